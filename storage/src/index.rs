use crate::error::StorageError;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_row::{RowConverter, Rows, SortField};
use arrow_schema::{DataType, SchemaRef};
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use std::cmp::Ordering;
use std::collections::BTreeMap;
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
const BLOOM_PROBES: u32 = 7;

/// Seeded, process-independent hash of stored key bytes (the same for every file's bloom
/// filter and every lookup).
fn key_hash(key: &[u8]) -> u64 {
    foldhash::fast::FixedState::with_seed(0x6772_6974_6462).hash_one(key)
}

/// The primary keys of one data file in row order — which is key order, because every data
/// file is written sorted by key — plus a bloom filter (10 bits per key, 7 probes, about 1%
/// false positives).
#[derive(Debug, Default)]
pub struct FileKeys {
    data: Vec<u8>,
    ends: Vec<u32>,
    width: usize,
    len: usize,
    bloom: Vec<u64>,
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
        let mut prev: Option<Vec<u8>> = None;
        for r in rows {
            if !layout.compact_into(r.as_ref(), &mut buf) {
                return Err("key does not match the key layout".into());
            }
            if prev.as_deref().is_some_and(|p| p >= buf.as_slice()) {
                return Err("keys are not strictly ascending (data files are written sorted by key)".into());
            }
            data.extend_from_slice(&buf);
            if width == 0 {
                ends.push(data.len() as u32);
            }
            bloom_set(&mut bloom, key_hash(&buf));
            prev = Some(buf.clone());
        }
        Ok(Self { data, ends, width, len, bloom })
    }

    /// Stored key of row `i`.
    fn get(&self, i: usize) -> &[u8] {
        if self.width > 0 {
            &self.data[i * self.width..(i + 1) * self.width]
        } else {
            let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
            &self.data[start..self.ends[i] as usize]
        }
    }

    fn find(&self, key: &[u8], hash: u64) -> Option<u32> {
        if !bloom_test(&self.bloom, hash) {
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

fn bloom_probe(hash: u64, i: u32, bits: usize) -> (usize, u64) {
    let h1 = hash as u32;
    let h2 = (hash >> 32) as u32 | 1;
    let bit = (h1.wrapping_add(i.wrapping_mul(h2)) as usize) % (bits * 64);
    (bit / 64, 1u64 << (bit % 64))
}

fn bloom_set(bloom: &mut [u64], hash: u64) {
    for i in 0..BLOOM_PROBES {
        let (w, m) = bloom_probe(hash, i, bloom.len());
        bloom[w] |= m;
    }
}

fn bloom_test(bloom: &[u64], hash: u64) -> bool {
    (0..BLOOM_PROBES).all(|i| {
        let (w, m) = bloom_probe(hash, i, bloom.len());
        bloom[w] & m != 0
    })
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
/// A lookup hashes the key once, skips files whose bloom filter says no, binary-searches the
/// others and returns the occurrence that is not in its file's deletion vector (a key is live
/// in at most one file). Equality is decided on the full key bytes, never on the hash.
///
/// Memory per indexed row: key bytes (16 for two `Int64` columns) + 10 bits of bloom filter;
/// an empty table holds 0 bytes here.
pub struct KeyIndex {
    layout: KeyLayout,
    files: BTreeMap<u32, FileKeys>,
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
        Self {
            layout: KeyLayout::for_types(key_types),
            files: BTreeMap::new(),
            res: Reservation::new(ctl, Category::KeyIndex, table),
        }
    }

    /// Indexed rows over all files (deleted rows included until their file is rewritten).
    pub fn rows(&self) -> usize {
        self.files.values().map(FileKeys::len).sum()
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
        let width = self.layout.width();
        let estimate = match width {
            Some(w) => rows.num_rows() * w,
            None => rows.iter().map(|r| r.as_ref().len() + 4).sum(),
        } + (rows.num_rows() * BLOOM_BITS_PER_KEY).div_ceil(64).max(1) * 8;
        self.res.try_grow(estimate)?;
        match FileKeys::build(rows, &self.layout) {
            Ok(fk) => {
                self.files.insert(id, fk);
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
        self.files.remove(&id);
        self.account();
    }

    fn account(&mut self) {
        let bytes: usize = self.files.values().map(FileKeys::bytes).sum();
        // Shrinking never fails; the growth was budgeted in `add_file`.
        let _ = self.res.try_resize(bytes);
    }

    /// The live location of `key` (arrow-row bytes): the occurrence, newest file first, whose
    /// row `deleted` does not report as deleted.
    pub fn find(&self, key: &[u8], deleted: impl Fn(Loc) -> bool) -> Option<Loc> {
        if self.files.is_empty() {
            return None;
        }
        let mut buf = Vec::with_capacity(key.len());
        if !self.layout.compact_into(key, &mut buf) {
            return None;
        }
        let h = key_hash(&buf);
        for (id, fk) in self.files.iter().rev() {
            if let Some(row) = fk.find(&buf, h) {
                let loc = Loc { file: *id, row };
                if !deleted(loc) {
                    return Some(loc);
                }
            }
        }
        None
    }
}
