//! Adversarial checks of the sliced replay (a log record applied in slices, `flushed_seq`
//! committed inside a record, the next open resuming after it), of covered WAL segment files
//! removed by a background task, of byte-capped scan batches and of export under small
//! limits. Crash states are taken as exact images of the data directory at chosen points of
//! a running replay (a file layer that copies the directory right after a manifest rename),
//! and every answer is compared with an exact `BTreeMap` model (key -> version; every cell is
//! a function of key and version).

use arrow::array::{Array, ArrayRef, AsArray, BinaryArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::vfs::{FaultFs, StdFs, Vfs, VfsFile};
use gritdb::{CompareOp, Engine, EngineConfig, ExportOptions, ScanFilter, ScanOptions, Table};
use gritdb_tests::mix;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

// ---------------------------------------------------------------- the model

/// How the text column `s` is filled.
#[derive(Clone, Copy, Debug)]
enum Text {
    /// `min..=max` bytes, varying by key and version (1 in 17 null).
    Range { min: usize, max: usize },
    /// Keys from `from` on get `wide` bytes, the others 8..=24 bytes.
    Skewed { from: i64, wide: usize },
    /// One of four values of `len` bytes (a Parquet dictionary holds them all).
    FewValues { len: usize },
}

/// A table shape: `k` Int64, optionally `tag` Utf8 (part of the key, a function of `k`), `v`
/// Int64 (the version), `s` Utf8 (see [`Text`]), `b` Binary (0..64 bytes, 1 in 11 null).
#[derive(Clone, Copy, Debug)]
struct Shape {
    string_key: bool,
    text: Text,
}

fn tag(k: i64) -> String {
    format!("tag-{k:010}-{}", "t".repeat((k.rem_euclid(50)) as usize + 20))
}

impl Shape {
    fn schema(&self) -> SchemaRef {
        let mut f = vec![Field::new("k", DataType::Int64, false)];
        if self.string_key {
            f.push(Field::new("tag", DataType::Utf8, false));
        }
        f.push(Field::new("v", DataType::Int64, true));
        f.push(Field::new("s", DataType::Utf8, true));
        f.push(Field::new("b", DataType::Binary, true));
        Arc::new(Schema::new(f))
    }

    fn key_names(&self) -> Vec<&'static str> {
        if self.string_key { vec!["k", "tag"] } else { vec!["k"] }
    }

    fn key_schema(&self) -> SchemaRef {
        let mut f = vec![Field::new("k", DataType::Int64, false)];
        if self.string_key {
            f.push(Field::new("tag", DataType::Utf8, false));
        }
        Arc::new(Schema::new(f))
    }

    fn s(&self, k: i64, ver: u64) -> Option<String> {
        let h = mix((k as u64).wrapping_mul(1_000_003) ^ ver.wrapping_mul(7919));
        let len = match self.text {
            Text::Range { min, max } => {
                if h.is_multiple_of(17) {
                    return None;
                }
                min + (h >> 8) as usize % (max - min + 1)
            }
            Text::Skewed { from, wide } => {
                if k >= from {
                    wide
                } else {
                    8 + (h >> 8) as usize % 17
                }
            }
            Text::FewValues { len } => {
                let which = (h % 4) as u8;
                return Some(std::iter::repeat_n(char::from(b'a' + which), len).collect());
            }
        };
        let mut s = format!("{k}/{ver}/");
        let fill = char::from(b'a' + (h % 26) as u8);
        while s.len() < len {
            s.push(fill);
        }
        s.truncate(len.max(1));
        Some(s)
    }

    fn b(k: i64, ver: u64) -> Option<Vec<u8>> {
        let h = mix((k as u64) ^ ver.wrapping_mul(0x5851_f42d_4c95_7f2d));
        if h.is_multiple_of(11) {
            return None;
        }
        Some((0..(h >> 20) % 64).map(|i| (h >> (i % 56)) as u8).collect())
    }

    fn batch(&self, rows: &[(i64, u64)]) -> RecordBatch {
        let mut cols: Vec<ArrayRef> = vec![Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0)))];
        if self.string_key {
            cols.push(Arc::new(StringArray::from_iter_values(rows.iter().map(|r| tag(r.0)))));
        }
        cols.push(Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1 as i64))));
        cols.push(Arc::new(StringArray::from(rows.iter().map(|&(k, v)| self.s(k, v)).collect::<Vec<_>>())));
        let bs: Vec<Option<Vec<u8>>> = rows.iter().map(|&(k, v)| Self::b(k, v)).collect();
        cols.push(Arc::new(bs.iter().map(|b| b.as_deref()).collect::<BinaryArray>()));
        RecordBatch::try_new(self.schema(), cols).unwrap()
    }

    fn keys(&self, keys: &[i64]) -> RecordBatch {
        let mut cols: Vec<ArrayRef> = vec![Arc::new(Int64Array::from(keys.to_vec()))];
        if self.string_key {
            cols.push(Arc::new(StringArray::from_iter_values(keys.iter().map(|&k| tag(k)))));
        }
        RecordBatch::try_new(self.key_schema(), cols).unwrap()
    }
}

/// One table's exact expected content: key -> version.
#[derive(Clone)]
struct Model {
    name: String,
    shape: Shape,
    rows: BTreeMap<i64, u64>,
    ver: u64,
    /// The table's next sequence number and its log records (op, first, last), as the
    /// engine numbers them: a put's rows one each, a delete's applied keys one each.
    seq: u64,
    records: Vec<(char, u64, u64)>,
}

impl Model {
    fn new(name: &str, shape: Shape) -> Self {
        Self { name: name.to_owned(), shape, rows: BTreeMap::new(), ver: 1, seq: 1, records: Vec::new() }
    }

    fn log(&mut self, op: char, n: usize) {
        if n > 0 {
            self.records.push((op, self.seq, self.seq + n as u64 - 1));
            self.seq += n as u64;
        }
    }

