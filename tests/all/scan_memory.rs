//! Batches a scan hands out — decoded from Parquet, or copied out of a delta by a filter or a
//! projection — are counted under `scan_buffers` for as long as the caller holds them, and a
//! scan that cannot get that memory returns a typed error.

use arrow::array::{Array, Int64Array, RecordBatch};
use gritdb::memory::Category;
use gritdb::{CompareOp, Engine, EngineConfig, Error, ScanFilter, ScanOptions};
use gritdb_tests::*;
use std::sync::Arc;

fn rows(from: i64, n: i64) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, (k % 3) as i32), (Some(k), Some(format!("value number {k}"))))).collect()
}

/// Bytes the batch's arrays use (slices of their buffers).
fn used(b: &RecordBatch) -> usize {
    b.columns().iter().map(|c| c.to_data().get_slice_memory_size().unwrap()).sum()
}

#[test]
fn decoded_batches_count_while_held() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let t = engine.create_table("d", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 100_000))).unwrap();
    t.flush().unwrap();
    let scan_bytes = || engine.memory().category_bytes(Category::ScanBuffers);
    assert_eq!(scan_bytes(), 0);

    // Every batch of a file scan, held: all counted, at least the bytes they use and less than
    // twice that (the copy-out rule), per table as well as engine-wide.
    let held: Vec<RecordBatch> = t.scan(ScanOptions::default()).unwrap().map(Result::unwrap).collect();
    assert_eq!(held.iter().map(RecordBatch::num_rows).sum::<usize>(), 100_000);
    let in_use: usize = held.iter().map(used).sum();
    let counted = scan_bytes();
    assert!(counted >= in_use && counted < 2 * in_use, "counted {counted} B for {in_use} B in use");
    let table_scan =
        engine.memory_report().tables.iter().find(|r| r.table == "d").unwrap().categories.iter().find(|c| c.category == Category::ScanBuffers).unwrap().bytes;
    assert_eq!(table_scan, counted);
    // Data is intact through the re-pointed buffers.
    assert_eq!(collect_composite(held.clone().into_iter().map(Ok)), rows(0, 100_000).into_iter().collect());
    // Letting go of half of them releases about half.
    let (first, second) = held.split_at(held.len() / 2);
    let second_in_use: usize = second.iter().map(used).sum();
    let first: Vec<RecordBatch> = first.to_vec();
    drop(held);
    let after_half = scan_bytes();
    assert!(after_half < counted && after_half >= first.iter().map(used).sum::<usize>(), "{after_half} of {counted}; second half used {second_in_use}");
    drop(first);
    assert_eq!(scan_bytes(), 0, "dropping the batches releases every counted byte");

    // A column shared by a batch and a slice of it counts once per batch handed out.
    let mut s = t.scan(ScanOptions::default().projection(["k1"]).batch_rows(1000)).unwrap();
    let b = s.next().unwrap().unwrap();
    let one = scan_bytes();
    let k1 = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().clone();
    drop(b);
    assert_eq!(scan_bytes(), one, "an array kept from a batch keeps its bytes counted");
    assert_eq!(k1.value(999), 999);
    drop(k1);
    drop(s);
    assert_eq!(scan_bytes(), 0);

    // Rows copied out of a delta by a filter are counted too.
    t.insert(&composite_batch(&rows(200_000, 5_000))).unwrap();
    let f = ScanFilter::compare("k1", CompareOp::GtEq, Arc::new(Int64Array::from(vec![202_000])));
    let held: Vec<RecordBatch> = t.scan(ScanOptions::default().filter(f)).unwrap().map(Result::unwrap).collect();
    assert_eq!(held.iter().map(RecordBatch::num_rows).sum::<usize>(), 3_000);
    assert!(scan_bytes() >= held.iter().map(used).sum::<usize>());
    drop(held);
    assert_eq!(scan_bytes(), 0);
}

/// Holding scan results until the limit is reached: the next batch is a typed
/// `MemoryLimit` error naming `scan_buffers` (after the bounded wait), and scanning works
/// again once the held batches are dropped.
#[test]
fn held_batches_at_the_limit_are_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(24 << 20).backpressure_timeout(std::time::Duration::from_millis(100));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("h", composite_schema(), &["k1", "k2"]).unwrap();
    for start in (0..100_000).step_by(10_000) {
        t.insert(&composite_batch(&rows(start, 10_000))).unwrap();
    }
    t.flush().unwrap();
    engine.release_cached_memory();
    let mut held = Vec::new();
    let mut error = None;
    'outer: for _ in 0..20 {
        for b in t.scan(ScanOptions::default()).unwrap() {
            match b {
                Ok(b) => held.push(b),
                Err(e) => {
                    error = Some(e);
                    break 'outer;
                }
            }
        }
    }
    let e = error.expect("holding 20 full scans cannot fit in 24 MiB");
    assert!(matches!(e, Error::MemoryLimit { category: Category::ScanBuffers, .. }), "{e:?}");
    assert!(engine.memory().used() <= 24 << 20);
    drop(held);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
    assert_eq!(t.row_count().unwrap(), 100_000);
}

/// An open file reader's own page and dictionary buffers count under `scan_buffers` for as
/// long as the reader is open, with no batch held: more than nothing, and gone when the scan
/// ends or is dropped. A reader that cannot get them is a typed `MemoryLimit` that loses
/// nothing: the next call tries again and the scan then returns every row exactly.
#[test]
fn an_open_reader_counts_its_page_buffers_and_a_refusal_loses_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(16 << 20).backpressure_timeout(std::time::Duration::from_millis(100));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("r", composite_schema(), &["k1", "k2"]).unwrap();
    for start in (0..60_000).step_by(10_000) {
        t.insert(&composite_batch(&rows(start, 10_000))).unwrap();
    }
    t.flush().unwrap();
    engine.release_cached_memory();
    let scan_bytes = || engine.memory().category_bytes(Category::ScanBuffers);
    assert_eq!(scan_bytes(), 0);

    // One batch pulled and dropped: the reader stays open and its buffers stay counted.
    let mut s = t.scan(ScanOptions::default().batch_rows(1000)).unwrap();
    drop(s.next().unwrap().unwrap());
    let open_reader = scan_bytes();
    assert!(open_reader > 0, "an open reader holds pages");
    let rest: usize = s.by_ref().map(|b| b.unwrap().num_rows()).sum();
    assert_eq!(rest + 1000, 60_000);
    assert_eq!(scan_bytes(), 0, "an exhausted scan holds nothing");
    drop(s);

    // A second scan whose reader cannot get its buffers while the first one's batches are held.
    let mut filler = Vec::new();
    let mut s = t.scan(ScanOptions::default().batch_rows(1000)).unwrap();
    // Memory filled with held batches of other scans, up to the limit; the scan that could
    // not go on is kept open too (it holds no reader buffers once refused).
    let mut stuck = None;
    'fill: for _ in 0..1000 {
        let mut other = t.scan(ScanOptions::default()).unwrap();
        loop {
            match other.next() {
                Some(Ok(b)) => filler.push(b),
                Some(Err(_)) => {
                    stuck = Some(other);
                    break 'fill;
                }
                None => break,
            }
        }
    }
    assert!(stuck.is_some(), "memory never filled");
    // The refused scan released its own reader's buffers; the rest of the memory is held
    // here, leaving less than a reader needs.
    let mut hold = gritdb_memctl::Reservation::new(engine.memory(), Category::Metadata, None);
    hold.try_grow((16 << 20) - engine.memory().used() - open_reader / 2).unwrap();
    let refused = match s.next() {
        Some(Err(e)) => e,
        other => panic!("the reader got {open_reader} B beside {} B in use: {:?}", engine.memory().used(), other.map(|b| b.map(|b| b.num_rows()))),
    };
    assert!(matches!(refused, Error::MemoryLimit { category: Category::ScanBuffers, .. }), "{refused:?}");
    drop(filler);
    drop(stuck);
    drop(hold);
    let after: usize = s.map(|b| b.unwrap().num_rows()).sum();
    assert_eq!(after, 60_000, "the refused reader was kept: no file lost");
    assert_eq!(scan_bytes(), 0);
}

