//! Breaker pass 8: the write gate of e4d27a7 (`EngineInner::begin_write` / `shutdown`), the WAL
//! record pool's cancel path and relaxed inline appends, attacked with engine drop while writes
//! are stalled in the WAL, blocked in backpressure or racing from many threads, a user flush
//! spanning drop + reopen, scans held across writes and drop, and refused big writes racing
//! their record task. Every potential hang runs on a thread bounded by `recv_timeout`.

use crate::breaker_walpool7::{BIG, Model, config, contents, rows, write_buffers};
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Error, ScanOptions, Table, WalSync};
use gritdb_tests::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// An engine on `dir` over the fault layer `fs` (PerBatch) with a new composite-key table `t`.
fn open_faulty(dir: &std::path::Path, fs: &FaultFs) -> (Engine, Table) {
    let engine = Engine::open(dir, config(WalSync::PerBatch).vfs(Arc::new(fs.clone()))).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    (engine, t)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Runs `f` on its own thread; `None` when it did not return within `ms`.
fn within<T: Send + 'static>(ms: u64, f: impl FnOnce() -> T + Send + 'static) -> (Option<T>, mpsc::Receiver<T>) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    let got = rx.recv_timeout(Duration::from_millis(ms)).ok();
    (got, rx)
}

fn is_closed<T: std::fmt::Debug>(r: &gritdb::Result<T>) -> bool {
    matches!(r, Err(Error::Closed(_)))
}

// ------------------------------------------------ drop while the WAL is stalled

/// A small and a big write are stuck in a stalled WAL (PerBatch) while the engine is dropped on
/// another thread: the drop waits for them (by design), returns once another thread heals the
/// disk, both writes are acknowledged and present after reopen, and the held handle then
/// returns `Closed`.
#[test]
fn drop_waits_for_writes_in_a_stalled_wal_and_returns_after_heal() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let (engine, t) = open_faulty(dir.path(), &fs);
    t.insert(&composite_batch(&rows(0, 10, 0))).unwrap();
    fs.stall_paths("wal-");
    let (t1, t2) = (t.clone(), t.clone());
    let small = std::thread::spawn(move || t1.insert(&composite_batch(&rows(100, 10, 1))));
    let big = std::thread::spawn(move || t2.insert(&composite_batch(&rows(10_000, 3 * BIG, 2))));
    wait_until("the WAL to stall", || fs.is_stalled());
    std::thread::sleep(Duration::from_millis(50));
    let (dropped, rx) = within(300, move || drop(engine));
    assert!(dropped.is_none(), "drop returned while an admitted write was stuck in the WAL");
    fs.heal();
    rx.recv_timeout(Duration::from_secs(3)).expect("drop still blocked 3 s after heal");
    assert_eq!(small.join().unwrap().unwrap(), 10);
    assert_eq!(big.join().unwrap().unwrap(), 3 * BIG as usize);
    assert!(is_closed(&t.insert(&composite_batch(&rows(50_000, 1, 3)))));
    drop(t);
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 20 + 3 * BIG as u64);
}

/// While a drop waits for a write stuck in a stalled WAL, a new write from a third thread (a
/// handle held past the drop) must return `Error::Closed` promptly: the engine is closed and
/// the write needs no disk. Observed: it blocks until the disk heals — `begin_write` takes
/// `write_gate.read()` before `check_open`, and std's RwLock queues readers behind the waiting
/// writer (`shutdown`'s `write_gate.write()`). A refused write (existing key) and a delete hang
/// the same way.
#[test]
fn write_after_close_returns_closed_while_drop_waits_on_stalled_wal() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let (engine, t) = open_faulty(dir.path(), &fs);
    let other = engine.create_table("o", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 10, 0))).unwrap();
    fs.stall_paths("wal-");
    let t1 = t.clone();
    let stuck = std::thread::spawn(move || t1.insert(&composite_batch(&rows(100, 10, 1))));
    wait_until("the WAL to stall", || fs.is_stalled());
    let (dropped, drop_rx) = within(200, move || drop(engine));
    assert!(dropped.is_none());
    // The engine is closed now (drop is inside shutdown, waiting on the gate).
    let o2 = other.clone();
    let (late, late_rx) = within(1_000, move || o2.insert(&composite_batch(&rows(0, 10, 9))));
    let t3 = t.clone();
    let (refused, refused_rx) = within(200, move || t3.insert(&composite_batch(&rows(0, 1, 9))));
    let heal_needed = late.is_none();
    fs.heal();
    drop_rx.recv_timeout(Duration::from_secs(3)).expect("drop blocked after heal");
    let late = late.or_else(|| late_rx.recv_timeout(Duration::from_secs(3)).ok()).unwrap();
    let refused = refused.or_else(|| refused_rx.recv_timeout(Duration::from_secs(3)).ok()).unwrap();
    assert_eq!(stuck.join().unwrap().unwrap(), 10);
    assert!(is_closed(&late), "{late:?}");
    assert!(is_closed(&refused), "{refused:?}");
    assert!(!heal_needed, "a write to a closed engine returned only after the stalled WAL healed");
}

