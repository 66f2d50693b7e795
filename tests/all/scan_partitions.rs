//! `Table::scan_partitions`: one snapshot read by several scans on several threads returns
//! exactly the rows of one scan, each once, and every counted byte is released after.

use arrow::array::{Int64Array, RecordBatch};
use gritdb::memory::Category;
use gritdb::{CompareOp, Engine, EngineConfig, ScanFilter, ScanOptions};
use gritdb_tests::*;
use std::sync::Arc;
use std::time::Duration;

fn rows(from: i64, n: i64, tag: &str) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, (k % 3) as i32), (Some(k * 10), Some(format!("{tag} {k}"))))).collect()
}

/// Runs each scan on its own thread and returns all their batches.
fn on_threads(scans: Vec<gritdb::Scan>) -> Vec<RecordBatch> {
    std::thread::scope(|s| {
        let handles: Vec<_> = scans.into_iter().map(|scan| s.spawn(move || scan.map(Result::unwrap).collect::<Vec<RecordBatch>>())).collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

/// Several data files of several row groups (five flushes; compaction may merge some), a
/// deletion vector, rows
/// replaced by upserts still in memory, deletes still in memory, and new rows in a delta:
/// 1 to 6 partitions on as many threads return the single scan's rows, each once (the model
/// compares whole rows, and the row count rules out repeats), with and without a filter and
/// a projection; a write after `scan_partitions` is in none of them; `scan_buffers` ends at 0.
#[test]
fn partitions_on_threads_return_the_single_scans_rows_once() {
    let dir = tempfile::tempdir().unwrap();
    // Row groups are cut at half the flush threshold: 2 MiB gives files of several.
    let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(2 << 20).flush_age(Duration::from_secs(3600));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("p", composite_schema(), &["k1", "k2"]).unwrap();
    for (i, n) in [(0, 90_000), (1, 60_000), (2, 80_000), (3, 500), (4, 700)] {
        t.insert(&composite_batch(&rows(i * 100_000, n, "first"))).unwrap();
        t.flush().unwrap();
    }
    let files = t.stats().unwrap().files;
    assert!(files >= 2, "{files} files (compaction may merge the small ones)");
    // A deletion vector in a file, then changes still in memory.
    let gone: Vec<(i64, i32)> = (100_000..130_000).step_by(5).map(|k| (k, (k % 3) as i32)).collect();
    t.delete(&composite_keys(&gone)).unwrap();
    t.flush().unwrap();
    t.upsert(&composite_batch(&rows(10_000, 5_000, "upserted"))).unwrap();
    let gone_now: Vec<(i64, i32)> = (200_000..210_000).step_by(3).map(|k| (k, (k % 3) as i32)).collect();
    t.delete(&composite_keys(&gone_now)).unwrap();
    t.insert(&composite_batch(&rows(900_000, 3_000, "delta"))).unwrap();
    let scan_bytes = || engine.memory().category_bytes(Category::ScanBuffers);

    let band = ScanFilter::and([
        ScanFilter::compare("k1", CompareOp::GtEq, Arc::new(Int64Array::from(vec![20_000]))),
        ScanFilter::compare("k1", CompareOp::Lt, Arc::new(Int64Array::from(vec![400_300]))),
    ]);
    let options = [
        ScanOptions::default(),
        ScanOptions::default().filter(band.clone()).batch_rows(1_000),
        ScanOptions::default().projection(["k1", "k2", "v", "s"]).filter(band),
    ];
    for (o, opts) in options.into_iter().enumerate() {
        let mut scan = t.scan(opts.clone()).unwrap();
        let single: Vec<RecordBatch> = scan.by_ref().map(Result::unwrap).collect();
        let groups = scan.metrics().row_groups_total;
        assert!(groups >= files as u64 + 2, "options {o}: {groups} row groups in {files} files");
        drop(scan);
        let want_rows: usize = single.iter().map(RecordBatch::num_rows).sum();
        let want = collect_composite(single.into_iter().map(Ok));
        assert_eq!(want.len(), want_rows, "options {o}: the single scan returns each key once");
        assert!(want_rows > 100_000, "options {o}: {want_rows} rows");
        for n in 1..=6 {
            let scans = t.scan_partitions(opts.clone(), n).unwrap();
            assert_eq!(scans.len(), n);
            // Written after the snapshot: in no partition.
            t.insert(&composite_batch(&rows(950_000 + (o * 10 + n) as i64 * 100, 10, "late"))).unwrap();
            let got = on_threads(scans);
            assert_eq!(got.iter().map(RecordBatch::num_rows).sum::<usize>(), want_rows, "options {o}, {n} partitions: row count");
            assert_eq!(collect_composite(got.into_iter().map(Ok)), want, "options {o}, {n} partitions");
            t.delete(&composite_keys(&rows(950_000 + (o * 10 + n) as i64 * 100, 10, "").into_iter().map(|(k, _)| k).collect::<Vec<_>>())).unwrap();
            assert_eq!(scan_bytes(), 0, "options {o}, {n} partitions: released");
        }
    }
    // Partition 0 of 0 is taken as 1: the whole table.
    assert_eq!(t.scan_partitions(ScanOptions::default(), 0).unwrap().len(), 1);
    // More partitions than threads any setting may ask for: a typed error, nothing held
    // (`usize::MAX` was a capacity-overflow panic).
    assert_eq!(t.scan_partitions(ScanOptions::default(), gritdb::MAX_THREADS).unwrap().len(), gritdb::MAX_THREADS);
    for n in [gritdb::MAX_THREADS + 1, 1_000_000, usize::MAX] {
        assert!(matches!(t.scan_partitions(ScanOptions::default(), n), Err(gritdb::Error::Config(_))), "{n} partitions");
    }
    assert_eq!(scan_bytes(), 0);
    // Partitions of a dropped table.
    let scans = t.scan_partitions(ScanOptions::default(), 3).unwrap();
    drop(scans);
    engine.drop_table("p").unwrap();
    assert!(matches!(t.scan_partitions(ScanOptions::default(), 2), Err(gritdb::Error::TableNotFound { .. })));
    assert_eq!(scan_bytes(), 0);
    engine.close().unwrap();
}

/// Each partition counts its share: summed over the partitions, row groups read and pruned
/// equal the single scan's; each partition counts the files it opens; and the rows decoded
/// add up to the single scan's.
#[test]
fn partition_metrics_add_up_to_the_single_scans() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(2 << 20);
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("m", composite_schema(), &["k1", "k2"]).unwrap();
    for i in 0..3 {
        t.insert(&composite_batch(&rows(i * 100_000, 60_000, "m"))).unwrap();
        t.flush().unwrap();
    }
    let f = ScanFilter::compare("k1", CompareOp::GtEq, Arc::new(Int64Array::from(vec![130_000])));
    let opts = ScanOptions::default().filter(f);
    let mut single = t.scan(opts.clone()).unwrap();
    let rows_single: usize = single.by_ref().map(|b| b.unwrap().num_rows()).sum();
    let one = single.metrics();
    assert_eq!(rows_single, 30_000 + 60_000);
    assert!(one.row_groups_total >= 3, "{one:?}");
    let mut scans = t.scan_partitions(opts, 2).unwrap();
    let mut rows = 0;
    for s in &mut scans {
        rows += s.by_ref().map(|b| b.unwrap().num_rows()).sum::<usize>();
    }
    let m: Vec<_> = scans.iter().map(gritdb::Scan::metrics).collect();
    assert_eq!(rows, rows_single);
    assert_eq!(m.iter().map(|m| m.row_groups_total).sum::<u64>(), one.row_groups_total);
    assert_eq!(m.iter().map(|m| m.row_groups_pruned).sum::<u64>(), one.row_groups_pruned);
    assert_eq!(m.iter().map(|m| m.rows_decoded).sum::<u64>(), one.rows_decoded);
    assert_eq!(m.iter().map(|m| m.rows_matched).sum::<u64>(), one.rows_matched);
    assert!(m.iter().all(|m| m.files_opened == 3), "{m:?}");
    assert!(m.iter().all(|m| m.rows_decoded > 0), "both partitions decode: {m:?}");
    engine.close().unwrap();
}