/// An export whose delta copy would pass the write soft limit flushes the table first and
/// reads files only (its snapshot copies no delta into the room the flush needs); without
/// pressure it copies the deltas and flushes nothing. Both files are exact. The background
/// writer (one thread) is held on another table's stalled data file, so the exported table's
/// sealed deltas stay in memory until the export flushes them on the caller's thread.
#[test]
fn export_under_memory_pressure_flushes_the_deltas_first() {
    let dir = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let fs = gritdb::vfs::FaultFs::new();
    // 8 MiB: flush threshold 1 MiB (limit / 8), flush headroom 2 MiB, so the write soft limit
    // is 6 MiB.
    let config = EngineConfig::default()
        .memory_limit(8 << 20)
        .writer_threads(1)
        .flush_age(std::time::Duration::from_hours(1))
        .backpressure_timeout(std::time::Duration::from_secs(20))
        .vfs(Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), config).unwrap();
    let stalled = engine.create_table("a", composite_schema(), &["k1", "k2"]).unwrap();
    let e = engine.create_table("e", composite_schema(), &["k1", "k2"]).unwrap();
    let want_small = rows(0, 2_000);
    e.insert(&composite_batch(&want_small)).unwrap();
    // Little in memory: the export copies the delta, nothing is flushed.
    let small = out.path().join("small.parquet");
    assert_eq!(e.export_parquet(&small).unwrap().rows, 2_000);
    assert_eq!(e.stats().unwrap().files, 0, "an export without pressure flushed");
    assert_eq!(collect_composite(read_parquet_batches(&small).into_iter().map(Ok)), want_small.into_iter().collect());
    // Table `a` (directory tables/t1) seals a delta; its background flush stalls on its data
    // file and holds the writer's only thread.
    fs.stall_paths("t1/f");
    let mut stalled_rows = 0i64;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !fs.is_stalled() {
        stalled.insert(&composite_batch(&rows(stalled_rows, 2_000))).unwrap();
        stalled_rows += 2_000;
        assert!(std::time::Instant::now() < deadline, "table a's flush never reached its data file");
    }
    // Table `e` fills until its deltas hold 2 MiB and their copy would pass the soft limit
    // (pressure as the engine reckons it: used bytes less cached free chunks).
    let pressure = || engine.memory().used() - engine.memory().category_bytes(Category::FreeChunks);
    let deltas = || {
        let s = e.stats().unwrap();
        s.active_delta_bytes + s.sealed_delta_bytes
    };
    let mut n = 2_000i64;
    while deltas() < 2 << 20 || pressure() + deltas() <= 6 << 20 {
        e.insert(&composite_batch(&rows(n, 2_000))).unwrap();
        n += 2_000;
    }
    assert!(e.stats().unwrap().sealed_deltas > 0, "e's sealed deltas are queued behind a's flush");
    let big = out.path().join("big.parquet");
    let stats = e.export_parquet(&big).unwrap();
    assert_eq!(stats.rows, n as u64);
    let s = e.stats().unwrap();
    assert!(s.files >= 1 && s.active_delta_bytes == 0 && s.sealed_deltas == 0, "the export did not flush first: {s:?}");
    assert_eq!(collect_composite(read_parquet_batches(&big).into_iter().map(Ok)), rows(0, n).into_iter().collect());
    fs.heal();
    assert_eq!(stalled.row_count().unwrap(), stalled_rows as u64);
    assert_eq!(e.row_count().unwrap(), n as u64);
}

fn read_parquet_batches(path: &std::path::Path) -> Vec<RecordBatch> {
    let file = std::fs::File::open(path).unwrap();
    gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap().map(Result::unwrap).collect()
}

/// Rows of `width`-byte values that do not compress (letters from `mix`), keys `from..to`.
pub(crate) fn incompressible(from: i64, to: i64, width: usize) -> RecordBatch {
    let schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("k", arrow::datatypes::DataType::Int64, false),
        arrow::datatypes::Field::new("s", arrow::datatypes::DataType::Utf8, false),
    ]));
    let text: Vec<String> = (from..to).map(|k| (0..width).map(|i| char::from(b'a' + (mix(k as u64 * 7919 + i as u64) % 26) as u8)).collect()).collect();
    RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(from..to)), Arc::new(arrow::array::StringArray::from(text))]).unwrap()
}

/// Table `wide` with `wide_rows` rows of 10,000 incompressible bytes (keys `0..wide_rows`),
/// flushed, and seven `filler` tables each holding an unflushed delta of about 700 KB
/// (50-row inserts of 500-byte values); each filler with its row count.
pub(crate) fn wide_and_fillers(engine: &Engine, wide_rows: i64) -> (gritdb::Table, Vec<(gritdb::Table, i64)>) {
    let wide = engine.create_table("wide", incompressible(0, 1, 8).schema(), &["k"]).unwrap();
    for at in (0..wide_rows).step_by(50) {
        wide.insert(&incompressible(at, (at + 50).min(wide_rows), 10_000)).unwrap();
    }
    wide.flush().unwrap();
    let mut fillers = Vec::new();
    for n in 0..7 {
        let t = engine.create_table(&format!("filler{n}"), incompressible(0, 1, 8).schema(), &["k"]).unwrap();
        let mut k = 0;
        while t.stats().unwrap().active_delta_bytes < 700_000 {
            t.insert(&incompressible(k, k + 50, 500)).unwrap();
            k += 50;
        }
        fillers.push((t, k));
    }
    (wide, fillers)
}

