//! Breaker trial 5: fault classes from public bug reports.
//!
//! - PostgreSQL "fsyncgate": a failed fsync drops the dirty pages it covered (here: the file is
//!   cut back to its last synced length) and a later fsync succeeds; a directory fsync that fails
//!   loses the renames since the last good one (RocksDB/LevelDB manifest-rename recovery bugs).
//!   A test file layer ([`LossyFs`]) does both, plus short writes (ENOSPC after part of a
//!   buffer). After each fault: reopen with a healthy file system shows exactly the acknowledged
//!   writes (a `BTreeMap` model).
//! - `create_table` failing at every file step (FaultFs), then retried.
//! - SQL (DuckDB/DataFusion class): typed predicates pushed or not pushed over files +
//!   deletion vectors + deltas, GROUP BY / DISTINCT / ORDER BY / joins at small limits (exact
//!   or a typed `MemoryLimit`, memory back to the baseline), streams dropped mid-way and
//!   tables dropped mid-stream.
//! - (`gritdb-soak` bad command lines: moved to `soak/tests/cli.rs`.)

#[cfg(feature = "sql")]
use arrow::array::{Array, BooleanArray, Date32Array, Decimal128Array, Int32Array, UInt64Array};
use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, StringArray};
#[cfg(feature = "sql")]
use arrow::datatypes::UInt64Type;
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
#[cfg(feature = "sql")]
use gritdb::memory::Category;
use gritdb::vfs::{FaultFs, Vfs, VfsFile};
use gritdb::{Engine, EngineConfig, Error, ScanOptions, StorageError, Table, WalSync};
#[cfg(feature = "sql")]
use gritdb_tests::settled;
use std::collections::BTreeMap;
use std::io::{self, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// =====================================================================================
// LossyFs: fsyncgate semantics, lost renames, short writes
// =====================================================================================

#[derive(Debug, Default)]
struct LossyState {
    /// Fail the next fsync of a file whose path contains this; its unsynced bytes are lost.
    sync_fail: Option<String>,
    /// The next write to a file whose path contains this writes only part of its buffer (at
    /// most the given bytes, at least 1, less than the buffer), and the following write fails
    /// with ENOSPC.
    short_write: Option<(String, usize)>,
    /// Fail the next directory fsync that follows a rename whose target contains this; the
    /// renames into that directory since its last good fsync are undone.
    dir_sync_fail_after: Option<String>,
    /// Fail the next `sync_dir` of the `wal` directory (undoing creates since the last good one).
    wal_dir_sync_fail: bool,
    armed_dir_fail: bool,
    /// The n-th (1 = next) rename to a path containing this is done, then reported failed
    /// (EIO): a rename whose error does not mean it did not happen (NFS retransmits, a lost
    /// reply).
    rename_lie: Option<(String, u32)>,
    /// Renames into a directory since its last good fsync: (target, previous contents).
    pending: Vec<(PathBuf, Option<Vec<u8>>)>,
    /// Files created in the wal directory since its last good fsync.
    created: Vec<PathBuf>,
    failures: usize,
}

#[derive(Debug, Clone, Default)]
struct LossyFs(Arc<Mutex<LossyState>>);

impl LossyFs {
    fn with<R>(&self, f: impl FnOnce(&mut LossyState) -> R) -> R {
        f(&mut self.0.lock().unwrap())
    }
    fn failures(&self) -> usize {
        self.with(|s| s.failures)
    }
    fn armed(&self) -> bool {
        self.with(|s| {
            s.sync_fail.is_some()
                || s.short_write.is_some()
                || s.dir_sync_fail_after.is_some()
                || s.rename_lie.is_some()
                || s.wal_dir_sync_fail
                || s.armed_dir_fail
        })
    }
}

struct LossyFile {
    f: std::fs::File,
    path: PathBuf,
    synced: u64,
    fail_next_write: bool,
    fs: LossyFs,
}

impl Write for LossyFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.fail_next_write {
            self.fail_next_write = false;
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let p = self.path.to_string_lossy().into_owned();
        let short = self.fs.with(|s| match &s.short_write {
            Some((pat, n)) if p.contains(pat.as_str()) && buf.len() > 1 => {
                let n = (*n).clamp(1, buf.len() - 1);
                s.short_write = None;
                s.failures += 1;
                Some(n)
            }
            _ => None,
        });
        if let Some(n) = short {
            self.fail_next_write = true;
            return self.f.write(&buf[..n]);
        }
        self.f.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.f.flush()
    }
}

impl VfsFile for LossyFile {
    fn sync_all(&mut self) -> io::Result<()> {
        let p = self.path.to_string_lossy().into_owned();
        let fail = self.fs.with(|s| {
            if s.sync_fail.as_ref().is_some_and(|pat| p.contains(pat.as_str())) {
                s.sync_fail = None;
                s.failures += 1;
                true
            } else {
                false
            }
        });
        if fail {
            // fsyncgate: the dirty pages are gone (marked clean after the writeback error);
            // the file keeps only what an earlier fsync made durable.
            self.f.set_len(self.synced)?;
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.f.sync_all()?;
        self.synced = self.f.metadata()?.len();
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.f.metadata()?.len())
    }
}

fn is_wal_dir(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n == "wal")
}

impl Vfs for LossyFs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        let mut f = std::fs::OpenOptions::new().create(true).truncate(true).write(true).read(true).open(path)?;
        f.seek(io::SeekFrom::Start(0))?;
        if path.parent().is_some_and(is_wal_dir) {
            self.with(|s| s.created.push(path.to_path_buf()));
        }
        Ok(Box::new(LossyFile { f, path: path.to_path_buf(), synced: 0, fail_next_write: false, fs: self.clone() }))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let old = std::fs::read(to).ok();
        std::fs::rename(from, to)?;
        let t = to.to_string_lossy().into_owned();
        let lie = self.with(|s| match &mut s.rename_lie {
            Some((pat, n)) if t.contains(pat.as_str()) => {
                *n -= 1;
                if *n == 0 {
                    s.rename_lie = None;
                    s.failures += 1;
                    true
                } else {
                    false
                }
            }
            _ => false,
        });
        if lie {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.with(|s| {
            s.pending.push((to.to_path_buf(), old));
            if s.dir_sync_fail_after.as_ref().is_some_and(|pat| t.contains(pat.as_str())) {
                s.dir_sync_fail_after = None;
                s.armed_dir_fail = true;
            }
        });
        Ok(())
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut s = self.0.lock().unwrap();
        if s.armed_dir_fail {
            s.armed_dir_fail = false;
            s.failures += 1;
            // The renames into `path` since its last good fsync never reached the disk.
            let (undo, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut s.pending).into_iter().partition(|(to, _)| to.parent() == Some(path));
            s.pending = keep;
            for (to, old) in undo.into_iter().rev() {
                match old {
                    Some(bytes) => std::fs::write(&to, bytes)?,
                    None => std::fs::remove_file(&to)?,
                }
            }
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if is_wal_dir(path) && s.wal_dir_sync_fail {
            s.wal_dir_sync_fail = false;
            s.failures += 1;
            for f in std::mem::take(&mut s.created) {
                let _ = std::fs::remove_file(f);
            }
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        s.pending.retain(|(to, _)| to.parent() != Some(path));
        if is_wal_dir(path) {
            s.created.clear();
        }
        drop(s);
        std::fs::File::open(path)?.sync_all()
    }
}

// =====================================================================================
// A (k, v, s) table and its model
// =====================================================================================

type Model = BTreeMap<i64, (i64, String)>;

fn kv_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true), Field::new("s", DataType::Utf8, true)]))
}

fn val(k: i64, ver: i64) -> (i64, String) {
    (k * 10 + ver, format!("v{ver}-{k}-{}", "x".repeat((k % 7) as usize * 5)))
}

