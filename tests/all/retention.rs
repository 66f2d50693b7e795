//! Retention rule for scans: results that keep small slices of big buffers are copied out
//! (capacity / used >= 2), so keeping a few small results never pins big blocks.

use arrow::array::{Array, Int64Array, RecordBatch};
use gritdb::memory::Category;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, ScanOptions, compact_if_sparse, retained_bytes};
use gritdb_tests::*;
use std::sync::Arc;

fn rows(n: i64) -> Vec<((i64, i32), Row)> {
    (0..n).map(|k| ((k, 1), (Some(k), Some(format!("some text for row {k}"))))).collect()
}

fn keep_ten(t: &gritdb::Table) -> Vec<RecordBatch> {
    let kept: Vec<RecordBatch> = t.scan(ScanOptions::default().batch_rows(10)).unwrap().take(10).map(Result::unwrap).collect();
    assert_eq!(kept.len(), 10);
    assert!(kept.iter().all(|b| b.num_rows() == 10));
    kept
}

fn retained(kept: &[RecordBatch]) -> usize {
    kept.iter().map(retained_bytes).sum()
}

#[test]
fn copy_out_rule_on_a_plain_slice() {
    let big = composite_batch(&rows(100_000));
    let slice = big.slice(500, 10);
    assert!(retained_bytes(&slice) >= 1 << 20, "a slice pins the whole batch");
    let c = compact_if_sparse(slice.clone()).unwrap();
    assert!(retained_bytes(&c) <= 4096, "{}", retained_bytes(&c));
    assert_eq!(c, slice);
    // A batch that uses its buffers is returned as is (no needless copy).
    let same = compact_if_sparse(big.clone()).unwrap();
    let a = same.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
    let b = big.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
    assert_eq!(a.values().as_ptr(), b.values().as_ptr());
    // A buffer shared by two columns counts once.
    let shared = RecordBatch::try_from_iter(vec![("a", big.column(0).clone()), ("b", big.column(0).clone())]).unwrap();
    assert_eq!(retained_bytes(&shared), retained_bytes(&RecordBatch::try_from_iter(vec![("a", big.column(0).clone())]).unwrap()));
}

#[test]
fn ten_small_results_from_delta_file_and_staged_data_retain_little() {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20).vfs(Arc::new(fs.clone()))).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(100_000))).unwrap();

    // 1. From the active delta.
    let kept = keep_ten(&t);
    assert!(retained(&kept) <= 64 << 10, "delta: {} bytes retained", retained(&kept));
    assert!(engine.memory().category_bytes(Category::ScanBuffers) <= 64 << 10, "the scan's other snapshot blocks are freed");
    drop(kept);

    // 2. From a staged file (flush held mid-way: rows served from the flush batch block).
    fs.stall_paths(".parquet");
    let t2 = t.clone();
    let flusher = std::thread::spawn(move || t2.flush());
    while !fs.is_stalled() {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let kept = keep_ten(&t);
    assert!(retained(&kept) <= 64 << 10, "staged: {} bytes retained", retained(&kept));
    fs.heal();
    flusher.join().unwrap().unwrap();
    drop(kept);

    // 3. From a committed Parquet file.
    let kept = keep_ten(&t);
    assert!(retained(&kept) <= 64 << 10, "file: {} bytes retained", retained(&kept));
    // Projections copy only the projected columns.
    let p: Vec<RecordBatch> = t.scan(ScanOptions::default().batch_rows(10).projection(["v"])).unwrap().take(10).map(Result::unwrap).collect();
    assert!(retained(&p) <= 16 << 10, "projection: {} bytes retained", retained(&p));
}
