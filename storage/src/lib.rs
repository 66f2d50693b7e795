//! # gritdb-storage — Parquet data files, manifest, deletion vectors, key index
//!
//! One directory per table:
//! ```text
//! <table dir>/manifest.json        the committed state (atomic replace: tmp, fsync, rename, fsync dir;
//!                                  first field line, the file's second: the CRC-32 of the
//!                                  bytes after it, `MANIFEST_CHECKSUM_KEY`)
//! <table dir>/f000001.parquet      data files (immutable once written)
//! <table dir>/f000001.dv7          deletion vector of f000001 as of manifest version 7 (roaring)
//! ```
//! A row of a data file is live unless its position is in the file's deletion vector.
//! Files not named by the manifest (a crash between writing a file and committing the
//! manifest) and `*.tmp` files are removed on open.
//!
//! The [`KeyIndex`] maps each live primary key (`arrow-row` bytes, the same encoding the delta
//! store uses) to `(file, row)`. Its key bytes live in per-file key stores; equality is always
//! checked on the full key bytes, never on the hash alone.
//!
//! Nothing here knows about row blocks: it takes Arrow batches and key bytes.

mod bytes;
mod compact;
mod error;
mod filter;
mod grouped_read;
mod index;
mod manifest;
#[cfg(test)]
mod stage_tests;
mod table;
mod vfs;
mod wal;
mod write;

pub use bytes::{HELD_ALLOCATION_BYTES, HELD_BUFFER_BYTES, MAX_ARRAY_STRUCT_BYTES, alloc_size_class, batch_bytes, held_array_bytes};

/// The id an on-disk name spells in `digits`, when it is spelled exactly as gritdb writes it:
/// decimal, zero-padded to `width` digits and no further (`canonical_id("000007", 6)` is 7;
/// `"07"` at width 1, `"+7"`, `""` or a number past `u64::MAX` are `None`). The one rule behind
/// segment names ([`wal_segment_id`], width 8), table files ([`is_table_file_name`], width 6)
/// and table directories (`t<id>`, width 1), so a name gritdb did not give is never taken for
/// one it did.
pub fn canonical_id(digits: &str, width: usize) -> Option<u64> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let id: u64 = digits.parse().ok()?;
    (format!("{id:0width$}") == digits).then_some(id)
}
pub use compact::{CompactionOptions, CompactionPlan};
pub use error::StorageError;
pub use filter::{BoundFilter, CompareOp, FilePlan, FilterError, MAX_FILTER_DEPTH, ScanCounters, ScanFilter, ScanMetrics, filter_batch, keep_rows};
pub use index::{FileKeys, KeyIndex, Loc, MAX_FILE_ROWS};
pub use manifest::{FileMeta, LEGACY_DECODED_RATIO, MANIFEST_CHECKSUM_KEY, MANIFEST_FILE, Manifest, write_atomic};
pub use table::{CommitPlan, FileGuard, FileScan, PutKeyEncoder, PutKeys, ScanSource, Staged, TableStore, is_table_file_name};
pub use vfs::{FaultFs, FsOp, StdFs, Vfs, VfsFile, rename_may_have_happened};
pub use wal::{MAX_SEGMENT_ID, SEGMENT_BYTES, TornTail, WAL_DIR, Wal, WalOp, WalPosition, WalRecord, WalSync, decode_segment, wal_segment_id};
pub use write::{
    CancelToken, DATA_FILE_COMPRESSION, DATA_PAGE_BYTES, DICTIONARY_PAGE_BYTES, DICTIONARY_TABLE_BYTES, EXPORT_COMPRESSION, FOOTER_MEMORY_FACTOR, FileReader,
    FooterTally, LearnedGrowth, MemoryWait, OFFSET_INDEX_MEMORY_FACTOR, PAGE_INDEX_MEMORY_FACTOR, ReadSpec, StepError, StepStats, StepWriter,
    WRITTEN_CHUNK_BYTES, WriteOptions, WrittenFile, WrittenMetadata, data_file_properties, default_encode_threads, file_crc32, fit_dictionaries,
    largest_readable_value, largest_value_within, read_file, read_file_reserved, read_file_with, read_file_within, row_memory_bytes, write_data_file,
    write_data_file_from,
};