fn kv(keys: impl IntoIterator<Item = i64>, ver: i64) -> RecordBatch {
    let keys: Vec<i64> = keys.into_iter().collect();
    let vals: Vec<(i64, String)> = keys.iter().map(|&k| val(k, ver)).collect();
    RecordBatch::try_new(
        kv_schema(),
        vec![
            Arc::new(Int64Array::from(keys)) as ArrayRef,
            Arc::new(Int64Array::from(vals.iter().map(|v| v.0).collect::<Vec<_>>())),
            Arc::new(StringArray::from(vals.into_iter().map(|v| v.1).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

fn kv_keys(keys: impl IntoIterator<Item = i64>) -> RecordBatch {
    let s = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
    RecordBatch::try_new(s, vec![Arc::new(Int64Array::from_iter_values(keys)) as ArrayRef]).unwrap()
}

fn put(m: &mut Model, keys: impl IntoIterator<Item = i64>, ver: i64) {
    for k in keys {
        m.insert(k, val(k, ver));
    }
}

fn read(t: &Table) -> Model {
    let mut out = Model::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<Int64Type>();
        let v = b.column(1).as_primitive::<Int64Type>();
        let s = b.column(2).as_string::<i32>();
        for i in 0..b.num_rows() {
            assert!(out.insert(k.value(i), (v.value(i), s.value(i).to_owned())).is_none(), "key {} twice", k.value(i));
        }
    }
    out
}

fn cfg(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(10))
}

fn lossy_cfg(fs: &LossyFs, mode: WalSync) -> EngineConfig {
    cfg(64 << 20).wal_sync(mode).vfs(Arc::new(fs.clone()))
}

/// Flushes `t`, closes the engine and reopens `dir` with the real file system: the table
/// holds exactly `m`.
fn flush_and_reopen_cleanly_is(dir: &Path, engine: Engine, t: Table, m: &Model, what: &str) {
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir, cfg(64 << 20)).unwrap();
    assert_eq!(&read(&engine.table("t").unwrap()), m, "{what}: after a clean reopen");
}

/// Drops the engine without `close` (the crash the tests can make in process) and reopens the
/// directory with the real file system.
fn crash_reopen(dir: &Path, engine: Engine, t: Table, mode: WalSync) -> (Engine, Table) {
    drop(t);
    drop(engine);
    let engine = Engine::open(dir, cfg(64 << 20).wal_sync(mode)).unwrap_or_else(|e| panic!("reopen with a healthy file system: {e}"));
    let t = engine.table("t").unwrap();
    (engine, t)
}

#[track_caller]
fn assert_io(e: &Error, what: &str) {
    assert!(matches!(e, Error::Storage(StorageError::Io { .. })), "{what}: expected Error::Storage(Io), got {e:?}");
}

// =====================================================================================
// 1. fsyncgate on the WAL (per-batch mode)
// =====================================================================================

/// Per-batch mode, a failed WAL fsync drops the record's dirty pages: the write is refused
/// with `Storage(Io)`, nothing of it is visible, the same keys can be inserted again, and a
/// crash + reopen brings back exactly the acknowledged writes — at several positions in a
/// segment (first record, after several, after a failure already happened).
#[test]
fn fsyncgate_failed_wal_fsync_refuses_the_write_and_reopen_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let fs = LossyFs::default();
    let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut m = Model::new();
    for round in 0..4i64 {
        let base = round * 10_000;
        t.insert(&kv(base..base + 100, 1)).unwrap();
        put(&mut m, base..base + 100, 1);
        fs.with(|s| s.sync_fail = Some("/wal/".into()));
        // Small batches and big ones (>= 1,024 rows: their record is encoded on the WAL pool).
        let w = if round % 2 == 0 { 100 } else { 1_500 };
        let e = t.insert(&kv(base + 100..base + 100 + w, 2)).unwrap_err();
        assert_io(&e, "insert whose fsync failed");
        assert!(!fs.armed());
        assert_eq!(read(&t), m, "round {round}: the refused insert is not visible");
        // An upsert and a delete over acknowledged rows, then the refused keys again.
        fs.with(|s| s.sync_fail = Some("/wal/".into()));
        assert_io(&t.delete(&kv_keys(base..base + 10)).unwrap_err(), "delete whose fsync failed");
        assert_eq!(read(&t), m, "round {round}: the refused delete is not visible");
        t.insert(&kv(base + 100..base + 100 + w, 3)).unwrap();
        put(&mut m, base + 100..base + 100 + w, 3);
        t.upsert(&kv(base + 50..base + 150, 4)).unwrap();
        put(&mut m, base + 50..base + 150, 4);
        if round == 2 {
            t.flush().unwrap();
        }
    }
    assert_eq!(fs.failures(), 8);
    let (engine, t) = crash_reopen(dir.path(), engine, t, WalSync::PerBatch);
    assert_eq!(read(&t), m, "after reopen: exactly the acknowledged writes");
    assert_eq!(t.row_count().unwrap(), m.len() as u64);
    drop(t);
    engine.close().unwrap();
}

// =====================================================================================
// 2. Short writes mid WAL record (both modes)
// =====================================================================================

/// ENOSPC after part of a WAL record (a short write, then an error): the write is refused
/// whole, the torn bytes are cut, later writes work and a crash + reopen shows exactly the
/// acknowledged rows. Cut points from 1 byte into the record to near its end, in both modes.
#[test]
fn a_short_write_mid_wal_record_is_refused_and_reopen_is_exact() {
    for mode in [WalSync::PerBatch, WalSync::Relaxed] {
        for cut in [1usize, 7, 40, 300, 5_000, 60_000] {
            let dir = tempfile::tempdir().unwrap();
            let fs = LossyFs::default();
            let engine = Engine::open(dir.path(), lossy_cfg(&fs, mode)).unwrap();
            let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
            let mut m = Model::new();
            t.insert(&kv(0..500, 1)).unwrap();
            put(&mut m, 0..500, 1);
            fs.with(|s| s.short_write = Some(("/wal/".into(), cut)));
            let e = t.upsert(&kv(0..2_000, 2)).unwrap_err();
            assert_io(&e, &format!("{mode:?} cut {cut}"));
            assert_eq!(fs.failures(), 1, "{mode:?} cut {cut}: the short write happened");
            assert_eq!(read(&t), m, "{mode:?} cut {cut}: nothing of the refused upsert");
            t.insert(&kv(500..600, 3)).unwrap();
            put(&mut m, 500..600, 3);
            t.delete(&kv_keys(0..20)).unwrap();
            for k in 0..20 {
                m.remove(&k);
            }
            let (engine, t) = crash_reopen(dir.path(), engine, t, mode);
            assert_eq!(read(&t), m, "{mode:?} cut {cut}: after reopen");
            drop(t);
            engine.close().unwrap();
        }
    }
}

// =====================================================================================
// 3. fsyncgate on a data file
// =====================================================================================

/// A failed fsync of the flush's Parquet file loses its pages (the file is cut to 0 bytes):
/// the flush fails with `Storage(Io)`, rows are still served, a retried flush succeeds and
/// both a crash + reopen and a clean reopen are exact, the files all readable.
#[test]
fn fsyncgate_failed_data_file_fsync_then_retry_and_reopen_are_exact() {
    for (crash_first, short) in [(true, None), (false, None), (true, Some(3usize)), (false, Some(1_000)), (false, Some(20_000))] {
        let dir = tempfile::tempdir().unwrap();
        let fs = LossyFs::default();
        let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let mut m = Model::new();
        t.insert(&kv(0..3_000, 1)).unwrap();
        put(&mut m, 0..3_000, 1);
        t.flush().unwrap();
        t.upsert(&kv(2_000..4_000, 2)).unwrap();
        put(&mut m, 2_000..4_000, 2);
        t.delete(&kv_keys((0..100).map(|i| i * 7))).unwrap();
        for i in 0..100 {
            m.remove(&(i * 7));
        }
        match short {
            None => fs.with(|s| s.sync_fail = Some(".parquet".into())),
            Some(n) => fs.with(|s| s.short_write = Some((".parquet".into(), n))),
        }
        let e = t.flush().unwrap_err();
        assert!(matches!(e, Error::Storage(StorageError::Io { .. } | StorageError::Parquet(_))), "short {short:?}: {e:?}");
        assert_eq!(fs.failures(), 1);
        assert_eq!(read(&t), m, "rows served after the failed flush");
        let (engine, t) = if crash_first {
            crash_reopen(dir.path(), engine, t, WalSync::PerBatch)
        } else {
            t.flush().unwrap();
            assert_eq!(read(&t), m);
            crash_reopen(dir.path(), engine, t, WalSync::PerBatch)
        };
        assert_eq!(read(&t), m, "crash_first={crash_first}: after reopen");
        flush_and_reopen_cleanly_is(dir.path(), engine, t, &m, &format!("crash_first={crash_first}"));
    }
}

// =====================================================================================
// 4. Short write of the manifest's temp file
// =====================================================================================

/// ENOSPC part-way through `manifest.json.tmp`: the flush fails typed, no temp file stays, and
/// a crash right after (rows only in the WAL) or a retried flush both reopen exactly.
#[test]
fn a_short_write_of_the_manifest_then_crash_or_retry_reopens_exactly() {
    for (crash_first, cut) in [(true, 1usize), (true, 100), (false, 10), (false, 400)] {
        let dir = tempfile::tempdir().unwrap();
        let fs = LossyFs::default();
        let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let mut m = Model::new();
        t.insert(&kv(0..1_000, 1)).unwrap();
        put(&mut m, 0..1_000, 1);
        t.flush().unwrap();
        t.upsert(&kv(500..1_500, 2)).unwrap();
        put(&mut m, 500..1_500, 2);
        t.delete(&kv_keys([1, 2, 3, 600])).unwrap();
        for k in [1, 2, 3, 600] {
            m.remove(&k);
        }
        fs.with(|s| s.short_write = Some(("manifest.json.tmp".into(), cut)));
        let e = t.flush().unwrap_err();
        assert_io(&e, &format!("cut {cut}"));
        assert_eq!(fs.failures(), 1);
        let tdir = std::fs::read_dir(dir.path().join("tables")).unwrap().flatten().next().unwrap().path();
        let tmps: Vec<String> =
            std::fs::read_dir(&tdir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".tmp")).collect();
        assert!(tmps.is_empty(), "cut {cut}: temp files left: {tmps:?}");
        assert_eq!(read(&t), m);
        if !crash_first {
            t.flush().unwrap();
        }
        let (engine, t) = crash_reopen(dir.path(), engine, t, WalSync::PerBatch);
        assert_eq!(read(&t), m, "cut {cut}, crash_first={crash_first}: after reopen");
        drop(t);
        engine.close().unwrap();
    }
}

