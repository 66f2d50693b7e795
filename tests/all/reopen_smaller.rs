//! A data directory written under a large memory limit and reopened under a much smaller
//! one: replay must leave the table scannable, writable and flushable at the new limit,
//! whatever the table's width (view, large and plain strings and binaries).

use arrow::array::{AsArray, BinaryArray, BinaryViewArray, Int64Array, LargeBinaryArray, LargeStringArray, RecordBatch, StringArray, StringViewArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig, ScanOptions};
use std::sync::Arc;
use std::time::Duration;

fn wide_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("sv", DataType::Utf8View, true),
        Field::new("bv", DataType::BinaryView, true),
        Field::new("ls", DataType::LargeUtf8, true),
        Field::new("lb", DataType::LargeBinary, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("b", DataType::Binary, true),
    ]))
}

fn text(k: i64, col: u8) -> String {
    format!("{col}-{k:012}-{}", "x".repeat(((k * 7 + i64::from(col)) % 40) as usize))
}

fn wide_batch(keys: std::ops::Range<i64>) -> RecordBatch {
    let ks: Vec<i64> = keys.collect();
    let t = |c: u8| ks.iter().map(move |&k| text(k, c)).collect::<Vec<_>>();
    RecordBatch::try_new(
        wide_schema(),
        vec![
            Arc::new(Int64Array::from(ks.clone())),
            Arc::new(StringViewArray::from_iter_values(t(1))),
            Arc::new(BinaryViewArray::from_iter_values(t(2))),
            Arc::new(LargeStringArray::from_iter_values(t(3))),
            Arc::new(LargeBinaryArray::from_iter_values(t(4))),
            Arc::new(StringArray::from_iter_values(t(5))),
            Arc::new(BinaryArray::from_iter_values(t(6))),
        ],
    )
    .unwrap()
}

/// Rows and the sum of keys and of `s`'s lengths, from a full scan.
fn totals(t: &gritdb::Table) -> (usize, i64, usize) {
    let (mut rows, mut keys, mut len) = (0, 0, 0);
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        rows += b.num_rows();
        keys += b.column(0).as_primitive::<Int64Type>().values().iter().sum::<i64>();
        len += b.column(5).as_string::<i32>().iter().map(|s| s.unwrap().len()).sum::<usize>();
    }
    (rows, keys, len)
}

fn expected(n: i64) -> (usize, i64, usize) {
    (n as usize, (0..n).sum(), (0..n).map(|k| text(k, 5).len()).sum())
}

#[test]
fn wide_table_written_large_reopened_small_scans_and_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let n = 60_000;
    {
        let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(64 << 20).flush_age(Duration::from_hours(1));
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.create_table("w", wide_schema(), &["k"]).unwrap();
        for at in (0..n).step_by(5_000) {
            t.insert(&wide_batch(at..(at + 5_000).min(n))).unwrap();
        }
        assert_eq!(totals(&t), expected(n));
        drop(t);
        drop(engine); // no close: the rows are in the write-ahead log only
    }
    for limit in [8 << 20, 12 << 20, 16 << 20] {
        let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(limit)).unwrap();
        let t = engine.table("w").unwrap();
        assert_eq!(totals(&t), expected(n), "limit {limit}: scan after replay");
        assert!(engine.memory().used() <= limit, "limit {limit}: {} used", engine.memory().used());
        t.upsert(&wide_batch(0..1_000)).unwrap();
        t.flush().unwrap();
        assert_eq!(totals(&t), expected(n), "limit {limit}: after a flush");
        drop(t);
        drop(engine);
    }
}

/// Two wide tables whose log records interleave, reopened at 8 MiB: replay flushes the larger
/// table's deltas as it goes, so both can be scanned, written and flushed.
#[test]
fn two_tables_interleaved_replayed_under_a_small_limit() {
    let dir = tempfile::tempdir().unwrap();
    let n = 40_000;
    {
        let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(64 << 20).flush_age(Duration::from_hours(1));
        let engine = Engine::open(dir.path(), config).unwrap();
        let a = engine.create_table("a", wide_schema(), &["k"]).unwrap();
        let b = engine.create_table("b", wide_schema(), &["k"]).unwrap();
        for at in (0..n).step_by(4_000) {
            a.insert(&wide_batch(at..at + 4_000)).unwrap();
            b.insert(&wide_batch(at..at + 4_000)).unwrap();
        }
        drop((a, b));
        drop(engine);
    }
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(8 << 20)).unwrap();
    for name in ["a", "b"] {
        let t = engine.table(name).unwrap();
        assert_eq!(totals(&t), expected(n), "{name}");
        t.delete(
            &RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])), vec![Arc::new(Int64Array::from(vec![0, 1, 2]))])
                .unwrap(),
        )
        .unwrap();
        t.flush().unwrap();
        let (rows, keys, _) = totals(&t);
        assert_eq!((rows, keys), (n as usize - 3, (3..n).sum::<i64>()), "{name} after deletes and a flush");
    }
    engine.close().unwrap();
}

