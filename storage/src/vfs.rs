//! The file layer data files, deletion vectors and manifests are written through.
//!
//! [`StdFs`] is the real file system. [`FaultFs`] wraps it for tests and for users who want to
//! rehearse failures: it can fail the Nth write-side operation with an OS error (ENOSPC, EIO),
//! or stall every write and fsync until released — which is how the tests prove that a stuck
//! disk never blocks ingest, deletes, drops or memory reclamation.

use std::fmt::Debug;
use std::fs;
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// A file opened for writing through a [`Vfs`].
pub trait VfsFile: Write + Send {
    /// Flushes data and metadata to stable storage (`fsync`).
    fn sync_all(&mut self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// True when the file is empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
}

/// The write side of the file system, as storage uses it. Reads go to `std::fs` directly.
pub trait Vfs: Send + Sync + Debug {
    /// Creates (or truncates) a file for writing.
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>>;
    /// Renames `from` to `to`, replacing `to` (atomic on POSIX file systems).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Creates a directory.
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// fsyncs a directory so renames and creates inside it are durable.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
}

/// After [`Vfs::rename`] of `from` returned an error: whether the rename may have taken
/// effect anyway — `from` is gone, or cannot be looked up (a file system can apply a rename
/// and then report `EIO`, as a network or FUSE file system whose reply is lost does;
/// `breaker_trial5`). A caller that deletes what the rename's target names on a failed rename
/// must treat `true` as "renamed". Reads go to `std::fs`, as for the rest of storage.
pub fn rename_may_have_happened(from: &Path) -> bool {
    !matches!(from.try_exists(), Ok(true))
}

/// Writes all of `bufs` to `file` in order, with as few vectored writes (`writev`) as the
/// file takes: `std::io::Write::write_all_vectored` is not stable. `bufs` is consumed (its
/// slices are advanced past what was written).
///
/// # Errors
/// The first write error other than `Interrupted`; `WriteZero` when a write takes nothing.
/// Part of `bufs` may have been written.
pub fn write_all_vectored(file: &mut dyn VfsFile, mut bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    io::IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match file.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "failed to write the whole record")),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdFs;

struct StdFile(fs::File);

impl Write for StdFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.0.write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl VfsFile for StdFile {
    fn sync_all(&mut self) -> io::Result<()> {
        self.0.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
}

impl Vfs for StdFs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        Ok(Box::new(StdFile(fs::File::create(path)?)))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        fs::create_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        fs::File::open(path)?.sync_all()
    }
}

/// Which operation a [`FaultFs`] step was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FsOp {
    /// `create`
    Create,
    /// a `write` call
    Write,
    /// `sync_all` of a file
    Sync,
    /// `rename`
    Rename,
    /// `sync_dir`
    SyncDir,
    /// `create_dir`
    CreateDir,
}

#[derive(Debug, Default)]
struct FaultState {
    fail_at: Option<(u64, i32)>,
    fail_all: Option<i32>,
    /// Operations on paths containing this fail with the errno (`None`: none).
    fail_paths: Option<(String, i32)>,
    stall: bool,
    /// Only paths containing this are stalled (`None`: all).
    stall_filter: Option<String>,
}

/// A [`Vfs`] over [`StdFs`] that injects faults. Every write-side operation is one step
/// (counted from 0); `remove_file` never fails (cleanup must be possible).
#[derive(Debug, Clone, Default)]
pub struct FaultFs {
    inner: Arc<FaultInner>,
}

#[derive(Debug, Default)]
struct FaultInner {
    steps: AtomicU64,
    state: Mutex<FaultState>,
    cv: Condvar,
    stalled: AtomicBool,
}

impl FaultFs {
    /// A fault layer that injects nothing until told to.
    pub fn new() -> Self {
        Self::default()
    }

    /// Write-side operations performed so far.
    pub fn steps(&self) -> u64 {
        self.inner.steps.load(Ordering::Acquire)
    }

