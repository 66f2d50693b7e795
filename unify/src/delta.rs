use crate::codec::{ColKind, ColReader, HEADER, OP_DELETE, OP_PUT, RowCodec};
use crate::error::UnifyError;
use arrow_array::{ArrayRef, RecordBatch, make_array};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_row::Rows;
use arrow_schema::{DataType, Schema, SchemaRef};
use gritdb_memctl::{BatchBlock, Category, MemoryController, Reservation, RowArena, RowAt, RowRef, TableAccount};
use hashbrown::{DefaultHashBuilder, HashTable};
use std::hash::BuildHasher;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

/// What a delta holds for a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// The newest version is a row (insert, upsert or update).
    Put,
    /// The newest version is a delete (tombstone).
    Deleted,
}

/// Arrow batches built from a delta.
#[derive(Debug)]
pub struct DeltaBatches {
    /// Rows put (full table schema), sorted by key when asked, cut into batches of at most
    /// `max_rows` rows and `max_bytes` encoded bytes, each in its own batch block.
    pub puts: Vec<RecordBatch>,
    /// Keys deleted (key columns only), sorted by key when asked.
    pub delete_keys: RecordBatch,
}

/// Runs a caller's commit with `work` (which it may call while its commit waits), then `work`
/// if the commit succeeded without calling it; a panic in either is caught and returned, so
/// the caller can undo what `work` did before resuming it (a panic from the thread that wrote
/// the WAL record must not leave entries behind a commit that did not happen).
fn commit_beside<E>(run: impl FnOnce(&mut dyn FnMut()) -> Result<(), E>, work: &mut dyn FnMut()) -> std::thread::Result<Result<(), E>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let res = run(&mut *work);
        if res.is_ok() {
            work();
        }
        res
    }))
}

fn key_of(row: &[u8]) -> &[u8] {
    &row[HEADER..HEADER + crate::codec::key_len(row)]
}

fn op_of(row: &[u8]) -> u8 {
    row[0]
}

/// Rows below which a part of a parallel sort is not worth a thread.
const MIN_SORT_PART: usize = 1 << 14;

/// The rows of `map` in arena order: grouped by block (a counting sort on the block id, below
/// `blocks`), each block's by offset. Reading rows in this order goes front to back through
/// each block instead of a cache and TLB miss per row in hash order (callgrind and timing of a
/// 600,000-row lineitem flush: the sort's row reads were most of its ~90 ms; issue 7), and rows
/// written in key order come out in key order, which the sorts after it detect in one pass.
fn arena_order(map: &HashTable<Entry>, blocks: usize) -> Vec<RowAt> {
    let Some(first) = map.iter().next() else { return Vec::new() };
    let mut start = vec![0usize; blocks + 1];
    for e in map {
        start[e.at.block() + 1] += 1;
    }
    for b in 0..blocks {
        start[b + 1] += start[b];
    }
    let mut next = start.clone();
    let mut out = vec![first.at; map.len()];
    for e in map {
        let b = e.at.block();
        out[next[b]] = e.at;
        next[b] += 1;
    }
    out
}

/// The rows starting at `rows` (`len` of them) that `keep` keeps, as `(key prefix, row)`
/// pairs, puts and deletes apart, in the order read: the prefix is the key's first 16 bytes,
/// big-endian, zero-padded ([`DeltaStore::select_sorted`]).
#[allow(clippy::type_complexity)]
fn read_keyed(
    arena: &RowArena,
    codec: &RowCodec,
    keep: &impl Fn(&[u8]) -> bool,
    rows: impl Iterator<Item = RowAt>,
    len: usize,
) -> (Vec<(u128, RowRef)>, Vec<(u128, RowRef)>) {
    let mut puts = Vec::with_capacity(len);
    let mut dels = Vec::new();
    for at in rows {
        let row = arena.get_from(at);
        let r = at.with_len(codec.row_len(row));
        let key = key_of(row);
        if !keep(key) {
            continue;
        }
        let mut p = [0u8; 16];
        let n = key.len().min(16);
        p[..n].copy_from_slice(&key[..n]);
        let item = (u128::from_be_bytes(p), r);
        if op_of(row) == OP_PUT { puts.push(item) } else { dels.push(item) }
    }
    (puts, dels)
}

/// Rows [`DeltaStore::decode`] reads before writing their columns: a multiple of 8 (a tile's
/// validity and boolean bits fill whole bytes); 128 rows of a few hundred bytes stay in L1/L2.
const TILE: usize = 128;

/// One row's regions after its header and key: null bitmap, fixed slots, variable-length bytes.
struct RowParts<'a> {
    bitmap: &'a [u8],
    fixed: &'a [u8],
    var: &'a [u8],
}

/// Where column `j`'s value lies in a row, for [`DeltaStore::decode`].
struct ColPlan {
    kind: ColKind,
    nullable: bool,
    /// Byte and bit of the column in the row's null bitmap.
    null_byte: usize,
    null_mask: u8,
    /// Offset of the column's fixed slot (for variable-length columns: the end of its bytes).
    at: usize,
    /// Slot holding the end of the previous variable-length column (its value's start), if any.
    start_at: Option<usize>,
}

fn read_u32(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// A variable-length column's value in a row: from the previous variable-length column's end
/// (slot `start_at`, or 0) to its own (slot `at`).
fn var_value<'a>(p: &RowParts<'a>, start_at: Option<usize>, at: usize) -> &'a [u8] {
    let start = start_at.map_or(0, |s| read_u32(p.fixed, s));
    &p.var[start..read_u32(p.fixed, at)]
}

/// Writes one bit per row of `parts` (`set`) into the bitmap `dst` from bit `base` on (`base`
/// a multiple of 8: whole bytes are written), and returns how many were unset.
fn fill_bits(dst: &mut [u8], base: usize, parts: &[RowParts<'_>], set: impl Fn(&RowParts<'_>) -> bool) -> usize {
    debug_assert_eq!(base % 8, 0);
    let mut unset = 0;
    for (d, rows) in dst[base / 8..base / 8 + parts.len().div_ceil(8)].iter_mut().zip(parts.chunks(8)) {
        let mut byte = 0u8;
        for (b, p) in rows.iter().enumerate() {
            let s = set(p);
            unset += usize::from(!s);
            byte |= u8::from(s) << b;
        }
        *d = byte;
    }
    unset
}

/// Copies the `N`-byte fixed slot at `at` of every row of `parts` into consecutive `N`-byte
/// values of `dst` (`dst.len() == N * parts.len()`).
fn copy_fixed<const N: usize>(dst: &mut [u8], parts: &[RowParts<'_>], at: usize) {
    for (d, p) in dst.chunks_exact_mut(N).zip(parts) {
        d.copy_from_slice(&p.fixed[at..at + N]);
    }
}

/// The rows of `parts`, each sorted by `cmp`, merged into one sorted list (ties: the earlier
/// part first).
fn merge_sorted(parts: &[Vec<(u128, RowRef)>], cmp: impl Fn(&(u128, RowRef), &(u128, RowRef)) -> std::cmp::Ordering) -> Vec<RowRef> {
    let mut heads: Vec<&[(u128, RowRef)]> = parts.iter().map(Vec::as_slice).filter(|p| !p.is_empty()).collect();
    let mut out = Vec::with_capacity(heads.iter().map(|h| h.len()).sum());
    while heads.len() > 1 {
        let mut best = 0;
        for i in 1..heads.len() {
            if cmp(&heads[i][0], &heads[best][0]) == std::cmp::Ordering::Less {
                best = i;
            }
        }
        out.push(heads[best][0].1);
        heads[best] = &heads[best][1..];
        if heads[best].is_empty() {
            heads.remove(best);
        }
    }
    if let Some(rest) = heads.first() {
        out.extend(rest.iter().map(|&(_, r)| r));
    }
    out
}

/// One key-map slot: the row and 32 bits of its key's hash, so growing the map rehashes from
/// the slot alone instead of reading every row's key back from the row blocks (that re-read,
/// a cache miss per row, was a quarter of the insert's CPU time in `perf`; issue 7).
/// 12 bytes: the row's start (its length is read back from the row, [`RowCodec::row_len`])
/// and the tag. (A full [`RowRef`] would make it 16: 7 more bytes per row at the map's load.)
#[derive(Clone, Copy)]
struct Entry {
    at: RowAt,
    tag: u32,
}

/// The one key hasher of the process: every delta hashes a key the same way, so a write
/// hashes each key once ([`key_hash`]) and probes the active and every sealed delta with it.
/// Randomly seeded per process (hashbrown's default, foldhash); hashes are never stored on disk.
static KEY_HASHER: LazyLock<DefaultHashBuilder> = LazyLock::new(DefaultHashBuilder::default);

/// Spreads a 32-bit tag to the 64-bit hash hashbrown wants: the tag in the low 32 bits (the
/// bucket index comes from the low bits) and a multiplicative mix of it (Knuth's golden-ratio
/// constant) in the high 32 (hashbrown's 7-bit control byte comes from the top bits).
/// `spread(h as u32) == h` for every hash [`key_hash`] returns.
fn spread(tag: u32) -> u64 {
    let t = u64::from(tag);
    (t.wrapping_mul(0x9E37_79B9_7F4A_7C15) & !0xFFFF_FFFF) | t
}

/// Hash of a key (its arrow-row bytes) as every [`DeltaStore`] of this process computes it.
/// Compute it once per key and pass it to the `*_hashed` methods.
pub fn key_hash(key: &[u8]) -> u64 {
    spread((KEY_HASHER.hash_one(key) >> 32) as u32)
}

/// [`key_hash`] of every row of `keys`, in row order.
pub fn hash_keys(keys: &Rows) -> Vec<u64> {
    keys.iter().map(|k| key_hash(k.as_ref())).collect()
}

/// Bytes held by a `HashTable<Entry>` of `capacity`: buckets × (entry + control byte) + one
/// group of trailing control bytes. hashbrown: capacity = buckets − 1 below 8 buckets, else
/// buckets × 7/8.
fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 { capacity + 1 } else { capacity / 7 * 8 };
    buckets * (std::mem::size_of::<Entry>() + 1) + 16
}

/// Smallest hashbrown capacity that holds `n` entries (for budgeting before growth).
fn capacity_for(n: usize) -> usize {
    if n < 4 {
        3
    } else if n < 8 {
        7
    } else {
        (n * 8 / 7).next_power_of_two() / 8 * 7
    }
}

/// One table's in-memory delta: encoded rows in a [`RowArena`] and a key → newest-row map.
///
/// Semantics of the primitive operations (the engine layers insert/update checks on top):
/// - [`DeltaStore::apply_puts`]: each row becomes the newest version of its key here; an older
///   version in this delta is freed.
/// - [`DeltaStore::apply_deletes`]: with a tombstone, the key's newest version becomes
///   "deleted" (it may exist in older layers); without, the key's entry here is simply removed.
///
/// Memory: row bytes under `row_blocks`, the map under `key_index`, both for the table.
pub struct DeltaStore {
    codec: Arc<RowCodec>,
    ctl: Arc<MemoryController>,
    table: Option<TableAccount>,
    arena: RowArena,
    map: HashTable<Entry>,
    map_res: Reservation,
    /// Keys the map is sized for at its first growth ([`Self::with_key_hint`]), then 0.
    key_hint: usize,
    puts: usize,
    tombstones: usize,
    max_seq: u64,
    /// Encoded key bytes of the keys held ([`Self::key_bytes`]).
    key_bytes: usize,
}

impl std::fmt::Debug for DeltaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaStore").field("puts", &self.puts).field("tombstones", &self.tombstones).finish_non_exhaustive()
    }
}

