use crate::error::StorageError;
use arrow_array::{ArrayRef, RecordBatch};
use arrow_row::{RowConverter, Rows, SortField};
use arrow_schema::SchemaRef;
use gritdb_memctl::{Category, MemoryController, Reservation, TableAccount};
use hashbrown::{DefaultHashBuilder, HashTable};
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::Arc;

/// Where a live key's row is: data file id and row position in that file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    /// Data file id.
    pub file: u32,
    /// Row position within the file.
    pub row: u32,
}

/// The primary keys of one data file, row by row, as `arrow-row` bytes.
///
/// Fixed-width keys (every key column a primitive type) are stored back to back with no
/// offsets; variable-width keys keep `u32` end offsets.
#[derive(Debug, Default)]
pub struct FileKeys {
    data: Vec<u8>,
    ends: Vec<u32>,
    width: usize,
    len: usize,
}

impl FileKeys {
    /// Copies the keys of `rows` (all of them, in order).
    pub fn from_rows(rows: &Rows) -> Self {
        let len = rows.num_rows();
        let total: usize = rows.iter().map(|r| r.as_ref().len()).sum();
        let width = if len > 0 && rows.iter().all(|r| r.as_ref().len() == total / len) && total % len == 0 {
            total / len
        } else {
            0
        };
        let mut data = Vec::with_capacity(total);
        let mut ends = Vec::with_capacity(if width == 0 { len } else { 0 });
        for r in rows {
            data.extend_from_slice(r.as_ref());
            if width == 0 {
                ends.push(data.len() as u32);
            }
        }
        Self { data, ends, width, len }
    }

    /// Key bytes of row `i`.
    pub fn get(&self, i: usize) -> &[u8] {
        if self.width > 0 {
            &self.data[i * self.width..(i + 1) * self.width]
        } else {
            let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
            &self.data[start..self.ends[i] as usize]
        }
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap bytes held (capacities).
    pub fn bytes(&self) -> usize {
        self.data.capacity() + self.ends.capacity() * 4
    }
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

/// Bytes of a `HashTable<Loc>` of `capacity` (entries of 8 bytes + 1 control byte per bucket,
/// plus one trailing group of 16 control bytes; hashbrown keeps buckets × 7/8 usable).
fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 { capacity + 1 } else { capacity / 7 * 8 };
    buckets * (std::mem::size_of::<Loc>() + 1) + 16
}

/// Primary key → [`Loc`] for every live row of a table's data files, counted under
/// `key_index` (hash table plus the per-file key stores).
///
/// An empty index holds no table memory (0 bytes). Key bytes are not duplicated in the table:
/// an entry is 8 bytes and its key is read from the file's [`FileKeys`] when compared, so a
/// hash collision can never match a different key.
pub struct KeyIndex {
    table: HashTable<Loc>,
    hasher: DefaultHashBuilder,
    res: Reservation,
}

impl std::fmt::Debug for KeyIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyIndex").field("len", &self.table.len()).field("bytes", &self.res.size()).finish()
    }
}

type Keys = BTreeMap<u32, FileKeys>;

fn key_at(keys: &Keys, loc: Loc) -> &[u8] {
    keys.get(&loc.file).map_or(&[][..], |k| k.get(loc.row as usize))
}

impl KeyIndex {
    /// An empty index.
    pub fn new(ctl: &Arc<MemoryController>, table: Option<&TableAccount>) -> Self {
        Self { table: HashTable::new(), hasher: DefaultHashBuilder::default(), res: Reservation::new(ctl, Category::KeyIndex, table) }
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True when no key is indexed.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Accounted bytes (hash table + key stores).
    pub fn bytes(&self) -> usize {
        self.res.size()
    }

    /// Where `key` lives, if it is live in some file.
    pub fn get(&self, key: &[u8], keys: &Keys) -> Option<Loc> {
        let h = self.hasher.hash_one(key);
        self.table.find(h, |l| key_at(keys, *l) == key).copied()
    }

    /// Budgets the table for `additional` more entries plus `key_bytes` of key stores in all.
    pub(crate) fn reserve(&mut self, additional: usize, key_bytes: usize, keys: &Keys) -> Result<(), StorageError> {
        let need = self.table.len() + additional;
        if need > self.table.capacity() {
            let new_cap = if need < 8 { 7.max(need) } else { (need * 8 / 7).next_power_of_two() / 8 * 7 };
            // Old and new tables coexist while rehashing.
            self.res.try_resize(table_bytes(self.table.capacity()) + table_bytes(new_cap) + key_bytes)?;
            let hasher = &self.hasher;
            self.table.reserve(need - self.table.len(), |l| hasher.hash_one(key_at(keys, *l)));
        }
        self.res.try_resize(table_bytes(self.table.capacity()) + key_bytes)?;
        Ok(())
    }

    /// Re-states the accounted bytes after key stores were added or removed.
    pub(crate) fn account(&mut self, key_bytes: usize) {
        let want = table_bytes(self.table.capacity()) + key_bytes;
        if self.res.try_resize(want).is_err() {
            // Shrinking never fails; growing beyond the limit here only happens when stores
            // were already budgeted by `reserve`.
            tracing::warn!(want, "key index accounting above limit");
        }
    }

    /// Points `key` at `loc`; returns the location it replaces. The key must be readable at
    /// `loc` through `keys`. Call [`Self::reserve`] first.
    pub(crate) fn insert(&mut self, key: &[u8], loc: Loc, keys: &Keys) -> Option<Loc> {
        let h = self.hasher.hash_one(key);
        if let Some(slot) = self.table.find_mut(h, |l| key_at(keys, *l) == key) {
            return Some(std::mem::replace(slot, loc));
        }
        let hasher = &self.hasher;
        self.table.insert_unique(h, loc, |l| hasher.hash_one(key_at(keys, *l)));
        None
    }

    /// Removes `key`; returns where it was.
    pub(crate) fn remove(&mut self, key: &[u8], keys: &Keys) -> Option<Loc> {
        let h = self.hasher.hash_one(key);
        match self.table.find_entry(h, |l| key_at(keys, *l) == key) {
            Ok(e) => Some(e.remove().0),
            Err(_) => None,
        }
    }

}