    /// Where `flushed_seq` lies in this table's records: `inside put`, `inside delete` or
    /// `at a record end`.
    fn place(&self, flushed: u64) -> &'static str {
        match self.records.iter().find(|r| r.1 <= flushed && flushed <= r.2) {
            Some(r) if flushed == r.2 => "at a record end",
            Some(('p', ..)) => "inside put",
            Some(_) => "inside delete",
            None => "before any record",
        }
    }

    fn create(&self, engine: &Engine) -> Table {
        engine.create_table(&self.name, self.shape.schema(), &self.shape.key_names()).unwrap()
    }

    fn bump(&mut self) -> u64 {
        self.ver += 1;
        self.ver
    }

    fn insert(&mut self, t: &Table, keys: impl IntoIterator<Item = i64>) {
        let ver = self.bump();
        let rows: Vec<(i64, u64)> = keys.into_iter().map(|k| (k, ver)).collect();
        assert!(rows.iter().all(|r| !self.rows.contains_key(&r.0)), "model: insert of an existing key");
        assert_eq!(t.insert(&self.shape.batch(&rows)).unwrap(), rows.len(), "insert into {}", self.name);
        self.log('p', rows.len());
        self.rows.extend(rows);
    }

    fn upsert(&mut self, t: &Table, keys: impl IntoIterator<Item = i64>) {
        let ver = self.bump();
        let rows: Vec<(i64, u64)> = keys.into_iter().map(|k| (k, ver)).collect();
        assert_eq!(t.upsert(&self.shape.batch(&rows)).unwrap(), rows.len(), "upsert into {}", self.name);
        self.log('p', rows.len());
        self.rows.extend(rows);
    }

    /// Updates those of `keys` that exist.
    fn update(&mut self, t: &Table, keys: impl IntoIterator<Item = i64>) {
        let ver = self.bump();
        let rows: Vec<(i64, u64)> = keys.into_iter().filter(|k| self.rows.contains_key(k)).map(|k| (k, ver)).collect();
        if rows.is_empty() {
            return;
        }
        assert_eq!(t.update(&self.shape.batch(&rows)).unwrap(), rows.len(), "update of {}", self.name);
        self.log('p', rows.len());
        self.rows.extend(rows);
    }

    /// Deletes `keys` (absent ones and repeats allowed); checks the count returned.
    fn delete(&mut self, t: &Table, keys: &[i64]) {
        let uniq: BTreeSet<i64> = keys.iter().copied().collect();
        let present = uniq.iter().filter(|k| self.rows.contains_key(k)).count();
        assert_eq!(t.delete(&self.shape.keys(keys)).unwrap(), present, "delete from {}", self.name);
        self.log('d', present);
        for k in uniq {
            self.rows.remove(&k);
        }
    }

    /// Compares a scan (any projection that includes `k`) exactly with the rows of the model
    /// for which `pred(key, version)` holds.
    fn check_batches(&self, batches: impl IntoIterator<Item = RecordBatch>, cols: &[&str], pred: &dyn Fn(i64, u64) -> bool, what: &str) {
        let mut seen = BTreeSet::new();
        for b in batches {
            let names: Vec<&str> = b.schema_ref().fields().iter().map(|f| f.name().as_str()).collect();
            assert_eq!(names, cols, "{what}: columns");
            let col = |n: &str| b.column(cols.iter().position(|c| *c == n).unwrap());
            let ks = col("k").as_primitive::<Int64Type>().clone();
            for i in 0..b.num_rows() {
                let k = ks.value(i);
                assert!(seen.insert(k), "{what}: key {k} returned twice");
                let Some(&ver) = self.rows.get(&k) else { panic!("{what}: key {k} is not in the model (deleted or never written)") };
                assert!(pred(k, ver), "{what}: key {k} (version {ver}) does not match the filter");
                for &c in cols {
                    match c {
                        "k" => {}
                        "tag" => assert_eq!(col("tag").as_string::<i32>().value(i), tag(k), "{what}: key {k} tag"),
                        "v" => assert_eq!(col("v").as_primitive::<Int64Type>().value(i), ver as i64, "{what}: key {k} version"),
                        "s" => {
                            let a = col("s");
                            let got = (!a.is_null(i)).then(|| a.as_string::<i32>().value(i));
                            assert!(got == self.shape.s(k, ver).as_deref(), "{what}: key {k} version {ver}: s differs");
                        }
                        "b" => {
                            let a = col("b");
                            let got = (!a.is_null(i)).then(|| a.as_binary::<i32>().value(i));
                            assert!(got == Shape::b(k, ver).as_deref(), "{what}: key {k} version {ver}: b differs");
                        }
                        other => panic!("unexpected column {other}"),
                    }
                }
            }
        }
        let want = self.rows.iter().filter(|(k, v)| pred(**k, **v)).count();
        assert_eq!(seen.len(), want, "{what}: rows returned vs model ({} in the table model)", self.rows.len());
    }

    fn all_cols(&self) -> Vec<&'static str> {
        if self.shape.string_key { vec!["k", "tag", "v", "s", "b"] } else { vec!["k", "v", "s", "b"] }
    }

    fn check(&self, t: &Table, what: &str) {
        let cols = self.all_cols();
        self.check_with(t, ScanOptions::default(), &cols, &|_, _| true, what);
    }

    fn check_with(&self, t: &Table, opts: ScanOptions, cols: &[&str], pred: &dyn Fn(i64, u64) -> bool, what: &str) {
        let scan = t.scan(opts).unwrap_or_else(|e| panic!("{what}: scan of {}: {e}", self.name));
        let batches = scan.map(|b| b.unwrap_or_else(|e| panic!("{what}: scan batch of {}: {e}", self.name)));
        self.check_batches(batches, cols, pred, &format!("{what} ({})", self.name));
    }
}

fn check_all(engine: &Engine, models: &[Model], what: &str) {
    let mut names: Vec<String> = models.iter().map(|m| m.name.clone()).collect();
    names.sort();
    assert_eq!(engine.table_names(), names, "{what}: tables");
    for m in models {
        let t = engine.table(&m.name).unwrap_or_else(|e| panic!("{what}: table {}: {e}", m.name));
        m.check(&t, what);
    }
}

// ---------------------------------------------------------------- engines and files

/// The large limit the logs are written under: 256 MiB, 64 MiB deltas, no age flushes.
fn big() -> EngineConfig {
    EngineConfig::default().memory_limit(256 * MIB).table_flush_bytes(64 * MIB).flush_age(Duration::from_hours(1))
}

/// A small limit, no age flushes, a short backpressure wait.
fn small(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_hours(1)).backpressure_timeout(Duration::from_secs(3))
}

/// A small limit with a small flush threshold: replay cuts records into many slices.
fn sliced(limit: usize, flush: usize) -> EngineConfig {
    small(limit).table_flush_bytes(flush)
}

fn within(engine: &Engine, what: &str) {
    let (used, limit) = (engine.memory().used(), engine.memory().limit());
    assert!(used <= limit, "{what}: {used} bytes used above the {limit} limit");
}

fn open(dir: &Path, config: EngineConfig, what: &str) -> Engine {
    let limit = config.memory_limit;
    let engine = Engine::open(dir, config).unwrap_or_else(|e| panic!("{what}: open at {limit:?}: {e}"));
    within(&engine, &format!("{what}: after open"));
    engine
}

pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            copy_dir(&e.path(), &target);
        } else if e.file_name() != "LOCK" {
            // A file removed meanwhile (a temp file renamed) is simply not in the image.
            let _ = std::fs::copy(e.path(), &target);
        }
    }
}

fn wal_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir.join("wal")).map_or_else(|_| Vec::new(), |rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect());
    v.sort();
    v
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A file layer over the real one for these tests: copies the data directory right after
/// manifest renames (crash images), slows down or fails the removal of WAL segment files and
/// the WAL directory fsync, and records WAL removals that happen after the engine was closed.
#[derive(Debug, Default)]
struct TestFs {
    /// (data dir, images dir, every n-th manifest rename) while images are taken.
    snap: Mutex<Option<(PathBuf, PathBuf, u64)>>,
    images: Mutex<Vec<PathBuf>>,
    /// Images are taken before each WAL segment file removal instead of after renames.
    image_on_wal_remove: AtomicBool,
    manifest_renames: AtomicU64,
    remove_delay_ms: AtomicU64,
    fail_wal_remove: AtomicBool,
    fail_wal_sync_dir: AtomicBool,
    /// A WAL file was removed since the last WAL directory fsync (the fsync is the removal's).
    removed_since_sync: AtomicBool,
    failed_wal_syncs: AtomicU64,
    wal_removes: AtomicU64,
    failed_wal_removes: AtomicU64,
    /// Set by the test once the engine using this layer is closed or dropped.
    closed: AtomicBool,
    late: Mutex<Vec<String>>,
    /// Held across every create, rename, removal and directory fsync, and while an image is
    /// copied: an image is the directory between two such steps (what a crash leaves), even
    /// when another thread writes meanwhile.
    ops: Mutex<()>,
}

impl TestFs {
    fn is_wal(path: &Path) -> bool {
        path.parent().and_then(Path::file_name).is_some_and(|n| n == "wal")
    }

    fn note_late(&self, what: String) {
        if self.closed.load(Ordering::Acquire) {
            self.late.lock().unwrap().push(what);
        }
    }

    fn take_images(&self, dir: &Path, out: &Path, every: u64) {
        *self.snap.lock().unwrap() = Some((dir.to_path_buf(), out.to_path_buf(), every.max(1)));
    }

    fn stop_images(&self) -> Vec<PathBuf> {
        *self.snap.lock().unwrap() = None;
        self.images.lock().unwrap().clone()
    }
}

