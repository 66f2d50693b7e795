//! Breaker pass 7: the WAL records of big puts (1,024 rows or more) are encoded and appended on
//! the writer runtime's blocking pool (`PendingAppend`, commits 7145acb and 23f137c), in both
//! sync modes. (Since e4d27a7: on their own pool runtime, and PerBatch only; the relaxed
//! tests now check the inline path.) Attacked with more concurrent big writers than the pool has threads (one table
//! and many tables, with flushes, deletes, refused writes and drops in between), engine drop
//! while big writes are in flight, writes from inside tokio runtimes, refused writes
//! (`KeyExists`, `KeyNotFound`, `DuplicateKey`, `MemoryLimit`, WAL I/O failures) and the
//! `write_buffers` bytes they leave, backpressure at tiny limits, and the runtime's threads
//! after many open/write/close cycles. Every table is compared row for row with a model after
//! drop-without-close + reopen (WAL replay) and after close + reopen.

use gritdb::memory::Category;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Error, ScanOptions, Table, WalSync};
use gritdb_tests::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Two tests of one check that takes the WAL sync mode: `$per_batch` runs it with
/// `WalSync::PerBatch`, `$relaxed` with `WalSync::Relaxed`.
macro_rules! per_sync_mode {
    ($check:ident: $per_batch:ident, $relaxed:ident) => {
        #[test]
        fn $per_batch() {
            $check(WalSync::PerBatch);
        }

        #[test]
        fn $relaxed() {
            $check(WalSync::Relaxed);
        }
    };
}

pub(crate) type Model = BTreeMap<(i64, i32), Row>;

/// An engine on `dir` in `sync` mode with a new composite-key table `t`.
fn open_with_t(dir: &std::path::Path, sync: WalSync) -> (Engine, Table) {
    let engine = Engine::open(dir, config(sync)).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    (engine, t)
}

/// A composite-key table `shared` and four more, `t0`..`t3`, one per writer.
fn shared_and_own(engine: &Engine) -> (Table, Vec<Table>) {
    let shared = engine.create_table("shared", composite_schema(), &["k1", "k2"]).unwrap();
    let own = (0..4).map(|i| engine.create_table(&format!("t{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    (shared, own)
}

/// `OVERLAP_WAL_ROWS`: batches this big take the pool path.
pub(crate) const BIG: i64 = 1024;

pub(crate) fn rows(from: i64, n: i64, tag: i64) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, (k % 7) as i32), (Some(k * 1_000 + tag), Some(format!("k{k}-t{tag}"))))).collect()
}

fn keys(from: i64, n: i64) -> Vec<(i64, i32)> {
    (from..from + n).map(|k| (k, (k % 7) as i32)).collect()
}

fn apply(m: &mut Model, rows: &[((i64, i32), Row)]) {
    for (k, r) in rows {
        m.insert(*k, r.clone());
    }
}

pub(crate) fn contents(t: &Table) -> Model {
    collect_composite(t.scan(ScanOptions::default()).unwrap())
}

pub(crate) fn config(sync: WalSync) -> EngineConfig {
    EngineConfig::default().memory_limit(256 << 20).wal_sync(sync).flush_age(Duration::from_secs(3600))
}

