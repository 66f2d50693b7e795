//! Breaker pass 10: commit e059b01 (`WalSync::Relaxed`: a full segment is fsynced before it is
//! closed; a failed fsync of acknowledged records is final until reopen) and commit a3312ec
//! (float key columns canonicalized before `arrow-row` encoding: −0.0 = 0.0, every NaN one key).
//!
//! The WAL half injects faults into the write-ahead log only (a test [`Vfs`] that fails writes
//! or fsyncs of files under `wal/`, so data files and manifests stay healthy): the group-commit
//! tick failing, the rotation's fsync failing, a failed write (not fsync) in relaxed mode, many
//! writers while the tick fails, per-batch mode (one write fails, on both WAL paths), and after
//! the failure: every write kind, flush, create/drop table, close, memory accounting, and a
//! reopen after drop-without-close that must bring back exactly the acknowledged writes.
//!
//! The key half keeps a model (canonical key → value as written, bits included) and drives
//! random inserts / upserts / updates / deletes with zeros of both signs, NaNs of both signs
//! and several payloads, infinities and subnormals, in composite (float, string) keys, through
//! sliced batches, flushes (many small ones: compaction), reopen after close and after
//! drop-without-close (WAL replay); and checks nullable float keys, scan filters on the float
//! key (delta and files alike), export, and SQL.

use arrow::array::{Array, ArrayRef, AsArray, Float16Array, Float32Array, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::vfs::{StdFs, Vfs, VfsFile};
use gritdb::{CompareOp, Engine, EngineConfig, Error, ScanFilter, ScanOptions, StorageError, Table, UnifyError, WalSync};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// =====================================================================================
// WAL fault layer
// =====================================================================================

/// Faults for the write-ahead log's files only (paths whose parent directory is `wal`).
#[derive(Debug, Default)]
struct WalFaultState {
    /// errno for every WAL file fsync (0: none).
    sync_errno: AtomicI32,
    /// errno for every WAL file write (0: none).
    write_errno: AtomicI32,
    /// Clear the fault after it fired once.
    once: AtomicBool,
    syncs: AtomicU64,
    failed_syncs: AtomicU64,
    failed_writes: AtomicU64,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct WalFault(Arc<WalFaultState>);

impl WalFault {
    pub(crate) fn fail_syncs(&self, errno: i32, once: bool) {
        self.0.once.store(once, Ordering::SeqCst);
        self.0.sync_errno.store(errno, Ordering::SeqCst);
    }
    pub(crate) fn fail_writes(&self, errno: i32, once: bool) {
        self.0.once.store(once, Ordering::SeqCst);
        self.0.write_errno.store(errno, Ordering::SeqCst);
    }
    pub(crate) fn heal(&self) {
        self.0.sync_errno.store(0, Ordering::SeqCst);
        self.0.write_errno.store(0, Ordering::SeqCst);
    }
    fn failed_syncs(&self) -> u64 {
        self.0.failed_syncs.load(Ordering::SeqCst)
    }
    fn syncs(&self) -> u64 {
        self.0.syncs.load(Ordering::SeqCst)
    }
    /// Waits (at most `limit`) until at least `n` WAL fsyncs have failed.
    fn wait_failed_syncs(&self, n: u64, limit: Duration) -> bool {
        let start = Instant::now();
        while self.failed_syncs() < n {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }
    fn take(&self, slot: &AtomicI32) -> Option<i32> {
        let e = slot.load(Ordering::SeqCst);
        if e == 0 {
            return None;
        }
        if self.0.once.load(Ordering::SeqCst) && slot.compare_exchange(e, 0, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return None;
        }
        Some(e)
    }
}

fn is_wal(p: &Path) -> bool {
    p.parent().and_then(|d| d.file_name()).is_some_and(|n| n == "wal")
}

struct WalFile {
    inner: Box<dyn VfsFile>,
    fault: WalFault,
}

impl Write for WalFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(e) = self.fault.take(&self.fault.0.write_errno) {
            self.fault.0.failed_writes.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::from_raw_os_error(e));
        }
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl VfsFile for WalFile {
    fn sync_all(&mut self) -> io::Result<()> {
        self.fault.0.syncs.fetch_add(1, Ordering::SeqCst);
        if let Some(e) = self.fault.take(&self.fault.0.sync_errno) {
            self.fault.0.failed_syncs.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::from_raw_os_error(e));
        }
        self.inner.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
}

impl Vfs for WalFault {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        let f = StdFs.create(path)?;
        if is_wal(path) { Ok(Box::new(WalFile { inner: f, fault: self.clone() })) } else { Ok(f) }
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        StdFs.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        StdFs.create_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        StdFs.sync_dir(path)
    }
}

// =====================================================================================
// WAL helpers: an (Int64 key, Utf8 value) table and its model
// =====================================================================================

fn kv_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", DataType::Utf8, true)]))
}

fn kv(keys: impl IntoIterator<Item = i64>, tag: &str) -> RecordBatch {
    let keys: Vec<i64> = keys.into_iter().collect();
    let vals: Vec<String> = keys.iter().map(|k| format!("{tag}-{k}")).collect();
    RecordBatch::try_new(kv_schema(), vec![Arc::new(Int64Array::from(keys)) as ArrayRef, Arc::new(StringArray::from(vals))]).unwrap()
}

fn kv_keys(keys: impl IntoIterator<Item = i64>) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
    RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(keys)) as ArrayRef]).unwrap()
}

fn kv_apply(model: &mut BTreeMap<i64, String>, keys: impl IntoIterator<Item = i64>, tag: &str) {
    for k in keys {
        model.insert(k, format!("{tag}-{k}"));
    }
}

pub(crate) fn kv_rows(t: &Table) -> BTreeMap<i64, String> {
    let mut out = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<Int64Type>();
        let s = b.column(1).as_string::<i32>();
        for i in 0..b.num_rows() {
            assert!(out.insert(k.value(i), s.value(i).to_owned()).is_none(), "key {} twice in a scan", k.value(i));
        }
    }
    out
}

/// The error is the relaxed log's sticky refusal: `Error::Storage(StorageError::Io)` whose text
/// names the earlier fsync and says to reopen.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(r: gritdb::Result<T>, what: &str) {
    match r {
        Err(Error::Storage(StorageError::Io { source, .. })) => {
            let text = source.to_string();
            assert!(text.contains("earlier fsync") && text.contains("reopen"), "{what}: {text}");
        }
        other => panic!("{what}: expected the sticky WAL refusal, got {other:?}"),
    }
}

#[track_caller]
fn assert_os_error<T: std::fmt::Debug>(r: gritdb::Result<T>, errno: i32, what: &str) {
    match r {
        Err(Error::Storage(StorageError::Io { source, .. })) => {
            assert_eq!(source.raw_os_error(), Some(errno), "{what}: {source}");
            assert!(!source.to_string().contains("earlier fsync"), "{what}: {source}");
        }
        other => panic!("{what}: expected an I/O error {errno}, got {other:?}"),
    }
}

fn category_bytes(engine: &Engine) -> Vec<(Category, usize)> {
    Category::ALL.iter().filter(|c| **c != Category::FreeChunks).map(|c| (*c, engine.memory().category_bytes(*c))).collect()
}

fn relaxed(fault: &WalFault, interval: Duration) -> EngineConfig {
    EngineConfig::default().memory_limit(128 << 20).wal_sync(WalSync::Relaxed).wal_sync_interval(interval).vfs(Arc::new(fault.clone()))
}