impl Vfs for TestFs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        let _ops = self.ops.lock().unwrap();
        StdFs.create(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let _ops = self.ops.lock().unwrap();
        StdFs.rename(from, to)?;
        if to.file_name().is_some_and(|n| n == "manifest.json") && !self.image_on_wal_remove.load(Ordering::Acquire) {
            let n = self.manifest_renames.fetch_add(1, Ordering::AcqRel);
            let snap = self.snap.lock().unwrap().clone();
            if let Some((dir, out, every)) = snap
                && n % every == every - 1
            {
                let image = out.join(format!("image-{n:04}"));
                copy_dir(&dir, &image);
                self.images.lock().unwrap().push(image);
            }
        }
        Ok(())
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        if !Self::is_wal(path) {
            let _ops = self.ops.lock().unwrap();
            return StdFs.remove_file(path);
        }
        self.note_late(format!("remove_file {}", path.display()));
        // The slow unlink does not hold up other file steps.
        let ms = self.remove_delay_ms.load(Ordering::Acquire);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let _ops = self.ops.lock().unwrap();
        if self.image_on_wal_remove.load(Ordering::Acquire) {
            let snap = self.snap.lock().unwrap().clone();
            if let Some((dir, out, _)) = snap {
                let mut images = self.images.lock().unwrap();
                let image = out.join(format!("removal-{:04}", images.len()));
                copy_dir(&dir, &image);
                images.push(image);
            }
        }
        self.removed_since_sync.store(true, Ordering::Release);
        if self.fail_wal_remove.load(Ordering::Acquire) {
            self.failed_wal_removes.fetch_add(1, Ordering::AcqRel);
            return Err(io::Error::from_raw_os_error(5));
        }
        self.wal_removes.fetch_add(1, Ordering::AcqRel);
        StdFs.remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        let _ops = self.ops.lock().unwrap();
        StdFs.create_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let _ops = self.ops.lock().unwrap();
        if path.file_name().is_some_and(|n| n == "wal") {
            self.note_late(format!("sync_dir {}", path.display()));
            // Only the fsync after removals fails (a new segment's is a write's).
            if self.removed_since_sync.swap(false, Ordering::AcqRel) && self.fail_wal_sync_dir.load(Ordering::Acquire) {
                self.failed_wal_syncs.fetch_add(1, Ordering::AcqRel);
                return Err(io::Error::from_raw_os_error(28));
            }
        }
        StdFs.sync_dir(path)
    }
}

fn with_fs(config: EngineConfig, fs: &Arc<TestFs>) -> EngineConfig {
    config.vfs(Arc::clone(fs) as Arc<dyn Vfs>)
}

// ---------------------------------------------------------------- crash images of a replay

/// Replays the log of `src` (a copy) through a file layer that copies the data directory
/// right after manifest renames made during `Engine::open`: about `images` crash images,
/// each with a `flushed_seq` somewhere in the log (often inside a record). Checks the open
/// itself too. Returns the images (kept under `out`).
fn replay_images(src: &Path, out: &Path, config: &dyn Fn() -> EngineConfig, models: &[Model], images: u64) -> Vec<PathBuf> {
    // A first replay counts the commits.
    let commits = {
        let work = tempfile::tempdir().unwrap();
        copy_dir(src, work.path());
        let fs = Arc::new(TestFs::default());
        let engine = open(work.path(), with_fs(config(), &fs), "counting replay");
        let n = fs.manifest_renames.load(Ordering::Acquire);
        check_all(&engine, models, "counting replay");
        n
    };
    assert!(commits >= 3, "the replay must commit several times inline ({commits})");
    eprintln!("replay at {:?}: {commits} inline commits", config().memory_limit);
    let every = (commits / images).max(1);
    let work = out.join("work");
    copy_dir(src, &work);
    let fs = Arc::new(TestFs::default());
    fs.take_images(&work, out, every);
    let engine = Engine::open(&work, with_fs(config(), &fs)).unwrap();
    let taken = fs.stop_images();
    within(&engine, "imaging replay");
    check_all(&engine, models, "imaging replay");
    drop(engine);
    assert!(!taken.is_empty());
    taken
}