// ------------------------------------------------ drop while writes wait for memory

/// Writers blocked in backpressure (a tiny limit, the data files stalled, a long
/// backpressure_timeout) give up with `Closed` within a second of the engine's drop; after heal
/// the drop returns and every acknowledged row, and no refused one, is there after reopen.
#[test]
fn backpressured_writers_give_up_with_closed_when_the_engine_drops() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let cfg = EngineConfig::default().memory_limit(8 << 20).wal_sync(WalSync::PerBatch).backpressure_timeout(Duration::from_secs(30)).vfs(Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), cfg).unwrap();
    let tables: Vec<Table> = (0..4).map(|i| engine.create_table(&format!("t{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    fs.stall_paths(".parquet");
    let go = Arc::new(AtomicBool::new(true));
    let writers: Vec<_> = tables
        .iter()
        .enumerate()
        .map(|(th, t)| {
            let (t, go) = (t.clone(), Arc::clone(&go));
            std::thread::spawn(move || {
                let mut acked = Model::new();
                let mut b = 0i64;
                loop {
                    let r: Vec<_> = (b * 2_048..(b + 1) * 2_048).map(|k| ((k, 1), (Some(th as i64), Some(format!("{k:0>150}"))))).collect();
                    match t.insert(&composite_batch(&r)) {
                        Ok(n) => {
                            assert_eq!(n, 2_048);
                            acked.extend(r);
                        }
                        Err(e) => return (acked, e, Instant::now()),
                    }
                    b += 1;
                    if !go.load(Ordering::Acquire) && b > 1_000 {
                        unreachable!()
                    }
                }
            })
        })
        .collect();
    wait_until("the flush to stall", || fs.is_stalled());
    std::thread::sleep(Duration::from_millis(300));
    let (_, drop_rx) = within(0, move || drop(engine));
    let dropped_at = Instant::now();
    let start = Instant::now();
    while writers.iter().any(|w| !w.is_finished()) {
        assert!(start.elapsed() < Duration::from_secs(2), "backpressured writers did not give up after the drop");
        std::thread::sleep(Duration::from_millis(5));
    }
    let results: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    for (_, e, at) in &results {
        assert!(matches!(e, Error::Closed(_)), "{e:?}");
        assert!(at.duration_since(dropped_at) < Duration::from_secs(1));
    }
    fs.heal();
    drop_rx.recv_timeout(Duration::from_secs(4)).expect("drop blocked after heal");
    drop(tables);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    for (i, (acked, _, _)) in results.iter().enumerate() {
        let got = contents(&engine.table(&format!("t{i}")).unwrap());
        assert_eq!(got.len(), acked.len(), "t{i}");
        assert!(got == *acked, "t{i}");
    }
}

// ------------------------------------------------ many writers across drop

/// Sixteen threads write small and big batches (inserts, upserts, deletes) to two shared tables
/// and their own, holding handles past the engine's drop; after the drop every write returns
/// `Closed`, and reopen finds exactly the acknowledged effects, in both sync modes.
fn many_writers_across_drop(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    let tables: Vec<Table> = (0..16).map(|i| engine.create_table(&format!("t{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    let dropped = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(17));
    let hs: Vec<_> = tables
        .iter()
        .enumerate()
        .map(|(th, t)| {
            let (t, dropped, barrier) = (t.clone(), Arc::clone(&dropped), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let th = th as i64;
                let mut m = Model::new();
                barrier.wait();
                let mut i = 0i64;
                loop {
                    let n = if i % 3 == 0 { BIG + (mix((th * 97 + i) as u64) % 500) as i64 } else { 1 + i % 50 };
                    let from = (mix((th * 1_000 + i) as u64) % 20_000) as i64;
                    let r = rows(from, n, th * 10_000 + i);
                    let res = if i % 5 == 4 {
                        let ks: Vec<_> = r.iter().map(|(k, _)| *k).collect();
                        t.delete(&composite_keys(&ks)).map(|_| {
                            for k in &ks {
                                m.remove(k);
                            }
                        })
                    } else {
                        t.upsert(&composite_batch(&r)).map(|_| {
                            for (k, v) in &r {
                                m.insert(*k, v.clone());
                            }
                        })
                    };
                    match res {
                        Ok(()) => {}
                        Err(Error::Closed(_)) => {
                            // Every later write is refused too, at once.
                            let again = t.insert(&composite_batch(&rows(900_000, 1, 0)));
                            assert!(is_closed(&again), "{again:?}");
                            return (m, i);
                        }
                        Err(e) => panic!("thread {th}: {e:?}"),
                    }
                    i += 1;
                    assert!(i < 100_000 || !dropped.load(Ordering::Acquire));
                }
            })
        })
        .collect();
    barrier.wait();
    std::thread::sleep(Duration::from_millis(150));
    let (res, _rx) = within(3_000, move || drop(engine));
    assert!(res.is_some(), "{sync:?}: drop under many writers did not return in 3 s");
    dropped.store(true, Ordering::Release);
    let (joined, _rx) = within(3_000, move || hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>());
    let models = joined.expect("writers did not all see Closed within 3 s of the drop");
    drop(tables);
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    for (i, (m, writes)) in models.iter().enumerate() {
        assert!(*writes > 0, "{sync:?}: thread {i} wrote nothing");
        let got = contents(&engine.table(&format!("t{i}")).unwrap());
        assert_eq!(got.len(), m.len(), "{sync:?}: t{i} rows after {writes} writes");
        assert!(got == *m, "{sync:?}: t{i}");
    }
}

#[test]
fn many_writers_across_drop_keep_exactly_the_acknowledged_per_batch() {
    many_writers_across_drop(WalSync::PerBatch);
}

#[test]
fn many_writers_across_drop_keep_exactly_the_acknowledged_relaxed() {
    many_writers_across_drop(WalSync::Relaxed);
}

// ------------------------------------------------ scans held across writes and drop

/// A scan iterator partly consumed stays held while the same thread writes (small and big),
/// and while another thread drops the engine: nothing hangs, the scan either finishes with the
/// snapshot's rows or errs, and the writes are in the reopened engine.
#[test]
fn scan_held_across_writes_and_engine_drop() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 200_000, 0))).unwrap();
    let t2 = t.clone();
    let (res, _rx) = within(4_000, move || {
        let mut scan = t2.scan(ScanOptions::default()).unwrap();
        let first = scan.next().unwrap().unwrap().num_rows();
        t2.insert(&composite_batch(&rows(500_000, 10, 1))).unwrap();
        t2.upsert(&composite_batch(&rows(600_000, 2 * BIG, 1))).unwrap();
        t2.delete(&composite_keys(&[(0, 0)])).unwrap();
        (scan, first)
    });
    let (mut scan, first) = res.expect("a write while this thread held a scan hung");
    let (dropped, _rx) = within(3_000, move || drop(engine));
    assert!(dropped.is_some(), "drop with a scan held hung");
    let (rest, _rx) = within(3_000, move || {
        let mut n = 0usize;
        for b in scan.by_ref() {
            match b {
                Ok(b) => n += b.num_rows(),
                Err(_) => return None,
            }
        }
        Some(n)
    });
    if let Some(Some(n)) = rest {
        assert_eq!(first + n, 200_000, "the snapshot changed under the scan");
    } else {
        assert!(rest.is_some(), "the held scan hung after the drop");
    }
    assert!(is_closed(&t.insert(&composite_batch(&rows(700_000, 1, 1)))));
    drop(t);
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 200_000 + 10 + 2 * BIG as u64 - 1);
}

