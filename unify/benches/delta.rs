//! Delta-store hot paths (issue 7). Numbers and the command are in `docs/performance.md`,
//! section "Micro-benchmarks".
//!
//! The input is a lineitem-shaped batch of [`ROWS`] rows built here (no generator
//! dependency): key (`Int64`, `Int32`), two more `Int64`, four `Decimal128(15, 2)`, three
//! `Date32`, two one-character strings, two short strings and a 10–43 byte comment — 16
//! columns, about the shape and width of TPC-H lineitem.
//!
//! - `row_encode/apply_puts`: encode every row of the batch into a fresh delta (one bump
//!   allocation per row, key map install); throughput in rows.
//! - `row_encode/upsert_existing`: an upsert of 8,192 keys a delta of 524,288 rows holds (the
//!   bench workload's upsert): each install replaces a row in a key map and row blocks larger
//!   than the caches.
//! - `key_encode/encode_batch`: the `arrow-row` key bytes of the batch.
//! - `key_lookup/{hit,miss}`: [`DeltaStore::get`] of every key of the batch against a delta
//!   holding it (hit) or holding other keys (miss).
//! - `to_batches/{unsorted,sorted}`: rows → Arrow arrays in a batch block for a delta of
//!   [`DELTA_BATCHES`] × [`ROWS`] rows (the flush path sorts by key; the scan path does not);
//!   `to_batches/sorted_16k/{1,2}`: sorted, in 16,384-row batches, on 1 and 2 threads
//!   (`to_batches_parallel`, the flush's path).

use arrow_array::{ArrayRef, Date32Array, Decimal128Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gritdb_memctl::{Category, ControllerConfig, MemoryController};
use gritdb_unify::{DeltaStore, RowCodec, UnifyError};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

/// Rows per input batch (the peer workload's batch size).
const ROWS: usize = 8192;
/// Batches in the delta converted by `to_batches`.
const DELTA_BATCHES: usize = 8;

fn schema() -> Arc<Schema> {
    let dec = DataType::Decimal128(15, 2);
    Arc::new(Schema::new(vec![
        Field::new("orderkey", DataType::Int64, false),
        Field::new("partkey", DataType::Int64, false),
        Field::new("suppkey", DataType::Int64, false),
        Field::new("linenumber", DataType::Int32, false),
        Field::new("quantity", dec.clone(), false),
        Field::new("extendedprice", dec.clone(), false),
        Field::new("discount", dec.clone(), false),
        Field::new("tax", dec, false),
        Field::new("returnflag", DataType::Utf8, false),
        Field::new("linestatus", DataType::Utf8, false),
        Field::new("shipdate", DataType::Date32, false),
        Field::new("commitdate", DataType::Date32, false),
        Field::new("receiptdate", DataType::Date32, false),
        Field::new("shipinstruct", DataType::Utf8, false),
        Field::new("shipmode", DataType::Utf8, false),
        Field::new("comment", DataType::Utf8, true),
    ]))
}

/// Batch `b` of the input: orders `b * ROWS / 4 ..`, four lines each (keys never repeat
/// across batches).
fn batch(b: usize) -> RecordBatch {
    let n = ROWS;
    let order = |i: usize| ((b * n + i) / 4) as i64 + 1;
    let dec = |f: &dyn Fn(usize) -> i128| -> ArrayRef {
        Arc::new(Decimal128Array::from_iter_values((0..n).map(f)).with_precision_and_scale(15, 2).expect("valid decimal"))
    };
    let date = |k: i32| -> ArrayRef { Arc::new(Date32Array::from_iter_values((0..n).map(|i| 8000 + k + (i % 2500) as i32))) };
    let words = ["DELIVER IN PERSON", "COLLECT COD", "NONE", "TAKE BACK RETURN"];
    let modes = ["AIR", "REG AIR", "TRUCK", "MAIL", "SHIP", "RAIL", "FOB"];
    let comment =
        |i: usize| -> Option<String> { (!i.is_multiple_of(97)).then(|| "carefully final deposits sleep quickly among the"[..10 + (i * 7) % 34].to_owned()) };
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values((0..n).map(order))),
        Arc::new(Int64Array::from_iter_values((0..n).map(|i| (i * 7919 % 20_000) as i64))),
        Arc::new(Int64Array::from_iter_values((0..n).map(|i| (i * 31 % 1000) as i64))),
        Arc::new(Int32Array::from_iter_values((0..n).map(|i| ((b * n + i) % 4) as i32 + 1))),
        dec(&|i| (i % 50 + 1) as i128 * 100),
        dec(&|i| (i * 104_729 % 10_000_000) as i128),
        dec(&|i| (i % 11) as i128),
        dec(&|i| (i % 9) as i128),
        Arc::new(StringArray::from_iter_values((0..n).map(|i| ["A", "N", "R"][i % 3]))),
        Arc::new(StringArray::from_iter_values((0..n).map(|i| ["F", "O"][i % 2]))),
        date(0),
        date(30),
        date(60),
        Arc::new(StringArray::from_iter_values((0..n).map(|i| words[i % 4]))),
        Arc::new(StringArray::from_iter_values((0..n).map(|i| modes[i % 7]))),
        Arc::new((0..n).map(comment).collect::<StringArray>()),
    ];
    RecordBatch::try_new(schema(), cols).expect("valid batch")
}

