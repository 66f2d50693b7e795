//! Compaction keeps the file count and the key index bounded under delete/reinsert churn; the
//! key index costs at most 24 bytes per row for a two-integer key.

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema};
use gritdb::{Engine, EngineConfig, ScanOptions};
use gritdb_tests::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

const ROWS: i64 = 100_000;
/// Documented bound (docs/architecture.md, "Compaction"): with the default options a table
/// whose files are all small keeps fewer than `small_files_trigger` (4) small files plus the
/// file being written and one rewritten file.
const MAX_FILES: usize = 6;

fn row(k: i64, round: i64) -> ((i64, i32), Row) {
    ((k, (k % 3) as i32), (Some(k + round), None))
}

#[test]
fn delete_reinsert_churn_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let t = engine.create_table("churn", composite_schema(), &["k1", "k2"]).unwrap();
    for start in (0..ROWS).step_by(20_000) {
        t.insert(&composite_batch(&(start..start + 20_000).map(|k| row(k, 0)).collect::<Vec<_>>())).unwrap();
    }
    t.flush().unwrap();
    let mut rng = StdRng::seed_from_u64(42);
    let mut values: Vec<i64> = (0..ROWS).collect();
    let mut first_index = 0usize;
    let rounds = 200;
    for round in 1..=rounds {
        let mut keys: Vec<i64> = (0..ROWS / 10).map(|_| rng.random_range(0..ROWS)).collect();
        keys.sort_unstable();
        keys.dedup();
        let kk: Vec<(i64, i32)> = keys.iter().map(|&k| (k, (k % 3) as i32)).collect();
        assert_eq!(t.delete(&composite_keys(&kk)).unwrap(), keys.len());
        t.insert(&composite_batch(&keys.iter().map(|&k| row(k, round)).collect::<Vec<_>>())).unwrap();
        for &k in &keys {
            values[k as usize] = k + round;
        }
        t.flush().unwrap();
        let s = t.stats().unwrap();
        if round == 1 {
            first_index = s.key_index_bytes;
        }
        assert!(s.files <= MAX_FILES, "round {round}: {} files", s.files);
        assert!(s.key_index_bytes as f64 <= 1.1 * first_index as f64, "round {round}: key index {} bytes > 1.1 x {first_index}", s.key_index_bytes);
        assert!(s.key_index_bytes <= 24 * ROWS as usize * 11 / 10, "round {round}: {} bytes", s.key_index_bytes);
    }
    let s = t.stats().unwrap();
    assert!(
        s.key_index_bytes <= 24 * ROWS as usize,
        "key index {} bytes for {ROWS} rows = {:.1} B/row",
        s.key_index_bytes,
        s.key_index_bytes as f64 / ROWS as f64
    );
    eprintln!(
        "after {rounds} rounds: {} files, key index {} bytes ({:.1} B/row), first round {first_index}",
        s.files,
        s.key_index_bytes,
        s.key_index_bytes as f64 / ROWS as f64
    );
    let got = collect_composite(t.scan(ScanOptions::default()).unwrap());
    assert_eq!(got.len(), ROWS as usize);
    let sum: i64 = got.values().map(|r| r.0.unwrap()).sum();
    assert_eq!(sum, values.iter().sum::<i64>());
    // Obsolete files are gone from disk once no scan holds them, and so are their deletion
    // vectors: at most one `.dv` file per live data file (each compacted input used to leave
    // its own behind until the next open).
    let names: Vec<String> = std::fs::read_dir(dir.path().join("tables"))
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .map(|f| f.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.iter().filter(|n| n.ends_with(".parquet")).count(), s.files);
    let dvs = names.iter().filter(|n| n.contains(".dv")).count();
    assert!(dvs <= s.files, "{dvs} deletion-vector files for {} data files: {names:?}", s.files);
}

/// Steady upserts over a bounded key set keep the tables' files, and the metadata counted for
/// them, bounded at a small limit. At 8 MiB a flush holds about 500 rows of 2 KB, no two such
/// files fit a merge's budget by their whole bytes, and each upsert round deletes every row of
/// the files before it: with three tables written at once those were rewritten as empty files
/// one for one, and the files grew with every flush (2026-12-06: 11,000 files and 3.4 MiB of
/// metadata after 90 s). Now files with no live row are dropped without a new file and merges
/// are planned by the live rows' bytes. Three threads, each 1,500 upserts of 100 rows over its
/// own table's 10,000 keys.
#[test]
fn steady_upserts_of_a_bounded_key_set_keep_the_files_bounded() {
    use arrow::array::{Int32Array, StringArray};
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(8 << 20).flush_age(Duration::from_secs(3600))).unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int32, false), Field::new("s", DataType::Utf8, false)]));
    let rounds = 1_500i32;
    let tables: Vec<_> = (0..3).map(|i| engine.create_table(&format!("t{i}"), schema.clone(), &["id"]).unwrap()).collect();
    let most_files: Vec<usize> = std::thread::scope(|sc| {
        let handles: Vec<_> = tables
            .iter()
            .map(|t| {
                let schema = schema.clone();
                sc.spawn(move || {
                    let mut most = 0;
                    for round in 0..rounds {
                        let from = (round * 100) % 10_000;
                        let ids: Vec<i32> = (from..from + 100).collect();
                        let s: Vec<String> = ids.iter().map(|i| format!("{round}:{i:0>2000}")).collect();
                        let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int32Array::from(ids)), Arc::new(StringArray::from(s))]).unwrap();
                        assert_eq!(t.upsert(&b).unwrap(), 100);
                        if round % 50 == 49 {
                            most = most.max(t.stats().unwrap().files);
                        }
                    }
                    most
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let meta = engine.memory_report().categories.iter().find(|c| c.category.name() == "metadata").unwrap().bytes;
    eprintln!("files: at most {most_files:?}; metadata {meta} B");
    for t in &tables {
        t.flush().unwrap();
        // Every key holds its last round's value.
        let mut seen = 0usize;
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            let ids = b.column(0).as_any().downcast_ref::<Int32Array>().unwrap();
            let s = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
            for i in 0..b.num_rows() {
                let id = ids.value(i);
                let last = (0..rounds).rev().find(|r| (r * 100) % 10_000 <= id && id < (r * 100) % 10_000 + 100).unwrap();
                assert_eq!(s.value(i), format!("{last}:{id:0>2000}"));
                seen += 1;
            }
        }
        assert_eq!(seen, 10_000);
    }
    assert!(most_files.iter().all(|&f| f <= 400), "{most_files:?} files");
    assert!(meta <= 256 << 10, "{meta} B of metadata");
    engine.close().unwrap();
}
