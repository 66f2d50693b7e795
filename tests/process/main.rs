//! Process-wide memory figures (jemalloc `allocated`): in their own test binary, one test at
//! a time, so no other test's allocations land in the measurement (STYLE.md item 16).

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use gritdb::memory::{AllocatorKind, Category, ProcessView};
use gritdb::{Engine, EngineConfig};
use std::sync::Mutex;
use tpchgen::generators::LineItemGenerator;
use tpchgen_arrow::LineItemArrow;

/// Serialises the tests of this binary even when run with several test threads.
static SERIAL: Mutex<()> = Mutex::new(());

fn allocated() -> usize {
    let v = ProcessView::read();
    assert_eq!(v.allocator.kind, AllocatorKind::Jemalloc, "this binary runs on jemalloc");
    v.allocator.allocated
}

/// 1 M TPC-H lineitem rows ingested: the engine accounts for at least 95% of the allocator's
/// growth (outside-engine <= 5%).
#[test]
fn outside_engine_is_at_most_five_percent_of_ingest_growth() {
    let _g = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(
        dir.path(),
        EngineConfig::default().memory_limit(4 << 30).table_flush_bytes(2 << 30).flush_age(std::time::Duration::from_hours(1)),
    )
    .unwrap();
    let mut generator = LineItemArrow::new(LineItemGenerator::new(0.2, 1, 1)).with_batch_size(8192);
    let first = generator.next().unwrap().unwrap();
    let t = engine.create_table("lineitem", first.schema(), &["l_orderkey", "l_linenumber"]).unwrap();
    t.insert(&first).unwrap();
    drop(first);
    let (alloc0, used0) = (allocated(), engine.memory().used());
    let mut rows = 0usize;
    while rows < 1_000_000 {
        let b = generator.next().unwrap().unwrap();
        rows += b.num_rows();
        t.insert(&b).unwrap();
    }
    drop(generator);
    let (alloc1, used1) = (allocated(), engine.memory().used());
    let growth = alloc1.saturating_sub(alloc0);
    let accounted = used1 - used0;
    let outside = growth.saturating_sub(accounted);
    eprintln!(
        "{rows} rows: allocator +{growth} B, engine accounted +{accounted} B, outside-engine {outside} B ({:.2}%); row_blocks {} B",
        outside as f64 * 100.0 / growth as f64,
        engine.memory().category_bytes(Category::RowBlocks)
    );
    assert!(accounted > 50 << 20, "1 M rows must be accounted ({accounted} B)");
    assert!(outside * 20 <= growth, "outside-engine {outside} B is more than 5% of {growth} B");
}

/// A 64-column table: the Parquet writer's buffers stay bounded (row groups are cut by bytes)
/// and are counted under `write_buffers` while they exist.
#[test]
fn wide_table_writer_buffers_are_bounded_and_counted() {
    use arrow::array::{ArrayRef, Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    let _g = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(1 << 30).table_flush_bytes(512 << 20)).unwrap();
    let fields: Vec<Field> = (0..64).map(|i| Field::new(format!("c{i}"), DataType::Int64, false)).collect();
    let schema = Arc::new(Schema::new(fields));
    let t = engine.create_table("wide", Arc::clone(&schema), &["c0"]).unwrap();
    let n = 100_000i64;
    for start in (0..400_000i64).step_by(n as usize) {
        let cols: Vec<ArrayRef> =
            (0..64).map(|c| Arc::new(Int64Array::from_iter_values((start..start + n).map(|i| i * 64 + c))) as ArrayRef).collect();
        t.insert(&RecordBatch::try_new(Arc::clone(&schema), cols).unwrap()).unwrap();
    }
    engine.memory().reset_peaks();
    t.flush().unwrap();
    let peak = engine.memory().category_peak(Category::WriteBuffers);
    eprintln!("64 columns x 400k rows: write_buffers peak {peak} B");
    assert!(peak > 0, "writer buffers are counted");
    assert!(peak <= 48 << 20, "writer buffers stay bounded: {peak} B");
    assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), 0);
    assert_eq!(t.row_count().unwrap(), 400_000);
}
