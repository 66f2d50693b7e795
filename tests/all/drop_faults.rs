//! `drop_table` when the file layer fails: the directory's rename into `trash/` (the drop's
//! commit point) goes through the `Vfs`. A rename that fails leaves the table whole (served,
//! writable, same bytes accounted, back after a reopen); a rename that takes effect and then
//! reports EIO is a drop; a failed fsync of `tables/` after the rename leaves the table gone
//! here and never resurrects its rows into a table created under the same name.

use gritdb::vfs::{FaultFs, StdFs, Vfs, VfsFile};
use gritdb::{Engine, EngineConfig, Error, ExportOptions, ScanOptions, Table};
use gritdb_tests::crash::TableModel;
use gritdb_tests::*;
use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

fn rows(from: i64, n: i64) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, (k % 7) as i32), (Some(k * 3), Some(format!("v{k}"))))).collect()
}

fn model(t: &Table) -> TableModel {
    collect_composite(t.scan(ScanOptions::default()).unwrap())
}

fn expected(ranges: &[(i64, i64)]) -> TableModel {
    ranges.iter().flat_map(|&(from, n)| rows(from, n)).collect()
}

/// Entries of `dir/sub`, sorted.
fn entries(dir: &Path, sub: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join(sub)).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// A table with 1,000 rows in a data file and 500 more only in the delta and the WAL.
fn filled(engine: &Engine, name: &str) -> Table {
    let t = engine.create_table(name, composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 1_000))).unwrap();
    t.flush().unwrap();
    t.insert(&composite_batch(&rows(1_000, 500))).unwrap();
    t
}

#[test]
fn a_failed_drop_rename_leaves_the_table_whole() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let cfg = || EngineConfig::default().memory_limit(128 << 20);
    let engine = Engine::open(dir.path(), cfg().vfs(Arc::new(fs.clone()))).unwrap();
    let t = filled(&engine, "a");
    let used = engine.memory().used();
    let before = t.stats().unwrap();
    let on_disk = entries(dir.path(), "tables");

    for errno in [libc::EIO, libc::ENOSPC, libc::EACCES] {
        // Step 0 from here is the drop's rename.
        fs.fail_step(0, errno);
        match engine.drop_table("a") {
            Err(Error::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(errno)),
            other => panic!("errno {errno}: expected Error::Io, got {other:?}"),
        }
        assert_eq!(engine.table_names(), vec!["a".to_owned()], "errno {errno}");
        assert_eq!(engine.memory().used(), used, "errno {errno}: accounted bytes moved");
        assert_eq!(t.stats().unwrap(), before, "errno {errno}");
        assert_eq!(model(&t), expected(&[(0, 1_500)]), "errno {errno}");
        assert_eq!(entries(dir.path(), "tables"), on_disk, "errno {errno}");
        assert!(entries(dir.path(), "trash").is_empty(), "errno {errno}");
    }

    // Still writable and flushable through the old handle, and through a new one.
    t.insert(&composite_batch(&rows(1_500, 250))).unwrap();
    engine.table("A").unwrap().flush().unwrap();
    t.insert(&composite_batch(&rows(1_750, 250))).unwrap();
    assert_eq!(model(&t), expected(&[(0, 2_000)]));
    drop(t);
    engine.close().unwrap();

    // Reopened: every row, from files and the WAL.
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    assert_eq!(model(&engine.table("a").unwrap()), expected(&[(0, 2_000)]));
    // A drop that works now is a drop, across a reopen too.
    engine.drop_table("a").unwrap();
    assert!(entries(dir.path(), "tables").is_empty());
    assert!(entries(dir.path(), "trash").is_empty());
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    assert!(engine.table_names().is_empty());
    assert!(matches!(engine.table("a"), Err(Error::TableNotFound { .. })));
}

/// The real file system, except that the first rename into `trash/` after [`Self::arm`]
/// happens and then returns EIO (a lost reply).
#[derive(Debug, Default)]
struct LyingTrashRename(AtomicBool);

