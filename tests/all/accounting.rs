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

/// Rebuilding the key index at open reads every file's key columns: the Parquet reader's
/// buffers and each decoded 8,192-row batch with its keys (14 B a row for `(Int64, Int32)` in
/// the `arrow-row` encoding) count under `key_index` while they live. So the category's
/// high-water mark at open is above the finished index by at least one batch's keys, yet
/// within 2 MiB of it (one batch and one reader, not the file's 300,000 keys twice over, 8.4
/// MB, as the rebuild held before, uncounted); once open the category holds the index alone.
#[test]
fn the_key_index_rebuild_at_open_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let config = || EngineConfig::default().memory_limit(256 << 20);
    let rows = 300_000i64;
    {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
        for start in (0..rows).step_by(50_000) {
            t.insert(&composite_batch(&(start..start + 50_000).map(|k| ((k, (k % 7) as i32), (Some(k), None))).collect::<Vec<_>>())).unwrap();
        }
        t.flush().unwrap();
        engine.close().unwrap();
    }
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("t").unwrap();
    let index = t.stats().unwrap().key_index_bytes;
    let ctl = engine.memory();
    assert_eq!(ctl.category_bytes(Category::KeyIndex), index, "after open: the index alone");
    let peak = ctl.category_peak(Category::KeyIndex);
    assert!(peak >= index + 14 * 8192, "key_index peak {peak} B at open for an index of {index} B: the rebuild's keys were not counted");
    assert!(peak <= index + (2 << 20), "key_index peak {peak} B at open for an index of {index} B: the rebuild holds more than a batch");
    assert_eq!(t.row_count().unwrap(), rows as u64);
}
