//! Embedding gritdb: create a keyed table, write, delete, flush, scan, look at memory.
//!
//! Run: `cargo run --release -p gritdb --example embed`

use gritdb::arrow_array::{Array, Int64Array, RecordBatch, StringArray};
use gritdb::arrow_schema::{DataType, Field, Schema};
use gritdb::{Engine, EngineConfig, ScanOptions};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("gritdb-embed-{}", std::process::id()));
    let engine = Engine::open(&dir, EngineConfig::default().memory_limit(256 << 20))?;
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("name", DataType::Utf8, true)]));
    let users = engine.create_table("users", schema.clone(), &["id"])?;
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(Int64Array::from(vec![1, 2, 3])), Arc::new(StringArray::from(vec![Some("ada"), None, Some("grace")]))],
    )?;
    users.insert(&batch)?;
    let keys = RecordBatch::try_new(Arc::new(Schema::new(vec![schema.field(0).clone()])), vec![Arc::new(Int64Array::from(vec![2]))])?;
    println!("deleted {} row(s)", users.delete(&keys)?);
    users.flush()?;
    for b in users.scan(ScanOptions::default().projection(["id", "name"]))? {
        let b = b?;
        let ids = b.column(0).as_any().downcast_ref::<Int64Array>().ok_or("id column")?;
        let names = b.column(1).as_any().downcast_ref::<StringArray>().ok_or("name column")?;
        for i in 0..b.num_rows() {
            println!("{} {:?}", ids.value(i), (!names.is_null(i)).then(|| names.value(i)));
        }
    }
    println!("{}", engine.memory_report());
    engine.close()?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