impl DeltaStore {
    /// An empty delta; it holds no memory until the first row.
    pub fn new(codec: Arc<RowCodec>, ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Self {
        Self {
            codec,
            ctl: Arc::clone(ctl),
            table: table.cloned(),
            arena: RowArena::new(ctl, table),
            map: HashTable::new(),
            map_res: Reservation::new(ctl, Category::KeyIndex, table),
            key_hint: 0,
            puts: 0,
            tombstones: 0,
            max_seq: 0,
            key_bytes: 0,
        }
    }

    /// This delta with its key map sized for `keys` keys at its first growth (typically the
    /// key count of the delta it replaces at a seal), so a delta that fills up like the last
    /// one never rehashes: growing by doubling moves every key about once more and touches a
    /// fresh table each time (`reserve_rehash` was 8% of an insert beside a flush, perf,
    /// `gritdb-soak bench`). Nothing is allocated until the first write; when the hinted size
    /// cannot be budgeted, the map grows as it would without a hint.
    #[must_use]
    pub fn with_key_hint(mut self, keys: usize) -> Self {
        self.key_hint = keys;
        self
    }

    /// The codec.
    pub fn codec(&self) -> &Arc<RowCodec> {
        &self.codec
    }

    /// Keys with a put row.
    pub fn puts(&self) -> usize {
        self.puts
    }

    /// Keys with a tombstone.
    pub fn tombstones(&self) -> usize {
        self.tombstones
    }

    /// Keys held (puts + tombstones).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when the delta holds no key.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Accounted bytes: row blocks plus the key map.
    pub fn bytes(&self) -> usize {
        self.arena.bytes() + self.map_res.size()
    }

    /// The `arrow-row` bytes of the [`Self::len`] keys held (put rows and tombstones). A
    /// flush of the delta holds these keys again beside its batches, in the key-index set it
    /// builds (and one batch's keys at a time while it builds it), so the engine's estimate
    /// of what the flush needs counts them: [`Self::bytes`] alone left out a key's width,
    /// and deltas of wide keys were admitted that no flush could write.
    pub fn key_bytes(&self) -> usize {
        self.key_bytes
    }

    /// Accounted bytes of the key map alone (part of [`Self::bytes`]).
    pub fn key_map_bytes(&self) -> usize {
        self.map_res.size()
    }

    /// Highest sequence number applied.
    pub fn max_seq(&self) -> u64 {
        self.max_seq
    }

    /// The newest entry for `key` (arrow-row bytes), if this delta holds one.
    pub fn get(&self, key: &[u8]) -> Option<Lookup> {
        self.get_hashed(key, key_hash(key))
    }

    /// [`Self::get`] with the key's [`key_hash`] computed by the caller.
    pub fn get_hashed(&self, key: &[u8], hash: u64) -> Option<Lookup> {
        let arena = &self.arena;
        let tag = hash as u32;
        self.map
            .find(hash, |e| e.tag == tag && key_of(arena.get_from(e.at)) == key)
            .map(|e| if op_of(arena.get_from(e.at)) == OP_PUT { Lookup::Put } else { Lookup::Deleted })
    }

    /// Every key with its entry kind.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], Lookup)> {
        self.map.iter().map(|e| {
            let row = self.arena.get_from(e.at);
            (key_of(row), if op_of(row) == OP_PUT { Lookup::Put } else { Lookup::Deleted })
        })
    }

    /// The map's capacity before a write, for [`Self::unreserve_map`].
    fn map_mark(&self) -> usize {
        self.map.capacity()
    }

    /// Gives back map capacity grown for a batch that was then refused (its rows were never
    /// installed), so a write that applies nothing holds nothing: the map returns to its
    /// capacity before (not below it: a hinted map keeps its size). A hint the refused write
    /// used is dropped, not restored: the write may have failed for the memory the hinted
    /// map took, and its retry must not take it again.
    fn unreserve_map(&mut self, capacity_before: usize) {
        if self.map.capacity() > capacity_before {
            self.map.shrink_to(capacity_before, |e| spread(e.tag));
            self.map_res.try_resize(table_bytes(self.map.capacity())).ok();
        }
    }

    /// Budgets and grows the map so `additional` more keys fit without reallocation.
    /// `write_bytes` is the write's row bytes: a key hint applies only with room to spare,
    /// when the hinted table, those rows twice over (the rows and the caller's log record of
    /// them) and everything already used stay within half the memory limit. A hint is an
    /// optimization and must never turn a write that fits into a memory error.
    fn reserve_map(&mut self, additional: usize, write_bytes: usize) -> Result<(), UnifyError> {
        let need = self.map.len() + additional;
        if need <= self.map.capacity() {
            return Ok(());
        }
        let old_bytes = table_bytes(self.map.capacity());
        // The hint applies once; beyond it the map doubles as usual.
        let hinted = std::mem::take(&mut self.key_hint);
        let mut want = need;
        let hinted_bytes = table_bytes(capacity_for(hinted));
        let room = self.ctl.used().saturating_add(hinted_bytes).saturating_add(write_bytes.saturating_mul(2)) <= self.ctl.limit() / 2;
        if hinted > need && room && self.map_res.try_resize(old_bytes + hinted_bytes).is_ok() {
            want = hinted;
        } else {
            // While hashbrown rehashes, old and new tables exist together: budget both.
            self.map_res.try_resize(old_bytes + table_bytes(capacity_for(need)))?;
        }
        self.map.reserve(want - self.map.len(), |e| spread(e.tag));
        let actual = table_bytes(self.map.capacity());
        self.map_res.try_resize(actual).ok();
        Ok(())
    }

    /// Encodes and stores every row of `batch` (already validated by [`RowCodec::validate`];
    /// `keys` from [`crate::KeyEncoder::encode_batch`]) with sequence numbers `seq, seq+1, ...`.
    /// All memory is budgeted before the first row is written, so on error nothing changed.
    /// `commit` runs after the budget is secured and before any row becomes visible (the
    /// engine appends to its write-ahead log there); when it fails nothing is applied.
    ///
    /// # Errors
    /// [`UnifyError::RowTooLarge`], [`UnifyError::Memory`], or `commit`'s error.
    pub fn apply_puts<E: From<UnifyError>>(&mut self, batch: &RecordBatch, keys: &Rows, seq: u64, commit: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        let hashes = hash_keys(keys);
        self.apply_puts_with(batch, keys, &hashes, seq, |encode| {
            commit()?;
            encode();
            Ok(())
        })
    }

    /// [`Self::apply_puts`] for a caller that wants to run its commit *beside* the encoding
    /// (the engine's write-ahead-log fsync on another thread while the rows are encoded).
    ///
    /// Once the memory is budgeted, `run` is called with `encode`, which writes every row into
    /// the row blocks and points the map at them; `run` returns the commit's result. The
    /// caller holds whatever lock keeps readers out until this returns (the engine's table
    /// lock), so the commit's wait overlaps the map work without anyone seeing its rows early.
    /// On `Ok` the rows replaced are freed (after encoding, if `run` did not call `encode`);
    /// on `Err`, or a panic in `run` (resumed after), every entry gets its old row back, the
    /// encoded rows are freed and nothing is applied. `hashes` holds the
    /// [`key_hash`] of every row of `keys` (from [`hash_keys`]; the caller already has them
    /// from its key checks).
    ///
    /// # Errors
    /// [`UnifyError::RowTooLarge`], [`UnifyError::Memory`], or `run`'s error.
    ///
    /// # Panics
    /// When `hashes` and `keys` differ in length.
    pub fn apply_puts_with<E: From<UnifyError>>(
        &mut self,
        batch: &RecordBatch,
        keys: &Rows,
        hashes: &[u64],
        seq: u64,
        run: impl FnOnce(&mut dyn FnMut()) -> Result<(), E>,
    ) -> Result<(), E> {
        let n = batch.num_rows();
        assert_eq!(hashes.len(), keys.num_rows(), "one hash per key");
        // The contract the row layout relies on (a `Decimal64` value must fit 8 bytes).
        debug_assert!(self.codec.validate(batch).is_ok(), "apply_puts_with on a batch RowCodec::validate refuses");
        if n == 0 {
            return Ok(());
        }
        let codec = Arc::clone(&self.codec);
        let readers: Vec<ColReader<'_>> = batch.columns().iter().zip(codec.kinds()).map(|(a, k)| ColReader::new(a, *k)).collect();
        let sizes = codec.row_sizes(keys, &readers)?;
        let plan = codec.plan(&readers);
        let before = self.map_mark();
        self.reserve_map(n, sizes.iter().sum())?;
        // Before `prepare`: a rollback also returns the block table it may grow.
        let mark = self.arena.mark();
        if let Err(e) = self.arena.prepare(sizes.iter().copied()) {
            self.unreserve_map(before);
            return Err(UnifyError::from(e).into());
        }
        let mut refs: Vec<RowRef> = Vec::new();
        // Per row, the entry its install replaced: freed once `run` succeeds, put back if not.
        let mut replaced: Vec<Option<RowAt>> = Vec::new();
        let mut encode = || {
            if !refs.is_empty() {
                return;
            }
            refs.reserve_exact(n);
            for (i, (&size, key)) in sizes.iter().zip(keys.iter()).enumerate() {
                // Cannot fail: `prepare` acquired every chunk these sizes need.
                let Ok((r, buf)) = self.arena.alloc(size) else { unreachable!("row memory was prepared") };
                codec.encode_row(buf, OP_PUT, seq + i as u64, key.as_ref(), &plan, i);
                refs.push(r);
            }
            // Installed while the caller's commit (the WAL record's write and fsync) runs:
            // the caller holds the table's lock, so no reader sees these entries before
            // `run` returns, and they are taken out again if it fails.
            replaced.reserve_exact(n);
            for ((key, &h), r) in keys.iter().zip(hashes).zip(&refs) {
                replaced.push(self.place(key.as_ref(), h, *r));
            }
        };
        let committed = commit_beside(run, &mut encode);
        self.settle_places(committed, hashes, &refs, replaced, mark, before)?;
        self.puts += n;
        self.key_bytes += keys.lengths().sum::<usize>();
        self.max_seq = self.max_seq.max(seq + n as u64 - 1);
        Ok(())
    }

