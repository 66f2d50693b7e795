//! Storage hot paths (issue 7). Numbers and the command are in `docs/performance.md`, section
//! "Micro-benchmarks".
//!
//! - `key_index/{hit,miss}`: [`TableStore::find_key`] (bloom filter, then binary search of a
//!   file's sorted keys) for [`LOOKUPS`] keys against a table of [`FILES`] staged files of
//!   [`FILE_ROWS`] rows each, keys `(Int64, Int32)`; hits spread over all files, misses fall
//!   between existing keys.
//! - `wal_append/{relaxed,per_batch}`: [`Wal::append`] of a 1,024-row, 6-column batch (Arrow
//!   IPC encode, checksum, one write; `per_batch` adds the fsync, so it measures the disk of
//!   the machine more than the code). Segments are truncated every 64 appends so the bench
//!   does not fill the disk.
//! - `wal_encode/views`: [`Wal::encode_record`] alone of an 8,192-row batch shaped like the
//!   bench's lineitem rows as they reach the log: `Utf8View` strings (short inline values and
//!   27–43-byte buffer values) and `Decimal128(15, 2)` columns, both logged compact (offsets,
//!   `Decimal64`), beside `Int64` keys.

use arrow_array::{ArrayRef, Date32Array, Decimal128Array, Int32Array, Int64Array, RecordBatch, StringArray, StringViewArray};
use arrow_row::{RowConverter, SortField};
use arrow_schema::{DataType, Field, Schema};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gritdb_memctl::{ControllerConfig, MemoryController};
use gritdb_storage::{StdFs, TableStore, Vfs, Wal, WalOp, WalSync};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FILES: usize = 8;
const FILE_ROWS: usize = 65_536;
const LOOKUPS: usize = 8192;
const WAL_ROWS: usize = 1024;

fn controller() -> Arc<MemoryController> {
    MemoryController::new(ControllerConfig { memory_limit: Some(4 << 30), ..ControllerConfig::default() }).expect("valid config")
}

fn schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("orderkey", DataType::Int64, false),
        Field::new("linenumber", DataType::Int32, false),
        Field::new("partkey", DataType::Int64, false),
        Field::new("price", DataType::Decimal128(15, 2), false),
        Field::new("shipdate", DataType::Date32, false),
        Field::new("comment", DataType::Utf8, false),
    ]))
}

/// Rows with order keys `2 * first, 2 * (first + 1), ...` (even, so odd keys miss), line 1.
fn batch(first: usize, n: usize) -> RecordBatch {
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((first..first + n).map(|i| 2 * i as i64))),
        Arc::new(Int32Array::from_iter_values((0..n).map(|_| 1))),
        Arc::new(Int64Array::from_iter_values((0..n).map(|i| (i * 7919 % 20_000) as i64))),
        Arc::new(Decimal128Array::from_iter_values((0..n).map(|i| (i * 104_729 % 10_000_000) as i128)).with_precision_and_scale(15, 2).expect("valid decimal")),
        Arc::new(Date32Array::from_iter_values((0..n).map(|i| 8000 + (i % 2500) as i32))),
        Arc::new(StringArray::from_iter_values((0..n).map(|i| &"carefully final deposits sleep quickly among the"[..10 + (i * 7) % 34]))),
    ];
    RecordBatch::try_new(schema(), cols).expect("valid batch")
}

fn key_index(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ctl = controller();
    let vfs: Arc<dyn Vfs> = Arc::new(StdFs);
    let mut store = TableStore::create(vfs, &dir.path().join("t"), "t", schema(), &[0, 1], &ctl, None).expect("create table");
    let schema = schema();
    let key_schema = Arc::new(Schema::new(vec![schema.field(0).clone(), schema.field(1).clone()]));
    for f in 0..FILES {
        let b = batch(f * FILE_ROWS, FILE_ROWS);
        store.stage(&[b], &RecordBatch::new_empty(Arc::clone(&key_schema)), f as u64 + 1).expect("stage");
    }
    let conv = RowConverter::new(vec![SortField::new(DataType::Int64), SortField::new(DataType::Int32)]).expect("key types");
    let keys = |odd: i64| {
        let total = FILES * FILE_ROWS;
        let order = Int64Array::from_iter_values((0..LOOKUPS).map(|i| 2 * ((i * 7919) % total) as i64 + odd));
        let line = Int32Array::from_iter_values((0..LOOKUPS).map(|_| 1));
        conv.convert_columns(&[Arc::new(order) as ArrayRef, Arc::new(line)]).expect("encodable")
    };
    let (hits, misses) = (keys(0), keys(1));
    let mut g = c.benchmark_group("key_index");
    g.throughput(Throughput::Elements(LOOKUPS as u64));
    for (name, keys, want) in [("hit", &hits, LOOKUPS), ("miss", &misses, 0)] {
        g.bench_function(name, |bench| {
            bench.iter(|| {
                let found = keys.iter().filter(|k| store.find_key(k.as_ref()).is_some()).count();
                assert_eq!(found, want);
                found
            });
        });
    }
    g.finish();
}

