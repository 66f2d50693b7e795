//! The limit holds at every moment: ingest waits for the writer (backpressure) and completes
//! when the writer keeps up, and fails with a typed `MemoryLimit` (no hang, no panic) when the
//! writer cannot free memory. Failures injected at every reservation surface as typed errors
//! and lose no acknowledged row.

use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Error, ScanOptions};
use gritdb_tests::*;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn rows(thread: i64, batch: i64, n: i64) -> Vec<((i64, i32), Row)> {
    (0..n).map(|i| ((thread * 10_000_000 + batch * 10_000 + i, 0), (Some(i), Some("p".repeat(64))))).collect()
}

/// Samples `used <= limit` every millisecond until stopped; returns (samples, violations, max).
fn sampler(engine: Arc<Engine>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(usize, usize, usize)> {
    std::thread::spawn(move || {
        let (mut samples, mut bad, mut max) = (0, 0, 0);
        while !stop.load(Ordering::Acquire) {
            let (used, limit) = (engine.memory().used(), engine.memory().limit());
            samples += 1;
            max = max.max(used);
            if used > limit {
                bad += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        (samples, bad, max)
    })
}

#[test]
fn four_writers_under_32_mib_complete_by_backpressure() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 32 << 20;
    let engine = Arc::new(Engine::open(dir.path(), EngineConfig::default().memory_limit(limit)).unwrap());
    let tables: Vec<_> = (0..4).map(|i| engine.create_table(&format!("w{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let s = sampler(Arc::clone(&engine), Arc::clone(&stop));
    let batches = 60;
    std::thread::scope(|scope| {
        for (th, t) in tables.iter().enumerate() {
            scope.spawn(move || {
                for b in 0..batches {
                    t.insert(&composite_batch(&rows(th as i64, b, 2_000))).unwrap();
                }
            });
        }
    });
    stop.store(true, Ordering::Release);
    let (samples, bad, max) = s.join().unwrap();
    assert!(samples > 10, "the sampler ran ({samples} samples)");
    assert_eq!(bad, 0, "used exceeded the limit in {bad} of {samples} samples");
    assert!(max <= limit);
    // 4 x 60 x 2,000 rows x ~100 B is about 48 MiB: more than the limit, so flushes had to run.
    for t in &tables {
        assert_eq!(t.row_count().unwrap(), batches as u64 * 2_000);
        assert!(t.stats().unwrap().files > 0);
    }
}

#[test]
fn paused_writer_gives_a_typed_limit_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let limit = 32 << 20;
    let engine = Arc::new(
        Engine::open(dir.path(), EngineConfig::default().memory_limit(limit).backpressure_timeout(Duration::from_secs(2)).vfs(Arc::new(fs.clone()))).unwrap(),
    );
    let t = engine.create_table("w", composite_schema(), &["k1", "k2"]).unwrap();
    fs.stall_paths(".parquet");
    let stop = Arc::new(AtomicBool::new(false));
    let s = sampler(Arc::clone(&engine), Arc::clone(&stop));
    let start = Instant::now();
    let acked = AtomicUsize::new(0);
    let err = loop {
        match t.insert(&composite_batch(&rows(0, acked.load(Ordering::Relaxed) as i64, 2_000))) {
            Ok(_) => {
                acked.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => break e,
        }
        assert!(start.elapsed() < Duration::from_mins(1), "ingest neither finished nor failed");
    };
    stop.store(true, Ordering::Release);
    let (_, bad, _) = s.join().unwrap();
    assert_eq!(bad, 0);
    match &err {
        Error::MemoryLimit { limit: l, used, requested, top, .. } => {
            assert_eq!(*l, limit);
            assert!(*used <= limit && *requested > 0);
            assert!(top.iter().any(|c| c.name == "table:w"), "{top:?}");
        }
        other => panic!("expected MemoryLimit, got {other:?}"),
    }
    // Release the writer: everything acknowledged is there, and ingest works again.
    fs.heal();
    let n = acked.load(Ordering::Relaxed) as u64;
    t.flush().unwrap();
    assert_eq!(t.row_count().unwrap(), n * 2_000);
    t.insert(&composite_batch(&rows(1, 0, 10))).unwrap();
}

#[test]
fn thousand_tables_with_one_row_each_fit_a_small_limit() {
    let dir = tempfile::tempdir().unwrap();
    // 1,000 one-row deltas hold a 64 KiB chunk each (64 MiB): twice the limit. Pressure
    // flushes the largest deltas across all tables.
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(32 << 20)).unwrap();
    for i in 0..1000 {
        let t = engine.create_table(&format!("one{i}"), composite_schema(), &["k1", "k2"]).unwrap();
        t.insert(&composite_batch(&rows(i, 0, 1))).unwrap();
        assert!(engine.memory().used() <= 32 << 20);
    }
    for i in (0..1000).step_by(97) {
        assert_eq!(engine.table(&format!("one{i}")).unwrap().row_count().unwrap(), 1);
    }
}

#[test]
fn limit_error_text_is_pinned() {
    let e = Error::MemoryLimit {
        requested: 65536,
        used: 33_000_000,
        limit: 33_554_432,
        category: gritdb::memory::Category::RowBlocks,
        top: vec![
            gritdb::memory::Consumer { name: "category:row_blocks".into(), bytes: 30 << 20 },
            gritdb::memory::Consumer { name: "table:orders".into(), bytes: 29 << 20 },
        ],
    };
    assert_eq!(
        e.to_string(),
        "memory limit reached: requested 64.0 KiB for row_blocks, 31.5 MiB of 32.0 MiB in use; top consumers: \
         category:row_blocks 30.0 MiB, table:orders 29.0 MiB. Raise the limit (EngineConfig::memory_limit / \
         Engine::set_memory_limit) or ask for less at once (a smaller write or scan batch; at open, the tables' \
         key indexes must fit)"
    );
}

/// A scan refused for its file reader's buffers says what lowers them: the reader holds a
/// page and a dictionary per projected column of a row group whatever `batch_rows` is (a
/// trial's table of 100-byte strings, flushed at 64 MiB, then scanned at 2 MiB, was told to
/// use "a smaller write or scan batch", which changed nothing). Fewer columns do fit.
#[test]
fn a_scan_refused_for_its_readers_buffers_is_told_what_lowers_them() {
    use arrow::array::{Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20).backpressure_timeout(Duration::from_secs(1))).unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, true)]));
    let t = e.create_table("t", Arc::clone(&schema), &["k"]).unwrap();
    let n = 100_000i64;
    let s: StringArray = (0..n).map(|k| Some(format!("{k:0100}"))).collect();
    t.insert(&RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(0..n)), Arc::new(s)]).unwrap()).unwrap();
    t.flush().unwrap();
    e.set_memory_limit(2 << 20).unwrap();
    for rows in [16, 1024] {
        let err = t.scan(ScanOptions::default().batch_rows(rows)).and_then(Iterator::collect::<gritdb::Result<Vec<_>>>).unwrap_err();
        assert!(matches!(err, Error::MemoryLimit { category: gritdb::memory::Category::ScanBuffers, .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains("project fewer columns") && text.contains("however small the batch"), "{text}");
    }
    let (mut count, mut sum) = (0usize, 0i64);
    for b in t.scan(ScanOptions::default().projection(["k"])).unwrap() {
        let b = b.unwrap();
        count += b.num_rows();
        sum += b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().values().iter().sum::<i64>();
    }
    assert_eq!((count, sum), (n as usize, n * (n - 1) / 2), "the key column alone is read at 2 MiB");
}

/// Walks an injected allocation failure across a whole ingest + flush + scan run.
#[test]
fn injected_failure_at_every_reservation() {
    let mut n = 0u64;
    let mut failures_seen = 0;
    loop {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20).table_flush_bytes(256 << 10)).unwrap();
        let t = engine.create_table("f", composite_schema(), &["k1", "k2"]).unwrap();
        let mut model: BTreeMap<(i64, i32), Row> = BTreeMap::new();
        engine.memory().inject_failure_after(Some(n));
        let mut failed = false;
        let mut step = |r: gritdb::Result<()>| match r {
            Ok(()) => true,
            Err(e) => {
                assert!(matches!(e, Error::Memory(_) | Error::MemoryLimit { .. }), "step {n}: untyped failure {e:?}");
                failed = true;
                false
            }
        };
        for b in 0..6 {
            let r = rows(0, b, 700);
            if step(t.insert(&composite_batch(&r)).map(drop)) {
                model.extend(r);
            }
            if b == 3 {
                let keys: Vec<(i64, i32)> = rows(0, 1, 300).iter().map(|r| r.0).collect();
                if step(t.delete(&composite_keys(&keys)).map(drop)) {
                    for k in &keys {
                        model.remove(k);
                    }
                }
            }
        }
        step(t.flush().map(drop));
        step(t.scan(ScanOptions::default()).and_then(std::iter::Iterator::collect::<gritdb::Result<Vec<_>>>).map(drop));
        engine.memory().inject_failure_after(None);
        // Usable afterwards, nothing acknowledged lost.
        t.flush().unwrap();
        assert_eq!(collect_composite(t.scan(ScanOptions::default()).unwrap()), model, "step {n}");
        drop(t);
        engine.close().unwrap();
        let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
        assert_eq!(collect_composite(engine.table("f").unwrap().scan(ScanOptions::default()).unwrap()), model, "step {n} after reopen");
        if failed {
            failures_seen += 1;
        } else if n > 40 {
            break;
        }
        n += 1;
        assert!(n < 5_000, "the walk must end");
    }
    assert!(failures_seen > 10, "{failures_seen} injected failures surfaced");
}
