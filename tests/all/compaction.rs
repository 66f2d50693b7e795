//! Compaction keeps the file count and the key index bounded under delete/reinsert churn; the
//! key index costs at most 24 bytes per row for a two-integer key.

use gritdb::{Engine, EngineConfig, ScanOptions};
use gritdb_tests::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