/// The committed `flushed_seq` of table `name` in data directory `dir` (0: none).
fn flushed_seq(dir: &Path, name: &str) -> u64 {
    for e in std::fs::read_dir(dir.join("tables")).unwrap().flatten() {
        let Ok(text) = std::fs::read_to_string(e.path().join("manifest.json")) else { continue };
        let text: String = text.chars().filter(|c| !c.is_whitespace()).collect();
        if !text.contains(&format!("\"table\":\"{name}\"")) {
            continue;
        }
        let at = text.find("\"flushed_seq\":").expect("flushed_seq in the manifest") + "\"flushed_seq\":".len();
        return text[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap();
    }
    0
}

/// Picks up to `k` images with some table's `flushed_seq` inside a put record, `k` inside a
/// delete record and one other; returns them with the counts of each kind among all images.
fn pick(images: &[PathBuf], models: &[Model], k: usize) -> (Vec<PathBuf>, usize, usize) {
    let (mut put, mut del, mut other) = (Vec::new(), Vec::new(), Vec::new());
    for image in images {
        let places: Vec<&str> = models.iter().map(|m| m.place(flushed_seq(image, &m.name))).collect();
        if places.contains(&"inside delete") {
            del.push(image.clone());
        } else if places.contains(&"inside put") {
            put.push(image.clone());
        } else {
            other.push(image.clone());
        }
    }
    eprintln!("{} images: {} inside a delete, {} inside a put, {} other", images.len(), del.len(), put.len(), other.len());
    let (np, nd) = (put.len(), del.len());
    let spread = |v: Vec<PathBuf>| -> Vec<PathBuf> {
        let step = v.len().div_ceil(k.max(1)).max(1);
        v.into_iter().step_by(step).take(k).collect()
    };
    let mut out = spread(del);
    out.extend(spread(put));
    out.extend(other.into_iter().last());
    (out, np, nd)
}

/// Opens each crash image through `limits` in turn (dropped without close after each, the
/// last one closed): exact every time.
fn resume_images(images: &[PathBuf], models: &[Model], limits: &[(&str, &dyn Fn() -> EngineConfig)]) {
    for image in images {
        let name = image.file_name().unwrap().to_string_lossy().into_owned();
        for (i, (what, config)) in limits.iter().enumerate() {
            let what = format!("{name}, open {i} at {what}");
            let engine = open(image, config(), &what);
            check_all(&engine, models, &what);
            if i + 1 == limits.len() {
                engine.flush_all().unwrap_or_else(|e| panic!("{what}: flush_all: {e}"));
                within(&engine, &what);
                check_all(&engine, models, &format!("{what}, flushed"));
                engine.close().unwrap();
                // WAL files may be left here: a commit made without its WAL truncation (an
                // engine dropped during a background flush) is never followed by one when
                // nothing is left to flush (see `a_covered_log_found_at_open_is_removed_by_close`).
            } else {
                drop(engine);
            }
        }
        let engine = open(image, big(), &format!("{name}: final"));
        check_all(&engine, models, &format!("{name}: final open"));
    }
}

/// A crash right after the manifest rename of a flush that covers the whole log (before the
/// log's segments are forgotten and removed): the next open has nothing to replay, and its
/// close must still leave no WAL file.
#[test]
fn a_covered_log_found_at_open_is_removed_by_close() {
    let dir = tempfile::tempdir().unwrap();
    let images = tempfile::tempdir().unwrap();
    let mut m = Model::new("t", Shape { string_key: false, text: Text::Range { min: 8, max: 64 } });
    let fs = Arc::new(TestFs::default());
    {
        let engine = open(dir.path(), with_fs(big(), &fs), "writer");
        let t = m.create(&engine);
        m.insert(&t, 0..1_000);
        fs.take_images(dir.path(), images.path(), 1);
        t.flush().unwrap();
        fs.stop_images();
    }
    let image = fs.images.lock().unwrap()[0].clone();
    assert_eq!(flushed_seq(&image, "t"), 1_000, "the image has the flush committed");
    assert_eq!(wal_files(&image).len(), 1, "and the log not yet removed");
    for round in 0..3 {
        let engine = open(&image, big(), "image");
        check_all(&engine, std::slice::from_ref(&m), &format!("round {round}"));
        engine.close().unwrap();
        assert!(wal_files(&image).is_empty(), "round {round}: WAL files left after close: {:?}", wal_files(&image));
    }
}

/// One table, big records of every kind written at 256 MiB: an insert, an upsert over old and
/// new keys, an update of every other key, a delete record with absent keys, repeats and keys
/// of the same record range, inserts after it, a delete of keys inserted just before, and an
/// upsert bringing deleted keys back.
fn one_table_log(dir: &Path, shape: Shape, n: i64) -> Vec<Model> {
    let mut m = Model::new("t", shape);
    let engine = open(dir, big(), "source");
    let t = m.create(&engine);
    m.insert(&t, 0..n);
    m.upsert(&t, n / 2..n + n / 2);
    m.update(&t, (0..n + n / 2).step_by(2));
    let mut dels: Vec<i64> = (0..n + n / 2).step_by(3).collect();
    dels.extend(10 * n..10 * n + n / 10); // absent
    dels.extend((0..n).step_by(7)); // repeats (some already in the list)
    dels.extend((0..n / 4).rev().step_by(3)); // repeats in reverse order
    m.delete(&t, &dels);
    m.insert(&t, 2 * n..2 * n + n / 2);
    let mut dels2: Vec<i64> = (2 * n..2 * n + n / 2).step_by(2).collect();
    dels2.extend((1..n).step_by(5));
    dels2.extend(2 * n + n..2 * n + n + 500); // absent
    m.delete(&t, &dels2);
    m.upsert(&t, (0..n).step_by(3)); // deleted keys back
    m.update(&t, (0..3 * n).step_by(11));
    drop(t);
    drop(engine); // no close: everything is in the log
    vec![m]
}

/// Crash images taken at the replay's inline commits (4 MiB, 256 KiB flush threshold) of one
/// table's big records: each image resumes exactly at 4 MiB, 256 MiB and 6 MiB (dropped
/// without close in between), then closes with no WAL file left.
#[test]
fn crash_images_of_a_sliced_replay_resume_exactly() {
    let src = tempfile::tempdir().unwrap();
    let models = one_table_log(src.path(), Shape { string_key: false, text: Text::Range { min: 40, max: 400 } }, 12_000);
    let out = tempfile::tempdir().unwrap();
    let images = replay_images(src.path(), out.path(), &|| sliced(4 * MIB, 256 << 10), &models, 30);
    let (images, put, _) = pick(&images, &models, 3);
    assert!(put > 0, "no image with flushed_seq inside a put record");
    resume_images(&images, &models, &[("4 MiB", &|| sliced(4 * MIB, 128 << 10)), ("256 MiB", &big), ("6 MiB", &|| small(6 * MIB))]);
}

/// The same with a string key (`k`, `tag`: about 60 bytes a key), so a delete record is
/// itself cut into slices and `flushed_seq` lands inside delete records.
#[test]
fn crash_images_inside_delete_records_resume_exactly() {
    let src = tempfile::tempdir().unwrap();
    let models = one_table_log(src.path(), Shape { string_key: true, text: Text::Range { min: 8, max: 120 } }, 12_000);
    let out = tempfile::tempdir().unwrap();
    let images = replay_images(src.path(), out.path(), &|| sliced(8 * MIB, 128 << 10), &models, 40);
    let (images, put, del) = pick(&images, &models, 3);
    assert!(put > 0 && del > 0, "images inside puts {put}, inside deletes {del}");
    resume_images(&images, &models, &[("8 MiB / 64 KiB", &|| sliced(8 * MIB, 64 << 10)), ("8 MiB / 256 KiB", &|| sliced(8 * MIB, 256 << 10))]);
}

/// Three tables whose big records interleave in the log (a string-keyed one among them):
/// one table's slices are flushed while another's record is half replayed. Crash images
/// at the inline commits resume exactly.
#[test]
fn crash_images_of_interleaved_tables_resume_exactly() {
    let src = tempfile::tempdir().unwrap();
    let shapes = [
        Shape { string_key: false, text: Text::Range { min: 100, max: 700 } },
        Shape { string_key: true, text: Text::Range { min: 8, max: 64 } },
        Shape { string_key: false, text: Text::Range { min: 8, max: 40 } },
    ];
    let mut models: Vec<Model> = shapes.iter().enumerate().map(|(i, s)| Model::new(&format!("m{i}"), *s)).collect();
    {
        let engine = open(src.path(), big(), "source");
        let ts: Vec<Table> = models.iter().map(|m| m.create(&engine)).collect();
        let n = 2_500_i64;
        for round in 0..3_i64 {
            for (i, (m, t)) in models.iter_mut().zip(&ts).enumerate() {
                let base = round * n + i as i64;
                m.insert(t, base * 10..base * 10 + n);
            }
            for (m, t) in models.iter_mut().zip(&ts) {
                let keys: Vec<i64> = m.rows.keys().copied().step_by(2).collect();
                let mut dels = keys.clone();
                dels.extend(keys.iter().take(300).copied());
                dels.extend(1_000_000 + round * 1000..1_000_000 + round * 1000 + 700);
                m.delete(t, &dels);
            }
            for (m, t) in models.iter_mut().zip(&ts) {
                let keys: Vec<i64> = (0..(round + 1) * n * 10).step_by(9).collect();
                m.upsert(t, keys);
                let live: Vec<i64> = m.rows.keys().copied().step_by(3).collect();
                m.update(t, live);
            }
        }
    }
    let out = tempfile::tempdir().unwrap();
    let images = replay_images(src.path(), out.path(), &|| sliced(6 * MIB, 64 << 10), &models, 30);
    let (images, put, del) = pick(&images, &models, 2);
    assert!(put + del > 0, "no image with a flushed_seq inside a record");
    resume_images(&images, &models, &[("6 MiB / 64 KiB", &|| sliced(6 * MIB, 64 << 10)), ("256 MiB", &big)]);
}

// ---------------------------------------------------------------- chains of drops

/// A log of big records of every kind, reopened at alternating small limits and flush
/// thresholds and dropped without close each time (each open flushes inside records and the
/// next resumes there), with more writes between some opens: exact after every open.
#[test]
fn alternating_sliced_reopens_dropped_without_close() {
    let dir = tempfile::tempdir().unwrap();
    let mut models = one_table_log(dir.path(), Shape { string_key: true, text: Text::Range { min: 10, max: 200 } }, 9_000);
    let configs: Vec<(&str, EngineConfig)> = vec![
        ("6 MiB / 64 KiB", sliced(6 * MIB, 64 << 10)),
        ("8 MiB / 192 KiB", sliced(8 * MIB, 192 << 10)),
        ("6 MiB / 96 KiB", sliced(6 * MIB, 96 << 10)),
        ("256 MiB", big()),
        ("8 MiB / 64 KiB", sliced(8 * MIB, 64 << 10)),
        ("6 MiB", small(6 * MIB)),
        ("8 MiB / 128 KiB", sliced(8 * MIB, 128 << 10)),
    ];
    for (round, (what, config)) in configs.into_iter().enumerate() {
        let what = format!("round {round} at {what}");
        let engine = open(dir.path(), config, &what);
        check_all(&engine, &models, &what);
        if round % 3 == 2 {
            // More writes at this limit (smaller records), then still no close.
            let t = engine.table("t").unwrap();
            let m = &mut models[0];
            let base = 100_000 + round as i64 * 5_000;
            m.insert(&t, base..base + 2_000);
            let mut d: Vec<i64> = (base..base + 2_000).step_by(4).collect();
            d.extend((0..20_000).step_by(13));
            m.delete(&t, &d);
            m.upsert(&t, (0..20_000).step_by(17));
            check_all(&engine, &models, &format!("{what}, written"));
        }
        drop(engine);
    }
    let engine = open(dir.path(), small(8 * MIB), "last");
    check_all(&engine, &models, "last open");
    engine.close().unwrap();
    assert!(wal_files(dir.path()).is_empty(), "WAL left after close: {:?}", wal_files(dir.path()));
}

// ---------------------------------------------------------------- faults in the replay

/// A log of big records (string key: delete records are sliced too) replayed at 8 MiB with
/// a 96 KiB flush threshold through a file layer failing one write-side step (sampled over
/// all steps of a clean replay; EIO and ENOSPC alternating), then opened again at another
/// threshold with another fault, dropped, and opened cleanly: nothing lost or resurrected.
#[test]
fn faults_in_sliced_replays_then_resumes() {
    let src = tempfile::tempdir().unwrap();
    let models = one_table_log(src.path(), Shape { string_key: true, text: Text::Range { min: 8, max: 160 } }, 8_000);
    let steps = {
        let work = tempfile::tempdir().unwrap();
        copy_dir(src.path(), work.path());
        let fs = FaultFs::new();
        let engine = open(work.path(), sliced(8 * MIB, 96 << 10).vfs(Arc::new(fs.clone())), "clean replay");
        check_all(&engine, &models, "clean replay through FaultFs");
        fs.steps()
    };
    assert!(steps > 20, "replay must flush inline ({steps} steps)");
    let stride = (steps / 10).max(1);
    let mut failed = 0;
    for (i, n) in (3..steps).step_by(stride as usize).enumerate() {
        let work = tempfile::tempdir().unwrap();
        copy_dir(src.path(), work.path());
        let errno = if i % 2 == 0 { 5 } else { 28 };
        for (j, (flush, at)) in [(96 << 10, n), (160 << 10, n / 3 + 1)].into_iter().enumerate() {
            let fs = FaultFs::new();
            fs.fail_step(at, errno);
            match Engine::open(work.path(), sliced(8 * MIB, flush).vfs(Arc::new(fs.clone()))) {
                Ok(engine) => {
                    within(&engine, "faulty open that succeeded");
                    check_all(&engine, &models, &format!("fault {j} at step {at} (of {steps}), open survived"));
                    drop(engine);
                }
                Err(e) => {
                    failed += 1;
                    eprintln!("fault {j} at step {at}: open failed: {e}");
                }
            }
        }
        let engine = open(work.path(), sliced(8 * MIB, 64 << 10), "after faults");
        check_all(&engine, &models, &format!("after faults at {n} (of {steps})"));
        drop(engine);
        let engine = open(work.path(), big(), "after faults, big");
        check_all(&engine, &models, &format!("after faults at {n}, big"));
        engine.close().unwrap();
    }
    assert!(failed > 0, "no fault made an open fail");
}

// ---------------------------------------------------------------- WAL segment removal

/// Rounds of writes to two tables with a flush after each batch (each flush covers the
/// active segment: one removal, slowed to 15 ms), a table dropped and created now and then,
/// and the engine closed or dropped right after its last flush: when `close`/drop returns no
/// removal of that engine is still to come (none reaches the file layer afterwards), a
/// closed engine leaves no WAL file, and the reopen at once is exact.
#[test]
fn wal_removal_finishes_before_close_returns_and_reopen_at_once_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Range { min: 8, max: 100 } };
    let mut models = vec![Model::new("a", shape), Model::new("b", shape)];
    let mut late_fs: Vec<Arc<TestFs>> = Vec::new();
    let mut created = 0;
    for round in 0..14_i64 {
        let fs = Arc::new(TestFs::default());
        fs.remove_delay_ms.store(15, Ordering::Release);
        let engine = open(dir.path(), with_fs(small(64 * MIB), &fs), &format!("round {round}"));
        for m in &models {
            if engine.table(&m.name).is_err() {
                m.create(&engine);
            }
        }
        check_all(&engine, &models, &format!("round {round}: reopened"));
        for part in 0..3_i64 {
            for m in &mut models {
                let t = engine.table(&m.name).unwrap();
                let base = round * 10_000 + part * 1_000;
                m.upsert(&t, base..base + 600);
                m.delete(&t, &(base - 5_000..base - 4_900).collect::<Vec<_>>());
                t.flush().unwrap();
            }
        }
        if round % 4 == 1 {
            // Drop a table while the removals of the flushes above run, create another.
            let gone = models.remove(0);
            engine.drop_table(&gone.name).unwrap();
            created += 1;
            let mut m = Model::new(&format!("c{created}"), shape);
            let t = m.create(&engine);
            m.insert(&t, 0..500);
            t.flush().unwrap();
            models.push(m);
        }
        let tail = engine.table(&models[0].name).unwrap();
        models[0].insert(&tail, 500_000 + round * 100..500_000 + round * 100 + 50);
        drop(tail);
        if round % 2 == 0 {
            drop(engine);
        } else {
            engine.close().unwrap();
            assert!(wal_files(dir.path()).is_empty(), "round {round}: WAL files left after close: {:?}", wal_files(dir.path()));
        }
        fs.closed.store(true, Ordering::Release);
        late_fs.push(fs);
    }
    std::thread::sleep(Duration::from_millis(100));
    for (round, fs) in late_fs.iter().enumerate() {
        assert!(fs.late.lock().unwrap().is_empty(), "round {round}: WAL file calls after the engine closed: {:?}", fs.late.lock().unwrap());
        assert!(fs.wal_removes.load(Ordering::Acquire) > 0, "round {round}: no WAL segment removed");
    }
    let engine = open(dir.path(), small(64 * MIB), "last");
    check_all(&engine, &models, "last open");
}

