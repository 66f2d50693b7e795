//! The naive keyed store of issue 7: the "before" of the production report. Every row is a
//! `Vec<Value>` with one heap allocation per string value, keyed by its primary key bytes in
//! a `HashMap<Vec<u8>, Vec<Value>>`. `gritdb-soak bench` runs the same insert / upsert /
//! delete on it as on the engine and prints allocations and bytes per row for both.
//!
//! Nothing here is accounted by a memory controller: all of its bytes are outside any engine.

use anyhow::{Result, bail};
use arrow::array::{Array, AsArray, Date32Array, Decimal128Array, Int32Array, Int64Array, LargeStringArray, RecordBatch, StringArray, StringViewArray};
use arrow::datatypes::{DataType, Date32Type, Decimal128Type, Int32Type, Int64Type};
use std::collections::HashMap;

/// One value of a naive row.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Value {
    /// `Int64`.
    I64(i64),
    /// `Int32`.
    I32(i32),
    /// `Decimal128`, the raw unscaled value.
    Dec(i128),
    /// `Date32`, days since the epoch.
    Date(i32),
    /// Any string type; one heap allocation per value.
    Str(String),
    /// A null.
    Null,
}

/// A string column of any Arrow string type, downcast once per batch.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Strs<'a> {
    View(&'a StringViewArray),
    Utf8(&'a StringArray),
    Large(&'a LargeStringArray),
}

impl<'a> Strs<'a> {
    /// The string column `a`, or `None` for another type.
    pub(crate) fn of(a: &'a dyn Array) -> Option<Self> {
        match a.data_type() {
            DataType::Utf8View => Some(Self::View(a.as_string_view())),
            DataType::Utf8 => Some(Self::Utf8(a.as_string::<i32>())),
            DataType::LargeUtf8 => Some(Self::Large(a.as_string::<i64>())),
            _ => None,
        }
    }

    /// A code of value `i` when it is at most 4 bytes long: its length in the low byte, its
    /// bytes from byte 4 up (a `Utf8View` view's first 8 bytes, read as they are); distinct
    /// short strings have distinct codes. `None` for longer values.
    #[inline]
    pub(crate) fn short_code(&self, i: usize) -> Option<u64> {
        if let Self::View(a) = self {
            let v = a.views()[i];
            return ((v as u32) <= 4).then_some(v as u64);
        }
        let s = self.value(i).as_bytes();
        (s.len() <= 4).then(|| {
            let mut b = [0u8; 8];
            b[0] = s.len() as u8;
            b[4..4 + s.len()].copy_from_slice(s);
            u64::from_le_bytes(b)
        })
    }

    /// Value `i` (callers check nulls).
    pub(crate) fn value(&self, i: usize) -> &'a str {
        match self {
            Self::View(a) => a.value(i),
            Self::Utf8(a) => a.value(i),
            Self::Large(a) => a.value(i),
        }
    }
}

/// A column downcast once per batch.
enum Col<'a> {
    I64(&'a Int64Array),
    I32(&'a Int32Array),
    Dec(&'a Decimal128Array),
    Date(&'a Date32Array),
    Str(Strs<'a>),
}

impl<'a> Col<'a> {
    fn of(a: &'a dyn Array) -> Result<Self> {
        Ok(match a.data_type() {
            DataType::Int64 => Col::I64(a.as_primitive::<Int64Type>()),
            DataType::Int32 => Col::I32(a.as_primitive::<Int32Type>()),
            DataType::Decimal128(_, _) => Col::Dec(a.as_primitive::<Decimal128Type>()),
            DataType::Date32 => Col::Date(a.as_primitive::<Date32Type>()),
            t => match Strs::of(a) {
                Some(s) => Col::Str(s),
                None => bail!("naive store: unsupported column type {t}"),
            },
        })
    }

    fn is_null(&self, i: usize) -> bool {
        match self {
            Col::I64(a) => a.is_null(i),
            Col::I32(a) => a.is_null(i),
            Col::Dec(a) => a.is_null(i),
            Col::Date(a) => a.is_null(i),
            Col::Str(Strs::View(a)) => a.is_null(i),
            Col::Str(Strs::Utf8(a)) => a.is_null(i),
            Col::Str(Strs::Large(a)) => a.is_null(i),
        }
    }

    fn value(&self, i: usize) -> Value {
        if self.is_null(i) {
            return Value::Null;
        }
        match self {
            Col::I64(a) => Value::I64(a.value(i)),
            Col::I32(a) => Value::I32(a.value(i)),
            Col::Dec(a) => Value::Dec(a.value(i)),
            Col::Date(a) => Value::Date(a.value(i)),
            Col::Str(s) => Value::Str(s.value(i).to_owned()),
        }
    }

    /// Appends the key bytes of value `i` (big-endian integers, string bytes + 0).
    fn key_bytes(&self, i: usize, out: &mut Vec<u8>) {
        match self {
            Col::I64(a) => out.extend_from_slice(&a.value(i).to_be_bytes()),
            Col::I32(a) => out.extend_from_slice(&a.value(i).to_be_bytes()),
            Col::Date(a) => out.extend_from_slice(&a.value(i).to_be_bytes()),
            Col::Dec(a) => out.extend_from_slice(&a.value(i).to_be_bytes()),
            Col::Str(s) => {
                out.extend_from_slice(s.value(i).as_bytes());
                out.push(0);
            }
        }
    }
}

/// Rows in a `HashMap<Vec<u8>, Vec<Value>>` keyed by primary-key bytes.
#[derive(Debug)]
pub struct NaiveStore {
    rows: HashMap<Vec<u8>, Vec<Value>>,
    key_columns: Vec<usize>,
}

impl NaiveStore {
    /// An empty store whose primary key is the columns `key_columns` (indices, in key order).
    pub fn new(key_columns: &[usize]) -> Self {
        Self { rows: HashMap::new(), key_columns: key_columns.to_vec() }
    }

    /// Live rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when no row is stored.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn keys_of(batch: &RecordBatch, key_columns: &[usize]) -> Result<Vec<Vec<u8>>> {
        let cols = key_columns.iter().map(|&c| Col::of(batch.column(c).as_ref())).collect::<Result<Vec<_>>>()?;
        Ok((0..batch.num_rows())
            .map(|i| {
                let mut k = Vec::with_capacity(16);
                for c in &cols {
                    c.key_bytes(i, &mut k);
                }
                k
            })
            .collect())
    }

    fn write(&mut self, batch: &RecordBatch, replace: bool) -> Result<usize> {
        let cols = batch.columns().iter().map(|a| Col::of(a.as_ref())).collect::<Result<Vec<_>>>()?;
        let keys = Self::keys_of(batch, &self.key_columns)?;
        for (i, key) in keys.into_iter().enumerate() {
            let row: Vec<Value> = cols.iter().map(|c| c.value(i)).collect();
            if replace {
                self.rows.insert(key, row);
            } else {
                match self.rows.entry(key) {
                    std::collections::hash_map::Entry::Occupied(_) => bail!("naive store: duplicate key in insert (row {i})"),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(row);
                    }
                }
            }
        }
        Ok(batch.num_rows())
    }

    /// Inserts every row; fails on a key already present.
    pub fn insert(&mut self, batch: &RecordBatch) -> Result<usize> {
        self.write(batch, false)
    }

    /// Inserts or replaces every row.
    pub fn upsert(&mut self, batch: &RecordBatch) -> Result<usize> {
        self.write(batch, true)
    }

    /// Deletes the rows whose keys are the rows of `keys` (its columns are the key columns in
    /// key order); returns the rows removed.
    pub fn delete(&mut self, keys: &RecordBatch) -> Result<usize> {
        let all: Vec<usize> = (0..keys.num_columns()).collect();
        let mut n = 0;
        for k in Self::keys_of(keys, &all)? {
            n += usize::from(self.rows.remove(&k).is_some());
        }
        Ok(n)
    }

    /// Sum of the raw (unscaled) values of decimal column `col` over live rows.
    pub fn sum_decimal(&self, col: usize) -> i128 {
        self.rows
            .values()
            .map(|r| match r.get(col) {
                Some(Value::Dec(v)) => *v,
                _ => 0,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::ArrayRef;
    use arrow::datatypes::{Field, Schema};
    use std::sync::Arc;

    fn batch(keys: &[(i64, i32)], qty: i128) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k1", DataType::Int64, false),
            Field::new("k2", DataType::Int32, false),
            Field::new("q", DataType::Decimal128(15, 2), false),
            Field::new("s", DataType::Utf8View, false),
        ]));
        let k1: ArrayRef = Arc::new(keys.iter().map(|k| k.0).collect::<Int64Array>());
        let k2: ArrayRef = Arc::new(keys.iter().map(|k| k.1).collect::<Int32Array>());
        let q: ArrayRef = Arc::new(keys.iter().map(|_| qty).collect::<Decimal128Array>().with_precision_and_scale(15, 2).unwrap());
        let s: ArrayRef = Arc::new(keys.iter().map(|k| Some(format!("row {}", k.0))).collect::<StringViewArray>());
        RecordBatch::try_new(schema, vec![k1, k2, q, s]).unwrap()
    }

    #[test]
    fn insert_upsert_delete_counts() {
        let mut s = NaiveStore::new(&[0, 1]);
        let a = batch(&[(1, 1), (1, 2), (2, 1)], 100);
        assert_eq!(s.insert(&a).unwrap(), 3);
        assert!(s.insert(&batch(&[(1, 2)], 1)).is_err(), "duplicate key must fail");
        assert_eq!(s.len(), 3);
        s.upsert(&batch(&[(1, 2), (3, 1)], 500)).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s.sum_decimal(2), 100 + 500 + 100 + 500);
        assert_eq!(s.delete(&a.project(&[0, 1]).unwrap()).unwrap(), 3);
        assert_eq!(s.delete(&a.project(&[0, 1]).unwrap()).unwrap(), 0);
        assert_eq!(s.len(), 1);
        assert_eq!(s.sum_decimal(2), 500);
        assert!(!s.is_empty());
    }
}