/// Wide batches of ~1.5 MB written straight into an 8 MiB engine: backpressure and flushes
/// keep up, and every row is there after a flush and a reopen at the same limit.
#[test]
fn wide_batches_written_under_a_small_limit() {
    let dir = tempfile::tempdir().unwrap();
    let n = 60_000;
    let config = || EngineConfig::default().memory_limit(8 << 20).flush_age(Duration::from_hours(1));
    {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.create_table("w", wide_schema(), &["k"]).unwrap();
        for at in (0..n).step_by(5_000) {
            t.insert(&wide_batch(at..at + 5_000)).unwrap();
            assert!(engine.memory().used() <= 8 << 20);
        }
        assert_eq!(totals(&t), expected(n));
        t.flush().unwrap();
        assert_eq!(totals(&t), expected(n));
        drop(t);
        drop(engine);
    }
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(totals(&engine.table("w").unwrap()), expected(n));
    engine.close().unwrap();
}

/// The limit lowered at run time from 256 MiB to 8 MiB over a 60,000-row wide delta: the call
/// flushes down to it, and the table is scanned and flushed at the new limit.
#[test]
fn wide_delta_then_limit_lowered_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let n = 60_000;
    let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(64 << 20).flush_age(Duration::from_hours(1));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("w", wide_schema(), &["k"]).unwrap();
    for at in (0..n).step_by(5_000) {
        t.insert(&wide_batch(at..at + 5_000)).unwrap();
    }
    engine.set_memory_limit(8 << 20).unwrap();
    assert!(engine.memory().used() <= 8 << 20, "{}", engine.memory().used());
    assert_eq!(totals(&t), expected(n));
    t.upsert(&wide_batch(100..3_100)).unwrap();
    t.flush().unwrap();
    assert_eq!(totals(&t), expected(n));
    drop(t);
    engine.close().unwrap();
}

/// One 60,000-row put record and one 20,000-key delete record, each far larger than an
/// 8 MiB engine's flush threshold: replay applies them in slices and flushes between slices,
/// so `flushed_seq` lands inside a record. Crashing right after that open and reopening
/// (small, then large) resumes after the committed part: every row once, no deleted row back.
#[test]
fn records_replayed_in_slices_resume_after_a_crash_mid_record() {
    let dir = tempfile::tempdir().unwrap();
    let n = 60_000_i64;
    let dels: Vec<i64> = (0..n).filter(|k| k % 3 == 0).collect();
    let keys_batch = |ks: &[i64]| {
        RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])), vec![Arc::new(Int64Array::from(ks.to_vec()))]).unwrap()
    };
    {
        let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(64 << 20).flush_age(Duration::from_hours(1));
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.create_table("w", wide_schema(), &["k"]).unwrap();
        t.insert(&wide_batch(0..n)).unwrap(); // one record
        assert_eq!(t.delete(&keys_batch(&dels)).unwrap(), dels.len()); // one record
        drop(t);
        drop(engine);
    }
    let want_rows = (n as usize) - dels.len();
    let want_keys: i64 = (0..n).filter(|k| k % 3 != 0).sum();
    let small = || EngineConfig::default().memory_limit(8 << 20).flush_age(Duration::from_hours(1));
    for (round, config) in [small(), small(), EngineConfig::default().memory_limit(256 << 20)].into_iter().enumerate() {
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.table("w").unwrap();
        let stats = t.stats().unwrap();
        if round == 0 {
            assert!(stats.files > 0, "replay flushed between slices: {stats:?}");
        }
        let (rows, keys, _) = totals(&t);
        assert_eq!((rows, keys), (want_rows, want_keys), "round {round}");
        drop(t);
        drop(engine); // no close: what replay did not flush is replayed again
    }
}
