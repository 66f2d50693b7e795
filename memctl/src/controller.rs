use crate::category::{Category, CounterSet};
use crate::limit::default_memory_limit;
use crate::pool::{ChunkPool, Padded};
use crate::report::format_bytes;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

/// Default chunk size: 64 KiB. Small enough that 500 tables with a few rows each hold 32 MiB
/// of row blocks, large enough that one chunk holds ~400 TPC-H lineitem rows.
pub const DEFAULT_CHUNK_SIZE: usize = 64 << 10;

/// Settings of a [`MemoryController`].
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// The one limit, in bytes. `None`: [`default_memory_limit`] (50% of RAM or cgroup limit).
    pub memory_limit: Option<usize>,
    /// Chunk size in bytes; a power of two between 4 KiB and 64 MiB.
    pub chunk_size: usize,
    /// Share of the limit cached empty chunks may occupy, as a divisor (8 = one eighth).
    /// The share covers the central list and every thread cache together.
    pub free_chunk_divisor: usize,
    /// Per-thread chunk caches in front of the central list (default `true`). `false` makes
    /// every acquisition and release take the central list's mutex (the benchmarks' baseline).
    pub thread_cache: bool,
    /// Most chunks one thread cache holds (default 32); lowered automatically so all caches
    /// together take at most half of the free-chunk share.
    pub thread_cache_chunks: usize,
    /// Chunks moved per refill from, or flush to, the central list (default 16).
    pub batch_chunks: usize,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self { memory_limit: None, chunk_size: DEFAULT_CHUNK_SIZE, free_chunk_divisor: 8, thread_cache: true, thread_cache_chunks: 32, batch_chunks: 16 }
    }
}

/// One consumer named in a [`MemoryError::Limit`]: a category or a table, with its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Consumer {
    /// `category:row_blocks` or `table:orders`.
    pub name: String,
    /// Bytes currently held.
    pub bytes: usize,
}

/// Errors of the memory controller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Granting `requested` bytes would take the accounted total above the limit.
    #[error(
        "memory limit reached: requested {} for {category}, {} of {} in use; top consumers: {}. \
         Raise the limit (EngineConfig::memory_limit / set_memory_limit), or flush and drop tables",
        format_bytes(*requested), format_bytes(*used), format_bytes(*limit), format_top(top)
    )]
    Limit {
        /// Bytes asked for.
        requested: usize,
        /// Accounted bytes at the time of the request.
        used: usize,
        /// The limit in bytes.
        limit: usize,
        /// Category the request was for.
        category: Category,
        /// Biggest categories and tables, largest first.
        top: Vec<Consumer>,
    },
    /// A configuration value is out of range.
    #[error("invalid memory configuration: {0}")]
    Config(String),
    /// A row longer than [`crate::MAX_ROW_LEN`] was asked of a [`crate::RowArena`]: a row's
    /// offset and length are `u32`s in its [`crate::RowRef`], and would wrap.
    #[error("a row of {bytes} bytes is longer than the {max} bytes a row block can hold")]
    RowTooLong {
        /// Bytes asked for.
        bytes: usize,
        /// [`crate::MAX_ROW_LEN`].
        max: usize,
    },
    /// A failure injected by the `fault-injection` test hook.
    #[error("injected allocation failure (fault-injection hook) for {category}")]
    Injected {
        /// Category the failed request was for.
        category: Category,
    },
}

fn format_top(top: &[Consumer]) -> String {
    if top.is_empty() {
        return "none".to_owned();
    }
    top.iter().map(|c| format!("{} {}", c.name, format_bytes(c.bytes))).collect::<Vec<_>>().join(", ")
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the protected counters
    // half-updated (each critical section is a single push/pop), so poisoning is ignored.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) struct TableInner {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) counters: CounterSet,
    /// Set by [`TableAccount::mark_dropped`]: reports leave the table out once it holds 0 bytes.
    pub(crate) dropped: std::sync::atomic::AtomicBool,
    ctl: Weak<MemoryController>,
}

impl Drop for TableInner {
    fn drop(&mut self) {
        if let Some(ctl) = self.ctl.upgrade() {
            lock(&ctl.tables).remove(&self.id);
        }
    }
}

/// Per-table accounting handle. Cheap to clone; the table's row in reports disappears when the
/// last clone is dropped. Bytes reserved with a table account count both engine-wide and for
/// the table.
#[derive(Clone)]
pub struct TableAccount(pub(crate) Arc<TableInner>);

