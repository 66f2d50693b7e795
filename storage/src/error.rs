use arrow_schema::ArrowError;
use gritdb_memctl::MemoryError;
use parquet::errors::ParquetError;
use std::path::{Path, PathBuf};

/// Errors of the storage layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    /// A file-system call failed.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A table's manifest cannot be parsed, fails its checksum, or is inconsistent. Manifests
    /// are read only when the engine opens its data directory, and one refused manifest
    /// refuses the whole open: the text says so and names the file; `detail` says what is
    /// wrong and, for a checksum that does not verify, how to reseal a manifest edited on
    /// purpose.
    #[error(
        "corrupt manifest {}: {detail}. The engine does not open its data directory{} while one of its table manifests is refused; \
         restore this manifest from a backup",
        path.display(), data_dir_of(path)
    )]
    CorruptManifest {
        /// The manifest path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A data file or deletion vector cannot be read as the manifest says it should (or, at
    /// a flush or compaction, a file about to be written has keys out of order). For damage
    /// found on disk `detail` ends with what it means and what to do: found when the engine
    /// opens, the data directory does not open; found by a read, that table's reads of the
    /// file fail, compactions leave it out, and other tables are unaffected; either way, restore the
    /// file from a backup.
    #[error("corrupt data file {}: {detail}", path.display())]
    CorruptFile {
        /// The data file path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A data file or deletion vector the table's manifest lists is not on disk (deleted or
    /// moved outside the engine): at open, instead of a bare "not found" I/O error, and by a
    /// scan or compaction of a file removed while the engine runs.
    #[error(
        "table `{table}`: {} is listed in the table's manifest but missing (deleted or moved outside the engine). Until it is back \
         the engine does not open this data directory, and an engine already open fails the table's scans and compactions that \
         need it (other tables are unaffected): {RESTORE}",
        path.display()
    )]
    MissingFile {
        /// The missing file.
        path: PathBuf,
        /// The table whose manifest lists it.
        table: String,
    },
    /// A write-ahead-log record is damaged somewhere other than a torn tail.
    #[error("corrupt write-ahead log {} at byte {offset}: {detail}. Acknowledged writes after this point cannot be recovered automatically; move the file aside to open without them", path.display())]
    CorruptWal {
        /// The segment path.
        path: PathBuf,
        /// Byte offset of the bad record.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// A data file would hold more rows than a file can ([`crate::MAX_FILE_ROWS`]: a key's
    /// row and the rows of a deletion vector are `u32`s). Refused before anything is written;
    /// the engine's flush then writes the rows as several files.
    #[error("a data file of {rows} rows is more than the {max_rows} rows a file can hold")]
    FileTooLarge {
        /// Rows the file would hold.
        rows: u64,
        /// [`crate::MAX_FILE_ROWS`].
        max_rows: u64,
    },
    /// The table has used every data file id (`u32`; one per flush and compaction, never
    /// reused): a flush that would write a file is refused rather than wrap onto a live file's
    /// id and name. Export the table and load it into a new one.
    #[error("table `{table}` has used all {} data file ids; export it (Table::export_parquet) and load it into a new table", u32::MAX - 1)]
    FileIdsExhausted {
        /// The table.
        table: String,
    },
    /// Parquet encoding or decoding failed.
    #[error("parquet error: {0}")]
    Parquet(#[from] ParquetError),
    /// Arrow failed.
    #[error("arrow error: {0}")]
    Arrow(#[from] ArrowError),
    /// No memory budget for index or writer buffers.
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

impl StorageError {
    /// `self`, or [`StorageError::MissingFile`] naming `table` when `self` is an I/O error
    /// "not found" on `path` itself (a file `table`'s manifest lists). Other errors, and a
    /// "not found" on another path (a missing directory met while writing), are kept.
    #[must_use]
    pub fn or_missing_file(self, path: &Path, table: &str) -> Self {
        match self {
            StorageError::Io { path: p, source } if p == path && source.kind() == std::io::ErrorKind::NotFound => {
                StorageError::MissingFile { path: p, table: table.to_owned() }
            }
            e => e,
        }
    }
}

/// What to do about data file damage only bytes from a backup undo.
const RESTORE: &str = "restore the file from a backup (data and deletion-vector files never change once written)";

/// A [`StorageError::CorruptFile`] `detail` for damage to a file of table `table` found while
/// the engine opens it, with what that means and what to do.
pub(crate) fn damaged_at_open(table: &str, detail: &str) -> String {
    format!(
        "{detail}. Table `{table}`'s files are read when the engine opens, so the engine does not open its data directory while this file is damaged: {RESTORE}"
    )
}

/// A [`StorageError::CorruptFile`] `detail` for damage to a committed data file found by a
/// read (a scan, or a compaction's), with what that means and what to do.
pub(crate) fn damaged_at_read(detail: &str) -> String {
    format!(
        "{detail}. Scans of this table that reach the file fail, and compactions leave the file as it is (Engine::degraded_tables \
         lists the table until the file matches again); other tables are unaffected. To read it whole again, {RESTORE}"
    )
}

/// " <data dir>" for a manifest at `<data dir>/tables/t<id>/manifest.json`, else "" (a path
/// of another shape, as in tests and the fuzzer).
fn data_dir_of(manifest: &Path) -> String {
    let table_dir = manifest.parent();
    match table_dir.and_then(Path::parent) {
        Some(tables) if tables.file_name().is_some_and(|n| n == "tables") => tables.parent().map_or_else(String::new, |d| format!(" `{}`", d.display())),
        _ => String::new(),
    }
}

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.into();
    move |source| StorageError::Io { path, source }
}