/// A scan whose batches (all kept by the caller) do not fit beside other tables' deltas, each
/// below its flush threshold (1 MiB at 8 MiB) and together below the write soft limit, so no
/// write pushes them out. Expected: the scan seals them for the writer (it does, since
/// `6a16383`) and proceeds, exact.
#[test]
fn a_scan_short_of_memory_flushes_other_tables_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let limit = 8usize << 20;
    let config =
        EngineConfig::default().memory_limit(limit).flush_age(std::time::Duration::from_secs(3600)).backpressure_timeout(std::time::Duration::from_secs(2));
    let engine = Engine::open(dir.path(), config).unwrap();
    let (wide, fillers) = wide_and_fillers(&engine, 300);
    for (t, _) in &fillers {
        assert_eq!(t.stats().unwrap().files, 0, "a filler's delta is not flushed yet");
    }
    let used = engine.memory().used();
    assert!(used > limit / 2, "{used} bytes in use before the scan");
    // The caller keeps every batch (3 MB of values, counted while held): more than is free
    // beside the deltas.
    let held: Vec<RecordBatch> = wide.scan(ScanOptions::default()).unwrap().map(|b| b.unwrap()).collect();
    assert!(engine.memory().used() <= limit);
    let rows: usize = held.iter().map(RecordBatch::num_rows).sum();
    let bytes: usize = held.iter().map(|b| arrow::array::AsArray::as_string::<i32>(b.column(1).as_ref()).values().len()).sum();
    assert_eq!((rows, bytes), (300, 300 * 10_000));
    assert!(fillers.iter().any(|(t, _)| t.stats().unwrap().files >= 1), "a filler's delta was flushed for the scan");
    for (t, k) in &fillers {
        assert_eq!(t.row_count().unwrap(), *k as u64);
    }
}

/// Keys of the rows in `batches` (column `k1`, first column of the composite schema or of a
/// projection on it), with how many times each came back.
fn key_counts(batches: &[RecordBatch]) -> std::collections::BTreeMap<i64, usize> {
    let mut out = std::collections::BTreeMap::new();
    for b in batches {
        let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        for v in k.values() {
            *out.entry(*v).or_insert(0) += 1;
        }
    }
    out
}

/// `counts` holds every key of `want` exactly once and nothing else; otherwise a short
/// description of the first keys missing, repeated or unexpected.
fn exactly_once(counts: &std::collections::BTreeMap<i64, usize>, want: &[i64]) -> Result<(), String> {
    let missing: Vec<i64> = want.iter().copied().filter(|k| !counts.contains_key(k)).collect();
    let twice: Vec<i64> = counts.iter().filter(|(_, n)| **n > 1).map(|(k, _)| *k).collect();
    let want_set: std::collections::BTreeSet<i64> = want.iter().copied().collect();
    let extra: Vec<i64> = counts.keys().copied().filter(|k| !want_set.contains(k)).collect();
    if missing.is_empty() && twice.is_empty() && extra.is_empty() {
        return Ok(());
    }
    let head = |v: &[i64]| format!("{} (first {:?})", v.len(), &v[..v.len().min(5)]);
    Err(format!("missing {}, returned twice {}, unexpected {}", head(&missing), head(&twice), head(&extra)))
}

/// A batch refused its memory is returned by the next call, not skipped; and while refused
/// the scan holds nothing: the open file reader's buffers are released (the reader is
/// reopened at the same file row on the retry), so a caller that keeps a refused scan does
/// not starve writers. For a file scan with a deletion vector, with and without a filter
/// (the reopened reader applies both again), and for rows copied out of a delta by a
/// projection. Every key comes back exactly once, and `scan_buffers` ends at 0. (Before, the
/// retry went on after the refused batch, and the reader kept its reservation.)
#[test]
fn a_refused_batch_is_returned_by_the_retry_and_the_refused_scan_holds_nothing() {
    use gritdb_memctl::Reservation;
    const LIMIT: usize = 16 << 20;
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(LIMIT).backpressure_timeout(std::time::Duration::from_millis(100));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("r", composite_schema(), &["k1", "k2"]).unwrap();
    for start in (0..60_000).step_by(10_000) {
        t.insert(&composite_batch(&rows(start, 10_000))).unwrap();
    }
    t.flush().unwrap();
    // A deletion vector on the file: every 7th key.
    let gone: Vec<(i64, i32)> = (0..60_000).step_by(7).map(|k| (k, (k % 3) as i32)).collect();
    assert_eq!(t.delete(&composite_keys(&gone)).unwrap(), gone.len());
    t.flush().unwrap();
    let files = t.stats().unwrap().files as u64;
    assert!(files >= 1);
    engine.release_cached_memory();
    let ctl = engine.memory();
    let scan_bytes = || ctl.category_bytes(Category::ScanBuffers);
    let kept = |k: &i64| k % 7 != 0;

    let from = ScanFilter::compare("k1", CompareOp::GtEq, Arc::new(Int64Array::from(vec![25_000])));
    let cases: Vec<(&str, ScanOptions, Vec<i64>)> = vec![
        ("file", ScanOptions::default().batch_rows(1000), (0..60_000).filter(kept).collect()),
        ("file, filtered", ScanOptions::default().batch_rows(1000).filter(from), (25_000..60_000).filter(kept).collect()),
    ];
    for (name, options, want) in cases {
        let mut s = t.scan(options).unwrap();
        let first = s.next().unwrap().unwrap();
        assert!(scan_bytes() > 0, "{name}: the reader and the first batch are counted");
        let mut counts = key_counts(&[first]);
        // Memory filled to 1 KiB under the limit before each attempt (the first refusal
        // releases the reader's buffers, which a reopened reader of fewer columns at a time
        // would fit in): no batch of 1,000 rows fits.
        let mut hold = Reservation::new(ctl, Category::Metadata, None);
        for attempt in 0..2 {
            hold.try_grow(LIMIT - ctl.used() - 1024).unwrap();
            match s.next() {
                Some(Err(Error::MemoryLimit { category: Category::ScanBuffers, .. })) => {}
                other => panic!("{name}, attempt {attempt}: {:?}", other.map(|b| b.map(|b| b.num_rows()))),
            }
            assert_eq!(scan_bytes(), 0, "{name}, attempt {attempt}: a refused scan holds no reader buffers");
        }
        drop(hold);
        for b in s.by_ref() {
            for (k, n) in key_counts(&[b.unwrap()]) {
                *counts.entry(k).or_insert(0) += n;
            }
        }
        exactly_once(&counts, &want).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(s.metrics().files_opened, files, "{name}: the reopened file counts once");
        drop(s);
        assert_eq!(scan_bytes(), 0, "{name}: after the scan");
    }

    // Rows copied out of a delta by a projection are counted when the scan is created (see
    // `delta_copies_waiting_in_a_scan_are_counted`): without the memory, the scan is refused
    // and holds nothing; with it, no batch is refused later.
    t.insert(&composite_batch(&rows(100_000, 5_000))).unwrap();
    let options = ScanOptions::default().projection(["k1"]).batch_rows(1000);
    let mut hold = Reservation::new(ctl, Category::Metadata, None);
    hold.try_grow(LIMIT - ctl.used() - 1024).unwrap();
    match t.scan(options.clone()) {
        Err(Error::MemoryLimit { category: Category::ScanBuffers, .. }) => {}
        other => panic!("delta copy: {:?}", other.map(|_| "a scan")),
    }
    assert_eq!(scan_bytes(), 0, "a refused scan holds nothing");
    drop(hold);
    let got: Vec<RecordBatch> = t.scan(options).unwrap().map(Result::unwrap).collect();
    let want: Vec<i64> = (0..60_000).filter(kept).chain(100_000..105_000).collect();
    exactly_once(&key_counts(&got), &want).unwrap_or_else(|e| panic!("delta copy: {e}"));
    drop(got);
    assert_eq!(scan_bytes(), 0);
    engine.close().unwrap();
}