impl LyingTrashRename {
    fn arm(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl Vfs for LyingTrashRename {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        StdFs.create(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        StdFs.rename(from, to)?;
        let into_trash = to.parent().and_then(Path::file_name).is_some_and(|n| n == "trash");
        if into_trash && self.0.swap(false, Ordering::AcqRel) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
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

#[test]
fn a_drop_rename_that_happens_then_reports_eio_is_a_drop() {
    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(LyingTrashRename::default());
    let cfg = || EngineConfig::default().memory_limit(128 << 20);
    let engine = Engine::open(dir.path(), cfg().vfs(Arc::clone(&fs) as Arc<dyn Vfs>)).unwrap();
    let keep = filled(&engine, "keep");
    engine.release_cached_memory();
    let baseline = engine.memory().used();
    let t = filled(&engine, "gone");
    fs.arm();
    engine.drop_table("gone").unwrap();
    assert!(!fs.0.load(Ordering::Acquire), "the drop's rename did not go through the Vfs");
    assert!(matches!(t.stats(), Err(Error::TableNotFound { .. })));
    engine.release_cached_memory();
    assert_eq!(engine.memory().used(), baseline, "the dropped table's bytes are not all back");
    assert_eq!(engine.table_names(), vec!["keep".to_owned()]);
    assert_eq!(entries(dir.path(), "tables").len(), 1);
    assert!(entries(dir.path(), "trash").is_empty());
    // The name is free; a new table under it starts empty, before and after a reopen.
    let again = engine.create_table("gone", composite_schema(), &["k1", "k2"]).unwrap();
    again.insert(&composite_batch(&rows(5_000, 10))).unwrap();
    drop((t, keep, again));
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    assert_eq!(model(&engine.table("gone").unwrap()), expected(&[(5_000, 10)]));
    assert_eq!(model(&engine.table("keep").unwrap()), expected(&[(0, 1_500)]));
}

#[test]
fn a_failed_fsync_after_the_drop_rename_never_resurrects_rows() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let cfg = || EngineConfig::default().memory_limit(128 << 20);
    let engine = Engine::open(dir.path(), cfg().vfs(Arc::new(fs.clone()))).unwrap();
    engine.release_cached_memory();
    let baseline = engine.memory().used();
    let t = filled(&engine, "t");
    // Step 0 is the rename (it works), step 1 the fsync of `tables/`.
    fs.fail_step(1, libc::EIO);
    match engine.drop_table("t") {
        Err(Error::Io { source, path }) => {
            assert_eq!(source.raw_os_error(), Some(libc::EIO));
            assert!(path.ends_with("tables"), "{}", path.display());
        }
        other => panic!("expected Error::Io from the fsync, got {other:?}"),
    }
    // Gone from this engine, its bytes released; the name is free.
    assert!(matches!(t.stats(), Err(Error::TableNotFound { .. })));
    assert!(matches!(engine.drop_table("t"), Err(Error::TableNotFound { .. })));
    engine.release_cached_memory();
    assert_eq!(engine.memory().used(), baseline);
    assert!(entries(dir.path(), "tables").is_empty());
    let again = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    again.insert(&composite_batch(&rows(9_000, 20))).unwrap();
    assert_eq!(model(&again), expected(&[(9_000, 20)]));
    drop((t, again));
    engine.close().unwrap();
    // The old table's WAL records name its id, not its name: nothing of it comes back.
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    assert_eq!(engine.table_names(), vec!["t".to_owned()]);
    assert_eq!(model(&engine.table("t").unwrap()), expected(&[(9_000, 20)]));
    assert!(entries(dir.path(), "trash").is_empty(), "the next open clears trash/");
}

/// Scans, exports and flushes racing `drop_table` (the directory is renamed into `trash/`
/// before the table's state is taken): each ends with its rows or `TableNotFound`, never a
/// file-layer error about the files it no longer finds. 12 rounds.
#[test]
fn reads_and_flushes_racing_a_drop_see_the_table_gone_not_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap());
    let out = tempfile::tempdir().unwrap();
    for round in 0..12_i64 {
        let name = format!("r{round}");
        let t = engine.create_table(&name, composite_schema(), &["k1", "k2"]).unwrap();
        for part in 0..6 {
            t.insert(&composite_batch(&rows(part * 2_000, 2_000))).unwrap();
            t.flush().unwrap();
        }
        t.insert(&composite_batch(&rows(12_000, 500))).unwrap();
        let mut hs = Vec::new();
        for job in 0..3 {
            let t = t.clone();
            let path = out.path().join(format!("{name}-{job}.parquet"));
            hs.push(std::thread::spawn(move || -> Result<String, String> {
                let mut ends = Vec::new();
                for _ in 0..40 {
                    let end = match job {
                        0 => match t.scan(ScanOptions::default().batch_rows(256)) {
                            Ok(s) => {
                                let mut n = 0;
                                let mut end = None;
                                for b in s {
                                    match b {
                                        Ok(b) => n += b.num_rows(),
                                        Err(e) => {
                                            end = Some(e);
                                            break;
                                        }
                                    }
                                }
                                match end {
                                    None if n == 12_500 || n == 12_600 => Ok(()),
                                    None => return Err(format!("a complete scan gave {n} rows (12500, or 12600 after the job-2 insert)")),
                                    Some(e) => Err(e),
                                }
                            }
                            Err(e) => Err(e),
                        },
                        1 => t.export_parquet_with(&path, &ExportOptions::default().overwrite(true)).map(|_| ()).map_err(Error::from),
                        _ => {
                            let _ = t.insert(&composite_batch(&rows(20_000, 100)));
                            t.flush().map(|_| ())
                        }
                    };
                    match end {
                        Ok(()) => {}
                        Err(Error::TableNotFound { .. }) => {
                            ends.push("gone");
                            break;
                        }
                        Err(e) => return Err(format!("job {job}: {e:?}")),
                    }
                }
                Ok(ends.join(","))
            }));
        }
        std::thread::sleep(std::time::Duration::from_millis(u64::try_from(round % 4).unwrap() * 3));
        engine.drop_table(&name).unwrap();
        for h in hs {
            h.join().expect("a job panicked").unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
    assert!(engine.table_names().is_empty());
    assert!(entries(dir.path(), "trash").is_empty());
}
