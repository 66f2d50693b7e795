//! Export of a table's current snapshot as one Parquet file other engines read
//! ([`Table::export_parquet`]).
//!
//! gritdb's own data files are Parquet too, but a table's live rows are "files minus deletion
//! vectors, merged with the in-memory deltas", which no other engine knows how to apply. An
//! export writes exactly what [`Table::scan`] returns into one plain Parquet file (Arrow schema
//! embedded, Snappy pages ([`crate::EXPORT_COMPRESSION`]), column statistics), so pyarrow, `DuckDB`, Spark or `DataFusion` read
//! the same rows gritdb does.
//!
//! ```text
//! Table::scan (one snapshot) ──batch by batch──> StepWriter ──> <dir>/.<name>.<pid>.<n>.gritdb-export.tmp
//!     (gritdb_storage, the flush's stepped ArrowWriter)     │ fsync, check target, rename
//!     row groups cut by the writer's buffered bytes         ▼
//!     (ArrowWriter::memory_size, reserved as write_buffers) <dir>/<name>, then fsync <dir>
//! ```
//!
//! Memory: one scanned batch at a time (at most `batch_rows` rows), counted under
//! `scan_buffers` by the scan as every batch it hands out, and dropped once written; the
//! Parquet writer's buffers, and the metadata it keeps of every row group written until the
//! file is closed ([`gritdb_storage::FooterTally`]), are reserved under `write_buffers` for the
//! table as they grow and released when the file is closed. The writer is fed in steps of at
//! most a quarter of the row-group cut and never past a row group's end, as a flush's is
//! ([`gritdb_storage::StepWriter`]); unlike a flush, an export budgets each row group's
//! metadata before closing it and fails with `MemoryLimit` when refused
//! ([`gritdb_storage::WrittenMetadata::Budget`]), because its row groups are sized by the
//! caller. Both categories are back where they were when the
//! export returns.
//!
//! Atomicity: the file appears under its name complete or not at all. On any error the temp
//! file is removed, and when the only failing step was the final directory fsync the renamed
//! file is removed too, so an `Err` never leaves a file of this export visible.

use crate::error::Error;
use crate::scan::ScanOptions;
use crate::table::Table;
use gritdb_storage::{Vfs, VfsFile};
use parquet::errors::ParquetError;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Default row-group cut for exports: the writer's buffered bytes (32 MiB, as for flushes).
const DEFAULT_ROW_GROUP_BYTES: usize = 32 << 20;
/// Default upper bound on rows per row group (Parquet's default).
const DEFAULT_ROW_GROUP_ROWS: usize = 1 << 20;

/// How [`Table::export_parquet_with`] writes its file.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    overwrite: bool,
    row_group_bytes: usize,
    row_group_rows: usize,
    batch_rows: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self { overwrite: false, row_group_bytes: DEFAULT_ROW_GROUP_BYTES, row_group_rows: DEFAULT_ROW_GROUP_ROWS, batch_rows: 8192 }
    }
}

impl ExportOptions {
    /// Replace an existing file at the target path (default: `false`, an existing target is
    /// [`ExportError::TargetExists`]). The old file stays intact until the new one is complete
    /// and renamed over it.
    #[must_use]
    pub fn overwrite(mut self, yes: bool) -> Self {
        self.overwrite = yes;
        self
    }

    /// Close a row group once the Parquet writer buffers this many bytes
    /// (`ArrowWriter::memory_size`: encoded pages, encoders, dictionaries; at least twice
    /// the dictionary tables every row group opens with, which closing does not free),
    /// checked after each step of at most a quarter of it (at least one row). Bounds the export's
    /// writer memory to about this plus one step, plus the metadata of the row groups already
    /// written (about [`crate::WRITTEN_CHUNK_BYTES`] a column chunk, kept until the file is
    /// closed and counted under `write_buffers` too). Default 32 MiB; at least 1 KiB. Under a
    /// small memory limit the cut is at most a quarter of the write soft limit (the limit
    /// less the flush headroom, docs/memory.md), and a row group is also closed earlier when
    /// the limit refuses the buffers' growth, so the export's scan keeps room for its batches.
    #[must_use]
    pub fn row_group_bytes(mut self, bytes: usize) -> Self {
        self.row_group_bytes = bytes.max(1 << 10);
        self
    }

    /// Upper bound on rows per row group. Default 1,048,576; at least 1. Each row group
    /// costs about [`crate::WRITTEN_CHUNK_BYTES`] a column in the writer until the file is
    /// closed, counted under the memory limit, so very small row groups of a large table can
    /// end in [`Error::MemoryLimit`] (in `write_buffers`).
    #[must_use]
    pub fn row_group_rows(mut self, rows: usize) -> Self {
        self.row_group_rows = rows.max(1);
        self
    }