/// Rows a projection or a filter copies out of the in-memory deltas when the scan is created
/// are counted under `scan_buffers` from that moment, not only once handed out: a scan
/// created and not yet read holds at least the bytes of every batch it will return, and
/// reading them all without keeping any ends at 0. (Before, the copies waited in the scan's
/// queue on the heap, uncounted: 200,000 rows of a projected string column were 0 bytes of
/// `scan_buffers` until `next`.)
#[test]
fn delta_copies_waiting_in_a_scan_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    // Deltas stay in memory for the whole test: no flush by size or age.
    let config = EngineConfig::default().memory_limit(256 << 20).table_flush_bytes(1 << 30).flush_age(std::time::Duration::from_secs(3600));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("q", composite_schema(), &["k1", "k2"]).unwrap();
    for start in (0..200_000).step_by(20_000) {
        t.insert(&composite_batch(&rows(start, 20_000))).unwrap();
    }
    assert_eq!(t.stats().unwrap().files, 0, "all rows in deltas");
    let scan_bytes = || engine.memory().category_bytes(Category::ScanBuffers);
    let odd = ScanFilter::compare("k2", CompareOp::Eq, Arc::new(arrow::array::Int32Array::from(vec![1])));
    let cases = [
        ("projection", ScanOptions::default().projection(["s"]), 200_000),
        ("filter", ScanOptions::default().filter(odd.clone()), 66_667),
        ("both", ScanOptions::default().projection(["k1", "s"]).filter(odd), 66_667),
    ];
    for (name, options, want) in cases {
        assert_eq!(scan_bytes(), 0);
        let s = t.scan(options.clone()).unwrap();
        let queued = scan_bytes();
        let held: Vec<RecordBatch> = s.map(Result::unwrap).collect();
        assert_eq!(held.iter().map(RecordBatch::num_rows).sum::<usize>(), want, "{name}");
        let in_use: usize = held.iter().map(used).sum();
        assert!(queued >= in_use, "{name}: {queued} B counted while queued, {in_use} B returned");
        assert!(scan_bytes() >= in_use, "{name}: the returned batches stay counted");
        drop(held);
        assert_eq!(scan_bytes(), 0, "{name}: every byte released");
        // Read without keeping anything: the queue's bytes go as its batches are handed out.
        let mut s = t.scan(options).unwrap();
        let before = scan_bytes();
        drop(s.next().unwrap().unwrap());
        assert!(scan_bytes() < before, "{name}: a batch handed out and dropped leaves the count: {before} -> {}", scan_bytes());
        drop(s);
        assert_eq!(scan_bytes(), 0, "{name}: a dropped scan releases its queue");
    }
    assert_eq!(t.stats().unwrap().files, 0, "the rows were read from deltas throughout");
    engine.close().unwrap();
}

/// A scan refused memory while it queues the rows of a staged file (a flush's file not yet
/// written: its Parquet write stalled here) keeps none of them and puts the file back: the
/// retry returns all 8,000 rows, once each, and the refused scan holds no `scan_buffers`.
/// (Found by a fresh-clone trial: the retry returned 4,000 of 8,000 rows, and the refused scan
/// held 1,016,080 bytes.)
#[test]
fn a_scan_refused_on_a_staged_file_returns_all_of_it_on_the_retry() {
    use gritdb_memctl::Reservation;
    const LIMIT: usize = 8 << 20;
    let dir = tempfile::tempdir().unwrap();
    let fs = gritdb::vfs::FaultFs::new();
    let config = EngineConfig::default().memory_limit(LIMIT).backpressure_timeout(std::time::Duration::from_millis(100)).vfs(Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("p", composite_schema(), &["k1", "k2"]).unwrap();
    fs.stall_paths(".parquet");
    t.insert(&composite_batch(&rows(0, 8_000))).unwrap();
    let flusher = {
        let t = engine.table("p").unwrap();
        std::thread::spawn(move || t.flush())
    };
    while !fs.is_stalled() {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(t.stats().unwrap().active_delta_bytes, 0, "the rows are in the staged file");
    let ctl = engine.memory();
    let scan_bytes = || ctl.category_bytes(Category::ScanBuffers);
    // A projection copies each staged batch's column out: every piece is counted.
    let mut s = t.scan(ScanOptions::default().projection(["k1"]).batch_rows(200)).unwrap();
    let mut hold = Reservation::new(ctl, Category::Metadata, None);
    let peak = ctl.category_peak(Category::ScanBuffers);
    // Room for about half of the 40 copied pieces (1,600 bytes of `k1` each): the refusal
    // comes halfway through the file.
    engine.release_cached_memory();
    hold.try_grow(LIMIT - ctl.used() - 30_000).unwrap();
    for attempt in 0..2 {
        match s.next() {
            Some(Err(Error::MemoryLimit { category: Category::ScanBuffers, .. })) => {}
            other => panic!("attempt {attempt}: {:?}", other.map(|b| b.map(|b| b.num_rows()))),
        }
        assert_eq!(scan_bytes(), 0, "attempt {attempt}: the refused scan holds nothing");
    }
    assert!(ctl.category_peak(Category::ScanBuffers) > peak + 10_000, "pieces were queued before the refusal");
    drop(hold);
    let got: Vec<RecordBatch> = s.map(Result::unwrap).collect();
    exactly_once(&key_counts(&got), &(0..8_000).collect::<Vec<_>>()).unwrap();
    drop(got);
    assert_eq!(scan_bytes(), 0);
    fs.heal();
    flusher.join().unwrap().unwrap();
    assert_eq!(t.row_count().unwrap(), 8_000);
    engine.close().unwrap();
}

/// A data file that cannot be opened (moved away) ends the scan with `MissingFile` naming
/// it and its table: the calls after it return nothing, even once the file is back, so no rows of other
/// files come after the error as if the scan were whole, and a caller draining the errors is
/// not looped forever; a new scan then returns every row. (Before, the failed file was
/// skipped and the scan went on with the next one.)
#[test]
fn a_file_that_failed_to_open_ends_the_scan_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("f", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 5_000))).unwrap();
    t.flush().unwrap();
    t.insert(&composite_batch(&rows(10_000, 5_000))).unwrap();
    t.flush().unwrap();
    assert_eq!(t.stats().unwrap().files, 2);
    let tables = dir.path().join("tables");
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(&tables)
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    let mut s = t.scan(ScanOptions::default().batch_rows(1_000)).unwrap();
    let aside: Vec<std::path::PathBuf> = files.iter().map(|p| p.with_extension("aside")).collect();
    for (p, a) in files.iter().zip(&aside) {
        std::fs::rename(p, a).unwrap();
    }
    match s.next() {
        Some(Err(e)) => {
            assert!(matches!(&e, gritdb::Error::Storage(gritdb::StorageError::MissingFile { path, table }) if files.contains(path) && table == "f"), "{e:?}");
        }
        other => panic!("{:?}", other.map(|b| b.map(|b| b.num_rows()))),
    }
    assert!(s.next().is_none(), "the scan ended with its error");
    for (p, a) in files.iter().zip(&aside) {
        std::fs::rename(a, p).unwrap();
    }
    assert!(s.next().is_none(), "still ended once the file is back");
    drop(s);
    let got: Vec<RecordBatch> = t.scan(ScanOptions::default().batch_rows(1_000)).unwrap().map(Result::unwrap).collect();
    exactly_once(&key_counts(&got), &(0..5_000).chain(10_000..15_000).collect::<Vec<_>>()).unwrap();
    drop(got);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
    engine.close().unwrap();
}