// =====================================================================================
// 5. A manifest rename lost by a failed directory fsync
// =====================================================================================

/// The manifest's rename is done, then the directory fsync fails and the rename never reached
/// the disk (the old manifest is back on disk). The flush must report the error, and neither
/// a crash right after nor more writes + a later successful flush may lose the rows the lost
/// manifest covered: the WAL must still hold them. Reopen is exact both ways.
#[test]
fn a_manifest_rename_lost_by_a_failed_dir_fsync_loses_no_acknowledged_row() {
    for crash_first in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let fs = LossyFs::default();
        let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let mut m = Model::new();
        t.insert(&kv(0..2_000, 1)).unwrap();
        put(&mut m, 0..2_000, 1);
        t.flush().unwrap();
        t.upsert(&kv(1_000..3_000, 2)).unwrap();
        put(&mut m, 1_000..3_000, 2);
        t.delete(&kv_keys(0..50)).unwrap();
        for k in 0..50 {
            m.remove(&k);
        }
        fs.with(|s| s.dir_sync_fail_after = Some("manifest.json".into()));
        let res = t.flush();
        assert_eq!(fs.failures(), 1, "the directory fsync after the manifest rename failed");
        let e = res.expect_err("a flush whose manifest directory fsync failed must not report success");
        assert_io(&e, "flush");
        assert_eq!(read(&t), m);
        if !crash_first {
            t.insert(&kv(5_000..5_100, 3)).unwrap();
            put(&mut m, 5_000..5_100, 3);
            t.flush().unwrap();
            t.upsert(&kv(5_050..5_150, 4)).unwrap();
            put(&mut m, 5_050..5_150, 4);
        }
        let (engine, t) = crash_reopen(dir.path(), engine, t, WalSync::PerBatch);
        assert_eq!(read(&t), m, "crash_first={crash_first}: after reopen");
        drop(t);
        engine.close().unwrap();
        let engine = Engine::open(dir.path(), cfg(64 << 20)).unwrap();
        assert_eq!(read(&engine.table("t").unwrap()), m, "crash_first={crash_first}: after a clean reopen");
    }
}

// =====================================================================================
// 6. A data-file rename lost by a failed directory fsync
// =====================================================================================

/// The flush's Parquet file is renamed into place, then the directory fsync fails and the
/// rename is lost (the file is gone). The flush fails typed; a retry or a crash both reopen
/// exactly, and the reopened table names no missing file.
#[test]
fn a_data_file_rename_lost_by_a_failed_dir_fsync_then_crash_or_retry_is_exact() {
    for (crash_first, pat) in [(true, ".parquet"), (false, ".parquet"), (true, ".dv"), (false, ".dv")] {
        let dir = tempfile::tempdir().unwrap();
        let fs = LossyFs::default();
        let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let mut m = Model::new();
        t.insert(&kv(0..2_000, 1)).unwrap();
        put(&mut m, 0..2_000, 1);
        if pat == ".dv" {
            // A flush that writes a deletion vector for the first file.
            t.flush().unwrap();
            t.delete(&kv_keys((0..2_000).step_by(3))).unwrap();
            for k in (0..2_000).step_by(3) {
                m.remove(&k);
            }
            t.upsert(&kv(1_900..2_100, 5)).unwrap();
            put(&mut m, 1_900..2_100, 5);
        }
        fs.with(|s| s.dir_sync_fail_after = Some(pat.into()));
        let e = t.flush().unwrap_err();
        assert_io(&e, &format!("flush whose {pat} directory fsync failed"));
        assert_eq!(fs.failures(), 1, "{pat}");
        assert_eq!(read(&t), m);
        if !crash_first {
            t.flush().unwrap();
            assert_eq!(read(&t), m);
        }
        let (engine, t) = crash_reopen(dir.path(), engine, t, WalSync::PerBatch);
        assert_eq!(read(&t), m, "{pat} crash_first={crash_first}: after reopen");
        t.upsert(&kv(1_500..2_500, 2)).unwrap();
        put(&mut m, 1_500..2_500, 2);
        flush_and_reopen_cleanly_is(dir.path(), engine, t, &m, &format!("crash_first={crash_first}"));
    }
}

// =====================================================================================
// 6b. A manifest rename that reports an error after it happened
// =====================================================================================

