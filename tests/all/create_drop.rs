//! Create/drop cycles leave no trace: accounted bytes return exactly to the baseline, open
//! file descriptors too; an empty table costs at most 1 KiB of accounted memory.

use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig};
use std::sync::Arc;

fn five_columns() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("a", DataType::Int64, true),
        Field::new("b", DataType::Float64, true),
        Field::new("c", DataType::Utf8, true),
        Field::new("d", DataType::Int64, true),
    ]))
}

fn rows(n: i64) -> RecordBatch {
    RecordBatch::try_new(
        five_columns(),
        vec![
            Arc::new(Int64Array::from_iter_values(0..n)),
            Arc::new(Int64Array::from_iter_values((0..n).map(|i| i * 2))),
            Arc::new(Float64Array::from_iter_values((0..n).map(|i| i as f64 / 3.0))),
            Arc::new(StringArray::from_iter_values((0..n).map(|i| format!("text-{i}")))),
            Arc::new(Int64Array::from_iter_values((0..n).map(|i| -i))),
        ],
    )
    .unwrap()
}

/// Open file descriptors of this process that point into `dir` (other tests in this binary
/// open files concurrently, so the process-wide count would not measure this engine).
fn open_fds(dir: &std::path::Path) -> usize {
    let dir = dir.canonicalize().unwrap();
    std::fs::read_dir("/proc/self/fd").unwrap().flatten().filter_map(|e| std::fs::read_link(e.path()).ok()).filter(|target| target.starts_with(&dir)).count()
}

#[test]
fn ten_thousand_empty_tables_cost_at_most_one_kib_each() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let before = engine.memory().used();
    let n = 10_000;
    for i in 0..n {
        engine.create_table(&format!("t{i}"), five_columns(), &["id"]).unwrap();
    }
    let growth = engine.memory().used() - before;
    let per_table = growth / n;
    eprintln!("{n} empty tables: {growth} accounted bytes, {per_table} B/table");
    assert!(per_table > 0 && per_table <= 1024, "{per_table} B per empty table");
    assert_eq!(engine.table_names().len(), n);
}

/// Runs `cycles` create → (insert `n` rows → flush) → drop cycles and checks the baseline.
fn cycles(cycles: usize, n: i64) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    // Warm up once so lazily created runtime threads and files exist in the baseline.
    let t = engine.create_table("warm", five_columns(), &["id"]).unwrap();
    t.insert(&rows(10)).unwrap();
    t.flush().unwrap();
    drop(t);
    engine.drop_table("warm").unwrap();
    engine.release_cached_memory();
    let used = engine.memory().used();
    let fds = open_fds(dir.path());
    assert!(fds >= 1, "the engine's lock file is open");
    let report_tables = engine.memory_report().tables.len();
    for i in 0..cycles {
        let name = format!("cycle{i}");
        let t = engine.create_table(&name, five_columns(), &["id"]).unwrap();
        if n > 0 {
            t.insert(&rows(n)).unwrap();
            if i % 2 == 0 {
                t.flush().unwrap();
            }
        }
        drop(t);
        engine.drop_table(&name).unwrap();
    }
    engine.release_cached_memory();
    assert_eq!(engine.memory().used(), used, "accounted bytes back to the baseline after {cycles} cycles of {n} rows");
    // drop_table removes the table's WAL segments before it returns (a flush's removal runs
    // in the background, but drop_table waits for it): no file is open for them any more.
    assert_eq!(open_fds(dir.path()), fds, "open file descriptors back to the baseline");
    assert_eq!(engine.memory_report().tables.len(), report_tables, "no per-table state left");
    assert_eq!(engine.wal_usage(), (0, 0), "no WAL kept for dropped tables");
    assert_eq!(std::fs::read_dir(dir.path().join("tables")).unwrap().count(), 0);
}

#[test]
fn create_drop_cycles_without_rows() {
    cycles(10_000, 0);
}

#[test]
fn create_drop_cycles_with_rows() {
    cycles(10_000, 1_000);
}
