//! # gritdb-unify — the in-memory row-delta store (UNIFY)
//!
//! Inserts, upserts, updates and deletes of a table are kept here as **rows** until the
//! background writer turns them into columnar files. Each row of an incoming Arrow
//! `RecordBatch` is encoded **once**, into **one** bump allocation in an engine-accounted row
//! block ([`gritdb_memctl::RowArena`]). A hash table maps each primary key to its newest row.
//!
//! ## Row layout (little endian)
//! ```text
//! | op u8 | seq u64 | key_len u32 | key bytes (arrow-row encoding) |           header + key
//! | null bitmap ceil(ncols/8) | fixed slots | var-len bytes |          puts only
//! ```
//! - `op`: 1 = put (insert/upsert/update), 2 = delete (tombstone; no value part).
//! - key bytes: the `arrow-row` [`RowConverter`](arrow_row::RowConverter) encoding of the
//!   primary-key columns — canonical and memcmp-comparable; equality of keys is byte equality
//!   of this encoding (the hash only picks the bucket).
//! - fixed slots: one per column in schema order; fixed-width types store their value
//!   (Boolean 1 byte, Decimal128 16 bytes, ...; a Decimal128 of precision ≤ 18 keeps only
//!   the low 8 bytes of its little-endian `i128`, sign-extended back on decode, since
//!   validation bounds it by `10^18 - 1 < 2^63`); variable-length types store the `u32` end
//!   offset of their bytes within the var-len part. A null's slot is zero.
//!
//! Nothing here knows about files: a sealed delta is turned into Arrow arrays built inside one
//! counted [`gritdb_memctl::BatchBlock`] ([`DeltaStore::to_batches`]).

mod codec;
mod delta;
mod error;

pub use codec::{KeyEncoder, MAX_ROW_BYTES, MAX_TYPE_DEPTH, RowCodec, RowValueBytes, type_depth};
pub use delta::{DeltaBatches, DeltaStore, Lookup, hash_keys, key_hash};
pub use error::UnifyError;