    /// Points `key`'s entry at `r` (one probe finds the key or the free slot for it) and
    /// returns the entry it replaced, without freeing or counting anything:
    /// [`Self::settle_places`] does that once the commit is known. The map must have room
    /// (reserved before).
    fn place(&mut self, key: &[u8], hash: u64, r: RowRef) -> Option<RowAt> {
        let arena = &self.arena;
        let tag = hash as u32;
        match self.map.entry(hash, |e| e.tag == tag && key_of(arena.get_from(e.at)) == key, |e| spread(e.tag)) {
            hashbrown::hash_table::Entry::Occupied(mut o) => Some(std::mem::replace(&mut o.get_mut().at, r.at())),
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(Entry { at: r.at(), tag });
                None
            }
        }
    }

    /// Settles what [`Self::apply_puts_with`] or [`Self::apply_deletes_with`] placed once its
    /// commit is known (`committed`, from [`commit_beside`]). Committed: the rows the new ones
    /// replaced (`replaced[j]` for `refs[j]`) are freed. Failed or panicked: row `j` of `refs`
    /// (key hash `hashes[j]`) gives its entry back the row it replaced (or the entry goes),
    /// newest first so a key written twice in the batch ends where it began; then the new rows
    /// and any map growth are given back, and the error is returned (the panic resumed).
    ///
    /// # Errors
    /// The commit's error.
    fn settle_places<E>(
        &mut self,
        committed: std::thread::Result<Result<(), E>>,
        hashes: &[u64],
        refs: &[RowRef],
        replaced: Vec<Option<RowAt>>,
        mark: gritdb_memctl::ArenaMark,
        before: usize,
    ) -> Result<(), E> {
        let failed = match committed {
            Ok(Ok(())) => {
                self.arena.release_spare();
                for old in replaced.into_iter().flatten() {
                    let old = self.row_ref(old);
                    self.count_removed(old);
                    self.arena.free(old);
                }
                return Ok(());
            }
            Ok(Err(e)) => Ok(e),
            Err(panic) => Err(panic),
        };
        for (j, old) in replaced.iter().enumerate().rev() {
            let (hash, new) = (hashes[j], refs[j].at());
            let tag = hash as u32;
            let Ok(entry) = self.map.find_entry(hash, |e| e.tag == tag && e.at == new) else {
                debug_assert!(false, "a placed entry is in the map");
                continue;
            };
            match old {
                Some(at) => entry.into_mut().at = *at,
                None => drop(entry.remove()),
            }
        }
        self.arena.rollback(mark, refs);
        self.arena.release_spare();
        self.unreserve_map(before);
        match failed {
            Ok(e) => Err(e),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// The row starting at `at`, with its length read from its bytes.
    fn row_ref(&self, at: RowAt) -> RowRef {
        at.with_len(self.codec.row_len(self.arena.get_from(at)))
    }

    fn count_removed(&mut self, r: RowRef) {
        let row = self.arena.get(r);
        if op_of(row) == OP_PUT {
            self.puts -= 1;
        } else {
            self.tombstones -= 1;
        }
        self.key_bytes -= key_of(row).len();
    }

    /// Deletes keys: `items` lists `(row index in keys, tombstone)`. With `tombstone` the key
    /// gets a tombstone row (an older layer may hold it); without, its entry here is removed.
    /// All memory is budgeted first and `commit` runs before anything changes (see
    /// [`Self::apply_puts`]); on error nothing changed.
    ///
    /// # Errors
    /// [`UnifyError::Memory`], or `commit`'s error.
    pub fn apply_deletes<E: From<UnifyError>>(
        &mut self,
        keys: &Rows,
        items: &[(usize, bool)],
        seq: u64,
        commit: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let hashes = hash_keys(keys);
        self.apply_deletes_with(keys, &hashes, items, seq, |place| {
            commit()?;
            place();
            Ok(())
        })
    }

    /// [`Self::apply_deletes`] for a caller that runs its commit beside the work (the engine's
    /// WAL record fsync on another thread), as [`Self::apply_puts_with`]: once the memory is
    /// budgeted, `run` is called with `place`, which writes the tombstone rows and points
    /// their keys' entries at them (the caller's lock keeps readers out). On `Ok` the rows
    /// they replaced are freed and the entries to remove are removed; on `Err` or a panic in
    /// `run` every entry gets its old row back and nothing is applied. `hashes` holds the
    /// [`key_hash`] of every row of `keys` (from [`hash_keys`]).
    ///
    /// # Errors
    /// [`UnifyError::Memory`], or `run`'s error.
    ///
    /// # Panics
    /// When `hashes` and `keys` differ in length.
    pub fn apply_deletes_with<E: From<UnifyError>>(
        &mut self,
        keys: &Rows,
        hashes: &[u64],
        items: &[(usize, bool)],
        seq: u64,
        run: impl FnOnce(&mut dyn FnMut()) -> Result<(), E>,
    ) -> Result<(), E> {
        let tomb: Vec<usize> = items.iter().filter(|(_, t)| *t).map(|(i, _)| *i).collect();
        let before = self.map_mark();
        let sizes: Vec<usize> = tomb.iter().map(|&i| HEADER + keys.row(i).as_ref().len()).collect();
        self.reserve_map(tomb.len(), sizes.iter().sum())?;
        let mark = self.arena.mark();
        if let Err(e) = self.arena.prepare(sizes.iter().copied()) {
            self.unreserve_map(before);
            return Err(UnifyError::from(e).into());
        }
        assert_eq!(hashes.len(), keys.num_rows(), "one hash per key");
        // The tombstones' rows, their keys' hashes and the entries they replaced, in `tomb` order.
        let mut refs: Vec<RowRef> = Vec::new();
        let mut tomb_hashes: Vec<u64> = Vec::new();
        let mut replaced: Vec<Option<RowAt>> = Vec::new();
        let mut place = || {
            if !refs.is_empty() || tomb.is_empty() {
                return;
            }
            refs.reserve_exact(tomb.len());
            tomb_hashes.reserve_exact(tomb.len());
            replaced.reserve_exact(tomb.len());
            // Sequence numbers follow `items` (each delete has one, tombstone or not).
            for (k, &(i, t)) in items.iter().enumerate() {
                if !t {
                    continue;
                }
                let key = keys.row(i);
                let key = key.as_ref();
                // Cannot fail: `prepare` acquired every chunk these sizes need.
                let Ok((r, buf)) = self.arena.alloc(HEADER + key.len()) else { unreachable!("tombstone memory was prepared") };
                buf[0] = OP_DELETE;
                buf[1..9].copy_from_slice(&(seq + k as u64).to_le_bytes());
                buf[9..13].copy_from_slice(&(key.len() as u32).to_le_bytes());
                buf[HEADER..].copy_from_slice(key);
                refs.push(r);
                tomb_hashes.push(hashes[i]);
                replaced.push(self.place(key, hashes[i], r));
            }
        };
        let committed = commit_beside(run, &mut place);
        self.settle_places(committed, &tomb_hashes, &refs, replaced, mark, before)?;
        self.tombstones += refs.len();
        self.key_bytes += sizes.iter().sum::<usize>() - HEADER * sizes.len();
        for &(i, t) in items {
            if t {
                continue;
            }
            let key = keys.row(i);
            let key = key.as_ref();
            let h = hashes[i];
            let tag = h as u32;
            let arena = &self.arena;
            if let Ok(entry) = self.map.find_entry(h, |e| e.tag == tag && key_of(arena.get_from(e.at)) == key) {
                let (old, _) = entry.remove();
                let old = self.row_ref(old.at);
                self.count_removed(old);
                self.arena.free(old);
            }
        }
        if !items.is_empty() {
            self.max_seq = self.max_seq.max(seq + items.len() as u64 - 1);
        }
        Ok(())
    }

    /// Builds Arrow batches of this delta's puts (full rows) and deletes (key columns), keeping
    /// only keys for which `keep` is true, sorted by key when `sorted`. Puts are cut into
    /// batches of at most `max_rows` rows and about `max_bytes` encoded row bytes (so string
    /// offsets never overflow `i32`; keep it under 2 GiB); each batch's arrays live in their
    /// own [`BatchBlock`] counted under `category` (`batch_blocks` for a flush, `scan_buffers`
    /// for a scan), released when its last array is dropped.
    ///
    /// # Errors
    /// [`UnifyError::Memory`] when a block cannot be budgeted; [`UnifyError::Arrow`].
    pub fn to_batches(
        &self,
        category: Category,
        sorted: bool,
        max_rows: usize,
        max_bytes: usize,
        keep: impl Fn(&[u8]) -> bool + Sync,
    ) -> Result<DeltaBatches, UnifyError> {
        self.to_batches_parallel(category, sorted, max_rows, max_bytes, 1, keep)
    }

    /// [`Self::to_batches`] on up to `threads` threads, the calling thread included (scoped
    /// threads, all joined before it returns; 1 = the calling thread alone). The sort runs on
    /// `threads` parts merged at the end; the batches, independent once the rows are ordered,
    /// are decoded by whichever thread is free, each into its own batch block. The result is
    /// the same for every `threads`, and so are the bytes: each batch block is the size it
    /// has on one thread, and a failed call (say, a block over the limit) drops every block
    /// it built before returning the first error.
    ///
    /// # Errors
    /// As [`Self::to_batches`].
    pub fn to_batches_parallel(
        &self,
        category: Category,
        sorted: bool,
        max_rows: usize,
        max_bytes: usize,
        threads: usize,
        keep: impl Fn(&[u8]) -> bool + Sync,
    ) -> Result<DeltaBatches, UnifyError> {
        let threads = threads.max(1);
        let (puts, dels) = if sorted { self.select_sorted(category, threads, &keep)? } else { self.select(category, &keep) };
        let mut cuts = Vec::new();
        let mut start = 0;
        while start < puts.len() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < puts.len() && end - start < max_rows.max(1) && (end == start || bytes + puts[end].len() <= max_bytes) {
                bytes += puts[end].len();
                end += 1;
            }
            cuts.push(start..end);
            start = end;
        }
        let puts = self.decode_all(&puts, &cuts, category, threads)?;
        let key_schema = self.key_schema();
        let delete_keys = if dels.is_empty() {
            RecordBatch::new_empty(key_schema)
        } else {
            let cols = self.codec.keys().decode(dels.iter().map(|r| key_of(self.arena.get(*r))))?;
            RecordBatch::try_new(key_schema, cols)?
        };
        Ok(DeltaBatches { puts, delete_keys })
    }

    /// The map's row starts grouped by block ([`arena_order`]), with the reservation that
    /// budgets them under `category` (8 bytes a row; keep it while the starts live); `None`
    /// when the limit has no room for them.
    fn arena_rows(&self, category: Category) -> Option<(Reservation, Vec<RowAt>)> {
        let mut order = Reservation::new(&self.ctl, category, self.table.as_ref());
        order.try_grow(self.map.len() * std::mem::size_of::<RowAt>()).ok()?;
        Some((order, arena_order(&self.map, self.arena.block_slots())))
    }

    /// The puts and deletes kept by `keep`, in arena order ([`arena_order`] then
    /// [`RowAt::sort_within_blocks`]: reading them, and decoding them after, goes front to back
    /// through each row block instead of a cache and TLB miss per row in hash-map order). The
    /// row starts this orders (8 bytes a row) are budgeted under `category` while they exist;
    /// when the limit leaves no room for them, the rows come in map order.
    fn select(&self, category: Category, keep: &impl Fn(&[u8]) -> bool) -> (Vec<RowRef>, Vec<RowRef>) {
        let mut puts = Vec::with_capacity(self.puts);
        let mut dels = Vec::with_capacity(self.tombstones);
        let mut take = |at: RowAt| {
            let row = self.arena.get_from(at);
            if keep(key_of(row)) {
                let r = at.with_len(self.codec.row_len(row));
                if op_of(row) == OP_PUT { puts.push(r) } else { dels.push(r) }
            }
        };
        if let Some((_order, mut rows)) = self.arena_rows(category) {
            RowAt::sort_within_blocks(&mut rows);
            rows.into_iter().for_each(&mut take);
        } else {
            self.map.iter().for_each(|e| take(e.at));
        }
        (puts, dels)
    }

    /// The puts and deletes kept by `keep`, each sorted by key bytes.
    ///
    /// The map's row starts are put in arena order ([`arena_order`]) and split into `threads`
    /// parts (scoped threads, the caller's included). Each part orders its rows within each
    /// block ([`RowAt::sort_within_blocks`]), reads them once, front to back, for the op, the
    /// `keep` test and a 16-byte big-endian key prefix (a whole `(Int64, Int32)` key fits), and
    /// sorts its puts and deletes; comparisons use the prefix and read the rows only when two
    /// prefixes are equal (keys longer than 16 bytes). The sorted parts are then merged.
    ///
    /// Budgeted under `category` while they exist: the `(prefix, row)` pairs (32 bytes a row)
    /// and the row starts (8 bytes a row). When the limit leaves no room for the row starts,
    /// one part reads the rows in map order instead (a cache miss per row, no parallelism).
    fn select_sorted(&self, category: Category, threads: usize, keep: &(impl Fn(&[u8]) -> bool + Sync)) -> Result<(Vec<RowRef>, Vec<RowRef>), UnifyError> {
        type Keyed = Vec<(u128, RowRef)>;
        if self.map.is_empty() {
            // No parts to split (the split below needs at least one row).
            return Ok((Vec::new(), Vec::new()));
        }
        let mut res = Reservation::new(&self.ctl, category, self.table.as_ref());
        res.try_grow(self.map.len() * std::mem::size_of::<(u128, RowRef)>())?;
        let arena = &self.arena;
        let codec = &self.codec;
        let cmp = |a: &(u128, RowRef), b: &(u128, RowRef)| a.0.cmp(&b.0).then_with(|| key_of(arena.get(a.1)).cmp(key_of(arena.get(b.1))));
        let sorted_part = |(mut puts, mut dels): (Keyed, Keyed)| {
            puts.sort_unstable_by(cmp);
            dels.sort_unstable_by(cmp);
            (puts, dels)
        };
        let Some((order, mut rows)) = self.arena_rows(category) else {
            let (puts, dels) = sorted_part(read_keyed(arena, codec, keep, self.map.iter().map(|e| e.at), self.map.len()));
            return Ok((merge_sorted(&[puts], cmp), merge_sorted(&[dels], cmp)));
        };
        let part = |rows: &mut [RowAt]| -> (Keyed, Keyed) {
            // Each block's rows by offset: this part then reads its rows front to back.
            RowAt::sort_within_blocks(rows);
            sorted_part(read_keyed(arena, codec, keep, rows.iter().copied(), rows.len()))
        };
        let parts = threads.min(rows.len() / MIN_SORT_PART).max(1);
        let part_len = rows.len().div_ceil(parts).max(1);
        // Each part's rows behind an (uncontended) lock, so a part whose thread cannot be
        // started (the OS is out of threads) can still run here.
        let slots: Vec<std::sync::Mutex<&mut [RowAt]>> = rows.chunks_mut(part_len).map(std::sync::Mutex::new).collect();
        let run = |i: usize| part(&mut slots[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let run = &run;
        let sorted: Vec<(Keyed, Keyed)> = std::thread::scope(|s| {
            let helpers: Vec<_> = (1..slots.len()).map(|i| std::thread::Builder::new().spawn_scoped(s, move || run(i)).map_err(|_| i)).collect();
            let mut out = vec![run(0)];
            for h in helpers {
                out.push(match h {
                    Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                    Err(i) => run(i),
                });
            }
            out
        });
        drop(slots);
        drop(rows);
        drop(order);
        let (puts, dels): (Vec<Keyed>, Vec<Keyed>) = sorted.into_iter().unzip();
        Ok((merge_sorted(&puts, cmp), merge_sorted(&dels, cmp)))
    }

    /// Decodes `puts[cut]` for every cut, on up to `threads` threads, in order.
    fn decode_all(&self, puts: &[RowRef], cuts: &[std::ops::Range<usize>], category: Category, threads: usize) -> Result<Vec<RecordBatch>, UnifyError> {
        if threads <= 1 || cuts.len() <= 1 {
            return cuts.iter().map(|c| self.decode(&puts[c.clone()], category)).collect();
        }
        let slots: Vec<std::sync::OnceLock<RecordBatch>> = cuts.iter().map(|_| std::sync::OnceLock::new()).collect();
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let work = || -> Result<(), UnifyError> {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= cuts.len() || failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                match self.decode(&puts[cuts[i].clone()], category) {
                    Ok(b) => {
                        let _ = slots[i].set(b);
                    }
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                }
            }
        };
        std::thread::scope(|s| {
            // Threads the OS cannot start are simply fewer helpers.
            let helpers: Vec<_> = (1..threads.min(cuts.len())).filter_map(|_| std::thread::Builder::new().spawn_scoped(s, work).ok()).collect();
            let mut res = work();
            for h in helpers {
                let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                if res.is_ok() {
                    res = r;
                }
            }
            res
        })?;
        // No error: every slot was filled.
        Ok(slots.into_iter().filter_map(std::sync::OnceLock::into_inner).collect())
    }

    /// Schema of the key columns.
    pub fn key_schema(&self) -> SchemaRef {
        let s = self.codec.schema();
        Arc::new(Schema::new(self.codec.keys().columns().iter().map(|&i| s.field(i).clone()).collect::<Vec<_>>()))
    }

    fn decode(&self, rows: &[RowRef], category: Category) -> Result<RecordBatch, UnifyError> {
        let codec = &self.codec;
        let schema = codec.schema();
        let n = rows.len();
        if n == 0 {
            return Ok(RecordBatch::new_empty(Arc::clone(schema)));
        }
        let kinds = codec.kinds();
        let bitmap_len = codec.bitmap_len();
        let fixed_len = codec.fixed_len();
        let body_of = |row: &[u8]| HEADER + key_of(row).len();
        let slot_u32 = |row: &[u8], body: usize, j: usize| {
            let at = body + bitmap_len + codec.slot_offset(j);
            u32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]]) as usize
        };
        // Pass 1: bytes of each variable-length column (for views: only values > 12 bytes).
        let var_cols: Vec<usize> = (0..kinds.len()).filter(|&j| kinds[j].is_var()).collect();
        let mut var_total = vec![0usize; kinds.len()];
        for r in rows {
            let row = self.arena.get(*r);
            let body = body_of(row);
            let mut prev = 0;
            for &j in &var_cols {
                let end = slot_u32(row, body, j);
                let len = end - prev;
                prev = end;
                if kinds[j] != ColKind::View || len > 12 {
                    var_total[j] += len;
                }
            }
        }
        // Layout: per column, [validity] then its buffers; each region 16-byte aligned.
        let align = |x: usize| x.div_ceil(16) * 16;
        let bits = n.div_ceil(8);
        let mut regions: Vec<Vec<(usize, usize)>> = Vec::with_capacity(kinds.len());
        let mut total = 0usize;
        let mut take = |len: usize| {
            let at = total;
            total += align(len);
            (at, len)
        };
        for (j, kind) in kinds.iter().enumerate() {
            let mut r = Vec::with_capacity(3);
            r.push(if schema.field(j).is_nullable() { take(bits) } else { (0, 0) });
            match kind {
                ColKind::Bool => r.push(take(bits)),
                ColKind::Fixed(w) => r.push(take(n * w)),
                ColKind::Decimal64 => r.push(take(n * 16)),
                ColKind::Off32 => {
                    r.push(take((n + 1) * 4));
                    r.push(take(var_total[j]));
                }
                ColKind::Off64 => {
                    r.push(take((n + 1) * 8));
                    r.push(take(var_total[j]));
                }
                ColKind::View => {
                    r.push(take(n * 16));
                    r.push(take(var_total[j]));
                }
            }
            regions.push(r);
        }
        let mut block = BatchBlock::new(&self.ctl, category, self.table.as_ref(), total)?;
        let mut null_counts = vec![0usize; kinds.len()];
        {
            // Rows are read in tiles of `TILE` (each row once, in the order given; a tile's
            // rows stay in cache), and each column is written for a whole tile at a time: one
            // dispatch on the column's kind per tile instead of per value, and tight loops per
            // kind (callgrind, lineitem flush: the per-value dispatch was ~100 instructions a
            // value; issue 7).
            let out = block.bytes_mut();
            let plans: Vec<ColPlan> = (0..kinds.len())
                .map(|j| ColPlan {
                    kind: kinds[j],
                    nullable: schema.field(j).is_nullable(),
                    null_byte: j / 8,
                    null_mask: 1 << (j % 8),
                    at: codec.slot_offset(j),
                    start_at: (0..j).rev().find(|&p| kinds[p].is_var()).map(|p| codec.slot_offset(p)),
                })
                .collect();
            let mut var_off = vec![0usize; kinds.len()];
            let mut parts: Vec<RowParts<'_>> = Vec::with_capacity(TILE);
            for (t, tile) in rows.chunks(TILE).enumerate() {
                let base = t * TILE;
                parts.clear();
                parts.extend(tile.iter().map(|r| {
                    let row = self.arena.get(*r);
                    let (bitmap, rest) = row[body_of(row)..].split_at(bitmap_len);
                    let (fixed, var) = rest.split_at(fixed_len);
                    RowParts { bitmap, fixed, var }
                }));
                for (j, plan) in plans.iter().enumerate() {
                    let reg = &regions[j];
                    if plan.nullable {
                        let valid = &mut out[reg[0].0..reg[0].0 + reg[0].1];
                        null_counts[j] += fill_bits(valid, base, &parts, |p| p.bitmap[plan.null_byte] & plan.null_mask == 0);
                    }
                    let at = plan.at;
                    match plan.kind {
                        ColKind::Bool => {
                            fill_bits(&mut out[reg[1].0..reg[1].0 + reg[1].1], base, &parts, |p| p.fixed[at] != 0);
                        }
                        ColKind::Fixed(w) => {
                            let dst = &mut out[reg[1].0 + base * w..reg[1].0 + (base + parts.len()) * w];
                            // The common widths as fixed-size copies (a move each, where a copy
                            // of run-time length is a `memcpy` call per value).
                            match w {
                                1 => copy_fixed::<1>(dst, &parts, at),
                                2 => copy_fixed::<2>(dst, &parts, at),
                                4 => copy_fixed::<4>(dst, &parts, at),
                                8 => copy_fixed::<8>(dst, &parts, at),
                                16 => copy_fixed::<16>(dst, &parts, at),
                                _ => {
                                    for (d, p) in dst.chunks_exact_mut(w).zip(&parts) {
                                        d.copy_from_slice(&p.fixed[at..at + w]);
                                    }
                                }
                            }
                        }
                        ColKind::Decimal64 => {
                            let dst = &mut out[reg[1].0 + base * 16..reg[1].0 + (base + parts.len()) * 16];
                            for (d, p) in dst.chunks_exact_mut(16).zip(&parts) {
                                let mut low = [0u8; 8];
                                low.copy_from_slice(&p.fixed[at..at + 8]);
                                d.copy_from_slice(&i128::from(i64::from_le_bytes(low)).to_le_bytes());
                            }
                        }
                        ColKind::Off32 | ColKind::Off64 | ColKind::View => {
                            // Offsets or views, then the values region after them.
                            let (head, tail) = out.split_at_mut(reg[2].0);
                            let data = &mut tail[..reg[2].1];
                            let off = &mut var_off[j];
                            match plan.kind {
                                ColKind::Off32 => {
                                    let offsets = &mut head[reg[1].0 + (base + 1) * 4..reg[1].0 + (base + 1 + parts.len()) * 4];
                                    for (o, p) in offsets.chunks_exact_mut(4).zip(&parts) {
                                        let v = var_value(p, plan.start_at, at);
                                        data[*off..*off + v.len()].copy_from_slice(v);
                                        *off += v.len();
                                        // Wraps only past `i32::MAX`, which is refused below.
                                        #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
                                        o.copy_from_slice(&(*off as i32).to_le_bytes());
                                    }
                                }
                                ColKind::Off64 => {
                                    let offsets = &mut head[reg[1].0 + (base + 1) * 8..reg[1].0 + (base + 1 + parts.len()) * 8];
                                    for (o, p) in offsets.chunks_exact_mut(8).zip(&parts) {
                                        let v = var_value(p, plan.start_at, at);
                                        data[*off..*off + v.len()].copy_from_slice(v);
                                        *off += v.len();
                                        o.copy_from_slice(&(*off as i64).to_le_bytes());
                                    }
                                }
                                _ => {
                                    let views = &mut head[reg[1].0 + base * 16..reg[1].0 + (base + parts.len()) * 16];
                                    for (o, p) in views.chunks_exact_mut(16).zip(&parts) {
                                        let v = var_value(p, plan.start_at, at);
                                        let view = if v.len() > 12 {
                                            data[*off..*off + v.len()].copy_from_slice(v);
                                            let view = arrow_array::builder::make_view(v, 0, *off as u32);
                                            *off += v.len();
                                            view
                                        } else {
                                            arrow_array::builder::make_view(v, 0, 0)
                                        };
                                        o.copy_from_slice(&view.to_le_bytes());
                                    }
                                }
                            }
                        }
                    }
                }
            }
            // Offsets past what the column's layout holds were written wrapped above: `i32`
            // offsets, and the `u32` buffer offsets of views. Never with the engine's batch
            // sizes (at most 1 GiB, or one row of at most `u32::MAX` bytes), but `max_bytes`
            // is the caller's.
            for (j, kind) in kinds.iter().enumerate() {
                let overflow = match kind {
                    ColKind::Off32 => i32::try_from(var_off[j]).is_err(),
                    ColKind::View => u32::try_from(var_off[j]).is_err(),
                    _ => false,
                };
                if overflow {
                    return Err(UnifyError::Arrow(arrow_schema::ArrowError::OffsetOverflowError(var_off[j])));
                }
            }
        }
        let block = Arc::new(block);
        let base = block.bytes().as_ptr();
        let buffer = |(at, len): (usize, usize)| -> Buffer {
            // SAFETY: `at + len` lies within the block (the layout above sums every region into
            // `total`, the block's size); the block is immutable from here on and `owner` keeps
            // it alive for as long as any buffer points into it.
            unsafe {
                let ptr = NonNull::new_unchecked(base.add(at).cast_mut());
                Buffer::from_custom_allocation(ptr, len, Arc::clone(&block) as Arc<dyn arrow_buffer::alloc::Allocation>)
            }
        };
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(kinds.len());
        for (j, kind) in kinds.iter().enumerate() {
            let reg = &regions[j];
            let dt: DataType = schema.field(j).data_type().clone();
            let nulls = (null_counts[j] > 0).then(|| buffer(reg[0]));
            let buffers: Vec<Buffer> = reg[1..].iter().map(|r| buffer(*r)).collect();
            let data = match kind {
                // Variable-width columns skip `validate_values` (per-value offset and UTF-8
                // checks: 7% of a lineitem flush's instructions under callgrind, mostly
                // `validate_string_view`); the cheap structural `validate` still runs.
                ColKind::Off32 | ColKind::Off64 | ColKind::View => {
                    let builder = ArrayData::builder(dt).len(n).null_bit_buffer(nulls).buffers(buffers);
                    // SAFETY: every value is a byte-for-byte copy of a value the codec took
                    // from an array of this very data type (built by safe Arrow constructors
                    // or read back by the IPC reader, both of which validate UTF-8), so
                    // strings are valid UTF-8; offsets start at 0 (the block is zeroed) and
                    // are running sums of the copied lengths, so they are monotonic and end at
                    // the values region's length; views are `make_view`s of the copied bytes
                    // with buffer index 0 and offsets inside the one data buffer. The test
                    // `decoded_arrays_pass_full_validation` runs `validate_full` on them.
                    let data = unsafe { builder.build_unchecked() };
                    data.validate()?;
                    data
                }
                _ => ArrayData::try_new(dt, n, nulls, 0, buffers, vec![])?,
            };
            columns.push(make_array(data));
        }
        Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
    }
}