/// A data file's footer is reserved before it is parsed (its encoded length, from the file's
/// last 8 bytes, times `FOOTER_MEMORY_FACTOR`): with less than that free the scan is refused
/// having parsed nothing (no file counted as opened), holds nothing, and returns every row once
/// the memory is there. Before, the footer was parsed uncounted and only the open reader
/// was counted.
#[test]
fn a_files_footer_is_reserved_before_it_is_parsed() {
    use arrow::array::{ArrayRef, AsArray};
    use arrow::datatypes::{DataType, Field, Int64Type, Schema};
    use gritdb_memctl::Reservation;
    use std::os::unix::fs::FileExt;
    const LIMIT: usize = 256 << 20;
    const COLS: usize = 150;
    const ROWS: i64 = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(LIMIT).flush_batch_bytes(256 << 10).backpressure_timeout(std::time::Duration::from_millis(100));
    let engine = Engine::open(dir.path(), config).unwrap();
    let schema = Arc::new(Schema::new((0..=COLS).map(|c| Field::new(format!("c{c}"), DataType::Int64, false)).collect::<Vec<_>>()));
    let cols: Vec<ArrayRef> = (0..=COLS).map(|c| Arc::new(Int64Array::from_iter_values((0..ROWS).map(|k| k * (c as i64 + 1)))) as ArrayRef).collect();
    let t = engine.create_table("wide", Arc::clone(&schema), &["c0"]).unwrap();
    t.insert(&RecordBatch::try_new(schema, cols).unwrap()).unwrap();
    t.flush().unwrap();
    assert_eq!(t.stats().unwrap().files, 1);
    let mut stack = vec![dir.path().to_path_buf()];
    let mut footer = 0usize;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                let f = std::fs::File::open(&p).unwrap();
                let mut tail = [0u8; 4];
                f.read_exact_at(&mut tail, f.metadata().unwrap().len() - 8).unwrap();
                footer = u32::from_le_bytes(tail) as usize;
            }
        }
    }
    let estimate = footer * gritdb::FOOTER_MEMORY_FACTOR;
    assert!(footer > 100_000, "a footer of many row groups and columns: {footer} B");
    engine.release_cached_memory();
    let ctl = engine.memory();
    let scan_bytes = || ctl.category_bytes(Category::ScanBuffers);
    let mut s = t.scan(ScanOptions::default().projection(["c0", "c7"])).unwrap();
    // One byte short of the footer's estimate free.
    let mut hold = Reservation::new(ctl, Category::Metadata, None);
    hold.try_grow(LIMIT - ctl.used() - estimate + 1).unwrap();
    for attempt in 0..2 {
        match s.next() {
            Some(Err(Error::MemoryLimit { category: Category::ScanBuffers, requested, .. })) => assert_eq!(requested, estimate, "attempt {attempt}"),
            other => panic!("attempt {attempt}: {:?}", other.map(|b| b.map(|b| b.num_rows()))),
        }
        assert_eq!(scan_bytes(), 0, "attempt {attempt}: a refused open holds nothing");
        assert_eq!(s.metrics().files_opened, 0, "attempt {attempt}: the footer was not parsed");
    }
    drop(hold);
    let (mut rows, mut sum) = (0usize, 0i64);
    for b in s.by_ref() {
        let b = b.unwrap();
        rows += b.num_rows();
        sum += b.column(1).as_primitive::<Int64Type>().values().iter().sum::<i64>();
    }
    assert_eq!((rows, sum), (ROWS as usize, (0..ROWS).map(|k| k * 8).sum::<i64>()));
    assert_eq!(s.metrics().files_opened, 1);
    drop(s);
    assert_eq!(scan_bytes(), 0);
}

