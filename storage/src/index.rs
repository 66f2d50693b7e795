use crate::error::StorageError;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_row::{RowConverter, Rows, SortField};
use arrow_schema::{DataType, SchemaRef};
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use std::cmp::Ordering;
use std::hash::BuildHasher;
use std::sync::Arc;

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
/// encoding plus a `u32` end offset per key. Dropping a constant byte keeps memcmp order.
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

    /// Writes the stored form of an `arrow-row` key into `out`; false when the key does not
    /// have this layout's shape.
    fn compact_into(&self, key: &[u8], out: &mut Vec<u8>) -> bool {
        out.clear();
        match self {
            KeyLayout::Var => out.extend_from_slice(key),
            KeyLayout::Fixed(widths) => {
                let mut at = 0;
                for w in widths {
                    if key.len() < at + 1 + w {
                        return false;
                    }
                    out.extend_from_slice(&key[at + 1..at + 1 + w]);
                    at += 1 + w;
                }
                if at != key.len() {
                    return false;
                }
            }
        }
        true
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
        let hi = u64::from_be_bytes(*key.first_chunk::<8>().expect("8 bytes"));
        let tail = u64::from_be_bytes(*key.last_chunk::<8>().expect("8 bytes"));
        let lo = if w == 8 { 0 } else { tail << (8 * (16 - w)) };
        (u128::from(hi) << 64) | u128::from(lo)
    } else {
        let mut b = [0u8; 16];
        b[..w].copy_from_slice(key);
        u128::from_be_bytes(b)
    }
}

/// The primary keys of one data file in row order — which is key order, because every data
/// file is written sorted by key — plus a bloom filter (10 bits per key, 7 probes, about 1%
/// false positives; see [`bloom_probe`]).
#[derive(Debug, Default)]
pub struct FileKeys {
    data: Vec<u8>,
    ends: Vec<u32>,
    width: usize,
    len: usize,
    bloom: Vec<u64>,
    /// First and last key as [`key_u128`] when keys are fixed-width of at most 16 bytes (0
    /// otherwise): the range check reads these, not the key bytes on the heap.
    first: u128,
    last: u128,
}

impl FileKeys {
    fn build(rows: &Rows, layout: &KeyLayout) -> Result<Self, String> {
        let len = rows.num_rows();
        let width = layout.width().unwrap_or(0);
        let mut data = Vec::with_capacity(if width > 0 { len * width } else { rows.iter().map(|r| r.as_ref().len()).sum() });
        let mut ends = Vec::with_capacity(if width == 0 { len } else { 0 });
        let mut buf = Vec::new();
        let bits = (len * BLOOM_BITS_PER_KEY).div_ceil(64).max(1);
        let mut bloom = vec![0u64; bits];
        // Where the previous key starts in `data` (None before the first): compared in place,
        // not copied out per key.
        let mut prev: Option<usize> = None;
        for r in rows {
            if !layout.compact_into(r.as_ref(), &mut buf) {
                return Err("key does not match the key layout".into());
            }
            if prev.is_some_and(|p| data[p..] >= *buf.as_slice()) {
                return Err("keys are not strictly ascending (data files are written sorted by key)".into());
            }
            prev = Some(data.len());
            data.extend_from_slice(&buf);
            if width == 0 {
                ends.push(data.len() as u32);
            }
            bloom_set(&mut bloom, key_hash(&buf));
        }
        let (first, last) = if width > 0 && width <= 16 && len > 0 {
            (key_u128(&data[..width]), key_u128(&data[(len - 1) * width..]))
        } else {
            (0, 0)
        };
        Ok(Self { data, ends, width, len, bloom, first, last })
    }