#[cfg(test)]
/// Test setup shared by the delta's test modules: a controller with `limit` bytes, a table of
/// one `Int64` key column `k`, its codec, and an empty delta of it.
fn int64_delta(limit: usize) -> (Arc<MemoryController>, SchemaRef, Arc<RowCodec>, DeltaStore) {
    let ctl = MemoryController::new(gritdb_memctl::ControllerConfig { memory_limit: Some(limit), ..Default::default() }).expect("valid controller config");
    let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new("k", DataType::Int64, false)]));
    let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).expect("supported schema"));
    let d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
    (ctl, schema, codec, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Array, BinaryArray, BooleanArray, Decimal128Array, Int32Array, Int64Array, LargeStringArray, StringArray, StringViewArray};
    use arrow_schema::Field;
    use gritdb_memctl::ControllerConfig;

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("b", DataType::Boolean, true),
            Field::new("i", DataType::Int32, true),
            Field::new("d", DataType::Decimal128(38, 2), true),
            Field::new("s", DataType::Utf8, true),
            Field::new("l", DataType::LargeUtf8, true),
            Field::new("v", DataType::Utf8View, true),
            Field::new("x", DataType::Binary, true),
        ]));
        let long = "a string longer than twelve bytes";
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(vec![3, 1, 2])),
                Arc::new(BooleanArray::from(vec![Some(true), None, Some(false)])),
                Arc::new(Int32Array::from(vec![None, Some(-7), Some(i32::MAX)])),
                Arc::new(Decimal128Array::from(vec![Some(-12_345), Some(i128::MAX / 7), None]).with_precision_and_scale(38, 2).unwrap()),
                Arc::new(StringArray::from(vec![Some("x"), None, Some("")])),
                Arc::new(LargeStringArray::from(vec![None, Some(long), Some("yz")])),
                Arc::new(StringViewArray::from(vec![Some(long), Some("short"), None])),
                Arc::new(BinaryArray::from(vec![Some(&b"\0\x01"[..]), Some(&b""[..]), None])),
            ],
        )
        .unwrap()
    }

    fn delta() -> DeltaStore {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let b = batch();
        DeltaStore::new(Arc::new(RowCodec::new(b.schema(), &[0], 1 << 20).unwrap()), &ctl, None)
    }

    /// `key_bytes` follows the keys the delta holds: put rows and tombstones add their
    /// encoded keys, a replaced row's key leaves with it, a removed key leaves, and a write
    /// whose commit fails changes nothing. The lengths are arrow-row's for `Utf8`:
    /// `variable_key_bytes` (1 + 9 per started 8 bytes up to 32, then 4 + 33 per 32).
    #[test]
    fn key_bytes_count_the_keys_held() {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, false), Field::new("v", DataType::Int64, true)]));
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let mut d = DeltaStore::new(Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap()), &ctl, None);
        let put = |d: &mut DeltaStore, ks: &[&str], seq: u64, ok: bool| {
            let b = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(StringArray::from(ks.to_vec())), Arc::new(Int64Array::from_iter_values(0..ks.len() as i64))],
            )
            .unwrap();
            let keys = d.codec().keys().encode_batch(&b).unwrap();
            d.apply_puts(&b, &keys, seq, || if ok { Ok(()) } else { Err(UnifyError::Arrow(arrow_schema::ArrowError::ComputeError("commit failed".into()))) })
        };
        let long = "x".repeat(100);
        let (a, l, c) = (gritdb_keys::variable_key_bytes(1), gritdb_keys::variable_key_bytes(100), gritdb_keys::variable_key_bytes(3));
        assert_eq!((a, l, c), (10, 136, 10));
        put(&mut d, &["a", &long], 1, true).unwrap();
        assert_eq!(d.key_bytes(), a + l);
        put(&mut d, &[&long], 3, true).unwrap();
        assert_eq!((d.key_bytes(), d.len()), (a + l, 2), "the replaced row's key left with it");
        assert!(put(&mut d, &["ccc"], 4, false).is_err());
        assert_eq!(d.key_bytes(), a + l, "a failed write adds nothing");
        let del = d.codec().keys().encode_key_columns(&[Arc::new(StringArray::from(vec!["a", "ccc"])) as ArrayRef]).unwrap();
        d.apply_deletes(&del, &[(0, false), (1, true)], 5, || Ok::<(), UnifyError>(())).unwrap();
        assert_eq!((d.key_bytes(), d.puts(), d.tombstones()), (l + c, 1, 1), "`a` removed, `ccc` a tombstone");
        put(&mut d, &["ccc"], 7, true).unwrap();
        assert_eq!((d.key_bytes(), d.puts(), d.tombstones()), (l + c, 2, 0), "the put replaced the tombstone");
    }

    #[test]
    fn rows_round_trip_through_encode_and_to_batches() {
        let mut d = delta();
        let b = batch();
        let keys = d.codec().keys().encode_batch(&b).unwrap();
        d.apply_puts(&b, &keys, 10, || Ok::<(), UnifyError>(())).unwrap();
        assert_eq!((d.len(), d.puts(), d.max_seq()), (3, 3, 12));
        let out = d.to_batches(Category::ScanBuffers, true, 100, 1 << 20, |_| true).unwrap();
        assert_eq!(out.puts.len(), 1);
        // Sorted by key: input rows 1, 2, 0.
        let want = arrow_select_take(&b, &[1, 2, 0]);
        for (j, (got, want)) in out.puts[0].columns().iter().zip(want.columns()).enumerate() {
            assert_eq!(got.to_data(), want.to_data(), "column {j}");
        }
    }

    /// Rows are decoded a tile (`TILE` rows) at a time: 1,003 rows (not a multiple of the tile
    /// or of 8), inserted in descending key order over several row blocks, with every column
    /// kind, nulls in varied patterns (a whole tile of nulls in one column), empty and long
    /// strings, come back in key order value for value, in cuts of 300 rows.
    #[test]
    fn tiles_of_rows_round_trip_every_kind() {
        let n = 1003usize;
        let long = |i: usize| "long value number ".repeat(1 + i % 3) + &i.to_string();
        let schema = batch().schema();
        let rev = |i: usize| (n - 1 - i) as i64;
        let b = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from((0..n).map(rev).collect::<Vec<_>>())),
                Arc::new(BooleanArray::from((0..n).map(|i| (i % 5 != 0).then_some(i % 3 == 0)).collect::<Vec<_>>())),
                Arc::new(Int32Array::from((0..n).map(|i| (!(256..384).contains(&i)).then_some(i as i32 * 7 - 3000)).collect::<Vec<_>>())),
                Arc::new(
                    Decimal128Array::from((0..n).map(|i| (i % 7 != 3).then_some(i as i128 * 1_000_003 - 500_000_000)).collect::<Vec<_>>())
                        .with_precision_and_scale(38, 2)
                        .unwrap(),
                ),
                Arc::new(StringArray::from((0..n).map(|i| (i % 4 != 1).then(|| if i % 9 == 0 { String::new() } else { long(i) })).collect::<Vec<_>>())),
                Arc::new(LargeStringArray::from((0..n).map(|i| (i % 6 != 2).then(|| format!("{i}"))).collect::<Vec<_>>())),
                Arc::new(StringViewArray::from((0..n).map(|i| (i % 11 != 4).then(|| if i % 2 == 0 { long(i) } else { format!("s{i}") })).collect::<Vec<_>>())),
                Arc::new(BinaryArray::from(
                    (0..n).map(|i| (i % 13 != 0).then(|| vec![i as u8; i % 20])).collect::<Vec<_>>().iter().map(Option::as_deref).collect::<Vec<_>>(),
                )),
            ],
        )
        .unwrap();
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        // ~100 KB of rows: more than one 64 KiB row block.
        let mut d = DeltaStore::new(Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap()), &ctl, None);
        let keys = d.codec().keys().encode_batch(&b).unwrap();
        d.apply_puts(&b, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        assert!(d.arena.block_slots() > 1, "rows in {} blocks", d.arena.block_slots());
        for threads in [1, 2] {
            let out = d.to_batches_parallel(Category::ScanBuffers, true, 300, 1 << 30, threads, |_| true).unwrap();
            assert_eq!(out.puts.iter().map(RecordBatch::num_rows).collect::<Vec<_>>(), [300, 300, 300, 103]);
            let got = arrow_select::concat::concat_batches(&schema, &out.puts).unwrap();
            let want = arrow_select_take(&b, &(0..n).rev().collect::<Vec<_>>());
            for (j, (g, w)) in got.columns().iter().zip(want.columns()).enumerate() {
                assert_eq!(g.null_count(), w.null_count(), "column {j}, {threads} threads");
                assert_eq!(g.as_ref(), w.as_ref(), "column {j}, {threads} threads");
            }
        }
    }

    /// The map keeps no row length: the length read back from each row equals the size it
    /// was allocated with, for rows whose last var-len value is null, empty or present, and
    /// for tombstones.
    #[test]
    fn row_lengths_read_back_from_rows_match_their_allocation() {
        let mut d = delta();
        let b = batch();
        let keys = d.codec().keys().encode_batch(&b).unwrap();
        let readers: Vec<ColReader<'_>> = b.columns().iter().zip(d.codec.kinds()).map(|(a, k)| ColReader::new(a, *k)).collect();
        let sizes = d.codec.row_sizes(&keys, &readers).unwrap();
        d.apply_puts(&b, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        for (i, key) in keys.iter().enumerate() {
            let e = *d.map.find(key_hash(key.as_ref()), |e| key_of(d.arena.get_from(e.at)) == key.as_ref()).unwrap();
            assert_eq!(d.row_ref(e.at).len(), sizes[i], "row {i}");
        }
        d.apply_deletes(&keys, &[(0, true)], 9, || Ok::<(), UnifyError>(())).unwrap();
        let k0 = keys.row(0);
        let e = *d.map.find(key_hash(k0.as_ref()), |e| key_of(d.arena.get_from(e.at)) == k0.as_ref()).unwrap();
        assert_eq!(d.row_ref(e.at).len(), HEADER + k0.as_ref().len());
        assert_eq!((d.puts(), d.tombstones()), (2, 1));
    }

    /// Rows of `b` in the order `idx` (a tiny `take`, the crate does not depend on arrow-select).
    fn arrow_select_take(b: &RecordBatch, idx: &[usize]) -> RecordBatch {
        let cols = b
            .columns()
            .iter()
            .map(|c| {
                let parts: Vec<ArrayRef> = idx.iter().map(|&i| c.slice(i, 1)).collect();
                let data: Vec<ArrayData> = parts.iter().map(Array::to_data).collect();
                let refs: Vec<&ArrayData> = data.iter().collect();
                let mut m = arrow_data::transform::MutableArrayData::new(refs, true, idx.len());
                for k in 0..idx.len() {
                    m.try_extend(k, 0, 1).unwrap();
                }
                make_array(m.freeze())
            })
            .collect();
        RecordBatch::try_new(b.schema(), cols).unwrap()
    }

    #[test]
    fn a_failed_commit_after_encoding_applies_nothing() {
        let mut d = delta();
        let b = batch();
        let keys = d.codec().keys().encode_batch(&b).unwrap();
        let hashes = hash_keys(&keys);
        let res = d.apply_puts_with(&b, &keys, &hashes, 1, |encode| {
            encode();
            Err(UnifyError::SchemaMismatch { detail: "commit failed".into() })
        });
        assert!(matches!(res, Err(UnifyError::SchemaMismatch { .. })));
        assert_eq!((d.len(), d.puts(), d.max_seq()), (0, 0, 0));
        assert!(keys.iter().all(|k| d.get(k.as_ref()).is_none()));
        assert_eq!(d.arena.live_rows(), 0);
        // The delta still works afterwards, and a `run` that never calls `encode` still
        // installs encoded rows.
        d.apply_puts_with(&b, &keys, &hashes, 5, |_| Ok::<(), UnifyError>(())).unwrap();
        assert_eq!((d.len(), d.max_seq()), (3, 7));
        assert_eq!(d.arena.live_rows(), 3);
        assert_eq!(d.to_batches(Category::ScanBuffers, false, 100, 1 << 20, |_| true).unwrap().puts[0].column(4).null_count(), 1);
    }

    /// The rows' entries are placed while the commit runs: a commit that fails (or panics)
    /// after `encode` must give every key its old row back, the counts and the row blocks
    /// exactly as before. Here the batch replaces all three keys (one a tombstone), and a
    /// second batch writes one key twice (so its undo must run newest first).
    #[test]
    fn a_failed_or_panicking_commit_over_existing_keys_gives_every_key_its_old_row() {
        let mut d = delta();
        let b = batch();
        let keys = d.codec().keys().encode_batch(&b).unwrap();
        let hashes = hash_keys(&keys);
        d.apply_puts(&b, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        // Key 2 (row 2) becomes a tombstone.
        d.apply_deletes(&keys, &[(2, true)], 4, || Ok::<(), UnifyError>(())).unwrap();
        let before = d.to_batches(Category::ScanBuffers, true, 100, 1 << 20, |_| true).unwrap();
        let state = |d: &DeltaStore| (d.len(), d.puts(), d.tombstones(), d.max_seq(), d.arena.live_rows(), d.bytes());
        let was = state(&d);
        assert_eq!((was.0, was.1, was.2, was.3), (3, 2, 1, 4));
        let same = |d: &DeltaStore| {
            assert_eq!(state(d), was);
            let now = d.to_batches(Category::ScanBuffers, true, 100, 1 << 20, |_| true).unwrap();
            assert_eq!(now.puts, before.puts);
            assert_eq!(now.delete_keys, before.delete_keys);
            assert_eq!(d.get(keys.row(2).as_ref()), Some(Lookup::Deleted));
            assert_eq!(d.get(keys.row(0).as_ref()), Some(Lookup::Put));
        };
        // A changed copy of the batch: other values under the same keys.
        let changed = RecordBatch::try_new(
            b.schema(),
            b.columns().iter().enumerate().map(|(j, c)| if j == 2 { Arc::new(Int32Array::from(vec![1, 2, 3])) as ArrayRef } else { Arc::clone(c) }).collect(),
        )
        .unwrap();
        let res = d.apply_puts_with(&changed, &keys, &hashes, 10, |encode| {
            encode();
            Err(UnifyError::SchemaMismatch { detail: "the record's fsync failed".into() })
        });
        assert!(matches!(res, Err(UnifyError::SchemaMismatch { .. })));
        same(&d);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = d.apply_puts_with(&changed, &keys, &hashes, 20, |encode| -> Result<(), UnifyError> {
                encode();
                panic!("the record's thread panicked");
            });
        }));
        assert!(panicked.is_err());
        same(&d);
        // One key written twice in one batch (rows 0 and 1 both key 3), then refused.
        let twice = arrow_select_take(&changed, &[0, 0]);
        let twice_keys = d.codec().keys().encode_batch(&twice).unwrap();
        let twice_hashes = hash_keys(&twice_keys);
        let res = d.apply_puts_with(&twice, &twice_keys, &twice_hashes, 30, |encode| {
            encode();
            Err(UnifyError::SchemaMismatch { detail: "refused".into() })
        });
        assert!(res.is_err());
        same(&d);
        // And the delta takes the write when the commit succeeds: key 2's tombstone is
        // replaced, every key reads the new values.
        d.apply_puts_with(&changed, &keys, &hashes, 40, |encode| {
            encode();
            Ok::<(), UnifyError>(())
        })
        .unwrap();
        assert_eq!((d.len(), d.puts(), d.tombstones(), d.max_seq(), d.arena.live_rows()), (3, 3, 0, 42, 3));
        let out = d.to_batches(Category::ScanBuffers, true, 100, 1 << 20, |_| true).unwrap();
        assert_eq!(out.puts[0].column(2).as_any().downcast_ref::<Int32Array>().unwrap().values(), &[2, 3, 1]);
    }

    /// Tombstones are placed while the delete's commit runs: a commit that fails (or panics)
    /// after placing them leaves every key as it was (two puts, one tombstone), entries
    /// removed outright are still there, and the row blocks hold what they held. Then the
    /// delete succeeds: one key removed outright, two get tombstones.
    #[test]
    fn a_failed_or_panicking_delete_leaves_every_key_as_it_was() {
        let mut d = delta();
        let b = batch();
        let keys = d.codec().keys().encode_batch(&b).unwrap();
        d.apply_puts(&b, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        d.apply_deletes(&keys, &[(2, true)], 4, || Ok::<(), UnifyError>(())).unwrap();
        let state = |d: &DeltaStore| (d.len(), d.puts(), d.tombstones(), d.max_seq(), d.arena.live_rows(), d.bytes());
        let was = state(&d);
        let lookups = |d: &DeltaStore| (0..3).map(|i| d.get(keys.row(i).as_ref())).collect::<Vec<_>>();
        let looked = lookups(&d);
        assert_eq!(looked, vec![Some(Lookup::Put), Some(Lookup::Put), Some(Lookup::Deleted)]);
        // Key 3 (row 0) removed outright, keys 1 and 2 (rows 1 and 2) get tombstones.
        let items = [(0, false), (1, true), (2, true)];
        let hashes = hash_keys(&keys);
        let res = d.apply_deletes_with(&keys, &hashes, &items, 10, |place| {
            place();
            Err(UnifyError::SchemaMismatch { detail: "the record's fsync failed".into() })
        });
        assert!(res.is_err());
        assert_eq!((state(&d), lookups(&d)), (was, looked.clone()));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = d.apply_deletes_with(&keys, &hashes, &items, 20, |place| -> Result<(), UnifyError> {
                place();
                panic!("the record's thread panicked");
            });
        }));
        assert!(panicked.is_err());
        assert_eq!((state(&d), lookups(&d)), (was, looked));
        d.apply_deletes_with(&keys, &hashes, &items, 30, |place| {
            place();
            Ok::<(), UnifyError>(())
        })
        .unwrap();
        assert_eq!(lookups(&d), vec![None, Some(Lookup::Deleted), Some(Lookup::Deleted)]);
        assert_eq!((d.len(), d.puts(), d.tombstones(), d.max_seq(), d.arena.live_rows()), (2, 0, 2, 32, 2));
    }
}

