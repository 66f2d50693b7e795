//! Accounting: a table's bytes all come back when it is dropped, exactly.

use gritdb::memory::Category;
use gritdb::{Engine, EngineConfig};
use gritdb_tests::*;

fn categories(e: &Engine) -> Vec<(Category, usize)> {
    Category::ALL.iter().map(|c| (*c, e.memory().category_bytes(*c))).collect()
}

#[test]
fn drop_table_returns_every_category_to_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    // Another table exists throughout, so the baseline is not trivially zero.
    let other = engine.create_table("other", composite_schema(), &["k1", "k2"]).unwrap();
    other.insert(&composite_batch(&[((1, 1), (Some(1), None))])).unwrap();
    engine.release_cached_memory();
    let before = categories(&engine);
    let used_before = engine.memory().used();

    let t = engine.create_table("big", composite_schema(), &["k1", "k2"]).unwrap();
    for chunk in 0..10 {
        let rows: Vec<_> = (0..10_000)
            .map(|i| {
                let k = chunk * 10_000 + i;
                ((k, (k % 13) as i32), (Some(k), Some(format!("value-{k}"))))
            })
            .collect();
        assert_eq!(t.insert(&composite_batch(&rows)).unwrap(), 10_000);
    }
    t.flush().unwrap();
    assert_eq!(t.row_count().unwrap(), 100_000);
    let during = engine.memory().used();
    assert!(during > used_before, "the table must hold accounted memory ({during} vs {used_before})");
    assert!(t.stats().unwrap().key_index_bytes > 0);
    engine.drop_table("big").unwrap();
    engine.release_cached_memory();
    assert_eq!(categories(&engine), before, "every category back to its value before the table existed");
    assert_eq!(engine.memory().used(), used_before);
    assert!(engine.table("big").is_err());
    assert!(matches!(t.insert(&composite_batch(&[((1, 1), (None, None))])), Err(gritdb::Error::TableNotFound { .. })));
}

#[test]
fn empty_table_costs_about_one_kib() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let before = engine.memory().used();
    for i in 0..200 {
        engine.create_table(&format!("e{i}"), composite_schema(), &["k1", "k2"]).unwrap();
    }
    let per_table = (engine.memory().used() - before) / 200;
    assert!(per_table > 0, "table metadata must be accounted");
    assert!(per_table <= 1024, "an empty table holds {per_table} accounted bytes");
    for i in 0..200 {
        engine.drop_table(&format!("e{i}")).unwrap();
    }
    assert_eq!(engine.memory().used(), before);
}