/// The manifest rename of a flush commit (n = 1) or of the compaction that follows it in the
/// same flush (n = 2) happens but returns EIO. The flush fails typed; the engine cannot know
/// which manifest is on disk, so it must keep every file either names: a crash right after
/// must reopen (no `CorruptFile` for a file the on-disk manifest names) with exactly the
/// acknowledged rows.
#[test]
fn a_manifest_rename_that_fails_after_it_happened_keeps_every_named_file() {
    // Calibrate: the fourth small flush compacts the four files into one.
    let compacts = |fs: Option<&LossyFs>| -> (tempfile::TempDir, Engine, Table, Model) {
        let dir = tempfile::tempdir().unwrap();
        let config = match fs {
            Some(fs) => lossy_cfg(fs, WalSync::PerBatch),
            None => cfg(64 << 20),
        };
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let mut m = Model::new();
        for i in 0..3 {
            t.insert(&kv(i * 100..(i + 1) * 100, 1)).unwrap();
            put(&mut m, i * 100..(i + 1) * 100, 1);
            t.flush().unwrap();
        }
        t.insert(&kv(300..400, 2)).unwrap();
        put(&mut m, 300..400, 2);
        (dir, engine, t, m)
    };
    {
        let (_dir, engine, t, m) = compacts(None);
        t.flush().unwrap();
        assert_eq!(t.stats().unwrap().files, 1, "the fourth flush compacts");
        assert_eq!(read(&t), m);
        drop(t);
        engine.close().unwrap();
    }
    let mut wrong = Vec::new();
    for n in [1u32, 2] {
        let fs = LossyFs::default();
        let (dir, engine, t, m) = compacts(Some(&fs));
        fs.with(|s| s.rename_lie = Some(("manifest.json".into(), n)));
        let res = t.flush();
        assert_eq!(fs.failures(), 1, "n {n}: the lying rename happened");
        if let Err(e) = &res {
            assert_io(e, &format!("n {n}"));
        }
        assert_eq!(read(&t), m, "n {n}: rows served after the failed flush");
        drop(t);
        drop(engine);
        match Engine::open(dir.path(), cfg(64 << 20)) {
            Ok(engine) => {
                let got = read(&engine.table("t").unwrap());
                if got != m {
                    wrong.push(format!("n {n}: reopen shows {} rows, want {}", got.len(), m.len()));
                }
                engine.close().unwrap();
            }
            Err(e) => wrong.push(format!("n {n} (flush result {:?}): reopen fails: {e}", res.as_ref().map_err(ToString::to_string))),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// An export whose rename replaced the target and then reported `EIO`: the caller gets the
/// error, so no file of the export stays (neither the target nor a tmp file); before,
/// `renamed` was set only on success and the complete file stayed beside the error. Then an
/// export over an existing file failing at each step (`FaultFs`: a failing rename does not
/// happen): the old file is kept byte for byte at every step but one — the directory fsync
/// after the rename, whose new file is removed — and the healthy export replaces it.
#[test]
fn an_export_whose_rename_fails_after_it_happened_leaves_no_file() {
    let fs = LossyFs::default();
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv(0..500, 1)).unwrap();
    let path = out.path().join("e.parquet");
    fs.with(|s| s.rename_lie = Some(("e.parquet".into(), 1)));
    let err = t.export_parquet(&path).unwrap_err();
    assert_eq!(fs.failures(), 1, "the lying rename happened");
    assert!(matches!(err, gritdb::ExportError::Io { .. }), "{err:?}");
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0, "no file of the failed export");
    assert_eq!(t.export_parquet(&path).unwrap().rows, 500);
    drop(t);
    engine.close().unwrap();

    let ffs = FaultFs::new();
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 << 20).vfs(Arc::new(ffs.clone()))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv(0..500, 1)).unwrap();
    let over = gritdb::ExportOptions::default().overwrite(true);
    let (mut step, mut removed) = (0u64, 0);
    loop {
        assert!(step < 1_000, "the export never completed");
        std::fs::write(&path, b"the old file").unwrap();
        ffs.fail_step(step, libc::EIO);
        match t.export_parquet_with(&path, &over) {
            Ok(stats) => {
                assert_eq!(stats.rows, 500);
                break;
            }
            Err(e) => {
                assert!(matches!(e, gritdb::ExportError::Io { .. }), "step {step}: {e:?}");
                match std::fs::read(&path) {
                    Ok(bytes) => assert_eq!(bytes, b"the old file", "step {step}"),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => removed += 1,
                    Err(e) => panic!("step {step}: {e}"),
                }
                assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1 - usize::from(!path.exists()), "step {step}: a tmp file left");
                step += 1;
            }
        }
    }
    ffs.heal();
    assert_eq!(removed, 1, "only the directory fsync after the rename loses the old file");
    assert!(step >= 4, "create, write, fsync, rename, directory fsync: {step} failing steps");
    drop(t);
    engine.close().unwrap();
}

// =====================================================================================
// 7. A new WAL segment whose directory fsync fails
// =====================================================================================

/// The first write of a fresh engine creates a WAL segment and fsyncs the `wal` directory;
/// that fsync fails and the segment's directory entry is lost. The write is refused typed,
/// the next write works and a crash + reopen is exact (nothing of the refused write).
#[test]
fn a_wal_segment_whose_dir_fsync_fails_refuses_the_write_and_reopen_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let fs = LossyFs::default();
    let engine = Engine::open(dir.path(), lossy_cfg(&fs, WalSync::PerBatch)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut m = Model::new();
    fs.with(|s| s.wal_dir_sync_fail = true);
    let e = t.insert(&kv(0..100, 1)).unwrap_err();
    assert!(matches!(e, Error::Storage(StorageError::Io { .. }) | Error::Io { .. }), "{e:?}");
    assert_eq!(fs.failures(), 1);
    assert_eq!(read(&t), m, "nothing of the refused insert");
    t.insert(&kv(0..100, 2)).unwrap();
    put(&mut m, 0..100, 2);
    t.insert(&kv(100..200, 3)).unwrap();
    put(&mut m, 100..200, 3);
    let (engine, t) = crash_reopen(dir.path(), engine, t, WalSync::PerBatch);
    assert_eq!(read(&t), m);
    drop(t);
    engine.close().unwrap();
}

// =====================================================================================
// 8. create_table failing at every file step
// =====================================================================================

/// `create_table` through FaultFs failing at each of its write-side steps (directory,
/// manifest temp file, write, fsync, rename, directory fsyncs): a typed error, the name not
/// taken, a retry succeeds, and after a crash the directory opens with exactly the table and
/// its acknowledged rows.
#[test]
fn create_table_failing_at_every_step_then_retried_reopens_exactly() {
    let mut step = 0u64;
    let mut failed_steps = 0;
    loop {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::new();
        let engine = Engine::open(dir.path(), cfg(64 << 20).vfs(Arc::new(fs.clone()))).unwrap();
        let before = fs.steps();
        fs.fail_step(step, libc::EIO);
        let res = engine.create_table("t", kv_schema(), &["k"]);
        let failed = res.is_err();
        if let Err(e) = &res {
            failed_steps += 1;
            assert!(matches!(e, Error::Storage(_) | Error::Io { .. }), "step {step}: {e:?}");
            assert!(engine.table_names().is_empty(), "step {step}: a failed create leaves no table: {:?}", engine.table_names());
            assert!(matches!(engine.table("t"), Err(Error::TableNotFound { .. })), "step {step}");
        }
        fs.heal();
        drop(res);
        let t = match engine.table("t") {
            Ok(t) => t,
            Err(_) => engine.create_table("t", kv_schema(), &["k"]).unwrap_or_else(|e| panic!("step {step}: retry of create_table: {e}")),
        };
        let mut m = Model::new();
        t.insert(&kv(0..300, 1)).unwrap();
        put(&mut m, 0..300, 1);
        let (engine, t) = crash_reopen(dir.path(), engine, t, WalSync::PerBatch);
        assert_eq!(engine.table_names(), vec!["t".to_owned()], "step {step}");
        assert_eq!(read(&t), m, "step {step}");
        drop(t);
        engine.close().unwrap();
        if !failed {
            assert!(step >= 4 && fs.steps() > before, "the walk covered the create's steps (step {step})");
            break;
        }
        step += 1;
    }
    assert!(failed_steps >= 4, "{failed_steps}");
}

// =====================================================================================
// SQL
// =====================================================================================

#[derive(Debug, Clone, PartialEq)]
#[cfg(feature = "sql")]
struct TRow {
    i32: Option<i32>,
    u64: Option<u64>,
    d: Option<i128>, // cents
    s: Option<String>,
    dt: Option<i32>,
    b: Option<bool>,
}

#[cfg(feature = "sql")]
fn trow(id: i64, ver: i64) -> TRow {
    let h = id * 31 + ver * 17;
    TRow {
        i32: (id % 17 != 0).then(|| ((id * 7 + ver * 3) % 1000) as i32 - 500),
        u64: (id % 19 != 0).then(|| if id % 5 == 0 { u64::MAX - id as u64 } else { (id * 1_000 + ver) as u64 }),
        d: (id % 23 != 0).then(|| i128::from((h * 37) % 20_000 - 10_000)),
        s: (id % 29 != 0).then(|| if id % 31 == 0 { String::new() } else { format!("s{:04}", (id * 13 + ver) % 3000) }),
        dt: (id % 37 != 0).then(|| 9_990 + ((id * 3 + ver) % 400) as i32),
        b: (id % 41 != 0).then_some((id + ver) % 3 == 0),
    }
}

#[cfg(feature = "sql")]
fn typed_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("i32", DataType::Int32, true),
        Field::new("u64", DataType::UInt64, true),
        Field::new("d", DataType::Decimal128(12, 2), true),
        Field::new("s", DataType::Utf8, true),
        Field::new("dt", DataType::Date32, true),
        Field::new("b", DataType::Boolean, true),
    ]))
}

