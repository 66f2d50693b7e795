use crate::error::StorageError;
use arrow_array::RecordBatch;
use arrow_row::{RowConverter, Rows};
use arrow_schema::{DataType, SchemaRef};
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use std::cmp::Ordering;
use std::hash::BuildHasher;
use std::sync::Arc;

/// Most rows one data file may hold: a key's row is a `u32` in [`Loc`], and deletion vectors
/// are roaring bitmaps of `u32` row numbers. [`KeyBuilder::start`] refuses a larger file's key
/// set with [`StorageError::FileTooLarge`] before anything is allocated, and a flush then
/// writes the delta as several files (the engine's flush in parts).
pub const MAX_FILE_ROWS: usize = u32::MAX as usize;

/// Where a key's row is: data file id and row position in that file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    /// Data file id.
    pub file: u32,
    /// Row position within the file.
    pub row: u32,
}

/// How primary keys are stored in the index.
///
/// Keys arrive as `arrow-row` bytes. For keys whose columns are all fixed-width (integers,
/// dates, decimals, ...) every column's encoding is one validity byte followed by the value
/// bytes; primary keys are never null, so the validity byte is always the same and is
/// dropped: two `Int64` columns take 16 bytes instead of 18. Other keys keep their full
/// encoding plus a `u32` end offset per key ([`KeyEnds`]: the offsets' high bits are kept
/// apart, so a file's key bytes may pass 4 GiB). Dropping a constant byte keeps memcmp order.
#[derive(Debug, Clone)]
pub(crate) enum KeyLayout {
    /// Widths of each fixed-width column's value (without its validity byte).
    Fixed(Vec<usize>),
    /// Variable-width keys, stored as encoded.
    Var,
}

impl KeyLayout {
    fn for_types(types: &[DataType]) -> Self {
        let widths: Option<Vec<usize>> = types.iter().map(|t| if t.is_primitive() { t.primitive_width() } else { None }).collect();
        match widths {
            Some(w) => KeyLayout::Fixed(w),
            None => KeyLayout::Var,
        }
    }

    fn width(&self) -> Option<usize> {
        match self {
            KeyLayout::Fixed(w) => Some(w.iter().sum()),
            KeyLayout::Var => None,
        }
    }

    /// Writes the stored form of a fixed-width `arrow-row` key into `out` (exactly
    /// [`Self::width`] bytes); false when the key does not have this layout's shape (or the
    /// layout is [`KeyLayout::Var`]).
    fn compact_to(&self, key: &[u8], out: &mut [u8]) -> bool {
        let KeyLayout::Fixed(widths) = self else { return false };
        let (mut at, mut o) = (0, 0);
        for &w in widths {
            if key.len() < at + 1 + w || out.len() < o + w {
                return false;
            }
            out[o..o + w].copy_from_slice(&key[at + 1..at + 1 + w]);
            at += 1 + w;
            o += w;
        }
        at == key.len() && o == out.len()
    }
}

const BLOOM_BITS_PER_KEY: usize = 10;
const BLOOM_PROBES: u64 = 7;

/// Longest fixed-width stored key that [`KeyIndex::find`] compacts on the stack (longer ones
/// use a heap buffer).
const STACK_KEY: usize = 64;

/// Seeded, process-independent hash of stored key bytes (the same for every file's bloom
/// filter and every lookup).
fn key_hash(key: &[u8]) -> u64 {
    foldhash::fast::FixedState::with_seed(0x6772_6974_6462).hash_one(key)
}

/// A stored fixed-width key of at most 16 bytes as a big-endian integer, zero-padded on the
/// right: for keys of one width, integer order is memcmp order and integer equality is byte
/// equality.
#[allow(clippy::inline_always)] // the lookup's inner loop; `ci` builds at opt-level 1, which inlines little on its own
#[inline(always)]
fn key_u128(key: &[u8]) -> u128 {
    let w = key.len();
    if (8..=16).contains(&w) {
        // Two 8-byte loads (the second one overlapping the first when `w < 16`), no copy of a
        // variable length.
        let hi = u64::from_be_bytes(*key.first_chunk::<8>().expect("8 bytes")); // infallible: 8 <= w
        let tail = u64::from_be_bytes(*key.last_chunk::<8>().expect("8 bytes")); // infallible: 8 <= w
        let lo = if w == 8 { 0 } else { tail << (8 * (16 - w)) };
        (u128::from(hi) << 64) | u128::from(lo)
    } else {
        let mut b = [0u8; 16];
        b[..w].copy_from_slice(key);
        u128::from_be_bytes(b)
    }
}

/// End offsets of a file's variable-width keys in its key bytes: the low 32 bits of each
/// (4 bytes a key), and, apart, the keys at which the high bits step up — one entry per 4 GiB
/// of key bytes, none below. The offsets were `u32` alone, and a file whose key bytes passed
/// 4 GiB (a million 4 KiB keys: a compaction's merge can write one) wrapped them silently:
/// lookups then compared the wrong bytes. Full `u64` offsets would cost 4 more bytes per key
/// (a 10-character string key is 19 bytes of arrow-row encoding: 23 → 27 bytes a row); this
/// costs nothing below 4 GiB.
#[derive(Debug, Default)]
struct KeyEnds {
    low: Vec<u32>,
    /// `steps[j]`: the first key whose end offset is at least `(j + 1) << 32`.
    steps: Vec<usize>,
}

