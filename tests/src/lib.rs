//! Shared helpers for gritdb's integration tests: schemas, batch builders, a BTreeMap model.

use arrow::array::{Array, ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use std::collections::BTreeMap;
use std::sync::Arc;

/// `(k1 Int64, k2 Int32, v Int64 nullable, s Utf8 nullable)` with primary key `(k1, k2)`.
pub fn composite_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k1", DataType::Int64, false),
        Field::new("k2", DataType::Int32, false),
        Field::new("v", DataType::Int64, true),
        Field::new("s", DataType::Utf8, true),
    ]))
}

/// A row of [`composite_schema`].
pub type Row = (Option<i64>, Option<String>);

/// Builds a batch of [`composite_schema`] from `((k1, k2), (v, s))` rows.
pub fn composite_batch(rows: &[((i64, i32), Row)]) -> RecordBatch {
    let k1: Int64Array = rows.iter().map(|r| Some(r.0.0)).collect();
    let k2: Int32Array = rows.iter().map(|r| Some(r.0.1)).collect();
    let v: Int64Array = rows.iter().map(|r| r.1.0).collect();
    let s: StringArray = rows.iter().map(|r| r.1.1.clone()).collect();
    RecordBatch::try_new(composite_schema(), vec![Arc::new(k1), Arc::new(k2), Arc::new(v), Arc::new(s)]).unwrap()
}

/// Builds a key batch `(k1, k2)`.
pub fn composite_keys(keys: &[(i64, i32)]) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("k1", DataType::Int64, false), Field::new("k2", DataType::Int32, false)]));
    let k1: ArrayRef = Arc::new(keys.iter().map(|k| Some(k.0)).collect::<Int64Array>());
    let k2: ArrayRef = Arc::new(keys.iter().map(|k| Some(k.1)).collect::<Int32Array>());
    RecordBatch::try_new(schema, vec![k1, k2]).unwrap()
}

/// Reads a scan of [`composite_schema`] into a map, asserting no key appears twice.
pub fn collect_composite(batches: impl IntoIterator<Item = gritdb::Result<RecordBatch>>) -> BTreeMap<(i64, i32), Row> {
    let mut out = BTreeMap::new();
    for b in batches {
        let b = b.expect("scan batch");
        let k1 = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let k2 = b.column(1).as_any().downcast_ref::<Int32Array>().unwrap();
        let v = b.column(2).as_any().downcast_ref::<Int64Array>().unwrap();
        let s = b.column(3).as_any().downcast_ref::<StringArray>().unwrap();
        for i in 0..b.num_rows() {
            let key = (k1.value(i), k2.value(i));
            let row = ((!v.is_null(i)).then(|| v.value(i)), (!s.is_null(i)).then(|| s.value(i).to_owned()));
            assert!(out.insert(key, row).is_none(), "duplicate primary key {key:?} in scan");
        }
    }
    out
}
pub mod crash;