/// WAL segment files whose removal fails (EIO) and a failing WAL directory fsync (ENOSPC):
/// flushes, drops and closes still succeed, the log forgets the segments
/// (`wal_usage` counts none after a full flush), nothing is lost, a dropped table's records
/// left in those files never come back (not even in a table created later), the next open
/// works, and a later clean run removes the leftovers.
#[test]
fn failing_wal_removal_loses_nothing_and_leftovers_go_later() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Range { min: 8, max: 200 } };
    let mut models = vec![Model::new("a", shape), Model::new("b", shape)];
    let fs = Arc::new(TestFs::default());
    fs.fail_wal_remove.store(true, Ordering::Release);
    fs.fail_wal_sync_dir.store(true, Ordering::Release);
    {
        let engine = open(dir.path(), with_fs(small(32 * MIB), &fs), "failing removal");
        for m in &models {
            m.create(&engine);
        }
        for round in 0..4_i64 {
            for m in &mut models {
                let t = engine.table(&m.name).unwrap();
                m.upsert(&t, round * 1_000..round * 1_000 + 2_000);
                m.delete(&t, &(round * 1_000..round * 1_000 + 300).step_by(2).collect::<Vec<_>>());
                t.flush().unwrap();
            }
        }
        engine.flush_all().unwrap();
        assert_eq!(engine.wal_usage().0, 0, "the log forgets covered segments even when their files stay");
        // b's records stay in files the log forgot; then b is dropped.
        let b = engine.table("b").unwrap();
        models[1].upsert(&b, 50_000..51_000);
        drop(b);
        engine.drop_table("b").unwrap();
        models.remove(1);
        let t = engine.table("a").unwrap();
        models[0].upsert(&t, 60_000..60_500);
        drop(t);
        engine.close().unwrap();
    }
    let left = wal_files(dir.path());
    assert!(!left.is_empty(), "the failing layer kept the files");
    assert!(fs.failed_wal_removes.load(Ordering::Acquire) > 0);
    assert!(fs.failed_wal_syncs.load(Ordering::Acquire) > 0);
    {
        // Still failing: the leftovers are read (covered records skipped), a new table is
        // created (its id must not be the dropped table's: its records are in the leftovers).
        let fs2 = Arc::new(TestFs::default());
        fs2.fail_wal_remove.store(true, Ordering::Release);
        let engine = open(dir.path(), with_fs(small(32 * MIB), &fs2), "reopen, still failing");
        check_all(&engine, &models, "reopen with leftovers");
        let mut m = Model::new("n", shape);
        let t = m.create(&engine);
        m.insert(&t, 50_500..50_600); // overlaps the dropped table's keys
        models.push(m);
        check_all(&engine, &models, "new table beside leftovers");
        drop(t);
        drop(engine); // no close
    }
    {
        let engine = open(dir.path(), small(32 * MIB), "clean reopen");
        check_all(&engine, &models, "clean reopen");
        let t = engine.table("n").unwrap();
        models[1].upsert(&t, 70_000..70_010);
        t.flush().unwrap();
        engine.flush_all().unwrap();
        drop(t);
        wait_until("leftover WAL files removed", || wal_files(dir.path()).len() <= engine.wal_usage().0);
        engine.close().unwrap();
    }
    assert!(wal_files(dir.path()).is_empty(), "leftovers: {:?}", wal_files(dir.path()));
    let engine = open(dir.path(), small(32 * MIB), "final");
    check_all(&engine, &models, "final");
}