#[cfg(test)]
mod parallel_tests {
    use super::*;
    use arrow_array::{Array, Int64Array, StringArray};
    use arrow_schema::Field;
    use gritdb_memctl::ControllerConfig;

    const N: usize = 50_000;

    /// A delta of `N` keys put in scrambled order — 27-byte string keys sharing their first 16
    /// bytes in runs, so the sort's 16-byte prefixes tie and the rows are compared — then every
    /// 10th key deleted with a tombstone.
    fn delta(ctl: &Arc<MemoryController>) -> DeltaStore {
        let schema =
            Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, false), Field::new("v", DataType::Int64, true), Field::new("p", DataType::Utf8, true)]));
        let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap());
        let mut d = DeltaStore::new(Arc::clone(&codec), ctl, None);
        let key = |i: usize| format!("shared-prefix-{:05}-{:07}", i / 1000, i);
        let order: Vec<usize> = (0..N).map(|i| i * 7_919 % N).collect();
        for (at, part) in order.chunks(5_000).enumerate() {
            let b = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(part.iter().map(|&i| Some(key(i))).collect::<StringArray>()),
                    Arc::new(part.iter().map(|&i| (i % 3 != 0).then_some(i as i64)).collect::<Int64Array>()),
                    Arc::new(part.iter().map(|&i| Some(format!("{i:064}"))).collect::<StringArray>()),
                ],
            )
            .unwrap();
            let keys = codec.keys().encode_batch(&b).unwrap();
            d.apply_puts(&b, &keys, (at * 5_000) as u64 + 1, || Ok::<(), UnifyError>(())).unwrap();
        }
        let gone = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new((0..N).step_by(10).map(|i| Some(key(i))).collect::<StringArray>()),
                Arc::new(Int64Array::from(vec![0; N.div_ceil(10)])),
                Arc::new(StringArray::from(vec![""; N.div_ceil(10)])),
            ],
        )
        .unwrap();
        let keys = codec.keys().encode_batch(&gone).unwrap();
        let items: Vec<(usize, bool)> = (0..gone.num_rows()).map(|i| (i, true)).collect();
        d.apply_deletes(&keys, &items, 1_000_000, || Ok::<(), UnifyError>(())).unwrap();
        d
    }

    fn ctl(limit: usize) -> Arc<MemoryController> {
        MemoryController::new(ControllerConfig { memory_limit: Some(limit), ..ControllerConfig::default() }).unwrap()
    }

    #[test]
    fn every_thread_count_gives_the_same_batches() {
        let ctl = ctl(256 << 20);
        let d = delta(&ctl);
        let one = d.to_batches(Category::BatchBlocks, true, 4_096, 1 << 20, |_| true).unwrap();
        let keys: Vec<String> = one
            .puts
            .iter()
            .flat_map(|b| b.column(0).as_any().downcast_ref::<StringArray>().unwrap().iter().map(|k| k.unwrap().to_owned()).collect::<Vec<_>>())
            .collect();
        assert_eq!(keys.len(), N - N.div_ceil(10));
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "puts sorted by key");
        assert_eq!(one.delete_keys.num_rows(), N.div_ceil(10));
        let used = ctl.category_bytes(Category::BatchBlocks);
        for threads in [2, 3, 8] {
            let many = d.to_batches_parallel(Category::BatchBlocks, true, 4_096, 1 << 20, threads, |_| true).unwrap();
            assert_eq!(many.puts.len(), one.puts.len(), "{threads} threads");
            for (a, b) in many.puts.iter().zip(&one.puts) {
                assert_eq!(a, b, "{threads} threads");
            }
            assert_eq!(many.delete_keys, one.delete_keys, "{threads} threads");
            // Same blocks, same bytes.
            assert_eq!(ctl.category_bytes(Category::BatchBlocks), 2 * used, "{threads} threads");
            drop(many);
            assert_eq!(ctl.category_bytes(Category::BatchBlocks), used, "{threads} threads");
        }
        // Keys kept by `keep`, on threads too.
        let odd = |k: &[u8]| k.iter().map(|&b| u32::from(b)).sum::<u32>() % 2 == 1;
        let a = d.to_batches(Category::BatchBlocks, true, 4_096, 1 << 20, odd).unwrap();
        let b = d.to_batches_parallel(Category::BatchBlocks, true, 4_096, 1 << 20, 2, odd).unwrap();
        assert_eq!(a.puts, b.puts);
        assert_eq!(a.delete_keys, b.delete_keys);
        let kept = a.puts.iter().map(RecordBatch::num_rows).sum::<usize>();
        assert!(kept > 0 && kept < N - N.div_ceil(10), "{kept}");
        drop((one, a, b));
        assert_eq!(ctl.category_bytes(Category::BatchBlocks), 0);
    }

    /// An empty delta converts to no batches, sorted or not, on any number of threads.
    #[test]
    fn an_empty_delta_converts_to_nothing() {
        let ctl = ctl(256 << 20);
        let d = DeltaStore::new(Arc::clone(delta(&ctl).codec()), &ctl, None);
        for sorted in [false, true] {
            for threads in [1, 2] {
                let b = d.to_batches_parallel(Category::BatchBlocks, sorted, 4_096, 1 << 20, threads, |_| true).unwrap();
                assert!(b.puts.is_empty() && b.delete_keys.num_rows() == 0, "sorted {sorted}, {threads} threads");
            }
        }
    }

    /// Under a limit with room for the sort's `(prefix, row)` pairs but not for the row starts
    /// of arena order beside them, the rows are selected in map order on one part: same rows,
    /// same order; with less room than the pairs, a memory error and nothing held. The
    /// unsorted select falls back from arena order to map order the same way.
    #[test]
    fn select_under_a_tight_limit_reads_in_map_order() {
        let ctl = ctl(256 << 20);
        let d = delta(&ctl);
        let (puts, dels) = d.select_sorted(Category::BatchBlocks, 2, &|_| true).unwrap();
        assert_eq!((puts.len(), dels.len()), (N - N.div_ceil(10), N.div_ceil(10)));
        let pairs = d.map.len() * std::mem::size_of::<(u128, RowRef)>();
        let room = pairs + d.map.len() * std::mem::size_of::<RowAt>() / 2;
        let mut fill = Reservation::new(&ctl, Category::Metadata, None);
        fill.try_grow(ctl.limit() - ctl.used() - room).unwrap();
        let (p2, d2) = d.select_sorted(Category::BatchBlocks, 2, &|_| true).unwrap();
        assert_eq!(p2, puts);
        assert_eq!(d2, dels);
        assert_eq!(ctl.category_bytes(Category::BatchBlocks), 0);
        // The unsorted select (scans): arena order with room for the row starts, map order
        // without; the same rows either way.
        drop(fill);
        let (mut ap, mut ad) = d.select(Category::BatchBlocks, &|_| true);
        assert!(ap.windows(2).all(|w| w[0].at() < w[1].at()) && ad.windows(2).all(|w| w[0].at() < w[1].at()), "arena order");
        let mut fill = Reservation::new(&ctl, Category::Metadata, None);
        fill.try_grow(ctl.limit() - ctl.used() - d.map.len() * std::mem::size_of::<RowAt>() / 2).unwrap();
        let (mut mp, mut md) = d.select(Category::BatchBlocks, &|_| true);
        assert!(!mp.windows(2).all(|w| w[0].at() < w[1].at()), "map order");
        for v in [&mut ap, &mut ad, &mut mp, &mut md] {
            v.sort_unstable_by_key(|r| r.at());
        }
        assert_eq!((mp, md), (ap, ad));
        drop(fill);
        let mut fill = Reservation::new(&ctl, Category::Metadata, None);
        fill.try_grow(ctl.limit() - ctl.used() - room).unwrap();
        fill.try_grow(room - pairs + 1).unwrap();
        assert!(matches!(d.select_sorted(Category::BatchBlocks, 2, &|_| true), Err(UnifyError::Memory(_))));
        assert_eq!(ctl.category_bytes(Category::BatchBlocks), 0);
    }

    /// A conversion that runs out of memory part-way (some batch blocks built, on several
    /// threads) returns the memory error and holds nothing afterwards.
    #[test]
    fn a_failed_parallel_conversion_releases_every_block() {
        let ctl = ctl(256 << 20);
        let d = delta(&ctl);
        let base = ctl.used();
        let whole = d.to_batches(Category::BatchBlocks, true, 2_048, 1 << 20, |_| true).unwrap();
        let blocks = ctl.category_bytes(Category::BatchBlocks);
        drop(whole);
        assert_eq!(ctl.used(), base);
        // The sort's (prefix, row) pairs fit; the batch blocks do not, all of them.
        let sort = d.len() * std::mem::size_of::<(u128, RowRef)>();
        assert!(blocks > 2 * sort, "{blocks} {sort}");
        ctl.set_limit(base + usize::midpoint(sort, blocks)).unwrap();
        for threads in [1, 2, 3] {
            ctl.reset_peaks();
            let err = d.to_batches_parallel(Category::BatchBlocks, true, 2_048, 1 << 20, threads, |_| true).unwrap_err();
            assert!(matches!(err, UnifyError::Memory(_)), "{threads} threads: {err}");
            assert!(ctl.category_peak(Category::BatchBlocks) > sort, "{threads} threads: failed in the conversion, after some blocks");
            assert_eq!(ctl.category_bytes(Category::BatchBlocks), 0, "{threads} threads");
            assert_eq!(ctl.used(), base, "{threads} threads");
        }
        assert_eq!(d.len(), N, "the delta itself is untouched");
    }
}

