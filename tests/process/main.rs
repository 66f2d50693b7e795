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
    let engine =
        Engine::open(dir.path(), EngineConfig::default().memory_limit(4 << 30).table_flush_bytes(2 << 30).flush_age(std::time::Duration::from_hours(1)))
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
        let cols: Vec<ArrayRef> = (0..64).map(|c| Arc::new(Int64Array::from_iter_values((start..start + n).map(|i| i * 64 + c))) as ArrayRef).collect();
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

/// Ten tables, each one 1 M-row file of ONE row group, scanned at once (a batch pulled from
/// each in turn, the ten current batches held): decoded batches and the ten open readers'
/// page buffers are counted under `scan_buffers`, its peak stays within its documented share
/// (limit / 4) and covers the allocator's growth, which stays far below what decoding the ten
/// row groups whole would take.
#[test]
fn ten_single_row_group_files_scan_within_scan_buffers_share() {
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    const ROWS: i64 = 1_000_000;
    let _g = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    // A flush threshold above 1 M rows, so each table's rows go to one file in one flush.
    let engine =
        Engine::open(dir.path(), EngineConfig::default().memory_limit(1 << 30).table_flush_bytes(120 << 20).flush_age(std::time::Duration::from_hours(1)))
            .unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true)]));
    let mut tables = Vec::new();
    for t in 0..10i64 {
        let table = engine.create_table(&format!("t{t}"), Arc::clone(&schema), &["k"]).unwrap();
        for start in (0..ROWS).step_by(1 << 16) {
            let end = (start + (1 << 16)).min(ROWS);
            let b = RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(Int64Array::from_iter_values(start..end)), Arc::new(Int64Array::from_iter_values((start..end).map(|k| k * 3 + t)))],
            )
            .unwrap();
            table.insert(&b).unwrap();
        }
        table.flush().unwrap();
        assert_eq!(table.stats().unwrap().files, 1);
        tables.push(table);
    }
    let limit = 256usize << 20;
    engine.set_memory_limit(limit).unwrap();
    engine.release_cached_memory();
    engine.memory().reset_peaks();
    let share = limit / 4;
    let before = allocated();
    let mut scans: Vec<gritdb::Scan> = tables.iter().map(|t| t.scan(gritdb::ScanOptions::default()).unwrap()).collect();
    let mut held: Vec<Option<RecordBatch>> = vec![None; 10];
    let (mut rows, mut sums) = (vec![0i64; 10], vec![0i64; 10]);
    let (mut max_growth, mut max_held_counted) = (0usize, 0usize);
    loop {
        let mut any = false;
        for (i, s) in scans.iter_mut().enumerate() {
            held[i] = None; // the caller lets go of its previous batch, then takes the next
            if let Some(b) = s.next() {
                let b = b.unwrap();
                rows[i] += b.num_rows() as i64;
                sums[i] += b.column(1).as_any().downcast_ref::<Int64Array>().unwrap().values().iter().sum::<i64>();
                held[i] = Some(b);
                any = true;
            }
        }
        if !any {
            break;
        }
        max_growth = max_growth.max(allocated().saturating_sub(before));
        if held.iter().all(Option::is_some) {
            max_held_counted = max_held_counted.max(engine.memory().category_bytes(Category::ScanBuffers));
        }
    }
    for (i, s) in scans.iter().enumerate() {
        assert_eq!(rows[i], ROWS);
        assert_eq!(sums[i], (0..ROWS).map(|k| k * 3 + i as i64).sum::<i64>());
        let m = s.metrics();
        assert_eq!((m.files_opened, m.row_groups_total, m.rows_decoded), (1, 1, ROWS as u64), "one file of one row group: {m:?}");
    }
    let peak = engine.memory().category_peak(Category::ScanBuffers);
    // Ten held 8,192-row batches of two Int64 columns: at least 10 x 128 KiB counted.
    let batch_bytes = 8192 * 16;
    let whole = 10 * ROWS as usize * 16;
    eprintln!(
        "ten scans: scan_buffers peak {peak} B (share {share} B, ten held batches counted {max_held_counted} B), allocator growth max {max_growth} B (whole row groups: {whole} B)"
    );
    assert!(max_held_counted >= 10 * batch_bytes, "held batches must be counted: {max_held_counted} B");
    assert!(peak <= share, "scan_buffers peak {peak} B above its share {share} B");
    // Besides its batch, each open reader counts its pages and dictionaries (an estimate from
    // the file's metadata): together they cover what the allocator shows, and are not far
    // above it.
    assert!(max_growth <= peak + (1 << 20), "allocator grew {max_growth} B, {peak} B counted at most");
    assert!(peak <= 2 * max_growth, "counted {peak} B for at most {max_growth} B allocated");
    assert!(max_growth * 4 <= whole, "allocator grew {max_growth} B: row groups decoded whole ({whole} B)?");
    drop(held);
    drop(scans);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0, "every counted batch released");
}