impl std::fmt::Debug for TableAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableAccount").field("id", &self.0.id).field("name", &self.0.name).finish()
    }
}

impl TableAccount {
    /// The table's name as registered.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Bytes this table currently holds in `category`.
    pub fn bytes(&self, category: Category) -> usize {
        self.0.counters[category.index()].get()
    }

    /// Marks the table dropped: from now on reports leave it out as soon as it holds 0 bytes,
    /// even while handles to its account (a `Table` handle, batches a scan handed out) live
    /// on; while it still holds bytes it is reported with `dropped: true`.
    pub fn mark_dropped(&self) {
        self.0.dropped.store(true, Ordering::Release);
    }

    /// Whether [`TableAccount::mark_dropped`] was called.
    pub fn is_dropped(&self) -> bool {
        self.0.dropped.load(Ordering::Acquire)
    }

    /// Bytes this table currently holds in all categories.
    pub fn total_bytes(&self) -> usize {
        self.0.counters.iter().map(crate::category::Counters::get).sum()
    }
}

/// The memory controller: one limit, per-category counters, a chunk pool.
///
/// Shared as `Arc<MemoryController>`; every method takes `&self` and is thread-safe.
pub struct MemoryController {
    limit: AtomicUsize,
    used: AtomicUsize,
    peak: AtomicUsize,
    pub(crate) counters: CounterSet,
    pub(crate) tables: Mutex<HashMap<u64, Weak<TableInner>>>,
    next_table: AtomicU64,
    chunk_size: usize,
    pub(crate) pool: ChunkPool,
    release_lock: Mutex<u64>,
    release_cv: Condvar,
    /// Read on every release: on lines of its own, away from `used` and the counters.
    waiters: Padded<AtomicUsize>,
    fault_countdown: std::sync::atomic::AtomicI64,
    pub(crate) weak_self: Weak<MemoryController>,
}

impl std::fmt::Debug for MemoryController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryController")
            .field("limit", &self.limit())
            .field("used", &self.used())
            .field("chunk_size", &self.chunk_size)
            .finish_non_exhaustive()
    }
}

impl MemoryController {
    /// Creates a controller.
    ///
    /// # Errors
    /// [`MemoryError::Config`] when the chunk size is not a power of two in 4 KiB..=64 MiB, or
    /// the limit is smaller than two chunks (one active chunk plus one more for a row that
    /// straddles it).
    // By value: the signature other crates call; taking `&ControllerConfig` would break them.
    #[allow(clippy::needless_pass_by_value)]
    pub fn new(config: ControllerConfig) -> Result<Arc<Self>, MemoryError> {
        let chunk_size = config.chunk_size;
        if !chunk_size.is_power_of_two() || !(4 << 10..=64 << 20).contains(&chunk_size) {
            return Err(MemoryError::Config(format!("chunk size must be a power of two between 4 KiB and 64 MiB, got {chunk_size} bytes")));
        }
        let limit = config.memory_limit.unwrap_or_else(default_memory_limit);
        Self::check_limit(limit, chunk_size)?;
        Ok(Arc::new_cyclic(|weak| Self {
            limit: AtomicUsize::new(limit),
            used: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            counters: Default::default(),
            tables: Mutex::new(HashMap::new()),
            next_table: AtomicU64::new(1),
            chunk_size,
            pool: ChunkPool::new(chunk_size, limit, config.free_chunk_divisor, config.thread_cache, config.batch_chunks, config.thread_cache_chunks),
            release_lock: Mutex::new(0),
            release_cv: Condvar::new(),
            waiters: Padded(AtomicUsize::new(0)),
            fault_countdown: std::sync::atomic::AtomicI64::new(-1),
            weak_self: weak.clone(),
        }))
    }

    /// Checks a limit value against the chunk size without applying it.
    ///
    /// # Errors
    /// [`MemoryError::Config`] when `limit` is below two chunks.
    pub fn check_limit_value(limit: usize, chunk_size: usize) -> Result<(), MemoryError> {
        Self::check_limit(limit, chunk_size)
    }