    /// Rows per scanned batch handed to the writer (default 8,192).
    #[must_use]
    pub fn batch_rows(mut self, rows: usize) -> Self {
        self.batch_rows = rows.max(1);
        self
    }
}

/// What an export wrote ([`Table::export_parquet`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ExportStats {
    /// The file written.
    pub path: PathBuf,
    /// Rows written (the live rows of the snapshot).
    pub rows: u64,
    /// File size in bytes.
    pub bytes: u64,
    /// Row groups in the file.
    pub row_groups: usize,
    /// Highest reservation of the Parquet writer under `write_buffers`, in bytes: the open row
    /// group's buffers plus what the writer keeps of the row groups already written until the
    /// file is closed ([`crate::WRITTEN_CHUNK_BYTES`] a column chunk plus its statistics), and
    /// the next step's estimate reserved before it is encoded, or what a step really made
    /// when that was more (counted past the limit as it exists). Never above the category's
    /// high-water mark in `memory_report()`.
    pub peak_buffer_bytes: usize,
}

/// Errors of [`Table::export_parquet`]. Whatever the error, no file of the failed export is
/// visible at the target path (and an existing target is untouched unless the failure came
/// after it was replaced with `overwrite`, in which case the target is absent).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The target file exists and [`ExportOptions::overwrite`] was not set.
    #[error("export target {} already exists; remove it or use ExportOptions::overwrite(true)", path.display())]
    TargetExists {
        /// The target path.
        path: PathBuf,
    },
    /// The directory the target would be written in does not exist (or is not a directory).
    #[error("export directory {} does not exist; create it first", dir.display())]
    DirectoryNotFound {
        /// The missing directory.
        dir: PathBuf,
    },
    /// The target path cannot name a file (empty, ends in `..`, or is a directory).
    #[error("export target {} is not a file path: {reason}", path.display())]
    InvalidPath {
        /// The path given.
        path: PathBuf,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A file-system operation failed (no space, I/O error, permission).
    #[error("export I/O error on {}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The OS error (`raw_os_error()` is `Some(28)` for ENOSPC on Linux).
        #[source]
        source: std::io::Error,
    },
    /// The Parquet encoder failed.
    #[error("export of {} failed in the Parquet writer: {source}", path.display())]
    Parquet {
        /// The file being written.
        path: PathBuf,
        /// The encoder's error.
        #[source]
        source: ParquetError,
    },
    /// The engine refused or failed the read (table dropped, engine closed, memory limit,
    /// storage read error).
    #[error(transparent)]
    Engine(#[from] Error),
}

impl From<ExportError> for Error {
    /// Folds an export error into the engine's error type, keeping its cause: file-system
    /// conditions become [`Error::Io`] with the matching [`std::io::ErrorKind`].
    fn from(e: ExportError) -> Self {
        use std::io::{Error as IoError, ErrorKind};
        match e {
            ExportError::TargetExists { path } => Error::Io { path, source: IoError::new(ErrorKind::AlreadyExists, "export target exists") },
            ExportError::DirectoryNotFound { dir } => Error::Io { path: dir, source: IoError::new(ErrorKind::NotFound, "export directory does not exist") },
            ExportError::InvalidPath { path, reason } => Error::Io { path, source: IoError::new(ErrorKind::InvalidInput, reason) },
            ExportError::Io { path, source } => Error::Io { path, source },
            ExportError::Parquet { source, .. } => Error::Storage(gritdb_storage::StorageError::Parquet(source)),
            ExportError::Engine(e) => e,
        }
    }
}

impl ExportError {
    /// The OS error code behind an [`ExportError::Io`] (e.g. 28 = ENOSPC), if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            ExportError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Temp file names are unique within the process (pid + counter), so two exports to one
/// directory never share one.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Table {
    /// Writes the table's current snapshot — exactly the rows [`Table::scan`] returns: committed
    /// files minus deletion vectors, merged with the in-memory deltas — into one Parquet file
    /// at `path` that other engines read. Refuses to replace an existing file; see
    /// [`Table::export_parquet_with`] for options.
    ///
    /// Streaming: one scanned batch and the writer's buffers (cut into row groups by bytes,
    /// reserved under `write_buffers`) are in memory at a time. When copying the in-memory
    /// deltas would pass the write soft limit (the limit less the flush headroom,
    /// docs/memory.md), the table is flushed first ([`Table::flush`]) and the export reads
    /// files only. The file is written to a temp
    /// file in the same directory, fsynced, renamed to `path`, and the directory fsynced.
    ///
    /// # Errors
    /// [`ExportError::TargetExists`], [`ExportError::DirectoryNotFound`],
    /// [`ExportError::InvalidPath`], [`ExportError::Io`] (ENOSPC, EIO, ...),
    /// [`ExportError::Parquet`], [`ExportError::Engine`] (table dropped, engine closed,
    /// [`Error::MemoryLimit`]). On any error no file of this export is visible.
    pub fn export_parquet(&self, path: impl AsRef<Path>) -> Result<ExportStats, ExportError> {
        self.export_parquet_with(path, &ExportOptions::default())
    }