/// A removal slowed to 300 ms per file: tables dropped and the engine dropped while it runs,
/// a new table created meanwhile; the drop waits for the removal, the reopen at once is
/// exact and its own first flush works.
#[test]
fn drop_table_and_engine_during_a_slow_removal() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Range { min: 8, max: 100 } };
    let mut models = vec![Model::new("a", shape), Model::new("b", shape)];
    for round in 0..4_i64 {
        let fs = Arc::new(TestFs::default());
        fs.remove_delay_ms.store(300, Ordering::Release);
        let engine = open(dir.path(), with_fs(small(32 * MIB), &fs), &format!("round {round}"));
        for m in &models {
            if engine.table(&m.name).is_err() {
                m.create(&engine);
            }
        }
        check_all(&engine, &models, &format!("round {round}"));
        for m in &mut models {
            let t = engine.table(&m.name).unwrap();
            m.upsert(&t, round * 1_000..round * 1_000 + 800);
        }
        // Flushing the first covers nothing (the second's records share the segment);
        // dropping the second does: the removal starts, and takes 300 ms.
        engine.table(&models[0].name).unwrap().flush().unwrap();
        let gone = models.remove(1);
        engine.drop_table(&gone.name).unwrap();
        let started = Instant::now();
        let mut m = Model::new(&format!("{}x", gone.name), shape);
        let t = m.create(&engine);
        m.insert(&t, 0..300);
        t.flush().unwrap();
        drop(t);
        models.push(m);
        let t = engine.table(&models[0].name).unwrap();
        models[0].upsert(&t, 90_000..90_100);
        drop(t);
        let before_drop = started.elapsed();
        drop(engine);
        fs.closed.store(true, Ordering::Release);
        assert!(fs.wal_removes.load(Ordering::Acquire) > 0 || before_drop >= Duration::from_millis(300), "round {round}: nothing removed");
        let engine = open(dir.path(), small(32 * MIB), &format!("round {round}: at once"));
        check_all(&engine, &models, &format!("round {round}: reopened at once"));
        engine.flush_all().unwrap();
        drop(engine);
        std::thread::sleep(Duration::from_millis(50));
        assert!(fs.late.lock().unwrap().is_empty(), "round {round}: WAL calls after the drop: {:?}", fs.late.lock().unwrap());
    }
}

// ---------------------------------------------------------------- scans and export

/// Writes `rows` with `shape` at 256 MiB and closes (all in files, one big row group).
fn files_at_big(dir: &Path, shape: Shape, keys: std::ops::Range<i64>) -> Model {
    let mut m = Model::new("f", shape);
    let engine = open(dir, big(), "writer");
    let t = m.create(&engine);
    let ks: Vec<i64> = keys.collect();
    for part in ks.chunks(20_000) {
        m.insert(&t, part.iter().copied());
    }
    drop(t);
    engine.close().unwrap();
    m
}

/// Every scan shape on a table: full, projections (reordered, without the key), filters on
/// the key and on the version (filter column not projected), at `limit`.
fn scans_exact(m: &Model, t: &Table, engine: &Engine, what: &str) {
    m.check(t, &format!("{what}: full"));
    within(engine, what);
    m.check_with(t, ScanOptions::default().projection(["s", "k"]), &["s", "k"], &|_, _| true, &format!("{what}: s, k"));
    let max_k = m.rows.keys().next_back().copied().unwrap_or(0);
    let cut = max_k - max_k / 5;
    let f = ScanFilter::compare("k", CompareOp::GtEq, Arc::new(Int64Array::from(vec![cut])));
    m.check_with(t, ScanOptions::default().projection(["k", "s", "b"]).filter(f), &["k", "s", "b"], &|k, _| k >= cut, &format!("{what}: k >= {cut}"));
    let ver = m.ver;
    let f = ScanFilter::compare("v", CompareOp::Eq, Arc::new(Int64Array::from(vec![ver as i64])));
    m.check_with(t, ScanOptions::default().projection(["k", "s"]).filter(f), &["k", "s"], &|_, v| v == ver, &format!("{what}: v = {ver}"));
    // Projection without the key: count and the sum of the versions.
    let mut rows = 0usize;
    let mut sum = 0i64;
    for b in t.scan(ScanOptions::default().projection(["v"])).unwrap() {
        let b = b.unwrap_or_else(|e| panic!("{what}: v-only scan: {e}"));
        rows += b.num_rows();
        sum += b.column(0).as_primitive::<Int64Type>().iter().map(Option::unwrap).sum::<i64>();
    }
    assert_eq!((rows, sum), (m.rows.len(), m.rows.values().map(|v| *v as i64).sum::<i64>()), "{what}: v-only scan");
    within(engine, what);
}

/// A file whose one row group holds 20,000 narrow rows and then 500 rows of 40 KB: a byte
/// cap of a file batch from the row group's *average* row (about 1 KB) let a batch of the
/// wide tail ask for 40 KB times the rows the average allows (26 MiB, `MemoryLimit` at 16 MiB);
/// the cap now comes from the densest page of the page index.
fn skewed_widths_scan_at(limit: usize) {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Skewed { from: 20_000, wide: 40_000 } };
    let m = files_at_big(dir.path(), shape, 0..20_500);
    let engine = open(dir.path(), small(limit), "scan at a small limit");
    let t = engine.table("f").unwrap();
    scans_exact(&m, &t, &engine, &format!("skewed widths at {} MiB", limit / MIB));
}

#[test]
fn a_row_group_of_skewed_widths_scans_at_16_mib() {
    skewed_widths_scan_at(16 * MIB);
}

/// At 8 MiB too, since data files cap their dictionary pages at 256 KiB
/// (`DICTIONARY_PAGE_BYTES`): with Parquet's 1 MiB the open reader's buffers were estimated at
/// 6.8 MB (the wide column's 1 MiB dictionary page as stored and decoded, a decoded and a
/// compressed 1 MiB page) and the next 1.4 MiB batch did not fit beside them (`MemoryLimit`).
#[test]
fn a_row_group_of_skewed_widths_scans_at_8_mib() {
    skewed_widths_scan_at(8 * MIB);
}

/// Long text values repeated (4 distinct values of 3 KB): Parquet keeps them in a dictionary,
/// so the column chunk's uncompressed size says a few bytes per row while every decoded row
/// holds 3 KB.
#[test]
fn dictionary_encoded_wide_values_scan_at_4_mib() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::FewValues { len: 3_000 } };
    let m = files_at_big(dir.path(), shape, 0..30_000);
    let engine = open(dir.path(), small(4 * MIB), "scan at 4 MiB");
    let t = engine.table("f").unwrap();
    scans_exact(&m, &t, &engine, "dictionary values at 4 MiB");
}

/// The same data written and scanned at one small limit (8 MiB): no limit change at all.
#[test]
fn dictionary_encoded_wide_values_written_and_scanned_at_8_mib() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::FewValues { len: 3_000 } };
    let mut m = Model::new("f", shape);
    let engine = open(dir.path(), small(8 * MIB), "8 MiB");
    let t = m.create(&engine);
    for at in (0..30_000).step_by(1_000) {
        m.insert(&t, at..at + 1_000);
    }
    t.flush().unwrap();
    scans_exact(&m, &t, &engine, "dictionary values at 8 MiB");
}

/// Wide rows (2..6 KB) in files written at 256 MiB, then updates, deletes and upserts logged
/// at 256 MiB; reopened at 4 MiB (sliced replay), every scan shape exact; then flushed and
/// scanned again.
#[test]
fn wide_rows_files_and_deltas_scan_exactly_at_4_mib() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Range { min: 2_000, max: 6_000 } };
    let mut m = files_at_big(dir.path(), shape, 0..8_000);
    {
        let engine = open(dir.path(), big(), "writer 2");
        let t = engine.table("f").unwrap();
        m.update(&t, (0..8_000).step_by(3));
        m.delete(&t, &(0..8_000).step_by(7).chain(20_000..20_100).collect::<Vec<_>>());
        m.upsert(&t, 7_500..9_000);
    }
    let engine = open(dir.path(), small(4 * MIB), "scan at 4 MiB");
    let t = engine.table("f").unwrap();
    scans_exact(&m, &t, &engine, "wide rows after replay at 4 MiB");
    t.flush().unwrap();
    scans_exact(&m, &t, &engine, "wide rows flushed at 4 MiB");
}