impl KeyEnds {
    /// Appends the end offset of the next key (offsets never decrease).
    fn push(&mut self, end: usize) {
        let i = self.low.len();
        let high = end >> 32;
        if high > self.steps.len() {
            self.steps.reserve_exact(high - self.steps.len());
            self.steps.resize(high, i);
        }
        // The low 32 bits; the high ones are in `steps`.
        self.low.push(end as u32);
    }

    /// End offset of key `i`.
    #[inline]
    fn get(&self, i: usize) -> usize {
        let high = if self.steps.is_empty() { 0 } else { self.steps.partition_point(|&s| s <= i) };
        (high << 32) | self.low[i] as usize
    }

    fn reserve_exact(&mut self, keys: usize) {
        self.low.reserve_exact(keys);
    }

    /// Heap bytes held (capacities).
    fn bytes(&self) -> usize {
        self.low.capacity() * 4 + self.steps.capacity() * std::mem::size_of::<usize>()
    }

    /// Bytes pushing keys whose end offsets run up to `end` adds to a store with `self`'s
    /// offsets: 4 per key, and a step per 4 GiB boundary passed.
    fn growth(&self, keys: usize, end: usize) -> usize {
        4 * keys + (end >> 32).saturating_sub(self.steps.len()) * std::mem::size_of::<usize>()
    }
}

/// The primary keys of one data file in row order — which is key order, because every data
/// file is written sorted by key — plus a blocked bloom filter (10 bits per key, 7 probes in
/// one 64-byte block, about 1% false positives; see [`bloom_bits`]).
#[derive(Debug, Default)]
pub struct FileKeys {
    data: Vec<u8>,
    ends: KeyEnds,
    width: usize,
    len: usize,
    bloom: Vec<BloomBlock>,
    /// First and last key as [`key_u128`] when keys are fixed-width of at most 16 bytes (0
    /// otherwise): the range check reads these, not the key bytes on the heap.
    first: u128,
    last: u128,
    /// Keys `0, FENCE_KEYS, 2·FENCE_KEYS, …` as [`key_u128`] (fixed-width keys of at most 16
    /// bytes; empty otherwise): a lookup searches these first, then one run of
    /// [`FENCE_KEYS`] keys (see there).
    fences: Vec<u128>,
}

/// Keys per fence of [`FileKeys`]: a sparse first level for the binary search of fixed-width
/// keys, 16 bytes per 64 keys (0.25 B a key beside the 12 B of a lineitem key and its 1.25 B
/// of bloom filter). A search over a file's whole key array takes one cache miss per step
/// (about 19 for 355,000 keys: ~300 ns a hit, most of a keyed delete's time, issue 7); the
/// fences of such a file are 89 KB, which the searches of one batch keep in cache, and the
/// run of 64 keys they lead to is 12 cache lines (docs/performance.md, twenty-second pass).
pub(crate) const FENCE_KEYS: usize = 64;

/// Fences [`FileKeys`] keeps for `rows` keys of width `width` ([`FENCE_KEYS`]).
fn fence_count(rows: usize, width: Option<usize>) -> usize {
    match width {
        Some(w) if (1..=16).contains(&w) => rows.div_ceil(FENCE_KEYS),
        _ => 0,
    }
}

/// One file's [`FileKeys`] built part by part, in row order: the fixed-width store is sized
/// for the announced row count up front and each part is compacted into its slots, so the
/// parts need not all exist at once (the index rebuild at open decodes one batch at a time).
struct FileKeysBuilder<'a> {
    layout: &'a KeyLayout,
    width: usize,
    /// Rows announced (fixed-width keys: the store's slots).
    rows: usize,
    data: Vec<u8>,
    ends: KeyEnds,
    len: usize,
}

impl<'a> FileKeysBuilder<'a> {
    fn new(layout: &'a KeyLayout, rows: usize) -> Self {
        let width = layout.width().unwrap_or(0);
        let data = if width > 0 { vec![0u8; rows * width] } else { Vec::new() };
        let ends = KeyEnds::default();
        Self { layout, width, rows, data, ends, len: 0 }
    }

    /// Bytes a push of `part` adds to the store (0 for fixed-width keys: sized up front).
    fn growth(&self, part: &Rows) -> usize {
        if self.width > 0 {
            return 0;
        }
        let bytes = part.iter().map(|r| r.data().len()).sum::<usize>();
        bytes + self.ends.growth(part.num_rows(), self.data.len() + bytes)
    }

    /// Bytes a push may copy while the store grows (the old buffers live beside the new ones
    /// for that moment): the variable-width store so far, 0 for fixed-width keys.
    fn moving(&self) -> usize {
        if self.width > 0 { 0 } else { self.data.len() + self.ends.bytes() }
    }

    /// Appends the next keys, in row order.
    fn push(&mut self, part: &Rows) -> Result<(), String> {
        if self.len + part.num_rows() > self.rows {
            return Err(format!("more than the {} keys announced", self.rows));
        }
        if self.width > 0 {
            let slots = &mut self.data[self.len * self.width..(self.len + part.num_rows()) * self.width];
            for (dst, key) in slots.chunks_exact_mut(self.width).zip(part.iter()) {
                if !self.layout.compact_to(key.data(), dst) {
                    return Err("key does not match the key layout".into());
                }
            }
        } else {
            // Exact capacities: the store's bytes are what was budgeted for it.
            self.data.reserve_exact(part.iter().map(|r| r.data().len()).sum());
            self.ends.reserve_exact(part.num_rows());
            for key in part {
                self.data.extend_from_slice(key.data());
                self.ends.push(self.data.len());
            }
        }
        self.len += part.num_rows();
        Ok(())
    }