    /// [`Table::export_parquet`] with options (overwrite, row-group cut, batch size).
    ///
    /// # Errors
    /// As [`Table::export_parquet`].
    pub fn export_parquet_with(&self, path: impl AsRef<Path>, options: &ExportOptions) -> Result<ExportStats, ExportError> {
        let path = path.as_ref();
        let (dir, file_name) = split_target(path)?;
        check_outside(path, &dir, &self.engine.dir)?;
        check_target(path, options.overwrite)?;
        let vfs: Arc<dyn Vfs> = Arc::clone(&self.inner.shared.config.vfs);
        // Under memory pressure the deltas are flushed first, so the snapshot reads files and
        // copies no delta: a copy beside the flush converting those deltas can take the room
        // that flush needs above the write soft limit, and then neither finishes (at a 6 MiB
        // limit right after a reopen, under load: `tests/all/breaker_reopen.rs` export tests).
        let shared = &self.inner.shared;
        let deltas = self.inner.delta_bytes();
        if deltas > 0 && shared.pressure_bytes() + deltas > shared.write_soft_limit() {
            tracing::debug!(table = %self.name(), deltas, "export under memory pressure: flushing the deltas first");
            self.flush()?;
        }
        // The snapshot is taken before the temp file exists: an engine or table error leaves
        // nothing behind.
        let scan = self.scan(ScanOptions::default().batch_rows(options.batch_rows))?;
        let tmp =
            dir.join(format!(".{}.{}.{}.gritdb-export.tmp", file_name.to_string_lossy(), std::process::id(), TMP_COUNTER.fetch_add(1, Ordering::Relaxed)));
        let mut renamed = false;
        let res = self.write_export(vfs.as_ref(), scan, &tmp, path, &dir, options, &mut renamed);
        if res.is_err() {
            let _ = vfs.remove_file(&tmp);
            if renamed {
                // Only the directory fsync failed: the file is complete but its name may not
                // be durable. The caller gets an error, so the file must not stay visible.
                let _ = vfs.remove_file(path);
            }
        }
        res
    }

    #[allow(clippy::too_many_arguments)]
    fn write_export(
        &self,
        vfs: &dyn Vfs,
        scan: crate::scan::Scan,
        tmp: &Path,
        path: &Path,
        dir: &Path,
        options: &ExportOptions,
        renamed: &mut bool,
    ) -> Result<ExportStats, ExportError> {
        let seen: Arc<Seen> = Arc::new(Mutex::new(None));
        let file = vfs.create(tmp).map_err(|source| ExportError::Io { path: tmp.to_path_buf(), source })?;
        let sink = Sink { inner: file, seen: Arc::clone(&seen) };
        let props = gritdb_storage::data_file_properties(options.row_group_rows)
            .set_compression(gritdb_storage::EXPORT_COMPRESSION)
            .set_created_by(format!("gritdb version {}", env!("CARGO_PKG_VERSION")))
            .build();
        let pq = |e: ParquetError| parquet_error(e, tmp, &seen);
        // Fed in budgeted steps as a flush's writer is (`gritdb_storage::StepWriter`): the row
        // group cut is at most a quarter of the write soft limit, so the writer's buffers leave
        // the scan room for its next batches under a small limit; the row groups written so
        // far stay in the writer until it is closed (their metadata and page indexes) and are
        // budgeted before each row group is closed, so many small row groups end in
        // `MemoryLimit` rather than growing past the limit.
        let steps = gritdb_storage::WriteOptions {
            row_group_bytes: options.row_group_bytes.min((self.inner.shared.write_soft_limit() / 4).max(64 << 10)),
            write_batch_rows: options.batch_rows,
            memory_wait: Some(self.inner.shared.export_memory_wait(&self.inner.account)),
            ..gritdb_storage::WriteOptions::default()
        };
        let step = |e: gritdb_storage::StepError| match e {
            gritdb_storage::StepError::Storage(e) => ExportError::from(Error::from(e)),
            gritdb_storage::StepError::Parquet(e) => pq(e),
        };
        let mut writer = gritdb_storage::StepWriter::try_new(
            sink,
            self.schema(),
            props,
            steps,
            gritdb_storage::WrittenMetadata::Budget,
            &self.inner.shared.ctl,
            Some(&self.inner.account),
            tmp,
        )
        .map_err(step)?;
        let mut rows = 0u64;
        for batch in scan {
            let batch = batch?;
            writer.write(&batch).map_err(step)?;
            rows += batch.num_rows() as u64;
        }
        let (sink, written) = writer.finish().map_err(step)?;
        let mut file = sink.inner;
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| ExportError::Io { path: p, source }
        };
        file.flush().map_err(io(tmp))?;
        file.sync_all().map_err(io(tmp))?;
        let bytes = file.len().map_err(io(tmp))?;
        drop(file);
        // Checked again right before the rename: a file created at the target while the export
        // ran is not replaced (a creation racing this very check still can be: a plain rename
        // has no no-replace mode on every file system).
        check_target(path, options.overwrite)?;
        let moved = vfs.rename(tmp, path);
        // A rename reported failed may still have replaced `path` (the tmp file is gone): the
        // caller gets an error, so the new file must not stay there either. A rename that
        // did not happen leaves `path` as it was.
        *renamed = moved.is_ok() || gritdb_storage::rename_may_have_happened(tmp);
        moved.map_err(io(path))?;
        vfs.sync_dir(dir).map_err(io(dir))?;
        tracing::debug!(table = %self.name(), path = %path.display(), rows, bytes, row_groups = written.row_groups, "table exported to Parquet");
        Ok(ExportStats { path: path.to_path_buf(), rows, bytes, row_groups: written.row_groups, peak_buffer_bytes: written.peak_bytes })
    }
}

