//! # gritdb-memctl — the memory controller
//!
//! Every byte gritdb holds for rows, batches, indexes and buffers is reserved here first,
//! counted by [`Category`], attributed to a table where it belongs to one, and kept under
//! **one** limit ([`MemoryController::limit`], in bytes). Nothing in this crate knows about
//! tables' contents, Arrow or tokio: it hands out budget, chunks and bump arenas.
//!
//! ```text
//!                        MemoryController  (limit, used, peak — bytes)
//!        ┌──────────────┬──────────┴──────────┬───────────────────────────┐
//!   chunk pool      Reservation (RAII)     BatchBlock               process view
//!   fixed chunks    try_grow / shrink      one aligned block,       RSS, VmHWM (/proc),
//!   (chunk_size)    key_index, metadata,   freed whole              jemalloc or glibc
//!      │            write_buffers,         (batch_blocks)           allocator figures
//!   RowArena        scan_buffers
//!   (row_blocks: bump over chunks, one allocation per row, live count per block)
//!      │ empty chunks are cached as free_chunks and trimmed back to the allocator
//! ```
//!
//! ## Categories — what counts toward each, and who reserves it
//!
//! | category        | counts                                                                  | reserved by |
//! |-----------------|-------------------------------------------------------------------------|-------------|
//! | `row_blocks`    | whole chunks (`chunk_size` bytes each, padding and unused tail included) held by row arenas, plus oversize row allocations (exact row length) | [`RowArena`] |
//! | `batch_blocks`  | whole batch blocks (requested bytes rounded up to 16) holding Arrow arrays built at flush | [`BatchBlock`] |
//! | `key_index`     | key index hash tables (bucket arrays by capacity, control bytes included) and key bytes | storage / unify via [`Reservation`] |
//! | `write_buffers` | Parquet writer buffers, from `ArrowWriter::memory_size`            | storage via [`Reservation`] |
//! | `scan_buffers`  | decoded batches held by scans and delta snapshots                       | engine via [`Reservation`] |
//! | `metadata`      | per-table bookkeeping: schemas, manifests, deletion vectors, arena block tables | every crate via [`Reservation`] |
//! | `free_chunks`   | empty chunks cached by the pool for reuse (count toward `used`)         | the pool itself |
//!
//! `used` is the sum of all categories, and is what the limit is enforced against:
//! a reservation that would take `used` above `limit` fails with
//! [`MemoryError::Limit`] before any memory is allocated, after first trimming
//! cached free chunks. The check is a compare-and-swap on one atomic, so `used <= limit`
//! holds at every instant (it can only be above the limit right after the limit was lowered,
//! until the owners release memory).
//!
//! ## What is NOT accounted
//! - Allocator overhead beyond the requested sizes (size-class rounding, jemalloc metadata).
//! - Short-lived temporaries on the ingest path that are freed before the call returns
//!   (per-batch key encodings from `arrow-row`, validation scratch vectors).
//! - Arrow arrays the caller passes in and arrays returned to the caller by scans once the
//!   caller owns them (the engine accounts them only while it holds them).
//! - Thread stacks, the tokio runtime, tracing, and the code itself.
//!
//! The process view ([`ProcessView`]) puts RSS, `VmHWM` and the allocator's own `allocated`
//! beside the accounted total; `outside_engine = allocator allocated − accounted` shows how
//! much of the heap is outside these categories.

mod arena;
mod batch;
mod category;
mod controller;
mod limit;
mod pool;
mod process;
mod report;
mod spin;

pub use arena::{RowArena, RowRef};
pub use batch::BatchBlock;
pub use category::Category;
pub use controller::{
    Consumer, ControllerConfig, DEFAULT_CHUNK_SIZE, MemoryController, MemoryError, Reservation,
    TableAccount,
};
pub use limit::{cgroup_memory_limit, default_memory_limit, physical_memory_bytes};
pub use pool::{PoolChunk, PoolStats};
pub use process::{AllocatorKind, AllocatorStats, ProcessView};
pub use report::{CategoryReport, MemoryReport, TableReport, format_bytes};