/// A batch the scan can never hold — its file reader's own buffers (pages, the decompressed
/// page) and the decoded batch together above the limit — is refused at once, not after the
/// whole `backpressure_timeout`: nothing another scan, write or flush releases can make room
/// for memory this scan must hold at the same time. Before, a scan of 2 MB values at 5 or
/// 6 MiB waited out its timeout for each refusal (6 s each, as a fresh-clone trial of
/// 2026-12-06 saw at 8 MiB before data pages were bounded). The refusal loses nothing: with
/// the limit raised the same scan returns every row.
#[test]
fn a_batch_bigger_than_the_limit_beside_its_own_reader_is_refused_at_once() {
    use arrow::array::StringArray;
    use arrow::datatypes::{DataType, Field, Schema};
    let dir = tempfile::tempdir().unwrap();
    let timeout = std::time::Duration::from_secs(60);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20).backpressure_timeout(timeout)).unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("c", DataType::Utf8, true)]));
    let t = engine.create_table("wide", Arc::clone(&schema), &["k"]).unwrap();
    // Eight rows of 2,000,000 bytes each, of letters that do not compress.
    let value = |k: i64| random_text(2_000_000, (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15), b'!', 90);
    let ks: Vec<i64> = (0..8).collect();
    let batch = RecordBatch::try_new(
        Arc::clone(&schema),
        vec![Arc::new(Int64Array::from(ks.clone())), Arc::new(StringArray::from_iter(ks.iter().map(|&k| Some(value(k)))))],
    )
    .unwrap();
    t.insert(&batch).unwrap();
    t.flush().unwrap();
    // At 6 MiB the reader's pages (about 6.0 MB for a 2 MB value: the page, read and
    // decompressed) fit but a decoded batch beside them does not; at 5 MiB the pages alone
    // do not.
    let mut scans = Vec::new();
    for limit in [6usize << 20, 5 << 20] {
        engine.set_memory_limit(limit).unwrap();
        let mut scan = t.scan(ScanOptions::default()).unwrap();
        let started = std::time::Instant::now();
        let e = scan.next().expect("a refusal, not the end").map(|b| b.num_rows()).expect_err("2 MB values do not decode here");
        let waited = started.elapsed();
        assert!(matches!(e, Error::MemoryLimit { .. }), "{e:?}");
        assert!(waited < timeout / 2, "at {limit} B: refused after {waited:?} of a {timeout:?} timeout");
        assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0, "a refused scan holds nothing");
        scans.push(scan);
    }

    // Nothing lost: at 64 MiB the same scan goes on and returns every row, each value whole.
    engine.set_memory_limit(64 << 20).unwrap();
    for scan in scans {
        let mut seen = Vec::new();
        for b in scan {
            let b = b.unwrap();
            let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
            let c = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
            for i in 0..b.num_rows() {
                assert_eq!(c.value(i), value(k.value(i)), "row {}", k.value(i));
                seen.push(k.value(i));
            }
        }
        assert_eq!(seen, ks);
    }
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
}

/// A 2 MiB engine over a [`gritdb::vfs::FaultFs`] (one writer thread, no flush by age, a
/// `timeout` for backpressure) with table `t` (`k Int64` key, `v Utf8`), for the scan-beside-
/// a-flush tests below: rows of `len(k)` random letters, checked when read back.
struct FlushBeside {
    _dir: tempfile::TempDir,
    engine: Engine,
    fs: gritdb::vfs::FaultFs,
    t: gritdb::Table,
    len: fn(i64) -> usize,
}

impl FlushBeside {
    const LIMIT: usize = 2 << 20;

    fn new(timeout: std::time::Duration, len: fn(i64) -> usize) -> Self {
        use arrow::datatypes::{DataType, Field, Schema};
        let dir = tempfile::tempdir().unwrap();
        let fs = gritdb::vfs::FaultFs::new();
        let config = EngineConfig::default()
            .memory_limit(Self::LIMIT)
            .writer_threads(1)
            .flush_age(std::time::Duration::from_secs(3600))
            .backpressure_timeout(timeout)
            .vfs(Arc::new(fs.clone()));
        let engine = Engine::open(dir.path(), config).unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Utf8, true)]));
        let t = engine.create_table("t", schema, &["k"]).unwrap();
        Self { _dir: dir, engine, fs, t, len }
    }

    /// A value 2,000 bytes under the row bound beside the 8-byte key.
    fn near_the_bound() -> usize {
        gritdb::largest_readable_value(Self::LIMIT) - 8 - 2_000
    }

    fn value(&self, k: i64) -> String {
        random_text((self.len)(k), k as u64, b'a', 26)
    }

    fn insert(&self, k: i64) {
        let b =
            RecordBatch::try_new(self.t.schema(), vec![Arc::new(Int64Array::from(vec![k])), Arc::new(arrow::array::StringArray::from(vec![self.value(k)]))])
                .unwrap();
        self.t.insert(&b).unwrap();
    }

    fn settle(&self) {
        while self.engine.flushes_in_flight() > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// (files, rows in files) once flushes settle.
    fn files(&self) -> (usize, u64) {
        self.settle();
        let s = self.t.stats().unwrap();
        (s.files, s.file_rows)
    }

    /// The keys of `b`, each row's value checked.
    fn keys(&self, b: &RecordBatch) -> Vec<i64> {
        let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let v = b.column(1).as_any().downcast_ref::<arrow::array::StringArray>().unwrap();
        (0..b.num_rows())
            .map(|i| {
                assert_eq!(v.value(i), self.value(k.value(i)), "key {}", k.value(i));
                k.value(i)
            })
            .collect()
    }
}

/// A scan whose snapshot holds a staged file (a flush's rows still in memory) reads those
/// rows before it opens a committed file. Behind the committed files, at 2 MiB, the scan held
/// the staged row's 395 KiB (`batch_blocks`, kept by the scan after the flush committed and let
/// go) while its reader of a committed row at the bound (1.6 MiB) waited for 395 KiB more,
/// memory only the scan itself could give back: refused with `MemoryLimit` after the whole
/// `backpressure_timeout`, 11 scans of 12 beside a flush of the same rows (helper-45's F2).
#[test]
fn a_scan_beside_a_flush_reads_its_staged_rows_before_opening_a_file() {
    let f = FlushBeside::new(std::time::Duration::from_secs(3), |_| FlushBeside::near_the_bound());
    f.insert(0);
    f.t.flush().unwrap();
    assert_eq!(f.files(), (1, 1));
    // Row 1's flush (the one called here, or one the insert's pressure queued) stages its
    // file and hangs writing it.
    f.fs.stall_paths(".parquet");
    f.insert(1);
    let flushing = {
        let t = f.t.clone();
        std::thread::spawn(move || t.flush())
    };
    while !f.fs.is_stalled() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(f.t.stats().unwrap().files, 2, "one committed file and one staged");
    let scan = f.t.scan(ScanOptions::default()).unwrap();
    // The flush commits and lets go of its batches; the scan's snapshot still holds them.
    f.fs.heal();
    flushing.join().unwrap().unwrap();
    assert_eq!(f.files(), (2, 2));
    let mut keys = Vec::new();
    for b in scan {
        let b = b.unwrap_or_else(|e| panic!("keys read before the refusal {keys:?}: {e}"));
        keys.extend(f.keys(&b));
    }
    // The staged row first.
    assert_eq!(keys, [1, 0]);
    assert_eq!(f.engine.memory().category_bytes(Category::ScanBuffers), 0);
    assert_eq!(f.engine.memory().category_bytes(Category::BatchBlocks), 0);
}

