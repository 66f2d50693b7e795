//! `drop_table` with a flush of the table in flight: the flush is cancelled within one write
//! call, and when `drop_table` returns every accounted byte of the table is released (the
//! engine total is back at its value before the table was created), no file of the table
//! remains, and the engine keeps working. A hung file layer bounds the wait instead.

use gritdb::memory::Category;
use gritdb::vfs::{FaultFs, StdFs, Vfs, VfsFile};
use gritdb::{Engine, EngineConfig, Error, ScanOptions};
use gritdb_tests::*;
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A file layer whose data-file (`.parquet`) writes are slow but progress: each `write` call
/// takes at most 4 KiB and sleeps 1 ms. While the gate is closed, writes of data files whose
/// path contains the gate's pattern wait at the gate (so the test can act while a flush or a
/// compaction is mid-write).
#[derive(Debug, Default)]
struct SlowFs {
    /// `Some(pattern)`: the gate is closed for data files whose path contains `pattern`.
    gate_closed: Mutex<Option<String>>,
    cv: Condvar,
    waiting: AtomicBool,
    /// Data-file write calls that reached the file system.
    writes: AtomicU64,
}

impl SlowFs {
    fn close_gate(&self, pattern: &str) {
        *self.gate_closed.lock().unwrap() = Some(pattern.to_owned());
    }
    fn open_gate(&self) {
        *self.gate_closed.lock().unwrap() = None;
        self.cv.notify_all();
    }
}

struct SlowFile {
    inner: Box<dyn VfsFile>,
    fs: Arc<SlowFs>,
    data: bool,
    path: String,
}

impl Write for SlowFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !self.data {
            return self.inner.write(buf);
        }
        let mut closed = self.fs.gate_closed.lock().unwrap();
        while closed.as_ref().is_some_and(|p| self.path.contains(p.as_str())) {
            self.fs.waiting.store(true, Ordering::Release);
            closed = self.fs.cv.wait(closed).unwrap();
        }
        drop(closed);
        self.fs.waiting.store(false, Ordering::Release);
        std::thread::sleep(Duration::from_millis(1));
        self.fs.writes.fetch_add(1, Ordering::AcqRel);
        self.inner.write(&buf[..buf.len().min(4096)])
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl VfsFile for SlowFile {
    fn sync_all(&mut self) -> io::Result<()> {
        self.inner.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
}

#[derive(Debug, Clone)]
struct SlowVfs(Arc<SlowFs>);

impl Vfs for SlowVfs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        let data = path.to_string_lossy().contains(".parquet");
        Ok(Box::new(SlowFile { inner: StdFs.create(path)?, fs: Arc::clone(&self.0), data, path: path.to_string_lossy().into_owned() }))
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

fn rows(from: i64, n: i64) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, (k % 7) as i32), (Some(k * 3), Some(format!("payload of row {k} for the drop test"))))).collect()
}

fn categories(e: &Engine) -> Vec<(Category, usize)> {
    Category::ALL.iter().map(|c| (*c, e.memory().category_bytes(*c))).collect()
}

/// Files under `tables/` and `trash/` of the data dir.
fn table_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for sub in ["tables", "trash"] {
        for t in std::fs::read_dir(dir.join(sub)).unwrap().flatten() {
            for f in std::fs::read_dir(t.path()).into_iter().flatten().flatten() {
                out.push(format!("{}/{}", t.file_name().to_string_lossy(), f.file_name().to_string_lossy()));
            }
        }
    }
    out.sort();
    out
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_mins(1), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Warms the engine-wide buffers a table's writes grow (the write-ahead log's encoding
/// buffer) with a table of the same shape, so the baseline taken afterwards is the engine's
/// steady state, not a first-use figure.
fn warm_up(engine: &Engine) -> gritdb::Table {
    let w = engine.create_table("warm", composite_schema(), &["k1", "k2"]).unwrap();
    w.insert(&composite_batch(&rows(0, 50_000))).unwrap();
    w.flush().unwrap();
    w
}