#[cfg(feature = "sql")]
fn typed_batch(ids: &[i64], ver: i64) -> RecordBatch {
    let rows: Vec<TRow> = ids.iter().map(|&i| trow(i, ver)).collect();
    RecordBatch::try_new(
        typed_schema(),
        vec![
            Arc::new(Int64Array::from(ids.to_vec())) as ArrayRef,
            Arc::new(Int32Array::from(rows.iter().map(|r| r.i32).collect::<Vec<_>>())),
            Arc::new(UInt64Array::from(rows.iter().map(|r| r.u64).collect::<Vec<_>>())),
            Arc::new(Decimal128Array::from(rows.iter().map(|r| r.d).collect::<Vec<_>>()).with_precision_and_scale(12, 2).unwrap()),
            Arc::new(StringArray::from(rows.iter().map(|r| r.s.clone()).collect::<Vec<_>>())),
            Arc::new(Date32Array::from(rows.iter().map(|r| r.dt).collect::<Vec<_>>())),
            Arc::new(BooleanArray::from(rows.iter().map(|r| r.b).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

#[cfg(feature = "sql")]
fn id_keys(ids: &[i64]) -> RecordBatch {
    let s = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(ids.to_vec())) as ArrayRef]).unwrap()
}

#[cfg(feature = "sql")]
fn sql_open(dir: &Path, limit: usize) -> Engine {
    Engine::open(dir, cfg(limit).backpressure_timeout(Duration::from_secs(5))).unwrap()
}

/// (count, sum of the first column) of a one-row answer `SELECT count(*), sum(x) ...`.
#[cfg(feature = "sql")]
fn count_sum(batches: &[RecordBatch]) -> (i64, i64) {
    let b: Vec<&RecordBatch> = batches.iter().filter(|b| b.num_rows() > 0).collect();
    assert_eq!((b.len(), b[0].num_rows()), (1, 1), "{batches:?}");
    let c = arrow::compute::cast(b[0].column(0), &DataType::Int64).unwrap();
    let s = arrow::compute::cast(b[0].column(1), &DataType::Int64).unwrap();
    let s = s.as_primitive::<Int64Type>();
    (c.as_primitive::<Int64Type>().value(0), if s.is_null(0) { 0 } else { s.value(0) })
}

/// Typed predicates (pushed into the scan and not) over a table whose rows are in a file, a
/// second file with a deletion vector on the first, and the active delta: SQL's count and
/// sum equal the model's, and the scan API's rows equal the model.
#[test]
#[cfg(feature = "sql")]
fn sql_typed_predicates_over_files_dvs_and_deltas_match_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let engine = sql_open(dir.path(), 64 << 20);
    let t = engine.create_table("t", typed_schema(), &["id"]).unwrap();
    let mut m: BTreeMap<i64, TRow> = BTreeMap::new();
    let all: Vec<i64> = (0..3_000).collect();
    t.insert(&typed_batch(&all, 1)).unwrap();
    m.extend(all.iter().map(|&i| (i, trow(i, 1))));
    t.flush().unwrap();
    let del: Vec<i64> = (0..3_000).filter(|i| i % 10 == 1).collect();
    t.delete(&id_keys(&del)).unwrap();
    for i in &del {
        m.remove(i);
    }
    let up2: Vec<i64> = (0..3_000).step_by(7).filter(|i| i % 10 != 1).collect();
    t.update(&typed_batch(&up2, 2)).unwrap();
    m.extend(up2.iter().map(|&i| (i, trow(i, 2))));
    t.flush().unwrap();
    let up3: Vec<i64> = (0..3_200).step_by(11).collect();
    t.upsert(&typed_batch(&up3, 3)).unwrap();
    m.extend(up3.iter().map(|&i| (i, trow(i, 3))));
    let del2: Vec<i64> = (0..3_200).step_by(13).collect();
    t.delete(&id_keys(&del2)).unwrap();
    for i in &del2 {
        m.remove(i);
    }
    // The scan API's rows are the model's.
    let mut scanned = 0usize;
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let ids = b.column(0).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            let id = ids.value(i);
            let r = &m[&id];
            let u = b.column(2).as_primitive::<UInt64Type>();
            assert_eq!(u.is_valid(i).then(|| u.value(i)), r.u64, "id {id}");
            let s = b.column(4).as_string::<i32>();
            assert_eq!(s.is_valid(i).then(|| s.value(i).to_owned()), r.s, "id {id}");
        }
        scanned += b.num_rows();
    }
    assert_eq!(scanned, m.len());

    type P = Box<dyn Fn(&TRow, i64) -> bool>;
    let d = |x: i128| x; // cents
    let preds: Vec<(&str, P)> = vec![
        ("i32 > 100", Box::new(|r, _| r.i32.is_some_and(|v| v > 100))),
        ("100 < i32", Box::new(|r, _| r.i32.is_some_and(|v| v > 100))),
        ("i32 <> 0", Box::new(|r, _| r.i32.is_some_and(|v| v != 0))),
        ("i32 = 7", Box::new(|r, _| r.i32 == Some(7))),
        ("i32 BETWEEN -10 AND 10", Box::new(|r, _| r.i32.is_some_and(|v| (-10..=10).contains(&v)))),
        ("i32 > 100 OR i32 IS NULL", Box::new(|r, _| r.i32.is_none_or(|v| v > 100))),
        ("NOT (i32 > 100)", Box::new(|r, _| r.i32.is_some_and(|v| v <= 100))),
        ("i32 < 2.5", Box::new(|r, _| r.i32.is_some_and(|v| v <= 2))),
        ("i32 > 3000000000", Box::new(|_, _| false)),
        ("i32 > -3000000000", Box::new(|r, _| r.i32.is_some())),
        ("u64 > 100000", Box::new(|r, _| r.u64.is_some_and(|v| v > 100_000))),
        ("u64 > 9223372036854775807", Box::new(|r, _| r.u64.is_some_and(|v| v > i64::MAX as u64))),
        ("u64 >= 18446744073709551000", Box::new(|r, _| r.u64.is_some_and(|v| v >= 18_446_744_073_709_551_000))),
        ("u64 > -1", Box::new(|r, _| r.u64.is_some())),
        ("u64 <> 5001", Box::new(|r, _| r.u64.is_some_and(|v| v != 5001))),
        ("d > 1.5", Box::new(move |r, _| r.d.is_some_and(|v| v > d(150)))),
        ("d >= -0.01", Box::new(|r, _| r.d.is_some_and(|v| v >= -1))),
        ("d = 12.34", Box::new(|r, _| r.d == Some(1234))),
        ("d BETWEEN -1.005 AND 1.005", Box::new(|r, _| r.d.is_some_and(|v| (-100..=100).contains(&v)))),
        ("d < 100", Box::new(|r, _| r.d.is_some_and(|v| v < 10_000))),
        ("d <> 0", Box::new(|r, _| r.d.is_some_and(|v| v != 0))),
        ("s = 's0013'", Box::new(|r, _| r.s.as_deref() == Some("s0013"))),
        ("s > 's1500'", Box::new(|r, _| r.s.as_deref().is_some_and(|v| v > "s1500"))),
        ("s >= ''", Box::new(|r, _| r.s.is_some())),
        ("s = ''", Box::new(|r, _| r.s.as_deref() == Some(""))),
        ("s < 's'", Box::new(|r, _| r.s.as_deref().is_some_and(|v| v < "s"))),
        ("s BETWEEN 's0100' AND 's0200'", Box::new(|r, _| r.s.as_deref().is_some_and(|v| ("s0100"..="s0200").contains(&v)))),
        ("s LIKE 's00%'", Box::new(|r, _| r.s.as_deref().is_some_and(|v| v.starts_with("s00")))),
        ("s IS NOT NULL AND s <> ''", Box::new(|r, _| r.s.as_deref().is_some_and(|v| !v.is_empty()))),
        ("dt > DATE '1997-05-01'", Box::new(|r, _| r.dt.is_some_and(|v| v > 9_982))),
        ("dt = '1997-05-20'", Box::new(|r, _| r.dt == Some(10_001))),
        ("dt BETWEEN DATE '1997-05-01' AND DATE '1997-06-01'", Box::new(|r, _| r.dt.is_some_and(|v| (9_982..=10_013).contains(&v)))),
        ("b", Box::new(|r, _| r.b == Some(true))),
        ("b = true", Box::new(|r, _| r.b == Some(true))),
        ("b <> true", Box::new(|r, _| r.b == Some(false))),
        ("NOT b", Box::new(|r, _| r.b == Some(false))),
        ("b IS NULL", Box::new(|r, _| r.b.is_none())),
        ("b = false OR b IS NULL", Box::new(|r, _| r.b != Some(true))),
        ("i32 > 400 OR s = 's0001'", Box::new(|r, _| r.i32.is_some_and(|v| v > 400) || r.s.as_deref() == Some("s0001"))),
        ("(d > 0 AND i32 < 0) OR b IS NULL", Box::new(|r, _| (r.d.is_some_and(|v| v > 0) && r.i32.is_some_and(|v| v < 0)) || r.b.is_none())),
        ("id >= 3000", Box::new(|_, id| id >= 3000)),
        ("id < 10", Box::new(|_, id| id < 10)),
        ("id = 1", Box::new(|_, id| id == 1)),
        ("id <> 1 AND id > 2990", Box::new(|_, id| id != 1 && id > 2990)),
    ];
    let mut wrong = Vec::new();
    for (p, f) in &preds {
        let want_n = m.iter().filter(|(id, r)| f(r, **id)).count() as i64;
        let want_s: i64 = m.iter().filter(|(id, r)| f(r, **id)).map(|(id, _)| *id).sum();
        let q = format!("SELECT count(*), sum(id) FROM t WHERE {p}");
        match engine.sql(&q) {
            Ok(b) => {
                let got = count_sum(&b);
                if got != (want_n, want_s) {
                    wrong.push(format!("{p}: want {:?}, got {got:?}", (want_n, want_s)));
                }
            }
            Err(e) => wrong.push(format!("{p}: error {e}")),
        }
    }
    // Aggregates, LIMIT/OFFSET over deletion vectors and deltas, IN lists, the system table.
    let n = m.len() as i64;
    let dsum: i128 = m.values().filter_map(|r| r.d).sum();
    let umax = m.values().filter_map(|r| r.u64).max().unwrap();
    let smax = m.values().filter_map(|r| r.s.clone()).max().unwrap();
    let checks: Vec<(&str, String)> = vec![
        ("SELECT CAST(sum(d) * 100 AS BIGINT) FROM t", (dsum as i64).to_string()),
        ("SELECT CAST(max(u64) AS VARCHAR) FROM t", umax.to_string()),
        ("SELECT max(s) FROM t", smax.clone()),
        ("SELECT count(*) FROM (SELECT id FROM t LIMIT 50 OFFSET 2600)", (n - 2600).clamp(0, 50).to_string()),
        ("SELECT count(*) FROM (SELECT id FROM t WHERE i32 > 0 LIMIT 7)", 7.to_string()),
        (
            "SELECT count(*) FROM t WHERE id IN (0, 1, 2, 3, 7, 3000, 3003)",
            [0i64, 1, 2, 3, 7, 3000, 3003].iter().filter(|i| m.contains_key(i)).count().to_string(),
        ),
        ("SELECT CAST(rows AS BIGINT) FROM gritdb_tables WHERE name = 't'", n.to_string()),
        ("SELECT count(DISTINCT s) FROM t", m.values().filter_map(|r| r.s.clone()).collect::<std::collections::BTreeSet<_>>().len().to_string()),
    ];
    for (q, want) in &checks {
        match engine.sql(q) {
            Ok(b) => {
                let b: Vec<&RecordBatch> = b.iter().filter(|b| b.num_rows() > 0).collect();
                let got = arrow::util::display::array_value_to_string(b[0].column(0), 0).unwrap();
                if &got != want {
                    wrong.push(format!("{q}: want {want}, got {got}"));
                }
            }
            Err(e) => wrong.push(format!("{q}: error {e}")),
        }
    }
    assert!(wrong.is_empty(), "SQL answers differ from the model:\n{}", wrong.join("\n"));
}