/// A scan that waits for memory for a batch it decoded lets go of its reader while it waits:
/// the flush it waits for may need exactly those buffers. At 2 MiB, a flush of a 300 KB row
/// failed (ENOSPC) and kept its converted batches for the retry; the scan's reader of a row
/// near the bound (1.6 MiB) decoded it and waited for 395 KiB with the reader open, the
/// flush's retry (the disk healed) was refused its write buffers beside that reader, and the
/// scan was refused after its whole `backpressure_timeout` (helper-45's F2: 4 of 12 scans
/// beside a flush of the same rows, after the staged rows were read first).
#[test]
fn a_scan_waiting_for_memory_lets_go_of_its_reader_so_a_flush_can_finish() {
    // Row 0 near the row bound; row 1 of 300 KB.
    let f = FlushBeside::new(std::time::Duration::from_secs(5), |k| if k == 0 { FlushBeside::near_the_bound() } else { 300_000 });
    f.insert(0);
    f.t.flush().unwrap();
    assert_eq!(f.files(), (1, 1));
    // Row 1's flush fails and keeps its batches (the row's memory) for the retry.
    f.fs.fail_paths(".parquet", 28);
    f.insert(1);
    assert!(matches!(f.t.flush(), Err(Error::Storage(_))));
    f.settle();
    assert!(f.engine.memory().category_bytes(Category::BatchBlocks) >= 300_000);
    let mut scan = f.t.scan(ScanOptions::default().batch_rows(1)).unwrap();
    // Row 1 first (the rows in memory), then row 0 from its file, while the disk heals.
    let mut keys = f.keys(&scan.next().unwrap().unwrap());
    let healer = {
        let fs = f.fs.clone();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            fs.heal();
        })
    };
    for b in scan {
        keys.extend(f.keys(&b.unwrap()));
    }
    healer.join().unwrap();
    assert_eq!(keys, [1, 0]);
    // The retried flush committed row 1.
    assert_eq!(f.files(), (2, 2));
    assert_eq!(f.engine.memory().category_bytes(Category::ScanBuffers), 0);
    assert_eq!(f.engine.memory().category_bytes(Category::BatchBlocks), 0);
}

/// A scan counts the free chunks the pool caches as free when it waits for a flush to leave
/// room: a reservation takes them back. At 2 MiB (and 1 and 4), two committed rows near the bound
/// and a 5 KB row in memory: the scan's first decoded batch left no room to flush that row,
/// so it sealed the delta and waited; the flush was done in milliseconds, but its row blocks
/// went back to the pool as free chunks, which the wait counted as used, so every such scan
/// waited out its whole `backpressure_timeout` (30 s by default) before it went on (helper-47's
/// F1). Now it goes on once the flush is done.
#[test]
fn a_scan_waiting_for_a_flush_counts_the_chunks_it_freed_as_free() {
    const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
    let f = FlushBeside::new(TIMEOUT, |k| if k == 2 { 5_000 } else { FlushBeside::near_the_bound() });
    for k in [0, 1] {
        f.insert(k);
        f.t.flush().unwrap();
    }
    f.insert(2);
    assert_eq!(f.files(), (2, 2));
    let started = std::time::Instant::now();
    let mut keys = Vec::new();
    for b in f.t.scan(ScanOptions::default().batch_rows(1)).unwrap() {
        keys.extend(f.keys(&b.unwrap()));
    }
    // Well under the timeout even on a loaded machine (about 2 ms here; 30 s before).
    assert!(started.elapsed() < TIMEOUT / 3, "{:?}", started.elapsed());
    // The row in memory first, then the files in order.
    assert_eq!(keys, [2, 0, 1]);
    // The row in memory was flushed while the scan waited.
    assert_eq!(f.files(), (3, 3));
    assert_eq!(f.engine.memory().category_bytes(Category::ScanBuffers), 0);
}

/// An explicit flush refused memory that a scan holds waits for it, as a write does. At
/// 4 MiB, rounds of one row each (two near the row bound, then one of 5 KB), each flushed on
/// a thread beside a full scan of the table: the flush, its batches converted, was refused its
/// write buffers beside the scan's reader ("requested 804.5 KiB for write_buffers", the reader
/// holding 3.2 MiB) in 10 of 60 rounds, though the scan let go of the reader milliseconds
/// later (helper-47's F3). Now no flush and no scan is refused. (Timing decides whether a
/// round meets the case; before, 10 rounds of 6 met it about 10 times.)
#[test]
fn a_flush_beside_a_scan_waits_for_the_memory_the_scan_gives_back() {
    use arrow::datatypes::{DataType, Field, Schema};
    const LIMIT: usize = 4 << 20;
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Utf8, true)]));
    let len = |k: i64| if k % 3 == 2 { 5_000 } else { gritdb::largest_readable_value(LIMIT) - 8 - 2_000 };
    for rep in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig::default().memory_limit(LIMIT).backpressure_timeout(std::time::Duration::from_secs(20));
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.create_table("t", Arc::clone(&schema), &["k"]).unwrap();
        for k in 0..6i64 {
            let v = random_text(len(k), k as u64, b'a', 26);
            t.insert(
                &RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from(vec![k])), Arc::new(arrow::array::StringArray::from(vec![v]))])
                    .unwrap(),
            )
            .unwrap();
            let flushing = {
                let t = t.clone();
                std::thread::spawn(move || t.flush())
            };
            let mut keys = Vec::new();
            for b in t.scan(ScanOptions::default().batch_rows(1)).unwrap() {
                let b = b.unwrap_or_else(|e| panic!("rep {rep} round {k}: scan refused: {e}"));
                let (keys_col, values) =
                    (b.column(0).as_any().downcast_ref::<Int64Array>().unwrap(), b.column(1).as_any().downcast_ref::<arrow::array::StringArray>().unwrap());
                for i in 0..b.num_rows() {
                    assert_eq!(values.value(i).len(), len(keys_col.value(i)));
                    keys.push(keys_col.value(i));
                }
            }
            flushing.join().unwrap().unwrap_or_else(|e| panic!("rep {rep} round {k}: flush refused: {e}"));
            keys.sort_unstable();
            assert_eq!(keys, (0..=k).collect::<Vec<_>>(), "rep {rep} round {k}");
        }
        assert_eq!(t.stats().unwrap().file_rows, 6);
        assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
    }
}

/// An export refused memory that another table's held scan batches take waits for them, as a
/// write and a flush do. At 2 MiB, with 1.6 MB of table `a`'s batches held by a caller, an
/// export of table `b` was refused its writer's buffers at once (helper-48); the caller lets
/// go 300 ms later, and the export now finishes with every row of `b`.
#[test]
fn an_export_beside_another_tables_held_batches_waits_for_them() {
    let (_dir, engine, a, b, _) = two_tables(2 << 20, std::time::Duration::from_secs(20), (40, 40_000, 4), 2_000);
    let out = tempfile::tempdir().unwrap();
    let held: Vec<RecordBatch> = a.scan(ScanOptions::default().batch_rows(1)).unwrap().map(Result::unwrap).collect();
    assert_eq!(held.iter().map(RecordBatch::num_rows).sum::<usize>(), 40);
    let held_bytes = engine.memory().category_bytes(Category::ScanBuffers);
    assert!(held_bytes > 1_600_000, "{held_bytes} bytes held");
    let target = out.path().join("b.parquet");
    let exporting = {
        let (b, target) = (b.clone(), target.clone());
        std::thread::spawn(move || b.export_parquet(&target))
    };
    std::thread::sleep(std::time::Duration::from_millis(300));
    drop(held);
    let stats = exporting.join().unwrap().unwrap_or_else(|e| panic!("export refused beside {held_bytes} bytes of held batches: {e}"));
    assert_eq!(stats.rows, 2_000);
    let file = std::fs::File::open(&target).unwrap();
    let rows: usize =
        gritdb::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap().map(|b| b.unwrap().num_rows()).sum();
    assert_eq!(rows, 2_000);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
    assert_eq!(engine.memory().category_bytes(Category::WriteBuffers), 0);
}