    fn check_limit(limit: usize, chunk_size: usize) -> Result<(), MemoryError> {
        let min = 2 * chunk_size;
        if limit < min {
            return Err(MemoryError::Config(format!("memory limit of {limit} B is below the minimum of two chunks ({min} B)")));
        }
        Ok(())
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Accounted bytes across all categories (free chunks included).
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// High-water mark of [`Self::used`] since creation or the last [`Self::reset_peaks`].
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Acquire)
    }

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// Current bytes in one category, engine-wide. Exact: for `row_blocks` and `free_chunks`
    /// this includes the moves inside thread caches not yet folded into the shared counters.
    pub fn category_bytes(&self, category: Category) -> usize {
        if category.is_pool() {
            let f = self.pool_figures();
            return if category == Category::RowBlocks { f.row_bytes } else { f.free_bytes };
        }
        self.counters[category.index()].get()
    }

    /// High-water mark of one category (see the crate docs for how exact it is for
    /// `row_blocks` and `free_chunks`).
    pub fn category_peak(&self, category: Category) -> usize {
        if category.is_pool() {
            self.observe_pool_peaks();
        }
        self.counters[category.index()].peak.load(Ordering::Acquire)
    }

    /// Sets the limit at run time and trims cached chunks above the new share.
    ///
    /// Memory already held above a lowered limit is not taken back here: owners (the engine's
    /// writer) must flush; new reservations fail until `used` is below the limit again.
    /// Cached empty chunks are trimmed to the new share at once (all of them when `used` is
    /// above the new limit), and while `used` stays above it, released chunks go straight
    /// back to the allocator instead of into a cache.
    ///
    /// # Errors
    /// [`MemoryError::Config`] when `bytes` is below two chunks.
    pub fn set_limit(&self, bytes: usize) -> Result<(), MemoryError> {
        Self::check_limit(bytes, self.chunk_size)?;
        let old = self.limit.swap(bytes, Ordering::AcqRel);
        tracing::info!(old_limit = old, new_limit = bytes, "memory limit changed");
        let over = self.used() > bytes;
        self.pool.over_limit.store(over, Ordering::Release);
        self.limit_changed();
        if over {
            // Above the new limit: no empty chunk stays cached (released ones are freed too,
            // until `used` is back under the limit).
            self.trim_free_chunks(0);
        }
        Ok(())
    }

    /// Resets the high-water marks (engine-wide, per category, per table) to current values.
    pub fn reset_peaks(&self) {
        self.peak.store(self.used(), Ordering::Release);
        for c in Category::ALL {
            if c.is_pool() {
                self.counters[c.index()].peak.store(self.category_bytes(c), Ordering::Release);
            } else {
                self.counters[c.index()].reset_peak();
            }
        }
        for t in self.live_tables() {
            for c in &t.0.counters {
                c.reset_peak();
            }
        }
    }

    /// Registers a table and returns its accounting handle.
    pub fn register_table(&self, name: &str) -> TableAccount {
        let id = self.next_table.fetch_add(1, Ordering::Relaxed);
        let inner = Arc::new(TableInner {
            id,
            name: name.to_owned(),
            counters: Default::default(),
            dropped: std::sync::atomic::AtomicBool::new(false),
            ctl: self.weak_self.clone(),
        });
        lock(&self.tables).insert(id, Arc::downgrade(&inner));
        TableAccount(inner)
    }

    pub(crate) fn live_tables(&self) -> Vec<TableAccount> {
        let mut v: Vec<TableAccount> =
            lock(&self.tables).values().filter_map(Weak::upgrade).map(TableAccount).filter(|t| !t.is_dropped() || t.total_bytes() > 0).collect();
        v.sort_by_key(|t| t.0.id);
        v
    }

    /// Number of registered tables: live accounting handles, leaving out dropped tables that
    /// hold 0 bytes.
    pub fn table_count(&self) -> usize {
        self.live_tables().len()
    }

    /// Makes the `n`th following chunk acquisition or reservation fail with
    /// [`MemoryError::Injected`] (`n = 0`: the next one). `None` disarms.
    /// Only active with the `fault-injection` feature.
    pub fn inject_failure_after(&self, n: Option<u64>) {
        self.fault_countdown.store(n.map_or(-1, |n| n as i64), Ordering::Release);
    }

    pub(crate) fn injected(&self, category: Category) -> Result<(), MemoryError> {
        if cfg!(feature = "fault-injection") {
            let prev = self.fault_countdown.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| if v >= 0 { Some(v - 1) } else { None });
            if prev == Ok(0) {
                self.counters[category.index()].failures.fetch_add(1, Ordering::Relaxed);
                return Err(MemoryError::Injected { category });
            }
        }
        Ok(())
    }

    /// Reserves `bytes` in `category` (and for `table`), or fails without side effects.
    ///
    /// # Errors
    /// [`MemoryError::Limit`] when `used + bytes` would exceed the limit even after trimming
    /// cached free chunks.
    pub fn try_reserve(&self, category: Category, table: Option<&TableAccount>, bytes: usize) -> Result<(), MemoryError> {
        self.injected(category)?;
        self.grow_used(category, bytes)?;
        self.counter_add(category, bytes);
        if let Some(t) = table {
            t.0.counters[category.index()].add(bytes);
        }
        Ok(())
    }

    /// Counts a refused request of `category` that a policy above the controller turned
    /// down (the SQL memory pool keeps queries under the write soft limit), so the report's
    /// `failures` shows it like a refusal at the limit.
    pub fn count_failure(&self, category: Category) {
        self.counters[category.index()].failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `bytes` in `category` (and for `table`) without checking the limit: for memory a
    /// caller has already allocated and cannot refuse (`DataFusion`'s infallible
    /// `MemoryReservation::grow`, used by a few join operators). The accounting stays truthful,
    /// so `used` may pass the limit; when it does, the request counts as a failure of
    /// `category`. Returns `true` when the bytes fit under the limit. Release them with
    /// [`Self::release`].
    pub fn force_reserve(&self, category: Category, table: Option<&TableAccount>, bytes: usize) -> bool {
        if self.try_reserve(category, table, bytes).is_ok() {
            return true;
        }
        let new = self.used.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(new, Ordering::AcqRel);
        self.counter_add(category, bytes);
        if let Some(t) = table {
            t.0.counters[category.index()].add(bytes);
        }
        new <= self.limit()
    }

    /// Releases `bytes` previously reserved with [`Self::try_reserve`].
    pub fn release(&self, category: Category, table: Option<&TableAccount>, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.counter_sub(category, bytes);
        if let Some(t) = table {
            t.0.counters[category.index()].sub(bytes);
        }
        self.sub_used(bytes);
        self.notify_release();
    }

    pub(crate) fn sub_used(&self, bytes: usize) {
        let prev = self.used.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(prev >= bytes, "used underflow: {prev} - {bytes}");
        if self.pool.over_limit.load(Ordering::Relaxed) && prev - bytes <= self.limit() {
            self.pool.over_limit.store(false, Ordering::Release);
        }
    }

    pub(crate) fn grow_used(&self, category: Category, bytes: usize) -> Result<(), MemoryError> {
        let mut trimmed = false;
        loop {
            let limit = self.limit();
            let cur = self.used.load(Ordering::Acquire);
            let new = cur.saturating_add(bytes);
            if new > limit {
                if !trimmed && self.category_bytes(Category::FreeChunks) > 0 {
                    trimmed = true;
                    self.trim_free_chunks(0);
                    continue;
                }
                self.counters[category.index()].failures.fetch_add(1, Ordering::Relaxed);
                return Err(self.limit_error(category, bytes));
            }
            if self.used.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.peak.fetch_max(new, Ordering::AcqRel);
                return Ok(());
            }
        }
    }

    /// Builds the limit error for a request of `requested` bytes, naming the biggest
    /// categories and tables.
    pub fn limit_error(&self, category: Category, requested: usize) -> MemoryError {
        let mut top: Vec<Consumer> =
            Category::ALL.iter().map(|c| Consumer { name: format!("category:{c}"), bytes: self.category_bytes(*c) }).filter(|c| c.bytes > 0).collect();
        top.sort_by_key(|c| std::cmp::Reverse(c.bytes));
        top.truncate(3);
        let mut tables: Vec<Consumer> =
            self.live_tables().iter().map(|t| Consumer { name: format!("table:{}", t.name()), bytes: t.total_bytes() }).filter(|c| c.bytes > 0).collect();
        tables.sort_by_key(|c| std::cmp::Reverse(c.bytes));
        tables.truncate(3);
        top.extend(tables);
        MemoryError::Limit { requested, used: self.used(), limit: self.limit(), category, top }
    }

    /// Wakes the threads in [`Self::wait_for_release`] as a release would, for a caller whose
    /// waiters wait on something else that counts against the limit: the engine's writes
    /// admitted but not yet applied, which end without releasing memory.
    pub fn wake_waiters(&self) {
        self.notify_release();
    }

    pub(crate) fn notify_release(&self) {
        if self.waiters.load(Ordering::Acquire) > 0 {
            let mut generation = lock(&self.release_lock);
            *generation = generation.wrapping_add(1);
            self.release_cv.notify_all();
        }
    }

    /// Blocks the calling thread until some accounted memory is released or `timeout` passes.
    /// Returns `true` when a release happened. Used for ingest backpressure.
    pub fn wait_for_release(&self, timeout: Duration) -> bool {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let generation = lock(&self.release_lock);
        let start = *generation;
        let (g, _) = self.release_cv.wait_timeout_while(generation, timeout, |g| *g == start).unwrap_or_else(PoisonError::into_inner);
        let released = *g != start;
        drop(g);
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        released
    }
}