#[cfg(test)]
mod hash_tests {
    use super::*;
    use arrow_array::Int64Array;

    /// The map rehashes from the 32-bit tag alone, so every hash must be recoverable from it.
    #[test]
    fn every_key_hash_is_its_spread_tag() {
        for i in 0..10_000u64 {
            let h = key_hash(&i.to_be_bytes());
            assert_eq!(spread(h as u32), h, "key {i}");
        }
    }

    /// 100,000 keys over many map growths (each a rehash from the stored tags), then every key
    /// found, every absent key not found, and replacing a key keeps one entry.
    #[test]
    fn keys_survive_map_growth_and_replacement() {
        let (_ctl, schema, codec, mut d) = int64_delta(256 << 20);
        for start in (0..100_000i64).step_by(1_000) {
            let b = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(start..start + 1_000))]).unwrap();
            let keys = codec.keys().encode_batch(&b).unwrap();
            d.apply_puts(&b, &keys, start as u64 + 1, || Ok::<(), UnifyError>(())).unwrap();
        }
        assert_eq!((d.len(), d.puts()), (100_000, 100_000));
        let probe = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(-50_000..150_000))]).unwrap();
        let keys = codec.keys().encode_batch(&probe).unwrap();
        let found = keys.iter().filter(|k| d.get(k.as_ref()) == Some(Lookup::Put)).count();
        assert_eq!(found, 100_000);
        let again = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(99_990..100_000))]).unwrap();
        let keys = codec.keys().encode_batch(&again).unwrap();
        d.apply_puts(&again, &keys, 200_000, || Ok::<(), UnifyError>(())).unwrap();
        assert_eq!((d.len(), d.puts(), d.max_seq()), (100_000, 100_000, 200_009));
    }
}