/// Fails the next group-commit fsync: arms the fault, acknowledges one more batch (so the tick
/// has something to sync), waits for the tick's fsync to fail, heals the disk.
fn fail_the_tick(t: &Table, fault: &WalFault, model: &mut BTreeMap<i64, String>, keys: std::ops::Range<i64>) {
    fault.fail_syncs(libc::EIO, false);
    // The tick may fail on earlier unsynced writes before this one: then it is refused.
    match t.insert(&kv(keys.clone(), "acked-before-failure")) {
        Ok(n) => {
            assert_eq!(n, keys.clone().count());
            kv_apply(model, keys, "acked-before-failure");
        }
        refused => assert_refused(refused, "the write racing the failing tick"),
    }
    assert!(fault.wait_failed_syncs(1, Duration::from_secs(10)), "the tick never fsynced the log");
    fault.heal();
}

// =====================================================================================
// WAL tests
// =====================================================================================

/// After a failed group-commit fsync every write kind is refused with the sticky error — also
/// after the disk heals and many ticks pass — while checks that precede the log (duplicate key,
/// key exists, update of a missing key, delete of nothing) keep their own answers; refused
/// writes change nothing (rows, memory); flush still works and loses nothing; reopen after
/// drop-without-close brings back exactly the acknowledged rows, and takes writes again.
#[test]
fn relaxed_tick_failure_refuses_every_write_kind_and_reopen_recovers_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = BTreeMap::new();
    t.insert(&kv(0..500, "a")).unwrap();
    kv_apply(&mut model, 0..500, "a");
    t.flush().unwrap();
    t.upsert(&kv(400..600, "b")).unwrap();
    kv_apply(&mut model, 400..600, "b");
    assert_eq!(t.delete(&kv_keys(0..10)).unwrap(), 10);
    for k in 0..10 {
        model.remove(&k);
    }
    t.update(&kv(100..110, "u")).unwrap();
    kv_apply(&mut model, 100..110, "u");
    fail_the_tick(&t, &fault, &mut model, 1000..1010);

    let base = category_bytes(&engine);
    for round in 0..3 {
        assert_refused(t.insert(&kv(2000..2100, "late")), "insert");
        assert_refused(t.upsert(&kv(0..5, "late")), "upsert of deleted keys");
        assert_refused(t.upsert(&kv(200..205, "late")), "upsert of live keys");
        assert_refused(t.update(&kv(300..305, "late")), "update");
        assert_refused(t.delete(&kv_keys(300..305)), "delete");
        // A batch big enough for the overlapped WAL path (the pool thread's append is refused).
        assert_refused(t.insert(&kv(10_000..12_000, "big")), "big insert");
        std::thread::sleep(Duration::from_millis(20)); // ticks pass; the refusal stays
        assert_eq!(t.row_count().unwrap(), model.len() as u64, "round {round}");
    }
    // Checks made before the log keep their typed answers.
    assert!(matches!(t.insert(&kv([200], "dup")), Err(Error::KeyExists { row: 0, .. })));
    assert!(matches!(t.insert(&kv([7000, 7000], "dup")), Err(Error::DuplicateKey { first: 0, row: 1, .. })));
    assert!(matches!(t.update(&kv([9999], "nope")), Err(Error::KeyNotFound { row: 0, .. })));
    assert_eq!(t.delete(&kv_keys([5, 9999])).unwrap(), 0, "deleting absent keys logs nothing");
    assert_eq!(category_bytes(&engine), base, "refused writes hold no memory");
    assert_eq!(kv_rows(&t), model);

    // Flush after the failure: data files are healthy, nothing is lost, nothing hangs.
    t.flush().unwrap();
    assert_eq!(t.stats().unwrap().active_delta_bytes, 0);
    assert_eq!(kv_rows(&t), model);
    assert_refused(t.insert(&kv(3000..3001, "after-flush")), "insert after flush");
    assert_eq!(kv_rows(&t), model);
    drop(t);
    drop(engine); // no close

    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(kv_rows(&t), model, "exactly the acknowledged writes after reopen");
    t.insert(&kv(5000..5010, "new")).unwrap();
    kv_apply(&mut model, 5000..5010, "new");
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert_eq!(kv_rows(&engine.table("t").unwrap()), model);
}

/// The failure without a flush before the drop: every acknowledged row is only in the log
/// (and the deltas), and the reopen replays exactly them.
#[test]
fn relaxed_tick_failure_then_drop_without_close_replays_only_acknowledged_rows() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..20 {
        t.insert(&kv(i * 10..i * 10 + 10, "a")).unwrap();
        kv_apply(&mut model, i * 10..i * 10 + 10, "a");
    }
    assert_eq!(t.delete(&kv_keys([3, 13, 23])).unwrap(), 3);
    for k in [3, 13, 23] {
        model.remove(&k);
    }
    fail_the_tick(&t, &fault, &mut model, 500..520);
    for i in 0..10 {
        assert_refused(t.insert(&kv(600 + i * 10..610 + i * 10, "refused")), "insert");
        assert_refused(t.delete(&kv_keys([40 + i])), "delete");
    }
    assert_eq!(t.stats().unwrap().files, 0, "nothing flushed: every row is in the log only");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert_eq!(kv_rows(&engine.table("t").unwrap()), model);
}

/// `close` after the failure flushes every table, returns the sticky error, and the next open
/// has every acknowledged row (from files) and takes writes.
#[test]
fn relaxed_close_after_failure_returns_the_error_and_keeps_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = BTreeMap::new();
    t.insert(&kv(0..300, "a")).unwrap();
    kv_apply(&mut model, 0..300, "a");
    fail_the_tick(&t, &fault, &mut model, 300..310);
    assert_refused(t.insert(&kv(400..410, "refused")), "insert");
    drop(t);
    assert_refused(engine.close(), "close");
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(kv_rows(&t), model);
    assert_eq!(t.stats().unwrap().file_rows, model.len() as u64, "close flushed every acknowledged row");
    t.insert(&kv(400..410, "again")).unwrap();
    kv_apply(&mut model, 400..410, "again");
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert_eq!(kv_rows(&engine.table("t").unwrap()), model);
}

/// Tables created and dropped after the failure: creation and drop do not go through the log,
/// a new table refuses writes like the others, and after drop-without-close + reopen the
/// catalog is what the calls said (the dropped table gone, its logged rows not replayed into
/// anything; the created one present and empty), with the surviving table's rows intact.
#[test]
fn relaxed_failure_then_create_and_drop_tables() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let gone = engine.create_table("gone", kv_schema(), &["k"]).unwrap();
    gone.insert(&kv(0..50, "g")).unwrap();
    let mut model = BTreeMap::new();
    t.insert(&kv(0..50, "a")).unwrap();
    kv_apply(&mut model, 0..50, "a");
    fail_the_tick(&t, &fault, &mut model, 50..60);
    assert_refused(gone.insert(&kv(100..110, "g")), "insert into the other table");
    engine.drop_table("gone").unwrap();
    assert!(matches!(gone.insert(&kv(200..201, "g")), Err(Error::TableNotFound { .. })));
    let fresh = engine.create_table("fresh", kv_schema(), &["k"]).unwrap();
    assert_refused(fresh.insert(&kv(0..5, "f")), "insert into a table created after the failure");
    assert_eq!(fresh.row_count().unwrap(), 0);
    // Re-creating the dropped name gets a new, empty table.
    let again = engine.create_table("gone", kv_schema(), &["k"]).unwrap();
    assert_eq!(again.row_count().unwrap(), 0);
    assert_refused(again.insert(&kv(0..5, "g2")), "insert into the re-created table");
    assert_eq!(kv_rows(&t), model);
    drop((t, gone, fresh, again));
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert_eq!(engine.table_names(), vec!["fresh".to_owned(), "gone".to_owned(), "t".to_owned()]);
    assert_eq!(kv_rows(&engine.table("t").unwrap()), model);
    assert_eq!(engine.table("gone").unwrap().row_count().unwrap(), 0, "the dropped table's logged rows do not come back");
    assert_eq!(engine.table("fresh").unwrap().row_count().unwrap(), 0);
}