/// `BackgroundPriority::Batch(0)` runs background flushes under `SCHED_BATCH`; the WAL record
/// threads and the caller keep the caller's policy. With `BackgroundPriority::Inherit` (the
/// default) the flush threads keep it too. Only threads started after
/// each engine opened are looked at (this binary runs one test at a time).
#[cfg(target_os = "linux")]
#[test]
fn background_flushes_run_under_sched_batch_unless_inherit() {
    use gritdb::BackgroundPriority;
    let _g = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let caller = gritdb_tests::current_thread_sched().policy;
    assert!(caller != 3 && caller != 5, "run the tests under SCHED_OTHER or a real-time policy (caller policy {caller})");
    let batches: Vec<_> = LineItemArrow::new(LineItemGenerator::new(0.01, 1, 1)).with_batch_size(8192).map(Result::unwrap).collect();
    for (priority, want) in [(BackgroundPriority::Batch(0), 3), (BackgroundPriority::Inherit, caller)] {
        let before: std::collections::HashSet<u32> = gritdb_tests::process_threads().into_iter().map(|t| t.tid).collect();
        let dir = tempfile::tempdir().unwrap();
        let engine =
            Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(1 << 20).background_priority(priority)).unwrap();
        let t = engine.create_table("lineitem", batches[0].schema(), &["l_orderkey", "l_linenumber"]).unwrap();
        for b in &batches {
            t.insert(b).unwrap();
        }
        // Only the background writer writes files before a flush is asked for.
        let deadline = std::time::Instant::now() + std::time::Duration::from_mins(1);
        while t.stats().unwrap().files == 0 {
            assert!(std::time::Instant::now() < deadline, "no background flush within 60 s");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let new: Vec<_> = gritdb_tests::process_threads().into_iter().filter(|t| !before.contains(&t.tid)).collect();
        let writers: Vec<u32> = new.iter().filter(|t| t.name == "gritdb-writer").map(|t| t.policy).collect();
        assert!(writers.contains(&want), "{priority:?}: no writer thread under policy {want}: {new:?}");
        for t in &new {
            if t.name == "gritdb-wal" {
                assert_eq!(t.policy, caller, "{priority:?}: a WAL record thread changed policy: {new:?}");
            }
        }
        assert!(gritdb_tests::current_thread_sched().policy == caller, "the caller's policy changed");
        if priority == BackgroundPriority::Inherit {
            assert!(!writers.contains(&3), "Inherit: a writer thread is under SCHED_BATCH: {new:?}");
        }
        drop(t);
        engine.close().unwrap();
    }
}

/// A nice value outside 0..=19 is refused at open with `Error::Config` (a background flush can
/// only be lowered), before anything is created on disk: no data directory, no lock file.
#[test]
fn background_priority_out_of_range_is_a_config_error() {
    use gritdb::BackgroundPriority;
    for nice in [-1i8, 20, i8::MIN] {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("data");
        let err = Engine::open(&dir, EngineConfig::default().background_priority(BackgroundPriority::Batch(nice))).unwrap_err();
        assert!(matches!(&err, gritdb::Error::Config(m) if m.contains("0..=19")), "Batch({nice}): {err}");
        assert!(!dir.exists(), "Batch({nice}): the data directory was created");
    }
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("data");
    let err = Engine::open(&dir, EngineConfig::default().max_row_bytes(0)).unwrap_err();
    assert!(matches!(&err, gritdb::Error::Config(m) if m.contains("max_row_bytes")), "{err}");
    assert!(!dir.exists(), "max_row_bytes 0: the data directory was created");
}

/// A scan of a flushed TPC-H lineitem file (600,572 rows, 16 columns), its batches dropped as
/// they come: the engine's accounted bytes grow at least as much as the allocator's, within
/// 256 KiB, at every batch: the open reader's page and dictionary buffers are counted (they
/// were 2.3–4.1 MB outside the engine's figures before). The count is an estimate from the
/// file's metadata; it stays within 3× the allocator's largest growth.
#[test]
fn an_open_file_scan_counts_the_readers_page_buffers() {
    let _g = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(512 << 20)).unwrap();
    let batches: Vec<arrow::array::RecordBatch> =
        LineItemArrow::new(LineItemGenerator::new(0.1, 1, 1)).with_batch_size(8192).collect::<Result<_, _>>().unwrap();
    let t = engine.create_table("lineitem", batches[0].schema(), &["l_orderkey", "l_linenumber"]).unwrap();
    for b in &batches {
        t.insert(b).unwrap();
    }
    t.flush().unwrap();
    drop(batches);
    engine.release_cached_memory();
    let accounted = || {
        let r = engine.memory_report();
        r.used - r.category(Category::FreeChunks)
    };
    let (alloc0, acc0) = (allocated(), accounted());
    let mut s = t.scan(gritdb::ScanOptions::default()).unwrap();
    let (mut rows, mut worst_outside, mut max_growth, mut max_counted) = (0usize, i64::MIN, 0i64, 0usize);
    for b in s.by_ref() {
        rows += b.unwrap().num_rows();
        let growth = allocated() as i64 - alloc0 as i64;
        let counted = accounted() as i64 - acc0 as i64;
        worst_outside = worst_outside.max(growth - counted);
        max_growth = max_growth.max(growth);
        max_counted = max_counted.max(engine.memory().category_bytes(Category::ScanBuffers));
    }
    assert_eq!(rows, 600_572);
    eprintln!(
        "open lineitem scan, no batch held: allocator growth max {max_growth} B, scan_buffers max {max_counted} B, growth outside the engine max {worst_outside} B"
    );
    assert!(worst_outside <= 256 << 10, "the reader held {worst_outside} B the engine did not count");
    assert!(max_counted as i64 <= 3 * max_growth.max(1), "counted {max_counted} B for at most {max_growth} B allocated");
    drop(s);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
}

