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
//!   central list    try_grow / shrink      one aligned block,       RSS, VmHWM (/proc),
//!    ▲ flush 16     key_index, metadata,   freed whole              jemalloc or glibc
//!    │ ▼ refill 16  write_buffers,         (batch_blocks)           allocator figures
//!   thread caches   scan_buffers, query
//!   (one per thread and controller; empty chunks = free_chunks)
//!      │ take / put: no shared counter written
//!   RowArena, PoolChunk
//!   (row_blocks: bump over chunks, one allocation per row, live count per block)
//!      │ empty chunks beyond the share, trimmed or idle go back to the allocator
//! ```
//!
//! ## Categories — what counts toward each, and who reserves it
//!
//! All figures are in bytes as the engine asked for them: never the allocator's size-class
//! rounding or per-allocation headers (see "What is NOT accounted").
//!
//! | category        | counts exactly                                                           | reserved by |
//! |-----------------|--------------------------------------------------------------------------|-------------|
//! | `row_blocks`    | every chunk held by a row arena or a [`PoolChunk`], `chunk_size` bytes each: the active chunk's unused tail and the tail a row did not fit in are included (rows are packed without alignment padding; chunks carry no in-band header); chunks taken ahead by [`RowArena::prepare`]; oversize rows (larger than a chunk) at their exact length, plus oversize budget prepaid by `prepare` | [`RowArena`], [`PoolChunk`] |
//! | `batch_blocks`  | whole batch blocks, requested bytes rounded up to 16 (the rounding is included)  | [`BatchBlock`] |
//! | `key_index`     | primary-key index structures, at the sizes the owning crate reserves          | storage / unify via [`Reservation`] |
//! | `write_buffers` | Parquet writer buffers, from `ArrowWriter::memory_size`                  | storage via [`Reservation`] |
//! | `scan_buffers`  | decoded batches held by scans and delta snapshots                        | engine via [`Reservation`] (or [`BatchBlock`]) |
//! | `metadata`      | per-table bookkeeping (schemas, manifests, deletion vectors) and each row arena's block table: its capacity × (block header + 4-byte free-id slot) | every crate via [`Reservation`]; [`RowArena`] |
//! | `query`         | what SQL query operators (hash tables, sorts, aggregates) reserve through the engine's `DataFusion` memory pool, at the sizes `DataFusion` asks for; freed when the operators drop their reservations | `gritdb` (`sql` feature) via [`Reservation`]-like calls to [`MemoryController::try_reserve`] |
//! | `free_chunks`   | empty chunks cached for reuse, `chunk_size` each, wherever they are: the central list **and every thread's cache**. They count toward `used` | the pool itself |
//!
//! `used` is the sum of all categories, and is what the limit is enforced against:
//! a reservation or new chunk that would take `used` above `limit` fails with
//! [`MemoryError::Limit`] before any memory is allocated, after first trimming every cached
//! chunk (other threads' caches included). The check is a compare-and-swap on one atomic, so
//! `used <= limit` holds at every instant (it can only be above the limit after the limit
//! was lowered, until the owners release memory; meanwhile released chunks are freed, not
//! cached; or after [`MemoryController::force_reserve`], which counts memory a caller has
//! already allocated and cannot give back, such as `DataFusion`'s infallible `grow`). Taking a cached chunk moves its bytes from `free_chunks` to `row_blocks` and
//! leaves `used` unchanged; only new chunks and chunks given back to the allocator move `used`.
//!
//! ## How exact the figures are
//!
//! - **Current bytes** ([`MemoryController::category_bytes`], [`MemoryController::report`],
//!   `used`, per table) are exact. A thread cache's fast path records its moves between
//!   `free_chunks` and `row_blocks` in counters only that thread writes (so threads do not
//!   contend on one cache line); they are folded into the shared counters at every refill,
//!   flush and trim, and every read adds the unfolded rest. With no concurrent pool traffic
//!   a read is exact to the byte; during traffic each operation is seen wholly or not at all.
//! - **Peaks**: `peak` (of `used`) and the peaks of `batch_blocks`, `key_index`,
//!   `write_buffers`, `scan_buffers`, `metadata`, `query` and of every table are exact high-water
//!   marks. The peaks of `row_blocks` and `free_chunks` are taken at every central-list
//!   operation (refill, flush, take or put at the central list, new chunk) and at every
//!   read; moves inside thread caches between two such points are not seen, so these two
//!   peaks can be below the true high-water mark by at most the chunks all thread caches
//!   can hold: half the free-chunk share, i.e. `limit / 16` with the default
//!   [`ControllerConfig::free_chunk_divisor`] of 8.
//!   With `thread_cache: false` they are exact too.
//! - **Event counts** (allocations, frees, failures per category) are exact; a failure is a
//!   refused request (limit reached or an injected fault).
//!
//! ## The chunk pool
//!
//! Fixed-size chunks (a power of two, [`DEFAULT_CHUNK_SIZE`] = 64 KiB) come from a central
//! list fronted by one small cache per thread (per controller: several controllers can live
//! in one process). A thread takes from and returns to its own cache; an empty cache takes
//! [`ControllerConfig::batch_chunks`] (16) chunks from the central list in one lock, a full
//! one ([`ControllerConfig::thread_cache_chunks`], 32, lowered so all caches together hold at
//! most half the share) sends 16 back. A chunk may be returned on another thread than the one
//! that took it. Empty chunks go back to the allocator when the caches pass their share of
//! the limit (`limit / free_chunk_divisor`), when the limit is lowered
//! ([`MemoryController::set_limit`]), on [`MemoryController::trim_free_chunks`] (`0` empties
//! every thread's cache too), when idle ([`MemoryController::trim_idle`], called
//! periodically by the engine), and when a thread ends (its cache goes to the central list,
//! the excess to the allocator). [`MemoryController::pool_stats`] shows caches, caps,
//! refills and flushes.
//!
//! ## What is NOT accounted
//! - Allocator overhead beyond the requested sizes: size-class rounding, per-allocation
//!   headers (glibc adds 16 bytes to a chunk; jemalloc's 64 KiB class is exact), allocator
//!   metadata, and pages it retains after a free.
//! - The pool's own bookkeeping: the central list and thread caches are vectors of chunk
//!   pointers (16 bytes per cached chunk), one 128-byte-aligned slot per thread cache, and
//!   a short per-thread list of caches; the controller, its counters and table handles;
//!   a [`RowArena`] struct itself and its spare-chunk vector (the chunks in it *are* counted).
//! - Short-lived temporaries on the ingest path that are freed before the call returns
//!   (per-batch key encodings from `arrow-row`, validation scratch vectors).
//! - Arrow arrays the caller passes in and arrays returned to the caller by scans once the
//!   caller owns them (the engine accounts them only while it holds them).
//! - Thread stacks, the tokio runtime, tracing, and the code itself.
//!
//! The process view ([`ProcessView`]) puts RSS, `VmHWM` and the allocator's own `allocated`
//! beside the accounted total; `outside_engine = allocator allocated − accounted` shows how
//! much of the heap is outside these categories.
//!
//! ## Test hook
//!
//! With the `fault-injection` feature, [`MemoryController::inject_failure_after`] makes the
//! Nth following chunk acquisition (from a thread cache, a refill or a new chunk alike) or
//! reservation (including arena block tables, oversize rows and batch blocks) fail with
//! [`MemoryError::Injected`].

mod arena;
mod batch;
mod category;
mod controller;
mod limit;
mod pool;
mod process;
mod report;
mod spin;

pub use arena::{ArenaMark, MAX_ROW_LEN, RowArena, RowAt, RowRef};
pub use batch::BatchBlock;
pub use category::Category;
pub use controller::{Consumer, ControllerConfig, DEFAULT_CHUNK_SIZE, MemoryController, MemoryError, Reservation, TableAccount};
pub use limit::{cgroup_memory_limit, default_memory_limit, physical_memory_bytes};
pub use pool::{PoolChunk, PoolStats};
pub use process::{AllocatorKind, AllocatorStats, ProcessView};
pub use report::{CategoryReport, MemoryReport, TableReport, format_bytes};