/// Relaxed mode, a failed WAL *write* (not fsync): only that write fails, with the OS error,
/// and the log keeps going (the next write and the ticks succeed); the reopen has every
/// acknowledged row and none of the failed one.
#[test]
fn relaxed_failed_write_fails_that_write_only() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(5))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = BTreeMap::new();
    t.insert(&kv(0..100, "a")).unwrap();
    kv_apply(&mut model, 0..100, "a");
    fault.fail_writes(libc::ENOSPC, true);
    assert_os_error(t.insert(&kv(100..200, "refused")), libc::ENOSPC, "insert");
    assert_eq!(fault.0.failed_writes.load(Ordering::SeqCst), 1);
    fault.fail_writes(libc::ENOSPC, true);
    assert_os_error(t.delete(&kv_keys(0..10)), libc::ENOSPC, "delete");
    assert_eq!(t.row_count().unwrap(), 100);
    let syncs = fault.syncs();
    t.insert(&kv(200..300, "b")).unwrap();
    kv_apply(&mut model, 200..300, "b");
    let start = Instant::now();
    while fault.syncs() == syncs && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(fault.syncs() > syncs, "the tick fsyncs again after a failed write");
    t.upsert(&kv(50..60, "c")).unwrap();
    kv_apply(&mut model, 50..60, "c");
    assert_eq!(kv_rows(&t), model);
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert_eq!(kv_rows(&engine.table("t").unwrap()), model);
}

/// 1 MiB records: value of `n` rows of 16 KiB strings.
fn wide(keys: std::ops::Range<i64>) -> RecordBatch {
    let big = "w".repeat(16 << 10);
    let n = usize::try_from(keys.end - keys.start).unwrap();
    RecordBatch::try_new(kv_schema(), vec![Arc::new(Int64Array::from_iter_values(keys)) as ArrayRef, Arc::new(StringArray::from(vec![big.as_str(); n]))])
        .unwrap()
}

/// The rotation at 16 MiB fsyncs the full segment (no tick in between: a one-hour interval),
/// and the reopen has every row. Then the same with that fsync failing: the rotating write
/// fails with the OS error, every later one is refused, and the reopen has exactly the rows
/// acknowledged before it.
#[test]
fn relaxed_rotation_fsyncs_the_full_segment_and_its_failure_is_final() {
    for fail in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let fault = WalFault::default();
        let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_secs(3600)).memory_limit(256 << 20)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        // The interval's first tick fires at once, some time after the open: let it pass (it
        // fsyncs this one row when it comes after it) before the rotation is measured.
        t.insert(&wide(-1..0)).unwrap();
        let start = Instant::now();
        while fault.syncs() == 0 && start.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(2));
        }
        if fail {
            fault.fail_syncs(libc::EIO, false);
        }
        let syncs = fault.syncs();
        let mut acked = 0i64;
        let mut refused = None;
        // 64 rows of 16 KiB: about 1 MiB a record; 17 fill a segment and rotate.
        for i in 0..20i64 {
            match t.insert(&wide(i * 64..i * 64 + 64)) {
                Ok(n) => {
                    assert_eq!(n, 64);
                    acked += 64;
                }
                Err(e) => {
                    refused = Some((i, e));
                    break;
                }
            }
        }
        if fail {
            let (i, e) = refused.expect("the rotation's fsync failed, so some write must fail");
            assert!(i >= 15, "failed at record {i}: {e}");
            assert_os_error::<()>(Err(e), libc::EIO, "the rotating write");
            fault.heal();
            assert_refused(t.insert(&kv([100_000], "late")), "after the rotation failure");
            assert_refused(t.delete(&kv_keys([0])), "delete after the rotation failure");
        } else {
            assert!(refused.is_none(), "{refused:?}");
            assert!(fault.syncs() > syncs, "no fsync at the rotation");
        }
        assert_eq!(t.row_count().unwrap(), acked as u64 + 1);
        drop(t);
        drop(engine);
        let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
        let t = engine.table("t").unwrap();
        assert_eq!(t.row_count().unwrap(), acked as u64 + 1, "fail={fail}");
        let keys: Vec<i64> = kv_rows(&t).into_keys().collect();
        assert_eq!(keys, (-1..acked).collect::<Vec<_>>(), "fail={fail}");
    }
}

/// Many writers while the tick fails: every write either is acknowledged or refused with the
/// sticky error; once one is refused, all are; the reopen after drop-without-close has exactly
/// the acknowledged keys.
#[test]
fn relaxed_concurrent_writers_while_the_tick_fails() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), relaxed(&fault, Duration::from_millis(2))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let failed = Arc::new(AtomicBool::new(false));
    let healed = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<BTreeSet<i64>>> = Arc::default();
    let threads: Vec<_> = (0..4i64)
        .map(|w| {
            let (t, failed, healed, acked) = (t.clone(), Arc::clone(&failed), Arc::clone(&healed), Arc::clone(&acked));
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut after_heal = 0;
                let mut refused = 0;
                for i in 0i64.. {
                    assert!(start.elapsed() < Duration::from_secs(60), "writer {w} never saw the refusal");
                    let keys = (0..5).map(|j| w * 1_000_000 + i * 5 + j);
                    let was_healed = healed.load(Ordering::SeqCst);
                    let r = if i % 7 == 3 { t.upsert(&kv(keys.clone(), "u")) } else { t.insert(&kv(keys.clone(), "i")) };
                    match r {
                        Ok(5) => {
                            assert_eq!(refused, 0, "writer {w}: a write was acknowledged after one was refused");
                            acked.lock().unwrap().extend(keys);
                        }
                        other => {
                            assert!(failed.load(Ordering::SeqCst) || fault_armed(), "writer {w}: refused before any failure: {other:?}");
                            assert_refused(other, "concurrent write");
                            refused += 1;
                            if was_healed {
                                after_heal += 1;
                                if after_heal >= 3 {
                                    break;
                                }
                            }
                        }
                    }
                    if i % 16 == 0 {
                        std::thread::yield_now();
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    ARMED.store(true, Ordering::SeqCst);
    fault.fail_syncs(libc::EIO, false);
    assert!(fault.wait_failed_syncs(1, Duration::from_secs(10)), "the tick never failed");
    failed.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(30));
    fault.heal();
    healed.store(true, Ordering::SeqCst);
    for h in threads {
        h.join().unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() >= 20, "{} acknowledged", acked.len());
    assert_eq!(t.row_count().unwrap(), acked.len() as u64);
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(128 << 20)).unwrap();
    let got: BTreeSet<i64> = kv_rows(&engine.table("t").unwrap()).into_keys().collect();
    assert_eq!(got.len(), acked.len());
    assert_eq!(got, acked);
}

static ARMED: AtomicBool = AtomicBool::new(false);
fn fault_armed() -> bool {
    ARMED.load(Ordering::SeqCst)
}

/// Per-batch mode: a failed fsync fails that write only (small and big batches, i.e. both WAL
/// paths; insert, update and delete), with the OS error; every other write goes on, and the
/// reopen after drop-without-close has exactly the acknowledged ones.
#[test]
fn per_batch_failed_fsync_fails_that_write_only() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let config = || EngineConfig::default().memory_limit(128 << 20).vfs(Arc::new(fault.clone()));
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = BTreeMap::new();
    t.insert(&kv(0..100, "a")).unwrap();
    kv_apply(&mut model, 0..100, "a");
    let base = category_bytes(&engine);
    for (what, big) in [("small", false), ("big", true)] {
        let (from, to) = if big { (10_000, 12_000) } else { (1000, 1010) };
        fault.fail_syncs(libc::EIO, true);
        assert_os_error(t.insert(&kv(from..to, "refused")), libc::EIO, what);
        assert_eq!(fault.failed_syncs(), if big { 2 } else { 1 });
        if !big {
            // (The big batch's rows are encoded before its fsync: see the next test.)
            assert_eq!(category_bytes(&engine), base, "{what}: the refused write holds nothing");
        }
        t.insert(&kv(from..to, "ok")).unwrap();
        kv_apply(&mut model, from..to, "ok");
        t.delete(&kv_keys(from..to)).unwrap();
        for k in from..to {
            model.remove(&k);
        }
    }
    fault.fail_syncs(libc::EIO, true);
    assert_os_error(t.update(&kv(0..10, "refused")), libc::EIO, "update");
    fault.fail_syncs(libc::EIO, true);
    assert_os_error(t.delete(&kv_keys(10..20)), libc::EIO, "delete");
    assert_eq!(kv_rows(&t), model, "refused update and delete changed nothing");
    t.update(&kv(0..10, "u")).unwrap();
    kv_apply(&mut model, 0..10, "u");
    assert_eq!(t.delete(&kv_keys(10..20)).unwrap(), 10);
    for k in 10..20 {
        model.remove(&k);
    }
    assert_eq!(kv_rows(&t), model);
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(128 << 20)).unwrap();
    assert_eq!(kv_rows(&engine.table("t").unwrap()), model);
}