#[cfg(test)]
mod view_tests {
    use super::*;
    use arrow_array::{Array, BinaryViewArray, Int64Array, StringViewArray};
    use arrow_schema::Field;
    use gritdb_memctl::ControllerConfig;

    /// View columns without nulls take the length-from-view fast path in `row_sizes`; inline
    /// (≤ 12 bytes) and out-of-line values, and a sliced array, come back byte for byte.
    #[test]
    fn view_columns_without_nulls_round_trip() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8View, false),
            Field::new("b", DataType::BinaryView, false),
        ]));
        let strs: Vec<String> = (0..40).map(|i| "x".repeat(i)).collect();
        let s = StringViewArray::from_iter_values(strs.iter());
        let b = BinaryViewArray::from_iter_values(strs.iter().rev().map(String::as_bytes));
        let full = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(0..40)), Arc::new(s), Arc::new(b)]).unwrap();
        let batch = full.slice(5, 30);
        let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap());
        let mut d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
        let keys = codec.keys().encode_batch(&batch).unwrap();
        d.apply_puts(&batch, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        // Header + key + bitmap + slots (8 + 4 + 4) + string bytes, per row.
        let key_len = keys.row(0).as_ref().len();
        let want: usize = (5..35).map(|i| HEADER + key_len + 1 + 16 + 2 * i).sum();
        assert_eq!(d.arena.live_rows(), 30);
        let out = d.to_batches(Category::ScanBuffers, true, 100, 1 << 20, |_| true).unwrap();
        assert_eq!(out.puts.len(), 1);
        let got = &out.puts[0];
        assert_eq!(got.num_rows(), 30);
        let gs = got.column(1).as_any().downcast_ref::<StringViewArray>().unwrap();
        let gb = got.column(2).as_any().downcast_ref::<BinaryViewArray>().unwrap();
        let mut bytes = 0;
        for r in 0..30 {
            assert_eq!(gs.value(r), strs[r + 5]);
            assert_eq!(gb.value(r), strs[34 - r].as_bytes());
            bytes += gs.value(r).len() + gb.value(r).len();
        }
        assert_eq!(bytes, (5..35).map(|i| 2 * i).sum::<usize>());
        let encoded: usize = d.map.iter().map(|e| d.row_ref(e.at).len()).sum();
        assert_eq!(encoded, want);
    }

    /// Decoded variable-width columns are built without Arrow's per-value validation (see
    /// `decode`): every kind, with multi-byte UTF-8 (values cut at 12/13 bytes inside the view
    /// limit), empty values and nulls, passes `validate_full` and reads back exactly.
    #[test]
    fn decoded_arrays_pass_full_validation() {
        use arrow_array::{BinaryArray, LargeBinaryArray, LargeStringArray, StringArray};
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
            Field::new("ls", DataType::LargeUtf8, true),
            Field::new("sv", DataType::Utf8View, true),
            Field::new("b", DataType::Binary, true),
            Field::new("lb", DataType::LargeBinary, true),
            Field::new("bv", DataType::BinaryView, true),
        ]));
        let text = |i: usize| (i % 5 != 4).then(|| "é€😀a".repeat(i % 7).chars().take(i % 13).collect::<String>());
        let bin = |i: usize| (i % 6 != 5).then(|| (0..(i * 3) % 40).map(|b| (b * 37 + i) as u8).collect::<Vec<u8>>());
        let n = 300;
        let batch = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
                Arc::new((0..n).map(text).collect::<StringArray>()),
                Arc::new((0..n).map(|i| text(i + 1)).collect::<LargeStringArray>()),
                Arc::new((0..n).map(|i| text(i + 2)).collect::<StringViewArray>()),
                Arc::new((0..n).map(bin).collect::<Vec<_>>().iter().map(|v| v.as_deref()).collect::<BinaryArray>()),
                Arc::new((0..n).map(|i| bin(i + 1)).collect::<Vec<_>>().iter().map(|v| v.as_deref()).collect::<LargeBinaryArray>()),
                Arc::new((0..n).map(|i| bin(i + 2)).collect::<Vec<_>>().iter().map(|v| v.as_deref()).collect::<BinaryViewArray>()),
            ],
        )
        .unwrap();
        let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap());
        let mut d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
        let keys = codec.keys().encode_batch(&batch).unwrap();
        d.apply_puts(&batch, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        for rows in [1, 7, 64, 1000] {
            let out = d.to_batches(Category::ScanBuffers, true, rows, 1 << 20, |_| true).unwrap();
            for b in &out.puts {
                for c in b.columns() {
                    c.to_data().validate_full().unwrap();
                }
            }
            let got = arrow_select::concat::concat_batches(&schema, &out.puts).unwrap();
            assert_eq!(got, batch, "{rows} rows a batch");
        }
    }
}