    /// Makes step `n` (counting from the current step count, 0 = the next) fail with the OS
    /// error `errno` (e.g. `libc::ENOSPC` = 28, `libc::EIO` = 5).
    pub fn fail_step(&self, n: u64, errno: i32) {
        let at = self.steps() + n;
        self.lock().fail_at = Some((at, errno));
    }

    /// Makes every write-side operation fail with `errno` until [`Self::heal`].
    pub fn fail_all(&self, errno: i32) {
        self.lock().fail_all = Some(errno);
    }

    /// Makes every write-side operation on a path containing `pattern` fail with `errno`
    /// until [`Self::heal`] (for example the name of the file a compaction will write, to
    /// fail it and nothing before it).
    pub fn fail_paths(&self, pattern: &str, errno: i32) {
        self.lock().fail_paths = Some((pattern.to_owned(), errno));
    }

    /// Blocks every following write and fsync until [`Self::heal`].
    pub fn stall(&self) {
        let mut s = self.lock();
        s.stall = true;
        s.stall_filter = None;
    }

    /// Blocks following writes and fsyncs of files whose path contains `pattern` (for example
    /// `".parquet"`: the background writer's data files, not the write-ahead log) until
    /// [`Self::heal`].
    pub fn stall_paths(&self, pattern: &str) {
        let mut s = self.lock();
        s.stall = true;
        s.stall_filter = Some(pattern.to_owned());
    }

    /// True while an operation is blocked by [`Self::stall`].
    pub fn is_stalled(&self) -> bool {
        self.inner.stalled.load(Ordering::Acquire)
    }

    /// Clears every injected fault and releases stalled operations.
    pub fn heal(&self) {
        let mut s = self.lock();
        *s = FaultState::default();
        self.inner.cv.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.inner.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn step(&self, op: FsOp, path: &Path) -> io::Result<()> {
        let step = self.inner.steps.fetch_add(1, Ordering::AcqRel);
        let mut s = self.lock();
        let matches = |s: &FaultState| s.stall_filter.as_ref().is_none_or(|p| path.to_string_lossy().contains(p.as_str()));
        if s.stall && matches!(op, FsOp::Write | FsOp::Sync) && matches(&s) {
            self.inner.stalled.store(true, Ordering::Release);
            while s.stall {
                s = self.inner.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
            }
            self.inner.stalled.store(false, Ordering::Release);
        }
        if let Some(errno) = s.fail_all {
            return Err(io::Error::from_raw_os_error(errno));
        }
        if let Some((pattern, errno)) = &s.fail_paths
            && path.to_string_lossy().contains(pattern.as_str())
        {
            return Err(io::Error::from_raw_os_error(*errno));
        }
        if let Some((at, errno)) = s.fail_at
            && at == step
        {
            s.fail_at = None;
            return Err(io::Error::from_raw_os_error(errno));
        }
        Ok(())
    }
}

struct FaultFile {
    inner: Box<dyn VfsFile>,
    fs: FaultFs,
    path: std::path::PathBuf,
}

impl Write for FaultFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.fs.step(FsOp::Write, &self.path)?;
        self.inner.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.fs.step(FsOp::Write, &self.path)?;
        self.inner.write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl VfsFile for FaultFile {
    fn sync_all(&mut self) -> io::Result<()> {
        self.fs.step(FsOp::Sync, &self.path)?;
        self.inner.sync_all()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
}

impl Vfs for FaultFs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        self.step(FsOp::Create, path)?;
        Ok(Box::new(FaultFile { inner: StdFs.create(path)?, fs: self.clone(), path: path.to_path_buf() }))
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.step(FsOp::Rename, to)?;
        StdFs.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.step(FsOp::CreateDir, path)?;
        StdFs.create_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.step(FsOp::SyncDir, path)?;
        StdFs.sync_dir(path)
    }
}