    /// The key set: checked strictly ascending, with its bloom filter.
    fn finish(self) -> Result<FileKeys, String> {
        let Self { data, ends, width, len, rows, .. } = self;
        if len != rows {
            return Err(format!("{len} keys, {rows} announced"));
        }
        let unsorted = || Err("keys are not strictly ascending (data files are written sorted by key)".to_string());
        let mut fk = FileKeys { data, ends, width, len, bloom: Vec::new(), first: 0, last: 0, fences: Vec::new() };
        // Strictly ascending (compared as integers when they fit 16 bytes).
        if width > 0 && width <= 16 {
            let mut prev: Option<u128> = None;
            for k in fk.data.chunks_exact(width).map(key_u128) {
                if prev.is_some_and(|p| p >= k) {
                    return unsorted();
                }
                prev = Some(k);
            }
        } else if (1..len).any(|i| fk.get(i - 1) >= fk.get(i)) {
            return unsorted();
        }
        let mut bloom = vec![BloomBlock::default(); bloom_blocks(len)];
        for i in 0..len {
            bloom_set(&mut bloom, key_hash(fk.get(i)));
        }
        fk.bloom = bloom;
        if width > 0 && width <= 16 && len > 0 {
            (fk.first, fk.last) = (key_u128(fk.get(0)), key_u128(fk.get(len - 1)));
            let mut fences = Vec::with_capacity(fence_count(len, Some(width)));
            fences.extend(fk.data.chunks_exact(width).step_by(FENCE_KEYS).map(key_u128));
            fk.fences = fences;
        }
        Ok(fk)
    }
}

impl FileKeys {
    /// Stored key of row `i`.
    #[inline]
    fn get(&self, i: usize) -> &[u8] {
        if self.width > 0 {
            &self.data[i * self.width..(i + 1) * self.width]
        } else {
            let start = if i == 0 { 0 } else { self.ends.get(i - 1) };
            &self.data[start..self.ends.get(i)]
        }
    }

    /// Row of stored key `key` (hash `hash` = [`key_hash`] of it). Files whose key range does
    /// not hold `key` are skipped on their first and last key (no extra memory: the keys are
    /// sorted), the others on their bloom filter; equality is decided on the key bytes.
    fn find(&self, key: &[u8], hash: u64) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        if self.width > 0 && self.width <= 16 {
            return if key.len() == self.width { self.find_fixed16(key_u128(key), hash) } else { None };
        }
        if key < self.get(0) || key > self.get(self.len - 1) || !bloom_test(&self.bloom, hash) {
            return None;
        }
        let (mut lo, mut hi) = (0usize, self.len);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.get(mid).cmp(key) {
                Ordering::Less => lo = mid + 1,
                Ordering::Greater => hi = mid,
                Ordering::Equal => return Some(mid as u32),
            }
        }
        None
    }

    /// [`Self::find`] for fixed-width keys of at most 16 bytes, compared as integers
    /// ([`key_u128`]); a branch-free lower-bound search.
    #[allow(clippy::inline_always)] // the lookup's inner loop; `ci` builds at opt-level 1, which inlines little on its own
    #[inline(always)]
    fn find_fixed16(&self, k: u128, hash: u64) -> Option<u32> {
        // The range check inline in the caller's loop over files; the rest is not.
        if self.len == 0 || k < self.first || k > self.last {
            return None;
        }
        self.search_fixed16(k, hash)
    }

    /// Bloom filter, then binary search, of a file whose key range holds `k`.
    fn search_fixed16(&self, k: u128, hash: u64) -> Option<u32> {
        if !bloom_test(&self.bloom, hash) {
            return None;
        }
        let w = self.width;
        let data = &self.data[..self.len * w];
        // The last fence <= k (fence 0 = first <= k holds), then within its run of keys the
        // largest `base` with key(base) <= k; both branch-free lower-bound searches.
        let fences = &self.fences[..];
        let (mut run, mut size) = (0usize, fences.len());
        while size > 1 {
            let half = size / 2;
            let mid = run + half;
            run = if fences[mid] <= k { mid } else { run };
            size -= half;
        }
        let mut base = run * FENCE_KEYS;
        let mut size = (self.len - base).min(FENCE_KEYS);
        while size > 1 {
            let half = size / 2;
            let mid = base + half;
            base = if key_u128(&data[mid * w..mid * w + w]) <= k { mid } else { base };
            size -= half;
        }
        (key_u128(&data[base * w..base * w + w]) == k).then_some(base as u32)
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap bytes held (capacities: key bytes, offsets, bloom filter, fences).
    pub fn bytes(&self) -> usize {
        self.data.capacity()
            + self.ends.bytes()
            + self.bloom.capacity() * std::mem::size_of::<BloomBlock>()
            + self.fences.capacity() * std::mem::size_of::<u128>()
    }
}

/// One 512-bit block of a bloom filter: a cache line (64-byte aligned), so a key's probes all
/// touch one line.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, align(64))]
struct BloomBlock([u64; 8]);

/// Blocks of a bloom filter for `keys` keys at [`BLOOM_BITS_PER_KEY`] (at least one).
fn bloom_blocks(keys: usize) -> usize {
    (keys * BLOOM_BITS_PER_KEY).div_ceil(512).max(1)
}

