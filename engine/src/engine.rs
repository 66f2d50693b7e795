use crate::config::EngineConfig;
use crate::data_dir::DATA_DIR_MARKER;
use crate::error::{Error, Result, io};
use crate::table::{Table, TableInner, lock};
use crate::writer::Writer;
use arrow_schema::SchemaRef;
use gritdb_memctl::{Category, ControllerConfig, MemoryController, MemoryReport, TableAccount};
use gritdb_storage::{TableStore, WAL_DIR, Wal, WalOp, WalRecord, WalSync};
use gritdb_unify::RowCodec;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Cached free chunks unused for this long are given back to the allocator.
const IDLE_CHUNK_TRIM: Duration = Duration::from_secs(10);

/// The default data directory of [`Engine::open_default`].
pub const DEFAULT_DATA_DIR: &str = "./gritdb-data";

pub(crate) struct Shared {
    pub(crate) ctl: Arc<MemoryController>,
    pub(crate) config: EngineConfig,
    wal: OnceLock<Wal>,
    /// Table id -> highest sequence number in committed files (absent: dropped).
    flushed: Mutex<HashMap<u64, u64>>,
    /// Set when the engine is closed or dropped: background work stops at its next step.
    pub(crate) closed: AtomicBool,
    /// While a lower limit is being reached (`set_memory_limit`), writes already respect it
    /// (0: none pending) and flushes may still use the old limit.
    pub(crate) write_target: std::sync::atomic::AtomicUsize,
    /// How many `set_memory_limit` calls have taken effect or begun a lowering; held while a
    /// call applies its limit, so the last call wins (a lowering still waiting when a later
    /// call comes is superseded and applies nothing).
    limit_calls: Mutex<u64>,
    /// Write-ahead-log segment files the log has forgotten and that are still to be removed
    /// (see [`Shared::note_flushed`]).
    wal_cleanup: WalCleanup,
    wal_pool: Option<tokio::runtime::Handle>,
    /// Bytes of the writes between their admission check and the end of their apply, all
    /// tables together ([`Self::admit`]).
    admitting: std::sync::atomic::AtomicUsize,
    /// Data files being written by flushes and compactions ([`Self::file_write`]), and how
    /// many of those writers wait for memory in [`Self::memory_wait`].
    file_writes: std::sync::atomic::AtomicUsize,
    file_writes_waiting: std::sync::atomic::AtomicUsize,
    /// Writes waiting for memory, in the order they began to wait ([`Self::queue`]).
    queue: Mutex<WriteQueue>,
    /// Peak bytes of every write in [`Self::queue`], read without its lock by writes that are
    /// not waiting.
    queued_bytes: std::sync::atomic::AtomicUsize,
}

/// Writes waiting for memory, oldest first: their tickets and peak bytes.
#[derive(Default)]
struct WriteQueue {
    next_ticket: u64,
    waiting: Vec<(u64, usize)>,
}

/// [`Shared::flush_room_certain`] with `pressure` bytes in use under `limit`.
fn flush_room_certain_at(pressure: usize, limit: usize, bytes: usize) -> bool {
    3usize.saturating_mul(pressure.saturating_add(bytes)) <= limit
}

/// [`Shared::flush_room_short`] with `pressure` bytes in use under `limit` (0 for
/// [`Shared::never_fits`]: an engine holding nothing).
fn flush_room_short_at(pressure: usize, limit: usize, bytes: usize, convert: usize, active: usize, largest_sealed: usize) -> Option<usize> {
    if flush_room_certain_at(pressure, limit, bytes) {
        return None;
    }
    let need = bytes.saturating_add(active.saturating_add(convert).max(largest_sealed));
    (pressure.saturating_add(need) > limit).then_some(need)
}

/// A data-file write's place among [`Shared::file_writes`], for its duration.
pub(crate) struct FileWrite<'a>(&'a Shared);

impl Drop for FileWrite<'_> {
    fn drop(&mut self) {
        self.0.file_writes.fetch_sub(1, Ordering::AcqRel);
        // A flush waiting in `memory_wait` may now have nothing left to wait for.
        self.0.ctl.wake_waiters();
    }
}

/// A write's place in the queue of writes waiting for memory ([`Shared::queue`]).
pub(crate) struct QueuePlace<'a> {
    shared: &'a Shared,
    ticket: u64,
    bytes: usize,
}

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        let mut q = lock(&self.shared.queue);
        q.waiting.retain(|(t, _)| *t != self.ticket);
        drop(q);
        self.shared.queued_bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        // The writes behind may fit now.
        self.shared.ctl.wake_waiters();
    }
}

/// The longest a flush's Parquet writer waits for memory at one step before it counts the
/// step past the limit ([`Shared::memory_wait`]): 1 s. The holders it waits for (a write
/// between its admission and the end of its apply, another data-file write) give memory back
/// within milliseconds unless a disk stalls.
const FLUSH_MEMORY_WAIT: Duration = Duration::from_secs(1);

/// A write's place among the writes being admitted ([`Shared::admit`]): its bytes count for
/// every write admitted after it until this is dropped, which wakes the writes waiting for
/// memory (their check may have failed on these bytes alone).
pub(crate) struct Admission<'a> {
    shared: &'a Shared,
    bytes: usize,
    /// Bytes of the writes admitted before this one and still applying when it was taken.
    pub(crate) others: usize,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.shared.admitting.fetch_sub(self.bytes, Ordering::AcqRel);
        // One atomic load when nobody waits.
        self.shared.ctl.wake_waiters();
    }
}

/// Removal of covered WAL segment files off the flushing thread: queued by
/// [`Shared::note_flushed`], done by one blocking task on the writer's runtime at a time, and
/// drained by [`EngineInner::shutdown`] (which waits for a running removal), so no removal of
/// this engine runs after it closes.
struct WalCleanup {
    pending: Mutex<Vec<PathBuf>>,
    /// Held while files are removed.
    running: Mutex<()>,
    /// A removal task is queued and has not started draining.
    queued: AtomicBool,
    runtime: Option<tokio::runtime::Handle>,
}

impl Shared {
    pub(crate) fn wal(&self) -> Result<&Wal> {
        self.wal.get().ok_or_else(|| Error::Closed("the write-ahead log (engine still opening)".into()))
    }

    /// The WAL record pool ([`crate::writer::Writer::wal_pool`]), for the records of big puts
    /// (`Table::write`).
    pub(crate) fn wal_pool(&self) -> Option<&tokio::runtime::Handle> {
        self.wal_pool.as_ref()
    }

    /// Records that `table`'s committed files cover writes up to `seq` (`None`: the table was
    /// dropped), then drops the WAL segments no table needs any more ([`Self::truncate_wal`]),
    /// their files removed by a background task when `defer` — a flush does not wait for the
    /// unlinks (45–55 ms per 600k-row flush here).
    pub(crate) fn note_flushed(self: &Arc<Self>, table: u64, seq: Option<u64>, defer: bool) {
        {
            let mut f = lock(&self.flushed);
            match seq {
                Some(s) => {
                    f.insert(table, s);
                }
                None => {
                    f.remove(&table);
                }
            }
        }
        self.truncate_wal(defer);
    }

    /// Forgets every WAL segment whose records all tables have committed (or whose tables
    /// were dropped) — [`Engine::wal_usage`] no longer counts it — and removes its file: on the
    /// writer's runtime when `defer`, else on this thread before returning (after any removal
    /// already running). Called after each commit (deferred), and in place by `drop_table`,
    /// at the end of `Engine::open` (segments a commit before a crash covered) and by
    /// `Engine::close` after its last sync (the active segment is kept while unsynced).
    pub(crate) fn truncate_wal(self: &Arc<Self>, defer: bool) {
        let Some(wal) = self.wal.get() else { return };
        let gone = {
            let f = lock(&self.flushed);
            wal.forget_covered(|t, q| f.get(&t).is_none_or(|done| *done >= q))
        };
        if !gone.is_empty() {
            tracing::debug!(segments = gone.len(), "write-ahead log segments covered; removing");
            lock(&self.wal_cleanup.pending).extend(gone);
        }
        if !defer {
            self.remove_covered_segments();
            return;
        }
        if lock(&self.wal_cleanup.pending).is_empty() {
            return;
        }
        let spawned = self.wal_cleanup.runtime.as_ref().is_some_and(|rt| {
            if self.wal_cleanup.queued.swap(true, Ordering::AcqRel) {
                return true; // the queued task will take these too
            }
            let weak = Arc::downgrade(self);
            // A runtime already shut down drops the task unrun: `EngineInner::shutdown`
            // removes what is pending.
            crate::writer::spawn_blocking_on(rt, move || {
                if let Some(shared) = weak.upgrade() {
                    shared.remove_covered_segments();
                }
            });
            true
        });
        if !spawned {
            self.remove_covered_segments();
        }
    }

    /// Removes the pending covered WAL segment files (see [`Self::note_flushed`]); waits for a
    /// removal already running.
    pub(crate) fn remove_covered_segments(&self) {
        let _running = lock(&self.wal_cleanup.running);
        self.wal_cleanup.queued.store(false, Ordering::Release);
        loop {
            let files = std::mem::take(&mut *lock(&self.wal_cleanup.pending));
            if files.is_empty() {
                return;
            }
            if let Some(wal) = self.wal.get() {
                wal.remove_segments(&files);
            }
        }
    }

    /// Per-table flush threshold in bytes: configured (default limit / 16, 1 MiB..=64 MiB),
    /// never more than limit / 8 — a flush needs about its delta's size again for the Arrow
    /// batches it builds, and that must fit in the flush headroom.
    pub(crate) fn table_flush_bytes(&self) -> usize {
        self.flush_bytes_under(self.ctl.limit())
    }

    /// [`Self::table_flush_bytes`] under the limit a lowering is heading for
    /// ([`Engine::set_memory_limit`]'s write target; the limit when none). Flushes cut their
    /// row groups by it, so the files written while the limit comes down are files the new
    /// limit can read: a reader holds a page and a dictionary per column, up to about the
    /// column's share of a row group (`docs/memory.md`, "Scans").
    pub(crate) fn target_flush_bytes(&self) -> usize {
        self.flush_bytes_under(self.target_limit())
    }

    /// The limit writes are held to: the limit, or the lower value a lowering in progress
    /// heads for ([`Engine::set_memory_limit`]'s write target).
    pub(crate) fn target_limit(&self) -> usize {
        let target = self.write_target.load(Ordering::Acquire);
        if target == 0 { self.ctl.limit() } else { target.min(self.ctl.limit()) }
    }

    fn flush_bytes_under(&self, limit: usize) -> usize {
        let wanted = self.config.table_flush_bytes.unwrap_or_else(|| (limit / 16).clamp(1 << 20, 64 << 20));
        wanted.min(limit / 8).max(self.ctl.chunk_size())
    }

    /// Memory kept free of new writes so flushes (batch blocks, index growth) can always run:
    /// a quarter of the limit, and at least two flush thresholds (two writer threads may flush
    /// at once). Writes wait (backpressure) while the memory in use, cached free chunks not
    /// counted, is above `min(limit, write target) - flush_headroom` and the writer has work.
    pub(crate) fn flush_headroom(&self) -> usize {
        self.headroom_under(self.ctl.limit())
    }