#[test]
fn drop_table_cancels_a_slow_flush_and_returns_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let slow = Arc::new(SlowFs::default());
    let config = EngineConfig::default().memory_limit(256 << 20).flush_age(Duration::from_hours(1)).vfs(Arc::new(SlowVfs(Arc::clone(&slow))));
    let engine = Arc::new(Engine::open(dir.path(), config).unwrap());
    let warm = warm_up(&engine);
    engine.release_cached_memory();
    let (base_used, base) = (engine.memory().used(), categories(&engine));
    let files_before = table_files(dir.path());

    let t = engine.create_table("victim", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 50_000))).unwrap();
    slow.close_gate(".parquet");
    let t2 = t.clone();
    let flusher = std::thread::spawn(move || t2.flush());
    wait_until("the flush to reach its first data-file write", || slow.waiting.load(Ordering::Acquire));
    // Mid-write: the flush's batch block and writer buffers are held.
    assert!(engine.memory().category_bytes(Category::BatchBlocks) > 0);
    let writes_before = slow.writes.load(Ordering::Acquire);

    let e = Arc::clone(&engine);
    let dropper = std::thread::spawn(move || e.drop_table("victim"));
    // Once a handle sees the table gone, its writes are cancelled: let the file layer go on.
    wait_until("drop_table to take the table", || matches!(t.stats(), Err(Error::TableNotFound { .. })));
    slow.open_gate();
    dropper.join().unwrap().unwrap();
    // drop_table has returned: every byte of the table is released, exactly.
    engine.release_cached_memory();
    assert_eq!(categories(&engine), base, "every category back to its value before the table existed");
    assert_eq!(engine.memory().used(), base_used);
    // (The handle `t` still exists, so the table's account may still be listed: with nothing.)
    let report = engine.memory_report();
    let left: usize = report.tables.iter().filter(|r| r.table == "victim").flat_map(|r| r.categories.iter().map(|c| c.bytes)).sum();
    assert_eq!(left, 0, "the table's accounted bytes are gone");
    // The write that was waiting at the gate went through; the next one saw the cancellation.
    assert_eq!(slow.writes.load(Ordering::Acquire) - writes_before, 1, "cancelled within one write call");
    let err = flusher.join().unwrap().unwrap_err();
    assert!(err.to_string().contains("cancelled") || matches!(err, Error::TableNotFound { .. }), "{err}");
    assert_eq!(table_files(dir.path()), files_before, "no file of the dropped table remains");

    // The engine keeps working, under the same name too.
    let t = engine.create_table("victim", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 1_000))).unwrap();
    t.flush().unwrap();
    t.insert(&composite_batch(&rows(1_000, 10))).unwrap();
    assert_eq!(collect_composite(t.scan(ScanOptions::default()).unwrap()), rows(0, 1_010).into_iter().collect());
    assert_eq!(warm.row_count().unwrap(), 50_000);
}

/// A compaction (a merge of four small files) mid-write when the table is dropped: cancelled
/// the same way, every byte back at the baseline when `drop_table` returns.
#[test]
fn drop_table_cancels_a_compaction_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let slow = Arc::new(SlowFs::default());
    let config = EngineConfig::default().memory_limit(256 << 20).flush_age(Duration::from_hours(1)).vfs(Arc::new(SlowVfs(Arc::clone(&slow))));
    let engine = Arc::new(Engine::open(dir.path(), config).unwrap());
    let _warm = warm_up(&engine);
    engine.release_cached_memory();
    let (base_used, base) = (engine.memory().used(), categories(&engine));
    let files_before = table_files(dir.path());

    let t = engine.create_table("merged", composite_schema(), &["k1", "k2"]).unwrap();
    for f in 0..3 {
        t.insert(&composite_batch(&rows(f * 10_000, 10_000))).unwrap();
        t.flush().unwrap();
    }
    assert_eq!(t.stats().unwrap().files, 3);
    // The fourth flush writes f000004; the merge of the four files then writes f000005.
    t.insert(&composite_batch(&rows(30_000, 10_000))).unwrap();
    slow.close_gate("f000005");
    let t2 = t.clone();
    let flusher = std::thread::spawn(move || t2.flush());
    wait_until("the compaction to reach its first write", || slow.waiting.load(Ordering::Acquire));
    assert!(engine.memory().category_bytes(Category::BatchBlocks) > 0, "the merge holds its decoded rows");
    let e = Arc::clone(&engine);
    let dropper = std::thread::spawn(move || e.drop_table("merged"));
    wait_until("drop_table to take the table", || matches!(t.stats(), Err(Error::TableNotFound { .. })));
    slow.open_gate();
    dropper.join().unwrap().unwrap();
    engine.release_cached_memory();
    assert_eq!(categories(&engine), base, "every category back to its value before the table existed");
    assert_eq!(engine.memory().used(), base_used);
    assert!(flusher.join().unwrap().is_err(), "the flush's compaction was cancelled");
    assert_eq!(table_files(dir.path()), files_before, "no file of the dropped table remains");
}

/// A data-file write hung in the file layer: `drop_table` returns after its bounded wait
/// (`backpressure_timeout`) with the table gone; the flush's bytes are released when the hung
/// call returns, and then the engine total is back at its baseline.
#[test]
fn drop_table_with_a_hung_write_returns_after_a_bounded_wait() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let config = EngineConfig::default()
        .memory_limit(256 << 20)
        .flush_age(Duration::from_hours(1))
        .backpressure_timeout(Duration::from_millis(300))
        .vfs(Arc::new(fs.clone()));
    let engine = Arc::new(Engine::open(dir.path(), config).unwrap());
    let _warm = warm_up(&engine);
    engine.release_cached_memory();
    let (base_used, base) = (engine.memory().used(), categories(&engine));

    let t = engine.create_table("hung", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 20_000))).unwrap();
    fs.stall_paths(".parquet");
    let t2 = t.clone();
    let flusher = std::thread::spawn(move || t2.flush());
    wait_until("the writer to hang", || fs.is_stalled());
    engine.drop_table("hung").unwrap();
    assert!(engine.table("hung").is_err());
    assert!(!dir.path().join("tables").read_dir().unwrap().flatten().any(|d| d.path().join("f000001.parquet.tmp").exists()));
    // The hung call still holds the flush's batch block.
    assert!(engine.memory().category_bytes(Category::BatchBlocks) > 0, "the flush is still inside the hung call");
    fs.heal();
    assert!(flusher.join().unwrap().is_err());
    engine.release_cached_memory();
    assert_eq!(categories(&engine), base);
    assert_eq!(engine.memory().used(), base_used);
    let t = engine.create_table("hung", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 100))).unwrap();
    t.flush().unwrap();
    assert_eq!(t.row_count().unwrap(), 100);
}
