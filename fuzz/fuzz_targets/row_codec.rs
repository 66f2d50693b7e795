//! Row codec round trip: bytes become a batch of (key Int64, Int32?, Utf8?, Boolean?,
//! Decimal128?, Binary?) rows; put into a delta (one allocation per row) and read back as
//! Arrow, every value must come back unchanged, for any input.
#![no_main]
use arrow_array::{Array, BinaryArray, BooleanArray, Decimal128Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use gritdb_memctl::{Category, ControllerConfig, MemoryController};
use gritdb_unify::{DeltaStore, RowCodec};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("i", DataType::Int32, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("b", DataType::Boolean, true),
        Field::new("d", DataType::Decimal128(20, 3), true),
        Field::new("x", DataType::Binary, true),
    ]));
    // Parse rows: each row takes a control byte, a key byte and up to 12 value bytes.
    let mut rows: BTreeMap<i64, (Option<i32>, Option<String>, Option<bool>, Option<i128>, Option<Vec<u8>>)> = BTreeMap::new();
    let mut chunks = data.chunks(14);
    for c in chunks.by_ref() {
        if c.len() < 2 {
            break;
        }
        let ctl = c[0];
        let key = i64::from(c[1]) - 128;
        let rest = &c[2..];
        let i = (ctl & 1 != 0).then(|| i32::from_le_bytes([rest.first().copied().unwrap_or(0), 0, 0, rest.get(1).copied().unwrap_or(0)]));
        let s = (ctl & 2 != 0).then(|| String::from_utf8_lossy(rest).into_owned());
        let b = (ctl & 4 != 0).then_some(ctl & 8 != 0);
        let d = (ctl & 16 != 0).then(|| i128::from(rest.len() as i64) * if ctl & 32 != 0 { -1 } else { 1 } * 1_000_000_007);
        let x = (ctl & 64 != 0).then(|| rest.iter().rev().copied().collect());
        rows.insert(key, (i, s, b, d, x));
    }
    if rows.is_empty() {
        return;
    }
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![
            Arc::new(Int64Array::from_iter_values(rows.keys().copied())),
            Arc::new(rows.values().map(|r| r.0).collect::<Int32Array>()),
            Arc::new(rows.values().map(|r| r.1.clone()).collect::<StringArray>()),
            Arc::new(rows.values().map(|r| r.2).collect::<BooleanArray>()),
            Arc::new(rows.values().map(|r| r.3).collect::<Decimal128Array>().with_precision_and_scale(20, 3).unwrap()),
            Arc::new(rows.values().map(|r| r.4.as_deref()).collect::<BinaryArray>()),
        ],
    )
    .unwrap();
    let ctl = MemoryController::new(ControllerConfig { memory_limit: Some(64 << 20), chunk_size: 4096, ..ControllerConfig::default() }).unwrap();
    let codec = Arc::new(RowCodec::new(Arc::clone(&schema), &[0], 1 << 20).unwrap());
    codec.validate(&batch).unwrap();
    let keys = codec.keys().encode_batch(&batch).unwrap();
    let mut delta = DeltaStore::new(codec, &ctl, None);
    delta.apply_puts(&batch, &keys, 1, || Ok::<(), gritdb_unify::UnifyError>(())).unwrap();
    let out = delta.to_batches(Category::ScanBuffers, true, 1 << 20, 1 << 30, |_| true).unwrap();
    let back = arrow_select_concat(&schema, &out.puts);
    assert_eq!(back.num_rows(), batch.num_rows());
    for c in 0..schema.fields().len() {
        assert_eq!(back.column(c).to_data(), batch.column(c).to_data(), "column {c}");
    }
    drop(back);
    drop(out);
    drop(delta);
    assert_eq!(ctl.category_bytes(Category::ScanBuffers), 0);
});

fn arrow_select_concat(schema: &Arc<Schema>, batches: &[RecordBatch]) -> RecordBatch {
    assert_eq!(batches.len(), 1, "one batch for under 1 Mi rows");
    let b = batches[0].clone();
    assert_eq!(b.schema(), *schema);
    b
}