/// Per-batch mode, a batch of 1,024+ rows (the overlapped WAL path: its rows are encoded
/// while the pool thread writes and fsyncs the record): when that fsync fails, the refused
/// write must hold no memory, as a refused small batch does and as a batch refused for memory
/// does (`refused_writes.rs`).
#[test]
fn per_batch_refused_big_write_gives_back_its_row_memory() {
    let dir = tempfile::tempdir().unwrap();
    let fault = WalFault::default();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(128 << 20).vfs(Arc::new(fault.clone()))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv(0..100, "a")).unwrap();
    let base = category_bytes(&engine);
    let mut after = Vec::new();
    for round in 0..5i64 {
        fault.fail_syncs(libc::EIO, true);
        assert_os_error(t.insert(&kv(10_000 + round * 5000..12_000 + round * 5000, "refused")), libc::EIO, "big insert");
        assert_eq!(t.row_count().unwrap(), 100);
        after.push(engine.memory().category_bytes(Category::RowBlocks));
    }
    assert_eq!(category_bytes(&engine), base, "row_blocks after each refused big write: {after:?}");
}

// =====================================================================================
// Float keys: model
// =====================================================================================

/// Canonical key bits: both zeros → +0.0, every NaN → the positive quiet NaN.
fn canon(x: f64) -> u64 {
    if x == 0.0 {
        0
    } else if x.is_nan() {
        f64::NAN.to_bits()
    } else {
        x.to_bits()
    }
}

const POOL: [u64; 13] = [
    0x0000_0000_0000_0000, // 0.0
    0x8000_0000_0000_0000, // -0.0
    0x7ff8_0000_0000_0000, // NaN
    0xfff8_0000_0000_0000, // -NaN
    0x7ff8_0000_0000_0001, // NaN, payload
    0xfff0_0000_0000_0001, // -NaN, signalling, payload
    0x7ff0_0000_0000_0000, // inf
    0xfff0_0000_0000_0000, // -inf
    0x3ff8_0000_0000_0000, // 1.5
    0xbff8_0000_0000_0000, // -1.5
    0x0000_0000_0000_0001, // smallest subnormal
    0x8000_0000_0000_0001, // its negative
    0x7fef_ffff_ffff_ffff, // f64::MAX
];
const TEXTS: [&str; 3] = ["", "a", "zz"];

fn fk_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Float64, false), Field::new("s", DataType::Utf8, false), Field::new("v", DataType::Int64, true)]))
}

fn fk_key_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Float64, false), Field::new("s", DataType::Utf8, false)]))
}

/// A row: key bits, key text, value.
type FRow = (u64, String, Option<i64>);

/// Builds the batch, when `pad` as a slice (offset 2) of a bigger batch whose extra rows hold
/// −0.0 and NaN keys.
fn fk_batch(rows: &[FRow], pad: bool) -> RecordBatch {
    let mut all: Vec<FRow> = Vec::new();
    if pad {
        all.push(((-0.0f64).to_bits(), "a".into(), Some(-1)));
        all.push((0xfff8_0000_0000_0000, String::new(), None));
    }
    all.extend(rows.iter().cloned());
    if pad {
        all.push((0x8000_0000_0000_0000, "zz".into(), Some(-3)));
        all.push((0x7ff8_0000_0000_0001, "a".into(), None));
    }
    let b = RecordBatch::try_new(
        fk_schema(),
        vec![
            Arc::new(Float64Array::from_iter_values(all.iter().map(|r| f64::from_bits(r.0)))) as ArrayRef,
            Arc::new(StringArray::from_iter_values(all.iter().map(|r| r.1.as_str()))),
            Arc::new(Int64Array::from(all.iter().map(|r| r.2).collect::<Vec<_>>())),
        ],
    )
    .unwrap();
    if pad { b.slice(2, rows.len()) } else { b }
}

fn fk_keys(keys: &[(u64, String)], pad: bool) -> RecordBatch {
    let mut all: Vec<(u64, String)> = Vec::new();
    if pad {
        all.push((0x8000_0000_0000_0000, "a".into()));
    }
    all.extend(keys.iter().cloned());
    if pad {
        all.push((0x7ff8_0000_0000_0000, String::new()));
    }
    let b = RecordBatch::try_new(
        fk_key_schema(),
        vec![
            Arc::new(Float64Array::from_iter_values(all.iter().map(|r| f64::from_bits(r.0)))) as ArrayRef,
            Arc::new(StringArray::from_iter_values(all.iter().map(|r| r.1.as_str()))),
        ],
    )
    .unwrap();
    if pad { b.slice(1, keys.len()) } else { b }
}

/// Canonical key → (key bits as written, text, value).
type FModel = BTreeMap<(u64, String), (u64, Option<i64>)>;

/// Every row of a scan, keyed canonically; panics when one canonical key comes twice.
fn fk_rows(t: &Table, opts: ScanOptions) -> FModel {
    let mut out = FModel::new();
    for b in t.scan(opts).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<Float64Type>();
        let s = b.column(1).as_string::<i32>();
        let v = b.column(2).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            let bits = k.value(i).to_bits();
            let val = v.is_valid(i).then(|| v.value(i));
            let prev = out.insert((canon(k.value(i)), s.value(i).to_owned()), (bits, val));
            assert!(prev.is_none(), "one canonical key twice in a scan: {bits:#x} {:?} (and {prev:?})", s.value(i));
        }
    }
    out
}