/// The block of `hash` and a second hash whose seven 9-bit fields ([`bloom_probe`]) are its
/// [`BLOOM_PROBES`] bits within the block: a split-block ("blocked") bloom filter (Putze, Sanders, Singler, "Cache-, Hash- and Space-Efficient Bloom Filters",
/// 2007). The block is Lemire's multiply-shift range reduction `(hash * blocks) >> 64` (any
/// number of blocks, no division); the second hash is `hash` rotated and multiplied by the
/// 64-bit golden ratio (Fibonacci hashing). One cache line per key where a textbook filter's probes land in seven (at 10 bits per key a
/// 600,000-key file's filter is 750 KB, beyond L2: setting the bits was half of
/// `KeyIndex::add_file` in a lineitem flush; issue 7). The false-positive rate is the textbook
/// one averaged over the Poisson load of a block, `Σ_L P(L) (1 - (1 - 1/512)^(7L))^7` ≈ 0.96% at
/// 10 bits per key (0.82% unblocked; measured: `bloom_false_positive_rate` below).
#[allow(clippy::inline_always)] // the lookup's inner loop; `ci` builds at opt-level 1, which inlines little on its own
#[inline(always)]
fn bloom_bits(hash: u64, blocks: usize) -> (usize, u64) {
    let block = ((u128::from(hash) * blocks as u128) >> 64) as usize;
    (block, hash.rotate_left(32).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Probe `i` (< [`BLOOM_PROBES`]) of `h2` ([`bloom_bits`]): its word in the block and its mask.
#[allow(clippy::inline_always)] // the lookup's inner loop; `ci` builds at opt-level 1, which inlines little on its own
#[inline(always)]
fn bloom_probe(h2: u64, i: u64) -> (usize, u64) {
    let bit = (h2 >> (55 - 9 * i)) & 511;
    ((bit >> 6) as usize, 1u64 << (bit & 63))
}

fn bloom_set(bloom: &mut [BloomBlock], hash: u64) {
    let (block, h2) = bloom_bits(hash, bloom.len());
    let b = &mut bloom[block].0;
    for i in 0..BLOOM_PROBES {
        let (w, m) = bloom_probe(h2, i);
        b[w] |= m;
    }
}

#[inline]
fn bloom_test(bloom: &[BloomBlock], hash: u64) -> bool {
    let (block, h2) = bloom_bits(hash, bloom.len());
    // `block < bloom.len()` always (the reduction maps into `[0, blocks)`).
    let b = &bloom[block].0;
    (0..BLOOM_PROBES).all(|i| {
        let (w, m) = bloom_probe(h2, i);
        b[w] & m != 0
    })
}

/// Key encoder for the storage side: the one the delta store uses ([`gritdb_keys::key_converter`]),
/// so a key's bytes in a data file equal its bytes in the delta.
pub(crate) fn key_converter(schema: &SchemaRef, key_cols: &[usize]) -> Result<RowConverter, StorageError> {
    Ok(gritdb_keys::key_converter(key_cols.iter().map(|&i| schema.field(i).data_type().clone()))?)
}

/// Key bytes of the rows of a data-file batch, floats made canonical first, as the delta store
/// encodes them ([`gritdb_keys::encode_keys`]).
pub(crate) fn encode_keys(conv: &RowConverter, batch: &RecordBatch, key_cols: &[usize]) -> Result<Rows, StorageError> {
    Ok(gritdb_keys::encode_keys(conv, key_cols.iter().map(|&i| Arc::clone(batch.column(i))).collect())?)
}

/// Builds one data file's key set for a [`KeyIndex`] (its stored keys, the ascending check
/// and the bloom filter) without access to the index, so the caller need not hold the table's
/// lock: a flush of 368,640 lineitem rows spent 13–24 ms here, during which every write to
/// the table waited (`gritdb-soak bench`, docs/performance.md, eleventh pass).
#[derive(Debug, Clone)]
pub(crate) struct KeyBuilder {
    layout: KeyLayout,
    width: Option<usize>,
    ctl: Arc<MemoryController>,
    table: Option<TableAccount>,
}

/// What [`KeyBuilder::build`] gives for a file's keys: the built set, or why the keys cannot
/// be indexed (not strictly ascending, or not of the layout's shape).
pub(crate) type BuildResult = Result<BuiltKeys, String>;

/// A file's key set from [`KeyBuilder::build`], budgeted under `key_index` for the table
/// until [`KeyIndex::install`] takes it (dropped instead, its bytes are released).
#[derive(Debug)]
pub(crate) struct BuiltKeys {
    keys: FileKeys,
    res: Reservation,
}

impl BuiltKeys {
    /// The set's keys in row order (= key order), in their stored form
    /// ([`KeyIndex::find_stored`]).
    pub(crate) fn stored_keys(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.keys.len).map(|i| self.keys.get(i))
    }
}

impl KeyBuilder {
    /// The key set of a file whose keys, in row order, are those of `parts` one after the
    /// other (must be strictly ascending). Its memory is budgeted before it is built (the
    /// key bytes, or the encoded bytes plus a `u32` offset per key for variable-width keys,
    /// plus the bloom filter) and trimmed to what it holds.
    ///
    /// # Errors
    /// [`StorageError::Memory`]; `Ok(Err(detail))` when the keys are not ascending or do not
    /// have the layout's shape (the caller names the file: [`StorageError::CorruptFile`]).
    pub(crate) fn build(&self, parts: &[Rows]) -> Result<BuildResult, StorageError> {
        let mut b = self.start(parts.iter().map(Rows::num_rows).sum())?;
        for p in parts {
            if let Err(detail) = b.push(p)? {
                return Ok(Err(detail));
            }
        }
        Ok(b.finish())
    }

    /// An empty reservation under `key_index` for the table this builder's sets count for.
    pub(crate) fn reservation(&self) -> Reservation {
        Reservation::new(&self.ctl, Category::KeyIndex, self.table.as_ref())
    }

    /// A key set of `rows` keys built part by part ([`KeySetBuild::push`] in row order, then
    /// [`KeySetBuild::finish`]), as [`Self::build`] gives. Fixed-width keys and the bloom
    /// filter are budgeted here, variable-width keys as each part is pushed.
    ///
    /// # Errors
    /// [`StorageError::Memory`]; [`StorageError::FileTooLarge`] for more than
    /// [`MAX_FILE_ROWS`] rows (checked before anything is budgeted or allocated).
    pub(crate) fn start(&self, rows: usize) -> Result<KeySetBuild<'_>, StorageError> {
        check_file_rows(rows)?;
        let mut res = Reservation::new(&self.ctl, Category::KeyIndex, self.table.as_ref());
        res.try_grow(
            self.width
                .map_or(0, |w| rows.saturating_mul(w))
                .saturating_add(bloom_blocks(rows).saturating_mul(std::mem::size_of::<BloomBlock>()))
                .saturating_add(fence_count(rows, self.width).saturating_mul(std::mem::size_of::<u128>())),
        )?;
        Ok(KeySetBuild { keys: FileKeysBuilder::new(&self.layout, rows), res })
    }
}

