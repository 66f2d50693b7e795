use crate::engine::Shared;
use crate::error::{Error, Result};
use crate::scan::{Scan, ScanOptions};
use arrow_array::RecordBatch;
use gritdb_memctl::{Category, TableAccount};
use gritdb_storage::{TableStore, WalOp, WalRecord};
use gritdb_unify::{DeltaStore, Lookup, RowCodec};
use hashbrown::HashTable;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// Rows per Arrow batch built at flush (one batch block each).
const FLUSH_BATCH_ROWS: usize = 64 << 10;

/// Put batches of at least this many rows append to the write-ahead log (encode, write,
/// fsync) on the WAL record pool while the rows are encoded into the delta
/// ([`PendingAppend`]); smaller ones do the two in turn (the hand-over, two thread wake-ups of
/// ~10–50 µs, is not worth it there).
const OVERLAP_WAL_ROWS: usize = 1024;

/// The most parts a flush splits a sealed delta into when the limit has no room to convert
/// it at once (`TableInner::flush_delta`): each part scans the whole delta for its keys, so
/// the count is kept small; a part of 1/256 of a delta that still cannot be had fails the
/// flush with `MemoryLimit`.
const MAX_FLUSH_PARTS: u64 = 256;

/// One class of a sealed delta's keys, flushed as a part of its own: the keys whose
/// [`gritdb_unify::key_hash`] is `residue` modulo `modulus` (a power of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FlushPart {
    modulus: u64,
    residue: u64,
}

impl FlushPart {
    /// Every key: the delta flushed at once.
    const WHOLE: Self = Self { modulus: 1, residue: 0 };

    fn holds(self, hash: u64) -> bool {
        hash % self.modulus == self.residue
    }

    /// The two classes that together hold exactly this one's keys.
    fn halves(self) -> [Self; 2] {
        let modulus = self.modulus * 2;
        [Self { modulus, residue: self.residue }, Self { modulus, residue: self.residue + self.modulus }]
    }
}

/// How a batch of rows is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteMode {
    Insert,
    Upsert,
    Update,
}

pub(crate) struct TableState {
    pub(crate) active: DeltaStore,
    /// Sealed deltas waiting for the writer, oldest first.
    pub(crate) sealed: VecDeque<Arc<DeltaStore>>,
    pub(crate) store: TableStore,
    pub(crate) last_flush_error: Option<String>,
    /// When the active delta got its first row (for age-based flushes).
    pub(crate) active_since: Option<std::time::Instant>,
}

impl TableState {
    /// Newest version of `key` across the layers: active, sealed (newest first), files.
    /// `hash` is the key's [`gritdb_unify::key_hash`], computed once for all the deltas.
    pub(crate) fn exists(&self, key: &[u8], hash: u64) -> bool {
        match self.active.get_hashed(key, hash) {
            Some(l) => l == Lookup::Put,
            None => self.exists_below_active(key, hash),
        }
    }

    pub(crate) fn exists_below_active(&self, key: &[u8], hash: u64) -> bool {
        for s in self.sealed.iter().rev() {
            if let Some(l) = s.get_hashed(key, hash) {
                return l == Lookup::Put;
            }
        }
        self.store.contains_key(key)
    }
}