fn first_dup(rows: &[(u64, String)]) -> Option<(usize, usize)> {
    let mut seen: HashMap<(u64, String), usize> = HashMap::new();
    for (i, (k, s)) in rows.iter().enumerate() {
        if let Some(&first) = seen.get(&(canon(f64::from_bits(*k)), s.clone())) {
            return Some((first, i));
        }
        seen.insert((canon(f64::from_bits(*k)), s.clone()), i);
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Insert,
    Upsert,
    Update,
    Delete,
}

/// Applies `op` to the table and the model and checks the result matches the model's answer.
fn fk_apply(t: &Table, model: &mut FModel, op: Op, rows: &[FRow], pad: bool, ctx: &str) {
    let keys: Vec<(u64, String)> = rows.iter().map(|r| (r.0, r.1.clone())).collect();
    let ck = |k: &(u64, String)| (canon(f64::from_bits(k.0)), k.1.clone());
    if op == Op::Delete {
        let got = t.delete(&fk_keys(&keys, pad)).unwrap_or_else(|e| panic!("{ctx}: delete: {e}"));
        let mut uniq = BTreeSet::new();
        let mut want = 0;
        for k in &keys {
            if uniq.insert(ck(k)) && model.remove(&ck(k)).is_some() {
                want += 1;
            }
        }
        assert_eq!(got, want, "{ctx}: delete {keys:x?}");
        return;
    }
    let b = fk_batch(rows, pad);
    let res = match op {
        Op::Insert => t.insert(&b),
        Op::Upsert => t.upsert(&b),
        Op::Update => t.update(&b),
        Op::Delete => unreachable!(),
    };
    if let Some((first, row)) = first_dup(&keys) {
        match res {
            Err(Error::DuplicateKey { first: f, row: r, .. }) => assert_eq!((f, r), (first, row), "{ctx}: {op:?} {keys:x?}"),
            other => panic!("{ctx}: {op:?} {keys:x?}: expected DuplicateKey {{ first: {first}, row: {row} }}, got {other:?}"),
        }
        return;
    }
    match op {
        Op::Insert => {
            if let Some(row) = keys.iter().position(|k| model.contains_key(&ck(k))) {
                match res {
                    Err(Error::KeyExists { row: r, .. }) => assert_eq!(r, row, "{ctx}: insert {keys:x?}"),
                    other => panic!("{ctx}: insert {keys:x?}: expected KeyExists {{ row: {row} }}, got {other:?}"),
                }
                return;
            }
        }
        Op::Update => {
            if let Some(row) = keys.iter().position(|k| !model.contains_key(&ck(k))) {
                match res {
                    Err(Error::KeyNotFound { row: r, .. }) => assert_eq!(r, row, "{ctx}: update {keys:x?}"),
                    other => panic!("{ctx}: update {keys:x?}: expected KeyNotFound {{ row: {row} }}, got {other:?}"),
                }
                return;
            }
        }
        _ => {}
    }
    assert_eq!(res.unwrap_or_else(|e| panic!("{ctx}: {op:?} {keys:x?}: {e}")), rows.len(), "{ctx}");
    for r in rows {
        model.insert(ck(&(r.0, r.1.clone())), (r.0, r.2));
    }
}

/// xorshift, deterministic.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn fk_check(t: &Table, model: &FModel, ctx: &str) {
    let got = fk_rows(t, ScanOptions::default());
    assert_eq!(&got, model, "{ctx}");
    assert_eq!(t.row_count().unwrap(), model.len() as u64, "{ctx}");
}

/// Random inserts / upserts / updates / deletes over (float, text) keys drawn from zeros and
/// NaNs of every sign and payload, with padded (sliced) and plain batches, small flushes
/// (compaction), reopen after close and after drop-without-close; the table equals the model
/// after every step, bits of the written values included.
#[test]
fn composite_float_keys_random_ops_match_the_model_across_flush_compaction_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let config = || EngineConfig::default().memory_limit(64 << 20);
    let mut engine = Some(Engine::open(dir.path(), config()).unwrap());
    let mut t = engine.as_ref().unwrap().create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut flushes = 0;
    for step in 0..600 {
        let op = [Op::Insert, Op::Insert, Op::Upsert, Op::Update, Op::Delete][rng.below(5)];
        let n = 1 + rng.below(4);
        let rows: Vec<FRow> =
            (0..n).map(|_| (POOL[rng.below(POOL.len())], TEXTS[rng.below(TEXTS.len())].to_owned(), (rng.below(4) != 0).then(|| i64::from(step)))).collect();
        let pad = rng.below(2) == 0;
        fk_apply(&t, &mut model, op, &rows, pad, &format!("step {step}"));
        fk_check(&t, &model, &format!("step {step} after {op:?}"));
        if step % 9 == 8 {
            t.flush().unwrap();
            flushes += 1;
            fk_check(&t, &model, &format!("step {step} after flush {flushes}"));
        }
        if step % 150 == 149 {
            let e = engine.take().unwrap();
            drop(t);
            if step % 300 == 149 {
                drop(e); // drop without close: replay
            } else {
                e.close().unwrap();
            }
            engine = Some(Engine::open(dir.path(), config()).unwrap());
            t = engine.as_ref().unwrap().table("f").unwrap();
            fk_check(&t, &model, &format!("step {step} after reopen"));
        }
    }
    let stats = t.stats().unwrap();
    assert!(stats.files <= 8, "compaction keeps the file count bounded: {stats:?}");
    drop(t);
    engine.take().unwrap().close().unwrap();
    let engine = Engine::open(dir.path(), config()).unwrap();
    fk_check(&engine.table("f").unwrap(), &model, "final reopen");
}

/// Deterministic walk: each representation of zero and NaN written, then found by every other
/// representation — by insert (refused), update, upsert, delete — in the delta, in a file, in a
/// compacted file, after replay. The value written last is the one kept, bits included.
#[test]
fn every_zero_and_nan_representation_finds_the_others_in_every_layer() {
    let zeros = [0x0000_0000_0000_0000u64, 0x8000_0000_0000_0000];
    let nans = [0x7ff8_0000_0000_0000u64, 0xfff8_0000_0000_0000, 0x7ff8_0000_0000_0001, 0xfff0_0000_0000_0001, 0x7ff4_0000_0000_0000];
    let dir = tempfile::tempdir().unwrap();
    let config = || EngineConfig::default().memory_limit(64 << 20);
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    let mut round = 0i64;
    for class in [&zeros[..], &nans[..]] {
        for &w in class {
            for &other in class {
                for layer in ["delta", "file", "file+reopen"] {
                    round += 1;
                    let ctx = format!("write {w:#x}, find by {other:#x}, {layer}");
                    let text = "k".to_owned();
                    fk_apply(&t, &mut model, Op::Insert, &[(w, text.clone(), Some(round))], round % 2 == 0, &ctx);
                    if layer != "delta" {
                        t.flush().unwrap();
                    }
                    fk_apply(&t, &mut model, Op::Insert, &[(other, text.clone(), Some(-round))], false, &ctx);
                    fk_check(&t, &model, &ctx);
                    fk_apply(&t, &mut model, Op::Update, &[(other, text.clone(), Some(round * 10))], true, &ctx);
                    fk_check(&t, &model, &ctx);
                    assert_eq!(model[&(canon(f64::from_bits(w)), text.clone())], (other, Some(round * 10)), "{ctx}: the update's bits");
                    if layer == "file+reopen" {
                        t.flush().unwrap();
                    }
                    fk_apply(&t, &mut model, Op::Upsert, &[(w, text.clone(), Some(round * 100))], false, &ctx);
                    fk_check(&t, &model, &ctx);
                    fk_apply(&t, &mut model, Op::Delete, &[(other, text.clone(), None), (w, text.clone(), None)], round % 3 == 0, &ctx);
                    assert!(model.is_empty(), "{ctx}");
                    fk_check(&t, &model, &ctx);
                }
            }
        }
    }
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config()).unwrap();
    fk_check(&engine.table("f").unwrap(), &model, "after replay");
    assert_eq!(engine.table("f").unwrap().row_count().unwrap(), 0);
}

