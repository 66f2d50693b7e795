//! A big write beside busy small writers is admitted in its turn (first come, first served),
//! not starved until its `backpressure_timeout` while the small writes that came after it keep
//! passing the soft limit (fresh-clone trial of 2026-12-06, probe B: writes of 20-150% of the
//! soft limit beside two busy writers were refused after the whole 3 s timeout).

use arrow::array::{Int32Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig, Error, ScanOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("id", DataType::Int32, false), Field::new("s", DataType::Utf8, false)]))
}

/// Rows of `width`-byte strings keyed by `ids`.
fn batch(ids: &[i32], width: usize) -> RecordBatch {
    let s: Vec<String> = ids.iter().map(|i| format!("{i:0>width$}")).collect();
    RecordBatch::try_new(schema(), vec![Arc::new(Int32Array::from(ids.to_vec())), Arc::new(StringArray::from(s))]).unwrap()
}

fn rows(t: &gritdb::Table) -> usize {
    t.scan(ScanOptions::default()).unwrap().map(|b| b.unwrap().num_rows()).sum()
}

/// At an 8 MiB limit (soft limit 6 MiB), four threads upsert 200 KB batches (100 rows of
/// 2,000-byte strings, over 10,000 keys each, so the key indexes stay small) into their own
/// tables without pause, while a fifth inserts five 1.6 MB batches (1,000 rows; peak ~3.3 MB,
/// half the soft limit) one after another, each given 20 s. Every big write must be admitted:
/// the small writes that arrive while it waits queue behind it instead of keeping the memory
/// in use at the soft limit. Before the queue all five waited out their 20 s and were refused
/// (2026-12-06); with it each took 10-50 ms.
#[test]
fn a_big_write_beside_busy_small_writers_is_admitted_in_its_turn() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 8 * MIB;
    let config = EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(20));
    let engine = Engine::open(dir.path(), config).unwrap();
    let big_table = engine.create_table("big", schema(), &["id"]).unwrap();
    let stop = AtomicBool::new(false);
    let (results, small) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let t = engine.create_table(&format!("w{w}"), schema(), &["id"]).unwrap();
                let stop = &stop;
                s.spawn(move || {
                    let (mut written, mut refused, mut next) = (0usize, 0usize, 0i32);
                    while !stop.load(Ordering::Relaxed) {
                        let n = 100;
                        let ids: Vec<i32> = (next..next + n).collect();
                        next = (next + n) % 10_000;
                        match t.upsert(&batch(&ids, 2000)) {
                            Ok(k) => written += k,
                            Err(Error::MemoryLimit { .. }) => refused += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                    (t, written, refused)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let mut results = Vec::new();
        for round in 0..5 {
            let ids: Vec<i32> = (round * 1000..round * 1000 + 1000).collect();
            let b = batch(&ids, 1600);
            let started = Instant::now();
            results.push((big_table.insert(&b), started.elapsed()));
        }
        stop.store(true, Ordering::Relaxed);
        let small: Vec<_> = writers.into_iter().map(|h| h.join().unwrap()).collect();
        (results, small)
    });
    for (t, written, refused) in &small {
        assert_eq!(rows(t), (*written).min(10_000));
        eprintln!("small writer: {written} rows, {refused} refused");
    }
    for (r, took) in &results {
        eprintln!("big write: {:?} in {took:?}", r.as_ref().map_err(ToString::to_string));
    }
    let admitted = results.iter().filter(|(r, _)| r.is_ok()).count();
    assert_eq!(admitted, 5, "{results:?}");
    assert_eq!(rows(&big_table), 5000);
    engine.close().unwrap();
}

/// Inserts 100-row batches of 2,000-byte strings into `t` until the engine holds more than
/// `bytes`; returns the rows written.
fn fill(engine: &Engine, t: &gritdb::Table, bytes: usize) -> usize {
    let mut next = 0i32;
    while engine.memory().used() < bytes {
        let ids: Vec<i32> = (next..next + 100).collect();
        t.insert(&batch(&ids, 2000)).unwrap();
        next += 100;
    }
    next as usize
}

/// A write waiting for memory when its table is dropped returns `TableNotFound` within a
/// wait step (100 ms), not `MemoryLimit` after its whole `backpressure_timeout`: before, the
/// soft-limit wait never looked at the table, so the write kept its place in the queue (its
/// peak counted ahead of every later write, to any table) for the 20 s, then reported the
/// wrong error. The data files are stalled, so nothing frees memory meanwhile.
#[test]
fn a_write_waiting_for_memory_when_its_table_is_dropped_returns_table_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let fs = gritdb::vfs::FaultFs::new();
    let limit = 16 * MIB;
    let timeout = Duration::from_secs(20);
    let config = EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(timeout).vfs(Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), config).unwrap();
    let a = engine.create_table("a", schema(), &["id"]).unwrap();
    let b = engine.create_table("b", schema(), &["id"]).unwrap();
    fs.stall_paths(".parquet");
    let written = fill(&engine, &b, limit / 2);
    // 3,000 rows of 1,000-byte strings: ~3 MB of Arrow bytes, a peak of ~6.3 MB, which does
    // not fit beside b's 8 MiB under the soft limit; it waits.
    let ids: Vec<i32> = (0..3000).collect();
    let big = batch(&ids, 1000);
    let (result, took) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let started = Instant::now();
            let r = a.insert(&big);
            (r, started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(500));
        engine.drop_table("a").unwrap();
        h.join().unwrap()
    });
    assert!(matches!(&result, Err(Error::TableNotFound { name }) if name == "a"), "{result:?}");
    assert!(took < timeout / 2, "the write waited {took:?} after its table was dropped");
    fs.heal();
    assert_eq!(rows(&b), written);
    engine.close().unwrap();
}