/// A table of `n` rows with many groups and long strings, layered: a file, a deletion vector,
/// a second file and the active delta. Returns the model id -> (grp, s).
#[cfg(feature = "sql")]
fn group_table(engine: &Engine, n: i64) -> BTreeMap<i64, (i64, String)> {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("grp", DataType::Int64, false),
        Field::new("s", DataType::Utf8, false),
    ]));
    let t = engine.create_table("g", Arc::clone(&schema), &["id"]).unwrap();
    let row = |id: i64, ver: i64| (id % 20_011, format!("str-{:06}-{}", (id * 7 + ver) % 30_011, "p".repeat(40)));
    let batch = |ids: &[i64], ver: i64| {
        let r: Vec<(i64, String)> = ids.iter().map(|&i| row(i, ver)).collect();
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from(ids.to_vec())) as ArrayRef,
                Arc::new(Int64Array::from(r.iter().map(|x| x.0).collect::<Vec<_>>())),
                Arc::new(StringArray::from(r.into_iter().map(|x| x.1).collect::<Vec<_>>())),
            ],
        )
        .unwrap()
    };
    let mut m = BTreeMap::new();
    for start in (0..n).step_by(25_000) {
        let ids: Vec<i64> = (start..(start + 25_000).min(n)).collect();
        t.insert(&batch(&ids, 0)).unwrap();
        m.extend(ids.iter().map(|&i| (i, row(i, 0))));
    }
    t.flush().unwrap();
    let del: Vec<i64> = (0..n).step_by(9).collect();
    t.delete(&id_keys(&del)).unwrap();
    for i in &del {
        m.remove(i);
    }
    let up: Vec<i64> = (1..n).step_by(5).filter(|i| i % 9 != 0).collect();
    t.update(&batch(&up, 1)).unwrap();
    m.extend(up.iter().map(|&i| (i, row(i, 1))));
    t.flush().unwrap();
    let up2: Vec<i64> = (0..n + 3_000).step_by(13).collect();
    t.upsert(&batch(&up2, 2)).unwrap();
    m.extend(up2.iter().map(|&i| (i, row(i, 2))));
    m
}

/// GROUP BY with ~20k groups, count(DISTINCT) and DISTINCT + ORDER BY on strings, a full sort:
/// at 64, 24 and 12 MiB each query answers exactly or fails with `MemoryLimit { Query }`, and
/// afterwards every category is back at its baseline.
#[test]
#[cfg(feature = "sql")]
fn sql_group_by_distinct_and_order_by_at_small_limits_are_exact_or_a_memory_error() {
    let src = tempfile::tempdir().unwrap();
    let n = 150_000i64;
    let m = {
        let engine = sql_open(src.path(), 128 << 20);
        let m = group_table(&engine, n);
        engine.close().unwrap();
        m
    };
    let mut groups: BTreeMap<i64, (i64, i64)> = BTreeMap::new();
    for (id, (g, _)) in &m {
        let e = groups.entry(*g).or_default();
        e.0 += 1;
        e.1 += id;
    }
    let mut strings: Vec<&String> = m.values().map(|(_, s)| s).collect();
    strings.sort();
    strings.dedup();
    let mut by_s: Vec<(&String, i64)> = m.iter().map(|(id, (_, s))| (s, *id)).collect();
    by_s.sort();
    let mut outcomes = Vec::new();
    for limit in [64usize << 20, 24 << 20, 12 << 20] {
        let engine = sql_open(src.path(), limit);
        let base = settled(&engine);
        let mut check = |q: &str, verify: &dyn Fn(&[RecordBatch]) -> Result<(), String>| {
            let res = engine.sql(q);
            let tag = match &res {
                Ok(b) => {
                    if let Err(why) = verify(b) {
                        panic!("{} MiB: {q}: wrong answer: {why}", limit >> 20);
                    }
                    "ok".to_owned()
                }
                Err(Error::MemoryLimit { category: Category::Query, .. }) => "MemoryLimit".to_owned(),
                Err(e) => panic!("{} MiB: {q}: untyped or unexpected error: {e:?}", limit >> 20),
            };
            drop(res);
            assert_eq!(settled(&engine), base, "{} MiB: {q}: memory back at the baseline", limit >> 20);
            assert!(engine.memory().peak() <= limit, "{} MiB: {q}: peak above the limit", limit >> 20);
            outcomes.push(format!("{} MiB {q}: {tag}", limit >> 20));
        };
        check("SELECT grp, count(*) AS n, sum(id) AS s FROM g GROUP BY grp", &|b| {
            let mut got = BTreeMap::new();
            for b in b {
                let g = b.column(0).as_primitive::<Int64Type>();
                let c = arrow::compute::cast(b.column(1), &DataType::Int64).unwrap();
                let s = b.column(2).as_primitive::<Int64Type>();
                for i in 0..b.num_rows() {
                    got.insert(g.value(i), (c.as_primitive::<Int64Type>().value(i), s.value(i)));
                }
            }
            if got == groups { Ok(()) } else { Err(format!("{} groups, want {}", got.len(), groups.len())) }
        });
        check("SELECT count(DISTINCT s) FROM g", &|b| {
            let c = arrow::compute::cast(b.iter().find(|b| b.num_rows() > 0).unwrap().column(0), &DataType::Int64).unwrap();
            let got = c.as_primitive::<Int64Type>().value(0);
            if got == strings.len() as i64 { Ok(()) } else { Err(format!("{got} vs {}", strings.len())) }
        });
        check("SELECT DISTINCT s FROM g ORDER BY s DESC LIMIT 3", &|b| {
            let got: Vec<String> = b.iter().flat_map(|b| (0..b.num_rows()).map(move |i| b.column(0).as_string::<i32>().value(i).to_owned())).collect();
            let want: Vec<String> = strings.iter().rev().take(3).map(|s| (*s).clone()).collect();
            if got == want { Ok(()) } else { Err(format!("{got:?} vs {want:?}")) }
        });
        check("SELECT id FROM g ORDER BY s, id", &|b| {
            let got: Vec<i64> = b.iter().flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec()).collect();
            let want: Vec<i64> = by_s.iter().map(|x| x.1).collect();
            if got == want { Ok(()) } else { Err(format!("{} rows vs {}", got.len(), want.len())) }
        });
        engine.close().unwrap();
    }
    eprintln!("{}", outcomes.join("\n"));
    assert!(outcomes.iter().filter(|o| o.starts_with("64 MiB")).all(|o| o.ends_with("ok")), "{outcomes:#?}");
}