/// [`StorageError::FileTooLarge`] for a data file of more than [`MAX_FILE_ROWS`] rows.
pub(crate) fn check_file_rows(rows: usize) -> Result<(), StorageError> {
    if rows > MAX_FILE_ROWS {
        return Err(StorageError::FileTooLarge { rows: rows as u64, max_rows: MAX_FILE_ROWS as u64 });
    }
    Ok(())
}

/// A key set being built by [`KeyBuilder::start`], budgeted under `key_index` as it grows.
pub(crate) struct KeySetBuild<'a> {
    keys: FileKeysBuilder<'a>,
    res: Reservation,
}

impl KeySetBuild<'_> {
    /// Appends the next keys of the file, in row order.
    ///
    /// # Errors
    /// [`StorageError::Memory`]; `Ok(Err(detail))` when the keys do not have the layout's
    /// shape or are more than announced.
    pub(crate) fn push(&mut self, part: &Rows) -> Result<Result<(), String>, StorageError> {
        let moving = self.keys.moving();
        self.res.try_grow(self.keys.growth(part) + moving)?;
        let pushed = self.keys.push(part);
        self.res.shrink(moving);
        Ok(pushed)
    }

    /// The built set, trimmed to what it holds; `Err(detail)` when the keys are not strictly
    /// ascending or fewer than announced.
    pub(crate) fn finish(self) -> BuildResult {
        let Self { keys, mut res } = self;
        keys.finish().map(|keys| {
            // Never above what was budgeted (capacities are exact): a shrink, which cannot fail.
            if keys.bytes() <= res.size() {
                res.shrink(res.size() - keys.bytes());
            }
            BuiltKeys { keys, res }
        })
    }
}

/// Primary key → [`Loc`] for a table's data files, counted under `key_index`.
///
/// Layout: per data file, its keys in row order (= key order) in one byte vector (fixed-width
/// keys without offsets and without arrow-row's constant validity bytes) and a bloom filter.
/// A lookup compacts the key on the stack and hashes it once, skips files whose key range
/// (their first and last key) does not hold it or whose bloom filter says no, binary-searches
/// the others and returns the occurrence that is not in its file's deletion vector (a key is live
/// in at most one file). Equality is decided on the full key bytes, never on the hash.
///
/// Memory per indexed row: key bytes (16 for two `Int64` columns) + 10 bits of bloom filter;
/// an empty table holds 0 bytes here.
pub struct KeyIndex {
    layout: KeyLayout,
    /// `layout.width()`.
    width: Option<usize>,
    /// Per data file, ascending by file id (a lookup walks it newest first).
    files: Vec<(u32, FileKeys)>,
    res: Reservation,
    /// The table `res` counts for (handed to [`KeyBuilder`]s).
    table: Option<TableAccount>,
}

impl std::fmt::Debug for KeyIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyIndex").field("files", &self.files.len()).field("bytes", &self.res.size()).finish_non_exhaustive()
    }
}

impl KeyIndex {
    /// An empty index for keys of `key_types`.
    pub fn new(ctl: &Arc<MemoryController>, table: Option<&TableAccount>, key_types: &[DataType]) -> Self {
        let layout = KeyLayout::for_types(key_types);
        Self { width: layout.width(), layout, files: Vec::new(), res: Reservation::new(ctl, Category::KeyIndex, table), table: table.cloned() }
    }

    /// Indexed rows over all files (deleted rows included until their file is rewritten).
    pub fn rows(&self) -> usize {
        self.files.iter().map(|(_, f)| f.len()).sum()
    }

    /// Accounted bytes (key bytes, offsets and bloom filters of every file).
    pub fn bytes(&self) -> usize {
        self.res.size()
    }

    /// Indexes file `id` whose keys, in row order, are those of `parts` one after the other
    /// (must be strictly ascending): [`KeyBuilder::build`] then [`Self::install`].
    /// The memory is budgeted before it is kept.
    ///
    /// # Errors
    /// [`StorageError::Memory`]; `Err(detail)` via [`StorageError::CorruptFile`] at the caller
    /// when the keys are not ascending.
    #[cfg(test)]
    pub(crate) fn add_file(&mut self, id: u32, parts: &[Rows]) -> Result<Result<(), String>, StorageError> {
        Ok(self.builder().build(parts)?.map(|built| self.install(id, built)))
    }

