use gritdb_memctl::{Category, Consumer, MemoryError, format_bytes};
use gritdb_storage::StorageError;
use gritdb_unify::UnifyError;
use std::path::PathBuf;

/// Result type of gritdb.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error gritdb returns. Bad input is rejected whole: when a write returns an error,
/// nothing of its batch was applied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The memory limit was reached and backpressure (waiting for the background writer to
    /// flush) did not free enough within the configured wait.
    #[error(
        "memory limit reached: requested {} for {category}, {} of {} in use; top consumers: {}. \
         Raise the limit (EngineConfig::memory_limit / Engine::set_memory_limit) or ask for less at once ({})",
        format_bytes(*requested), format_bytes(*used), format_bytes(*limit), top_list(top), less_of(*category)
    )]
    MemoryLimit {
        /// Bytes asked for.
        requested: usize,
        /// Accounted bytes when the request failed.
        used: usize,
        /// The limit in bytes.
        limit: usize,
        /// Category of the failed request.
        category: Category,
        /// Biggest categories and tables, largest first.
        top: Vec<Consumer>,
    },
    /// Another memory-controller error (configuration, injected fault).
    #[error(transparent)]
    Memory(MemoryError),
    /// A lowering of the limit (`Engine::set_memory_limit`) was still waiting for memory to
    /// be given back when a later call began; the later call wins and this one applied
    /// nothing.
    #[error(
        "memory limit change to {} superseded by a later set_memory_limit call before it took effect; the limit is {}",
        format_bytes(*requested), format_bytes(*limit)
    )]
    LimitSuperseded {
        /// The limit this call asked for, in bytes.
        requested: usize,
        /// The limit in force when this call returned, in bytes.
        limit: usize,
    },
    /// A table name is not acceptable.
    #[error("invalid table name {name:?}: {reason}")]
    InvalidTableName {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A table of that name (compared case-insensitively) exists.
    #[error("table `{name}` already exists{}", existing_as(.name, .existing))]
    TableExists {
        /// The name given.
        name: String,
        /// The existing table's name (differs from `name` only in case, if at all).
        existing: String,
    },
    /// No table of that name.
    #[error("table `{name}` does not exist")]
    TableNotFound {
        /// The name given.
        name: String,
    },
    /// The primary-key definition is invalid.
    #[error("invalid primary key: {0}")]
    InvalidPrimaryKey(String),
    /// A projected column does not exist.
    #[error("column `{column}` does not exist in table `{table}`")]
    ColumnNotFound {
        /// Table name.
        table: String,
        /// Column asked for.
        column: String,
    },
    /// A scan filter does not fit the table: a literal whose type cannot be compared with its
    /// column, a literal that is not one element, or a column type without an ordering.
    /// (A filter naming an unknown column is [`Error::ColumnNotFound`].)
    #[error("invalid scan filter for table `{table}`: {source}")]
    InvalidFilter {
        /// Table name.
        table: String,
        /// What does not fit.
        #[source]
        source: gritdb_storage::FilterError,
    },
    /// `insert` of a key that already exists.
    #[error("table `{table}`: primary key ({key}) at row {row} already exists; use upsert to replace rows")]
    KeyExists {
        /// Table name.
        table: String,
        /// Row index within the batch.
        row: usize,
        /// The key's values, `column=value` for each key column (Arrow's display).
        key: String,
    },
    /// `update` of a key that does not exist.
    #[error("table `{table}`: primary key ({key}) at row {row} does not exist; update only replaces existing rows (use upsert)")]
    KeyNotFound {
        /// Table name.
        table: String,
        /// Row index within the batch.
        row: usize,
        /// The key's values, `column=value` for each key column (Arrow's display).
        key: String,
    },
    /// Two rows of one batch have the same primary key.
    #[error("table `{table}`: rows {first} and {row} of the batch have the same primary key")]
    DuplicateKey {
        /// Table name.
        table: String,
        /// First row with the key.
        first: usize,
        /// The repeating row.
        row: usize,
    },
    /// A row of the batch holds a string or binary value too long for a scan to read the row
    /// back, a flush to write it or an open to rebuild its key, under the memory limit in
    /// force beside the key indexes the tables' files hold
    /// ([`gritdb_storage::row_memory_bytes`]: about five times the row's largest value, plus
    /// its other values and its key; six to seven times for a string key, which the key index
    /// holds too, and about six times a key of several string columns; [`crate::largest_readable_value`] is `(limit − 64
    /// KiB) / 5` bytes for a row of one value in an empty engine). Nothing of the batch was
    /// applied; raising the limit (`Engine::set_memory_limit`) admits it.
    #[error(
        "table `{table}`: row {row}'s value in column `{column}` is {bytes} bytes; a scan could not read the row back (nor a \
         flush write it, nor an open rebuild its key) under the memory limit of {} beside its other values, its key and the \
         tables' key indexes ({}): at most {max} bytes here (a reader holds a value about five times, docs/memory.md). Raise \
         the limit (EngineConfig::memory_limit / Engine::set_memory_limit) or store the value in smaller parts",
        format_bytes(*limit), format_bytes(*key_index)
    )]
    ValueTooLarge {
        /// Table name.
        table: String,
        /// Column name of the row's largest value.
        column: String,
        /// Row index within the batch.
        row: usize,
        /// The value's length in bytes.
        bytes: usize,
        /// The largest value this row could hold under `limit` (its other values, its encoded
        /// key and `key_index` unchanged: for a value of the key, a little more fits, as its
        /// key shrinks with it), in bytes; 0 when none fits.
        max: usize,
        /// The memory limit (or the lower value a lowering in progress heads for), in bytes.
        limit: usize,
        /// Bytes of the key indexes of every table's files when the write was checked (held
        /// while the tables are open, so left out of what a scan may use).
        key_index: usize,
    },
    /// The batch or row does not fit the table (schema, nulls, types, size).
    #[error(transparent)]
    Input(UnifyError),
    /// A storage failure (I/O, Parquet, corrupt files).
    #[error(transparent)]
    Storage(StorageError),
    /// File-system failure outside a table (data dir, lock file).
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// [`crate::Engine::open`] refused the path as a data directory, and left it as it was
    /// (nothing created, changed or removed in it). What counts as a data directory:
    /// [`crate::Engine::open`].
    #[error("{} is not a gritdb data directory: {found}", path.display())]
    NotADataDir {
        /// The path given to `Engine::open`.
        path: PathBuf,
        /// What is there instead.
        found: DataDirFound,
    },
    /// The data directory's marker file ([`crate::DATA_DIR_MARKER`]) is not one this build
    /// reads: damaged, or of another format. [`crate::Engine::open`] left the directory as
    /// it was (nothing created, changed or removed).
    #[error("{}: {problem}; nothing in the directory was created, changed or removed", path.display())]
    BadDataDirMarker {
        /// The marker file.
        path: PathBuf,
        /// What is wrong with it.
        problem: MarkerProblem,
    },
    /// The data directory is already opened by another engine.
    #[error("data directory {} is locked by another gritdb engine (the lock file names {holder}, the last process that took it); close it first", path.display())]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// What the lock file says about the holder (process id).
        holder: String,
    },
    /// The engine was closed or the table dropped.
    #[error("{0} is closed")]
    Closed(String),
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A SQL statement failed (`sql` feature): `kind` says at which stage, `source` is
    /// `DataFusion`'s error. Unknown tables are [`Error::TableNotFound`] and a query that
    /// cannot get memory is [`Error::MemoryLimit`] instead.
    #[cfg(feature = "sql")]
    #[error("SQL {kind}: {source}")]
    Sql {
        /// Which stage failed.
        kind: crate::sql::SqlErrorKind,
        /// `DataFusion`'s error.
        #[source]
        source: Box<datafusion::error::DataFusionError>,
    },
}

