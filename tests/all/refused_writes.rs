//! Found by a breaker session: a write refused for memory kept the key-map capacity (and the
//! row-block table room) it had grown for its rows, so an empty table held bytes.

use arrow::array::{Int64Array, RecordBatch, StringViewArray};
use arrow::datatypes::{DataType, Field, Schema};
use gritdb::memory::Category;
use gritdb::{Engine, EngineConfig, Error};
use std::sync::Arc;
use std::time::Duration;

/// A batch refused for memory (1,500 rows of 8 KiB strings at an 8 MiB limit) applies nothing
/// and holds nothing: every category but the pool's cached chunks is back at its value
/// before, the key map included; the table still takes a write after.
#[test]
fn a_refused_write_gives_back_its_key_map_growth() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(8 << 20).backpressure_timeout(Duration::from_millis(500));
    let engine = Engine::open(dir.path(), config).unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Utf8View, false)]));
    let t = engine.create_table("big", Arc::clone(&schema), &["k"]).unwrap();
    let base: Vec<usize> = Category::ALL.iter().map(|c| engine.memory().category_bytes(*c)).collect();
    let big = "x".repeat(8 << 10);
    for n in [1_500usize, 1_000] {
        let b = RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(0..n as i64)), Arc::new(StringViewArray::from_iter_values(std::iter::repeat_n(big.as_str(), n)))],
        )
        .unwrap();
        assert!(matches!(t.insert(&b), Err(Error::MemoryLimit { .. })), "{n} rows of 8 KiB under 8 MiB");
        assert_eq!(t.row_count().unwrap(), 0);
        for (c, before) in Category::ALL.iter().zip(&base) {
            if *c != Category::FreeChunks {
                assert_eq!(engine.memory().category_bytes(*c), *before, "{n} rows: {c:?}");
            }
        }
    }
    let one = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from(vec![7])), Arc::new(StringViewArray::from(vec!["ok"]))]).unwrap();
    assert_eq!(t.insert(&one).unwrap(), 1);
    assert_eq!(t.row_count().unwrap(), 1);
}
