use arrow_schema::ArrowError;
use gritdb_memctl::MemoryError;
use parquet::errors::ParquetError;
use std::path::PathBuf;

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
    /// The manifest cannot be parsed or is inconsistent.
    #[error("corrupt manifest {}: {detail}. The table cannot be opened; restore the directory from a backup", path.display())]
    CorruptManifest {
        /// The manifest path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A data file cannot be read as the manifest says it should.
    #[error("corrupt data file {}: {detail}", path.display())]
    CorruptFile {
        /// The data file path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
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

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.into();
    move |source| StorageError::Io { path, source }
}