/// Many small flushes of the same zero/NaN keys in alternating representations, so compaction
/// merges files whose rows hold different bits of one key; then drop without close, reopen,
/// and more writes found by the other representations.
#[test]
fn compaction_of_files_holding_both_zero_signs_and_many_nans() {
    let dir = tempfile::tempdir().unwrap();
    let config = || EngineConfig::default().memory_limit(64 << 20);
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    for round in 0..40usize {
        let rows: Vec<FRow> = (0..POOL.len())
            .filter(|i| (i + round) % 3 != 0)
            .flat_map(|i| TEXTS.iter().map(move |s| (POOL[(i + round) % POOL.len()], (*s).to_owned(), Some((round * 100 + i) as i64))))
            .collect();
        // Same canonical keys repeat inside `rows` (several NaNs, both zeros): upsert one at a
        // time would be the model; here upsert the batch deduplicated by canonical key.
        let mut seen = BTreeSet::new();
        let rows: Vec<FRow> = rows.into_iter().filter(|r| seen.insert((canon(f64::from_bits(r.0)), r.1.clone()))).collect();
        fk_apply(&t, &mut model, Op::Upsert, &rows, round % 2 == 1, &format!("round {round}"));
        if round % 5 == 4 {
            let dels: Vec<FRow> = [0x8000_0000_0000_0000u64, 0xfff0_0000_0000_0001].iter().map(|k| (*k, "a".to_owned(), None)).collect();
            fk_apply(&t, &mut model, Op::Delete, &dels, false, &format!("round {round} delete"));
        }
        t.flush().unwrap();
        fk_check(&t, &model, &format!("round {round}"));
    }
    let files = t.stats().unwrap().files;
    assert!(files <= 8, "{files} files after 40 small flushes");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("f").unwrap();
    fk_check(&t, &model, "after reopen");
    for (k, s) in [(0x0000_0000_0000_0000u64, ""), (0x7ff8_0000_0000_0001, "zz"), (0xfff8_0000_0000_0000, "a")] {
        fk_apply(&t, &mut model, Op::Insert, &[(k, s.to_owned(), Some(1))], false, "after reopen");
    }
    fk_check(&t, &model, "after reopen, inserts");
}

/// Nullable float key columns: a null key is a typed error (`NullKey` with column and row),
/// in insert, upsert, update and delete, also in a sliced batch and hidden behind −0.0 / NaN
/// bits; nothing is applied.
#[test]
fn null_float_keys_are_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let schema =
        Arc::new(Schema::new(vec![Field::new("k", DataType::Float32, true), Field::new("s", DataType::Utf8, true), Field::new("v", DataType::Int64, true)]));
    let t = match engine.create_table("n", Arc::clone(&schema), &["k", "s"]) {
        Ok(t) => t,
        Err(e) => panic!("nullable key columns: {e}"),
    };
    let b = |k: Vec<Option<f32>>, s: Vec<Option<&str>>| {
        let n = k.len();
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Float32Array::from(k)) as ArrayRef, Arc::new(StringArray::from(s)), Arc::new(Int64Array::from(vec![Some(1); n]))],
        )
        .unwrap()
    };
    assert_eq!(t.insert(&b(vec![Some(-0.0), Some(f32::NAN)], vec![Some("a"), Some("a")])).unwrap(), 2);
    let null_at = |r: gritdb::Result<usize>, column: &str, row: usize, what: &str| match r {
        Err(Error::Input(UnifyError::NullKey { column: c, row: r })) => assert_eq!((c.as_str(), r), (column, row), "{what}"),
        other => panic!("{what}: expected NullKey, got {other:?}"),
    };
    null_at(t.insert(&b(vec![Some(1.0), None], vec![Some("a"), Some("a")])), "k", 1, "insert");
    null_at(t.upsert(&b(vec![Some(0.0), Some(2.0)], vec![Some("a"), None])), "s", 1, "upsert");
    null_at(t.update(&b(vec![None], vec![Some("a")])), "k", 0, "update");
    // A null whose value bits are −0.0 / a NaN, in a slice.
    let hidden = Float32Array::new(vec![5.0f32, -0.0, f32::from_bits(0xffc0_0001), 3.0].into(), Some(vec![true, false, false, true].into()));
    let s = StringArray::from(vec!["x", "a", "a", "y"]);
    let v = Int64Array::from(vec![1, 2, 3, 4]);
    let full = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(hidden) as ArrayRef, Arc::new(s), Arc::new(v)]).unwrap();
    null_at(t.upsert(&full.slice(1, 3)), "k", 0, "upsert slice");
    null_at(t.insert(&full.slice(2, 2)), "k", 0, "insert slice");
    let key_schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Float32, true), Field::new("s", DataType::Utf8, true)]));
    let keys = RecordBatch::try_new(
        key_schema,
        vec![Arc::new(Float32Array::from(vec![Some(0.0), None])) as ArrayRef, Arc::new(StringArray::from(vec![Some("a"), Some("a")]))],
    )
    .unwrap();
    null_at(t.delete(&keys), "k", 1, "delete");
    assert_eq!(t.row_count().unwrap(), 2);
    // The non-null rows still work, found by the other zero and another NaN.
    assert_eq!(t.delete(&keys.slice(0, 1)).unwrap(), 1);
    assert!(matches!(t.insert(&b(vec![Some(-f32::NAN)], vec![Some("a")])), Err(Error::KeyExists { row: 0, .. })));
    assert_eq!(t.row_count().unwrap(), 1);
}

/// Float16 and Float32 keys composite with a string, through flush and replay.
#[test]
fn float16_and_float32_composite_keys_through_flush_and_replay() {
    type F16 = <arrow::datatypes::Float16Type as arrow::datatypes::ArrowPrimitiveType>::Native;
    let dir = tempfile::tempdir().unwrap();
    let config = || EngineConfig::default().memory_limit(64 << 20);
    let schema = Arc::new(Schema::new(vec![
        Field::new("h", DataType::Float16, false),
        Field::new("f", DataType::Float32, false),
        Field::new("s", DataType::Utf8, false),
    ]));
    let b = |rows: &[(u16, u32, &str)]| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(rows.iter().map(|r| Some(F16::from_bits(r.0))).collect::<Float16Array>()) as ArrayRef,
                Arc::new(Float32Array::from_iter_values(rows.iter().map(|r| f32::from_bits(r.1)))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.2))),
            ],
        )
        .unwrap()
    };
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("h", Arc::clone(&schema), &["h", "f", "s"]).unwrap();
    // h: -0.0, f: -NaN with payload
    assert_eq!(t.insert(&b(&[(0x8000, 0xffc0_0001, "a"), (0x7e00, 0x8000_0000, "a"), (0x3c00, 0x0000_0000, "a")])).unwrap(), 3);
    let exists = |rows: &[(u16, u32, &str)], what: &str| {
        assert!(matches!(t.insert(&b(rows)), Err(Error::KeyExists { row: 0, .. })), "{what}");
    };
    exists(&[(0x0000, 0x7fc0_0000, "a")], "delta");
    exists(&[(0xfe01, 0x0000_0000, "a")], "delta, f16 NaN payload");
    t.flush().unwrap();
    exists(&[(0x0000, 0x7fc0_0000, "a")], "file");
    exists(&[(0x7c01 | 0x0200, 0x0000_0000, "a")], "file, f16 NaN");
    assert_eq!(t.insert(&b(&[(0x0000, 0x7fc0_0000, "b")])).unwrap(), 1, "another text is another key");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("h").unwrap();
    assert_eq!(t.row_count().unwrap(), 4);
    assert!(matches!(t.insert(&b(&[(0x8000, 0xffff_ffff, "b")])), Err(Error::KeyExists { row: 0, .. })), "replayed");
    let key_schema = Arc::new(Schema::new(vec![
        Field::new("h", DataType::Float16, false),
        Field::new("f", DataType::Float32, false),
        Field::new("s", DataType::Utf8, false),
    ]));
    let keys = RecordBatch::try_new(
        key_schema,
        vec![
            Arc::new(vec![Some(F16::from_bits(0x0000)), Some(F16::from_bits(0xfe00))].into_iter().collect::<Float16Array>()) as ArrayRef,
            Arc::new(Float32Array::from(vec![f32::NAN, 0.0])),
            Arc::new(StringArray::from(vec!["a", "a"])),
        ],
    )
    .unwrap();
    assert_eq!(t.delete(&keys).unwrap(), 2);
    assert_eq!(t.row_count().unwrap(), 2);
}