/// Net bytes this thread has allocated (jemalloc's per-thread `allocated` less `deallocated`
/// counters, usable sizes): immune to other threads and to thread caches.
fn thread_net_allocated() -> i64 {
    let a = tikv_jemalloc_ctl::thread::allocatedp::read().unwrap().get();
    let d = tikv_jemalloc_ctl::thread::deallocatedp::read().unwrap().get();
    a as i64 - d as i64
}

/// A caller holding 40 four-row batches of a wide table (2,000 nullable `Int64` columns, all
/// null, and 1,000 nullable `Utf8` columns, beside an `Int64` key): what this thread's
/// allocations grew by while it took them (jemalloc's per-thread counters: the scan decodes
/// on the caller's thread, and thread caches do not blur them) is within 10% (2% measured) of what
/// `scan_buffers` grew by. Each held column keeps its `Arc`'d array, a re-pointed `Arc<Bytes>`
/// for each buffer and the owner of each buffer's allocation: 544 bytes beside an `Int64`
/// column's 40 bytes of buffers, 819 beside a `Utf8` column's 47, which were not counted
/// before (allocated 14.6 and 18.4 times the count). Dropping the batches and the scan
/// brings `scan_buffers` back to exactly its bytes before the scan.
#[test]
fn held_batches_of_a_wide_table_are_counted_as_allocated() {
    use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    let _g = SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for (dt, cols) in [(DataType::Int64, 2000usize), (DataType::Utf8, 1000)] {
        let rows = 400i64;
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(1 << 30)).unwrap();
        let mut fields = vec![Field::new("k", DataType::Int64, false)];
        fields.extend((0..cols).map(|i| Field::new(format!("c{i}"), dt.clone(), true)));
        let schema = Arc::new(Schema::new(fields));
        let t = engine.create_table("w", Arc::clone(&schema), &["k"]).unwrap();
        let mut arrays: Vec<ArrayRef> = vec![Arc::new(Int64Array::from_iter_values(0..rows))];
        for c in 0..cols {
            arrays.push(match dt {
                DataType::Int64 => Arc::new(Int64Array::new_null(rows as usize)),
                _ => Arc::new((0..rows).map(|r| (r % 3 != 0).then(|| format!("v{r}-{c}"))).collect::<StringArray>()),
            });
        }
        t.insert(&RecordBatch::try_new(Arc::clone(&schema), arrays).unwrap()).unwrap();
        t.flush().unwrap();
        engine.release_cached_memory();
        let scan_bytes = || engine.memory().category_bytes(Category::ScanBuffers);
        let baseline = scan_bytes();
        let mut s = t.scan(gritdb::ScanOptions::default().batch_rows(4)).unwrap();
        // The first batch opens the reader (counted under scan_buffers too): measured from there.
        let mut held = vec![s.next().unwrap().unwrap()];
        let (a0, s0) = (thread_net_allocated(), scan_bytes());
        let n = 40;
        for _ in 0..n {
            held.push(s.next().unwrap().unwrap());
        }
        let (a1, s1) = (thread_net_allocated(), scan_bytes());
        let (grown, counted) = (a1 - a0, (s1 - s0) as i64);
        let per_column = |b: i64| b / n / (cols as i64 + 1);
        eprintln!(
            "{dt} x {cols}, {n} held 4-row batches: allocated +{grown} B, scan_buffers +{counted} B; a column {} B allocated, {} B counted",
            per_column(grown),
            per_column(counted)
        );
        assert!(grown * 10 <= counted * 11, "{dt}: allocated {grown} B for {counted} B counted (more than 10% over)");
        assert!(counted * 10 <= grown * 11, "{dt}: counted {counted} B for {grown} B allocated (more than 10% over)");
        assert!(held.iter().all(|b| b.num_rows() == 4 && b.num_columns() == cols + 1));
        drop(held);
        drop(s);
        assert_eq!(scan_bytes(), baseline, "{dt}: dropping the batches and the scan releases every byte counted for them");
    }
}