/// Shared state of one table. Handles ([`Table`]) point at it.
pub(crate) struct TableInner {
    pub(crate) name: String,
    pub(crate) id: u64,
    pub(crate) dir: PathBuf,
    pub(crate) codec: Arc<RowCodec>,
    pub(crate) account: TableAccount,
    /// `None` once dropped: every byte the table held is released at that moment.
    pub(crate) state: Mutex<Option<TableState>>,
    /// Set by `drop_table` just before it renames the directory into `trash/` (cleared again
    /// when that rename fails), so a read or flush that meets the files gone in the moment
    /// before `state` is taken reports the table as dropped ([`Self::explain`]).
    pub(crate) dropping: AtomicBool,
    /// Serialises flushes of this table (held across encode/write/fsync; never needed by
    /// ingest, delete, drop or limit changes).
    pub(crate) flush_lock: Mutex<()>,
    pub(crate) flush_scheduled: AtomicBool,
    pub(crate) seq: AtomicU64,
    /// What flushing this table's largest sealed delta needs ([`Shared::delta_flush_need`];
    /// 0 when none), kept beside
    /// `state.sealed` so the write admission rule ([`Shared::flush_room_short`]) can read
    /// every table's without taking their locks.
    pub(crate) largest_sealed: AtomicUsize,
    pub(crate) shared: Arc<Shared>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a critical section of these locks leaves the state consistent (every
    // mutation is applied after its fallible steps), so poisoning is ignored.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TableInner {
    /// A table over `store`, with an empty active delta; writes get sequence numbers from
    /// `next_seq` on.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::needless_pass_by_value)] // the table keeps clones of the handle
    pub(crate) fn new(
        name: String,
        id: u64,
        dir: PathBuf,
        codec: Arc<RowCodec>,
        account: TableAccount,
        store: TableStore,
        next_seq: u64,
        shared: &Arc<Shared>,
    ) -> Self {
        Self {
            name,
            id,
            dir,
            codec: Arc::clone(&codec),
            account: account.clone(),
            state: Mutex::new(Some(TableState {
                active: DeltaStore::new(codec, &shared.ctl, Some(&account)),
                sealed: VecDeque::new(),
                store,
                last_flush_error: None,
                active_since: None,
            })),
            flush_lock: Mutex::new(()),
            flush_scheduled: AtomicBool::new(false),
            dropping: AtomicBool::new(false),
            seq: AtomicU64::new(next_seq),
            largest_sealed: AtomicUsize::new(0),
            shared: Arc::clone(shared),
        }
    }

    /// True once `drop_table` has begun committing the drop (its directory is being or has
    /// been renamed into `trash/`) or has taken the table's state.
    pub(crate) fn is_dropped(&self) -> bool {
        self.dropping.load(Ordering::Acquire) || lock(&self.state).is_none()
    }

    /// An error of a read or flush of this table, as the caller should see it: a file-layer
    /// error met because the table was dropped meanwhile (its files gone) is
    /// [`Error::TableNotFound`].
    pub(crate) fn explain(&self, e: Error) -> Error {
        if self.is_dropped() {
            return Error::TableNotFound { name: self.name.clone() };
        }
        // A refusal met once the engine is closed is the engine gone (`Scan::stop_waiting`).
        if e.is_memory_limit() && self.shared.closed.load(Ordering::Acquire) {
            return Error::Closed("the engine".into());
        }
        e
    }

    pub(crate) fn state(&self) -> Result<MutexGuard<'_, Option<TableState>>> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(Error::Closed("the engine".into()));
        }
        let g = lock(&self.state);
        if g.is_none() {
            return Err(Error::TableNotFound { name: self.name.clone() });
        }
        Ok(g)
    }

    fn new_delta(&self) -> DeltaStore {
        DeltaStore::new(Arc::clone(&self.codec), &self.shared.ctl, Some(&self.account))
    }

    /// Seals the active delta (when not empty) and hands it to the writer queue.
    pub(crate) fn seal(&self, st: &mut TableState) -> bool {
        self.seal_with(st, 0)
    }

    /// [`Self::seal`] of a delta that reached the flush threshold by writes: the next delta's
    /// key map starts at this one's key count ([`DeltaStore::with_key_hint`]), so a table
    /// filling delta after delta does not rehash its way up again in each. Only when this
    /// map is at most a quarter of the threshold: a successor map presized for a delta of
    /// mostly keys would make the next small write seal a delta of its own
    /// (`breaker_encode6::a_small_write_after_a_big_batch_does_not_seal_alone`). Seals for
    /// age, pressure, an explicit flush or replay give no hint.
    pub(crate) fn seal_full(&self, st: &mut TableState) -> bool {
        let hint = if st.active.key_map_bytes() <= self.shared.table_flush_bytes() / 4 { st.active.len() } else { 0 };
        self.seal_with(st, hint)
    }

    fn seal_with(&self, st: &mut TableState, key_hint: usize) -> bool {
        if st.active.is_empty() {
            return false;
        }
        let old = std::mem::replace(&mut st.active, self.new_delta().with_key_hint(key_hint));
        self.largest_sealed.fetch_max(Shared::delta_flush_need(&old), Ordering::AcqRel);
        st.sealed.push_back(Arc::new(old));
        st.active_since = None;
        true
    }

    /// Highest write sequence number in committed files.
    pub(crate) fn flushed_seq(&self) -> u64 {
        lock(&self.state).as_ref().map_or(0, |s| s.store.flushed_seq())
    }

    /// Re-applies one write-ahead-log record at open (puts as upsert, deletes as delete),
    /// flushing inline when memory runs short. The caller keeps replay under the write soft
    /// limit (see `Engine::open`), so a table replayed under a smaller limit than it was
    /// written with can still be scanned and flushed.
    ///
    /// Returns the sequence numbers the record used: its rows for a put, its applied deletes
    /// (keys that existed) for a delete — so the caller can replay a record in slices.
    ///
    /// A record that does not fit the table — columns, types, nulls or values it refuses, or a
    /// row above this engine's `max_row_bytes` — is [`gritdb_storage::StorageError::CorruptWal`]
    /// naming the record's segment and offset ([`Self::unreplayable`]); memory and I/O errors
    /// of the flushes it causes stay what they are.
    pub(crate) fn replay(&self, rec: &WalRecord) -> Result<u64> {
        for attempt in 0..2 {
            let res = {
                let mut g = self.state()?;
                let Some(st) = g.as_mut() else { return Ok(0) };
                let bad = |e: Error| self.unreplayable(rec, &e);
                let res = match rec.op {
                    WalOp::Put => {
                        // Records log view columns as offset columns: back to the table's types.
                        let batch = rec.batch_as(self.codec.schema()).map_err(|e| bad(e.into()))?;
                        self.codec.validate(&batch).map_err(|e| bad(e.into()))?;
                        let keys = self.codec.keys().encode_batch(&batch).map_err(|e| bad(e.into()))?;
                        st.active
                            .apply_puts(&batch, &keys, rec.first_seq, || Ok::<(), Error>(()))
                            .map(|()| batch.num_rows() as u64)
                            .map_err(|e| if matches!(e, Error::Input(gritdb_unify::UnifyError::RowTooLarge { .. })) { bad(e) } else { e })
                    }
                    WalOp::Delete => {
                        let batch = rec.batch_as(&st.active.key_schema()).map_err(|e| bad(e.into()))?;
                        self.codec.validate_keys(&batch).map_err(|e| bad(e.into()))?;
                        let keys = self.codec.keys().encode_key_columns(batch.columns()).map_err(|e| bad(e.into()))?;
                        let hashes = gritdb_unify::hash_keys(&keys);
                        let items: Vec<(usize, bool)> = unique_rows(&keys, &hashes)
                            .into_iter()
                            .filter_map(|i| {
                                let (k, h) = (keys.row(i), hashes[i]);
                                match st.active.get_hashed(k.as_ref(), h) {
                                    Some(Lookup::Put) => Some((i, st.exists_below_active(k.as_ref(), h))),
                                    Some(Lookup::Deleted) => None,
                                    None => st.exists_below_active(k.as_ref(), h).then_some((i, true)),
                                }
                            })
                            .collect();
                        st.active.apply_deletes(&keys, &items, rec.first_seq, || Ok::<(), Error>(())).map(|()| items.len() as u64)
                    }
                };
                if res.is_ok() && st.active_since.is_none() && !st.active.is_empty() {
                    st.active_since = Some(Instant::now());
                }
                if res.is_ok() && st.active.bytes() >= self.shared.table_flush_bytes() {
                    self.seal(st);
                }
                res
            };
            match res {
                Err(e) if e.is_memory_limit() && attempt == 0 => {
                    self.seal_and_flush()?;
                }
                other => return other,
            }
        }
        Ok(0)
    }

    /// The error for a WAL record of this table that cannot be replayed into it: the log's
    /// `CorruptWal` naming the record's segment and offset, with `e` (what the table refused)
    /// as the detail. Before, a record whose column name or type was damaged under a valid
    /// checksum surfaced at `Engine::open` as a bare `SchemaMismatch`, naming no file.
    fn unreplayable(&self, rec: &WalRecord, e: &Error) -> Error {
        let what = match rec.op {
            WalOp::Put => "put",
            WalOp::Delete => "delete",
        };
        let hint = if matches!(e, Error::Input(gritdb_unify::UnifyError::RowTooLarge { .. })) {
            " (the record was written with a larger EngineConfig::max_row_bytes: reopen with one at least this large to replay it)"
        } else {
            ""
        };
        Error::Storage(rec.position.corrupt(format!(
            "{what} record of table `{}` (id {}, sequence numbers {}..={}) cannot be replayed into the table: {e}{hint}",
            self.name, rec.table, rec.first_seq, rec.last_seq
        )))
    }

    /// Seals the active delta and flushes every sealed delta, on the caller's thread
    /// (`flush_threads`): replay's way to make room, as it runs before the background
    /// writer starts. Returns rows written.
    pub(crate) fn seal_and_flush(&self) -> Result<u64> {
        if let Some(st) = lock(&self.state).as_mut() {
            self.seal(st);
        }
        self.flush_sealed(self.shared.config.flush_threads, None)
    }

    /// Bytes of this table's active and sealed deltas (what [`Self::seal_and_flush`] frees).
    pub(crate) fn delta_bytes(&self) -> usize {
        lock(&self.state).as_ref().map_or(0, |st| st.active.bytes() + st.sealed.iter().map(|d| d.bytes()).sum::<usize>())
    }

    /// What flushing the active delta needs ([`Shared::delta_flush_need`]), for
    /// [`EngineInner::scan_flush_room_short`].
    pub(crate) fn active_flush_need(&self) -> usize {
        lock(&self.state).as_ref().map_or(0, |s| Shared::delta_flush_need(&s.active))
    }

    /// Active delta bytes (for choosing what to flush under pressure).
    pub(crate) fn active_bytes(&self) -> usize {
        lock(&self.state).as_ref().map_or(0, |s| s.active.bytes())
    }

    /// Writes every sealed delta and staged file of this table; returns rows written.
    /// Holds the table state lock only for in-memory steps, never across encode/write/fsync.
    /// `threads`: the threads this flush and its compactions use (`flush_threads` when a caller
    /// waits for it, `background_flush_threads` on the background writer). `before`: when
    /// given, only deltas whose rows all have sequence numbers below it (those sealed before
    /// a caller's [`Table::flush`] read it) are written; the first newer one ends the flush.
    /// Without it a writer sealing delta after delta kept a caller's flush going as long as
    /// it wrote (helper-52's F2: a `flush()` beside a loop of upserts returned 57 s after the
    /// loop stopped).
    pub(crate) fn flush_sealed(&self, threads: usize, before: Option<u64>) -> Result<u64> {
        let _flush = lock(&self.flush_lock);
        let mut rows = 0u64;
        loop {
            self.commit_staged(threads)?;
            let sealed = {
                let g = self.state()?;
                let Some(st) = g.as_ref() else { break };
                match st.sealed.front() {
                    Some(s) if before.is_none_or(|b| s.max_seq() < b) => Arc::clone(s),
                    _ => break,
                }
            };
            match self.flush_delta(sealed, threads)? {
                Some(n) => rows += n,
                None => break, // the table was dropped
            }
            // Files this delta left with no live row are dropped now (no data file is read
            // or written, only the manifest), not after the last delta of a long flush: with
            // a writer sealing delta after delta, upserts of one 100 KB key at 1 MiB held
            // four files of it, three dead, and the writes waited for their memory
            // (`big_keys`). A failure is left to the compaction below, which reports it.
            if self.state()?.as_ref().is_some_and(|st| st.store.has_dead_files()) {
                let _ = self.compact(1, threads);
            }
        }
        // Every row this flush took is committed (manifest durable) by now: the flush has
        // succeeded, whatever the compaction after it does. A compaction that fails (I/O, a
        // damaged input file) leaves the committed files as they were; it is reported where
        // failures of background work are — a warning, `Table::stats().last_flush_error` and
        // `Engine::degraded_tables` — and retried by the next flush. (Before, its error was
        // the flush's, and a caller retried or gave up on rows that were already durable.) A
        // flush that gets this far with no error ends the degraded state.
        let compacted = self.compact(4, threads);
        match (lock(&self.state).as_mut(), compacted) {
            (Some(st), Ok(())) => st.last_flush_error = None,
            (Some(st), Err(e)) => {
                tracing::warn!(table = %self.name, error = %e, "compaction failed after a flush committed; the flushed rows are durable, the compaction is retried by the next flush");
                st.last_flush_error = Some(format!("{COMPACTION_FAILED}{e}"));
            }
            // The table was dropped meanwhile, its compaction stopped by the drop: the drop's
            // error, as the flush's rows are gone with the table.
            (None, Err(e)) => return Err(e),
            (None, Ok(())) => {}
        }
        Ok(rows)
    }

    /// Flushes one sealed delta (the oldest in the queue; caller holds the flush lock) and
    /// takes it off the queue; returns its rows written, `None` when the table was dropped.
    ///
    /// The delta is converted whole when the limit has room for its batches (about its bytes
    /// again). When it has not, the conversion fails with `MemoryLimit` and the delta is
    /// flushed in parts instead: its keys split into classes by their hash
    /// ([`FlushPart`]), each converted, staged and committed as a file of its own, halving a
    /// class that still does not fit, down to 1/[`MAX_FLUSH_PARTS`] of the keys. So a delta
    /// needs only one part's batches beside its rows, not the whole delta twice: without
    /// this, a close at 6 MiB left a 1.5 MB delta (one write) that needed 1.49 MB of batches
    /// with 1.48 MB free, and failed (`breaker_session13::close_after_refused_writers_returns_ok`).
    ///
    /// The parts are correct at any moment: the delta stays in the queue, newest for its
    /// keys, until its last part is staged, so scans and key checks read its rows and skip
    /// the part files' copies; each part's keys are disjoint from the others', so staging one
    /// marks only older files' rows deleted; only the last part records the delta's
    /// `max_seq` in the manifest, so a crash in between replays the whole delta from the WAL
    /// over the parts already written (upserts: the same final state). The delta's row
    /// blocks are released when its last part is staged.
    fn flush_delta(&self, sealed: Arc<DeltaStore>, threads: usize) -> Result<Option<u64>> {
        let mut rows = 0u64;
        let mut todo = vec![FlushPart::WHOLE];
        while let Some(part) = todo.pop() {
            // Rows -> Arrow arrays in batch blocks (no lock: the sealed delta is immutable),
            // sorted and decoded on up to `threads` threads; then the puts' keys and their
            // key-index set, also before the state lock (under it they held every write to
            // the table for 13–24 ms per 368k-row flush).
            let cfg = &self.shared.config;
            let Some(encoder) = self.state()?.as_ref().map(|st| st.store.put_keys()) else { return Ok(None) };
            let converted = sealed
                .to_batches_parallel(Category::BatchBlocks, true, FLUSH_BATCH_ROWS, cfg.flush_batch_bytes, threads, |k| {
                    part == FlushPart::WHOLE || part.holds(gritdb_unify::key_hash(k))
                })
                .map_err(Error::from)
                .and_then(|batches| Ok((encoder.encode(&batches.puts)?, batches)));
            let (keyed, batches) = match converted {
                Err(e) if e.is_memory_limit() && part.modulus < MAX_FLUSH_PARTS => {
                    tracing::info!(table = %self.name, parts = part.modulus * 2, "flush: no memory to convert the delta at once; converting it in parts");
                    todo.extend(part.halves());
                    continue;
                }
                // More rows than one data file can hold (`u32` row numbers): each half of the
                // keys goes into a file of its own.
                Err(Error::Storage(gritdb_storage::StorageError::FileTooLarge { rows, .. })) if part.modulus < MAX_FLUSH_PARTS => {
                    tracing::info!(table = %self.name, rows, parts = part.modulus * 2, "flush: more rows than one data file holds; writing the delta as several files");
                    todo.extend(part.halves());
                    continue;
                }
                other => other?,
            };
            let last = todo.is_empty();
            {
                let mut g = self.state()?;
                let Some(st) = g.as_mut() else { return Ok(None) };
                st.store.stage_keyed(keyed, &batches.delete_keys, if last { sealed.max_seq() } else { 0 })?;
                if last && st.sealed.front().is_some_and(|s| Arc::ptr_eq(s, &sealed)) {
                    st.sealed.pop_front();
                    self.largest_sealed.store(st.sealed.iter().map(|d| Shared::delta_flush_need(d)).max().unwrap_or(0), Ordering::Release);
                }
            }
            rows += batches.puts.iter().map(|b| b.num_rows() as u64).sum::<u64>();
            drop(batches);
            if last {
                // The sealed delta's row blocks go back to the pool here, before any disk
                // write (unless a running scan still holds the delta).
                drop(sealed);
                self.commit_staged(threads)?;
                return Ok(Some(rows));
            }
            self.commit_staged(threads)?;
        }
        Ok(Some(rows)) // not reached: the last part returns above
    }

    /// Runs up to `max` compactions of this table (caller holds the flush lock). The state
    /// lock is held only for planning and the in-memory swaps, never while reading or writing.
    fn compact(&self, max: usize, threads: usize) -> Result<()> {
        // Files found damaged are checked again first, off the table's lock: one changed on
        // disk since (restored from a backup) and matching its checksum compacts again; the
        // others are read no more and left out of the plans.
        let damaged = match self.state()?.as_ref() {
            Some(st) => st.store.damaged_files(),
            None => return Ok(()),
        };
        for guard in damaged {
            let _ = guard.verify_if_changed();
        }
        match self.compact_readable(max, threads) {
            // The compaction found an input damaged (its check before the rewrite): the file
            // is known damaged now, left out of the next plans, and `degraded_tables` shows
            // it for as long as it is ([`TableInner::degraded`]), not as this flush's record.
            // So is a missing input (`MissingFile`: before, each flush's compaction picked it
            // again and failed, as for damaged files). Another `CorruptFile` (of a file not
            // known damaged: one whose keys decode out of order under a matching checksum) is
            // the flush's error as any other; before, any `CorruptFile` was taken for the
            // damage while some file was known damaged.
            Err(Error::Storage(gritdb_storage::StorageError::CorruptFile { path, .. } | gritdb_storage::StorageError::MissingFile { path, .. }))
                if self.state()?.as_ref().is_some_and(|st| st.store.damaged_files().iter().any(|g| g.path() == path)) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// Why the table is degraded, `None` when it is not: its last flush's error, or its
    /// compaction's after a committed flush ([`TableState::last_flush_error`]), else the
    /// damage of a data file found damaged by any read (a scan's, a compaction's), for as
    /// long as the file does not match its checksum: from the read that found it (before, a
    /// scan's finding showed only after the next flush) until the read that finds the file
    /// restored (before, until the next flush after it).
    pub(crate) fn degraded(st: &TableState) -> Option<String> {
        st.last_flush_error.clone().or_else(|| st.store.damage().map(|e| e.to_string()))
    }

    /// Up to `max` compactions of the table's files not found damaged, one after another.
    fn compact_readable(&self, max: usize, threads: usize) -> Result<()> {
        let opts = gritdb_storage::CompactionOptions::default();
        for _ in 0..max {
            let (mut plan, ctl, account, wopts) = {
                let mut g = self.state()?;
                let Some(st) = g.as_mut() else { return Ok(()) };
                let Some(plan) = st.store.plan_compaction(&opts) else { return Ok(()) };
                // A compaction frees nothing that is needed now: refused memory skips it
                // (below) rather than counting its writer past the limit, as a flush's does.
                // With three writers of 70-600 KB upserts at 4 and 8 MiB, compactions beside
                // the flushes counted up to 101 KB past the limit
                // (`peak_limit::concurrent_writers_of_big_rows_stay_under_small_limits`).
                let mut wopts = self.write_options(st, threads);
                wopts.count_past_limit = false;
                (plan, Arc::clone(st.store.controller()), st.store.account().cloned(), wopts)
            };
            let writing = self.shared.file_write();
            let done = plan.execute(&wopts, &ctl, account.as_ref());
            drop(writing);
            if let Err(e) = done {
                plan.abandon();
                if matches!(e, gritdb_storage::StorageError::Memory(_)) {
                    tracing::info!(table = %self.name, "compaction skipped: no memory for it now");
                    return Ok(());
                }
                return Err(e.into());
            }
            {
                let mut g = self.state()?;
                let Some(st) = g.as_mut() else { return Ok(()) };
                if let Err(e) = st.store.install_compaction(&mut plan) {
                    drop(g);
                    plan.abandon();
                    return Err(e.into());
                }
            }
            if let Err(e) = plan.commit() {
                if let Some(st) = self.state()?.as_mut() {
                    st.store.uninstall_compaction(&plan);
                }
                plan.abandon();
                return Err(e.into());
            }
            let inputs = plan.inputs();
            let mut g = self.state()?;
            let Some(st) = g.as_mut() else { return Ok(()) };
            let rows = st.store.finish_compaction(plan);
            tracing::debug!(table = %self.name, ?inputs, rows, "compaction done");
        }
        Ok(())
    }

    /// The table's data-file write options, encoding on up to `threads` threads, with row
    /// groups cut at half the flush threshold (under the limit a lowering heads for:
    /// [`Shared::target_flush_bytes`]; at most storage's 32 MiB default), so a flush's
    /// writer buffers fit in the flush headroom beside its batches at any limit (headroom
    /// ≥ 2 × threshold: [`crate::engine::Shared::flush_headroom`]).
    fn write_options(&self, st: &TableState, threads: usize) -> gritdb_storage::WriteOptions {
        let mut opts = st.store.write_options().clone();
        opts.encode_threads = threads.max(1);
        opts.row_group_bytes = opts.row_group_bytes.min((self.shared.target_flush_bytes() / 2).max(64 << 10));
        opts
    }

    /// Writes and commits staged files in order. Data file, deletion vectors and manifest are
    /// written without the state lock.
    fn commit_staged(&self, threads: usize) -> Result<()> {
        loop {
            let (plan, ctl, account, opts) = {
                let g = self.state()?;
                let Some(st) = g.as_ref() else { return Ok(()) };
                let Some(plan) = st.store.plan_commit() else { return Ok(()) };
                let mut opts = self.write_options(st, threads);
                opts.memory_wait = Some(self.shared.memory_wait());
                (plan, Arc::clone(st.store.controller()), st.store.account().cloned(), opts)
            };
            let mut plan = plan;
            let writing = self.shared.file_write();
            let done = plan.execute(&opts, &ctl, account.as_ref());
            drop(writing);
            if let Err(e) = done {
                let err: Error = e.into();
                if let Ok(mut g) = self.state()
                    && let Some(st) = g.as_mut()
                {
                    st.last_flush_error = Some(err.to_string());
                }
                return Err(err);
            }
            let mut g = self.state()?;
            let flushed = g.as_mut().map(|st| {
                st.store.finish_commit(plan);
                st.last_flush_error = None;
                st.store.flushed_seq()
            });
            drop(g);
            if let Some(seq) = flushed {
                self.shared.note_flushed(self.id, Some(seq), true);
            }
        }
    }
}

/// How [`TableStats::last_flush_error`] and `Engine::degraded_tables` begin the error of a
/// compaction that failed after its flush committed (the flush itself returned `Ok`).
pub const COMPACTION_FAILED: &str = "compaction after a committed flush failed (the flushed rows are durable; retried by the next flush): ";

/// A handle to one table. Cheap to clone; every method is thread-safe.
///
/// Writes take Arrow `RecordBatch`es whose columns match the table schema exactly (names and
/// types in order). A write either applies the whole batch or returns an error and applies
/// nothing.
#[derive(Clone)]
pub struct Table {
    pub(crate) inner: Arc<TableInner>,
    pub(crate) engine: Arc<crate::engine::EngineInner>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("name", &self.inner.name).finish_non_exhaustive()
    }
}