    /// [`Self::flush_headroom`] under a limit of `limit` bytes.
    fn headroom_under(&self, limit: usize) -> usize {
        (limit / 4).max(2 * self.flush_bytes_under(limit)).min(limit / 2)
    }

    /// Whether a limit of `limit` bytes leaves writes room beside the memory no flush gives
    /// back: `fixed` bytes (the key index of the tables' files) plus one chunk must fit under the write soft limit that value would have (`limit` less its
    /// [`Self::flush_headroom`]). Returns the bytes short when it does not.
    ///
    /// Below that every write would be refused or would wait for a flush that cannot free
    /// anything: a lowering to the key index + 64 KiB was accepted and then refused 20 of 20
    /// one-row upserts; at + 256 KiB each upsert took 110-175 ms instead of 4 (helper-42,
    /// 2026-12-07).
    pub(crate) fn limit_floor_short(&self, limit: usize, fixed: usize) -> Option<usize> {
        let soft = limit.saturating_sub(self.headroom_under(limit));
        let need = fixed.saturating_add(self.ctl.chunk_size());
        (need > soft).then(|| need - soft)
    }

    /// Accounted bytes that flushing can matter for: `used` without cached free chunks
    /// (those are given back on demand and are no reason to flush).
    pub(crate) fn pressure_bytes(&self) -> usize {
        self.ctl.used().saturating_sub(self.ctl.category_bytes(Category::FreeChunks))
    }

    /// Whether scans hold memory now (`scan_buffers`: their readers, and the batches they
    /// handed out that callers still hold), which comes back when they let go: a write or a
    /// flush refused memory waits for it (up to `backpressure_timeout`) rather than failing
    /// at once. A caller holding batches itself while it writes waits out the timeout.
    pub(crate) fn scans_hold(&self) -> bool {
        self.ctl.category_bytes(Category::ScanBuffers) > 0
    }

    /// Bytes free under the limit, the pool's cached free chunks counted as free (they are
    /// given back on demand): `limit − pressure_bytes()`. What a scan waits for and sizes its
    /// reader's decoding by; `limit − used` made a scan wait out its whole
    /// `backpressure_timeout` for the very chunks a flush had just freed (helper-47's F1).
    pub(crate) fn free_bytes(&self) -> usize {
        self.ctl.limit().saturating_sub(self.pressure_bytes())
    }

    /// Bytes a write of `bytes` Arrow bytes in `rows` rows, whose encoded keys
    /// (`arrow-row`) take `key_bytes`, adds to a delta, estimated for
    /// [`Self::flush_room_short`]: the Arrow bytes plus [`DELTA_ROW_OVERHEAD`] a row plus
    /// [`wide_key_bytes`]. A row holds its key twice, as a column value and as the encoded
    /// key its row header keeps for lookups (a one-row insert with a 150,000-byte key took
    /// 297.6 KiB of `row_blocks`: `big_keys`).
    pub(crate) fn delta_growth(bytes: usize, rows: usize, key_bytes: usize) -> usize {
        bytes.saturating_add(rows.saturating_mul(DELTA_ROW_OVERHEAD)).saturating_add(wide_key_bytes(key_bytes, rows))
    }

    /// Bytes flushing a write of `bytes` Arrow bytes in `rows` rows, whose encoded keys take
    /// `key_bytes`, needs beside its delta, estimated for [`Self::flush_room_short`] (its
    /// `convert`): the Arrow bytes of its batches plus the key-index growth,
    /// [`FLUSH_ROW_OVERHEAD`] a row plus [`wide_key_bytes`] (a file's key index keeps a
    /// variable-width key as encoded: `gritdb_storage::KeyIndex`), plus [`wide_key_bytes`]
    /// again for the batch of encoded keys the set is built from
    /// (`gritdb_storage::PutKeyEncoder::encode`).
    pub(crate) fn flush_need(bytes: usize, rows: usize, key_bytes: usize) -> usize {
        let wide = wide_key_bytes(key_bytes, rows);
        bytes.saturating_add(rows.saturating_mul(FLUSH_ROW_OVERHEAD)).saturating_add(wide.saturating_mul(2))
    }

    /// What flushing delta `d` needs at most beside it, for [`Self::flush_room_short`]: its
    /// bytes (they bound its batches, key-index growth at [`FLUSH_ROW_OVERHEAD`] a key
    /// included) plus [`wide_key_bytes`] of its keys (the wider keys' place in the set and
    /// in the batch of encoded keys it is built from, beyond the key each row holds: at most
    /// twice its bytes, which [`Self::flush_room_certain`] assumes).
    pub(crate) fn delta_flush_need(d: &gritdb_unify::DeltaStore) -> usize {
        d.bytes().saturating_add(wide_key_bytes(d.key_bytes(), d.len()))
    }

    /// Whether a write adding `bytes` to a delta ([`Self::delta_growth`]) is admitted by
    /// [`Self::flush_room_short`] whatever the deltas' sizes: `3 × (pressure + bytes) ≤
    /// limit`, because the delta a flush must convert is never larger than the memory in use
    /// after the write, and converting it needs at most twice its bytes
    /// ([`Self::delta_flush_need`]; the write's own `convert` is at most twice its growth).
    /// Before wide keys were counted it was `2 ×`: a delta's conversion was taken to need
    /// its bytes at most.
    pub(crate) fn flush_room_certain(&self, bytes: usize) -> bool {
        flush_room_certain_at(self.pressure_bytes(), self.ctl.limit(), bytes)
    }

    /// Whether a write adding `bytes` to a delta ([`Self::delta_growth`]) of a table whose
    /// active delta holds `active` bytes would leave too little memory to flush: after it, the
    /// free memory must still hold the batch blocks and key-index growth of the largest delta
    /// waiting for a flush (at most its bytes again: the flush holds a delta's rows and their
    /// Arrow batches at once), the larger of `largest_sealed` and `active + bytes`. `pressure + bytes + that > limit`
    /// means short. The caller adds to `bytes` the writes being admitted to other tables
    /// ([`Self::admit`]), so deltas of other tables that are about to grow count too.
    ///
    /// `convert` is what flushing this write's rows needs beside its delta
    /// ([`Self::flush_need`]: their Arrow bytes plus their key-index growth; a sealed delta's
    /// own bytes bound its conversion from above).
    ///
    /// Returns `Some(bytes + that)` when short: what the write must find free, for itself and
    /// to flush what it leaves (the `requested` of its `MemoryLimit` refusal, so that `used +
    /// requested > limit` in the message, as in any other refusal).
    pub(crate) fn flush_room_short(&self, bytes: usize, convert: usize, active: usize, largest_sealed: usize) -> Option<usize> {
        flush_room_short_at(self.pressure_bytes(), self.ctl.limit(), bytes, convert, active, largest_sealed)
    }

    /// Whether a write adding `bytes` to a delta ([`Self::delta_growth`]), whose rows need
    /// `convert` bytes to flush, would be refused by [`Self::flush_room_short`] even in an
    /// engine holding nothing (no other write admitted, no delta, nothing in use): when both
    /// `2 × bytes` and `bytes + convert` are more than the limit. Returns
    /// `Some(bytes + convert)`, the `requested` of its refusal. No flush can make room for
    /// such a write, so it is refused at once instead of waiting out `backpressure_timeout`
    /// while other writers keep the engine busy (a 5 MiB row at a 4 MiB limit beside two busy
    /// writers waited the whole 30 s; idle, it was refused at once: trial of 2026-12-06,
    /// `probe30_g`).
    pub(crate) fn never_fits(&self, bytes: usize, convert: usize) -> Option<usize> {
        flush_room_short_at(0, self.ctl.limit(), bytes, convert, 0, 0)
    }

    /// Takes a write's place among the writes being admitted, for `bytes`: what it will hold
    /// at its peak (its delta growth and its WAL record). The admission checks of
    /// `Table::with_backpressure` count [`Admission::others`] as memory in use, so writes to
    /// different tables that check at once no longer each see the memory free that the others
    /// are about to take. Before, each of N such writes could pass the soft limit by its own
    /// size, N writes together, and at a small limit that spent the flush headroom: 12 writers
    /// of 0.35 MiB batches on 12 tables at 8 MiB left 6.7 MiB of sealed deltas and 0.8 MiB of
    /// key maps, and no flush could get the 64 KiB its Parquet writer asked for (the engine
    /// stayed full until its limit was raised; `breaker_walpool7`, relaxed mode with its WAL
    /// records on the pool). The other writes are counted twice while they allocate (their
    /// rows are in use before their admission ends), which only makes a check stricter for
    /// those few milliseconds.
    pub(crate) fn admit(&self, bytes: usize) -> Admission<'_> {
        let others = self.admitting.fetch_add(bytes, Ordering::AcqRel);
        Admission { shared: self, bytes, others }
    }

    /// Takes a place, after every write already there, in the queue of writes waiting for
    /// memory, for a write whose peak is `bytes` (see [`Self::queued_ahead`]). The place is
    /// kept until the write returns, however often it waits; dropping it wakes the writes
    /// behind.
    pub(crate) fn queue(&self, bytes: usize) -> QueuePlace<'_> {
        let mut q = lock(&self.queue);
        let ticket = q.next_ticket;
        q.next_ticket += 1;
        q.waiting.push((ticket, bytes));
        self.queued_bytes.fetch_add(bytes, Ordering::AcqRel);
        QueuePlace { shared: self, ticket, bytes }
    }

    /// Peak bytes of the writes waiting for memory ahead of a write at `place`, or of all of
    /// them for a write that is not waiting. The soft-limit check counts them as memory in
    /// use, so the writes are admitted first come, first served: a write arriving while a
    /// bigger one waits no longer takes the memory a flush just freed before it (a 1.6 MB
    /// insert beside three writers of 100 KB batches at 8 MiB waited out its whole 20 s
    /// `backpressure_timeout`, five times of five;
    /// `fair_admission::a_big_write_beside_busy_small_writers_is_admitted_in_its_turn`).
    /// One atomic load when nobody waits.
    pub(crate) fn queued_ahead(&self, place: Option<&QueuePlace<'_>>) -> usize {
        let Some(place) = place else { return self.queued_bytes.load(Ordering::Acquire) };
        lock(&self.queue).waiting.iter().take_while(|(t, _)| *t < place.ticket).map(|(_, b)| b).sum()
    }

    /// Counts a data-file write (a flush's or a compaction's) until the guard drops.
    pub(crate) fn file_write(&self) -> FileWrite<'_> {
        self.file_writes.fetch_add(1, Ordering::AcqRel);
        FileWrite(self)
    }

    /// How a flush's Parquet writer waits for memory before it counts a step past the limit
    /// (`gritdb_storage::WriteOptions::memory_wait`): while a write is between its admission
    /// and the end of its apply ([`Self::admit`]; its WAL record is freed when written), or
    /// another data-file write is running and not itself waiting here (it ends, or fails, and
    /// gives its buffers and batches back), for at most [`FLUSH_MEMORY_WAIT`] a step; woken by
    /// every release. When every other writer waits too, or nothing else holds memory that
    /// will come back, it does not wait: a flush must finish to free memory, and the step
    /// then goes on past the limit as before. Two flushes whose conversions filled a 2 MiB
    /// engine beside the writes of three tables counted their steps up to 55 KB past it
    /// (`peak_limit::concurrent_writers_of_big_rows_stay_under_small_limits`).
    pub(crate) fn memory_wait(self: &Arc<Self>) -> gritdb_storage::MemoryWait {
        let shared = Arc::downgrade(self);
        gritdb_storage::MemoryWait::new(move |waited| {
            let Some(s) = shared.upgrade() else { return false };
            if waited >= FLUSH_MEMORY_WAIT {
                return false;
            }
            // This writer is one of the running and one of the waiting.
            let waiting = s.file_writes_waiting.fetch_add(1, Ordering::AcqRel) + 1;
            let others = s.file_writes.load(Ordering::Acquire).saturating_sub(waiting) > 0 || s.admitting() > 0;
            if others {
                s.ctl.wait_for_release(FLUSH_MEMORY_WAIT.saturating_sub(waited).min(Duration::from_millis(20)));
            }
            s.file_writes_waiting.fetch_sub(1, Ordering::AcqRel);
            others
        })
    }

    /// How an export's Parquet writer (of `table`) waits for memory
    /// (`gritdb_storage::WriteOptions::memory_wait`) before its smallest step goes bare and
    /// before it budgets a closed row group's metadata: while other tables' scans hold
    /// batches or readers ([`Category::ScanBuffers`] beyond `table`'s own), a write is
    /// between its admission and the end of its apply, or a data-file write runs that is not
    /// itself waiting — memory that comes back — for at most `backpressure_timeout` a step,
    /// woken by every release; never once the engine is closed. With no such holder (the
    /// export's own scan and batches are `table`'s) the writer's refusal is returned at once
    /// (the export's scan waits for memory as any scan does, `Scan::waiting_for_memory`,
    /// and stops waiting once the engine is closed). Before,
    /// an export at 2 MiB beside 1.6 MB of another table's held batches was refused at once
    /// ("requested 2.0 KiB for `write_buffers`", helper-48), though they were let go of soon
    /// after (`scan_memory::an_export_beside_another_tables_held_batches_waits_for_them`).
    pub(crate) fn export_memory_wait(self: &Arc<Self>, table: &TableAccount) -> gritdb_storage::MemoryWait {
        let (shared, table) = (Arc::downgrade(self), table.clone());
        gritdb_storage::MemoryWait::new(move |waited| {
            let Some(s) = shared.upgrade() else { return false };
            let timeout = s.config.backpressure_timeout;
            if waited >= timeout || s.closed.load(Ordering::Acquire) {
                return false;
            }
            let others = s.ctl.category_bytes(Category::ScanBuffers) > table.bytes(Category::ScanBuffers)
                || s.admitting() > 0
                || s.file_writes.load(Ordering::Acquire) > s.file_writes_waiting.load(Ordering::Acquire);
            if others {
                s.ctl.wait_for_release(timeout.saturating_sub(waited).min(Duration::from_millis(20)));
            }
            others
        })
    }

    /// Bytes of the writes being admitted now ([`Self::admit`]).
    pub(crate) fn admitting(&self) -> usize {
        self.admitting.load(Ordering::Acquire)
    }

    /// The soft limit writes respect (see [`Self::flush_headroom`]).
    pub(crate) fn write_soft_limit(&self) -> usize {
        self.target_limit().saturating_sub(self.flush_headroom())
    }
}