/// Two layered tables joined (inner, left anti, grouped): the SQL answers equal the model at
/// 64 MiB and are exact or `MemoryLimit` at 10 MiB; memory back at the baseline.
#[test]
#[cfg(feature = "sql")]
fn sql_joins_of_two_layered_tables_match_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let o_schema = Arc::new(Schema::new(vec![Field::new("okey", DataType::Int64, false), Field::new("cust", DataType::Int64, false)]));
    let l_schema = Arc::new(Schema::new(vec![
        Field::new("okey", DataType::Int64, false),
        Field::new("line", DataType::Int64, false),
        Field::new("qty", DataType::Int64, false),
    ]));
    let mut om: BTreeMap<i64, i64> = BTreeMap::new();
    let mut lm: BTreeMap<(i64, i64), i64> = BTreeMap::new();
    {
        let engine = sql_open(dir.path(), 64 << 20);
        let o = engine.create_table("o", Arc::clone(&o_schema), &["okey"]).unwrap();
        let l = engine.create_table("l", Arc::clone(&l_schema), &["okey", "line"]).unwrap();
        let ob = |keys: &[i64], ver: i64| {
            RecordBatch::try_new(
                Arc::clone(&o_schema),
                vec![
                    Arc::new(Int64Array::from(keys.to_vec())) as ArrayRef,
                    Arc::new(Int64Array::from(keys.iter().map(|k| (k * 7 + ver) % 101).collect::<Vec<_>>())),
                ],
            )
            .unwrap()
        };
        let lb = |keys: &[(i64, i64)], ver: i64| {
            RecordBatch::try_new(
                Arc::clone(&l_schema),
                vec![
                    Arc::new(Int64Array::from(keys.iter().map(|k| k.0).collect::<Vec<_>>())) as ArrayRef,
                    Arc::new(Int64Array::from(keys.iter().map(|k| k.1).collect::<Vec<_>>())),
                    Arc::new(Int64Array::from(keys.iter().map(|k| k.0 % 50 + k.1 + ver * 100).collect::<Vec<_>>())),
                ],
            )
            .unwrap()
        };
        let okeys: Vec<i64> = (0..20_000).collect();
        o.insert(&ob(&okeys, 0)).unwrap();
        om.extend(okeys.iter().map(|&k| (k, (k * 7) % 101)));
        let lkeys: Vec<(i64, i64)> = (0..20_000).filter(|k| k % 4 != 3).flat_map(|k| (0..(k % 5)).map(move |l| (k, l))).collect();
        l.insert(&lb(&lkeys, 0)).unwrap();
        lm.extend(lkeys.iter().map(|&k| (k, k.0 % 50 + k.1)));
        o.flush().unwrap();
        l.flush().unwrap();
        // Deletion vectors on both, then updates into the deltas.
        let od: Vec<i64> = (0..20_000).step_by(17).collect();
        let odk = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("okey", DataType::Int64, false)])),
            vec![Arc::new(Int64Array::from(od.clone())) as ArrayRef],
        )
        .unwrap();
        o.delete(&odk).unwrap();
        for k in &od {
            om.remove(k);
        }
        let ld: Vec<(i64, i64)> = lkeys.iter().copied().filter(|k| (k.0 + k.1) % 11 == 0).collect();
        let ldk = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("okey", DataType::Int64, false), Field::new("line", DataType::Int64, false)])),
            vec![
                Arc::new(Int64Array::from(ld.iter().map(|k| k.0).collect::<Vec<_>>())) as ArrayRef,
                Arc::new(Int64Array::from(ld.iter().map(|k| k.1).collect::<Vec<_>>())),
            ],
        )
        .unwrap();
        l.delete(&ldk).unwrap();
        for k in &ld {
            lm.remove(k);
        }
        l.flush().unwrap();
        let ou: Vec<i64> = (0..21_000).step_by(3).collect();
        o.upsert(&ob(&ou, 1)).unwrap();
        om.extend(ou.iter().map(|&k| (k, (k * 7 + 1) % 101)));
        let lu: Vec<(i64, i64)> = (0..21_000).step_by(7).flat_map(|k| [(k, 0), (k, 9)]).collect();
        l.upsert(&lb(&lu, 1)).unwrap();
        lm.extend(lu.iter().map(|&k| (k, k.0 % 50 + k.1 + 100)));
        drop((o, l));
        engine.close().unwrap();
    }
    // Model answers.
    let inner: Vec<(i64, i64)> = lm.iter().filter_map(|(k, q)| om.get(&k.0).map(|c| (*c, *q))).collect();
    let inner_n = inner.len() as i64;
    let inner_q: i64 = inner.iter().map(|x| x.1).sum();
    let mut by_cust: BTreeMap<i64, i64> = BTreeMap::new();
    for (c, q) in &inner {
        if c % 3 == 0 {
            *by_cust.entry(*c).or_default() += q;
        }
    }
    let lonely = om.keys().filter(|k| !lm.range((**k, i64::MIN)..=(**k, i64::MAX)).any(|_| true)).count() as i64;
    for limit in [64usize << 20, 10 << 20] {
        let engine = sql_open(dir.path(), limit);
        let base = settled(&engine);
        let run = |q: &str| -> Option<Vec<RecordBatch>> {
            match engine.sql(q) {
                Ok(b) => Some(b),
                Err(Error::MemoryLimit { category: Category::Query, .. }) if limit < 64 << 20 => None,
                Err(e) => panic!("{} MiB: {q}: {e:?}", limit >> 20),
            }
        };
        if let Some(b) = run("SELECT count(*), sum(l.qty) FROM o JOIN l ON o.okey = l.okey") {
            assert_eq!(count_sum(&b), (inner_n, inner_q), "{} MiB inner join", limit >> 20);
        }
        if let Some(b) = run("SELECT count(*), sum(o.cust) * 0 FROM o LEFT JOIN l ON o.okey = l.okey WHERE l.okey IS NULL") {
            assert_eq!(count_sum(&b).0, lonely, "{} MiB anti join", limit >> 20);
        }
        if let Some(b) = run("SELECT o.cust, sum(l.qty) FROM o JOIN l ON l.okey = o.okey WHERE o.cust % 3 = 0 GROUP BY o.cust ORDER BY o.cust") {
            let mut got = BTreeMap::new();
            for b in &b {
                let c = b.column(0).as_primitive::<Int64Type>();
                let s = b.column(1).as_primitive::<Int64Type>();
                for i in 0..b.num_rows() {
                    got.insert(c.value(i), s.value(i));
                }
            }
            assert_eq!(got, by_cust, "{} MiB grouped join", limit >> 20);
        }
        assert_eq!(settled(&engine), base, "{} MiB: memory back at the baseline", limit >> 20);
        engine.close().unwrap();
    }
}

/// Reads one batch of a stream, via a poll of the trait object.
#[cfg(feature = "sql")]
async fn next_batch(s: &mut gritdb::sql::datafusion::physical_plan::SendableRecordBatchStream) -> Option<gritdb::sql::datafusion::error::Result<RecordBatch>> {
    std::future::poll_fn(|cx| s.as_mut().poll_next(cx)).await
}