/// Whether a filter `k op lit` is true for `k = v`, as `PostgreSQL` compares floats (the
/// documented comparison of scan filters): −0.0 = 0.0, every NaN equals every NaN and is
/// above every number.
fn pg_cmp_holds(op: CompareOp, v: f64, lit: f64) -> bool {
    use std::cmp::Ordering as O;
    let c = match (v.is_nan(), lit.is_nan()) {
        (true, true) => O::Equal,
        (true, false) => O::Greater,
        (false, true) => O::Less,
        _ => v.partial_cmp(&lit).expect("no NaN here"),
    };
    match op {
        CompareOp::Eq => c == O::Equal,
        CompareOp::NotEq => c != O::Equal,
        CompareOp::Lt => c == O::Less,
        CompareOp::LtEq => c != O::Greater,
        CompareOp::Gt => c == O::Greater,
        CompareOp::GtEq => c != O::Less,
        _ => unreachable!(),
    }
}

/// Scan filters on the float key column compare as the key rules do (−0.0 = 0.0, NaNs of any
/// sign or payload equal, NaN above every number), whichever spelling was written and
/// whichever the literal uses; the same in the delta, in files and mixed; Float32 literals are
/// cast.
#[test]
fn scan_filters_on_float_keys_agree_between_delta_and_files() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    let half: Vec<FRow> = POOL.iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(i, k)| (*k, "a".to_owned(), Some(i as i64))).collect();
    let other: Vec<FRow> = POOL.iter().enumerate().filter(|(i, _)| i % 2 == 1).map(|(i, k)| (*k, "b".to_owned(), Some(i as i64))).collect();
    let ops = [CompareOp::Eq, CompareOp::NotEq, CompareOp::Lt, CompareOp::LtEq, CompareOp::Gt, CompareOp::GtEq];
    let check = |model: &FModel, layer: &str| {
        for &lit in &POOL {
            for op in ops {
                let f = ScanFilter::compare("k", op, Arc::new(Float64Array::from(vec![f64::from_bits(lit)])));
                let got = fk_rows(&t, ScanOptions::default().filter(f));
                let want: FModel =
                    model.iter().filter(|(_, (bits, _))| pg_cmp_holds(op, f64::from_bits(*bits), f64::from_bits(lit))).map(|(k, v)| (k.clone(), *v)).collect();
                assert_eq!(got, want, "{layer}: k {op} {lit:#x}");
            }
        }
        for lit in [0.0f32, -0.0, f32::NAN] {
            let f = ScanFilter::compare("k", CompareOp::Eq, Arc::new(Float32Array::from(vec![lit])));
            let got = fk_rows(&t, ScanOptions::default().filter(f));
            let want: FModel = model
                .iter()
                .filter(|(_, (bits, _))| pg_cmp_holds(CompareOp::Eq, f64::from_bits(*bits), f64::from(lit)))
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            assert_eq!(got, want, "{layer}: k = {lit} (Float32 literal)");
        }
    };
    fk_apply(&t, &mut model, Op::Insert, &half, true, "half");
    check(&model, "delta");
    t.flush().unwrap();
    check(&model, "file");
    fk_apply(&t, &mut model, Op::Insert, &other, false, "other");
    check(&model, "file + delta");
    // Upserts by the other representation change the bits the filters see.
    let flipped: Vec<FRow> = [(0x8000_0000_0000_0000u64, "a"), (0x7ff8_0000_0000_0000, "b"), (0x0000_0000_0000_0000, "b")]
        .iter()
        .map(|(k, s)| (*k, (*s).to_owned(), Some(77)))
        .collect();
    fk_apply(&t, &mut model, Op::Upsert, &flipped, false, "flip");
    check(&model, "flipped in the delta over a file");
    t.flush().unwrap();
    check(&model, "flipped, all files");
}

/// A float literal of another width than its column, or −0.0 for an integer column, names
/// the same value there, NaNs of any sign, payload or signalling bit included: each filter
/// returns what `PostgreSQL`'s rule gives (every NaN one value, −0.0 = 0), not
/// `InvalidFilter`. Before, the literal's cast had to round-trip bit for bit before it was
/// made canonical, and 445 such filters of a trial were refused. A value the column type
/// cannot hold (0.1 for Float32) is still refused.
#[test]
fn float_literals_of_another_width_name_the_same_value() {
    use arrow::datatypes::Float16Type;
    type F16 = <Float16Type as arrow::datatypes::ArrowPrimitiveType>::Native;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let s = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("x", DataType::Float64, true),
        Field::new("y", DataType::Float32, true),
        Field::new("h", DataType::Float16, true),
    ]));
    let t = engine.create_table("w", Arc::clone(&s), &["id"]).unwrap();
    // Rows 0..4: 0.0, −0.0, NaN, −NaN; row 4: 1.5; row 5: NULL (in every float column).
    let xs = [Some(0.0), Some(-0.0), Some(f64::NAN), Some(-f64::NAN), Some(1.5), None];
    let batch = RecordBatch::try_new(
        Arc::clone(&s),
        vec![
            Arc::new(Int64Array::from_iter_values(0..6)),
            Arc::new(Float64Array::from(xs.to_vec())),
            Arc::new(Float32Array::from(xs.iter().map(|v| v.map(|v| v as f32)).collect::<Vec<_>>())),
            Arc::new(Float16Array::from(xs.iter().map(|v| v.map(F16::from_f64)).collect::<Vec<_>>())),
        ],
    )
    .unwrap();
    t.insert(&batch).unwrap();
    let ids = |f: ScanFilter| -> Result<Vec<i64>, gritdb::Error> {
        let mut out: Vec<i64> = Vec::new();
        for b in t.scan(ScanOptions::default().filter(f))? {
            out.extend(b?.column(0).as_primitive::<Int64Type>().values().iter().copied());
        }
        out.sort_unstable();
        Ok(out)
    };
    let nan64: [f64; 4] = [f64::from_bits(0x7ff8_0000_0000_0001), f64::from_bits(0xfff8_0000_0000_0007), f64::from_bits(0x7ff0_0000_0000_0001), -f64::NAN];
    let nan32: [f32; 3] = [f32::from_bits(0x7f80_0001), f32::from_bits(0xffc0_0001), -f32::NAN];
    let nan16: [u16; 2] = [0x7c01, 0xfe01];
    let literals: Vec<(&str, ArrayRef)> = nan64
        .iter()
        .map(|v| ("f64 NaN", Arc::new(Float64Array::from(vec![*v])) as ArrayRef))
        .chain(nan32.iter().map(|v| ("f32 NaN", Arc::new(Float32Array::from(vec![*v])) as ArrayRef)))
        .chain(nan16.iter().map(|b| ("f16 NaN", Arc::new(Float16Array::from(vec![F16::from_bits(*b)])) as ArrayRef)))
        .collect();
    for col in ["x", "y", "h"] {
        for (what, lit) in &literals {
            for (op, want) in [(CompareOp::Eq, vec![2, 3]), (CompareOp::Lt, vec![0, 1, 4]), (CompareOp::GtEq, vec![2, 3]), (CompareOp::NotEq, vec![0, 1, 4])] {
                let got = ids(ScanFilter::compare(col, op, Arc::clone(lit))).unwrap_or_else(|e| panic!("{col} {op} {what} {lit:?}: {e}"));
                assert_eq!(got, want, "{col} {op} {what} {lit:?}");
            }
        }
        // −0.0 of the other widths is 0 in each.
        for lit in [
            Arc::new(Float64Array::from(vec![-0.0])) as ArrayRef,
            Arc::new(Float32Array::from(vec![-0.0f32])),
            Arc::new(Float16Array::from(vec![F16::from_bits(0x8000)])),
        ] {
            assert_eq!(ids(ScanFilter::compare(col, CompareOp::Eq, Arc::clone(&lit))).unwrap(), [0, 1], "{col} = -0.0 as {}", lit.data_type());
        }
    }
    // −0.0 for an integer column is 0.
    assert_eq!(ids(ScanFilter::compare("id", CompareOp::Eq, Arc::new(Float64Array::from(vec![-0.0])))).unwrap(), [0]);
    assert_eq!(ids(ScanFilter::compare("id", CompareOp::Lt, Arc::new(Float32Array::from(vec![-0.0f32])))).unwrap(), Vec::<i64>::new());
    // A value the column cannot hold is still refused, typed.
    for (col, lit) in [
        ("y", Arc::new(Float64Array::from(vec![0.1])) as ArrayRef),
        ("id", Arc::new(Float64Array::from(vec![f64::NAN]))),
        ("id", Arc::new(Float64Array::from(vec![1.5]))),
    ] {
        let e = ids(ScanFilter::compare(col, CompareOp::Eq, Arc::clone(&lit))).unwrap_err();
        assert!(matches!(e, gritdb::Error::InvalidFilter { .. }), "{col} = {lit:?}: {e:?}");
    }
}