// ------------------------------------------------ user flush across drop and reopen

/// A user `Table::flush` stalled in its data file write spans the engine's drop (which does not
/// wait for it) and a reopen that flushes new rows; after heal the old flush must not commit
/// into the directory the new engine owns. Everything acknowledged by both engines must survive
/// a final reopen.
#[test]
fn user_flush_stalled_across_drop_and_reopen_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let (engine, t) = open_faulty(dir.path(), &fs);
    let mut m = Model::new();
    let a = rows(0, 5_000, 1);
    t.insert(&composite_batch(&a)).unwrap();
    m.extend(a);
    fs.stall_paths(".parquet");
    let t1 = t.clone();
    let flusher = std::thread::spawn(move || t1.flush());
    wait_until("the flush to stall", || fs.is_stalled());
    let (dropped, _rx) = within(3_000, move || drop(engine));
    assert!(dropped.is_some(), "drop waited for a user flush stuck in the file layer");
    // A new engine (its own, healthy file layer) owns the directory now.
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    let t2 = engine.table("t").unwrap();
    let b = rows(10_000, 5_000, 2);
    t2.insert(&composite_batch(&b)).unwrap();
    m.extend(b);
    t2.flush().unwrap();
    fs.heal();
    let (res, _rx) = within(3_000, move || flusher.join().unwrap());
    let res = res.expect("the old flush hung after heal");
    let c = rows(20_000, 10, 3);
    t2.insert(&composite_batch(&c)).unwrap();
    m.extend(c);
    t2.flush().unwrap();
    drop(t2);
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    let got = contents(&engine.table("t").unwrap());
    assert_eq!(got.len(), m.len(), "rows after the final reopen (old flush returned {res:?})");
    assert!(got == m, "contents differ (old flush returned {res:?})");
}