impl Table {
    /// Table name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Arrow schema.
    pub fn schema(&self) -> arrow_schema::SchemaRef {
        Arc::clone(self.inner.codec.schema())
    }

    /// Primary-key column names.
    pub fn primary_key(&self) -> Vec<String> {
        let s = self.inner.codec.schema();
        self.inner.codec.keys().columns().iter().map(|&i| s.field(i).name().clone()).collect()
    }

    /// Inserts rows; returns rows inserted.
    ///
    /// # Errors
    /// [`Error::KeyExists`] when a key is already in the table, [`Error::DuplicateKey`] for a
    /// key repeated inside the batch, [`Error::Input`] for schema mismatches or nulls in key
    /// or non-nullable columns and rows above `max_row_bytes`, [`Error::ValueTooLarge`] for a
    /// row no scan could read back under the memory limit (a value above about a fifth of it),
    /// [`Error::MemoryLimit`] when memory cannot be had after
    /// backpressure (at once, without waiting, for a batch no flush could make room for:
    /// `docs/memory.md`, "Enforcement"). On any error nothing of the batch is applied.
    pub fn insert(&self, batch: &RecordBatch) -> Result<usize> {
        self.write(batch, WriteMode::Insert)
    }

    /// Inserts rows, replacing rows with the same key; returns rows written.
    ///
    /// # Errors
    /// As [`Table::insert`], except that existing keys are replaced.
    pub fn upsert(&self, batch: &RecordBatch) -> Result<usize> {
        self.write(batch, WriteMode::Upsert)
    }