/// What [`Error::NotADataDir`] found at the path.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DataDirFound {
    /// Nothing: the path does not exist, and [`crate::EngineConfig::create_if_missing`] is
    /// off.
    Missing,
    /// A file (or anything else that is not a directory).
    NotADirectory,
    /// A directory with entries that is not positively gritdb's: no marker file
    /// ([`crate::DATA_DIR_MARKER`]), and not a data directory an older gritdb wrote (only
    /// gritdb's entries, with a `LOCK` holding a pid or a table whose manifest reads). Someone
    /// else's files.
    Foreign {
        /// The first entry names in sorted order (at most 5).
        entries: Vec<String>,
        /// How many entries the directory holds (`lost+found` is not counted).
        total: usize,
    },
}

impl std::fmt::Display for DataDirFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataDirFound::Missing => f.write_str("it does not exist, and EngineConfig::create_if_missing is off (turn it on to create the directory)"),
            DataDirFound::NotADirectory => f.write_str("it is a file, not a directory"),
            DataDirFound::Foreign { entries, total } => {
                let listed = entries.iter().map(|e| format!("`{e}`")).collect::<Vec<_>>().join(", ");
                let more = total.saturating_sub(entries.len());
                let more = if more > 0 { format!(" and {more} more") } else { String::new() };
                write!(
                    f,
                    "the directory is not empty ({listed}{more}), has no `{marker}` marker file of a gritdb data directory and is not one \
                     an older gritdb wrote (only gritdb's `LOCK`, `tables/t<N>/`, `trash/`, `wal/` entries, with a `LOCK` holding a pid \
                     or a table manifest that reads); nothing was created, changed or removed in it. Give a new or empty directory, \
                     or an existing gritdb data directory",
                    marker = crate::DATA_DIR_MARKER
                )
            }
        }
    }
}