fn read_parquet(path: &Path) -> Vec<RecordBatch> {
    let file = std::fs::File::open(path).unwrap();
    gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap().map(Result::unwrap).collect()
}

/// Export at 4 and 6 MiB after a sliced replay (files, sealed and active deltas at once),
/// with the default options and a 256 KiB cut: every exported file exact, memory within the
/// limit and the writer buffers given back.
#[test]
fn export_after_a_sliced_replay_is_exact() {
    for limit in [4 * MIB, 6 * MIB] {
        let dir = tempfile::tempdir().unwrap();
        let models = one_table_log(dir.path(), Shape { string_key: false, text: Text::Range { min: 40, max: 600 } }, 6_000);
        let m = &models[0];
        let engine = open(dir.path(), sliced(limit, 256 << 10), "export");
        let t = engine.table("t").unwrap();
        let out = tempfile::tempdir().unwrap();
        for (name, opts) in [("default", ExportOptions::default()), ("256k", ExportOptions::default().row_group_bytes(256 << 10))] {
            let path = out.path().join(format!("{name}.parquet"));
            let what = format!("export {name} at {} MiB", limit / MIB);
            let stats = t.export_parquet_with(&path, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
            within(&engine, &what);
            assert_eq!(stats.rows, m.rows.len() as u64, "{what}: rows");
            m.check_batches(read_parquet(&path), &m.all_cols(), &|_, _| true, &what);
            wait_until("writer buffers given back", || engine.memory().category_bytes(Category::WriteBuffers) == 0);
        }
    }
}

/// One insert record of 6,000 narrow rows whose last 24 rows hold 700 KB each (all rows far
/// under `max_row_bytes`), written at 256 MiB: replay at 8 MiB slices the record by its
/// *average* row (about 2.8 KB), so the last slice holds all 24 wide rows (16 MiB).
#[test]
fn a_record_with_its_wide_rows_together_replays_at_8_mib() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Skewed { from: 6_000, wide: 700_000 } };
    let mut m = Model::new("w", shape);
    {
        let engine = open(dir.path(), big(), "writer");
        let t = m.create(&engine);
        m.insert(&t, 0..6_024); // one record
        m.delete(&t, &[3, 6_010]);
    }
    let engine = open(dir.path(), small(8 * MIB), "replay at 8 MiB");
    check_all(&engine, std::slice::from_ref(&m), "after replay at 8 MiB");
    engine.flush_all().unwrap();
    check_all(&engine, std::slice::from_ref(&m), "flushed at 8 MiB");
}

/// The control case: the same rows, the wide ones one per record (written at 256 MiB).
#[test]
fn the_same_wide_rows_one_per_record_replay_at_8_mib() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: false, text: Text::Skewed { from: 6_000, wide: 700_000 } };
    let mut m = Model::new("w", shape);
    {
        let engine = open(dir.path(), big(), "writer");
        let t = m.create(&engine);
        m.insert(&t, 0..6_000);
        for k in 6_000..6_024 {
            m.insert(&t, [k]);
        }
        m.delete(&t, &[3, 6_010]);
    }
    let engine = open(dir.path(), small(8 * MIB), "replay at 8 MiB");
    check_all(&engine, std::slice::from_ref(&m), "after replay at 8 MiB");
    engine.flush_all().unwrap();
    check_all(&engine, std::slice::from_ref(&m), "flushed at 8 MiB");
}

/// A log of three 16 MiB segments replayed at 8 MiB (inline commits inside records), then
/// flushed in the background and by `flush_all`: crash images taken right before each
/// covered segment file is removed (the log has forgotten it, the file is still there)
/// resume exactly at 6 MiB and at 256 MiB.
#[test]
fn crash_images_before_segment_removals_resume_exactly() {
    let src = tempfile::tempdir().unwrap();
    let mut m = Model::new("t", Shape { string_key: false, text: Text::Range { min: 200, max: 900 } });
    {
        let engine = open(src.path(), big(), "source");
        let t = m.create(&engine);
        for part in 0..6_i64 {
            m.upsert(&t, part * 6_000..part * 6_000 + 12_000); // about 8 MB a record
        }
        let dels: Vec<i64> = (0..45_000).step_by(2).chain(90_000..90_500).collect();
        m.delete(&t, &dels);
        m.update(&t, (0..42_000).step_by(5));
    }
    assert!(wal_files(src.path()).len() >= 3, "a log of several segments: {:?}", wal_files(src.path()));
    let out = tempfile::tempdir().unwrap();
    let work = out.path().join("work");
    copy_dir(src.path(), &work);
    let fs = Arc::new(TestFs::default());
    fs.image_on_wal_remove.store(true, Ordering::Release);
    fs.take_images(&work, out.path(), 1);
    let models = vec![m];
    {
        let engine = open(&work, with_fs(sliced(8 * MIB, 512 << 10), &fs), "imaging");
        check_all(&engine, &models, "imaging open");
        engine.flush_all().unwrap();
        check_all(&engine, &models, "imaging open, flushed");
        engine.close().unwrap();
    }
    let images = fs.stop_images();
    assert!(!images.is_empty(), "no segment removal seen");
    eprintln!("{} images before segment removals", images.len());
    for image in &images {
        let name = image.file_name().unwrap().to_string_lossy().into_owned();
        let engine = open(image, sliced(6 * MIB, 256 << 10), &name);
        check_all(&engine, &models, &format!("{name} at 6 MiB"));
        drop(engine);
        let engine = open(image, big(), &name);
        check_all(&engine, &models, &format!("{name} at 256 MiB"));
    }
}

/// Writes the engine rejects (a repeated key in an upsert, an existing key in an insert, a
/// missing key in an update) apply nothing and log nothing: interleaved with big accepted
/// records, a sliced replay (dropped twice without close) is exact.
#[test]
fn rejected_writes_between_big_records_are_not_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape { string_key: true, text: Text::Range { min: 20, max: 300 } };
    let mut m = Model::new("r", shape);
    {
        let engine = open(dir.path(), big(), "writer");
        let t = m.create(&engine);
        m.insert(&t, 0..8_000);
        let ver = m.bump();
        let mut rows: Vec<(i64, u64)> = (8_000..12_000).map(|k| (k, ver)).collect();
        rows.push((9_000, ver));
        assert!(t.upsert(&shape.batch(&rows)).is_err(), "an upsert with a repeated key is refused");
        let rows: Vec<(i64, u64)> = (7_000..9_000).map(|k| (k, ver)).collect();
        assert!(t.insert(&shape.batch(&rows)).is_err(), "an insert of existing keys is refused");
        assert!(t.update(&shape.batch(&rows)).is_err(), "an update of missing keys is refused");
        let dels: Vec<i64> = (0..8_000).step_by(2).chain(0..100).collect();
        m.delete(&t, &dels);
        m.upsert(&t, 4_000..10_000);
        m.delete(&t, &(9_000..9_500).collect::<Vec<_>>());
    }
    for (i, config) in [sliced(6 * MIB, 64 << 10), sliced(8 * MIB, 160 << 10), big()].into_iter().enumerate() {
        let engine = open(dir.path(), config, &format!("open {i}"));
        check_all(&engine, std::slice::from_ref(&m), &format!("open {i}"));
    }
}