    /// Replaces existing rows; returns rows updated. A key that does not exist rejects the
    /// whole batch with [`Error::KeyNotFound`] (nothing is applied).
    ///
    /// # Errors
    /// As [`Table::insert`], plus [`Error::KeyNotFound`].
    pub fn update(&self, batch: &RecordBatch) -> Result<usize> {
        self.write(batch, WriteMode::Update)
    }

    /// Deletes rows by key. `keys` holds exactly the primary-key columns (names and types in
    /// key order). Returns rows deleted: keys that do not exist, or repeat within `keys`,
    /// count once or not at all.
    ///
    /// # Errors
    /// [`Error::Input`] for a wrong key schema or a null key; [`Error::MemoryLimit`].
    pub fn delete(&self, keys: &RecordBatch) -> Result<usize> {
        let _admitted = self.engine.begin_write()?;
        let codec = &self.inner.codec;
        codec.validate_keys(keys)?;
        let rows = codec.keys().encode_key_columns(keys.columns())?;
        let hashes = gritdb_unify::hash_keys(&rows);
        let unique = unique_rows(&rows, &hashes);
        let wal = self.inner.shared.wal()?;
        // As for puts (`Self::write`): a big delete with an fsync per write has its record
        // encoded, written and fsynced on a pool thread while this one looks its keys up in
        // every layer; a delete that finds none drops its record unwritten.
        let overlap = unique.len() >= OVERLAP_WAL_ROWS && wal.syncs_each_append();
        let id = self.inner.id;
        // No wide-key bytes for a delete: its tombstones hold each key once (about the key
        // columns' Arrow bytes, already counted) and its flush builds no key set; charged as
        // a put, a delete of a flushed 162 KB key at 1 MiB asked for 890 KB and was refused
        // for good (helper-53; `big_keys::a_flushed_wide_key_can_be_deleted_at_a_small_limit`).
        self.with_backpressure(gritdb_storage::batch_bytes(keys), keys.num_rows(), 0, |st| {
            let pending = if overlap { Some(PendingAppend::start(&self.inner.shared, WalOp::Delete, keys, id)?) } else { None };
            let mut items = Vec::new();
            for &i in &unique {
                let key = rows.row(i);
                let key = key.as_ref();
                match st.active.get_hashed(key, hashes[i]) {
                    Some(Lookup::Put) => items.push((i, st.exists_below_active(key, hashes[i]))),
                    Some(Lookup::Deleted) => {}
                    None => {
                        if st.exists_below_active(key, hashes[i]) {
                            items.push((i, true));
                        }
                    }
                }
            }
            if items.is_empty() {
                return Ok(0);
            }
            let n = items.len() as u64;
            let seq = self.inner.seq.fetch_add(n, Ordering::AcqRel);
            st.active.apply_deletes_with(&rows, &hashes, &items, seq, |place| match &pending {
                Some(p) => {
                    p.number(seq, seq + n - 1);
                    place();
                    p.finish()
                }
                None => wal.append(WalOp::Delete, id, seq, seq + n - 1, keys).map_err(Error::from),
            })?;
            Ok(items.len())
        })
    }

