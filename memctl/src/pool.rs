//! The chunk pool: a central free list plus one small cache per thread (and per controller).
//!
//! ```text
//!            central free list  (Mutex<Vec<Chunk>>, at most `central_cap` chunks)
//!              ▲ flush 16        │ refill 16
//!              │                 ▼
//!   thread A cache (≤ thread_cap)     thread B cache (≤ thread_cap)     ...
//!      │ pop / push: one uncontended mutex, no shared counter of the pool
//!      ▼
//!   RowArena (row_blocks)
//! ```
//!
//! - A thread takes chunks from its own cache; an empty cache is refilled with up to
//!   `batch` chunks from the central list in one lock; a full cache sends `batch` chunks back
//!   in one lock. Only when the central list is empty too is a new chunk allocated (and only
//!   then does `used` grow, under the limit check).
//! - A cache is a [`Slot`] registered with its controller, so the controller can reach every
//!   thread's cache: [`MemoryController::trim_free_chunks`] (`0` empties them all),
//!   [`MemoryController::set_limit`], [`MemoryController::trim_idle`] and the limit path steal
//!   from them. The owner's mutex is uncontended except while such a trim runs.
//! - Thread caches are kept in a small per-thread list keyed by controller id, so many
//!   controllers can live in one process. When the thread ends, its caches go back to their
//!   controllers' central lists (beyond the central share, to the allocator). When a controller
//!   is dropped, it frees the chunks of every cache registered with it; the thread's stale entry
//!   is pruned on its next miss.
//! - A chunk may be released on another thread than the one that acquired it: chunks are plain
//!   equal-size boxes and the accounting is per controller, so it simply enters the releasing
//!   thread's cache.
//!
//! Share of the limit: the empty chunks cached anywhere (central and all thread caches) stay
//! within `limit / free_chunk_divisor` bytes: each thread cache holds at most `thread_cap`
//! chunks (`min(thread_cache_chunks, share / (2 × caches))`) and the central list at most
//! `share − caches × thread_cap` chunks. Both caps are recomputed when the limit changes or a
//! cache is added or removed, and caches above the new caps are trimmed at once.

use crate::category::Category;
use crate::controller::{MemoryController, MemoryError, TableAccount, lock};
use crate::spin::SpinLock;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// One pool chunk: `chunk_size` bytes, zeroed when first allocated.
pub(crate) type Chunk = Box<[u8]>;

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// Figures of the chunk pool (see [`MemoryController::pool_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PoolStats {
    /// Whether per-thread caches are enabled ([`crate::ControllerConfig::thread_cache`]).
    pub thread_cache: bool,
    /// Number of thread caches registered with this controller (threads that used its pool
    /// and have not ended).
    pub thread_caches: usize,
    /// Empty chunks in thread caches.
    pub thread_cached_chunks: usize,
    /// Empty chunks in the central list.
    pub central_chunks: usize,
    /// Current cap of one thread cache, in chunks.
    pub thread_cap: usize,
    /// Current cap of the central list, in chunks.
    pub central_cap: usize,
    /// Batch refills of a thread cache from the central list.
    pub refills: u64,
    /// Batch flushes of a full thread cache to the central list.
    pub flushes: u64,
    /// Chunks allocated from the global allocator (new chunks).
    pub allocated_chunks: u64,
    /// Chunks given back to the global allocator (over the share, trims, idle).
    pub returned_chunks: u64,
}

/// One chunk of the pool, held outside a row arena: counted under `row_blocks` (and the
/// table, if any) while held, returned to the pool (this thread's cache first) when dropped.
///
/// Row arenas take their chunks the same way; this handle is for callers that manage a
/// chunk's bytes themselves, and for the pool benchmarks. It borrows the controller, so
/// taking and returning one touches no reference count.
pub struct PoolChunk<'a> {
    ctl: &'a MemoryController,
    table: Option<&'a TableAccount>,
    data: Option<Chunk>,
}