/// The directory and file name of `path` (a bare name means the current directory).
fn split_target(path: &Path) -> Result<(PathBuf, std::ffi::OsString), ExportError> {
    let invalid = |reason| ExportError::InvalidPath { path: path.to_path_buf(), reason };
    if path.as_os_str().is_empty() {
        return Err(invalid("empty path"));
    }
    let Some(name) = path.file_name() else { return Err(invalid("no file name (ends in `..` or is a root)")) };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(ExportError::DirectoryNotFound { dir });
    }
    Ok((dir, name.to_os_string()))
}

/// Refuses a target in the engine's data directory or below it (its data files, deletion
/// vectors, manifests and WAL): an export there could replace a file the manifest names, and
/// the table would read the export's rows as its own, then fail to open (a trial of
/// 2026-12-03 exported over `tables/t1/f000001.parquet` with `overwrite`: scans returned 6,996
/// rows of a 4,998-row table). Compared after resolving symbolic links and `..`.
fn check_outside(path: &Path, dir: &Path, data_dir: &Path) -> Result<(), ExportError> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| ExportError::Io { path: p, source }
    };
    let target_dir = std::fs::canonicalize(dir).map_err(io(dir))?;
    let data_dir = std::fs::canonicalize(data_dir).map_err(io(data_dir))?;
    if target_dir.starts_with(&data_dir) {
        return Err(ExportError::InvalidPath { path: path.to_path_buf(), reason: "it is inside the engine's data directory; export elsewhere" });
    }
    Ok(())
}

fn check_target(path: &Path, overwrite: bool) -> Result<(), ExportError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Err(ExportError::InvalidPath { path: path.to_path_buf(), reason: "a directory is in the way" }),
        Ok(_) if !overwrite => Err(ExportError::TargetExists { path: path.to_path_buf() }),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ExportError::Io { path: path.to_path_buf(), source }),
    }
}

type Seen = Mutex<Option<(std::io::ErrorKind, Option<i32>, String)>>;

/// The Parquet writer's sink: remembers the last I/O error, because Parquet reports some of
/// them only as text ("fail to get inner writer: ...").
struct Sink {
    inner: Box<dyn VfsFile>,
    seen: Arc<Seen>,
}

impl Sink {
    fn note(&self, e: &std::io::Error) {
        *self.seen.lock().unwrap_or_else(PoisonError::into_inner) = Some((e.kind(), e.raw_os_error(), e.to_string()));
    }
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf).inspect_err(|e| self.note(e))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush().inspect_err(|e| self.note(e))
    }
}

/// A Parquet error caused by the sink reads as the I/O error it was (ENOSPC stays ENOSPC).
fn parquet_error(e: ParquetError, path: &Path, seen: &Seen) -> ExportError {
    if let ParquetError::External(inner) = e {
        return match inner.downcast::<std::io::Error>() {
            Ok(source) => ExportError::Io { path: path.to_path_buf(), source: *source },
            Err(other) => ExportError::Parquet { path: path.to_path_buf(), source: ParquetError::External(other) },
        };
    }
    if let Some((kind, raw, msg)) = seen.lock().unwrap_or_else(PoisonError::into_inner).take() {
        let source = match raw {
            Some(code) => std::io::Error::from_raw_os_error(code),
            None => std::io::Error::new(kind, msg),
        };
        return ExportError::Io { path: path.to_path_buf(), source };
    }
    ExportError::Parquet { path: path.to_path_buf(), source: e }
}