    fn write(&self, batch: &RecordBatch, mode: WriteMode) -> Result<usize> {
        let _admitted = self.engine.begin_write()?;
        let codec = &self.inner.codec;
        codec.validate(batch)?;
        let n = batch.num_rows();
        if n == 0 {
            // Nothing to apply, but a dropped table or a closed engine says so, as every
            // other write (an empty delete included) does.
            drop(self.inner.state()?);
            return Ok(0);
        }
        let keys = codec.keys().encode_batch(batch)?;
        // Before the memory wait: a row above `max_row_bytes` fits under no limit.
        codec.check_row_sizes(batch, &keys)?;
        self.check_value_sizes(batch, &keys)?;
        let hashes = gritdb_unify::hash_keys(&keys);
        if let Some((first, row)) = first_duplicate(&keys, &hashes) {
            return Err(Error::DuplicateKey { table: self.inner.name.clone(), first, row });
        }
        let wal = self.inner.shared.wal()?;
        // In both sync modes: with `Relaxed` the record's encoding and `write` overlap the
        // rows' encoding as the fsync does with `PerBatch`. (Relaxed appended inline from
        // e4d27a7 until the admission counted the writes being admitted to other tables,
        // `Shared::admit`: before that, concurrent relaxed writers at an 8 MiB limit passed
        // the soft limit together and left deltas no flush had the memory to write,
        // `breaker_walpool7`.)
        let overlap = n >= OVERLAP_WAL_ROWS;
        let id = self.inner.id;
        self.with_backpressure(gritdb_storage::batch_bytes(batch), n, encoded_bytes(&keys), |st| {
            if !overlap {
                self.check_keys(st, batch, &keys, &hashes, mode)?;
                let seq = self.inner.seq.fetch_add(n as u64, Ordering::AcqRel);
                st.active.apply_puts_with(batch, &keys, &hashes, seq, |encode| {
                    wal.append(WalOp::Put, id, seq, seq + n as u64 - 1, batch)?;
                    encode();
                    Ok::<(), Error>(())
                })?;
                return Ok(n);
            }
            // A big batch with an fsync per write: a pool thread encodes the WAL record while
            // this one checks the keys and budgets the rows, then writes and fsyncs it while
            // this one encodes the rows and places their entries (under the table lock, so
            // unseen). The call returns after the append, and nothing stays applied unless it
            // succeeded (apply_puts_with puts the entries back and frees the rows); a
            // rejected write waits for its record to be dropped unwritten.
            let pending = PendingAppend::start(&self.inner.shared, WalOp::Put, batch, id)?;
            self.check_keys(st, batch, &keys, &hashes, mode)?;
            let seq = self.inner.seq.fetch_add(n as u64, Ordering::AcqRel);
            st.active.apply_puts_with(batch, &keys, &hashes, seq, |encode| {
                pending.number(seq, seq + n as u64 - 1);
                encode();
                pending.finish()
            })?;
            Ok(n)
        })
    }

    /// Refuses a batch with a row no scan could read back, no flush write or no open rebuild
    /// the key of, under the limit in force (the lower value a lowering heads for, if one is
    /// in progress) beside the key indexes of every table's files with a live row, which stay
    /// held (`EngineInner::live_file_index_bytes`; files with none are dropped by the next
    /// compaction): the row's
    /// [`gritdb_storage::row_memory_bytes`] (from its largest string or binary value, all of
    /// them, those of its key columns, and its encoded key) plus those indexes must be within
    /// the limit. Cheap for usual
    /// batches: when the batch's whole Arrow memory (at least every row's values) and its keys
    /// pass with the `key_index` category (at least the files' indexes) beside them, no row
    /// is measured.
    ///
    /// # Errors
    /// [`Error::ValueTooLarge`] naming the first row's largest value where it does not fit.
    fn check_value_sizes(&self, batch: &RecordBatch, keys: &arrow_row::Rows) -> Result<()> {
        let shared = &self.inner.shared;
        let limit = shared.target_limit();
        let batch_bytes = batch.get_array_memory_size();
        let key_bytes = keys.size();
        let held = shared.ctl.category_bytes(Category::KeyIndex);
        if gritdb_storage::row_memory_bytes(batch_bytes, batch_bytes, batch_bytes, key_bytes).saturating_add(held) <= limit {
            return Ok(());
        }
        let key_index = self.engine.live_file_index_bytes();
        let budget = limit.saturating_sub(key_index);
        let key_columns = self.inner.codec.keys().columns();
        for (row, v) in self.inner.codec.value_bytes_by_row(batch).into_iter().enumerate() {
            let key = keys.row(row).as_ref().len();
            // A row without a string or binary value has no value to blame: only a full key
            // index leaves it no room, which its flush reports (`MemoryLimit`, `key_index`).
            if v.largest == 0 || gritdb_storage::row_memory_bytes(v.largest, v.values, v.key_values, key) <= budget {
                continue;
            }
            let max = if key_columns.contains(&v.column) {
                // The largest value is part of the key: the largest `len` for which the row
                // fits with that value cut to `len`, its encoded key cut with it. (Before, the
                // encoded key stayed the refused value's: a 200,000-byte key at 1 MiB was told
                // "at most 142633 bytes" while 160,000 fit; helper-52's F3.)
                let key_with = |len: usize| key.saturating_sub(gritdb_keys::variable_key_bytes(v.largest)) + gritdb_keys::variable_key_bytes(len);
                let fits =
                    |len: usize| gritdb_storage::row_memory_bytes(len, v.values - v.largest + len, v.key_values - v.largest + len, key_with(len)) <= budget;
                let (mut lo, mut hi) = (0, v.largest);
                while lo < hi {
                    let mid = lo + (hi - lo).div_ceil(2);
                    if fits(mid) { lo = mid } else { hi = mid - 1 }
                }
                if fits(lo) { lo } else { 0 }
            } else {
                gritdb_storage::largest_value_within(budget, v.values - v.largest, v.key_values, key)
            };
            return Err(Error::ValueTooLarge {
                table: self.inner.name.clone(),
                column: self.inner.codec.schema().field(v.column).name().clone(),
                row,
                bytes: v.largest,
                max,
                limit,
                key_index,
            });
        }
        Ok(())
    }

    /// Insert: no key may exist in any layer; update: every key must exist.
    fn check_keys(&self, st: &TableState, batch: &RecordBatch, keys: &arrow_row::Rows, hashes: &[u64], mode: WriteMode) -> Result<()> {
        let n = keys.num_rows();
        match mode {
            WriteMode::Insert => {
                if let Some(row) = (0..n).find(|&i| st.exists(keys.row(i).as_ref(), hashes[i])) {
                    return Err(Error::KeyExists { table: self.inner.name.clone(), row, key: self.key_text(batch, row) });
                }
            }
            WriteMode::Update => {
                if let Some(row) = (0..n).find(|&i| !st.exists(keys.row(i).as_ref(), hashes[i])) {
                    return Err(Error::KeyNotFound { table: self.inner.name.clone(), row, key: self.key_text(batch, row) });
                }
            }
            WriteMode::Upsert => {}
        }
        Ok(())
    }