impl std::fmt::Debug for PoolChunk<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolChunk").field("len", &self.len()).finish_non_exhaustive()
    }
}

impl PoolChunk<'_> {
    /// Length in bytes (the controller's chunk size).
    pub fn len(&self) -> usize {
        self.data.as_ref().map_or(0, |d| d.len())
    }

    /// Always false: a chunk is never empty. (Present for `len`'s sake.)
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The chunk's bytes (zeroed when the chunk was new, earlier contents when reused).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_deref().unwrap_or_default()
    }

    /// The chunk's bytes, for writing.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.data.as_deref_mut().unwrap_or_default()
    }
}

impl Drop for PoolChunk<'_> {
    fn drop(&mut self) {
        if let Some(data) = self.data.take() {
            self.ctl.put_chunk(data, self.table);
        }
    }
}

/// Activity counter plus idle bookkeeping, shared by the central list and thread caches.
struct Idle {
    /// Operations so far (bumped by every take/put).
    uses: u64,
    /// `uses` as seen by the last [`MemoryController::trim_idle`] call.
    seen: u64,
    /// When `uses` was last seen to change.
    since: Instant,
}

impl Idle {
    fn new() -> Self {
        Self { uses: 0, seen: 0, since: Instant::now() }
    }

    /// True when no operation happened for at least `max_idle` (as observed by the calls).
    fn idle_for(&mut self, now: Instant, max_idle: Duration) -> bool {
        if self.uses != self.seen {
            self.seen = self.uses;
            self.since = now;
        }
        now.duration_since(self.since) >= max_idle
    }
}

struct CacheInner {
    chunks: Vec<Chunk>,
    idle: Idle,
}

/// One thread's cache for one controller. Locked by its owner thread on every operation
/// (uncontended) and by trims from other threads.
///
/// The owner's fast path does not touch the controller's shared counters (one cache line
/// written by every thread would serialise them again): it records the move of a chunk
/// between `free_chunks` and `row_blocks` in `moved`, `takes` and `puts`, written only under
/// `inner` (plain load + store, no locked instruction) and read by anyone: readers add them
/// to the shared counters (wrapping sums, see `fold`). They are folded into the shared
/// counters when the cache is unregistered (thread exit), under the registry lock that
/// readers also hold, so a reader sees every move exactly once.
// Aligned to two cache lines so two threads' slots (allocated back to back) never share a
// line or an adjacent-line prefetch pair.
#[repr(align(128))]
pub(crate) struct Slot {
    inner: SpinLock<CacheInner>,
    /// Net bytes moved from `free_chunks` to `row_blocks` through this cache.
    moved: AtomicIsize,
    /// Acquisitions served by this cache.
    takes: AtomicU64,
    /// Releases into this cache.
    puts: AtomicU64,
}

impl Slot {
    fn new(cap: usize) -> Self {
        Self {
            inner: SpinLock::new(CacheInner { chunks: Vec::with_capacity(cap), idle: Idle::new() }),
            moved: AtomicIsize::new(0),
            takes: AtomicU64::new(0),
            puts: AtomicU64::new(0),
        }
    }