fn controller() -> Arc<MemoryController> {
    MemoryController::new(ControllerConfig { memory_limit: Some(4 << 30), ..ControllerConfig::default() }).expect("valid config")
}

fn codec() -> Arc<RowCodec> {
    Arc::new(RowCodec::new(schema(), &[0, 3], 1 << 20).expect("supported schema"))
}

fn put(delta: &mut DeltaStore, b: &RecordBatch, seq: u64) {
    let keys = delta.codec().keys().encode_batch(b).expect("encodable keys");
    delta.apply_puts(b, &keys, seq, || Ok::<(), UnifyError>(())).expect("within the limit");
}

fn row_encode(c: &mut Criterion) {
    let ctl = controller();
    let codec = codec();
    let b = batch(0);
    let keys = codec.keys().encode_batch(&b).expect("encodable keys");
    let mut g = c.benchmark_group("row_encode");
    g.throughput(Throughput::Elements(ROWS as u64));
    g.bench_function("apply_puts", |bench| {
        bench.iter(|| {
            let mut d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
            d.apply_puts(&b, &keys, 1, || Ok::<(), UnifyError>(())).expect("within the limit");
            black_box(d.len())
        });
    });
    g.finish();
    let mut g = c.benchmark_group("key_encode");
    g.throughput(Throughput::Elements(ROWS as u64));
    g.bench_function("encode_batch", |bench| bench.iter(|| black_box(codec.keys().encode_batch(&b).expect("encodable keys").num_rows())));
    g.finish();
}

fn key_lookup(c: &mut Criterion) {
    let ctl = controller();
    let codec = codec();
    let (b0, b1) = (batch(0), batch(1));
    let mut d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
    put(&mut d, &b0, 1);
    let hits = codec.keys().encode_batch(&b0).expect("encodable keys");
    let misses = codec.keys().encode_batch(&b1).expect("encodable keys");
    let mut g = c.benchmark_group("key_lookup");
    g.throughput(Throughput::Elements(ROWS as u64));
    for (name, keys, want) in [("hit", &hits, ROWS), ("miss", &misses, 0)] {
        g.bench_function(name, |bench| {
            bench.iter(|| {
                let found = keys.iter().filter(|k| d.get(k.as_ref()).is_some()).count();
                assert_eq!(found, want);
                found
            });
        });
    }
    g.finish();
}

/// An upsert of one batch of keys a large delta already holds (the bench workload's upsert:
/// 64 batches, 524,288 rows, about SF 0.1's lineitem; every key of one batch replaced, a
/// different batch each iteration), so each row's install finds an existing entry in a key
/// map and row blocks far larger than the caches.
fn upsert_existing(c: &mut Criterion) {
    let ctl = controller();
    let mut d = DeltaStore::new(codec(), &ctl, None);
    let batches: Vec<RecordBatch> = (0..64).map(batch).collect();
    for (i, b) in batches.iter().enumerate() {
        put(&mut d, b, (i * ROWS) as u64 + 1);
    }
    let keys: Vec<_> = batches.iter().map(|b| d.codec().keys().encode_batch(b).expect("encodable keys")).collect();
    let mut seq = (64 * ROWS) as u64 + 1;
    let mut next = 0usize;
    let mut g = c.benchmark_group("row_encode");
    g.throughput(Throughput::Elements(ROWS as u64));
    g.bench_function("upsert_existing", |bench| {
        bench.iter(|| {
            // A different batch each time (every 23rd of 64, all in turn), so its entries and
            // rows are not in the caches from the iteration before.
            next = (next + 23) % 64;
            d.apply_puts(&batches[next], &keys[next], seq, || Ok::<(), UnifyError>(())).expect("within the limit");
            seq += ROWS as u64;
            assert_eq!(d.len(), 64 * ROWS);
        });
    });
    g.finish();
}

fn to_batches(c: &mut Criterion) {
    let ctl = controller();
    let mut d = DeltaStore::new(codec(), &ctl, None);
    for i in 0..DELTA_BATCHES {
        put(&mut d, &batch(i), (i * ROWS) as u64 + 1);
    }
    let rows = DELTA_BATCHES * ROWS;
    let mut g = c.benchmark_group("to_batches");
    g.throughput(Throughput::Elements(rows as u64));
    for sorted in [false, true] {
        let name = if sorted { "sorted" } else { "unsorted" };
        g.bench_with_input(BenchmarkId::from_parameter(name), &sorted, |bench, &sorted| {
            bench.iter(|| {
                let out = d.to_batches(Category::BatchBlocks, sorted, 64 << 10, 256 << 20, |_| true).expect("within the limit");
                let n: usize = out.puts.iter().map(RecordBatch::num_rows).sum();
                assert_eq!(n, rows);
                out
            });
        });
    }
    // The flush's parallel path: sorted, cut into 16,384-row batches, on 1 and 2 threads.
    for threads in [1usize, 2] {
        g.bench_with_input(BenchmarkId::new("sorted_16k", threads), &threads, |bench, &threads| {
            bench.iter(|| {
                let out = d.to_batches_parallel(Category::BatchBlocks, true, 16 << 10, 256 << 20, threads, |_| true).expect("within the limit");
                let n: usize = out.puts.iter().map(RecordBatch::num_rows).sum();
                assert_eq!(n, rows);
                out
            });
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default().sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500))
}

criterion_group! { name = benches; config = config(); targets = row_encode, upsert_existing, key_lookup, to_batches }
criterion_main!(benches);
