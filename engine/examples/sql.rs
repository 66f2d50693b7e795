//! SQL over gritdb: load TPC-H lineitem (SF 0.01, generated in process), update and delete
//! some rows, and answer TPC-H Q1 through `Engine::sql` (`DataFusion`) — over committed files,
//! their deletion vectors and the in-memory deltas at once.
//!
//! Run: `cargo run --release -p gritdb --features sql --example sql`

use arrow_array::cast::AsArray;
use arrow_array::types::Decimal128Type;
use arrow_array::{ArrayRef, RecordBatch};
use gritdb::sql::datafusion::arrow::util::pretty::pretty_format_batches;
use gritdb::{Engine, EngineConfig};
use std::sync::Arc;
use std::time::Instant;
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

const Q1: &str = "SELECT l_returnflag, l_linestatus,
    sum(l_quantity) AS sum_qty,
    sum(l_extendedprice) AS sum_base_price,
    sum(l_extendedprice * (1 - l_discount)) AS sum_disc_price,
    sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) AS sum_charge,
    avg(l_quantity) AS avg_qty,
    avg(l_extendedprice) AS avg_price,
    avg(l_discount) AS avg_disc,
    count(*) AS count_order
FROM lineitem
WHERE l_shipdate <= date '1998-12-01' - interval '90' day
GROUP BY l_returnflag, l_linestatus
ORDER BY l_returnflag, l_linestatus";

/// `batch` with one more unit of `l_quantity` on every row (an update of every row in it).
fn more_quantity(batch: &RecordBatch) -> Result<RecordBatch, Box<dyn std::error::Error>> {
    let i = batch.schema().index_of("l_quantity")?;
    let q = batch.column(i).as_primitive::<Decimal128Type>();
    let more = q.unary::<_, Decimal128Type>(|v| v + 100).with_precision_and_scale(q.precision(), q.scale())?;
    let mut cols: Vec<ArrayRef> = batch.columns().to_vec();
    cols[i] = Arc::new(more);
    Ok(RecordBatch::try_new(batch.schema(), cols)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("gritdb-sql-example-{}", std::process::id()));
    let engine = Engine::open(&dir, EngineConfig::default().memory_limit(256 << 20))?;
    let batches: Vec<RecordBatch> = LineItemArrow::new(LineItemGenerator::new(0.01, 1, 1)).with_batch_size(8192).collect::<Result<_, _>>()?;
    let lineitem = engine.create_table("lineitem", batches[0].schema(), &["l_orderkey", "l_linenumber"])?;
    let t = Instant::now();
    for b in &batches {
        lineitem.insert(b)?;
    }
    lineitem.flush()?;
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    println!("loaded {rows} lineitem rows in {:.0} ms (one committed file)", t.elapsed().as_secs_f64() * 1000.0);

    // Updates: one more unit of quantity on every row of batches 0, 3, 6 (flushed: the old
    // versions become deletion-vector entries of the file); deletes: every row of batch 4
    // (kept in the active delta as tombstones, not flushed).
    let mut updated = 0;
    for b in batches.iter().step_by(3) {
        updated += lineitem.update(&more_quantity(b)?)?;
    }
    lineitem.flush()?;
    let key = batches[4].project(&[0, 3])?; // l_orderkey, l_linenumber
    let deleted = lineitem.delete(&key)?;
    println!("updated {updated} rows (flushed), deleted {deleted} rows (in the active delta)");

    let t = Instant::now();
    let q1 = engine.sql(Q1)?;
    println!("\nTPC-H Q1 through SQL ({:.1} ms):", t.elapsed().as_secs_f64() * 1000.0);
    println!("{}", pretty_format_batches(&q1)?);

    let tables = engine.sql("SELECT name, rows, files, file_rows, delta_bytes, index_bytes FROM gritdb_tables")?;
    println!("\n{}", pretty_format_batches(&tables)?);
    let memory = engine.sql(
        "SELECT category, bytes, peak_bytes, failures FROM gritdb_memory WHERE scope = 'engine' AND (bytes > 0 OR peak_bytes > 0) ORDER BY peak_bytes DESC",
    )?;
    println!("\n{}", pretty_format_batches(&memory)?);

    drop(lineitem);
    engine.close()?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
