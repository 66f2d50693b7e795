//! A flush and a compaction on several threads (`EngineConfig::flush_threads`: the sort and
//! rows -> Arrow conversion of a sealed delta, then the Parquet encoding of the columns) give
//! the same files, the same answers and the same accounting as on one thread: every category
//! the flush used is back at its baseline afterwards, the peaks of `batch_blocks` and
//! `write_buffers` are the same, and the files read back exactly.

use gritdb::memory::Category;
use gritdb::{Engine, EngineConfig, ScanOptions};
use gritdb_tests::*;
use std::path::Path;
use std::time::Duration;

fn rows(from: i64, n: i64, tag: &str) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, (k % 3) as i32), ((k % 9 != 0).then_some(k * 5), Some(format!("{tag} {k} {}", "p".repeat((k % 50) as usize)))))).collect()
}

/// Data files of the table directory, by name, with their bytes.
fn data_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(dir.join("tables")).unwrap().flatten() {
        for f in std::fs::read_dir(t.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.ends_with(".parquet") {
                out.push((name, std::fs::read(f.path()).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Bytes of the categories a flush uses.
fn flush_categories(e: &Engine) -> Vec<usize> {
    [Category::BatchBlocks, Category::WriteBuffers, Category::ScanBuffers].iter().map(|c| e.memory().category_bytes(*c)).collect()
}

/// Three flushes (150,000 rows: three 64 Ki-row conversion batches; then upserts and
/// deletes of older rows, so deletion vectors and tombstones) and one compaction.
fn run(threads: usize) -> (Vec<(String, Vec<u8>)>, std::collections::BTreeMap<(i64, i32), Row>, Vec<usize>) {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(512 << 20).flush_age(Duration::from_hours(1)).flush_threads(threads);
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let base = flush_categories(&engine);
    t.insert(&composite_batch(&rows(0, 150_000, "a"))).unwrap();
    assert_eq!(t.flush().unwrap(), 150_000);
    assert_eq!(flush_categories(&engine), base, "{threads} threads: back at the baseline after the flush");
    t.upsert(&composite_batch(&rows(140_000, 20_000, "b"))).unwrap();
    let gone: Vec<(i64, i32)> = (0..150_000).step_by(3).map(|k| (k, (k % 3) as i32)).collect();
    t.delete(&composite_keys(&gone)).unwrap();
    t.flush().unwrap();
    assert_eq!(flush_categories(&engine), base, "{threads} threads");
    t.insert(&composite_batch(&rows(500_000, 70_000, "c"))).unwrap();
    t.flush().unwrap();
    assert_eq!(flush_categories(&engine), base, "{threads} threads");
    let peaks = [Category::BatchBlocks, Category::WriteBuffers].iter().map(|c| engine.memory().category_peak(*c)).collect();
    let files = data_files(dir.path());
    let answer = collect_composite(t.scan(ScanOptions::default()).unwrap());
    drop(t);
    engine.close().unwrap();
    (files, answer, peaks)
}

#[test]
fn flush_threads_change_neither_files_nor_answers() {
    let (files_1, answer_1, peaks_1) = run(1);
    let mut model: std::collections::BTreeMap<_, _> = rows(0, 150_000, "a").into_iter().collect();
    model.extend(rows(140_000, 20_000, "b"));
    for k in (0..150_000).step_by(3) {
        model.remove(&(k, (k % 3) as i32));
    }
    model.extend(rows(500_000, 70_000, "c"));
    assert_eq!(answer_1, model);
    assert!(files_1.len() >= 3, "{:?}", files_1.iter().map(|f| &f.0).collect::<Vec<_>>());
    for threads in [2, 3] {
        let (files, answer, peaks) = run(threads);
        assert_eq!(answer, model, "{threads} threads");
        // The same batch blocks and writer buffers at their highest: threads add no memory.
        assert_eq!(peaks, peaks_1, "{threads} threads: peak batch_blocks, write_buffers");
        assert_eq!(files.len(), files_1.len(), "{threads} threads");
        for (a, b) in files.iter().zip(&files_1) {
            assert_eq!(a.0, b.0);
            assert!(a.1 == b.1, "{threads} threads: {} differs from the one-thread file", a.0);
        }
    }
}