fn wal_append(c: &mut Criterion) {
    let b = batch(0, WAL_ROWS);
    let mut g = c.benchmark_group("wal_append");
    g.throughput(Throughput::Elements(WAL_ROWS as u64));
    for (name, sync) in [("relaxed", WalSync::Relaxed), ("per_batch", WalSync::PerBatch)] {
        let dir = tempfile::tempdir().expect("temp dir");
        let ctl = controller();
        let wal = Wal::open(dir.path(), Arc::new(StdFs), sync, &ctl, |_| Ok::<(), gritdb_storage::StorageError>(())).expect("open wal");
        let mut seq = 1u64;
        g.bench_function(name, |bench| {
            bench.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for i in 0..iters {
                    let t = Instant::now();
                    wal.append(WalOp::Put, 1, seq, seq + WAL_ROWS as u64 - 1, &b).expect("append");
                    spent += t.elapsed();
                    seq += WAL_ROWS as u64;
                    if i % 64 == 63 {
                        wal.sync().expect("sync");
                        wal.truncate(|_, _| true);
                    }
                }
                spent
            });
        });
        wal.sync().expect("sync");
        wal.truncate(|_, _| true);
    }
    g.finish();
}

fn wal_encode(c: &mut Criterion) {
    const ROWS: usize = 8192;
    let schema = Arc::new(Schema::new(vec![
        Field::new("orderkey", DataType::Int64, false),
        Field::new("quantity", DataType::Decimal128(15, 2), false),
        Field::new("price", DataType::Decimal128(15, 2), false),
        Field::new("flag", DataType::Utf8View, false),
        Field::new("mode", DataType::Utf8View, false),
        Field::new("comment", DataType::Utf8View, false),
    ]));
    let text = "carefully final deposits sleep quickly among the furiously ironic";
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((0..ROWS).map(|i| i as i64))),
        Arc::new(Decimal128Array::from_iter_values((0..ROWS).map(|i| (i % 50) as i128 * 100)).with_precision_and_scale(15, 2).expect("valid decimal")),
        Arc::new(
            Decimal128Array::from_iter_values((0..ROWS).map(|i| (i * 104_729 % 10_000_000) as i128)).with_precision_and_scale(15, 2).expect("valid decimal"),
        ),
        Arc::new(StringViewArray::from_iter_values((0..ROWS).map(|i| ["A", "N", "R"][i % 3]))),
        Arc::new(StringViewArray::from_iter_values((0..ROWS).map(|i| ["TRUCK", "MAIL", "REG AIR", "FOB"][i % 4]))),
        Arc::new(StringViewArray::from_iter_values((0..ROWS).map(|i| &text[..27 + i % 17]))),
    ];
    let b = RecordBatch::try_new(schema, cols).expect("valid batch");
    let dir = tempfile::tempdir().expect("temp dir");
    let ctl = controller();
    let wal = Wal::open(dir.path(), Arc::new(StdFs), WalSync::Relaxed, &ctl, |_| Ok::<(), gritdb_storage::StorageError>(())).expect("open wal");
    let mut g = c.benchmark_group("wal_encode");
    g.throughput(Throughput::Elements(ROWS as u64));
    g.bench_function("views", |bench| bench.iter(|| wal.encode_record(WalOp::Put, &b).expect("encode")));
    g.finish();
}

fn config() -> Criterion {
    Criterion::default().sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500))
}

criterion_group! { name = benches; config = config(); targets = key_index, wal_append, wal_encode }
criterion_main!(benches);