/// Bytes a delta holds per row beyond the row's Arrow bytes, for the write admission rule
/// ([`Shared::delta_growth`]): the row's header in its row block and its key-map slot.
/// Measured by a new-user trial at 16 MiB: 60,000 rows of 112 Arrow bytes held 136 B a row in
/// `row_blocks` and 28 B a row of key map (+52 B); with Arrow bytes alone the rule admitted a
/// 6.4 MiB batch whose flush then could not get its batch and key-index memory.
pub(crate) const DELTA_ROW_OVERHEAD: usize = 64;

/// Key-index bytes a flushed row adds, for the write admission rule's conversion estimate
/// (the trial above: its flush asked 542 KiB of key index for 60,000 keys, 9 B a key).
/// Encoded keys longer than this on average add the rest ([`wide_key_bytes`]).
pub(crate) const FLUSH_ROW_OVERHEAD: usize = 16;

/// Bytes of `rows` encoded keys totalling `key_bytes` beyond [`FLUSH_ROW_OVERHEAD`] a row:
/// what [`DELTA_ROW_OVERHEAD`] and [`FLUSH_ROW_OVERHEAD`], measured on 9-byte `Int64` keys,
/// leave out for wider keys. A delta's row header and a file's key index each hold a key as
/// encoded, so with these left out one-row inserts of 30–200 KB `Binary` keys at 1 MiB were
/// all admitted and then no flush, scan or `close` could get the memory for them (42 of 200
/// runs of `big_keys::wide_keys_admitted_at_a_small_limit_stay_flushable_and_scannable`;
/// helper-52's F1).
pub(crate) fn wide_key_bytes(key_bytes: usize, rows: usize) -> usize {
    key_bytes.saturating_sub(rows.saturating_mul(FLUSH_ROW_OVERHEAD))
}

pub(crate) struct EngineInner {
    pub(crate) dir: PathBuf,
    pub(crate) shared: Arc<Shared>,
    tables: RwLock<BTreeMap<String, Arc<TableInner>>>,
    pub(crate) writer: Writer,
    next_table_id: AtomicU64,
    closed: AtomicBool,
    /// Set by [`Engine::close`] before its last flush: no write is admitted any more and a
    /// write waiting for memory gives up with [`Error::Closed`], so writers that never stop
    /// cannot keep that flush going, nor take the memory it needs. Scans and DDL still run
    /// until `closed`.
    closing: AtomicBool,
    /// Held shared by every write (insert, upsert, update, delete) from its open check to its
    /// return ([`Self::begin_write`]); [`Self::shutdown`] takes it exclusively after setting
    /// `closed`, so every write this engine acknowledges has appended to its WAL before the
    /// directory lock is released (a write still running then would append to a log the next
    /// open had already replayed, and be lost).
    write_gate: RwLock<()>,
    /// The exclusive lock on `<dir>/LOCK`, released by [`EngineInner::shutdown`].
    lock_file: Mutex<Option<DirLock>>,
    /// SQL sessions and their runtime, built at the first query (`sql` feature).
    #[cfg(feature = "sql")]
    pub(crate) sql: crate::sql::SqlSlot,
}

impl EngineInner {
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed("the engine".into()));
        }
        Ok(())
    }

    /// [`Self::check_open`] for writes: also refused once [`Engine::close`] has begun.
    ///
    /// # Errors
    /// [`Error::Closed`] once the engine is closing or closed.
    pub(crate) fn check_writable(&self) -> Result<()> {
        if self.closing.load(Ordering::Acquire) {
            return Err(Error::Closed("the engine".into()));
        }
        self.check_open()
    }

    /// Admits one write: the guard, held until the write returns, makes
    /// [`Self::shutdown`] and [`Engine::close`] wait for it.
    ///
    /// # Errors
    /// [`Error::Closed`] once the engine is closing.
    pub(crate) fn begin_write(&self) -> Result<RwLockReadGuard<'_, ()>> {
        // Only `shutdown` takes the gate exclusively, after setting `closed`: a gate that is
        // not free for a reader means the engine is closing. (A blocking `read` would queue
        // behind shutdown, which may wait on a write stuck on a stalled disk: a breaker test.)
        let gate = match self.write_gate.try_read() {
            Ok(gate) => gate,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(Error::Closed("the engine".into())),
        };
        self.check_writable()?;
        Ok(gate)
    }

    fn tables_read(&self) -> RwLockReadGuard<'_, BTreeMap<String, Arc<TableInner>>> {
        self.tables.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn tables_write(&self) -> RwLockWriteGuard<'_, BTreeMap<String, Arc<TableInner>>> {
        self.tables.write().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn all_tables(&self) -> Vec<Arc<TableInner>> {
        self.tables_read().values().cloned().collect()
    }

    /// Names of all tables, sorted.
    pub(crate) fn table_names(&self) -> Vec<String> {
        self.tables_read().keys().cloned().collect()
    }

    /// The table named exactly `name`, else the one whose name equals it ignoring case
    /// (names are unique ignoring case, so there is at most one).
    pub(crate) fn lookup(&self, name: &str) -> Option<Arc<TableInner>> {
        let tables = self.tables_read();
        resolve_name(&tables, name).and_then(|k| tables.get(&k)).cloned()
    }

    /// Seals the largest active deltas across all tables and queues their flush. With
    /// `urgent` (a write just failed for memory) it seals until a quarter of the limit is
    /// queued; otherwise only when `used` passes 7/8 of the limit (`RocksDB`'s
    /// `WriteBufferManager` flush point), until 3/4 would remain. Returns `true` when the
    /// writer has work that will free memory.
    pub(crate) fn relieve_pressure(&self, urgent: bool) -> bool {
        let ctl = &self.shared.ctl;
        let (used, limit) = (self.shared.pressure_bytes(), ctl.limit());
        if !urgent && used <= limit / 8 * 7 {
            return true;
        }
        let target = if urgent { limit / 4 } else { used.saturating_sub(limit / 4 * 3) };
        let mut by_size: Vec<(usize, Arc<TableInner>)> = self.all_tables().into_iter().map(|t| (t.active_bytes(), t)).collect();
        by_size.sort_by_key(|b| std::cmp::Reverse(b.0));
        let mut queued = 0usize;
        let mut busy = false;
        for (bytes, t) in by_size {
            let mut g = lock(&t.state);
            let Some(st) = g.as_mut() else { continue };
            let waiting = !st.sealed.is_empty() || st.store.staged_count() > 0;
            let sealed_now = queued < target && bytes > 0 && t.seal(st);
            drop(g);
            if sealed_now {
                queued += bytes;
            }
            if sealed_now || waiting {
                busy = true;
                self.writer.schedule(&t);
            }
        }
        if urgent && queued > 0 {
            tracing::info!(queued, used, limit, "memory pressure: sealed the largest deltas");
        }
        busy || self.writer.in_flight() > 0
    }

    /// Whether a scan counting `bytes` more would leave too little memory to flush the
    /// largest delta, active or sealed, of any table: `pressure + bytes + that > limit`, the
    /// bound of the write admission rule ([`Shared::flush_room_short`]: a flush holds a
    /// delta's rows and their Arrow batches at once). `false` without deltas, and at once
    /// when `3 × (pressure + bytes) ≤ limit` ([`Shared::flush_room_certain`]), so the tables
    /// are only visited when memory is more than a third used.
    pub(crate) fn scan_flush_room_short(&self, bytes: usize) -> bool {
        let shared = &self.shared;
        if shared.flush_room_certain(bytes) {
            return false;
        }
        let active = self.all_tables().iter().map(|t| t.active_flush_need()).max().unwrap_or(0);
        let largest = active.max(self.largest_sealed_delta());
        largest > 0 && shared.pressure_bytes().saturating_add(bytes).saturating_add(largest) > shared.ctl.limit()
    }

    /// What flushing the largest sealed delta of any table needs ([`Shared::delta_flush_need`];
    /// see [`Shared::flush_room_short`]).
    pub(crate) fn largest_sealed_delta(&self) -> usize {
        self.tables_read().values().map(|t| t.largest_sealed.load(Ordering::Acquire)).max().unwrap_or(0)
    }

    /// Memory no flush gives back, for [`Engine::set_memory_limit`]: the key index of the
    /// tables' files, in bytes (part of the `key_index` category, which also holds the
    /// deltas' key maps, which a flush turns into file index, and the key sets flushes and
    /// compactions are building).
    pub(crate) fn file_index_bytes(&self) -> usize {
        self.all_tables().iter().map(|t| lock(&t.state).as_ref().map_or(0, |st| st.store.index().bytes())).sum()
    }

    /// [`Self::file_index_bytes`] less the key sets of files with no live row, which the
    /// compaction after the next flush drops: the key index that stays, for the checks that
    /// refuse a row for good (`Table::check_value_sizes`). With them counted, upserts of one
    /// 100 KB key at 1 MiB were refused as `ValueTooLarge` while three dead files of that key
    /// waited for the compaction at the end of a long background flush (`big_keys`).
    pub(crate) fn live_file_index_bytes(&self) -> usize {
        self.all_tables().iter().map(|t| lock(&t.state).as_ref().map_or(0, |st| st.store.live_index_bytes())).sum()
    }

    /// Bytes of sealed deltas not yet turned into flush batches (what flushing them will
    /// need again, about, in `batch_blocks`).
    pub(crate) fn sealed_bytes(&self) -> usize {
        self.all_tables().iter().map(|t| lock(&t.state).as_ref().map_or(0, |st| st.sealed.iter().map(|d| d.bytes()).sum::<usize>())).sum()
    }

    /// Seals and queues every active delta whose first row is older than `age`.
    pub(crate) fn flush_aged(&self, age: Duration) {
        for t in self.all_tables() {
            let mut g = lock(&t.state);
            let Some(st) = g.as_mut() else { continue };
            if st.active_since.is_some_and(|since| since.elapsed() >= age) && t.seal(st) {
                drop(g);
                tracing::debug!(table = %t.name, "age flush");
                self.writer.schedule(&t);
            }
        }
    }

    /// Waits (at most until `deadline`, in steps of 100 ms) for the writer to free memory.
    /// Returns `false` when the deadline passed or nothing is being flushed.
    pub(crate) fn wait_for_memory(&self, deadline: Instant) -> bool {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        self.shared.ctl.wait_for_release((deadline - now).min(Duration::from_millis(100)));
        true
    }
}