#[cfg(test)]
mod plan_tests {
    use super::*;
    use arrow_array::{Array, Date32Array, Decimal128Array, Int16Array, Int32Array, Int64Array};
    use arrow_schema::Field;
    use gritdb_memctl::ControllerConfig;

    /// Every fixed width the encode plan groups (4, 8, 16 bytes, without nulls) and the ones
    /// it leaves to the per-value path (2 bytes, a 4-byte column with nulls), on a sliced
    /// batch: values come back exactly, in key order.
    #[test]
    fn grouped_fixed_columns_round_trip_from_a_slice() {
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("d", DataType::Date32, false),
            Field::new("k", DataType::Int64, false),
            Field::new("m", DataType::Decimal128(15, 2), false),
            Field::new("h", DataType::Int16, false),
            Field::new("n", DataType::Int32, true),
        ]));
        let n = 100i64;
        let full = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Date32Array::from_iter_values((0..n).map(|i| 19_000 + i as i32))),
                Arc::new(Int64Array::from_iter_values((0..n).rev())),
                Arc::new(Decimal128Array::from_iter_values((0..n).map(|i| i128::from(i) * 1_000_003 - 7)).with_precision_and_scale(15, 2).unwrap()),
                Arc::new(Int16Array::from_iter_values((0..n).map(|i| i as i16 - 50))),
                Arc::new((0..n).map(|i| (i % 4 != 0).then_some(i as i32 * -3)).collect::<Int32Array>()),
            ],
        )
        .unwrap();
        let batch = full.slice(10, 80);
        let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[1], 1 << 20).unwrap());
        let mut d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
        let keys = codec.keys().encode_batch(&batch).unwrap();
        d.apply_puts(&batch, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        let out = d.to_batches(Category::ScanBuffers, true, 1000, 1 << 20, |_| true).unwrap();
        let got = &out.puts[0];
        assert_eq!(got.num_rows(), 80);
        // Keys ascending: input rows 89, 88, ..., 10 of the full batch (keys 10..=89).
        for (r, i) in (10..90).rev().enumerate() {
            let k = got.column(1).as_any().downcast_ref::<Int64Array>().unwrap().value(r);
            assert_eq!(k, n - 1 - i);
            assert_eq!(got.column(0).as_any().downcast_ref::<Date32Array>().unwrap().value(r), 19_000 + i as i32);
            assert_eq!(got.column(2).as_any().downcast_ref::<Decimal128Array>().unwrap().value(r), i128::from(i) * 1_000_003 - 7);
            assert_eq!(got.column(3).as_any().downcast_ref::<Int16Array>().unwrap().value(r), i as i16 - 50);
            let c = got.column(4).as_any().downcast_ref::<Int32Array>().unwrap();
            assert_eq!(c.is_null(r), i % 4 == 0);
            if i % 4 != 0 {
                assert_eq!(c.value(r), i as i32 * -3);
            }
        }
    }
}

#[cfg(test)]
mod refused_tests {
    use super::*;
    use arrow_array::Int64Array;

    /// Puts and tombstones whose commit fails give back the map growth they budgeted: the
    /// key map's bytes and capacity return to their values before.
    #[test]
    fn refused_batches_give_back_map_growth() {
        let (_ctl, schema, codec, mut d) = int64_delta(64 << 20);
        let small = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(0..10))]).unwrap();
        let keys = codec.keys().encode_batch(&small).unwrap();
        d.apply_puts(&small, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        let (bytes, capacity) = (d.map_res.size(), d.map.capacity());
        let big = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(100..10_100))]).unwrap();
        let keys = codec.keys().encode_batch(&big).unwrap();
        let refused = || Err::<(), UnifyError>(UnifyError::SchemaMismatch { detail: "refused".into() });
        assert!(d.apply_puts(&big, &keys, 11, refused).is_err());
        assert_eq!((d.map_res.size(), d.map.capacity(), d.len()), (bytes, capacity, 10));
        let items: Vec<(usize, bool)> = (0..10_000).map(|i| (i, true)).collect();
        assert!(d.apply_deletes(&keys, &items, 11, refused).is_err());
        assert_eq!((d.map_res.size(), d.map.capacity(), d.len()), (bytes, capacity, 10));
        assert_eq!(d.tombstones(), 0);
    }
}

#[cfg(test)]
mod key_hint_tests {
    use super::*;
    use arrow_array::Int64Array;

    fn put(d: &mut DeltaStore, schema: &SchemaRef, keys: std::ops::Range<i64>) {
        let b = RecordBatch::try_new(Arc::clone(schema), vec![Arc::new(Int64Array::from_iter_values(keys.clone()))]).unwrap();
        let rows = d.codec().keys().encode_batch(&b).unwrap();
        d.apply_puts(&b, &rows, keys.start.unsigned_abs() + 1, || Ok::<(), UnifyError>(())).unwrap();
    }

    /// A hinted delta sizes its map for the hint at its first write, budgets exactly that
    /// table, and does not grow again until the hint is passed; then it doubles as usual.
    #[test]
    fn a_key_hint_sizes_the_map_once() {
        let (_ctl, schema, _codec, d) = int64_delta(64 << 20);
        let mut d = d.with_key_hint(5_000);
        assert_eq!((d.map.capacity(), d.map_res.size()), (0, 0), "nothing before the first write");
        put(&mut d, &schema, 0..10);
        let cap = d.map.capacity();
        assert_eq!(cap, capacity_for(5_000));
        assert_eq!(d.map_res.size(), table_bytes(cap));
        put(&mut d, &schema, 10..5_000);
        assert_eq!((d.map.capacity(), d.len()), (cap, 5_000), "no growth up to the hint");
        put(&mut d, &schema, 5_000..cap as i64 + 1);
        assert_eq!(d.map.capacity(), capacity_for(cap + 1), "past the hint: the usual growth");
        assert_eq!(d.map_res.size(), table_bytes(d.map.capacity()));
    }

    /// A refused write gives the map back exactly: a refused first write leaves no table and
    /// drops the hint (its retry must not take that memory again); a refused write past the
    /// hint returns the hinted table to its size (not below it) and its bytes.
    #[test]
    fn a_refused_write_keeps_the_hinted_map_and_the_hint() {
        let (_ctl, schema, _codec, d) = int64_delta(64 << 20);
        let mut d = d.with_key_hint(3_000);
        let refused = || Err::<(), UnifyError>(UnifyError::SchemaMismatch { detail: "refused".into() });
        let b = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(0..10))]).unwrap();
        let rows = d.codec().keys().encode_batch(&b).unwrap();
        assert!(d.apply_puts(&b, &rows, 1, refused).is_err());
        assert_eq!((d.map.capacity(), d.map_res.size(), d.key_hint), (0, 0, 0), "the hint is dropped with the write");
        let mut d = d.with_key_hint(3_000);
        put(&mut d, &schema, 0..10);
        let (cap, bytes) = (d.map.capacity(), d.map_res.size());
        assert_eq!(cap, capacity_for(3_000));
        let big = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from_iter_values(100..10_100))]).unwrap();
        let rows = d.codec().keys().encode_batch(&big).unwrap();
        assert!(d.apply_puts(&big, &rows, 20, refused).is_err());
        assert_eq!((d.map.capacity(), d.map_res.size(), d.len()), (cap, bytes, 10));
        let items: Vec<(usize, bool)> = (0..10_000).map(|i| (i, true)).collect();
        assert!(d.apply_deletes(&rows, &items, 20, refused).is_err());
        assert_eq!((d.map.capacity(), d.map_res.size(), d.len()), (cap, bytes, 10));
    }

    /// A hint whose table does not fit the memory limit is dropped: the write succeeds with
    /// the map sized for its own keys, as without a hint.
    #[test]
    fn a_key_hint_above_the_budget_gives_way() {
        let (ctl, schema, _codec, d) = int64_delta(1 << 20);
        let mut d = d.with_key_hint(10_000_000);
        put(&mut d, &schema, 0..100);
        assert_eq!(d.map.capacity(), capacity_for(100));
        assert_eq!(d.map_res.size(), table_bytes(capacity_for(100)));
        assert!(ctl.used() <= 1 << 20);
    }
}

#[cfg(test)]
mod decimal64_tests {
    use super::*;
    use arrow_array::{Array, Decimal128Array, Int64Array};
    use arrow_schema::Field;
    use gritdb_memctl::ControllerConfig;

    /// Decimals of precision ≤ 18 are kept in 8 bytes a value and come back bit for bit: the
    /// extremes of precisions 18, 15 and 1, zero, −1, nulls, and a sliced input (an array
    /// offset), in key order; the row is 8 bytes shorter per such column than at precision 19.
    #[test]
    fn decimals_up_to_precision_18_round_trip_in_8_bytes() {
        let max18 = 10i128.pow(18) - 1;
        let max15 = 10i128.pow(15) - 1;
        let schema = Arc::new(arrow_schema::Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("d18", DataType::Decimal128(18, 4), true),
            Field::new("d15", DataType::Decimal128(15, 2), false),
            Field::new("d1", DataType::Decimal128(1, 0), true),
        ]));
        let d18 = [Some(max18), Some(-max18), None, Some(0), Some(-1), Some(1), Some(i128::from(i64::MAX) / 10), Some(-7)];
        let d15 = [max15, -max15, 0, -1, 1, 123_456, -987_654_321, 42];
        let d1 = [Some(9), Some(-9), Some(0), None, Some(-1), Some(1), Some(5), Some(-5)];
        let full = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values((0..10).rev())),
                Arc::new(Decimal128Array::from([None, None].into_iter().chain(d18).collect::<Vec<_>>()).with_precision_and_scale(18, 4).unwrap()),
                Arc::new(Decimal128Array::from([0, 0].into_iter().chain(d15).collect::<Vec<_>>()).with_precision_and_scale(15, 2).unwrap()),
                Arc::new(Decimal128Array::from([None, None].into_iter().chain(d1).collect::<Vec<_>>()).with_precision_and_scale(1, 0).unwrap()),
            ],
        )
        .unwrap();
        // Rows 2..10: keys 7..0, every array read from offset 2.
        let b = full.slice(2, 8);
        let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap());
        codec.validate(&b).unwrap();
        assert_eq!(codec.kinds()[1..], [ColKind::Decimal64; 3]);
        let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), ..ControllerConfig::default() }).unwrap();
        let mut d = DeltaStore::new(Arc::clone(&codec), &ctl, None);
        let keys = codec.keys().encode_batch(&b).unwrap();
        d.apply_puts(&b, &keys, 1, || Ok::<(), UnifyError>(())).unwrap();
        let out = d.to_batches(Category::ScanBuffers, true, 100, 1 << 20, |_| true).unwrap();
        let got = &out.puts[0];
        // Sorted by key: the input reversed.
        let want = arrow_select::take::take_record_batch(&b, &arrow_array::UInt32Array::from_iter_values((0..8).rev())).unwrap();
        for j in 0..4 {
            assert_eq!(got.column(j).as_ref(), want.column(j).as_ref(), "column {j}");
        }
        let d18_out = got.column(1).as_any().downcast_ref::<Decimal128Array>().unwrap();
        assert_eq!((d18_out.value(7), d18_out.value(6), d18_out.null_count()), (max18, -max18, 1));
        assert_eq!(got.schema(), schema);

        // The same columns at precision 19 take 16 bytes each.
        let wide = Arc::new(arrow_schema::Schema::new(
            schema
                .fields()
                .iter()
                .map(|f| match f.data_type() {
                    DataType::Decimal128(_, s) => Field::new(f.name(), DataType::Decimal128(19, *s), f.is_nullable()),
                    _ => f.as_ref().clone(),
                })
                .collect::<Vec<_>>(),
        ));
        let wide_codec = RowCodec::new(wide, &[0], 1 << 20).unwrap();
        assert_eq!(wide_codec.kinds()[1..], [ColKind::Fixed(16); 3]);
        assert_eq!(wide_codec.fixed_len() - codec.fixed_len(), 3 * 8);
    }
}