    /// Row `row`'s primary key as `name=value` pairs (Arrow's display of each value), for
    /// error messages. A value Arrow cannot display (a `Date32` beyond chrono's range) shows
    /// as its integer; one longer than [`KEY_TEXT_CHARS`] characters is cut there, with its
    /// length in bytes after it (a 100 KB key made a 100 KB error message: trial of
    /// 2026-12-03).
    fn key_text(&self, batch: &RecordBatch, row: usize) -> String {
        let schema = batch.schema();
        let opts = arrow_cast::display::FormatOptions::default().with_null("null");
        let show = |a: &dyn arrow_array::Array| arrow_cast::display::ArrayFormatter::try_new(a, &opts).ok().and_then(|f| f.value(row).try_to_string().ok());
        self.inner
            .codec
            .keys()
            .columns()
            .iter()
            .map(|&c| {
                let col = batch.column(c);
                let value = show(col.as_ref())
                    .or_else(|| arrow_cast::cast(col, &arrow_schema::DataType::Int64).ok().and_then(|a| show(a.as_ref())))
                    .unwrap_or_else(|| "?".to_owned());
                format!("{}={}", schema.field(c).name(), cut_text(&value))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Runs `apply` under the table lock; when it fails for memory, asks the writer to flush
    /// the largest deltas and waits (bounded by `backpressure_timeout`) before trying again.
    /// Writes that wait are admitted first come, first served (`Shared::queue`). The write
    /// has `rows` rows of `batch_bytes_hint` Arrow bytes whose encoded keys take `key_bytes`
    /// ([`encoded_bytes`]).
    fn with_backpressure(
        &self,
        batch_bytes_hint: usize,
        rows: usize,
        key_bytes: usize,
        mut apply: impl FnMut(&mut TableState) -> Result<usize>,
    ) -> Result<usize> {
        let deadline = crate::engine::deadline_after(self.inner.shared.config.backpressure_timeout);
        let mut waited = false;
        let shared = &self.inner.shared;
        // Whether the soft limit is checked again under the table lock (see below); off once
        // the engine had nothing to relieve, as for the check before the lock.
        let mut recheck = true;
        // Whether a flush was in flight when the last attempt ran (see the refusal below).
        let mut flushing;
        // What the write holds at its peak: its delta growth and its WAL record (about the
        // batch's Arrow bytes; the record is freed once written).
        let growth = Shared::delta_growth(batch_bytes_hint, rows, key_bytes);
        let peak = growth.saturating_add(batch_bytes_hint);
        // What flushing this write's rows needs beside its delta (`Shared::flush_room_short`).
        let convert = Shared::flush_need(batch_bytes_hint, rows, key_bytes);
        // This write's place among the writes waiting for memory, taken when it first waits
        // and kept until it returns (`Shared::queue`).
        let mut place = None;
        loop {
            // A write waiting for memory while the engine closes gives up (the flushes that
            // would free memory are stopping, or `close` needs that memory for its last
            // flush; both wait for admitted writes).
            self.engine.check_writable()?;
            // A write waiting for memory whose table is dropped meanwhile stops waiting (and
            // leaves the queue, where its peak counted ahead of every later write): the wait
            // below takes no table lock, so without this it waited out the whole timeout and
            // returned `MemoryLimit` (`fair_admission::a_write_waiting_for_memory_when_its_table_is_dropped_returns_table_not_found`).
            if waited {
                drop(self.inner.state()?);
            }
            // A write no flush can make room for is refused now, not after the timeout (read
            // again each time round: the limit may have been changed meanwhile).
            if let Some(need) = shared.never_fits(growth, convert) {
                let e: Error = shared.ctl.limit_error(gritdb_memctl::Category::RowBlocks, need).into();
                tracing::warn!(table = %self.inner.name, error = %e, "memory limit error returned: the write needs more than the limit");
                return Err(e);
            }
            // Soft limit for writes: leave the flush headroom to the writer, else a full
            // engine could not flush (a flush needs memory to free memory). The write's whole
            // peak must fit under it, not only the memory in use before it: a write admitted
            // just under the soft limit took its delta growth and its WAL record from the
            // headroom, and the flush running beside it counted its Parquet writer's steps
            // past the limit (100-row inserts of 240-300 KB at 1-4 MiB: up to 149 KB past,
            // `peak_limit`).
            // The writes waiting ahead of this one count as memory in use: they are admitted
            // first (`Shared::queued_ahead`).
            let soft = shared.write_soft_limit();
            let ahead = shared.queued_ahead(place.as_ref());
            if shared.pressure_bytes().saturating_add(ahead).saturating_add(peak) > soft && self.engine.relieve_pressure(true) {
                place.get_or_insert_with(|| shared.queue(peak));
                if !waited {
                    tracing::info!(table = %self.inner.name, used = shared.ctl.used(), soft, "backpressure: waiting for the writer to free memory");
                    waited = true;
                }
                if !self.engine.wait_for_memory(deadline) {
                    let requested = peak.max(1);
                    let e: Error = shared.ctl.limit_error(gritdb_memctl::Category::RowBlocks, requested).into();
                    tracing::warn!(table = %self.inner.name, error = %e, "memory limit error returned");
                    return Err(e);
                }
                continue;
            }
            // What the write adds to its delta for the room-to-flush check below: its growth
            // plus one chunk, as rows are carved from whole chunks (a 14.7 KB row that opened
            // a chunk took 64 KiB at 1 MiB, and the flush of the 136 KiB-key delta beside it
            // then found 5 KiB too little: `big_keys`).
            let room_growth = growth.saturating_add(shared.ctl.chunk_size());
            // Read before the table lock (it reads every table); 0 when the cheap bound in
            // `flush_room_short` already admits the write.
            let largest_sealed = if shared.flush_room_certain(room_growth.saturating_add(shared.admitting())) { 0 } else { self.engine.largest_sealed_delta() };
            let res = {
                let mut g = self.inner.state()?;
                // From here to the end of the apply, this write's peak (its delta growth and
                // its WAL record, about the batch's bytes) counts as memory in use for the
                // writes to other tables that check meanwhile, and theirs for this one
                // (`Shared::admit`).
                let admission = shared.admit(peak);
                let others = admission.others;
                // A write must leave the memory to flush what it leaves behind: converting a
                // sealed delta to batches needs about its bytes again, so a big write that
                // filled the engine with deltas larger than the free memory left a table no
                // flush or scan could get memory for (8 writers of 0.5-3 MB batches at 8 MiB:
                // `breaker_session12::many_writers_at_tiny_limits_with_big_batches_never_hang`).
                let active = g.as_ref().map_or(0, |st| Shared::delta_flush_need(&st.active));
                if let Some(need) = shared.flush_room_short(room_growth.saturating_add(others), convert, active, largest_sealed) {
                    drop(admission);
                    drop(g);
                    let e: Error = shared.ctl.limit_error(gritdb_memctl::Category::RowBlocks, need.max(1)).into();
                    // Nothing to flush and no other write being admitted: waiting cannot
                    // help; the write is too big for what is free. (Writes admitted before
                    // this one become deltas a flush can free, or fail and give their bytes
                    // back: worth the wait.)
                    // Batches and readers scans hold come back too: a 3.3 MB insert at
                    // 16 MiB beside another thread's 11 MB of held batches was refused here
                    // at once (helper-48).
                    let relieved = self.engine.relieve_pressure(true) || others > 0 || shared.scans_hold();
                    if !relieved || !self.engine.wait_for_memory(deadline) {
                        tracing::warn!(table = %self.inner.name, error = %e, "memory limit error returned: no room to flush this write");
                        return Err(e);
                    }
                    place.get_or_insert_with(|| shared.queue(peak));
                    if !waited {
                        tracing::info!(table = %self.inner.name, used = shared.ctl.used(), "backpressure: waiting for room to flush this write");
                        waited = true;
                    }
                    continue;
                }
                // Checked again under the table lock: writers that passed the check above
                // together and then queued on this lock would otherwise each spend the flush
                // headroom in turn, up to the hard limit, and leave a full engine whose flush
                // could not get the memory to convert a delta (24 writers on one table at an
                // 8 MiB limit: `breaker_write11`). Such a writer waits like the one above.
                if recheck && shared.pressure_bytes().saturating_add(others).saturating_add(peak) > shared.write_soft_limit() {
                    drop(admission);
                    drop(g);
                    if !self.engine.relieve_pressure(true) && others == 0 {
                        recheck = false;
                        continue;
                    }
                    place.get_or_insert_with(|| shared.queue(peak));
                    if !waited {
                        tracing::info!(table = %self.inner.name, used = shared.ctl.used(), "backpressure: waiting for the writer to free memory");
                        waited = true;
                    }
                    if !self.engine.wait_for_memory(deadline) {
                        let e: Error = shared.ctl.limit_error(gritdb_memctl::Category::RowBlocks, peak.max(1)).into();
                        tracing::warn!(table = %self.inner.name, error = %e, "memory limit error returned");
                        return Err(e);
                    }
                    continue;
                }
                let st = g.as_mut().ok_or_else(|| Error::TableNotFound { name: self.inner.name.clone() })?;
                // A flush running now may free what a refused write needs; read before the
                // write, so one that ends between the refusal and the retry below counts.
                flushing = self.engine.writer.in_flight() > 0;
                let res = apply(st);
                if res.is_ok() && st.active_since.is_none() && !st.active.is_empty() {
                    st.active_since = Some(Instant::now());
                }
                if res.is_ok() && st.active.bytes() >= self.inner.shared.table_flush_bytes() && self.inner.seal_full(st) {
                    self.engine.writer.schedule(&self.inner);
                }
                res
            };
            match res {
                Err(e) if e.is_memory_limit() => {
                    place.get_or_insert_with(|| shared.queue(peak));
                    if !waited {
                        tracing::info!(table = %self.inner.name, "backpressure: waiting for the writer to free memory");
                        waited = true;
                    }
                    if !self.engine.relieve_pressure(true) {
                        // Nothing left to flush. If a flush was running when the write was
                        // refused, it has ended since and given its memory back: try again
                        // (at an 8 MiB limit a 3 MB write was refused beside a flush's 3 MB
                        // of batches and gave up just after they were freed; breaker_slices).
                        // A write refused with no flush running has nothing to wait for.
                        if flushing && Instant::now() < deadline {
                            continue;
                        }
                        // Nor a scan's batches and readers, which come back when their
                        // holders let go.
                        if shared.scans_hold() && self.engine.wait_for_memory(deadline) {
                            continue;
                        }
                        tracing::warn!(table = %self.inner.name, error = %e, "memory limit error returned");
                        return Err(e);
                    }
                    if !self.engine.wait_for_memory(deadline) {
                        tracing::warn!(table = %self.inner.name, error = %e, "memory limit error returned");
                        return Err(e);
                    }
                }
                other => {
                    if waited {
                        tracing::info!(table = %self.inner.name, "backpressure ended");
                    }
                    if other.is_ok() {
                        self.engine.relieve_pressure(false);
                    }
                    return other;
                }
            }
        }
    }

    /// Makes everything written so far durable in committed Parquet files; returns the rows
    /// this call wrote to new files. A flush the background writer is running is waited for
    /// and its rows are not counted, so after a steady load this is often 0 (or only the
    /// rows of the last, unsealed delta) although everything is durable when it returns.
    /// "So far" is the moment of the call: rows other threads write while it runs are left to
    /// the background writer (or the next flush), so a steady writer cannot keep it going.
    ///
    /// A compaction that runs after the commit (merging small files, rewriting files with
    /// many deleted rows) and fails does not fail the flush: its rows are durable when it
    /// returns `Ok`. The compaction's failure is logged, shown in
    /// [`TableStats::last_flush_error`] and `Engine::degraded_tables` (beginning with
    /// [`COMPACTION_FAILED`]) and retried by the next flush.
    ///
    /// A flush refused memory while others hold some they give back — scans (their readers
    /// and the batches their callers hold), writes being applied, other flushes — waits for
    /// releases and tries again, up to `backpressure_timeout`, as a write does; with no such
    /// holder, or once `Engine::close` has begun, the refusal is returned at once. Before, a
    /// flush beside a scan reading a row near the bound was refused at once (helper-47's F3:
    /// "requested 804.5 KiB for `write_buffers`", the scan's reader holding 3.2 MiB of 4 MiB,
    /// done a few milliseconds later).
    ///
    /// # Errors
    /// [`Error::Storage`] on I/O failure of the commit (the rows stay in memory and are
    /// retried by the next flush), [`Error::MemoryLimit`] (the rows stay in memory too).
    pub fn flush(&self) -> Result<u64> {
        // Every row written before this call has a sequence number below `before` (a write
        // takes its numbers under the table lock), and so does every delta sealed here or
        // earlier; deltas sealed by later writes are left to the background writer.
        let before = {
            let mut g = self.inner.state()?;
            if let Some(st) = g.as_mut() {
                self.inner.seal(st);
            }
            self.inner.seq.load(Ordering::Acquire)
        };
        let shared = &self.inner.shared;
        let deadline = crate::engine::deadline_after(shared.config.backpressure_timeout);
        // `Engine::close` (whose flushes come here) does not wait: batches a caller keeps
        // across it would hold it for the whole timeout; its rows are in the log either way.
        let others = || self.engine.check_writable().is_ok() && (shared.scans_hold() || shared.admitting() > 0 || self.engine.writer.in_flight() > 0);
        loop {
            match self.inner.flush_sealed(shared.config.flush_threads, Some(before)) {
                Err(e) if e.is_memory_limit() && others() && self.engine.wait_for_memory(deadline) => {
                    tracing::debug!(table = %self.inner.name, error = %e, "flush waiting for memory others hold");
                }
                r => {
                    return r.map_err(|e| match e {
                        Error::Closed(_) => e,
                        e => self.inner.explain(e),
                    });
                }
            }
        }
    }

    /// Reads a consistent snapshot of the table: committed files minus deletion vectors,
    /// merged with sealed and active deltas (newest version of each key wins).
    ///
    /// # Errors
    /// [`Error::ColumnNotFound`] for an unknown projected column, [`Error::MemoryLimit`] when
    /// the delta snapshot, or the rows a filter or a narrower projection copies out of it,
    /// cannot be budgeted (after the `backpressure_timeout` wait); nothing is then held.
    #[allow(clippy::needless_pass_by_value)] // builder value, consumed by convention
    pub fn scan(&self, options: ScanOptions) -> Result<Scan> {
        self.scan_snapshot(&options)
    }

    /// One snapshot of the table read by `partitions` scans (at least 1) that return its rows
    /// between them, each row exactly once, so that as many threads can decode it at once:
    /// scan `i` reads row group `g` of the data file numbered `id` when
    /// `(g + id) % partitions == i` (so files of one row group each go to the scans in turn
    /// too), and scan 0 also the rows still in memory. Every scan is a [`Scan`]: `Send`, counted under `scan_buffers`,
    /// and refused and retried as one. With fewer row groups than scans, some return nothing.
    /// The snapshot is the same for all: writes after this call are in none of them.
    ///
    /// # Errors
    /// As [`Self::scan`]; [`Error::Config`] when `partitions` is above
    /// [`crate::MAX_THREADS`] (each partition is meant for a thread of its own), checked
    /// before the snapshot is taken.
    #[allow(clippy::needless_pass_by_value)] // builder value, consumed by convention
    pub fn scan_partitions(&self, options: ScanOptions, partitions: usize) -> Result<Vec<Scan>> {
        if partitions > crate::MAX_THREADS {
            return Err(Error::Config(format!(
                "scan_partitions: {partitions} partitions is more than MAX_THREADS ({}); each partition is read by a thread of its own",
                crate::MAX_THREADS
            )));
        }
        Ok(self.scan_snapshot(&options)?.into_partitions(partitions))
    }

    fn scan_snapshot(&self, options: &ScanOptions) -> Result<Scan> {
        self.engine.check_open()?;
        // The delta snapshot needs scan buffers: under memory pressure, wait for the writer
        // like a write does.
        let deadline = crate::engine::deadline_after(self.inner.shared.config.backpressure_timeout);
        loop {
            match Scan::new(&self.inner, &self.engine, options) {
                Err(e) if e.is_memory_limit() => {
                    if !self.engine.relieve_pressure(true) || !self.engine.wait_for_memory(deadline) {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
    }

    /// Live rows (files minus deletion vectors, plus deltas).
    ///
    /// # Errors
    /// [`Error::TableNotFound`] after the table was dropped.
    pub fn row_count(&self) -> Result<u64> {
        let mut n = 0u64;
        for b in self.scan(ScanOptions::default().projection(self.primary_key()))? {
            n += b?.num_rows() as u64;
        }
        Ok(n)
    }

    /// Table figures: files, rows, delta and index bytes.
    ///
    /// # Errors
    /// [`Error::TableNotFound`] after the table was dropped.
    pub fn stats(&self) -> Result<TableStats> {
        let g = self.inner.state()?;
        let st = g.as_ref().ok_or_else(|| Error::TableNotFound { name: self.inner.name.clone() })?;
        Ok(TableStats {
            files: st.store.file_count(),
            file_rows: st.store.live_rows(),
            active_delta_bytes: st.active.bytes(),
            sealed_deltas: st.sealed.len(),
            sealed_delta_bytes: st.sealed.iter().map(|d| d.bytes()).sum(),
            key_index_bytes: st.store.index().bytes(),
            accounted_bytes: self.inner.account.total_bytes(),
            manifest_version: st.store.version(),
            last_flush_error: st.last_flush_error.clone(),
            damaged_files: st.store.damaged_files().iter().map(|g| g.path().to_path_buf()).collect(),
            damage: st.store.damage().map(|e| e.to_string()),
        })
    }
}

/// Figures of one table ([`Table::stats`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TableStats {
    /// Data files (committed and staged).
    pub files: usize,
    /// Live rows in files.
    pub file_rows: u64,
    /// Bytes of the active delta (row blocks + key map).
    pub active_delta_bytes: usize,
    /// Sealed deltas waiting for the writer.
    pub sealed_deltas: usize,
    /// Bytes of the sealed deltas (row blocks + key maps).
    pub sealed_delta_bytes: usize,
    /// Key index bytes (hash table + key stores).
    pub key_index_bytes: usize,
    /// All bytes accounted to the table.
    pub accounted_bytes: usize,
    /// Manifest version of the last commit.
    pub manifest_version: u64,
    /// The error of the last flush (background or called) if it failed: a data file, deletion
    /// vector or manifest write (the flush returned that error; its rows stay in memory), or
    /// the compaction after a flush that committed (the text begins with
    /// [`COMPACTION_FAILED`]; the flush returned `Ok`, its rows are durable). Cleared by the
    /// next flush that commits and compacts without error.
    pub last_flush_error: Option<String>,
    /// Data files found damaged (their bytes do not match the CRC-32 the manifest records) or
    /// missing (not at their path) by a read or the check before a compaction, and not found
    /// matching since, by file id: scans reaching them fail with `CorruptFile` or
    /// `MissingFile` and compactions leave them out until they are restored
    /// (docs/architecture.md, "damaged files"). Empty when none is known.
    pub damaged_files: Vec<std::path::PathBuf>,
    /// The first damaged or missing file's error, as a read of it returns it and
    /// [`crate::Engine::degraded_tables`] shows it (which names the file and what to do);
    /// `None` when [`Self::damaged_files`] is empty.
    pub damage: Option<String>,
}

/// Walks the keys in order and calls `seen_before(first, row)` for every row whose key an
/// earlier row already had; stops early when it returns `true`. Returns the rows whose key
/// appears for the first time (complete only when the walk was not stopped).
///
/// Keys in strictly ascending order (a bulk load in key order, the peer workload's batches)
/// cannot repeat: that is checked first, one `memcmp` a row (`arrow-row` bytes order as the
/// keys do), and the hash-set walk runs only when it fails.
fn walk_keys(rows: &arrow_row::Rows, hashes: &[u64], mut seen_before: impl FnMut(usize, usize) -> bool) -> Vec<usize> {
    if (1..rows.num_rows()).all(|i| rows.row(i - 1) < rows.row(i)) {
        return (0..rows.num_rows()).collect();
    }
    let mut seen: HashTable<usize> = HashTable::with_capacity(rows.num_rows());
    let mut firsts = Vec::with_capacity(rows.num_rows());
    for i in 0..rows.num_rows() {
        let k = rows.row(i);
        let h = hashes[i];
        if let Some(&j) = seen.find(h, |&j| hashes[j] == h && rows.row(j).as_ref() == k.as_ref()) {
            if seen_before(j, i) {
                break;
            }
        } else {
            seen.insert_unique(h, i, |&j| hashes[j]);
            firsts.push(i);
        }
    }
    firsts
}

/// Bytes of all of `rows`' encoded keys (without the offsets), for the admission estimates
/// (`Shared::delta_growth`, `Shared::flush_need`).
fn encoded_bytes(rows: &arrow_row::Rows) -> usize {
    rows.lengths().sum()
}

/// Indices of the first occurrence of each distinct key.
fn unique_rows(rows: &arrow_row::Rows, hashes: &[u64]) -> Vec<usize> {
    walk_keys(rows, hashes, |_, _| false)
}

/// Characters of one key value an error message shows ([`Table::key_text`]).
const KEY_TEXT_CHARS: usize = 200;

/// `text` up to [`KEY_TEXT_CHARS`] characters, then `… (N bytes)` when it was longer.
fn cut_text(text: &str) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(KEY_TEXT_CHARS) {
        Some((at, _)) => format!("{}… ({} bytes)", &text[..at], text.len()).into(),
        None => text.into(),
    }
}

/// The first pair `(first, row)` of rows with equal keys.
fn first_duplicate(rows: &arrow_row::Rows, hashes: &[u64]) -> Option<(usize, usize)> {
    let mut dup = None;
    walk_keys(rows, hashes, |first, row| {
        dup = Some((first, row));
        true
    });
    dup
}

/// The WAL record of one big put, encoded and appended on the WAL record pool
/// ([`crate::writer::Writer::wal_pool`]) beside the write that owns it ([`Table::write`]):
/// [`Self::start`] hands the batch over, [`Self::number`] gives the record its sequence
/// numbers once the keys passed their checks, [`Self::finish`] waits for the write and fsync.
/// Dropped without a number (a rejected write), it cancels a record no pool thread took yet,
/// or waits for a running one to be dropped unwritten, so its `write_buffers` reservation is
/// back before the write returns.
///
/// Why a pool and not a thread per write: pool threads live between writes, so the record's
/// buffers (the Arrow IPC stream and the view columns' offset copy, ~1.4 MB per 8,192-row
/// TPC-H lineitem batch) come from warm allocator memory; a thread spawned per write got a
/// cold jemalloc arena and spent ~0.9 ms more per such batch in page faults
/// (docs/performance.md, seventh pass).
struct PendingAppend {
    numbered: std::cell::Cell<Option<std::sync::mpsc::Sender<(u64, u64)>>>,
    done: std::sync::mpsc::Receiver<std::thread::Result<Result<()>>>,
    /// `QUEUED` until a pool thread takes the task (`RUNNING`), or `CANCELLED` by a refused
    /// write first: the task then returns unrun and the write does not wait for a thread.
    state: Arc<std::sync::atomic::AtomicU8>,
}

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const CANCELLED: u8 = 2;

impl PendingAppend {
    /// Starts encoding `batch`'s record for table `table`.
    ///
    /// # Errors
    /// [`Error::Closed`] when the engine has no WAL record pool (closed).
    fn start(shared: &Arc<Shared>, op: WalOp, batch: &RecordBatch, table: u64) -> Result<Self> {
        let rt = shared.wal_pool().ok_or_else(|| Error::Closed("the WAL record pool".into()))?;
        let (go, numbered) = std::sync::mpsc::channel::<(u64, u64)>();
        let (finished, done) = std::sync::mpsc::sync_channel(1);
        let (shared, batch) = (Arc::clone(shared), batch.clone());
        let state = Arc::new(std::sync::atomic::AtomicU8::new(QUEUED));
        let task_state = Arc::clone(&state);
        crate::writer::spawn_blocking_on(rt, move || {
            if task_state.compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire).is_err() {
                return; // cancelled: the write was refused before a thread took this
            }
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
                let wal = shared.wal()?;
                let rec = wal.encode_record(op, &batch)?;
                // No sequence numbers: the write was rejected before its append (the sender
                // is dropped), and the record is dropped unwritten.
                let Ok((first, last)) = numbered.recv() else { return Ok(()) };
                wal.append_record(rec, table, first, last)?;
                Ok(())
            }));
            let _ = finished.send(res);
        });
        Ok(Self { numbered: std::cell::Cell::new(Some(go)), done, state })
    }

    /// Gives the record the write's sequence numbers `first..=last`; it is written and fsynced
    /// next.
    fn number(&self, first: u64, last: u64) {
        // A send fails only when the record already failed to encode: `finish` returns that.
        if let Some(go) = self.numbered.take() {
            let _ = go.send((first, last));
        }
    }

    /// Waits for the record: `Ok` once written and fsynced; a panic on the pool thread is
    /// resumed here, as a scoped thread's join would.
    ///
    /// # Errors
    /// The encoding's or the append's error; [`Error::Closed`] when the runtime shut down
    /// before the task ran (nothing was written).
    fn finish(&self) -> Result<()> {
        match self.done.recv() {
            Ok(Ok(res)) => res,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => Err(Error::Closed("the WAL record pool (the record was not written)".into())),
        }
    }
}

impl Drop for PendingAppend {
    fn drop(&mut self) {
        // Never numbered: the write was rejected. A task no thread took yet is cancelled;
        // a running one drops its record at once (its channel closed here): wait for that.
        if self.numbered.take().is_some() && self.state.compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire).is_err() {
            let _ = self.done.recv();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, Int64Array};
    use arrow_row::{RowConverter, SortField};
    use std::sync::Arc;