impl Drop for MemoryController {
    fn drop(&mut self) {
        // Chunks in other threads' caches would otherwise live until those threads end.
        self.drop_thread_caches();
    }
}

/// RAII budget for memory that does not come from chunks (index tables, writer buffers, scan
/// buffers, metadata). Dropping it releases what it holds.
pub struct Reservation {
    ctl: Arc<MemoryController>,
    category: Category,
    table: Option<TableAccount>,
    size: usize,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").field("category", &self.category).field("size", &self.size).finish_non_exhaustive()
    }
}

impl Reservation {
    /// An empty reservation in `category`, optionally attributed to `table`.
    pub fn new(ctl: &Arc<MemoryController>, category: Category, table: Option<&TableAccount>) -> Self {
        Self { ctl: Arc::clone(ctl), category, table: table.cloned(), size: 0 }
    }

    /// Bytes held.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The category this reservation counts in.
    pub fn category(&self) -> Category {
        self.category
    }

    /// Grows by `bytes`.
    ///
    /// # Errors
    /// [`MemoryError::Limit`] (nothing changes) when the limit would be exceeded.
    pub fn try_grow(&mut self, bytes: usize) -> Result<(), MemoryError> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctl.try_reserve(self.category, self.table.as_ref(), bytes)?;
        self.size += bytes;
        Ok(())
    }

    /// Shrinks by `bytes` (at most what is held).
    pub fn shrink(&mut self, bytes: usize) {
        let bytes = bytes.min(self.size);
        self.ctl.release(self.category, self.table.as_ref(), bytes);
        self.size -= bytes;
    }

    /// Grows or shrinks to exactly `bytes`.
    ///
    /// # Errors
    /// [`MemoryError::Limit`] when growing would exceed the limit (the size is unchanged).
    pub fn try_resize(&mut self, bytes: usize) -> Result<(), MemoryError> {
        if bytes > self.size {
            self.try_grow(bytes - self.size)
        } else {
            self.shrink(self.size - bytes);
            Ok(())
        }
    }

    /// Grows or shrinks to exactly `bytes`, counting growth as
    /// [`MemoryController::force_reserve`] does: for memory that already exists and cannot be
    /// refused (what a Parquet writer keeps of the row groups it has written), so the counters
    /// stay truthful even past the limit. Returns `true` when the growth fitted under the
    /// limit (or the reservation shrank).
    pub fn force_resize(&mut self, bytes: usize) -> bool {
        if bytes > self.size {
            let fits = self.ctl.force_reserve(self.category, self.table.as_ref(), bytes - self.size);
            self.size = bytes;
            fits
        } else {
            self.shrink(self.size - bytes);
            true
        }
    }

    /// Releases everything held.
    pub fn free(&mut self) {
        self.shrink(self.size);
    }

    /// Takes over `other`'s bytes, for memory built under its own reservation (off a lock)
    /// and then handed to a structure whose reservation holds the rest (the key index's
    /// files). When both count in the same category for the same table of the same
    /// controller, the bytes move without touching any counter, so the limit sees no
    /// moment in which they are counted twice or not at all. Otherwise `other` releases them
    /// and this reservation counts them as [`MemoryController::force_reserve`] does: the
    /// memory already exists, so the counters stay truthful even past the limit.
    pub fn absorb(&mut self, mut other: Reservation) {
        let same_table = match (&self.table, &other.table) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(&a.0, &b.0),
            _ => false,
        };
        let bytes = std::mem::take(&mut other.size);
        if Arc::ptr_eq(&self.ctl, &other.ctl) && self.category == other.category && same_table {
            self.size += bytes;
            return;
        }
        other.ctl.release(other.category, other.table.as_ref(), bytes);
        self.ctl.force_reserve(self.category, self.table.as_ref(), bytes);
        self.size += bytes;
    }

    /// The controller this reservation draws from.
    pub fn controller(&self) -> &Arc<MemoryController> {
        &self.ctl
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.free();
    }
}