/// A flush called on a table handle is stalled in its data-file (or manifest) write when the
/// engine is dropped (the drop does not wait for a caller's flush, and nothing cancels it);
/// the directory is reopened in the same process, written and closed; then the stalled
/// write is released. The old flush must not commit into the directory the new engine
/// owns: every row acknowledged by the new engine is there at the next open.
#[test]
fn a_flush_stalled_across_close_does_not_commit_into_a_reopened_dir() {
    for pattern in [".parquet", "manifest", ".dv"] {
        let dir = tempfile::tempdir().unwrap();
        let shape = Shape { string_key: false, text: Text::Range { min: 8, max: 64 } };
        let mut m = Model::new("t", shape);
        let fs = FaultFs::new();
        let engine = open(dir.path(), small(64 * MIB).vfs(Arc::new(fs.clone())), "first engine");
        let t = m.create(&engine);
        m.insert(&t, 0..1_000);
        t.flush().unwrap();
        m.insert(&t, 1_000..2_000);
        m.delete(&t, &(0..1_000).step_by(3).collect::<Vec<_>>()); // a deletion vector
        fs.stall_paths(pattern);
        let stalled = std::thread::spawn(move || t.flush());
        wait_until("the flush to stall", || fs.is_stalled());
        drop(engine);
        {
            let engine = open(dir.path(), small(64 * MIB), "second engine");
            check_all(&engine, std::slice::from_ref(&m), &format!("{pattern}: second engine"));
            let t = engine.table("t").unwrap();
            m.insert(&t, 2_000..3_000);
            m.delete(&t, &(1..1_000).step_by(3).collect::<Vec<_>>());
            t.flush().unwrap();
            drop(t);
            engine.close().unwrap();
        }
        fs.heal();
        let res = stalled.join().unwrap();
        assert!(res.is_err(), "{pattern}: the stalled flush of the closed engine cannot succeed: {res:?}");
        let engine = open(dir.path(), small(64 * MIB), "third engine");
        check_all(&engine, std::slice::from_ref(&m), &format!("{pattern}: after the old flush was released"));
    }
}

/// A table dropped and created again under the same name (other key, other columns' data)
/// within one log, both with big records: a sliced replay applies only the new table's.
#[test]
fn a_table_dropped_and_recreated_within_one_sliced_log() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new("x", Shape { string_key: true, text: Text::Range { min: 20, max: 200 } });
    {
        let engine = open(dir.path(), big(), "writer");
        let mut old = Model::new("x", Shape { string_key: false, text: Text::Range { min: 100, max: 400 } });
        let t = old.create(&engine);
        old.insert(&t, 0..9_000);
        old.delete(&t, &(0..9_000).step_by(2).collect::<Vec<_>>());
        drop(t);
        engine.drop_table("x").unwrap();
        let t = m.create(&engine);
        m.insert(&t, 4_000..12_000);
        m.delete(&t, &(0..12_000).step_by(3).collect::<Vec<_>>());
        m.upsert(&t, 0..2_000);
    }
    for (i, config) in [sliced(6 * MIB, 64 << 10), sliced(8 * MIB, 128 << 10), big()].into_iter().enumerate() {
        let engine = open(dir.path(), config, &format!("open {i}"));
        check_all(&engine, std::slice::from_ref(&m), &format!("open {i}"));
    }
}

/// A fault at each write-side step of a flush whose commit is followed by a compaction:
/// when the flush fails (a step of its commit), the table shows degraded; when the flush
/// committed and the compaction after it failed, the flush returns `Ok` and the table shows
/// degraded with `COMPACTION_FAILED`; a later flush with nothing new (the compaction
/// retried) succeeds and clears it; the rows are exact, also after a reopen that replays
/// nothing the failed flush committed twice.
#[test]
fn a_compaction_fault_marks_degraded_and_the_next_flush_clears_it() {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Outcome {
        Clean,
        FlushFailed,
        CompactionFailed,
    }
    let shape = Shape { string_key: false, text: Text::Range { min: 8, max: 80 } };
    let run = |fault: Option<u64>| -> (u64, Outcome) {
        let dir = tempfile::tempdir().unwrap();
        let fs = FaultFs::new();
        let mut m = Model::new("c", shape);
        let engine = open(dir.path(), small(64 * MIB).vfs(Arc::new(fs.clone())), "compaction");
        let t = m.create(&engine);
        for i in 0..3 {
            m.insert(&t, i * 500..(i + 1) * 500);
            m.delete(&t, &[i * 500 + 7]);
            t.flush().unwrap();
        }
        m.upsert(&t, 1_400..1_700);
        m.delete(&t, &(0..1_500).step_by(9).collect::<Vec<_>>());
        let before = fs.steps();
        if let Some(n) = fault {
            fs.fail_step(n, 5);
        }
        let res = t.flush();
        let steps = fs.steps() - before;
        let what = format!("fault at step {fault:?}");
        let recorded = t.stats().unwrap().last_flush_error;
        let outcome = match (&res, &recorded) {
            (Err(e), Some(r)) => {
                assert!(!r.starts_with(gritdb::COMPACTION_FAILED), "{what}: the flush failed ({e}) but the record says compaction: {r}");
                Outcome::FlushFailed
            }
            (Err(e), None) => panic!("{what}: failed ({e}) but not degraded"),
            (Ok(_), Some(r)) => {
                assert!(r.starts_with(gritdb::COMPACTION_FAILED), "{what}: succeeded but degraded by {r}");
                Outcome::CompactionFailed
            }
            (Ok(_), None) => Outcome::Clean,
        };
        assert_eq!(engine.degraded_tables().len(), usize::from(outcome != Outcome::Clean), "{what}");
        m.check(&t, &format!("{what}: after the flush"));
        // A second flush (nothing new, the compaction again): clean.
        t.flush().unwrap_or_else(|e| panic!("{what}: second flush: {e}"));
        let stats = t.stats().unwrap();
        assert!(stats.last_flush_error.is_none(), "{what}: still degraded after a good flush: {stats:?}");
        assert!(engine.degraded_tables().is_empty(), "{what}");
        assert!(stats.files < 4, "{what}: four files and no compaction: {stats:?}");
        m.check(&t, &format!("{what}: after the second flush"));
        drop(t);
        drop(engine);
        let engine = open(dir.path(), small(64 * MIB), "reopen");
        check_all(&engine, std::slice::from_ref(&m), &format!("{what}: reopened"));
        (steps, outcome)
    };
    let (steps, clean) = run(None);
    assert_eq!(clean, Outcome::Clean);
    assert!(steps > 8, "{steps} steps");
    let outcomes: Vec<Outcome> = (0..steps).map(|n| run(Some(n)).1).collect();
    // The commit's steps come first (a fault there fails the flush), then the compaction's
    // (the flush returns Ok); a step or two between them tolerates a fault.
    let first_compaction = outcomes.iter().position(|o| *o == Outcome::CompactionFailed).expect("a fault in the compaction");
    assert!(outcomes[..first_compaction].contains(&Outcome::FlushFailed), "{outcomes:?}");
    assert!(outcomes[first_compaction..].iter().all(|o| *o != Outcome::FlushFailed), "{outcomes:?}");
}

/// Relaxed WAL sync (group commit every hour: never during the test): `close` flushes every
/// table and syncs the log; a closed engine leaves no WAL file, and a reopen and close
/// does not keep one either.
#[test]
fn relaxed_sync_close_leaves_no_wal() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new("r", Shape { string_key: false, text: Text::Range { min: 8, max: 64 } });
    let relaxed = || small(64 * MIB).wal_sync(gritdb::WalSync::Relaxed).wal_sync_interval(Duration::from_hours(1));
    {
        let engine = open(dir.path(), relaxed(), "relaxed");
        let t = m.create(&engine);
        m.insert(&t, 0..2_000);
        m.delete(&t, &(0..2_000).step_by(5).collect::<Vec<_>>());
        drop(t);
        engine.close().unwrap();
    }
    let after_first = wal_files(dir.path());
    for round in 0..2 {
        let engine = open(dir.path(), relaxed(), "reopen");
        check_all(&engine, std::slice::from_ref(&m), &format!("round {round}"));
        engine.close().unwrap();
    }
    let after_reopens = wal_files(dir.path());
    assert!(
        after_first.is_empty() && after_reopens.is_empty(),
        "WAL files left by the first close: {after_first:?}; after two reopens and closes: {after_reopens:?}"
    );
}