    /// A builder of file key sets for this index that needs no access to it, so a flush or
    /// a compaction builds them without the table's lock ([`BuiltKeys`]).
    pub(crate) fn builder(&self) -> KeyBuilder {
        KeyBuilder { layout: self.layout.clone(), width: self.width, ctl: Arc::clone(self.res.controller()), table: self.table.clone() }
    }

    /// Indexes file `id` with keys built by [`Self::builder`] (replacing the file's keys if it
    /// has some); their reservation joins the index's.
    pub(crate) fn install(&mut self, id: u32, built: BuiltKeys) {
        let BuiltKeys { keys, res } = built;
        match self.files.binary_search_by_key(&id, |(i, _)| *i) {
            Ok(at) => self.files[at].1 = keys,
            Err(at) => self.files.insert(at, (id, keys)),
        }
        self.res.absorb(res);
        self.account();
    }

    /// Bytes of file `id`'s key set (0 when the file is not indexed).
    pub fn file_bytes(&self, id: u32) -> usize {
        self.files.binary_search_by_key(&id, |(i, _)| *i).map_or(0, |at| self.files[at].1.bytes())
    }

    /// Forgets file `id`.
    pub(crate) fn remove_file(&mut self, id: u32) {
        if let Ok(at) = self.files.binary_search_by_key(&id, |(i, _)| *i) {
            self.files.remove(at);
        }
        self.account();
    }

    fn account(&mut self) {
        let bytes: usize = self.files.iter().map(|(_, f)| f.bytes()).sum();
        // Shrinking never fails; the growth was budgeted in `add_file`.
        let _ = self.res.try_resize(bytes);
    }

    /// The live location of `key` (arrow-row bytes): the occurrence, newest file first, whose
    /// row `deleted` does not report as deleted.
    pub fn find(&self, key: &[u8], deleted: impl Fn(Loc) -> bool) -> Option<Loc> {
        if self.files.is_empty() {
            return None;
        }
        // The stored form of the key: arrow-row bytes as they are for variable-width keys,
        // compacted on the stack for fixed-width ones (no allocation per lookup). Hashed once
        // for every file.
        let mut stack = [0u8; STACK_KEY];
        let mut heap = Vec::new();
        let stored: &[u8] = match &self.layout {
            KeyLayout::Var => key,
            KeyLayout::Fixed(widths) => {
                let width = self.width.unwrap_or(0);
                let out: &mut [u8] = if width <= STACK_KEY {
                    &mut stack[..width]
                } else {
                    heap.resize(width, 0);
                    &mut heap
                };
                let mut at = 0;
                let mut to = 0;
                for &w in widths {
                    if key.len() < at + 1 + w {
                        return None;
                    }
                    out[to..to + w].copy_from_slice(&key[at + 1..at + 1 + w]);
                    at += 1 + w;
                    to += w;
                }
                if at != key.len() {
                    return None;
                }
                out
            }
        };
        self.find_stored(stored, deleted)
    }