pub(crate) fn write_buffers(e: &Engine) -> usize {
    e.memory().category_bytes(Category::WriteBuffers)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ------------------------------------------------ more big writers than pool threads

/// 72 tables, one thread each, all released at once: more big writes in flight than the
/// writer's blocking pool has threads (writer_threads 2 + 64), so records queue for a thread.
/// Each thread inserts, has a big insert refused (existing key in its last row), flushes (one
/// in nine), upserts over half its rows, deletes ten keys (the inline path, between two
/// pooled records), has a big update refused (a deleted key), updates, and one in twelve drops
/// its table. Contents match the model live, after drop-without-close + reopen (replay) and
/// after close + reopen; a reopened table takes new big writes and refuses an existing key.
fn more_writers_than_pool_threads(sync: WalSync) {
    const TABLES: usize = 72;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    let tables: Vec<Table> = (0..TABLES).map(|i| engine.create_table(&format!("t{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    let base = write_buffers(&engine);
    let barrier = Barrier::new(TABLES);
    let models: Vec<Option<Model>> = std::thread::scope(|s| {
        let hs: Vec<_> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (barrier, engine) = (&barrier, &engine);
                s.spawn(move || {
                    let i = i as i64;
                    let mut m = Model::new();
                    barrier.wait();
                    let a = rows(0, BIG, i);
                    assert_eq!(t.insert(&composite_batch(&a)).unwrap(), 1024);
                    apply(&mut m, &a);
                    let mut r = rows(5_000, BIG - 1, i);
                    r.extend(rows(1_023, 1, i));
                    let e = t.insert(&composite_batch(&r)).unwrap_err();
                    assert!(matches!(e, Error::KeyExists { row: 1_023, .. }), "{e:?}");
                    if i % 9 == 0 {
                        t.flush().unwrap();
                    }
                    let b = rows(512, 2_048, i + 100);
                    assert_eq!(t.upsert(&composite_batch(&b)).unwrap(), 2_048);
                    apply(&mut m, &b);
                    assert_eq!(t.delete(&composite_keys(&keys(600, 10))).unwrap(), 10);
                    for k in keys(600, 10) {
                        m.remove(&k);
                    }
                    let e = t.update(&composite_batch(&rows(0, 1_500, i + 200))).unwrap_err();
                    assert!(matches!(e, Error::KeyNotFound { row: 600, .. }), "{e:?}");
                    let c = rows(1_000, 1_500, i + 300);
                    assert_eq!(t.update(&composite_batch(&c)).unwrap(), 1_500);
                    apply(&mut m, &c);
                    if i % 12 == 5 {
                        engine.drop_table(&format!("t{i}")).unwrap();
                        return None;
                    }
                    Some(m)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(write_buffers(&engine), base, "{sync:?}: record buffers back after the burst");
    let expected: BTreeSet<String> = models.iter().enumerate().filter(|(_, m)| m.is_some()).map(|(i, _)| format!("t{i}")).collect();
    let check = |engine: &Engine, what: &str| {
        assert_eq!(engine.table_names().into_iter().collect::<BTreeSet<_>>(), expected, "{sync:?} {what}: tables");
        for (i, m) in models.iter().enumerate() {
            if let Some(m) = m {
                let got = contents(&engine.table(&format!("t{i}")).unwrap());
                assert_eq!(got.len(), m.len(), "{sync:?} {what}: t{i} rows");
                assert!(got == *m, "{sync:?} {what}: t{i} contents differ from the model");
            }
        }
    };
    check(&engine, "live");
    drop(tables);
    drop(engine);
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    check(&engine, "after replay");
    let t0 = engine.table("t0").unwrap();
    assert_eq!(t0.insert(&composite_batch(&rows(10_000, BIG, 7))).unwrap(), 1024);
    let e = t0.insert(&composite_batch(&rows(9_000, BIG + 1, 7))).unwrap_err();
    assert!(matches!(e, Error::KeyExists { row: 1_000, .. }), "{e:?}");
    t0.delete(&composite_keys(&keys(10_000, BIG))).unwrap();
    drop(t0);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    check(&engine, "after close");
}

per_sync_mode!(more_writers_than_pool_threads: more_big_writers_than_pool_threads_per_batch, more_big_writers_than_pool_threads_relaxed);

// ------------------------------------------------ one table, contended

/// Eight threads upsert big overlapping batches into one table while another flushes it and
/// another deletes keys (small, inline records): the WAL's order must be the apply order, so
/// the replayed table equals the live one exactly, in both sync modes.
fn one_table_contended(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let (engine, t) = open_with_t(dir.path(), sync);
    t.insert(&composite_batch(&rows(0, 4_000, 0))).unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..8i64)
            .map(|th| {
                let t = &t;
                s.spawn(move || {
                    for r in 0..8i64 {
                        let from = (mix((th * 100 + r) as u64) % 3_000) as i64;
                        let n = BIG + (mix((th * 1_000 + r) as u64) % 2_048) as i64;
                        t.upsert(&composite_batch(&rows(from, n, th * 1_000 + r))).unwrap();
                        if r % 3 == 0 {
                            t.insert(&composite_batch(&rows(100_000 + th * 10_000 + r * 1_100, 1_100, th))).unwrap();
                        }
                    }
                })
            })
            .collect();
        let stop = &stop;
        let t2 = &t;
        let flusher = s.spawn(move || {
            while !stop.load(Ordering::Acquire) {
                t2.flush().unwrap();
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        let deleter = s.spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                let ks: Vec<_> = (0..40).map(|j| (mix(i * 64 + j) % 5_000) as i64).map(|k| (k, (k % 7) as i32)).collect();
                t2.delete(&composite_keys(&ks)).unwrap();
                i += 1;
            }
        });
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Release);
        flusher.join().unwrap();
        deleter.join().unwrap();
    });
    let live = contents(&t);
    assert!(live.len() > 10_000, "{}", live.len());
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    let got = contents(&engine.table("t").unwrap());
    assert_eq!(got.len(), live.len(), "{sync:?}: rows after replay");
    assert!(got == live, "{sync:?}: the replayed table differs from the live one");
}

per_sync_mode!(one_table_contended: one_table_many_big_writers_replay_equals_live_per_batch, one_table_many_big_writers_replay_equals_live_relaxed);

// ------------------------------------------------ refused writes and write_buffers

/// Big writes refused after their record started encoding — an existing key in the first,
/// middle or last row, a missing key for an update, a key repeated in the batch — give every
/// `write_buffers` byte back before they return, write nothing to the WAL, one at a time and
/// from eight threads at once, in both modes; the table is unchanged after replay.
fn refused_big_writes(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let (engine, t) = open_with_t(dir.path(), sync);
    t.insert(&composite_batch(&rows(0, 4_096, 1))).unwrap();
    let live = contents(&t);
    let base = write_buffers(&engine);
    let wal = engine.wal_usage();
    let refuse = |i: i64| -> Error {
        match i % 6 {
            0 => t.insert(&composite_batch(&rows(4_095, 2_000, i))).unwrap_err(),
            1 => t.insert(&composite_batch(&rows(3_000, 1_100, i))).unwrap_err(),
            2 => {
                let mut r = rows(10_000, BIG - 1, i);
                r.extend(rows(17, 1, i));
                t.insert(&composite_batch(&r)).unwrap_err()
            }
            3 => t.update(&composite_batch(&rows(3_500, BIG + i % 100, i))).unwrap_err(),
            4 => {
                let mut r = rows(0, 2_047, i);
                r.extend(rows(4_096, 1, i));
                t.update(&composite_batch(&r)).unwrap_err()
            }
            _ => {
                let mut r = rows(20_000, 1_500, i);
                r.extend(rows(20_003, 1, i));
                t.upsert(&composite_batch(&r)).unwrap_err()
            }
        }
    };
    let expect = |i: i64, e: &Error| match i % 6 {
        0 | 1 => assert!(matches!(e, Error::KeyExists { row: 0, .. }), "{i}: {e:?}"),
        2 => assert!(matches!(e, Error::KeyExists { row: 1_023, .. }), "{i}: {e:?}"),
        3 => assert!(matches!(e, Error::KeyNotFound { row: 596, .. }), "{i}: {e:?}"),
        4 => assert!(matches!(e, Error::KeyNotFound { row: 2_047, .. }), "{i}: {e:?}"),
        _ => assert!(matches!(e, Error::DuplicateKey { first: 3, row: 1_500, .. }), "{i}: {e:?}"),
    };
    for i in 0..12 {
        let e = refuse(i);
        expect(i, &e);
        assert_eq!(write_buffers(&engine), base, "{sync:?}: case {i} left record bytes");
        assert_eq!(engine.wal_usage(), wal, "{sync:?}: case {i} wrote to the WAL");
    }
    std::thread::scope(|s| {
        for th in 0..8i64 {
            let (refuse, expect) = (&refuse, &expect);
            s.spawn(move || {
                for j in 0..12 {
                    let i = th * 12 + j;
                    expect(i, &refuse(i));
                }
            });
        }
    });
    assert_eq!(write_buffers(&engine), base, "{sync:?}: concurrent refusals left record bytes");
    assert_eq!(engine.wal_usage(), wal, "{sync:?}: concurrent refusals wrote to the WAL");
    assert!(contents(&t) == live);
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    assert!(contents(&engine.table("t").unwrap()) == live, "{sync:?}: replay");
}

per_sync_mode!(refused_big_writes: refused_big_writes_leave_no_record_bytes_per_batch, refused_big_writes_leave_no_record_bytes_relaxed);

/// Big batches against an 8 MiB limit, from 1 MiB to 12 MiB of strings, each on a fresh
/// engine: the write either succeeds or is refused with `MemoryLimit`; a refused one has
/// `write_buffers` at 0 and nothing in the WAL the moment it returns, and a reopen finds
/// exactly the acknowledged rows.
fn memory_refusals(sync: WalSync) {
    let mut outcomes = Vec::new();
    for mib in [1usize, 2, 3, 4, 5, 6, 8, 12] {
        let dir = tempfile::tempdir().unwrap();
        let cfg =
            EngineConfig::default().memory_limit(8 << 20).wal_sync(sync).backpressure_timeout(Duration::from_millis(300)).flush_age(Duration::from_secs(3600));
        let engine = Engine::open(dir.path(), cfg.clone()).unwrap();
        let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
        let n = 2_048i64;
        let len = (mib << 20) / n as usize;
        let batch: Vec<_> = (0..n).map(|k| ((k, 0), (Some(k), Some(format!("{k:0len$}"))))).collect();
        let wal_before = engine.wal_usage();
        let res = t.insert(&composite_batch(&batch));
        let wal = engine.wal_usage();
        match &res {
            Ok(rows) => {
                assert_eq!(*rows, 2_048);
                wait_until("background work to finish", || write_buffers(&engine) == 0);
            }
            Err(e) => {
                assert!(e.is_memory_limit(), "{sync:?} {mib} MiB: {e:?}");
                assert_eq!(write_buffers(&engine), 0, "{sync:?} {mib} MiB: the refused record's buffer");
                assert_eq!(wal, wal_before, "{sync:?} {mib} MiB: the refused record was written");
            }
        }
        drop(t);
        drop(engine);
        let engine = Engine::open(dir.path(), cfg).unwrap();
        let got = contents(&engine.table("t").unwrap());
        if res.is_ok() {
            assert_eq!(got.len(), 2_048, "{sync:?} {mib} MiB");
            assert_eq!(got[&(2_047, 0)].1.as_deref(), Some(format!("{:0len$}", 2_047).as_str()));
        } else {
            assert!(got.is_empty(), "{sync:?} {mib} MiB: a refused write came back");
        }
        outcomes.push((mib, res.is_ok()));
    }
    assert!(outcomes.first().is_some_and(|o| o.1), "{outcomes:?}");
    assert!(outcomes.last().is_some_and(|o| !o.1), "{outcomes:?}");
}

per_sync_mode!(memory_refusals: big_writes_refused_for_memory_give_their_record_back_per_batch, big_writes_refused_for_memory_give_their_record_back_relaxed);

/// Eight threads write big batches to their own tables while the WAL fails with EIO for a
/// while: each write is acknowledged or refused with a storage error, `write_buffers` is back
/// at 0 once the writers are done, and after heal + drop + reopen every table holds exactly
/// its acknowledged batches.
fn wal_failures_under_concurrency(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let engine = Engine::open(dir.path(), config(sync).vfs(Arc::new(fs.clone()))).unwrap();
    let tables: Vec<Table> = (0..8).map(|i| engine.create_table(&format!("t{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    let failing = AtomicBool::new(false);
    let models: Vec<(Model, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = tables
            .iter()
            .enumerate()
            .map(|(th, t)| {
                let failing = &failing;
                s.spawn(move || {
                    let (mut m, mut refused) = (Model::new(), 0);
                    for b in 0..30i64 {
                        let r = rows(b * 1_500, 1_500, th as i64);
                        let res = if b % 2 == 0 { t.insert(&composite_batch(&r)) } else { t.upsert(&composite_batch(&r)) };
                        match res {
                            Ok(n) => {
                                assert_eq!(n, 1_500);
                                apply(&mut m, &r);
                            }
                            Err(Error::Storage(_)) => {
                                assert!(failing.load(Ordering::Acquire), "{sync:?}: a write failed before the fault");
                                refused += 1;
                            }
                            Err(e) => panic!("{sync:?}: untyped failure {e:?}"),
                        }
                    }
                    (m, refused)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(15));
        failing.store(true, Ordering::Release);
        fs.fail_all(5);
        std::thread::sleep(Duration::from_millis(30));
        fs.heal();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    wait_until("write buffers to drain", || write_buffers(&engine) == 0);
    for (i, (m, _)) in models.iter().enumerate() {
        assert!(contents(&tables[i]) == *m, "{sync:?}: t{i} live");
    }
    drop(tables);
    drop(engine);
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    for (i, (m, _)) in models.iter().enumerate() {
        let got = contents(&engine.table(&format!("t{i}")).unwrap());
        assert_eq!(got.len(), m.len(), "{sync:?}: t{i} rows after replay");
        assert!(got == *m, "{sync:?}: t{i} after replay");
    }
}

per_sync_mode!(wal_failures_under_concurrency: wal_failures_amid_concurrent_big_writes_per_batch, wal_failures_amid_concurrent_big_writes_relaxed);

// ------------------------------------------------ backpressure

/// A 8 MiB limit and four threads writing 2,048-row batches (~0.4 MiB each) to their own
/// tables and one shared table: writes wait for background flushes (and are retried) many
/// times. Every write is acknowledged, and the contents are exact live, after replay and
/// after close.
fn backpressure(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig::default().memory_limit(16 << 20).wal_sync(sync).backpressure_timeout(Duration::from_secs(20));
    let engine = Engine::open(dir.path(), cfg.clone()).unwrap();
    let (shared, own) = shared_and_own(&engine);
    let wide =
        |from: i64, n: i64, tag: i64| -> Vec<((i64, i32), Row)> { (from..from + n).map(|k| ((k, 1), (Some(tag), Some(format!("{tag}:{k:0>150}"))))).collect() };
    let models: Vec<(Model, Model)> = std::thread::scope(|s| {
        let hs: Vec<_> = own
            .iter()
            .enumerate()
            .map(|(th, t)| {
                let shared = &shared;
                let th = th as i64;
                s.spawn(move || {
                    let (mut mine, mut theirs) = (Model::new(), Model::new());
                    for b in 0..10i64 {
                        let r = wide(b * 2_048, 2_048, th);
                        t.insert(&composite_batch(&r)).unwrap();
                        apply(&mut mine, &r);
                        let r = wide(th * 1_000_000 + b * 2_048, 2_048, th);
                        shared.insert(&composite_batch(&r)).unwrap();
                        apply(&mut theirs, &r);
                        if b % 4 == 3 {
                            // Rewrites its own earlier rows (older versions in files).
                            let r = wide(b * 1_024, 2_048, th + 100);
                            t.upsert(&composite_batch(&r)).unwrap();
                            apply(&mut mine, &r);
                        }
                    }
                    (mine, theirs)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all_shared = Model::new();
    for (_, theirs) in &models {
        all_shared.extend(theirs.iter().map(|(k, v)| (*k, v.clone())));
    }
    let check = |engine: &Engine, what: &str| {
        let got = contents(&engine.table("shared").unwrap());
        assert_eq!(got.len(), all_shared.len(), "{sync:?} {what}: shared rows");
        assert!(got == all_shared, "{sync:?} {what}: shared");
        for (i, (mine, _)) in models.iter().enumerate() {
            let got = contents(&engine.table(&format!("t{i}")).unwrap());
            assert_eq!(got.len(), mine.len(), "{sync:?} {what}: t{i} rows");
            assert!(got == *mine, "{sync:?} {what}: t{i}");
        }
    };
    check(&engine, "live");
    drop((shared, own));
    drop(engine);
    let engine = Engine::open(dir.path(), cfg.clone()).unwrap();
    check(&engine, "after replay");
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg).unwrap();
    check(&engine, "after close");
}

per_sync_mode!(backpressure: backpressured_big_writes_are_exact_per_batch, backpressured_big_writes_are_exact_relaxed);

// ------------------------------------------------ async callers

/// Big writes from inside tokio: a current-thread runtime's `block_on`, tasks on a
/// two-worker multi-thread runtime (more tasks than workers, each blocking its worker for
/// the append), and its `spawn_blocking`; a refused big insert inside async; the engine
/// dropped inside async. No panic, and the replay is exact.
#[test]
fn big_writes_from_inside_tokio_runtimes() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let mut m = Model::new();
    let ct = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let a = rows(0, 4_096, 1);
    ct.block_on(async {
        assert_eq!(t.insert(&composite_batch(&a)).unwrap(), 4_096);
        let e = t.insert(&composite_batch(&rows(4_000, 2_000, 2))).unwrap_err();
        assert!(matches!(e, Error::KeyExists { row: 0, .. }), "{e:?}");
    });
    apply(&mut m, &a);
    let mt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let added: Vec<Vec<((i64, i32), Row)>> = mt.block_on(async {
        let mut hs = Vec::new();
        for th in 0..6i64 {
            let t = t.clone();
            // The test's own runtime (`mt`), dropped with the test: clippy.toml's rule is for
            // the engine's code.
            #[allow(clippy::disallowed_methods)]
            hs.push(tokio::spawn(async move {
                let r = rows(100_000 + th * 10_000, 2_000, th);
                t.insert(&composite_batch(&r)).unwrap();
                let u = rows(th * 500, 1_024, th + 50);
                t.upsert(&composite_batch(&u)).unwrap();
                vec![r, u]
            }));
        }
        let t2 = t.clone();
        #[allow(clippy::disallowed_methods)]
        let blocking = tokio::task::spawn_blocking(move || {
            let r = rows(500_000, 3_000, 9);
            t2.insert(&composite_batch(&r)).unwrap();
            vec![r]
        });
        let mut out = Vec::new();
        for h in hs {
            out.extend(h.await.unwrap());
        }
        out.extend(blocking.await.unwrap());
        out
    });
    for r in &added {
        // The upserts of different tasks overlap: the live table decides their order.
        if r.len() != 1_024 {
            apply(&mut m, r);
        }
    }
    let live = contents(&t);
    assert_eq!(live.len(), 4_096 + 6 * 2_000 + 3_000);
    for (k, v) in &m {
        if k.0 >= 100_000 {
            assert_eq!(live.get(k), Some(v), "{k:?}");
        }
    }
    drop(t);
    mt.block_on(async move { drop(engine) });
    drop(mt);
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
    assert!(contents(&engine.table("t").unwrap()) == live, "replay after an async drop");
}

// ------------------------------------------------ engine drop with big writes in flight

/// Eight threads write big batches (four into one shared table, four into their own) until
/// the engine is dropped under them. Every write either returns its row count or
/// `Error::Closed`; after the threads are done, a reopen finds exactly the acknowledged
/// batches (nothing refused comes back, nothing acknowledged is missing).
fn drop_under_big_writes(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    let (shared, own) = shared_and_own(&engine);
    let mut hs = Vec::new();
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for th in 0..8i64 {
        let t = if th < 4 { shared.clone() } else { own[(th - 4) as usize].clone() };
        let started = Arc::clone(&started);
        hs.push(std::thread::spawn(move || {
            let mut acked = Model::new();
            let mut b = 0i64;
            loop {
                let r = rows(th * 1_000_000 + b * 2_048, 2_048, th);
                match t.insert(&composite_batch(&r)) {
                    Ok(n) => {
                        assert_eq!(n, 2_048);
                        apply(&mut acked, &r);
                        if b == 0 {
                            started.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    Err(Error::Closed(_)) => return (th, acked, b),
                    Err(e) => panic!("{th}: untyped failure at batch {b}: {e:?}"),
                }
                b += 1;
            }
        }));
    }
    wait_until("every writer's first batch", || started.load(Ordering::Acquire) == 8);
    std::thread::sleep(Duration::from_millis(10));
    drop((shared, own));
    drop(engine);
    let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let engine = Engine::open(dir.path(), config(sync)).unwrap();
    let mut shared_model = Model::new();
    for (th, acked, batches) in &results {
        assert!(*batches > 0, "{sync:?}: thread {th} wrote nothing before the drop");
        if *th < 4 {
            shared_model.extend(acked.iter().map(|(k, v)| (*k, v.clone())));
        } else {
            let got = contents(&engine.table(&format!("t{}", th - 4)).unwrap());
            assert_eq!(got.len(), acked.len(), "{sync:?}: t{} rows (acknowledged batches only)", th - 4);
            assert!(got == *acked, "{sync:?}: t{}", th - 4);
        }
    }
    let got = contents(&engine.table("shared").unwrap());
    assert_eq!(got.len(), shared_model.len(), "{sync:?}: shared rows (acknowledged batches only)");
    assert!(got == shared_model, "{sync:?}: shared");
}

per_sync_mode!(drop_under_big_writes: engine_drop_under_big_writes_keeps_exactly_the_acknowledged_per_batch, engine_drop_under_big_writes_keeps_exactly_the_acknowledged_relaxed);

// ------------------------------------------------ the runtime's threads

fn writer_thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| matches!(c.trim_end(), "gritdb-writer" | "gritdb-wal")))
        .count()
}

fn all_thread_count() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

const THREADS_CHILD: &str = "GRITDB_WALPOOL7_THREADS_CHILD";

/// Runs in a child process of this test binary (alone, so other tests' engines do not count):
/// two cycles of open, 70 threads writing a big batch each to their own table at once (the
/// pool grows past 64 threads), drop without close (odd cycles) or close. After each cycle the
/// engine's `gritdb-writer` and `gritdb-wal` (WAL record pool) threads are all gone within 2 s, and the process's thread count
/// is back to where it started.
#[test]
fn writer_threads_child() {
    if std::env::var_os(THREADS_CHILD).is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = all_thread_count();
    assert_eq!(writer_thread_count(), 0);
    let mut peak = 0;
    for cycle in 0..2i64 {
        let engine = Engine::open(dir.path(), config(WalSync::PerBatch)).unwrap();
        let tables: Vec<Table> = (0..70)
            .map(|i| {
                let name = format!("t{i}");
                engine.table(&name).or_else(|_| engine.create_table(&name, composite_schema(), &["k1", "k2"])).unwrap()
            })
            .collect();
        let barrier = Barrier::new(70);
        std::thread::scope(|s| {
            for t in &tables {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    t.insert(&composite_batch(&rows(cycle * 10_000, 4_096, cycle))).unwrap();
                });
            }
        });
        peak = peak.max(writer_thread_count());
        for t in &tables {
            assert_eq!(t.row_count().unwrap(), (cycle as u64 + 1) * 4_096);
        }
        drop(tables);
        if cycle % 2 == 1 {
            drop(engine);
        } else {
            engine.close().unwrap();
        }
        let start = Instant::now();
        while writer_thread_count() > 0 && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(writer_thread_count(), 0, "cycle {cycle}: writer threads outlived the engine");
        assert_eq!(all_thread_count(), base, "cycle {cycle}: threads left in the process");
    }
    assert!(peak > 3, "the pool never grew: peak {peak}");
    println!("WRITER_THREADS_PEAK {peak}");
}

#[test]
fn writer_threads_end_with_the_engine() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["breaker_walpool7::writer_threads_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(THREADS_CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 passed"), "{stdout}");
    assert!(stdout.contains("WRITER_THREADS_PEAK"), "{stdout}");
}

// ------------------------------------------------ acknowledged after drop

/// A 400,000-row insert is in flight when the engine is dropped: its record is being encoded
/// on the writer's pool (its `write_buffers` reservation is the signal). `Drop for Engine`
/// returns (lock released, "handles still held return `Error::Closed`") without waiting for
/// it; the directory is reopened at once. The insert must then either fail or be in the
/// reopened engine — and after that engine's close and another reopen.
fn acked_after_drop(sync: WalSync) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(sync).memory_limit(1 << 30);
    let engine = Engine::open(dir.path(), cfg.clone()).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 10, 0))).unwrap();
    assert_eq!(write_buffers(&engine), 0);
    let batch = composite_batch(&rows(1_000, 400_000, 1));
    let dropped = Arc::new(AtomicBool::new(false));
    let writer = {
        let (t, dropped) = (t.clone(), Arc::clone(&dropped));
        std::thread::spawn(move || {
            let res = t.insert(&batch);
            (res.map_err(|e| format!("{e:?}")), dropped.load(Ordering::Acquire))
        })
    };
    let start = Instant::now();
    while write_buffers(&engine) == 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "the record never started encoding");
        std::hint::spin_loop();
    }
    drop(t);
    drop(engine);
    dropped.store(true, Ordering::Release);
    let engine = Engine::open(dir.path(), cfg.clone()).unwrap();
    let (res, after_drop) = writer.join().unwrap();
    let n2 = engine.table("t").unwrap().row_count().unwrap();
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg).unwrap();
    let n3 = engine.table("t").unwrap().row_count().unwrap();
    if res.is_ok() && (n2 != 400_010 || n3 != 400_010) {
        return Err(format!(
            "{sync:?}: insert returned {res:?} (after Engine drop had returned: {after_drop}); rows in the engine reopened \
             right after the drop: {n2}, after its close and another reopen: {n3} (expected 400010)"
        ));
    }
    Ok(())
}

#[test]
fn big_insert_acknowledged_after_engine_drop_is_in_the_reopened_engine_per_batch() {
    acked_after_drop(WalSync::PerBatch).unwrap();
}

#[test]
fn big_insert_acknowledged_after_engine_drop_is_in_the_reopened_engine_relaxed() {
    acked_after_drop(WalSync::Relaxed).unwrap();
}

// ------------------------------------------------ stalled WAL, saturated pool

/// The WAL disk stalls while 70 threads each write a big batch to their own table: with
/// `writer_threads(1)` that is the whole blocking pool (65 threads) stuck behind the WAL
/// lock, and five records queued. A big insert into another table refused for an existing key
/// — it needs no disk — must still return `KeyExists` at once, as a small one does (and as
/// a big one did with a thread per write). After heal every stuck write lands.
#[test]
fn refused_big_insert_does_not_wait_for_a_pool_saturated_by_a_stalled_wal() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let engine = Engine::open(dir.path(), config(WalSync::PerBatch).writer_threads(1).vfs(Arc::new(fs.clone()))).unwrap();
    let x = engine.create_table("x", composite_schema(), &["k1", "k2"]).unwrap();
    x.insert(&composite_batch(&rows(0, BIG, 0))).unwrap();
    let stuck: Vec<Table> = (0..70).map(|i| engine.create_table(&format!("s{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
    fs.stall_paths("wal-");
    let writers: Vec<_> = stuck
        .iter()
        .map(|t| {
            let t = t.clone();
            std::thread::spawn(move || t.insert(&composite_batch(&rows(0, BIG, 1))).map_err(|e| format!("{e:?}")))
        })
        .collect();
    wait_until("the WAL to stall", || fs.is_stalled());
    std::thread::sleep(Duration::from_millis(500));
    // The whole pool is busy: 1 worker + 65 blocking threads (other tests' engines may add).
    assert!(writer_thread_count() >= 66, "{}", writer_thread_count());
    // A small refused insert: at once.
    let e = x.insert(&composite_batch(&rows(0, 10, 2))).unwrap_err();
    assert!(matches!(e, Error::KeyExists { row: 0, .. }), "{e:?}");
    let (tx, rx) = std::sync::mpsc::channel();
    let x2 = x.clone();
    let refused = std::thread::spawn(move || {
        let start = Instant::now();
        let e = x2.insert(&composite_batch(&rows(0, BIG, 2))).unwrap_err();
        let _ = tx.send(());
        (e, start.elapsed())
    });
    let returned = rx.recv_timeout(Duration::from_secs(3)).is_ok();
    fs.heal();
    let (e, took) = refused.join().unwrap();
    for w in writers {
        assert_eq!(w.join().unwrap(), Ok(1_024));
    }
    assert!(matches!(e, Error::KeyExists { row: 0, .. }), "{e:?}");
    assert!(returned, "the refused big insert waited {took:?}, until the stalled WAL healed");
}

// ------------------------------------------------ tiny limit, CPU contention

/// Twelve threads write 2,048-row batches (~0.35 MiB) to their own tables under an 8 MiB limit
/// with `WalSync::Relaxed`, while three threads spin (a loaded machine; two cores here), ten
/// rounds of fresh engines. Every write must eventually be acknowledged (backpressure waits
/// up to 10 s for the writer: a wedge never clears, while 3 s let one write of a run time out
/// when the machine ran three other heavy jobs beside the suite). Observed instead: row blocks fill the limit as sealed deltas,
/// every background flush fails for memory (no `last_flush_error`, no files), writes fail
/// with `MemoryLimit`, and the engine stays wedged — `flush_all` and a 10-row insert fail
/// too. 5 of 5 runs wedged here (in rounds 0–8); `WalSync::PerBatch` 3 of 3 and the
/// pre-change commit 5b0e295 (Relaxed appended inline) 3 of 3 did not.
///
/// The cause (2026-12-05): the twelve writers checked the soft limit before any of their rows
/// were allocated, so together they passed it by several writes and spent the flush headroom
/// (6.7 MiB of sealed deltas, 0.8 MiB of key maps, and no flush could get 64 KiB for its
/// Parquet writer). Since `f20839c` each write's admission counts the writes being admitted to
/// other tables (`Shared::admit`), and relaxed puts are back on the WAL record pool: with the
/// count 5 of 5 runs pass, forced to 0 3 of 5 wedge. Both sync modes are checked.
fn tiny_limit_wedge(sync: WalSync) -> Result<(), String> {
    let spin = Arc::new(AtomicBool::new(true));
    let spinners: Vec<_> = (0..3)
        .map(|_| {
            let spin = Arc::clone(&spin);
            std::thread::spawn(move || {
                let mut x = 0u64;
                while spin.load(Ordering::Relaxed) {
                    x = mix(x);
                }
                x
            })
        })
        .collect();
    let res = (|| {
        for round in 0..10 {
            let dir = tempfile::tempdir().unwrap();
            let cfg = EngineConfig::default().memory_limit(8 << 20).wal_sync(sync).backpressure_timeout(Duration::from_secs(10));
            let engine = Engine::open(dir.path(), cfg).unwrap();
            let tables: Vec<Table> = (0..12).map(|i| engine.create_table(&format!("t{i}"), composite_schema(), &["k1", "k2"]).unwrap()).collect();
            let failed: Vec<String> = std::thread::scope(|s| {
                let hs: Vec<_> = tables
                    .iter()
                    .enumerate()
                    .map(|(th, t)| {
                        s.spawn(move || {
                            for b in 0..10i64 {
                                let r: Vec<_> = (b * 2_048..(b + 1) * 2_048).map(|k| ((k, 1), (Some(th as i64), Some(format!("{k:0>150}"))))).collect();
                                if let Err(e) = t.insert(&composite_batch(&r)) {
                                    return Some(e.to_string());
                                }
                            }
                            None
                        })
                    })
                    .collect();
                hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
            });
            if let Some(first) = failed.first() {
                let flush = engine.flush_all().map_err(|e| e.to_string());
                let small = tables[0].insert(&composite_batch(&rows(900_000, 10, 0))).map_err(|e| e.to_string());
                let files: u64 = tables.iter().map(|t| t.stats().unwrap().files as u64).sum();
                return Err(format!(
                    "{sync:?} round {round}: {} writes failed, first: {first}; then flush_all: {flush:?}; a 10-row insert: {small:?}; \
                     data files: {files}; used {} B",
                    failed.len(),
                    engine.memory().used()
                ));
            }
        }
        Ok(())
    })();
    spin.store(false, Ordering::Relaxed);
    for s in spinners {
        s.join().unwrap();
    }
    res
}

#[test]
fn relaxed_big_writers_at_a_tiny_limit_never_wedge_the_engine() {
    tiny_limit_wedge(WalSync::Relaxed).unwrap();
}

#[test]
fn per_batch_big_writers_at_a_tiny_limit_never_wedge_the_engine() {
    tiny_limit_wedge(WalSync::PerBatch).unwrap();
}
