//! # gritdb — an embedded columnar analytics engine whose ingest is memory-governed
//!
//! A Rust service links gritdb, writes rows by primary key (insert / upsert / update /
//! delete) as Arrow `RecordBatch`es and reads them back with scans. Every byte the engine
//! holds for rows, flush batches, key indexes and buffers is carved from budgeted chunks or
//! reserved, counted by category and kept under one memory limit ([`EngineConfig`],
//! [`Engine::set_memory_limit`], [`Engine::memory_report`]).
//!
//! ```text
//! Table::insert/upsert/update/delete ──> validate (schema, nulls, duplicates) ──> unify::DeltaStore
//!     (one bump allocation per row in accounted row blocks; key -> newest row)
//!         │ seal at table_flush_bytes or under memory pressure (largest deltas first)
//!         ▼
//!     background writer: rows -> Arrow arrays in a batch block, staged (index + deletion
//!     vectors updated, row blocks released), then Parquet write + fsync + manifest commit
//!     without the table lock
//!         ▼
//!     storage: <dir>/tables/t<id>/{manifest.json, f*.parquet, f*.dv*}
//! ```
//!
//! See `docs/architecture.md` and `docs/memory.md` in the repository.

mod config;
mod data_dir;
mod engine;
mod error;
mod export;
mod scan;
#[cfg(feature = "sql")]
pub mod sql;
mod table;
mod writer;

pub use config::{BackgroundPriority, EngineConfig};
pub use data_dir::DATA_DIR_MARKER;
pub use engine::{DEFAULT_DATA_DIR, Engine, MAX_THREADS, RESERVED_TABLE_PREFIX};
pub use error::{DataDirFound, Error, MarkerProblem, Result};
pub use export::{ExportError, ExportOptions, ExportStats};
/// The error types [`Error`] wraps ([`Error::Input`], [`Error::Storage`], [`Error::Memory`]),
/// so a caller can match on their typed fields (e.g. `UnifyError::NullKey { column, row }`).
pub use gritdb_memctl::MemoryError;
/// What a Parquet writer allocates, per dictionary-encoded fixed-width column, when a row group
/// opens; a flush or an export budgets it under `write_buffers` (docs/memory.md).
pub use gritdb_storage::DICTIONARY_TABLE_BYTES;
pub use gritdb_storage::StorageError;
/// What an open cut from the end of the write-ahead log ([`Engine::wal_torn_tail`]).
pub use gritdb_storage::TornTail as WalTornTail;
/// What a flush or an export counts, under `write_buffers`, for each column chunk a Parquet
/// writer has written and keeps in its footer until the file is closed (docs/memory.md).
pub use gritdb_storage::WRITTEN_CHUNK_BYTES;
pub use gritdb_storage::{CompareOp, FilterError, MAX_FILTER_DEPTH, ScanFilter, ScanMetrics, WalSync};
/// The Parquet writer settings of gritdb's data files and exports, for a caller that writes
/// files to compare with or load into gritdb's (the bench's raw-writer baseline does).
pub use gritdb_storage::{DATA_FILE_COMPRESSION, DICTIONARY_PAGE_BYTES, EXPORT_COMPRESSION, data_file_properties};
/// What a scan reserves for a data file's metadata before parsing it, per encoded byte
/// (docs/memory.md, "Not accounted").
pub use gritdb_storage::{FOOTER_MEMORY_FACTOR, OFFSET_INDEX_MEMORY_FACTOR, PAGE_INDEX_MEMORY_FACTOR};
/// What a write checks a row against ([`Error::ValueTooLarge`]), in bytes:
/// `row_memory_bytes(largest, values, key_values, key)` is the memory a row needs for a scan
/// to read it back, a flush to write it and an open to rebuild its key;
/// `largest_value_within(budget, rest, key_values, key)` the largest value outside the key a
/// row fits in `budget`; `largest_readable_value(limit)` that of a lone value in an empty
/// engine, `(limit − 64 KiB) / 5`.
pub use gritdb_storage::{largest_readable_value, largest_value_within, row_memory_bytes};
pub use gritdb_unify::UnifyError;
pub use scan::{RETAIN_RATIO, Scan, ScanOptions, compact_if_sparse, retained_bytes};
pub use table::{COMPACTION_FAILED, Table, TableStats};

/// Memory-controller types re-exported for reports and configuration.
pub mod memory {
    pub use gritdb_memctl::{
        AllocatorKind, AllocatorStats, Category, CategoryReport, Consumer, MemoryController, MemoryReport, ProcessView, TableReport, default_memory_limit,
        format_bytes, physical_memory_bytes,
    };
}

/// The names gritdb gives what it writes in a data directory, spelled exactly as it spells
/// them: what a tool may treat as gritdb's (the soak runner decides with these whether a
/// `--data-dir` holds only gritdb's files before it wipes it). The engine's own open uses
/// the same rules: a name shaped like these but spelled otherwise is not gritdb's.
pub mod names {
    pub use gritdb_storage::{MAX_SEGMENT_ID, is_table_file_name, wal_segment_id};

    /// The id of a table directory named `t<id>` (`t7`; not `t07`, `t+7`, or an id past
    /// `u64::MAX`), as under `tables/` and `trash/`.
    pub fn table_dir_id(name: &str) -> Option<u64> {
        crate::data_dir::table_dir_id(name)
    }
}

/// The file layer, for fault injection ([`EngineConfig::vfs`]).
pub mod vfs {
    pub use gritdb_storage::{FaultFs, FsOp, StdFs, Vfs, VfsFile};
}

pub use arrow_array;
pub use arrow_schema;
/// The `parquet` crate gritdb writes with, for reading exported files ([`Table::export_parquet`])
/// with the same version.
pub use parquet;

/// README.md, whose Rust example is compiled as a doctest (`no_run`), so the snippet a new
/// user copies keeps matching the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