/// What is wrong with a data directory's marker file ([`Error::BadDataDirMarker`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MarkerProblem {
    /// It does not read as a marker: not two lines `gritdb data directory` and `format N`.
    Damaged {
        /// What does not read.
        detail: String,
    },
    /// It names a data-directory format this build does not read (a newer gritdb's).
    UnknownFormat {
        /// The format it names.
        found: u64,
        /// The one this build reads.
        supported: u32,
    },
}

impl std::fmt::Display for MarkerProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MarkerProblem::Damaged { detail } => write!(
                f,
                "the gritdb data directory marker is damaged ({detail}). It holds two lines, `gritdb data directory` and `format {}`: \
                 if this is a gritdb data directory, write those back; if not, give another directory",
                crate::data_dir::DATA_DIR_FORMAT
            ),
            MarkerProblem::UnknownFormat { found, supported } => write!(
                f,
                "the gritdb data directory marker names format {found}, and this build reads only format {supported}; open it with \
                 the gritdb that wrote it"
            ),
        }
    }
}

/// How to ask for less of `category` at once, in [`Error::MemoryLimit`]'s message. A scan's
/// request is not always its batch: an open file reader reserves its page and dictionary
/// buffers for a whole row group, estimated from the file's metadata (docs/memory.md,
/// "Scans"), which a smaller `batch_rows` does not lower and fewer columns do.
fn less_of(category: Category) -> &'static str {
    match category {
        Category::ScanBuffers => {
            "scans: drop the batches held, project fewer columns, use a smaller batch_rows, or raise the limit \
             (Engine::set_memory_limit); an open file's reader holds a page and a dictionary per projected column of a row group, \
             however small the batch, stored and decoded: one value is held about five times over (writes refuse a row whose \
             gritdb::row_memory_bytes do not fit beside the key indexes; one written under a larger limit needs a raised one)"
        }
        Category::KeyIndex => "the tables' key indexes must fit, at open and as files are added",
        Category::Query => "a SQL query: fewer groups, joins or sorts at once",
        _ => "a smaller write or scan batch; at open, the tables' key indexes must fit",
    }
}

fn top_list(top: &[Consumer]) -> String {
    if top.is_empty() {
        return "none".into();
    }
    top.iter().map(|c| format!("{} {}", c.name, format_bytes(c.bytes))).collect::<Vec<_>>().join(", ")
}

impl From<MemoryError> for Error {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::Limit { requested, used, limit, category, top } => Error::MemoryLimit { requested, used, limit, category, top },
            MemoryError::Config(s) => Error::Config(s),
            other => Error::Memory(other),
        }
    }
}

impl From<UnifyError> for Error {
    fn from(e: UnifyError) -> Self {
        match e {
            UnifyError::Memory(m) => m.into(),
            other => Error::Input(other),
        }
    }
}

impl From<StorageError> for Error {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::Memory(m) => m.into(),
            other => Error::Storage(other),
        }
    }
}

impl Error {
    /// True for [`Error::MemoryLimit`].
    pub fn is_memory_limit(&self) -> bool {
        matches!(self, Error::MemoryLimit { .. })
    }
}

pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// " as `existing` (...)" when the existing table's name differs from the one given.
fn existing_as(name: &str, existing: &str) -> String {
    if name == existing { String::new() } else { format!(" as `{existing}` (table names compare case-insensitively)") }
}
