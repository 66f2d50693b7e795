//! String columns whose bytes in one flush exceed 2 GiB: the flush cuts its Arrow batches by
//! bytes, so `i32` offsets never overflow; nothing panics and every row comes back.

use arrow::array::{Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig, ScanOptions};
use std::sync::Arc;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("s", DataType::Utf8, false)]))
}

fn batch(from: i64, n: i64, len: usize) -> RecordBatch {
    let s: StringArray = (from..from + n)
        .map(|i| {
            let id = i.to_string();
            Some(format!("{id}{}", "x".repeat(len - id.len())))
        })
        .collect();
    RecordBatch::try_new(schema(), vec![Arc::new(Int64Array::from_iter_values(from..from + n)), Arc::new(s)]).unwrap()
}

fn check(t: &gritdb::Table, rows: i64, len: usize) {
    let mut n = 0i64;
    let mut bytes = 0usize;
    for b in t.scan(ScanOptions::default().batch_rows(1024)).unwrap() {
        let b = b.unwrap();
        let s = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        n += b.num_rows() as i64;
        bytes += s.value_data().len().min(s.value_offsets()[s.len()] as usize - s.value_offsets()[0] as usize);
        assert!(s.iter().all(|v| v.is_some_and(|v| v.len() == len)));
    }
    assert_eq!(n, rows);
    assert_eq!(bytes, rows as usize * len);
}

/// The mechanism, at a small cut: a 4 MiB flush with 256 KiB batches.
#[test]
fn flush_batches_are_cut_by_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20).flush_batch_bytes(256 << 10)).unwrap();
    let t = engine.create_table("s", schema(), &["id"]).unwrap();
    t.insert(&batch(0, 4096, 1000)).unwrap();
    t.flush().unwrap();
    check(&t, 4096, 1000);
}

/// The real thing: 2.25 GiB of strings in one delta and one flush.
#[test]
fn more_than_two_gib_of_strings_in_one_flush() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(12 << 30).table_flush_bytes(8 << 30).max_row_bytes(2 << 20)).unwrap();
    let t = engine.create_table("s", schema(), &["id"]).unwrap();
    let len = 1 << 20; // 1 MiB per value
    let rows = 2304; // 2.25 GiB
    for from in (0..rows).step_by(128) {
        t.insert(&batch(from, 128, len)).unwrap();
    }
    assert_eq!(t.stats().unwrap().sealed_deltas, 0, "all rows in one delta");
    t.flush().unwrap();
    check(&t, rows, len);
}