/// The moment `timeout` from now; a timeout past what `Instant` can hold (such as
/// `Duration::MAX`, "wait without end") gives a moment about 136 years away instead of
/// panicking on the overflow (`breaker_trial4`).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).or_else(|| now.checked_add(Duration::from_secs(u64::from(u32::MAX)))).unwrap_or(now)
}

/// Most threads any of [`EngineConfig`]'s thread counts may ask for (`writer_threads`,
/// `flush_threads`, `background_flush_threads`). A larger value is a configuration error at
/// open: tokio's semaphore panics past 2^61 permits, and thousands of threads on any machine
/// are a mistake, not a setting.
pub const MAX_THREADS: usize = 1024;

impl EngineInner {
    /// Stops the engine: no new operation starts, writes already admitted finish, background
    /// flushes stop at their next step
    /// and are waited for (at most 10 s: a write stuck in the kernel cannot be interrupted),
    /// the writer runtime is shut down and the directory lock released. Idempotent.
    fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        self.shared.closed.store(true, Ordering::Release);
        // Writes already admitted finish (a write waiting for memory gives up at once with
        // `Closed`; one stuck in a WAL fsync on a stalled disk holds this, by design: its
        // caller is owed an answer that the next open agrees with).
        drop(self.write_gate.write().unwrap_or_else(PoisonError::into_inner));
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.writer.in_flight() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.writer.shutdown();
        #[cfg(feature = "sql")]
        self.sql.shutdown();
        // No removal of this engine's WAL files may run after it closes (a reopen in this
        // process would list a file that then vanishes): wait for a running one, do the rest.
        self.shared.remove_covered_segments();
        if let Some(wal) = self.shared.wal.get() {
            let _ = wal.sync();
        }
        drop(lock(&self.lock_file).take());
    }
}

/// The `LOCK` files (device, inode) whose lock an engine of this process holds. Tells an
/// open of a directory this process already has open (refused at once) from a lock held
/// only by a child being forked (retried; see [`Engine::open`]).
static HELD_LOCKS: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// An exclusive lock on a data directory's `LOCK` file, entered in [`HELD_LOCKS`]. Dropping it
/// leaves the registry first, then unlocks (an open in between sees the lock as a child's and
/// retries, never as free while it is held).
struct DirLock {
    file: fs::File,
    key: (u64, u64),
}

impl DirLock {
    /// Whether an engine of this process holds the lock on the file `key` names.
    fn held_here(key: (u64, u64)) -> bool {
        HELD_LOCKS.lock().unwrap_or_else(PoisonError::into_inner).contains(&key)
    }

    fn new(file: fs::File, key: (u64, u64)) -> Self {
        HELD_LOCKS.lock().unwrap_or_else(PoisonError::into_inner).push(key);
        Self { file, key }
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        HELD_LOCKS.lock().unwrap_or_else(PoisonError::into_inner).retain(|k| *k != self.key);
        let _ = self.file.unlock();
    }
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Drop for Engine {
    /// Dropping the engine closes it without flushing: acknowledged writes not yet in files are
    /// replayed from the write-ahead log at the next open. Table handles still held return
    /// [`Error::Closed`].
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

/// An embedded gritdb engine over one data directory.
///
/// ```no_run
/// use std::sync::Arc;
/// use arrow_array::{Int64Array, RecordBatch, StringArray};
/// use arrow_schema::{DataType, Field, Schema};
///
/// let engine = gritdb::Engine::open("./gritdb-data", gritdb::EngineConfig::default().memory_limit(256 << 20))?;
/// let schema = Arc::new(Schema::new(vec![
///     Field::new("id", DataType::Int64, false),
///     Field::new("name", DataType::Utf8, true),
/// ]));
/// let users = engine.create_table("users", schema.clone(), &["id"])?;
/// let batch = RecordBatch::try_new(schema, vec![
///     Arc::new(Int64Array::from(vec![1, 2])),
///     Arc::new(StringArray::from(vec![Some("ada"), None])),
/// ])?;
/// users.insert(&batch)?;
/// users.flush()?;
/// println!("{}", engine.memory_report());
/// engine.close()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Engine {
    pub(crate) inner: Arc<EngineInner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("dir", &self.inner.dir).finish()
    }
}

/// A limit above physical memory cannot be honoured by the machine: it is clamped to physical
/// memory with a warning (documented in docs/memory.md).
fn clamp_to_ram(bytes: usize) -> usize {
    let ram = gritdb_memctl::physical_memory_bytes();
    if bytes > ram {
        tracing::warn!(requested = bytes, physical = ram, "memory limit above physical memory; clamped to physical memory");
        ram
    } else {
        bytes
    }
}

/// Prefix of the system tables' names (`gritdb_memory`, `gritdb_tables` in SQL), reserved
/// for them ignoring case, as `SQLite` reserves `sqlite_`: a table of such a name would be
/// shadowed in SQL by the system table, or by one added later.
pub const RESERVED_TABLE_PREFIX: &str = "gritdb_";