    /// Stored key of row `i`.
    #[inline]
    fn get(&self, i: usize) -> &[u8] {
        if self.width > 0 {
            &self.data[i * self.width..(i + 1) * self.width]
        } else {
            let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
            &self.data[start..self.ends[i] as usize]
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
        // Largest `base` with key(base) <= k (key(0) = first <= k holds).
        let (mut base, mut size) = (0usize, self.len);
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

    /// Heap bytes held (capacities: key bytes, offsets, bloom filter).
    pub fn bytes(&self) -> usize {
        self.data.capacity() + self.ends.capacity() * 4 + self.bloom.capacity() * 8
    }
}

/// Bit `i` of the bloom filter probe sequence of `hash` over `bits` bits: Kirsch–Mitzenmacher
/// double hashing `g_i = h1 + i * h2 (mod 2^64)` with `h1` the hash and `h2` its halves swapped
/// (forced odd), mapped to `[0, bits)` by Lemire's multiply-shift range reduction
/// `(g_i * bits) >> 64` — one multiplication, no division, any `bits`, no rounding of the
/// filter's size. Each probe is uniform over the filter, so the false-positive rate is the
/// textbook one, `(1 - e^(-7/10))^7` ≈ 0.82% at 10 bits and 7 probes per key (measured:
/// `bloom_false_positive_rate` below).
#[allow(clippy::inline_always)] // the lookup's inner loop; `ci` builds at opt-level 1, which inlines little on its own
#[inline(always)]
fn bloom_probe(h1: u64, h2: u64, i: u64, bits: u64) -> (usize, u64) {
    let g = h1.wrapping_add(i.wrapping_mul(h2));
    let bit = ((u128::from(g) * u128::from(bits)) >> 64) as u64;
    ((bit >> 6) as usize, 1u64 << (bit & 63))
}

#[allow(clippy::inline_always)] // the lookup's inner loop; `ci` builds at opt-level 1, which inlines little on its own
#[inline(always)]
fn bloom_hashes(hash: u64) -> (u64, u64) {
    (hash, hash.rotate_left(32) | 1)
}

fn bloom_set(bloom: &mut [u64], hash: u64) {
    let (h1, h2) = bloom_hashes(hash);
    let bits = bloom.len() as u64 * 64;
    for i in 0..BLOOM_PROBES {
        let (w, m) = bloom_probe(h1, h2, i, bits);
        bloom[w] |= m;
    }
}

#[inline]
fn bloom_test(bloom: &[u64], hash: u64) -> bool {
    let (h1, h2) = bloom_hashes(hash);
    let bits = bloom.len() as u64 * 64;
    let mut i = 0;
    while i < BLOOM_PROBES {
        let (w, m) = bloom_probe(h1, h2, i, bits);
        // `w < bloom.len()` always (the reduction maps into `[0, bits)`).
        if bloom[w] & m == 0 {
            return false;
        }
        i += 1;
    }
    true
}

/// Key encoder for the storage side: the same `arrow-row` encoding the delta store uses
/// (one `SortField` per key column, default options).
pub(crate) fn key_converter(schema: &SchemaRef, key_cols: &[usize]) -> Result<RowConverter, StorageError> {
    let fields = key_cols.iter().map(|&i| SortField::new(schema.field(i).data_type().clone())).collect();
    Ok(RowConverter::new(fields)?)
}

pub(crate) fn encode_keys(conv: &RowConverter, batch: &RecordBatch, key_cols: &[usize]) -> Result<Rows, StorageError> {
    let cols: Vec<ArrayRef> = key_cols.iter().map(|&i| Arc::clone(batch.column(i))).collect();
    Ok(conv.convert_columns(&cols)?)
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
        Self {
            width: layout.width(),
            layout,
            files: Vec::new(),
            res: Reservation::new(ctl, Category::KeyIndex, table),
        }
    }

    /// Indexed rows over all files (deleted rows included until their file is rewritten).
    pub fn rows(&self) -> usize {
        self.files.iter().map(|(_, f)| f.len()).sum()
    }

    /// Accounted bytes (key bytes, offsets and bloom filters of every file).
    pub fn bytes(&self) -> usize {
        self.res.size()
    }

    /// Indexes file `id` whose keys, in row order, are `rows` (must be strictly ascending).
    /// The memory is budgeted before it is kept.
    ///
    /// # Errors
    /// [`StorageError::Memory`]; `Err(detail)` via [`StorageError::CorruptFile`] at the caller
    /// when the keys are not ascending.
    pub(crate) fn add_file(&mut self, id: u32, rows: &Rows) -> Result<Result<(), String>, StorageError> {
        let width = self.width;
        let estimate = match width {
            Some(w) => rows.num_rows() * w,
            None => rows.iter().map(|r| r.as_ref().len() + 4).sum(),
        } + (rows.num_rows() * BLOOM_BITS_PER_KEY).div_ceil(64).max(1) * 8;
        self.res.try_grow(estimate)?;
        match FileKeys::build(rows, &self.layout) {
            Ok(fk) => {
                match self.files.binary_search_by_key(&id, |(i, _)| *i) {
                    Ok(at) => self.files[at].1 = fk,
                    Err(at) => self.files.insert(at, (id, fk)),
                }
                self.account();
                Ok(Ok(()))
            }
            Err(d) => {
                self.account();
                Ok(Err(d))
            }
        }
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
    use arrow_array::{Int32Array, Int64Array, StringArray};
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
        idx.add_file(1, &int_keys(&conv, f1.clone(), 1)).expect("budget").expect("sorted");
        idx.add_file(2, &int_keys(&conv, f2.clone(), 1)).expect("budget").expect("sorted");
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
        // Accounting: 12 key bytes + 10 bloom bits per row.
        assert_eq!(idx.bytes(), 2 * (1000 * 12 + (1000 * BLOOM_BITS_PER_KEY).div_ceil(64) * 8));
        idx.remove_file(2);
        assert_eq!(idx.bytes(), 1000 * 12 + (1000 * BLOOM_BITS_PER_KEY).div_ceil(64) * 8);
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
        idx.add_file(7, &rows).expect("budget").expect("sorted");
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
            let err = idx.add_file(1, &int_keys(&conv, bad.clone(), 1)).expect("budget").expect_err("unsorted");
            assert!(err.contains("strictly ascending"), "{bad:?}: {err}");
        }
        assert_eq!(idx.bytes(), 0);
        idx.add_file(1, &int_keys(&conv, [1, 2, 3], 1)).expect("budget").expect("sorted");
        let conv = RowConverter::new(vec![SortField::new(DataType::Utf8)]).expect("conv");
        let mut idx = KeyIndex::new(&ctl, None, &[DataType::Utf8]);
        let words = |w: &[&str]| conv.convert_columns(&[Arc::new(StringArray::from(w.to_vec())) as ArrayRef]).expect("enc");
        for bad in [&["a", "ab", "ab"][..], &["ab", "a"], &["b", "a"]] {
            assert!(idx.add_file(2, &words(bad)).expect("budget").is_err(), "{bad:?}");
        }
        idx.add_file(2, &words(&["", "a", "ab", "b"])).expect("budget").expect("a prefix sorts first");
        assert_eq!(idx.find(words(&["ab"]).row(0).as_ref(), |_| false), Some(Loc { file: 2, row: 2 }));
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
        let mut bloom = vec![0u64; (n * BLOOM_BITS_PER_KEY).div_ceil(64)];
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
        assert!(rate < 0.0105, "false-positive rate {rate}");
    }
}