    /// Records a fast-path move; the caller holds `inner` (so it is the only writer).
    fn record(&self, bytes: isize, take: bool) {
        self.moved.store(self.moved.load(Ordering::Relaxed) + bytes, Ordering::Relaxed);
        let events = if take { &self.takes } else { &self.puts };
        events.store(events.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// Exact figures of the two pool categories: shared counters plus unfolded thread-cache moves.
pub(crate) struct PoolFigures {
    pub(crate) row_bytes: usize,
    pub(crate) free_bytes: usize,
    pub(crate) takes: u64,
    pub(crate) puts: u64,
}

pub(crate) struct ChunkPool {
    id: u64,
    chunk_size: usize,
    thread_cache: bool,
    batch: usize,
    max_thread_chunks: usize,
    free_chunk_divisor: usize,
    thread_cap: AtomicUsize,
    central_cap: AtomicUsize,
    /// Set by `set_limit` when `used` is above the new limit, cleared when it is back under:
    /// while set, released chunks bypass the caches. Read-mostly, beside the caps.
    pub(crate) over_limit: AtomicBool,
    central: Padded<Mutex<CacheInner>>,
    /// Registered thread caches. Lock order: `central` → a slot's `inner`, and `slots` → a
    /// slot's `inner`; `central` and `slots` are never held together.
    slots: Padded<Mutex<Vec<Arc<Slot>>>>,
    stats: PoolCounters,
}

/// A value on cache lines of its own (two lines: adjacent-line prefetch pairs on x86).
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for Padded<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Slow-path event counts, on their own cache lines: the fields read on every fast-path
/// operation (`id`, caps) must not share a line with counters other threads write.
#[derive(Default)]
#[repr(align(128))]
struct PoolCounters {
    refills: AtomicU64,
    flushes: AtomicU64,
    allocated: AtomicU64,
    returned: AtomicU64,
}

impl ChunkPool {
    pub(crate) fn new(chunk_size: usize, limit: usize, free_chunk_divisor: usize, thread_cache: bool, batch: usize, max_thread_chunks: usize) -> Self {
        let pool = Self {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            chunk_size,
            thread_cache: thread_cache && max_thread_chunks > 0,
            batch: batch.max(1),
            max_thread_chunks,
            free_chunk_divisor: free_chunk_divisor.max(1),
            thread_cap: AtomicUsize::new(0),
            central_cap: AtomicUsize::new(0),
            over_limit: AtomicBool::new(false),
            central: Padded(Mutex::new(CacheInner { chunks: Vec::new(), idle: Idle::new() })),
            slots: Padded(Mutex::new(Vec::new())),
            stats: PoolCounters::default(),
        };
        pool.set_caps(limit, 0);
        pool
    }

    /// Bytes of empty chunks the pool may cache: the share of the limit.
    pub(crate) fn share_bytes(&self, limit: usize) -> usize {
        limit / self.free_chunk_divisor
    }

    /// Recomputes the caps for `limit` and `caches` registered thread caches.
    fn set_caps(&self, limit: usize, caches: usize) {
        let share = self.share_bytes(limit) / self.chunk_size;
        // Computed for at least one cache, so the first thread can register its own.
        let thread_cap = if self.thread_cache { self.max_thread_chunks.min(share / (2 * caches.max(1))) } else { 0 };
        self.thread_cap.store(thread_cap, Ordering::Release);
        self.central_cap.store(share.saturating_sub(caches * thread_cap), Ordering::Release);
    }
}

/// This thread's caches, one per controller it touched: a short list, most recent first.
struct ThreadCaches(RefCell<Vec<CacheEntry>>);

struct CacheEntry {
    pool_id: u64,
    ctl: Weak<MemoryController>,
    slot: Arc<Slot>,
}

impl Drop for ThreadCaches {
    fn drop(&mut self) {
        for e in self.0.get_mut().drain(..) {
            // A dropped controller already freed this cache's chunks (MemoryController::drop).
            if let Some(ctl) = e.ctl.upgrade() {
                ctl.retire_slot(&e.slot);
            }
        }
    }
}

thread_local! {
    static CACHES: ThreadCaches = const { ThreadCaches(RefCell::new(Vec::new())) };
}

impl MemoryController {
    /// Runs `f` on this thread's cache for this controller, creating it on first use.
    /// `None` when the thread-local is gone (thread exit) or re-entered: callers then use the
    /// central list.
    fn with_local_slot<R>(&self, f: impl FnOnce(&Slot) -> R) -> Option<R> {
        let pool_id = self.pool.id;
        CACHES
            .try_with(|caches| {
                let mut entries = caches.0.try_borrow_mut().ok()?;
                match entries.iter().position(|e| e.pool_id == pool_id) {
                    Some(0) => {}
                    Some(i) => entries.swap(0, i),
                    None => {
                        entries.retain(|e| e.ctl.strong_count() > 0);
                        let slot = self.register_slot();
                        entries.push(CacheEntry { pool_id, ctl: self.weak_self.clone(), slot });
                        let last = entries.len() - 1;
                        entries.swap(0, last);
                    }
                }
                Some(f(&entries[0].slot))
            })
            .ok()
            .flatten()
    }

    fn register_slot(&self) -> Arc<Slot> {
        let slot = Arc::new(Slot::new(self.pool.max_thread_chunks));
        let caches = {
            let mut slots = lock(&self.pool.slots);
            slots.push(Arc::clone(&slot));
            slots.len()
        };
        self.pool.set_caps(self.limit(), caches);
        // One more cache lowers every cache's cap: trim what is now above it.
        self.enforce_caps();
        slot
    }

    /// A thread ended: its cache goes back to the central list (the excess to the allocator).
    pub(crate) fn retire_slot(&self, slot: &Arc<Slot>) {
        let (caches, chunks) = {
            let mut slots = lock(&self.pool.slots);
            slots.retain(|s| !Arc::ptr_eq(s, slot));
            let mut c = slot.inner.lock();
            // Fold while the registry is held: no reader can miss these moves in between.
            self.fold(slot);
            (slots.len(), std::mem::take(&mut c.chunks))
        };
        self.pool.set_caps(self.limit(), caches);
        self.put_central(chunks);
        self.enforce_caps();
    }

    /// Frees every chunk cached in thread caches registered with this controller (on drop).
    pub(crate) fn drop_thread_caches(&mut self) {
        let slots = std::mem::take(self.pool.slots.0.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner));
        for s in slots {
            drop(std::mem::take(&mut s.inner.lock().chunks));
        }
    }

    // ---- moving bytes between categories --------------------------------------------------

    /// Folds a slot's moves into the shared counters, when it is unregistered. The caller
    /// holds the registry lock (so no reader is summing) and the slot's `inner`.
    fn fold(&self, slot: &Slot) {
        let moved = slot.moved.swap(0, Ordering::Relaxed);
        let takes = slot.takes.swap(0, Ordering::Relaxed);
        let puts = slot.puts.swap(0, Ordering::Relaxed);
        let row = &self.counters[Category::RowBlocks.index()];
        let free = &self.counters[Category::FreeChunks.index()];
        // Two's-complement wrapping: a shared value may be transiently "negative" while another
        // cache holds the matching unfolded move; the exact figure is the wrapping sum.
        row.current.fetch_add(moved as usize, Ordering::AcqRel);
        free.current.fetch_sub(moved as usize, Ordering::AcqRel);
        row.allocs.fetch_add(takes, Ordering::Relaxed);
        free.frees.fetch_add(takes, Ordering::Relaxed);
        row.frees.fetch_add(puts, Ordering::Relaxed);
        free.allocs.fetch_add(puts, Ordering::Relaxed);
    }

    /// Exact `row_blocks` and `free_chunks` figures: shared counters plus every cache's
    /// moves (the registry lock excludes folds; moves happening meanwhile land before or after).
    pub(crate) fn pool_figures(&self) -> PoolFigures {
        let slots = lock(&self.pool.slots);
        let row = &self.counters[Category::RowBlocks.index()];
        let free = &self.counters[Category::FreeChunks.index()];
        let mut f = PoolFigures { row_bytes: row.current.load(Ordering::Acquire), free_bytes: free.current.load(Ordering::Acquire), takes: 0, puts: 0 };
        for s in slots.iter() {
            let moved = s.moved.load(Ordering::Relaxed) as usize;
            f.row_bytes = f.row_bytes.wrapping_add(moved);
            f.free_bytes = f.free_bytes.wrapping_sub(moved);
            f.takes += s.takes.load(Ordering::Relaxed);
            f.puts += s.puts.load(Ordering::Relaxed);
        }
        f
    }

    /// Raises the `row_blocks` / `free_chunks` high-water marks to their exact current values.
    /// Runs after every slow-path change of the two categories and on every read of a peak.
    pub(crate) fn observe_pool_peaks(&self) {
        if !self.pool.thread_cache {
            // No thread caches: the shared counters are exact (and never wrap).
            for c in [Category::RowBlocks, Category::FreeChunks] {
                let k = &self.counters[c.index()];
                k.peak.fetch_max(k.get(), Ordering::AcqRel);
            }
            return;
        }
        let f = self.pool_figures();
        self.counters[Category::RowBlocks.index()].peak.fetch_max(f.row_bytes, Ordering::AcqRel);
        self.counters[Category::FreeChunks.index()].peak.fetch_max(f.free_bytes, Ordering::AcqRel);
    }

    /// Adds to a category: pool categories by wrapping add plus a peak observation, the others
    /// by the plain counter (which keeps its own peak).
    pub(crate) fn counter_add(&self, category: Category, bytes: usize) {
        if category.is_pool() {
            self.counters[category.index()].add_raw(bytes);
            self.observe_pool_peaks();
        } else {
            self.counters[category.index()].add(bytes);
        }
    }

    /// Subtracts from a category (see [`Self::counter_add`]).
    pub(crate) fn counter_sub(&self, category: Category, bytes: usize) {
        if category.is_pool() {
            self.counters[category.index()].sub_raw(bytes);
        } else {
            self.counters[category.index()].sub(bytes);
        }
    }

    /// A chunk cached centrally goes to a row arena: `free_chunks` → `row_blocks`.
    fn account_take(&self, table: Option<&TableAccount>) {
        let size = self.pool.chunk_size;
        self.counters[Category::FreeChunks.index()].sub_raw(size);
        self.counter_add(Category::RowBlocks, size);
        if let Some(t) = table {
            t.0.counters[Category::RowBlocks.index()].add(size);
        }
    }

    /// `n` cached chunks went back to the allocator: `free_chunks` and `used` shrink.
    fn account_returned(&self, n: usize) {
        if n == 0 {
            return;
        }
        let bytes = n * self.pool.chunk_size;
        self.counters[Category::FreeChunks.index()].sub_raw_n(bytes, n as u64);
        self.pool.stats.returned.fetch_add(n as u64, Ordering::Relaxed);
        self.sub_used(bytes);
    }

    // ---- acquire / release ---------------------------------------------------------------------

    /// Takes one chunk for a row arena, counted under `row_blocks` (and the table).
    ///
    /// Order of sources: this thread's cache, a batch refill from the central list, a new
    /// chunk from the allocator (under the limit check, after trimming every cache if needed).
    pub(crate) fn take_chunk(&self, table: Option<&TableAccount>) -> Result<Chunk, MemoryError> {
        self.injected(Category::RowBlocks)?;
        if self.pool.thread_cache && self.pool.thread_cap.load(Ordering::Relaxed) > 0 {
            // `None`: no thread cache usable (thread exiting): take the central path below.
            if let Some((chunk, refilled)) = self.with_local_slot(|slot| self.take_local(slot)) {
                if refilled {
                    self.pool.stats.refills.fetch_add(1, Ordering::Relaxed);
                    self.observe_pool_peaks();
                }
                let Some(chunk) = chunk else {
                    return self.new_chunk(table);
                };
                if let Some(t) = table {
                    t.0.counters[Category::RowBlocks.index()].add(self.pool.chunk_size);
                }
                return Ok(chunk);
            }
        }
        let cached = {
            let mut c = lock(&self.pool.central);
            c.idle.uses += 1;
            c.chunks.pop()
        };
        match cached {
            Some(chunk) => {
                self.account_take(table);
                Ok(chunk)
            }
            None => self.new_chunk(table),
        }
    }

    /// Takes one chunk from the pool, counted under `row_blocks` (and `table`) until the
    /// returned handle is dropped. Same path as a row arena's chunk: this thread's cache, a
    /// batch refill from the central list, or a new chunk under the limit check.
    ///
    /// # Errors
    /// [`MemoryError::Limit`] when a new chunk is needed and the limit would be exceeded even
    /// after trimming every cache; [`MemoryError::Injected`] from the fault-injection hook.
    pub fn acquire_chunk<'a>(&'a self, table: Option<&'a TableAccount>) -> Result<PoolChunk<'a>, MemoryError> {
        let data = self.take_chunk(table)?;
        Ok(PoolChunk { ctl: self, table, data: Some(data) })
    }

    /// Takes a chunk from this thread's cache; an empty cache is first refilled with up to
    /// `batch` chunks straight from the central list (one lock of each: central, then the
    /// slot). Returns the chunk (`None`: the central list is empty too) and whether a refill
    /// happened. The move to `row_blocks` is recorded in the slot, not the shared counters.
    fn take_local(&self, slot: &Slot) -> (Option<Chunk>, bool) {
        let size = self.pool.chunk_size as isize;
        let mut c = slot.inner.lock();
        c.idle.uses += 1;
        if let Some(chunk) = c.chunks.pop() {
            slot.record(size, true);
            return (Some(chunk), false);
        }
        drop(c);
        let want = self.pool.batch.min(self.pool.thread_cap.load(Ordering::Relaxed)).max(1);
        let mut central = lock(&self.pool.central);
        central.idle.uses += 1;
        let n = want.min(central.chunks.len());
        if n == 0 {
            return (None, false);
        }
        let at = central.chunks.len() - n;
        let mut c = slot.inner.lock();
        // The batch stays counted as free_chunks: it only moves from central to this cache.
        c.chunks.extend(central.chunks.drain(at..));
        drop(central);
        let chunk = c.chunks.pop();
        slot.record(size, true);
        (chunk, true)
    }

    /// A new chunk from the allocator: `used` grows under the limit check.
    fn new_chunk(&self, table: Option<&TableAccount>) -> Result<Chunk, MemoryError> {
        let size = self.pool.chunk_size;
        self.grow_used(Category::RowBlocks, size)?;
        self.counter_add(Category::RowBlocks, size);
        if let Some(t) = table {
            t.0.counters[Category::RowBlocks.index()].add(size);
        }
        self.pool.stats.allocated.fetch_add(1, Ordering::Relaxed);
        Ok(vec![0u8; size].into_boxed_slice())
    }

    /// Returns a chunk taken with [`Self::take_chunk`] (on any thread): into this thread's
    /// cache, else the central list, else (beyond the share of the limit) to the allocator.
    pub(crate) fn put_chunk(&self, chunk: Chunk, table: Option<&TableAccount>) {
        let size = self.pool.chunk_size;
        debug_assert_eq!(chunk.len(), size, "chunk of another pool");
        if let Some(t) = table {
            t.0.counters[Category::RowBlocks.index()].sub(size);
        }
        if self.pool.over_limit.load(Ordering::Relaxed) {
            // Above a lowered limit: give the memory back instead of caching it.
            self.counter_sub(Category::RowBlocks, size);
            drop(chunk);
            self.pool.stats.returned.fetch_add(1, Ordering::Relaxed);
            self.sub_used(size);
            self.notify_release();
            return;
        }
        let mut chunk = Some(chunk);
        let cap = self.pool.thread_cap.load(Ordering::Relaxed);
        if self.pool.thread_cache && cap > 0 {
            let flushed = self.with_local_slot(|slot| self.put_local(slot, &mut chunk, cap));
            if let Some(flushed) = flushed {
                if let Some(excess) = flushed {
                    self.pool.stats.flushes.fetch_add(1, Ordering::Relaxed);
                    let n = excess.len();
                    drop(excess);
                    self.account_returned(n);
                    self.observe_pool_peaks();
                }
                self.notify_release();
                return;
            }
        }
        if let Some(chunk) = chunk {
            self.counter_sub(Category::RowBlocks, size);
            let kept = {
                let mut c = lock(&self.pool.central);
                c.idle.uses += 1;
                if c.chunks.len() < self.pool.central_cap.load(Ordering::Relaxed) {
                    // Counted before it becomes visible to trims, which subtract it.
                    self.counters[Category::FreeChunks.index()].add_raw(size);
                    c.chunks.push(chunk);
                    None
                } else {
                    Some(chunk)
                }
            };
            match kept {
                Some(chunk) => {
                    drop(chunk);
                    self.pool.stats.returned.fetch_add(1, Ordering::Relaxed);
                    self.sub_used(size);
                }
                None => self.observe_pool_peaks(),
            }
        }
        self.notify_release();
    }

    /// Puts a released chunk into this thread's cache. A full cache first sends `batch`
    /// chunks straight to the central list (one lock of each: central, then the slot); those
    /// that do not fit under the central cap are returned (`Some(excess)`, to be freed);
    /// `None` when no flush happened. The move from `row_blocks` is recorded in the slot.
    fn put_local(&self, slot: &Slot, chunk: &mut Option<Chunk>, cap: usize) -> Option<Vec<Chunk>> {
        let size = self.pool.chunk_size as isize;
        let mut c = slot.inner.lock();
        c.idle.uses += 1;
        if c.chunks.len() < cap {
            c.chunks.extend(chunk.take());
            slot.record(-size, false);
            return None;
        }
        drop(c);
        let mut central = lock(&self.pool.central);
        central.idle.uses += 1;
        let mut c = slot.inner.lock();
        // Re-read: a trim may have emptied the cache in between.
        if c.chunks.len() < cap {
            c.chunks.extend(chunk.take());
            slot.record(-size, false);
            return None;
        }
        let n = self.pool.batch.min(c.chunks.len());
        let room = self.pool.central_cap.load(Ordering::Relaxed).saturating_sub(central.chunks.len());
        let at = c.chunks.len() - n;
        let to_central = n.min(room);
        let excess: Vec<Chunk> = c.chunks.drain(at + to_central..).collect();
        central.chunks.extend(c.chunks.drain(at..));
        drop(central);
        c.chunks.extend(chunk.take());
        slot.record(-size, false);
        Some(excess)
    }

    /// Puts chunks already counted as `free_chunks` into the central list; what does not fit
    /// under its cap goes back to the allocator.
    fn put_central(&self, mut chunks: Vec<Chunk>) {
        if chunks.is_empty() {
            return;
        }
        {
            let mut c = lock(&self.pool.central);
            c.idle.uses += 1;
            let room = self.pool.central_cap.load(Ordering::Relaxed).saturating_sub(c.chunks.len());
            let keep = room.min(chunks.len());
            let at = chunks.len() - keep;
            c.chunks.extend(chunks.drain(at..));
        }
        let n = chunks.len();
        drop(chunks);
        self.account_returned(n);
    }

    // ---- trimming ------------------------------------------------------------------------------

    /// Takes chunks out of every thread cache: `leave(cache)` says how many to leave in it.
    /// Returns the chunks taken.
    fn steal(&self, mut leave: impl FnMut(&mut CacheInner) -> usize) -> Vec<Chunk> {
        let mut taken = Vec::new();
        for s in lock(&self.pool.slots).iter() {
            let mut c = s.inner.lock();
            let k = leave(&mut c);
            if c.chunks.len() > k {
                taken.extend(c.chunks.drain(k..));
            }
        }
        taken
    }

    /// Gives chunks taken out of the caches back to the allocator; returns their bytes.
    fn release_taken(&self, taken: Vec<Chunk>) -> usize {
        let n = taken.len();
        drop(taken);
        self.account_returned(n);
        if n > 0 {
            self.notify_release();
        }
        n * self.pool.chunk_size
    }

    /// Trims every cache to its current cap (after the limit was lowered or a cache was added).
    pub(crate) fn enforce_caps(&self) {
        let thread_cap = self.pool.thread_cap.load(Ordering::Acquire);
        let mut released = self.steal(|_| thread_cap);
        {
            let cap = self.pool.central_cap.load(Ordering::Acquire);
            let mut c = lock(&self.pool.central);
            if c.chunks.len() > cap {
                released.extend(c.chunks.drain(cap..));
            }
        }
        self.release_taken(released);
    }

    /// Recomputes the caches' caps for the current limit and trims caches above them.
    pub(crate) fn limit_changed(&self) {
        let caches = lock(&self.pool.slots).len();
        self.pool.set_caps(self.limit(), caches);
        self.enforce_caps();
    }

    /// Gives cached empty chunks back to the allocator until at most `keep_bytes` remain
    /// cached, taking from the central list first and then from every thread's cache
    /// (other threads' caches included). `trim_free_chunks(0)` empties every cache: when no
    /// other thread is acquiring or releasing chunks at the same time, `free_chunks` is 0
    /// afterwards. Returns the bytes released.
    pub fn trim_free_chunks(&self, keep_bytes: usize) -> usize {
        let keep = keep_bytes / self.pool.chunk_size;
        let in_threads: usize = lock(&self.pool.slots).iter().map(|s| s.inner.lock().chunks.len()).sum();
        let mut released = Vec::new();
        let mut keep_in_threads = {
            let mut c = lock(&self.pool.central);
            // Thread caches are kept first (they are hot), then central chunks.
            let central_keep = keep.saturating_sub(in_threads).min(c.chunks.len());
            released.extend(c.chunks.drain(central_keep..));
            keep - central_keep
        };
        released.extend(self.steal(|c| {
            let k = keep_in_threads.min(c.chunks.len());
            keep_in_threads -= k;
            k
        }));
        self.release_taken(released)
    }

    /// Gives back to the allocator the cached chunks of every cache that saw no acquisition
    /// or release for at least `max_idle`: a thread's cache when that thread has not used the
    /// pool, the central list when no chunk went in or out of it. Returns the bytes released.
    ///
    /// Idleness is observed by the calls themselves (each cache's operation count is compared
    /// with the previous call's), so call it periodically, e.g. every `max_idle / 4`; a cache
    /// is trimmed between `max_idle` and `max_idle` + one period after its last use.
    /// `trim_idle(Duration::ZERO)` trims every cache.
    /// memctl starts no thread for it: the engine calls it from its background work.
    pub fn trim_idle(&self, max_idle: Duration) -> usize {
        let now = Instant::now();
        let mut released = self.steal(|c| if c.idle.idle_for(now, max_idle) { 0 } else { c.chunks.len() });
        {
            let mut c = lock(&self.pool.central);
            if c.idle.idle_for(now, max_idle) {
                released.append(&mut c.chunks);
            }
        }
        let n = released.len();
        if n > 0 {
            tracing::debug!(chunks = n, "idle chunk caches trimmed");
        }
        self.release_taken(released)
    }

    /// Figures of the chunk pool: caches, caps, batch refills and flushes.
    pub fn pool_stats(&self) -> PoolStats {
        let (caches, in_threads) = {
            let slots = lock(&self.pool.slots);
            (slots.len(), slots.iter().map(|s| s.inner.lock().chunks.len()).sum())
        };
        PoolStats {
            thread_cache: self.pool.thread_cache,
            thread_caches: caches,
            thread_cached_chunks: in_threads,
            central_chunks: lock(&self.pool.central).chunks.len(),
            thread_cap: self.pool.thread_cap.load(Ordering::Acquire),
            central_cap: self.pool.central_cap.load(Ordering::Acquire),
            refills: self.pool.stats.refills.load(Ordering::Relaxed),
            flushes: self.pool.stats.flushes.load(Ordering::Relaxed),
            allocated_chunks: self.pool.stats.allocated.load(Ordering::Relaxed),
            returned_chunks: self.pool.stats.returned.load(Ordering::Relaxed),
        }
    }
}