// ------------------------------------------------ cancel race

/// Eight threads issue big writes refused for a key (the record is handed to the pool and
/// cancelled or dropped) while eight others land big upserts on other tables, so pool threads
/// are taking tasks at the moment refusals cancel theirs. Afterwards `write_buffers` is back at
/// its baseline, the WAL grew by exactly what the successful writes need (checked by replay),
/// and the refused table's WAL bytes did not change while only refusals ran.
#[test]
fn refused_big_writes_racing_pool_pickup_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    let x = engine.create_table("x", composite_schema(), &["k1", "k2"]).unwrap();
    x.insert(&composite_batch(&rows(0, 2 * BIG, 0))).unwrap();
    let live_x = contents(&x);
    let base = write_buffers(&engine);
    let wal0 = engine.wal_usage();
    // Refusals alone: WAL and buffers unchanged.
    std::thread::scope(|s| {
        for th in 0..8i64 {
            let x = &x;
            s.spawn(move || {
                for j in 0..6 {
                    let e = x.insert(&composite_batch(&rows((th + j) % 3, BIG + th, th))).unwrap_err();
                    assert!(matches!(e, Error::KeyExists { row: 0, .. }), "{e:?}");
                }
            });
        }
    });
    assert_eq!(write_buffers(&engine), base);
    assert_eq!(engine.wal_usage(), wal0, "refused writes reached the WAL");
    let others: Vec<Table> = (0..8).map(|i| engine.create_table(&format!("o{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    let models: Vec<Model> = std::thread::scope(|s| {
        for th in 0..8i64 {
            let x = &x;
            s.spawn(move || {
                for j in 0..6 {
                    let e = x.update(&composite_batch(&rows(2 * BIG - 5 + j, BIG, th))).unwrap_err();
                    assert!(matches!(e, Error::KeyNotFound { .. }), "{e:?}");
                }
            });
        }
        let hs: Vec<_> = others
            .iter()
            .enumerate()
            .map(|(i, o)| {
                s.spawn(move || {
                    let mut m = Model::new();
                    for j in 0..4i64 {
                        let r = rows(j * 700, BIG + j, i as i64);
                        o.upsert(&composite_batch(&r)).unwrap();
                        m.extend(r);
                    }
                    m
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(write_buffers(&engine), base, "record bytes left after the race");
    assert!(contents(&x) == live_x);
    drop(others);
    drop(x);
    drop(engine);
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    assert!(contents(&engine.table("x").unwrap()) == live_x, "x after replay");
    for (i, m) in models.iter().enumerate() {
        assert!(contents(&engine.table(&format!("o{i}")).unwrap()) == *m, "o{i} after replay");
    }
}