    /// [`Self::find`] for a key in its stored form (as a file's key set holds it: fixed-width
    /// keys without `arrow-row`'s validity bytes, others as encoded), such as
    /// [`BuiltKeys::stored_keys`] gives: a flush looks the older versions of its puts up by
    /// the keys of the set it installs, without keeping their `arrow-row` encoding.
    pub fn find_stored(&self, stored: &[u8], deleted: impl Fn(Loc) -> bool) -> Option<Loc> {
        let h = key_hash(stored);
        if (1..=16).contains(&stored.len()) && self.width == Some(stored.len()) {
            // Fixed-width keys of at most 16 bytes: the key as an integer, computed once.
            let k = key_u128(stored);
            for (id, fk) in self.files.iter().rev() {
                if let Some(row) = fk.find_fixed16(k, h) {
                    let loc = Loc { file: *id, row };
                    if !deleted(loc) {
                        return Some(loc);
                    }
                }
            }
            return None;
        }
        for (id, fk) in self.files.iter().rev() {
            if let Some(row) = fk.find(stored, h) {
                let loc = Loc { file: *id, row };
                if !deleted(loc) {
                    return Some(loc);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::ArrayRef;
    use arrow_array::{Int32Array, Int64Array, StringArray};
    use arrow_row::SortField;
    use gritdb_memctl::ControllerConfig;

    fn ctl() -> Arc<MemoryController> {
        MemoryController::new(ControllerConfig { memory_limit: Some(1 << 30), ..ControllerConfig::default() }).expect("config")
    }

    fn int_keys(conv: &RowConverter, order: impl IntoIterator<Item = i64>, line: i32) -> Rows {
        let order = Int64Array::from_iter_values(order);
        let line = Int32Array::from_iter_values(std::iter::repeat_n(line, order.len()));
        conv.convert_columns(&[Arc::new(order) as ArrayRef, Arc::new(line)]).expect("encodable")
    }

    /// Exact answers for fixed-width keys: every key in its file, every non-key nowhere, the
    /// newest live occurrence wins, deleted occurrences are passed over.
    #[test]
    fn fixed_keys_exact() {
        let types = [DataType::Int64, DataType::Int32];
        let conv = RowConverter::new(types.iter().map(|t| SortField::new(t.clone())).collect()).expect("conv");
        let ctl = ctl();
        let mut idx = KeyIndex::new(&ctl, None, &types);
        // File 1: even keys 0..2000; file 2: multiples of 3 in 1000..4000 (overlaps file 1).
        let f1: Vec<i64> = (0..1000).map(|i| 2 * i).collect();
        let f2: Vec<i64> = (334..1334).map(|i| 3 * i).collect();
        idx.add_file(1, &[int_keys(&conv, f1.clone(), 1)]).expect("budget").expect("sorted");
        idx.add_file(2, &[int_keys(&conv, f2.clone(), 1)]).expect("budget").expect("sorted");
        let probe = int_keys(&conv, -10..4100, 1);
        for (k, r) in (-10..4100i64).zip(probe.iter()) {
            let got = idx.find(r.as_ref(), |_| false);
            let want = if let Some(p) = f2.iter().position(|&x| x == k) {
                Some(Loc { file: 2, row: p as u32 })
            } else {
                f1.iter().position(|&x| x == k).map(|p| Loc { file: 1, row: p as u32 })
            };
            assert_eq!(got, want, "key {k}");
            // With file 2's occurrence deleted, file 1's (if any) is the live one.
            let got = idx.find(r.as_ref(), |l| l.file == 2);
            assert_eq!(got, f1.iter().position(|&x| x == k).map(|p| Loc { file: 1, row: p as u32 }), "key {k}");
        }
        // Another line number never matches.
        for r in &int_keys(&conv, 0..4000, 2) {
            assert_eq!(idx.find(r.as_ref(), |_| false), None);
        }
        // Accounting: 12 key bytes per row + 10 bloom bits per row in 64-byte blocks (20) +
        // a 16-byte fence per 64 keys (16 for 1,000 keys).
        assert_eq!(idx.bytes(), 2 * (1000 * 12 + 20 * 64 + 16 * 16));
        idx.remove_file(2);
        assert_eq!(idx.bytes(), 1000 * 12 + 20 * 64 + 16 * 16);
    }

    /// The fenced search finds every key and no non-key at every file size around the fence
    /// runs' edges (a last run of 1, 63 and 64 keys, a single run, one key), at the first and
    /// last key of each run, and between and beyond them.
    #[test]
    fn fenced_search_is_exact_at_every_run_edge() {
        let types = [DataType::Int64, DataType::Int32];
        let conv = RowConverter::new(types.iter().map(|t| SortField::new(t.clone())).collect()).expect("conv");
        let ctl = ctl();
        for len in [1usize, 2, 63, 64, 65, 127, 128, 129, 191, 1000, 4097] {
            let mut idx = KeyIndex::new(&ctl, None, &types);
            // Keys 10, 20, 30, ...: each has a non-key on either side.
            let keys: Vec<i64> = (1..=len as i64).map(|i| 10 * i).collect();
            idx.add_file(1, &[int_keys(&conv, keys.clone(), 1)]).expect("budget").expect("sorted");
            assert_eq!(idx.bytes(), len * 12 + bloom_blocks(len) * 64 + len.div_ceil(FENCE_KEYS) * 16, "{len} keys");
            let probes: Vec<i64> = (0..=10 * len as i64 + 10).collect();
            for (k, r) in probes.iter().zip(int_keys(&conv, probes.iter().copied(), 1).iter()) {
                let want = (k % 10 == 0 && *k >= 10 && *k <= 10 * len as i64).then(|| Loc { file: 1, row: (k / 10 - 1) as u32 });
                assert_eq!(idx.find(r.as_ref(), |_| false), want, "{len} keys, key {k}");
            }
        }
    }

    /// Variable-width keys: found only by their exact bytes.
    #[test]
    fn var_keys_exact() {
        let types = [DataType::Utf8];
        let conv = RowConverter::new(vec![SortField::new(DataType::Utf8)]).expect("conv");
        let ctl = ctl();
        let mut idx = KeyIndex::new(&ctl, None, &types);
        let mut words: Vec<String> = (0..500).map(|i| format!("k{i:05}")).collect();
        words.sort();
        let rows = conv.convert_columns(&[Arc::new(StringArray::from(words.clone())) as ArrayRef]).expect("enc");
        idx.add_file(7, std::slice::from_ref(&rows)).expect("budget").expect("sorted");
        // Accounting: 10 bytes of arrow-row encoding per 6-character key (a sentinel and one
        // 8-byte mini block with its continuation byte), a 4-byte end offset (no high-bit
        // steps below 4 GiB), and 5,000 bloom bits in 64-byte blocks (10).
        assert_eq!(rows.iter().map(|r| r.as_ref().len()).collect::<std::collections::BTreeSet<_>>(), [10].into());
        assert_eq!(idx.bytes(), 500 * (10 + 4) + 10 * 64);
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(idx.find(r.as_ref(), |_| false), Some(Loc { file: 7, row: i as u32 }));
        }
        let others: Vec<String> = (0..500).flat_map(|i| [format!("k{i:05}x"), format!("k{i:04}"), String::new()]).collect();
        let rows = conv.convert_columns(&[Arc::new(StringArray::from(others)) as ArrayRef]).expect("enc");
        for r in &rows {
            assert_eq!(idx.find(r.as_ref(), |_| false), None);
        }
    }

    /// Keys out of order or repeated are refused (nothing is indexed, nothing stays budgeted
    /// beyond the index's own bytes); a key that is a prefix of the next is in order.
    #[test]
    fn unsorted_or_repeated_keys_are_refused() {
        let types = [DataType::Int64, DataType::Int32];
        let conv = RowConverter::new(types.iter().map(|t| SortField::new(t.clone())).collect()).expect("conv");
        let ctl = ctl();
        let mut idx = KeyIndex::new(&ctl, None, &types);
        for bad in [vec![1, 2, 2, 3], vec![1, 3, 2], vec![5, 4]] {
            let err = idx.add_file(1, &[int_keys(&conv, bad.clone(), 1)]).expect("budget").expect_err("unsorted");
            assert!(err.contains("strictly ascending"), "{bad:?}: {err}");
        }
        assert_eq!(idx.bytes(), 0);
        idx.add_file(1, &[int_keys(&conv, [1, 2, 3], 1)]).expect("budget").expect("sorted");
        let conv = RowConverter::new(vec![SortField::new(DataType::Utf8)]).expect("conv");
        let mut idx = KeyIndex::new(&ctl, None, &[DataType::Utf8]);
        let words = |w: &[&str]| conv.convert_columns(&[Arc::new(StringArray::from(w.to_vec())) as ArrayRef]).expect("enc");
        for bad in [&["a", "ab", "ab"][..], &["ab", "a"], &["b", "a"]] {
            assert!(idx.add_file(2, &[words(bad)]).expect("budget").is_err(), "{bad:?}");
        }
        idx.add_file(2, &[words(&["", "a", "ab", "b"])]).expect("budget").expect("a prefix sorts first");
        assert_eq!(idx.find(words(&["ab"]).row(0).as_ref(), |_| false), Some(Loc { file: 2, row: 2 }));
    }

    /// Variable-width key offsets past 4 GiB keep their high bits: every end offset comes back
    /// as pushed across one, two and three 4 GiB boundaries (one key crossing two at once), and
    /// the bytes held grow by one step entry per boundary, as `growth` budgets. Before, the
    /// offsets were `as u32` and wrapped silently past 4 GiB of key bytes in one file.
    #[test]
    fn key_end_offsets_past_4_gib_do_not_wrap() {
        const G4: usize = 1 << 32;
        let ends = [0, 7, 19, G4 - 1, G4, G4 + 1, G4 + 5, 2 * G4 + 3, 4 * G4 + 1, 4 * G4 + 100, 4 * G4 + 100, 5 * G4];
        let mut e = KeyEnds::default();
        let mut budget = 0;
        for (i, &end) in ends.iter().enumerate() {
            budget += e.growth(1, end);
            e.push(end);
            assert_eq!(e.get(i), end, "key {i}");
        }
        for (i, &end) in ends.iter().enumerate() {
            assert_eq!(e.get(i), end, "key {i} after all pushes");
        }
        assert_eq!(e.steps, vec![4, 7, 8, 8, 11]);
        assert_eq!(budget, 4 * ends.len() + 5 * std::mem::size_of::<usize>());
        // Below 4 GiB no step is held: 4 bytes a key, as before.
        let mut small = KeyEnds::default();
        small.reserve_exact(3);
        for end in [5, 10, u32::MAX as usize] {
            assert_eq!(small.growth(1, end), 4);
            small.push(end);
        }
        assert_eq!(small.bytes(), 12);
        assert_eq!(small.get(2), u32::MAX as usize);
    }

    /// A key set of more rows than a file can hold (`u32` rows in `Loc` and in deletion
    /// vectors) is refused typed by `start`, before anything is budgeted or allocated; one row
    /// less is not refused for its row count (it fails on the 1 GiB limit instead).
    #[test]
    fn a_key_set_of_more_than_u32_max_rows_is_refused() {
        let ctl = ctl();
        let idx = KeyIndex::new(&ctl, None, &[DataType::Int64]);
        let b = idx.builder();
        assert!(matches!(
            b.start(MAX_FILE_ROWS + 1).map(|_| ()),
            Err(StorageError::FileTooLarge { rows, max_rows }) if rows == 1 << 32 && max_rows == u64::from(u32::MAX)
        ));
        assert_eq!(ctl.used(), 0);
        assert!(matches!(b.start(MAX_FILE_ROWS).map(|_| ()), Err(StorageError::Memory(_))));
        assert!(check_file_rows(MAX_FILE_ROWS).is_ok());
    }

    /// `key_u128` orders and compares keys of one width as memcmp does, for every width 1..=16.
    #[test]
    fn key_u128_is_memcmp_order() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for w in 1..=16usize {
            for _ in 0..2000 {
                let mut a = [0u8; 16];
                let mut b = [0u8; 16];
                for i in 0..w {
                    // Few distinct byte values so that equal prefixes are common.
                    a[i] = (next() % 3) as u8 * 127;
                    b[i] = (next() % 3) as u8 * 127;
                }
                let (a, b) = (&a[..w], &b[..w]);
                assert_eq!(key_u128(a).cmp(&key_u128(b)), a.cmp(b), "{a:?} {b:?}");
            }
        }
    }

    /// The documented false-positive rate (~0.82% at 10 bits, 7 probes) holds.
    #[test]
    fn bloom_false_positive_rate() {
        let n = 100_000usize;
        let mut bloom = vec![BloomBlock::default(); bloom_blocks(n)];
        for i in 0..n as u64 {
            bloom_set(&mut bloom, key_hash(&i.to_be_bytes()));
        }
        for i in 0..n as u64 {
            assert!(bloom_test(&bloom, key_hash(&i.to_be_bytes())));
        }
        let trials = 1_000_000u64;
        let fp = (n as u64..n as u64 + trials).filter(|i| bloom_test(&bloom, key_hash(&i.to_be_bytes()))).count();
        let rate = fp as f64 / trials as f64;
        eprintln!("bloom false-positive rate {rate}");
        // Theory (see `bloom_bits`): 0.957%.
        assert!((0.0085..0.0107).contains(&rate), "false-positive rate {rate}");
    }
}