/// A write refused memory that another thread's held scan batches take waits for them, as a
/// flush and an export do. At 16 MiB, with 11 MB of table `a`'s batches held on another
/// thread, a 3.3 MB insert into table `b` — nothing to flush, no other write — was refused
/// at once, though the batches were let go of soon after (helper-48; its retry 20 ms later
/// succeeded). The holder lets go 300 ms later; the insert now waits and lands whole.
#[test]
fn a_write_beside_another_threads_held_batches_waits_for_them() {
    let (_dir, engine, a, b, batch) = two_tables(16 << 20, std::time::Duration::from_secs(20), (220, 50_000, 20), 0);
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let holder = {
        let a = a.clone();
        std::thread::spawn(move || {
            let held: Vec<RecordBatch> = a.scan(ScanOptions::default().batch_rows(4)).unwrap().map(Result::unwrap).collect();
            held_tx.send(held.iter().map(RecordBatch::num_rows).sum::<usize>()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(held);
        })
    };
    assert_eq!(held_rx.recv().unwrap(), 220);
    let held_bytes = engine.memory().category_bytes(Category::ScanBuffers);
    assert!(held_bytes > 10_000_000, "{held_bytes} bytes held");
    let big = batch(0, 66, 50_000);
    assert_eq!(b.insert(&big).unwrap_or_else(|e| panic!("insert refused beside {held_bytes} bytes of held batches: {e}")), 66);
    holder.join().unwrap();
    let rows: usize = b.scan(ScanOptions::default()).unwrap().map(|r| r.unwrap().num_rows()).sum();
    assert_eq!(rows, 66);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
}

/// An export waiting for memory when the engine is closed ends with `Error::Closed` at its
/// next wake-up and leaves no file: before, its scan waited out the whole timeout, or, when
/// the batches it waited for were let go of after `close`, went on reading the data directory
/// — beside a second engine that had opened it meanwhile — and wrote the export (helper-49's
/// F1 and F2). A scan opens no file once its engine is closed.
#[test]
fn an_export_waiting_when_the_engine_closes_ends_closed() {
    use gritdb::ExportError;
    for release_after_close in [false, true] {
        // The scan holding `a`'s batches is refused after this timeout; an export still
        // waiting when it runs out would end `MemoryLimit`, not `Closed`.
        let timeout = std::time::Duration::from_secs(3);
        let (dir, engine, a, b, _) = two_tables(2 << 20, timeout, (60, 40_000, 4), 2_000);
        let out = tempfile::tempdir().unwrap();
        // `a`'s batches, held until its scan is refused: the memory is full.
        let mut held = Vec::new();
        for r in a.scan(ScanOptions::default().batch_rows(1)).unwrap() {
            match r {
                Ok(b) => held.push(b),
                Err(e) if e.is_memory_limit() => break,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(held.len() > 30 && held.len() < 60, "{} batches held", held.len());
        let target = out.path().join("b.parquet");
        let exporting = {
            let (b, target) = (b.clone(), target.clone());
            std::thread::spawn(move || (b.export_parquet(&target), std::time::Instant::now()))
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        let closed_at = std::time::Instant::now();
        engine.close().unwrap();
        // The directory is free for another engine.
        let other = Engine::open(dir.path(), EngineConfig::default().memory_limit(2 << 20).backpressure_timeout(timeout)).unwrap();
        if release_after_close {
            std::thread::sleep(std::time::Duration::from_millis(300));
            held.clear();
        }
        let (res, done) = exporting.join().unwrap();
        match res {
            Err(ExportError::Engine(Error::Closed(_))) => {}
            other => panic!("release after close {release_after_close}: {other:?}"),
        }
        // Without the wait's end at close, the export's scan ran to its own 3 s timeout, about
        // 2.7 s after the close; `explain` reads that refusal as `Closed` too, so the time is
        // what tells (a wait wakes every 100 ms).
        assert!(done.duration_since(closed_at) < std::time::Duration::from_millis(1500), "ended {:?} after close", done.duration_since(closed_at));
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0, "no export file nor temp file");
        drop(held);
        // The second engine has every row.
        let rows: usize = other.table("b").unwrap().scan(ScanOptions::default()).unwrap().map(|r| r.unwrap().num_rows()).sum();
        assert_eq!(rows, 2_000);
        other.close().unwrap();
    }
}

/// Table `a` (`rows_a` rows of `len_a`-byte text, flushed `per_file` rows to a file) and table
/// `b` (`rows_b` rows of 100 bytes, flushed), `(k Int64, v Utf8)`, in an engine at `limit` with
/// `timeout` of backpressure; and a batch maker `(from, rows, bytes a value)`.
#[allow(clippy::type_complexity)]
fn two_tables(
    limit: usize,
    timeout: std::time::Duration,
    (rows_a, len_a, per_file): (i64, usize, i64),
    rows_b: i64,
) -> (tempfile::TempDir, Engine, gritdb::Table, gritdb::Table, Box<dyn Fn(i64, i64, usize) -> RecordBatch>) {
    use arrow::datatypes::{DataType, Field, Schema};
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Utf8, true)]));
    let batch = {
        let schema = Arc::clone(&schema);
        move |from: i64, n: i64, len: usize| {
            let k = Int64Array::from_iter_values(from..from + n);
            let v = arrow::array::StringArray::from_iter_values((from..from + n).map(|k| random_text(len, k as u64, b'a', 26)));
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(k), Arc::new(v)]).unwrap()
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(limit).backpressure_timeout(timeout)).unwrap();
    let a = engine.create_table("a", Arc::clone(&schema), &["k"]).unwrap();
    let b = engine.create_table("b", Arc::clone(&schema), &["k"]).unwrap();
    for from in (0..rows_a).step_by(usize::try_from(per_file).unwrap()) {
        a.insert(&batch(from, per_file, len_a)).unwrap();
        a.flush().unwrap();
    }
    if rows_b > 0 {
        b.insert(&batch(0, rows_b, 100)).unwrap();
        b.flush().unwrap();
    }
    (dir, engine, a, b, Box::new(batch))
}