/// Export writes the rows as scanned: one row per canonical key, bits as written.
#[test]
fn export_of_float_keys_keeps_the_written_bits() {
    use gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path().join("db"), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    let rows: Vec<FRow> = POOL.iter().enumerate().map(|(i, k)| (*k, "a".to_owned(), Some(i as i64))).collect();
    let mut seen = BTreeSet::new();
    let rows: Vec<FRow> = rows.into_iter().filter(|r| seen.insert(canon(f64::from_bits(r.0)))).collect();
    fk_apply(&t, &mut model, Op::Insert, &rows, false, "insert");
    t.flush().unwrap();
    fk_apply(&t, &mut model, Op::Upsert, &[(0x8000_0000_0000_0000, "a".into(), Some(-1)), (0xfff0_0000_0000_0001, "a".into(), Some(-2))], true, "flip");
    let path = dir.path().join("f.parquet");
    let stats = t.export_parquet(&path).unwrap();
    assert_eq!(stats.rows, model.len() as u64);
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&path).unwrap()).unwrap().build().unwrap();
    let mut got = FModel::new();
    for b in reader {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<Float64Type>();
        let s = b.column(1).as_string::<i32>();
        let v = b.column(2).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            let prev = got.insert((canon(k.value(i)), s.value(i).to_owned()), (k.value(i).to_bits(), v.is_valid(i).then(|| v.value(i))));
            assert!(prev.is_none());
        }
    }
    assert_eq!(got, model);
}

/// SQL over float keys: the count is one per canonical key; a float-key equality matches the
/// values as written.
#[cfg(feature = "sql")]
#[test]
fn sql_over_float_keys() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    fk_apply(
        &t,
        &mut model,
        Op::Insert,
        &[(0x8000_0000_0000_0000, "a".into(), Some(1)), (0x7ff8_0000_0000_0001, "a".into(), Some(2)), (0x3ff8_0000_0000_0000, "a".into(), Some(3))],
        false,
        "insert",
    );
    t.flush().unwrap();
    fk_apply(&t, &mut model, Op::Upsert, &[(0x0000_0000_0000_0000, "a".into(), Some(10))], false, "upsert 0.0");
    let scalar = |q: &str| -> i64 {
        let out = engine.sql(q).unwrap();
        let b = out.iter().find(|b| b.num_rows() > 0).unwrap_or_else(|| panic!("{q}: no rows"));
        arrow::compute::cast(b.column(0), &DataType::Int64).unwrap().as_primitive::<Int64Type>().value(0)
    };
    assert_eq!(scalar("SELECT count(*) FROM f"), 3);
    assert_eq!(scalar("SELECT sum(v) FROM f"), 15);
    assert_eq!(scalar("SELECT count(DISTINCT k) FROM f"), 3);
    // Typed float literals (the session parses `1.5` as a DECIMAL: see the next test).
    assert_eq!(scalar("SELECT v FROM f WHERE k = CAST(1.5 AS DOUBLE)"), 3);
    assert_eq!(scalar("SELECT v FROM f WHERE k = CAST(0 AS DOUBLE)"), 10, "the row holds +0.0 after the upsert");
    assert_eq!(scalar("SELECT count(*) FROM f WHERE k > CAST(1 AS DOUBLE)"), 2, "1.5 and the NaN (NaN sorts above numbers)");
}

/// The SQL session parses `1.5` as a DECIMAL (`parse_float_as_decimal`), so comparing a float
/// column with a plain numeric literal casts the column to DECIMAL(30, 15): a NaN, an
/// infinity or any value of 1e15 or more in the column turns `WHERE x = 1.5` / `WHERE x > 1.0`
/// into an execution error instead of an answer. NaN and ±inf are exactly the key values the
/// float-key change documents as first-class.
#[cfg(feature = "sql")]
#[test]
fn sql_float_column_compared_with_a_decimal_literal_answers_with_nan_inf_and_big_values() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("f", fk_schema(), &["k", "s"]).unwrap();
    let mut model = FModel::new();
    fk_apply(&t, &mut model, Op::Insert, &[(1.5f64.to_bits(), "a".into(), Some(3)), (2.5f64.to_bits(), "a".into(), Some(4))], false, "insert");
    let count = |q: &str| -> std::result::Result<i64, String> {
        let out = engine.sql(q).map_err(|e| format!("{q}: {e}"))?;
        let b = out.iter().find(|b| b.num_rows() > 0).ok_or_else(|| format!("{q}: no rows"))?;
        Ok(arrow::compute::cast(b.column(0), &DataType::Int64).unwrap().as_primitive::<Int64Type>().value(0))
    };
    assert_eq!(count("SELECT count(*) FROM f WHERE k > 1.0"), Ok(2), "finite values only");
    let mut wrong = Vec::new();
    for (bits, what) in [(f64::NAN.to_bits(), "NaN"), (f64::INFINITY.to_bits(), "inf"), (1e20f64.to_bits(), "1e20")] {
        fk_apply(&t, &mut model, Op::Insert, &[(bits, "b".into(), Some(9))], false, what);
        for (q, want) in [("SELECT count(*) FROM f WHERE k > 1.0", 3), ("SELECT count(*) FROM f WHERE k = 1.5", 1)] {
            let got = count(q);
            if got != Ok(want) {
                wrong.push(format!("with a {what} key: want {want}, got {got:?}"));
            }
        }
        fk_apply(&t, &mut model, Op::Delete, &[(bits, "b".into(), None)], false, what);
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