/// A `DataFrame` stream read for one batch and dropped gives back every byte; a table dropped
/// while a stream over it is half read: the stream ends (all of the snapshot's rows exactly,
/// or an error carrying a gritdb error), the table is gone for SQL (`TableNotFound`), and the
/// engine's categories return to what they were before the table existed. Then a plan over a
/// table dropped and re-created never reads the new table.
#[test]
#[cfg(feature = "sql")]
fn sql_streams_dropped_mid_way_and_tables_dropped_mid_stream_release_everything() {
    let dir = tempfile::tempdir().unwrap();
    let engine = sql_open(dir.path(), 64 << 20);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Build the SQL state and a warm baseline before any table.
    engine.sql("SELECT 1").unwrap();
    let empty = settled(&engine);
    let n = 120_000i64;
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    for start in (0..n).step_by(30_000) {
        t.insert(&kv(start..start + 30_000, 1)).unwrap();
    }
    t.flush().unwrap();
    t.upsert(&kv(0..5_000, 2)).unwrap(); // active delta over file rows
    let want_sum: i64 = (0..n).map(|k| if k < 5_000 { val(k, 2).0 } else { val(k, 1).0 }).sum();
    let base = settled(&engine);
    let ctx = engine.session_context().unwrap();

    // 1. One batch, then the stream dropped.
    rt.block_on(async {
        let df = ctx.sql("SELECT k, v, s FROM t").await.unwrap();
        let mut s = df.execute_stream().await.unwrap();
        let b = next_batch(&mut s).await.unwrap().unwrap();
        assert!(b.num_rows() > 0);
        drop(b);
        drop(s);
    });
    assert_eq!(settled(&engine), base, "a stream dropped after one batch released everything");

    // 2. A sort stream read for one batch, dropped.
    rt.block_on(async {
        let df = ctx.sql("SELECT k, s FROM t ORDER BY s DESC").await.unwrap();
        let mut s = df.execute_stream().await.unwrap();
        let _ = next_batch(&mut s).await.unwrap().unwrap();
        drop(s);
    });
    assert_eq!(settled(&engine), base, "a sort stream dropped after one batch released everything");

    // 3. The table dropped while a stream is half read.
    let (rows, sum, err) = rt.block_on(async {
        let df = ctx.sql("SELECT k, v FROM t").await.unwrap();
        let mut s = df.execute_stream().await.unwrap();
        let first = next_batch(&mut s).await.unwrap().unwrap();
        let (mut rows, mut sum) = (first.num_rows() as i64, first.column(1).as_primitive::<Int64Type>().values().iter().sum::<i64>());
        drop(first);
        engine.drop_table("t").unwrap();
        let mut err = None;
        loop {
            match tokio::time::timeout(Duration::from_secs(60), next_batch(&mut s)).await.expect("the stream over a dropped table hangs") {
                None => break,
                Some(Ok(b)) => {
                    rows += b.num_rows() as i64;
                    sum += b.column(1).as_primitive::<Int64Type>().values().iter().sum::<i64>();
                }
                Some(Err(e)) => {
                    err = Some(e);
                    break;
                }
            }
        }
        (rows, sum, err)
    });
    match &err {
        None => assert_eq!((rows, sum), (n, want_sum), "the stream finished: the whole snapshot exactly"),
        Some(e) => {
            let typed = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| e.source()).any(|e| e.downcast_ref::<Error>().is_some());
            assert!(typed, "the stream's error carries a gritdb error: {e:?}");
        }
    }
    drop(t);
    assert!(matches!(engine.sql("SELECT count(*) FROM t"), Err(Error::TableNotFound { .. })));
    drop(ctx);
    let after = settled(&engine);
    assert_eq!(after, empty, "after the drop, every category is back to the engine without the table");
    engine.close().unwrap();
    sql_a_plan_over_a_dropped_and_recreated_table_never_reads_the_new_one();
}

/// A `DataFrame` planned over a table that is then dropped and re-created with other rows:
/// running the old plan fails with a gritdb error or returns the old table's rows — never the
/// new table's, never a mix; a new query sees the new table.
#[cfg(feature = "sql")]
fn sql_a_plan_over_a_dropped_and_recreated_table_never_reads_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let engine = sql_open(dir.path(), 64 << 20);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv(0..1_000, 1)).unwrap();
    t.flush().unwrap();
    t.upsert(&kv(0..10, 2)).unwrap();
    let ctx = engine.session_context().unwrap();
    let df = rt.block_on(ctx.sql("SELECT count(*) AS n, sum(k) AS s FROM t")).unwrap();
    drop(t);
    engine.drop_table("t").unwrap();
    let t2 = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t2.insert(&kv(5_000..5_003, 1)).unwrap();
    match rt.block_on(df.collect()) {
        Ok(b) => assert_eq!(count_sum(&b), (1_000, (0..1_000).sum::<i64>()), "the old plan returned rows that are not the old table's"),
        Err(e) => {
            let typed = std::iter::successors(Some(&e as &(dyn std::error::Error + 'static)), |e| e.source()).any(|e| e.downcast_ref::<Error>().is_some());
            assert!(typed, "untyped error from a plan over a dropped table: {e:?}");
        }
    }
    assert_eq!(count_sum(&engine.sql("SELECT count(*), sum(k) FROM t").unwrap()), (3, 15_003));
    drop(t2);
    engine.close().unwrap();
}

/// The memory limit lowered below what a running sort holds, then the stream read to its end:
/// the answer is exact (every row, in order) or the stream fails with a gritdb
/// `MemoryLimit`; afterwards every category is back at its baseline and writes work.
#[cfg(feature = "sql")]
#[test]
fn sql_limit_lowered_under_a_running_sort_is_exact_or_typed_and_releases_everything() {
    let dir = tempfile::tempdir().unwrap();
    let engine = sql_open(dir.path(), 96 << 20);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let n = 200_000i64;
    for start in (0..n).step_by(50_000) {
        t.insert(&kv(start..start + 50_000, 1)).unwrap();
    }
    t.flush().unwrap();
    let base = settled(&engine);
    let ctx = engine.session_context().unwrap();
    let (rows, sorted, err, held) = rt.block_on(async {
        let df = ctx.sql("SELECT k, s FROM t ORDER BY s DESC, k").await.unwrap();
        let mut s = df.execute_stream().await.unwrap();
        let first = next_batch(&mut s).await.unwrap().unwrap();
        let held = engine.memory().category_bytes(Category::Query);
        let lowered = engine.set_memory_limit(24 << 20);
        assert!(lowered.is_ok() || lowered.as_ref().is_err_and(Error::is_memory_limit), "{lowered:?}");
        let mut keys: Vec<(String, i64)> = Vec::new();
        let push = |b: &RecordBatch, keys: &mut Vec<(String, i64)>| {
            let k = b.column(0).as_primitive::<Int64Type>();
            let v = b.column(1).as_string::<i32>();
            for i in 0..b.num_rows() {
                keys.push((v.value(i).to_owned(), k.value(i)));
            }
        };
        push(&first, &mut keys);
        drop(first);
        let mut err = None;
        while let Some(b) = tokio::time::timeout(Duration::from_secs(120), next_batch(&mut s)).await.expect("the sort stream hangs after the limit was lowered")
        {
            match b {
                Ok(b) => push(&b, &mut keys),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let sorted = keys.windows(2).all(|w| w[0].0 > w[1].0 || (w[0].0 == w[1].0 && w[0].1 < w[1].1));
        (keys.len() as i64, sorted, err, held)
    });
    eprintln!("query held {held} B when the limit was lowered; rows {rows}; error {err:?}");
    match &err {
        None => assert!(rows == n && sorted, "rows {rows} of {n}, sorted {sorted}"),
        Some(e) => {
            let typed = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| e.source()).any(|e| e.downcast_ref::<Error>().is_some())
                || e.to_string().contains("memory limit");
            assert!(typed, "untyped error: {e:?}");
        }
    }
    drop(ctx);
    engine.set_memory_limit(96 << 20).unwrap();
    assert_eq!(settled(&engine), base, "memory back at the baseline");
    t.insert(&kv(n..n + 10, 1)).unwrap();
    assert_eq!(t.row_count().unwrap(), (n + 10) as u64);
}