    fn keys(v: &[i64]) -> (arrow_row::Rows, Vec<u64>) {
        let conv = RowConverter::new(vec![SortField::new(arrow_schema::DataType::Int64)]).unwrap();
        let rows = conv.convert_columns(&[Arc::new(Int64Array::from(v.to_vec())) as ArrayRef]).unwrap();
        let hashes = gritdb_unify::hash_keys(&rows);
        (rows, hashes)
    }

    /// Ascending keys take the sorted path, everything else the hash walk; both find the
    /// same first duplicate and the same first occurrences (checked against a plain scan).
    #[test]
    fn duplicates_are_found_in_sorted_and_unsorted_batches() {
        let cases: &[&[i64]] =
            &[&[], &[7], &[1, 2, 3, 4], &[1, 2, 2, 3], &[-5, -1, 0, 9, 9], &[4, 3, 2, 1], &[3, 1, 3, 2, 1], &[1, 2, 3, 1], &[i64::MIN, -1, 0, 1, i64::MAX]];
        for v in cases {
            let (rows, hashes) = keys(v);
            let mut want_dup = None;
            'outer: for row in 0..v.len() {
                for first in 0..row {
                    if v[first] == v[row] {
                        want_dup = Some((first, row));
                        break 'outer;
                    }
                }
            }
            let want_firsts: Vec<usize> = (0..v.len()).filter(|&i| !v[..i].contains(&v[i])).collect();
            assert_eq!(first_duplicate(&rows, &hashes), want_dup, "{v:?}");
            assert_eq!(unique_rows(&rows, &hashes), want_firsts, "{v:?}");
        }
    }
}
