//! A sealed delta whose Arrow batches do not fit beside it is flushed in parts
//! (`TableInner::flush_delta`, engine/src/table.rs): each part a class of its keys, converted,
//! staged and committed as a file of its own, the delta staying the newest layer for its keys
//! until its last part.

use crate::breaker_session12::{kv_batch, kv_keys, kv_read, kv_schema};
use gritdb::memory::Category;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Table};
use gritdb_memctl::Reservation;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

/// A file of keys 0..2000 (version 1), then an active delta upserting 1000..4000 (version 2,
/// 400-byte strings: ~1.4 MB, under the 2 MiB flush threshold of a 32 MiB limit) and deleting
/// 0..500. Memory is then taken (a reservation, as other tables or held scans would) until
/// only 3/4 of the delta's bytes are free, so its batches (about its bytes again) cannot be
/// had at once: `flush` used to fail with `MemoryLimit`. It must now write the delta in parts,
/// never above the limit, and the table must read exactly the model before and after reopen,
/// with nothing left for the WAL to replay.
#[test]
fn a_delta_whose_batches_do_not_fit_beside_it_is_flushed_in_parts() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 32 * MIB;
    let config = || EngineConfig::default().memory_limit(limit).flush_age(Duration::from_hours(1));
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let model = file_then_delta(&t);
    let files_before = t.stats().unwrap().files;
    let st = t.stats().unwrap();
    assert_eq!(st.sealed_deltas, 0, "the delta must still be active (under the flush threshold)");
    let delta = st.active_delta_bytes;
    assert!(delta > MIB, "delta of {delta} B");

    let ctl = engine.memory();
    engine.release_cached_memory();
    let free = delta * 3 / 4;
    let mut hold = Reservation::new(ctl, Category::Metadata, None);
    hold.try_grow(limit - ctl.used() - free).unwrap();
    let peak_before = ctl.peak();

    let written = t.flush().unwrap();
    assert_eq!(written, 3000, "every put of the delta written");
    let st = t.stats().unwrap();
    assert_eq!((st.sealed_deltas, st.active_delta_bytes), (0, 0));
    assert_eq!(ctl.category_bytes(Category::RowBlocks), 0, "the delta's row blocks are released");
    assert_eq!(ctl.category_bytes(Category::BatchBlocks), 0, "every part's batches are released");
    assert!(st.files >= files_before + 2, "{} files: the delta was not written in parts", st.files);
    assert!(ctl.peak().max(peak_before) <= limit);
    assert_eq!(kv_read(&t), model);
    drop(hold);

    engine.close().unwrap();
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(t.stats().unwrap().active_delta_bytes, 0, "the manifest covers the delta: nothing replayed");
    assert_eq!(kv_read(&t), model);
}

/// The delta's keys split in parts must not change what a table holds when the parts hold
/// puts of keys that older files have (their rows get deletion-vector bits in the part that
/// holds the key) and deletes (in the part of their key): compared against a model over many
/// rounds, each flushed at a limit leaving a third of the delta free, so parts are split
/// again (halves of halves).
#[test]
fn flushes_in_parts_keep_the_table_equal_to_the_model_over_rounds() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 32 * MIB;
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(limit).flush_age(Duration::from_hours(1))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let ctl = engine.memory();
    let mut model = BTreeMap::new();
    for round in 0..6i64 {
        let keys: Vec<i64> = (round * 700..round * 700 + 2500).collect();
        t.upsert(&kv_batch(&keys, round, 300)).unwrap();
        model.extend(keys.iter().map(|&k| (k, round)));
        let gone: Vec<i64> = (round * 700..round * 700 + 2500).step_by(7).collect();
        t.delete(&kv_keys(&gone)).unwrap();
        for k in &gone {
            model.remove(k);
        }
        engine.release_cached_memory();
        let delta = t.stats().unwrap().active_delta_bytes;
        let mut hold = Reservation::new(ctl, Category::Metadata, None);
        hold.try_grow(limit - ctl.used() - delta / 3).unwrap();
        t.flush().unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(hold);
        assert_eq!(kv_read(&t), model, "round {round}");
    }
}

/// The table of the first test: a file of keys 0..2000 (version 1), then an active delta
/// upserting 1000..4000 (version 2) and deleting 0..500. Returns the model.
fn file_then_delta(t: &Table) -> BTreeMap<i64, i64> {
    let old: Vec<i64> = (0..2000).collect();
    t.insert(&kv_batch(&old, 1, 100)).unwrap();
    t.flush().unwrap();
    let new: Vec<i64> = (1000..4000).collect();
    t.upsert(&kv_batch(&new, 2, 400)).unwrap();
    let gone: Vec<i64> = (0..500).collect();
    t.delete(&kv_keys(&gone)).unwrap();
    (500..1000).map(|k| (k, 1)).chain((1000..4000).map(|k| (k, 2))).collect()
}

/// An I/O error at every file-layer step of a flush in parts in turn (the first part's data
/// file, its manifest, the second part's, …, the WAL's truncation): the flush fails or not,
/// and the engine is then dropped without `close` (a crash as far as the files go). Reopened
/// on a healthy disk, the table is exactly the model every time: a part committed before the
/// failure is overwritten by the delta's replay from the log, never doubled or lost.
#[test]
fn a_flush_in_parts_failing_at_any_step_loses_nothing_after_reopen() {
    let limit = 32 * MIB;
    let mut failed = 0;
    for step in 1u64.. {
        assert!(step < 400, "the flush never got past the injected failure");
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::new();
        let config = EngineConfig::default().memory_limit(limit).flush_age(Duration::from_hours(1));
        let engine = Engine::open(dir.path(), config.clone().vfs(Arc::new(fs.clone()))).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let model = file_then_delta(&t);
        let ctl = engine.memory();
        engine.release_cached_memory();
        let free = t.stats().unwrap().active_delta_bytes * 3 / 4;
        let mut hold = Reservation::new(ctl, Category::Metadata, None);
        hold.try_grow(limit - ctl.used() - free).unwrap();
        let steps_before = fs.steps();
        fs.fail_step(step, libc::EIO);
        let res = t.flush();
        let reached = fs.steps() - steps_before >= step;
        if res.is_ok() && !reached {
            assert!(failed > 4, "only {failed} failure points: the flush did not run in parts");
            break;
        }
        failed += usize::from(res.is_err());
        drop(hold);
        drop(t);
        drop(engine);
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.table("t").unwrap();
        assert_eq!(kv_read(&t), model, "failure at step {step} ({res:?})");
    }
}