/// Writes that wait out their `backpressure_timeout` leave the queue with their error: three
/// big writes refused while the data files are stalled, then, once the disk is back, a write
/// of the same size is admitted and every acknowledged row is there. (A place left behind
/// would count its bytes ahead of every later write, and this write would be refused too.)
#[test]
fn writes_that_time_out_in_the_queue_leave_it() {
    let dir = tempfile::tempdir().unwrap();
    let fs = gritdb::vfs::FaultFs::new();
    let limit = 16 * MIB;
    let config =
        EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(1)).vfs(Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), config).unwrap();
    let b = engine.create_table("b", schema(), &["id"]).unwrap();
    let tables: Vec<_> = (0..3).map(|i| engine.create_table(&format!("t{i}"), schema(), &["id"]).unwrap()).collect();
    fs.stall_paths(".parquet");
    let written = fill(&engine, &b, limit / 2);
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = tables
            .iter()
            .map(|t| {
                s.spawn(move || {
                    let ids: Vec<i32> = (0..3000).collect();
                    t.insert(&batch(&ids, 1000))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &results {
        assert!(matches!(r, Err(Error::MemoryLimit { .. })), "{r:?}");
    }
    fs.heal();
    b.flush().unwrap();
    let ids: Vec<i32> = (0..3000).collect();
    tables[0].insert(&batch(&ids, 1000)).unwrap();
    assert_eq!(rows(&tables[0]), 3000);
    assert_eq!(rows(&tables[1]), 0);
    assert_eq!(rows(&b), written);
    engine.close().unwrap();
}

/// The same for a scan (and so an export, which reads through one): a `next()` waiting for
/// memory when its table is dropped returns `TableNotFound` within a wait step, and the scan
/// then ends (`None`). At 16 MiB, 40,000 rows of 1,000-byte strings in 8 files; the caller holds
/// the scan's batches until its next call waits (a worker thread makes the calls). Before, the
/// waiting call returned 9.3 s of the 10 s timeout after the drop, and the scan answered
/// `TableNotFound` once more before it ended (fresh-clone trial of 2026-12-06).
#[test]
fn a_scan_waiting_for_memory_when_its_table_is_dropped_ends_with_table_not_found() {
    use std::sync::mpsc;
    let dir = tempfile::tempdir().unwrap();
    let timeout = Duration::from_secs(20);
    let config = EngineConfig::default().memory_limit(16 * MIB).flush_age(Duration::from_secs(3600)).backpressure_timeout(timeout);
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("w", schema(), &["id"]).unwrap();
    for part in (0..40_000).collect::<Vec<i32>>().chunks(5_000) {
        t.insert(&batch(part, 1000)).unwrap();
        t.flush().unwrap();
    }
    let mut scan = t.scan(ScanOptions::default().batch_rows(2_000)).unwrap();
    let (ask, asked) = mpsc::channel::<()>();
    let (answer, answers) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        while asked.recv().is_ok() {
            let r = scan.next().map(|r| r.map_err(|e| (matches!(e, Error::TableNotFound { .. }), e.to_string())));
            if answer.send((r, Instant::now())).is_err() {
                break;
            }
        }
    });
    // Hold every batch until a call does not answer within 2 s: it waits for memory.
    let mut held = Vec::new();
    let waiting = loop {
        ask.send(()).unwrap();
        match answers.recv_timeout(Duration::from_secs(2)) {
            Ok((Some(Ok(b)), _)) => held.push(b),
            Ok((other, _)) => panic!("the scan ended before it waited: {other:?}"),
            Err(_) => break true,
        }
    };
    assert!(waiting && !held.is_empty());
    let dropped = Instant::now();
    engine.drop_table("w").unwrap();
    let (r, at) = answers.recv_timeout(timeout * 2).expect("the waiting call returned");
    let after = at.saturating_duration_since(dropped);
    assert!(matches!(&r, Some(Err((true, _)))), "{r:?}");
    assert!(after < timeout / 2, "the waiting call returned {after:?} after the drop");
    // The scan has ended, and lets go of everything it held once the batches go.
    ask.send(()).unwrap();
    assert!(answers.recv_timeout(timeout).unwrap().0.is_none());
    drop(held);
    drop(ask);
    worker.join().unwrap();
    drop(t);
    assert_eq!(engine.memory().category_bytes(gritdb::memory::Category::ScanBuffers), 0);
    engine.close().unwrap();
}