/// Checks a table name: 1..=255 bytes, no `/`, `\`, NUL or control characters, not `.`/`..`,
/// no `..` inside, and no whitespace at either end. (Names never become paths — table directories are named by id — but
/// these rules keep names portable to tools that do.) Names starting with
/// [`RESERVED_TABLE_PREFIX`] (ignoring case) are the system tables'.
fn validate_name(name: &str) -> Result<()> {
    let bad = |reason| Err(Error::InvalidTableName { name: name.to_owned(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > 255 {
        return bad("longer than 255 bytes");
    }
    if name.contains(['/', '\\']) {
        return bad("contains a path separator");
    }
    if name.chars().any(char::is_control) {
        return bad("contains NUL or a control character");
    }
    if name.contains("..") || name == "." {
        return bad("contains `..` or is `.`");
    }
    if name.trim() != name {
        return bad("starts or ends with whitespace");
    }
    if name.get(..RESERVED_TABLE_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_TABLE_PREFIX)) {
        return bad("starts with `gritdb_`, reserved for system tables");
    }
    Ok(())
}

/// The registry key for a table name: the exact name, else the one name equal to it ignoring
/// case. `create_table` refuses names equal ignoring case, so the match is unique; SQL (which
/// folds unquoted identifiers to lower case) and the Rust API find the same table.
fn resolve_name(tables: &BTreeMap<String, Arc<TableInner>>, name: &str) -> Option<String> {
    if tables.contains_key(name) {
        return Some(name.to_owned());
    }
    let lower = name.to_lowercase();
    tables.keys().find(|k| k.to_lowercase() == lower).cloned()
}

impl Engine {
    /// Opens the data directory `dir`: an existing gritdb data directory, an empty directory,
    /// or a path that does not exist yet (created with its parents unless
    /// [`EngineConfig::create_if_missing`] is off).
    ///
    /// A gritdb data directory is one with the marker file [`DATA_DIR_MARKER`] (`GRITDB`)
    /// at its root, which gritdb writes when it creates one. A directory without it is taken
    /// only when it is one an older gritdb wrote: every entry is gritdb's (`LOCK` holding a
    /// pid; `tables/` holding only `t<N>` table directories, each with a manifest that reads
    /// and checks out or only the manifest's temp file; `trash/` holding only `t<N>`
    /// directories of table files; `wal/` holding only `wal-<N>.log` segments), and a pid
    /// `LOCK` or a table manifest proves it. It gets the marker once its tables and
    /// write-ahead log have opened (a refused open writes none). Anything else non-empty
    /// (`lost+found` aside) is someone else's: refused, nothing created, changed or removed in
    /// it — the open's cleanup (removing dropped tables from `trash/`, table directories of
    /// interrupted creates, and files no manifest names) runs only in a directory known to be
    /// gritdb's, and removes only names gritdb gives (`docs/architecture.md`, "On disk").
    ///
    /// Takes an exclusive lock on `dir/LOCK`, removes leftovers of interrupted drops and
    /// creates, and opens every table (manifest, deletion vectors, key index). A relative
    /// `dir` is made absolute against the working directory now ([`Engine::dir`]), so a
    /// later change of the process's working directory does not move it.
    ///
    /// # Errors
    /// [`Error::NotADataDir`] when `dir` is missing and may not be created, is not a
    /// directory, or is a non-empty directory that is not gritdb's;
    /// [`Error::BadDataDirMarker`] when its marker is damaged or of an unknown format;
    /// [`Error::Io`] when `dir` cannot be read, created or written; [`Error::Locked`] when
    /// another engine holds it, [`Error::Config`] for a bad configuration,
    /// [`Error::Storage`] for a corrupt table.
    pub fn open(dir: impl AsRef<Path>, config: EngineConfig) -> Result<Self> {
        let dir = dir.as_ref();
        if dir.as_os_str().is_empty() {
            return Err(Error::Config("the data directory path is empty".into()));
        }
        // A relative path is made absolute against the working directory once, here, as
        // SQLite does with its database path: every later file operation joins paths onto
        // it, and a process that changed directory afterwards (a daemon, a library calling
        // `set_current_dir`) had its writes, creates and scans fail with `NotFound` under the
        // new directory (`data_dir::a_relative_data_dir_survives_a_change_of_working_directory`).
        // Symbolic links are left as they are (`std::path::absolute`, not `canonicalize`).
        let dir = std::path::absolute(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
        // A bad configuration is refused before anything is created on disk.
        if config.max_row_bytes == 0 {
            return Err(Error::Config("max_row_bytes must be positive".into()));
        }
        // The row format stores a row's lengths and offsets as `u32`s: a larger row would
        // wrap them (the codec takes a larger maximum as this one; refused here so the
        // setting is never silently lowered).
        if config.max_row_bytes > gritdb_unify::MAX_ROW_BYTES {
            return Err(Error::Config(format!(
                "max_row_bytes = {}: at most {} (u32::MAX; a row's lengths and offsets are u32 in the row format)",
                config.max_row_bytes,
                gritdb_unify::MAX_ROW_BYTES
            )));
        }
        for (name, n) in [
            ("writer_threads", config.writer_threads),
            ("flush_threads", config.flush_threads),
            ("background_flush_threads", config.background_flush_threads),
            ("sql_scan_partitions", config.sql_scan_partitions),
        ] {
            if n > MAX_THREADS {
                return Err(Error::Config(format!("{name} = {n}: at most {MAX_THREADS} threads")));
            }
        }
        if let crate::BackgroundPriority::Batch(nice) = config.background_priority
            && !(0..=19).contains(&nice)
        {
            return Err(Error::Config(format!(
                "background_priority Batch({nice}): the nice value must be 0..=19 (a background flush can only run below its caller)"
            )));
        }
        // The chunk size and the limit are checked here too (the controller holds nothing on
        // disk), so a bad one leaves no directory or LOCK behind (`breaker_trial6`).
        let ctl = MemoryController::new(ControllerConfig {
            memory_limit: config.memory_limit.map(clamp_to_ram),
            chunk_size: config.chunk_size,
            ..ControllerConfig::default()
        })?;
        // Nothing is created in a directory that is not gritdb's, nor a directory the config
        // does not allow to create (before: any directory was taken and written into).
        let kind = crate::data_dir::classify(&dir, config.create_if_missing)?;
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let lock_path = dir.join("LOCK");
        let lock_file = fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&lock_path).map_err(io(&lock_path))?;
        // A lock recorded by this very process may be held only by a child it is forking:
        // between `fork` and `exec` the child shares the lock's open file description (std
        // opens it close-on-exec, which ends only at `exec`), so an engine closed and reopened
        // while another thread spawns a process saw `Locked` by its own pid (a fresh-clone
        // trial of 2026-12-04, one run in two). Such a lock is retried for up to 2 s; a lock an
        // engine of this process holds ([`HELD_LOCKS`]) is `Locked` at once (it was retried
        // for the 2 s too).
        let key = {
            use std::os::unix::fs::MetadataExt as _;
            let meta = lock_file.metadata().map_err(io(&lock_path))?;
            (meta.dev(), meta.ino())
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            match lock_file.try_lock() {
                Ok(()) => break,
                Err(fs::TryLockError::WouldBlock) => {
                    let holder = fs::read_to_string(&lock_path).unwrap_or_default().trim().to_owned();
                    if holder == std::process::id().to_string() && !DirLock::held_here(key) && std::time::Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                    return Err(Error::Locked { path: lock_path, holder: format!("pid {holder}") });
                }
                Err(fs::TryLockError::Error(e)) => return Err(Error::Io { path: lock_path, source: e }),
            }
        }
        let mut lock_file = DirLock::new(lock_file, key);
        lock_file.file.set_len(0).and_then(|()| write!(lock_file.file, "{}", std::process::id())).map_err(io(&lock_path))?;
        // A new directory gets the marker before anything else, under the lock: from here on
        // it is known to be gritdb's at every open. An earlier gritdb's directory gets it
        // only once its tables and write-ahead log have opened (below), so an open refused
        // for a damaged file leaves it without one, as it was (before, a `CorruptWal` open
        // left the marker written).
        if kind == crate::data_dir::Kind::New {
            crate::data_dir::write_marker(config.vfs.as_ref(), &dir)?;
        }

        let tables_dir = dir.join("tables");
        fs::create_dir_all(&tables_dir).map_err(io(&tables_dir))?;
        crate::data_dir::empty_trash(&dir)?;
        let writer = Writer::new(config.writer_threads)?;
        let shared = Arc::new(Shared {
            ctl: Arc::clone(&ctl),
            config,
            wal: OnceLock::new(),
            flushed: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            write_target: std::sync::atomic::AtomicUsize::new(0),
            limit_calls: Mutex::new(0),
            wal_cleanup: WalCleanup { pending: Mutex::new(Vec::new()), running: Mutex::new(()), queued: AtomicBool::new(false), runtime: writer.handle() },
            wal_pool: writer.wal_pool(),
            admitting: std::sync::atomic::AtomicUsize::new(0),
            file_writes: std::sync::atomic::AtomicUsize::new(0),
            file_writes_waiting: std::sync::atomic::AtomicUsize::new(0),
            queue: Mutex::new(WriteQueue::default()),
            queued_bytes: std::sync::atomic::AtomicUsize::new(0),
        });
        let mut tables: BTreeMap<String, Arc<TableInner>> = BTreeMap::new();
        let mut max_id = 0u64;
        for e in fs::read_dir(&tables_dir).map_err(io(&tables_dir))?.flatten() {
            let path = e.path();
            // Only directories named as gritdb names them (`t7`; not `t07` or `t+7`, which
            // would be taken for table 7 too); other entries are left alone.
            let Some(id) = e.file_name().to_str().and_then(crate::data_dir::table_dir_id) else {
                continue;
            };
            max_id = max_id.max(id);
            // gritdb makes table directories; a file of such a name is someone else's (before:
            // the open failed on it with `NotADirectory`). Its id still counts above.
            if !fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
                tracing::warn!(path = %path.display(), "leaving an entry of tables/ that is not a directory");
                continue;
            }
            if !path.join(gritdb_storage::MANIFEST_FILE).exists() {
                // An interrupted create leaves at most the manifest's temp file. Anything else
                // means the manifest was lost: refuse rather than delete data.
                if !crate::data_dir::is_interrupted_create(&path)? {
                    return Err(Error::Storage(gritdb_storage::StorageError::CorruptManifest {
                        path: path.join(gritdb_storage::MANIFEST_FILE),
                        detail: "missing, but the table directory holds data files; restore the manifest or move the directory away".into(),
                    }));
                }
                tracing::info!(dir = %path.display(), "removing table directory without manifest (interrupted create)");
                fs::remove_dir_all(&path).map_err(io(&path))?;
                continue;
            }
            let manifest = TableStore::read_manifest(&path)?;
            let name = manifest.table.clone();
            // Two directories naming one table (also only by case, which `create_table`
            // refuses): one would silently hide the other. A damaged or copied manifest;
            // refuse to open rather than choose.
            if let Some(other) = resolve_name(&tables, &name).and_then(|k| tables.get(&k)) {
                return Err(Error::Storage(gritdb_storage::StorageError::CorruptManifest {
                    path: path.join(gritdb_storage::MANIFEST_FILE),
                    detail: format!("names table `{name}`, as `{}` does too ({}); table names are unique ignoring case", other.name, other.dir.display()),
                }));
            }
            let account = ctl.register_table(&name);
            let store = TableStore::open(Arc::clone(&shared.config.vfs), &path, &ctl, Some(&account), manifest)?;
            let next_seq = store.flushed_seq() + 1;
            let codec = Arc::new(RowCodec::new(Arc::clone(store.schema()), store.key_columns(), shared.config.max_row_bytes)?);
            let inner = TableInner::new(name.clone(), id, path.clone(), codec, account, store, next_seq, &shared);
            lock(&shared.flushed).insert(id, inner.flushed_seq());
            tables.insert(name, Arc::new(inner));
        }
        // Replay the write-ahead log: every record newer than its table's committed files.
        let by_id: HashMap<u64, Arc<TableInner>> = tables.values().map(|t| (t.id, Arc::clone(t))).collect();
        let mut replayed = 0u64;
        let wal_dir = dir.join(WAL_DIR);
        let wal = Wal::open(&wal_dir, Arc::clone(&shared.config.vfs), shared.config.wal_sync, &ctl, |rec| -> Result<()> {
            max_id = max_id.max(rec.table);
            let Some(t) = by_id.get(&rec.table) else { return Ok(()) };
            t.seq.fetch_max(rec.last_seq + 1, Ordering::AcqRel);
            let flushed = t.flushed_seq();
            if rec.last_seq <= flushed {
                return Ok(());
            }
            // A record is replayed in slices of about one flush threshold (by each row's
            // Arrow bytes), flushing between them when memory asks, so a record
            // written under a larger limit — even one larger than this limit — can be replayed,
            // and leaves a delta that can be scanned and flushed at this one.
            //
            // Sequence numbers: a put's row i has `first_seq + i`; a delete's applied keys
            // (those that existed) take `first_seq, first_seq + 1, ...` in order. A flush
            // between slices commits `flushed_seq` inside a record, so the next open resumes
            // after it: puts skip the rows it covers; deletes replay every key again (keys
            // deleted in files no longer exist and apply nothing) numbering the rest from
            // `flushed_seq + 1`.
            let n = rec.batch.num_rows();
            let covered = usize::try_from(flushed.saturating_add(1).saturating_sub(rec.first_seq)).unwrap_or(usize::MAX);
            let (mut at, mut seq) = match rec.op {
                WalOp::Put => (covered.min(n), rec.first_seq.max(flushed + 1)),
                WalOp::Delete => (0, rec.first_seq.max(flushed + 1)),
            };
            let sizes = row_bytes(&rec.batch);
            // Each row's key-column bytes, about its encoded key (within arrow-row's 1 byte in
            // 32 and a few), for the estimates below: a delete record holds key columns only.
            let key_sizes = match rec.op {
                WalOp::Put => rec.batch.project(t.codec.keys().columns()).map_or_else(|_| sizes.clone(), |b| row_bytes(&b)),
                WalOp::Delete => sizes.clone(),
            };
            let flush_bytes = shared.table_flush_bytes();
            while at < n {
                // Rows up to about one flush threshold of Arrow bytes (at least one row).
                let (mut len, mut need, mut key_bytes) = (1, sizes[at], key_sizes[at]);
                while at + len < n && need + sizes[at + len] <= flush_bytes {
                    need += sizes[at + len];
                    key_bytes += key_sizes[at + len];
                    len += 1;
                }
                let part = WalRecord {
                    op: rec.op,
                    table: rec.table,
                    first_seq: seq,
                    last_seq: rec.last_seq,
                    batch: rec.batch.slice(at, len),
                    position: rec.position.clone(),
                };
                // Replay keeps the flush headroom free, as writes do (backpressure): when the
                // slice would take memory past the write soft limit, the largest tables'
                // deltas are flushed inline first. Else a log written under a larger limit
                // fills memory to the hard limit, and the table can then be neither scanned
                // nor flushed at this one. The slice's growth and the room to flush it are
                // estimated as a write's are (`Table::with_backpressure`), wide keys
                // included: counting Arrow bytes alone, six 100 KB-key rows logged under
                // 64 MiB replayed at 2 MiB into 1.5 MB of deltas that no scan could read
                // (`big_keys::wide_keys_logged_under_a_large_limit_replay_at_a_small_one`).
                let growth = Shared::delta_growth(need, len, key_bytes);
                let convert = Shared::flush_need(need, len, key_bytes);
                let over = || {
                    let largest_sealed = by_id.values().map(|t| t.largest_sealed.load(Ordering::Acquire)).max().unwrap_or(0);
                    shared.pressure_bytes() + growth > shared.write_soft_limit()
                        || shared.flush_room_short(growth + shared.ctl.chunk_size(), convert, t.active_flush_need(), largest_sealed).is_some()
                };
                if over() {
                    let mut by_size: Vec<(usize, &Arc<TableInner>)> = by_id.values().map(|t| (t.delta_bytes(), t)).collect();
                    by_size.sort_by_key(|b| std::cmp::Reverse(b.0));
                    for (bytes, t) in by_size {
                        if bytes == 0 || !over() {
                            break;
                        }
                        t.seal_and_flush()?;
                    }
                }
                seq += t.replay(&part)?;
                at += len;
                replayed += len as u64;
            }
            Ok(())
        })?;
        if shared.wal.set(wal).is_err() {
            return Err(Error::Closed("write-ahead log opened twice".into()));
        }
        if let Ok(wal) = shared.wal() {
            max_id = max_id.max(wal.max_table_id());
        }
        // Segments every table had committed before the last stop (a crash between a commit
        // and its truncation, say) are removed now, not left for a later commit.
        shared.truncate_wal(false);
        if kind == crate::data_dir::Kind::Legacy {
            crate::data_dir::write_marker(shared.config.vfs.as_ref(), &dir)?;
            tracing::info!(dir = %dir.display(), marker = DATA_DIR_MARKER, "data directory of an earlier gritdb: marker written");
        }
        if shared.config.wal_sync == WalSync::Relaxed {
            let weak = Arc::downgrade(&shared);
            writer.start_ticker(shared.config.wal_sync_interval, move || {
                let Some(shared) = weak.upgrade() else { return false };
                if let Ok(wal) = shared.wal()
                    && let Err(e) = wal.sync()
                {
                    // A failed fsync is final for the log (`WalSync::Relaxed`): every later
                    // write returns the error, so one report is enough and the tick stops.
                    tracing::error!(error = %e, "write-ahead log group commit failed; the engine takes no more writes until it is reopened");
                    return !wal.has_failed();
                }
                true
            });
        }
        tracing::info!(dir = %dir.display(), tables = tables.len(), replayed_rows = replayed, limit = ctl.limit(), "engine opened");
        let age = shared.config.flush_age;
        let engine = Self {
            inner: Arc::new(EngineInner {
                dir,
                shared,
                tables: RwLock::new(tables),
                writer,
                next_table_id: AtomicU64::new(max_id.saturating_add(1)),
                closed: AtomicBool::new(false),
                closing: AtomicBool::new(false),
                write_gate: RwLock::new(()),
                lock_file: Mutex::new(Some(lock_file)),
                #[cfg(feature = "sql")]
                sql: crate::sql::SqlSlot::default(),
            }),
        };
        // Age-based flushes: a delta older than `flush_age` is sealed and flushed even when
        // small, so the WAL stays short and idle tables give their chunks back.
        let weak = Arc::downgrade(&engine.inner);
        engine.inner.writer.start_ticker((age / 4).max(Duration::from_millis(10)), move || {
            let Some(inner) = weak.upgrade() else { return false };
            if inner.closed.load(Ordering::Acquire) {
                return false;
            }
            inner.flush_aged(age);
            // Cached chunks nobody used for a while go back to the allocator.
            inner.shared.ctl.trim_idle(IDLE_CHUNK_TRIM);
            true
        });
        // Deltas replay sealed (past the flush threshold) go to the background writer, as a
        // write's would.
        for t in engine.inner.all_tables() {
            if lock(&t.state).as_ref().is_some_and(|st| !st.sealed.is_empty()) {
                engine.inner.writer.schedule(&t);
            }
        }
        Ok(engine)
    }

    /// Opens [`DEFAULT_DATA_DIR`] (`./gritdb-data`) with the default configuration (memory
    /// limit 50% of RAM or of the cgroup limit).
    ///
    /// # Errors
    /// As [`Engine::open`].
    pub fn open_default() -> Result<Self> {
        Self::open(DEFAULT_DATA_DIR, EngineConfig::default())
    }

    /// The data directory, as an absolute path (a relative one given to [`Engine::open`] is
    /// joined onto the working directory of that moment).
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Creates a table with an Arrow schema and primary-key columns (in key order). The table
    /// is durable when this returns.
    ///
    /// Key identity: two rows have the same key when every key column is equal. Float key
    /// columns compare as numbers do for keys, so 0.0 and −0.0 are one key and every NaN (any
    /// sign or payload) is one key; a row keeps the value written. Scan filters
    /// ([`crate::ScanOptions::filter`]) compare floats the same way, so `k = 0.0` returns a row
    /// written with −0.0.
    ///
    /// # Errors
    /// [`Error::InvalidTableName`] (empty, over 255 bytes, a path separator, NUL or a control
    /// character, `.` or `..` in it, whitespace at either end, or the reserved `gritdb_` prefix),
    /// [`Error::TableExists`] (names compare case-insensitively),
    /// [`Error::InvalidPrimaryKey`] (empty, unknown or repeated column),
    /// [`Error::Input`] for an unsupported column type, [`Error::Storage`] on I/O failure.
    #[allow(clippy::needless_pass_by_value)] // the API of ARCHITECTURE.md: the table takes the schema
    pub fn create_table(&self, name: &str, schema: SchemaRef, primary_key: &[&str]) -> Result<Table> {
        self.inner.check_open()?;
        validate_name(name)?;
        if primary_key.is_empty() {
            return Err(Error::InvalidPrimaryKey("at least one primary-key column is required".into()));
        }
        let mut key_cols = Vec::with_capacity(primary_key.len());
        for k in primary_key {
            let i = schema.index_of(k).map_err(|_| Error::InvalidPrimaryKey(format!("column `{k}` is not in the schema")))?;
            if key_cols.contains(&i) {
                return Err(Error::InvalidPrimaryKey(format!("column `{k}` is named twice")));
            }
            key_cols.push(i);
        }
        let mut names = std::collections::HashSet::new();
        for f in schema.fields() {
            if !names.insert(f.name().to_lowercase()) {
                return Err(Error::Input(gritdb_unify::UnifyError::SchemaMismatch {
                    detail: format!("column name `{}` appears twice (names compare case-insensitively)", f.name()),
                }));
            }
        }
        let shared = &self.inner.shared;
        let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &key_cols, shared.config.max_row_bytes)?);
        let mut tables = self.inner.tables_write();
        let lower = name.to_lowercase();
        if let Some(existing) = tables.keys().find(|k| k.to_lowercase() == lower) {
            return Err(Error::TableExists { name: name.to_owned(), existing: existing.clone() });
        }
        let id = self.inner.next_table_id.fetch_add(1, Ordering::AcqRel);
        let dir = self.inner.dir.join("tables").join(format!("t{id}"));
        let account = shared.ctl.register_table(name);
        let store = TableStore::create(Arc::clone(&shared.config.vfs), &dir, name, Arc::clone(&schema), &key_cols, &shared.ctl, Some(&account))?;
        let inner = Arc::new(TableInner::new(name.to_owned(), id, dir, codec, account, store, 1, shared));
        lock(&shared.flushed).insert(id, 0);
        tables.insert(name.to_owned(), Arc::clone(&inner));
        drop(tables);
        tracing::debug!(table = name, id, "table created");
        Ok(Table { inner, engine: Arc::clone(&self.inner) })
    }

    /// A handle to an existing table. Names match exactly or, failing that, ignoring case
    /// (`create_table` refuses two names that differ only in case).
    ///
    /// # Errors
    /// [`Error::TableNotFound`].
    pub fn table(&self, name: &str) -> Result<Table> {
        self.inner.check_open()?;
        let t = self.inner.lookup(name).ok_or_else(|| Error::TableNotFound { name: name.to_owned() })?;
        Ok(Table { inner: t, engine: Arc::clone(&self.inner) })
    }

    /// Names of all tables, sorted.
    pub fn table_names(&self) -> Vec<String> {
        self.inner.table_names()
    }

    /// Drops a table: every accounted byte it holds is released at once, and its directory is
    /// removed (renamed into `trash/` first, so a crash never leaves half a table visible).
    /// Handles to it return [`Error::TableNotFound`] afterwards.
    ///
    /// A flush or compaction of the table in flight is cancelled: its Parquet write stops at
    /// its next call into the file layer (every `write` call, fsync and rename checks) or
    /// between the batches it encodes, removes its temp file and frees its batch block and
    /// writer buffers. `drop_table` waits for that (so when it returns the table's accounted
    /// bytes are all released and the engine total is back where it was before the table
    /// existed), but at most `EngineConfig::backpressure_timeout`: when the file layer is hung
    /// inside a system call (a `write` or `fsync` that does not return), it returns after that
    /// wait with the table gone (name free, directory removed) and the bytes that flush holds —
    /// its batch block (at most `flush_batch_bytes` per batch of the flush) and writer buffers
    /// (about 32 MiB at most) — are released when the system call returns.
    ///
    /// # Errors
    /// [`Error::TableNotFound`]; [`Error::Io`] when the directory cannot be renamed into
    /// `trash/` (nothing changed: the table is still there, whole); [`Error::Io`] when the
    /// `tables/` directory's fsync after the rename fails or the renamed directory cannot be
    /// removed (the table is gone from this engine; after a crash before the rename reached the
    /// disk it is back at the next open with every row its WAL held, else gone, and `trash/`
    /// is cleared at the next open).
    pub fn drop_table(&self, name: &str) -> Result<()> {
        self.inner.check_open()?;
        let vfs = &self.inner.shared.config.vfs;
        // The directory's rename into `trash/` is the drop's commit point on disk. It runs
        // under the tables lock (as `create_table`'s directory and manifest do), before
        // anything is taken from the table, so a rename that fails leaves the table exactly as
        // it was — served, writable, in the WAL and on disk — and no other call sees it half
        // dropped. It goes through the file layer, so a `Vfs` that fails or lies is honoured.
        let (t, trash) = {
            let mut tables = self.inner.tables_write();
            let key = resolve_name(&tables, name).ok_or_else(|| Error::TableNotFound { name: name.to_owned() })?;
            let t = Arc::clone(&tables[&key]);
            let trash = self.inner.dir.join("trash").join(format!("t{}", t.id));
            t.dropping.store(true, Ordering::Release);
            if let Err(e) = vfs.rename(&t.dir, &trash) {
                // A rename can take effect and still report an error (a lost reply on a
                // network file system): the directory is gone from `tables/`, so the drop
                // happened.
                if !gritdb_storage::rename_may_have_happened(&t.dir) {
                    t.dropping.store(false, Ordering::Release);
                    return Err(Error::Io { path: t.dir.clone(), source: e });
                }
                tracing::warn!(table = name, error = %e, "drop_table: the rename into trash/ reported an error but took effect");
            }
            tables.remove(&key);
            (t, trash)
        };
        // Cancel writes first, then take the state (under one lock), so once a handle sees the
        // table gone its writes are cancelled.
        let state = {
            let mut g = lock(&t.state);
            if let Some(st) = g.as_ref() {
                st.store.write_options().cancel.cancel();
                if let Some(account) = st.store.account() {
                    account.mark_dropped();
                }
            }
            g.take()
        };
        drop(state);
        // A flush or compaction in flight holds the flush lock until it has let go of its
        // memory: wait for it (bounded; a hung system call cannot be interrupted).
        let deadline = deadline_after(self.inner.shared.config.backpressure_timeout);
        let acknowledged = loop {
            match t.flush_lock.try_lock() {
                Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => break true,
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() >= deadline => break false,
                Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        if !acknowledged {
            tracing::warn!(table = name, "drop_table: a flush of the table is stuck in the file layer; its memory is released when the call returns");
        }
        // Make the rename durable before the WAL forgets the table's records. When that fsync
        // fails the table is gone from this engine but its records are kept (and `trash/` is
        // left for the next open to clear): after a crash it comes back whole or not at all,
        // never as a directory without the rows its WAL held.
        let tables_dir = self.inner.dir.join("tables");
        vfs.sync_dir(&tables_dir).map_err(io(&tables_dir))?;
        // The dropped table's segments are gone when the call returns (no removal of them
        // runs on afterwards).
        self.inner.shared.note_flushed(t.id, None, false);
        fs::remove_dir_all(&trash).map_err(io(&trash))?;
        tracing::debug!(table = name, "table dropped");
        Ok(())
    }

    /// Tables whose last flush failed, or whose compaction after a committed flush failed
    /// (the text then begins with [`crate::COMPACTION_FAILED`]; the flush returned `Ok` and
    /// its rows are durable), or that have a data file found damaged by a read (the
    /// `CorruptFile` error's text, from the read that found it until a read finds the file
    /// matching its checksum again), with the error text: the engine is degraded while this
    /// is not empty (rows not yet committed stay in memory and are served; flushes and
    /// compactions are retried by the next flush, compactions leaving damaged files out).
    pub fn degraded_tables(&self) -> Vec<(String, String)> {
        self.inner
            .all_tables()
            .iter()
            .filter_map(|t| {
                let g = lock(&t.state);
                let err = crate::table::TableInner::degraded(g.as_ref()?)?;
                Some((t.name.clone(), err))
            })
            .collect()
    }

    /// Background flushes queued or running now, a point-in-time count (`RocksDB` reports the
    /// like as `rocksdb.num-running-flushes` plus its flush queue). The Arrow batches and
    /// Parquet buffers a flush holds are the engine's until it ends, so memory measured while
    /// this is above 0 may still fall; flushes a caller runs itself (`Table::flush`,
    /// `flush_all`) are not counted.
    pub fn flushes_in_flight(&self) -> usize {
        self.inner.writer.in_flight()
    }

    /// Write-ahead-log segments kept and their bytes.
    pub fn wal_usage(&self) -> (usize, u64) {
        self.inner.shared.wal().map_or((0, 0), |w| (w.segment_count(), w.bytes()))
    }

    /// Engine memory by category and table beside RSS, `VmHWM` and the allocator's figures.
    pub fn memory_report(&self) -> MemoryReport {
        self.inner.shared.ctl.report()
    }

    /// [`Engine::memory_report`] as an Arrow batch (like `DuckDB`'s `duckdb_memory()`), one row
    /// per category engine-wide (`scope` = `engine`, `name` = null) and per table and
    /// category (`scope` = `table`, `name` = the table), so it can be queried.
    ///
    /// Columns: `scope` Utf8, `name` Utf8 (nullable), `category` Utf8, `bytes` `UInt64`,
    /// `peak_bytes` `UInt64`, `allocs` `UInt64`, `frees` `UInt64`, `failures` `UInt64`.
    ///
    /// # Errors
    /// Arrow errors (none expected).
    pub fn memory_report_batch(&self) -> Result<arrow_array::RecordBatch> {
        memory_batch(&self.memory_report())
    }

    /// What this open cut from the end of the write-ahead log as a torn tail, if anything:
    /// the segment, the offset, the bytes dropped and what recovery saw there
    /// ([`crate::WalTornTail`]). A write a crash interrupted leaves one (with the default
    /// [`crate::WalSync::PerBatch`] it was never acknowledged); so does damage to the last
    /// record, which recovery cannot tell apart, so an application that must know of every
    /// lost acknowledged write checks this after each open (the same tail is also logged at
    /// `warn`). `None` once the engine is closed. It reports bytes the log holds, not bytes
    /// taken from it: a segment cut to a record boundary (to 0 bytes, say) by something other
    /// than the engine reads as a shorter, whole log, and its cut records are lost with
    /// nothing to report (segments have no header or length record of their own; a trial of
    /// 2026-12-06 truncated the only segment after an fsynced insert).
    pub fn wal_torn_tail(&self) -> Option<crate::WalTornTail> {
        self.inner.shared.wal().ok().and_then(|w| w.torn_tail().cloned())
    }

    /// The memory controller (limit, used, peak, per-category figures).
    pub fn memory(&self) -> &Arc<MemoryController> {
        &self.inner.shared.ctl
    }

    /// Gives cached free chunks back to the allocator; returns the bytes released.
    pub fn release_cached_memory(&self) -> usize {
        self.inner.shared.ctl.trim_free_chunks(0)
    }

    /// Changes the memory limit at run time. A value above physical memory is clamped to it.
    ///
    /// Raising takes effect at once. Lowering: writes respect the new value at once, cached
    /// free chunks are trimmed, the largest deltas of every table are sealed and handed to the
    /// background writer — which may still use the old limit to build its batches — and this
    /// call waits (at most `backpressure_timeout`) until the accounted total is under the new
    /// value; then it becomes the limit. It never waits on a flush lock, so a stuck disk cannot
    /// block it beyond that bound.
    ///
    /// Calls from several threads apply in the order they begin, and the last one wins: a
    /// raise ends a lowering still waiting, and a lowering still waiting when another call
    /// begins applies nothing.
    ///
    /// A lowering must leave writes room beside the memory no flush gives back: the key index
    /// of the tables' files plus one chunk must fit under the new value less its flush
    /// headroom (a quarter to a half of it, `docs/memory.md`). A value below
    /// that is refused at once, before anything is sealed or flushed.
    ///
    /// # Errors
    /// [`Error::Config`] when `bytes` is below two chunks; [`Error::MemoryLimit`] with `limit`
    /// the value asked for and `requested` the bytes short of it — at once, with `category`
    /// `KeyIndex`, when the rule above refuses the value; after the wait, with
    /// the category holding the most, when memory in use is still above the new value — the
    /// old limit stays in force either way; [`Error::LimitSuperseded`] when a later call began
    /// while this lowering waited (the later call's value is the one in force).
    pub fn set_memory_limit(&self, bytes: usize) -> Result<()> {
        let bytes = clamp_to_ram(bytes);
        let shared = &self.inner.shared;
        let ctl = &shared.ctl;
        let call = {
            let mut calls = lock(&shared.limit_calls);
            if bytes >= ctl.limit() {
                ctl.set_limit(bytes)?;
                // The last call wins: a lowering still waiting is superseded, and writes are
                // no longer held to its value.
                *calls += 1;
                shared.write_target.store(0, Ordering::Release);
                return Ok(());
            }
            // Lowering: writes respect the new limit at once; the writer flushes down while
            // the old limit still lets it build its batches; then the new limit takes over.
            gritdb_memctl::MemoryController::check_limit_value(bytes, ctl.chunk_size())?;
            // A value that leaves no room for writes beside what no flush frees is refused
            // now, before anything is sealed or held to it: before, such a lowering waited the
            // whole `backpressure_timeout` with every write held to it (helper-41: 45 one-row
            // upserts in 5 s against 18,000), or was accepted and then refused every write
            // (helper-42); a refusal decided after the sealing returned while the flushes it
            // had started went on (30a59e8, reverted).
            if let Some(short) = shared.limit_floor_short(bytes, self.inner.file_index_bytes()) {
                return Err(self.lowering_refused(bytes, Category::KeyIndex, short));
            }
            *calls += 1;
            shared.write_target.store(bytes, Ordering::Release);
            *calls
        };
        let superseded = || *lock(&shared.limit_calls) != call;
        let superseded_error = || Error::LimitSuperseded { requested: bytes, limit: ctl.limit() };
        let deadline = deadline_after(shared.config.backpressure_timeout);
        // Every delta is sealed and flushed while the old limit still leaves the writer room
        // (a delta sealed under the old limit may need more than the new one allows).
        for t in self.inner.all_tables() {
            let sealed = lock(&t.state).as_mut().is_some_and(|st| t.seal(st));
            if sealed {
                self.inner.writer.schedule(&t);
            }
        }
        let reached = loop {
            if superseded() {
                return Err(superseded_error());
            }
            ctl.trim_free_chunks(0);
            // Done when what is in use, plus what the sealed deltas still need to be turned
            // into batches, fits the new limit (a staged file needs only the disk: a stuck
            // disk does not hold this call).
            if ctl.used() + self.inner.sealed_bytes() <= bytes {
                // Unless the flushes grew the files' key index past what leaves room for
                // writes: no wait helps then.
                break shared.limit_floor_short(bytes, self.inner.file_index_bytes()).is_none();
            }
            if shared.limit_floor_short(bytes, self.inner.file_index_bytes()).is_some() {
                break false;
            }
            // Nothing left to flush still leaves memory a caller may give back (held scan
            // batches): wait for releases until the deadline either way.
            self.inner.relieve_pressure(true);
            if !self.inner.wait_for_memory(deadline) {
                ctl.trim_free_chunks(0);
                break ctl.used() + self.inner.sealed_bytes() <= bytes;
            }
        };
        {
            let calls = lock(&shared.limit_calls);
            if *calls != call {
                return Err(superseded_error());
            }
            shared.write_target.store(0, Ordering::Release);
            if !reached {
                if let Some(short) = shared.limit_floor_short(bytes, self.inner.file_index_bytes()) {
                    return Err(self.lowering_refused(bytes, Category::KeyIndex, short));
                }
                // Name the category that holds the most, not the one a write would have needed.
                let holder = Category::ALL.into_iter().max_by_key(|c| ctl.category_bytes(*c)).unwrap_or(Category::RowBlocks);
                return Err(self.lowering_refused(bytes, holder, (ctl.used() + self.inner.sealed_bytes()).saturating_sub(bytes)));
            }
            ctl.set_limit(bytes)?;
            drop(calls);
        }
        // A reservation that checked the old limit just before the swap may have landed after
        // the check above; from now on none goes past the new limit, so `used` only falls:
        // wait (bounded) until it is under, or until a later call changes the limit again.
        while ctl.used() > bytes && !superseded() {
            ctl.trim_free_chunks(0);
            self.inner.relieve_pressure(true);
            if !self.inner.wait_for_memory(deadline) {
                break;
            }
        }
        Ok(())
    }

    /// The [`Error::MemoryLimit`] of a lowering to `bytes` that is refused: `requested` the
    /// bytes short, `limit` the value asked for (the old limit stays in force), `category` the
    /// holder named.
    fn lowering_refused(&self, bytes: usize, category: Category, short: usize) -> Error {
        let ctl = &self.inner.shared.ctl;
        let mut e: Error = ctl.limit_error(category, short.max(1)).into();
        if let Error::MemoryLimit { limit, .. } = &mut e {
            *limit = bytes;
        }
        tracing::warn!(target_limit = bytes, used = ctl.used(), error = %e, "lowered limit refused; the old limit stays");
        e
    }

    /// Flushes every table (all of them, even after one fails).
    ///
    /// # Errors
    /// The first flush error.
    pub fn flush_all(&self) -> Result<()> {
        // Every table gets its flush even when an earlier one fails; the first error is
        // returned.
        let mut first = None;
        for t in self.inner.all_tables() {
            if let Err(e) = (Table { inner: t, engine: Arc::clone(&self.inner) }).flush() {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Stops admitting writes, waits for the writes already admitted, flushes every table,
    /// stops the background writer and closes the engine. A write that starts (or is waiting
    /// for memory) once `close` has begun returns [`Error::Closed`] and is not applied.
    ///
    /// Dropping an engine without `close` loses nothing acknowledged: rows not yet in files
    /// are replayed from the write-ahead log at the next open.
    ///
    /// # Errors
    /// The first flush error (the engine is closed anyway).
    pub fn close(self) -> Result<()> {
        // Stop admitting writes first and wait for the admitted ones: writers that never stop
        // would otherwise keep the last flush going (each flush finds a new delta), and
        // writers waiting for memory would compete with it for the batch memory it needs.
        // A write refused here was never acknowledged, so nothing is lost.
        // (A write waiting for memory sees this within its 100 ms wait step.)
        self.inner.closing.store(true, Ordering::Release);
        drop(self.inner.write_gate.write().unwrap_or_else(PoisonError::into_inner));
        let mut res = self.flush_all();
        if let Ok(wal) = self.inner.shared.wal()
            && let Err(e) = wal.sync()
            && res.is_ok()
        {
            res = Err(e.into());
        }
        // Now synced, the active segment can go too when everything in it is committed
        // (`WalSync::Relaxed` left it unsynced at the flushes' truncations).
        self.inner.shared.truncate_wal(false);
        // Drop (right after this) stops the writer and releases the directory lock.
        res
    }
}

/// The schema of [`Engine::memory_report_batch`] (and of the SQL system table `gritdb_memory`).
pub(crate) fn memory_batch_schema() -> arrow_schema::SchemaRef {
    use arrow_schema::{DataType, Field, Schema};
    Arc::new(Schema::new(vec![
        Field::new("scope", DataType::Utf8, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("category", DataType::Utf8, false),
        Field::new("bytes", DataType::UInt64, false),
        Field::new("peak_bytes", DataType::UInt64, false),
        Field::new("allocs", DataType::UInt64, false),
        Field::new("frees", DataType::UInt64, false),
        Field::new("failures", DataType::UInt64, false),
    ]))
}

/// `report` as the batch of [`Engine::memory_report_batch`].
pub(crate) fn memory_batch(r: &MemoryReport) -> Result<arrow_array::RecordBatch> {
    use arrow_array::{ArrayRef, StringArray, UInt64Array};
    let mut scope = Vec::new();
    let mut name: Vec<Option<String>> = Vec::new();
    let mut cat = Vec::new();
    let (mut bytes, mut peak, mut allocs, mut frees, mut fails) = (vec![], vec![], vec![], vec![], vec![]);
    let mut push = |s: &str, n: Option<String>, c: &gritdb_memctl::CategoryReport| {
        scope.push(s.to_owned());
        name.push(n);
        cat.push(c.category.name().to_owned());
        bytes.push(c.bytes as u64);
        peak.push(c.peak_bytes as u64);
        allocs.push(c.allocs);
        frees.push(c.frees);
        fails.push(c.failures);
    };
    for c in &r.categories {
        push("engine", None, c);
    }
    for t in &r.tables {
        for c in &t.categories {
            push("table", Some(t.table.clone()), c);
        }
    }
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(scope)),
        Arc::new(StringArray::from(name)),
        Arc::new(StringArray::from(cat)),
        Arc::new(UInt64Array::from(bytes)),
        Arc::new(UInt64Array::from(peak)),
        Arc::new(UInt64Array::from(allocs)),
        Arc::new(UInt64Array::from(frees)),
        Arc::new(UInt64Array::from(fails)),
    ];
    Ok(arrow_array::RecordBatch::try_new(memory_batch_schema(), cols)?)
}

/// Arrow bytes of each row of `batch` (shape: one `usize` per row): a value's bytes plus its
/// offset or view for variable-width columns, the type's width for the others (8 for types
/// without one, 1 for booleans). Cuts replay slices by bytes, so rows of very unequal width
/// cannot put many wide rows in one slice the way an average would.
fn row_bytes(batch: &arrow_array::RecordBatch) -> Vec<usize> {
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    use arrow_schema::DataType;
    fn add_offsets<O: arrow_array::OffsetSizeTrait>(out: &mut [usize], offsets: &[O]) {
        for (o, w) in out.iter_mut().zip(offsets.windows(2)) {
            *o += (w[1] - w[0]).as_usize() + std::mem::size_of::<O>();
        }
    }
    let mut out = vec![0usize; batch.num_rows()];
    for c in batch.columns() {
        match c.data_type() {
            DataType::Utf8 => add_offsets(&mut out, c.as_string::<i32>().value_offsets()),
            DataType::LargeUtf8 => add_offsets(&mut out, c.as_string::<i64>().value_offsets()),
            DataType::Binary => add_offsets(&mut out, c.as_binary::<i32>().value_offsets()),
            DataType::LargeBinary => add_offsets(&mut out, c.as_binary::<i64>().value_offsets()),
            DataType::Utf8View | DataType::BinaryView => {
                let views = if matches!(c.data_type(), DataType::Utf8View) { c.as_string_view().views() } else { c.as_binary_view().views() };
                // A view's low 32 bits are the value's length.
                for (o, v) in out.iter_mut().zip(views.iter()) {
                    *o += 16 + (*v as u32) as usize;
                }
            }
            dt => {
                let w = if matches!(dt, DataType::Boolean) { 1 } else { dt.primitive_width().unwrap_or(8) };
                for o in &mut out {
                    *o += w;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write's admission counts for the writes admitted after it (not before), gives its
    /// bytes back when dropped, and wakes a writer waiting for memory, which would otherwise
    /// sleep until a release or its timeout.
    #[test]
    fn an_admission_counts_for_later_writes_until_dropped_and_wakes_waiters() {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
        let shared = Arc::clone(&engine.inner.shared);
        assert_eq!(shared.admitting(), 0);
        let a = shared.admit(1_000);
        let b = shared.admit(500);
        assert_eq!((a.others, b.others), (0, 1_000));
        assert_eq!(shared.admitting(), 1_500);
        drop(a);
        assert_eq!(shared.admitting(), 500);
        let c = shared.admit(7);
        assert_eq!(c.others, 500, "a's bytes are gone, b's still count");
        drop((b, c));
        assert_eq!(shared.admitting(), 0);

        // The waiter's timeout is far longer than the test allows, so `true` means it was woken.
        let ctl = Arc::clone(&shared.ctl);
        let waiter = std::thread::spawn(move || ctl.wait_for_release(Duration::from_mins(10)));
        let start = Instant::now();
        while !waiter.is_finished() {
            assert!(start.elapsed() < Duration::from_mins(1), "an admission's end never woke the waiter");
            drop(shared.admit(1));
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(waiter.join().unwrap(), "the waiter was woken by an admission's end, not its timeout");
        assert_eq!(shared.admitting(), 0);
    }

    /// The last `set_memory_limit` call wins. A lowering to 4 MiB waits while 12 MiB are held;
    /// a raise to 32 MiB then takes effect at once, ends the wait (the lowering returns
    /// `LimitSuperseded` and applies nothing, and writes are no longer held to 4 MiB), and once
    /// the memory is given back the limit is still 32 MiB (it was 4 MiB: the waiting lowering
    /// applied its value after the raise). A lowering superseded by a later lowering also
    /// applies nothing; the later one's value is in force.
    #[test]
    fn a_later_limit_call_supersedes_a_lowering_still_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig::default().memory_limit(64 << 20).backpressure_timeout(Duration::from_mins(5));
        let engine = Arc::new(Engine::open(dir.path(), config).unwrap());
        let shared = Arc::clone(&engine.inner.shared);
        for (later, want) in [(32 << 20, 32 << 20), (16 << 20, 16 << 20)] {
            engine.set_memory_limit(64 << 20).unwrap();
            let mut held = gritdb_memctl::Reservation::new(&shared.ctl, Category::ScanBuffers, None);
            held.try_resize(12 << 20).unwrap();
            let calls = *lock(&shared.limit_calls);
            let lowering = std::thread::spawn({
                let engine = Arc::clone(&engine);
                move || engine.set_memory_limit(4 << 20)
            });
            // Waiting: its call counted and writes held to 4 MiB.
            let start = Instant::now();
            while *lock(&shared.limit_calls) == calls || shared.write_target.load(Ordering::Acquire) != 4 << 20 {
                assert!(start.elapsed() < Duration::from_mins(1), "the lowering never began");
                std::thread::sleep(Duration::from_millis(2));
            }
            assert!(!lowering.is_finished(), "12 MiB held: the lowering to 4 MiB waits");
            let begun = Instant::now();
            // A raise to 32 MiB; a lowering to 16 MiB, which the 12 MiB held fit: both apply
            // at once.
            engine.set_memory_limit(later).unwrap();
            assert_eq!(shared.ctl.limit(), later);
            match lowering.join().unwrap() {
                // The limit in force when it returned: the raise had applied before it began
                // to count; a later lowering may apply just after.
                Err(Error::LimitSuperseded { requested, limit }) => {
                    assert_eq!(requested, 4 << 20);
                    assert!(limit == want || (later < 64 << 20 && limit == 64 << 20), "{limit}");
                }
                other => panic!("expected LimitSuperseded, got {other:?}"),
            }
            assert!(begun.elapsed() < Duration::from_mins(1), "the superseded lowering returned without waiting out its timeout");
            assert_eq!(shared.write_target.load(Ordering::Acquire), 0, "writes are no longer held to 4 MiB");
            drop(held);
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(shared.ctl.limit(), want, "the later call's value stays in force");
        }
    }
}
