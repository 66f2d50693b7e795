//! Breaker trial 3: attacks on the memory report's consistency read (f7ccdd0), WAL recovery's
//! metadata run-off and body-length checks (a53cb7d), the reader's metadata estimate
//! (1486263) and the scan's flush-room wait (613ef3e).

use crate::breaker_session12::{kv_batch, kv_keys, kv_schema};
use crate::breaker_slices::copy_dir;
use crate::breaker_trial::{cfg, last_segment, try_open, wal_cfg};
use crate::breaker_trial2::{Outcome, open_with};
use crate::scan_memory::wide_and_fillers;
use arrow::array::{
    ArrayRef, AsArray, BinaryArray, BooleanArray, Decimal128Array, Float64Array, Int32Array, Int64Array, LargeStringArray, RecordBatch, UInt8Array,
};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Error, ScanOptions, StorageError, Table, WalSync};
use gritdb_tests::mix;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const MODES: [WalSync; 2] = [WalSync::PerBatch, WalSync::Relaxed];

// =====================================================================================
// 1. Memory report: used beside the categories
// =====================================================================================

fn sum_categories(r: &gritdb::memory::MemoryReport) -> usize {
    r.categories.iter().map(|c| c.bytes).fold(0usize, usize::wrapping_add)
}

/// Waits (bounded) until no flush is queued or running.
fn settle(engine: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while engine.flushes_in_flight() > 0 {
        assert!(Instant::now() < deadline, "flushes never settled");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Eight threads create, fill, scan, flush and drop their own tables while four threads take
/// reports as fast as they can. No report panics or hangs; every report's tables are live
/// names; once quiescent, `used` equals the categories' sum exactly, every table's category
/// figure is at most the engine's, and after the last drop no table is reported and the
/// tables' bytes are 0.
#[test]
fn reports_during_concurrent_create_write_drop_agree_once_quiescent() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(Engine::open(dir.path(), cfg(64 * MIB)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for _ in 0..4 {
        let (engine, stop, reports) = (Arc::clone(&engine), Arc::clone(&stop), Arc::clone(&reports));
        readers.push(std::thread::spawn(move || {
            let mut worst = 0usize;
            while !stop.load(Ordering::Acquire) {
                let r = engine.memory_report();
                let sum = sum_categories(&r);
                worst = worst.max(sum.abs_diff(r.used));
                reports.fetch_add(1, Ordering::Relaxed);
                let _ = engine.memory_report_batch().unwrap();
            }
            worst
        }));
    }
    let mut writers = Vec::new();
    for w in 0..8i64 {
        let engine = Arc::clone(&engine);
        writers.push(std::thread::spawn(move || {
            for round in 0..6i64 {
                let name = format!("w{w}r{round}");
                let t = engine.create_table(&name, kv_schema(), &["k"]).unwrap();
                for b in 0..5i64 {
                    let keys: Vec<i64> = (b * 500..b * 500 + 500).collect();
                    t.upsert(&kv_batch(&keys, round + 1, 40)).unwrap();
                }
                if round % 2 == 0 {
                    t.flush().unwrap();
                }
                assert_eq!(t.delete(&kv_keys(&(0..100).collect::<Vec<_>>())).unwrap(), 100);
                let rows: usize = t.scan(ScanOptions::default()).unwrap().map(|b| b.unwrap().num_rows()).sum();
                assert_eq!(rows, 2_400);
                drop(t);
                engine.drop_table(&name).unwrap();
            }
        }));
    }
    let mut problems = Vec::new();
    for w in writers {
        if let Err(p) = w.join() {
            problems.push(format!("writer panicked: {}", crate::breaker_trial::panic_text(&*p)));
        }
    }
    stop.store(true, Ordering::Release);
    for r in readers {
        match r.join() {
            Ok(_) => {}
            Err(p) => problems.push(format!("reader panicked: {}", crate::breaker_trial::panic_text(&*p))),
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(reports.load(Ordering::Relaxed) > 0);
    settle(&engine);
    // Quiescent: the figures agree exactly.
    let keep = engine.create_table("keep", kv_schema(), &["k"]).unwrap();
    keep.upsert(&kv_batch(&(0..3_000).collect::<Vec<_>>(), 1, 40)).unwrap();
    settle(&engine);
    let r = engine.memory_report();
    assert_eq!(sum_categories(&r), r.used, "quiescent report: categories {:?}", r.categories);
    let names: Vec<&str> = r.tables.iter().map(|t| t.table.as_str()).collect();
    assert_eq!(names, ["keep"], "only the live table is reported");
    for c in &r.categories {
        let tables: usize = r.tables.iter().flat_map(|t| t.categories.iter()).filter(|x| x.category == c.category).map(|x| x.bytes).sum();
        assert!(tables <= c.bytes, "{:?}: tables {tables} > engine {}", c.category, c.bytes);
    }
    drop(keep);
    engine.drop_table("keep").unwrap();
    settle(&engine);
    let r = engine.memory_report();
    assert_eq!(sum_categories(&r), r.used);
    assert!(r.tables.is_empty(), "no table after the last drop: {:?}", r.tables.iter().map(|t| &t.table).collect::<Vec<_>>());
    for c in [Category::RowBlocks, Category::BatchBlocks, Category::KeyIndex, Category::ScanBuffers, Category::WriteBuffers] {
        assert_eq!(engine.memory().category_bytes(c), 0, "{c:?} after every table was dropped");
    }
}

// =====================================================================================
// 2. WAL recovery: damage before the last record, torn tails
// =====================================================================================

/// Copies `src`, writes `bytes` as segment `name`, opens and reads table `t` (kv schema).
fn open_kv(src: &Path, name: &std::ffi::OsStr, bytes: &[u8], mode: WalSync) -> Outcome {
    open_with(src, name, bytes, mode, false)
}

/// The IPC layout of the record at `at` (length `len`, header included): the schema
/// message's position and metadata length, the record batch message's, its body length,
/// and where the end-of-stream marker is. Asserts the record holds exactly these.
struct Layout {
    schema_msg: usize,
    batch_msg: usize,
    batch_meta: usize,
    body: usize,
}

fn layout(data: &[u8], at: usize, len: usize) -> Layout {
    let m1 = at + 8 + 25;
    let i32_at = |p: usize| i32::from_le_bytes(data[p..p + 4].try_into().unwrap()) as usize;
    assert_eq!(&data[m1..m1 + 4], &[0xff; 4]);
    let m2 = m1 + 8 + i32_at(m1 + 4);
    assert_eq!(&data[m2..m2 + 4], &[0xff; 4]);
    let meta2 = i32_at(m2 + 4);
    let eos = at + len - 8;
    assert_eq!(&data[eos..at + len], &[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    let body = eos - (m2 + 8 + meta2);
    Layout { schema_msg: m1, batch_msg: m2, batch_meta: meta2, body }
}

/// Three acknowledged upserts of 10 keys (record i: keys 10i..10i+10, version i + 1), engine
/// dropped without close.
fn three_records(dir: &Path, mode: WalSync, pad: usize) -> (std::ffi::OsString, Vec<u8>, Vec<(usize, usize)>) {
    let engine = Engine::open(dir, wal_cfg(mode)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    for i in 0..3i64 {
        t.upsert(&kv_batch(&(i * 10..i * 10 + 10).collect::<Vec<_>>(), i + 1, pad)).unwrap();
    }
    drop(t);
    drop(engine);
    let (seg, data, recs) = last_segment(dir);
    assert_eq!(recs.len(), 3);
    (seg.file_name().unwrap().to_owned(), data, recs)
}

fn rows_of(records: usize) -> BTreeMap<i64, i64> {
    (0..records as i64 * 10).map(|k| (k, k / 10 + 1)).collect()
}

/// The second field damaged beside the record length, in record `j`: (what, offset, new
/// 4- or 8-byte little-endian value).
fn stretch_damage(data: &[u8], at: usize, len: usize) -> Vec<(String, usize, Vec<u8>)> {
    let l = layout(data, at, len);
    let mut out = Vec::new();
    // The record batch message's metadata length, a few bytes longer (the flatbuffer still
    // parses: a verifier ignores bytes after the root's tables).
    for k in [16usize, 24, 40] {
        out.push((format!("batch metadata length +{k}"), l.batch_msg + 4, ((l.batch_meta + k) as i32).to_le_bytes().to_vec()));
    }
    // The record batch's bodyLength a few bytes longer (still below its last buffer's end + 64
    // when the padding allows).
    let meta = &data[l.batch_msg + 8..l.batch_msg + 8 + l.batch_meta];
    let needle = (l.body as i64).to_le_bytes();
    let hits: Vec<usize> = (0..meta.len() - 7).filter(|&i| meta[i..i + 8] == needle).collect();
    assert!(!hits.is_empty(), "bodyLength {} not found in the metadata", l.body);
    for k in [16usize, 24, 32, 40, 48, 56] {
        out.push((format!("bodyLength {} +{k}", l.body), l.batch_msg + 8 + hits[0], ((l.body + k) as i64).to_le_bytes().to_vec()));
    }
    let _ = l.schema_msg;
    out
}

/// Record 1 of 3 with its record length damaged (past the end, zero, or 4 bytes short) AND
/// one length inside its IPC stream a little longer (the record batch message's metadata
/// length, or its flatbuffer bodyLength within the 64-byte padding allowance): record 2 is
/// whole and acknowledged after it, so the open must be `CorruptWal`.
#[test]
fn a_stretched_ipc_length_in_a_record_before_the_last_is_corrupt_wal() {
    let mut problems = Vec::new();
    let mut cases = 0;
    for mode in MODES {
        let src = tempfile::tempdir().unwrap();
        let (name, data, recs) = three_records(src.path(), mode, 3);
        let (at, len) = recs[1];
        for (what, off, value) in stretch_damage(&data, at, len) {
            for (lwhat, lvalue) in [("u32::MAX", u32::MAX), ("0", 0), ("len-4", (len - 8 - 4) as u32)] {
                let mut d = data.clone();
                d[at..at + 4].copy_from_slice(&lvalue.to_le_bytes());
                d[off..off + value.len()].copy_from_slice(&value);
                cases += 1;
                match open_kv(src.path(), &name, &d, mode) {
                    Outcome::Corrupt => {}
                    Outcome::Rows(m) => {
                        problems.push(format!("{mode:?} length {lwhat} + {what}: {} rows replayed (record 2 lost: {})", m.len(), m == rows_of(1)));
                    }
                    Outcome::Other(s) => problems.push(format!("{mode:?} length {lwhat} + {what}: {s}")),
                }
            }
        }
    }
    let n = problems.len();
    problems.truncate(10);
    assert!(n == 0, "{n} of {cases} cases lost acknowledged records: {problems:#?}");
}

/// The same two-field damage in record 0 of 3 (records 1 and 2 after it): the walk lands in
/// record 1 and the search still finds record 2, so this is `CorruptWal`.
#[test]
fn a_stretched_ipc_length_with_two_records_after_it_is_corrupt_wal() {
    let mut problems = Vec::new();
    let src = tempfile::tempdir().unwrap();
    let (name, data, recs) = three_records(src.path(), WalSync::PerBatch, 3);
    let (at, len) = recs[0];
    for (what, off, value) in stretch_damage(&data, at, len) {
        for lvalue in [u32::MAX, 0, (len - 8 - 4) as u32] {
            let mut d = data.clone();
            d[at..at + 4].copy_from_slice(&lvalue.to_le_bytes());
            d[off..off + value.len()].copy_from_slice(&value);
            match open_kv(src.path(), &name, &d, WalSync::PerBatch) {
                Outcome::Corrupt => {}
                o => problems.push(format!("length {lvalue} + {what}: {o:?}")),
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Single-field damage of every IPC length field in record 1 of 3 (metadata lengths of both
/// messages, bodyLength set to 0, -1 and huge, the record length set to 0, u32::MAX and
/// short): `CorruptWal` every time, both modes.
#[test]
fn single_length_fields_damaged_before_the_last_record_are_corrupt_wal() {
    let mut problems = Vec::new();
    for mode in MODES {
        let src = tempfile::tempdir().unwrap();
        let (name, data, recs) = three_records(src.path(), mode, 3);
        let (at, len) = recs[1];
        let l = layout(&data, at, len);
        let meta = &data[l.batch_msg + 8..l.batch_msg + 8 + l.batch_meta];
        let body_at = l.batch_msg + 8 + (0..meta.len() - 7).find(|&i| meta[i..i + 8] == (l.body as i64).to_le_bytes()).unwrap();
        let mut cases: Vec<(String, usize, Vec<u8>)> = Vec::new();
        for v in [0u32, u32::MAX, (len - 8 - 4) as u32, (len - 8 + 64) as u32] {
            cases.push((format!("record length {v}"), at, v.to_le_bytes().to_vec()));
        }
        for v in [0i32, -1, i32::MAX, 7, 1 << 20] {
            cases.push((format!("schema meta length {v}"), l.schema_msg + 4, v.to_le_bytes().to_vec()));
            cases.push((format!("batch meta length {v}"), l.batch_msg + 4, v.to_le_bytes().to_vec()));
        }
        for v in [0i64, -1, i64::MAX, 1 << 40, (l.body + 64) as i64, l.body as i64 - 8] {
            cases.push((format!("bodyLength {v}"), body_at, v.to_le_bytes().to_vec()));
        }
        for (what, off, value) in cases {
            let mut d = data.clone();
            d[off..off + value.len()].copy_from_slice(&value);
            if d == data {
                continue;
            }
            match open_kv(src.path(), &name, &d, mode) {
                Outcome::Corrupt => {}
                o => problems.push(format!("{mode:?} {what}: {o:?}")),
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A table of every column kind the engine takes (Decimal of both widths, a large string, a
/// binary column holding a whole earlier WAL record): its last record torn at every offset of
/// its header and IPC metadata (every 3rd; every 7th in Relaxed) and every 131st offset of its body opens and replays exactly
/// the records before it, both modes.
#[test]
fn a_wide_record_torn_anywhere_replays_the_records_before_it() {
    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("v", DataType::Int64, false),
            Field::new("b", DataType::Boolean, true),
            Field::new("u", DataType::UInt8, true),
            Field::new("i", DataType::Int32, true),
            Field::new("f", DataType::Float64, true),
            Field::new("d18", DataType::Decimal128(18, 3), true),
            Field::new("d38", DataType::Decimal128(38, 5), true),
            Field::new("ls", DataType::LargeUtf8, true),
            Field::new("bin", DataType::Binary, true),
        ]))
    }
    fn batch(keys: &[i64], ver: i64, blob: &[u8]) -> RecordBatch {
        let n = keys.len();
        let cols: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(keys.to_vec())),
            Arc::new(Int64Array::from(vec![ver; n])),
            Arc::new(BooleanArray::from((0..n).map(|i| (i % 3 != 0).then_some(i % 2 == 0)).collect::<Vec<_>>())),
            Arc::new(UInt8Array::from((0..n).map(|i| Some(i as u8)).collect::<Vec<_>>())),
            Arc::new(Int32Array::from((0..n).map(|i| (i % 4 != 1).then_some(i as i32 * 7)).collect::<Vec<_>>())),
            Arc::new(Float64Array::from((0..n).map(|i| Some(i as f64 / 3.0)).collect::<Vec<_>>())),
            Arc::new(Decimal128Array::from((0..n).map(|i| Some(i as i128 * 1001)).collect::<Vec<_>>()).with_precision_and_scale(18, 3).unwrap()),
            Arc::new(
                Decimal128Array::from((0..n).map(|i| (i % 5 != 0).then_some(i as i128 * 10i128.pow(30))).collect::<Vec<_>>())
                    .with_precision_and_scale(38, 5)
                    .unwrap(),
            ),
            Arc::new(LargeStringArray::from((0..n).map(|i| Some(format!("large {i} {ver}"))).collect::<Vec<_>>())),
            Arc::new(BinaryArray::from((0..n).map(|i| Some(if i % 2 == 0 { blob } else { &b"x"[..] })).collect::<Vec<_>>())),
        ];
        RecordBatch::try_new(schema(), cols).unwrap()
    }
    let mut problems = Vec::new();
    for mode in MODES {
        let src = tempfile::tempdir().unwrap();
        let engine = Engine::open(src.path(), wal_cfg(mode)).unwrap();
        let t = engine.create_table("t", schema(), &["k"]).unwrap();
        t.upsert(&batch(&(0..6).collect::<Vec<_>>(), 1, b"plain")).unwrap();
        t.upsert(&batch(&(6..12).collect::<Vec<_>>(), 2, b"plain")).unwrap();
        // The whole of record 1 (read while the engine is open: a reopen starts a new
        // segment), as a value of the record torn below.
        let seg = crate::breaker_trial::segments(src.path()).pop().unwrap();
        let data = std::fs::read(&seg).unwrap();
        let recs = crate::breaker_session13::records(&data);
        assert_eq!(recs.len(), 2);
        let blob = data[recs[1].0..recs[1].0 + recs[1].1].to_vec();
        t.upsert(&batch(&(12..18).collect::<Vec<_>>(), 3, &blob)).unwrap();
        drop(t);
        drop(engine);
        let (seg2, data, recs) = last_segment(src.path());
        assert_eq!(seg2, seg, "one segment");
        assert_eq!(recs.len(), 3);
        let name = seg.file_name().unwrap().to_owned();
        let (at, len) = recs[2];
        let l = layout(&data, at, len);
        let body_start = l.batch_msg + 8 + l.batch_meta;
        // Every 3rd offset of the header and metadata (every 7th from +1 in Relaxed), every 131st of the body.
        let (phase, meta_step) = if mode == WalSync::PerBatch { (0, 3) } else { (1, 7) };
        let mut cuts: Vec<usize> = (at + phase..body_start + 16).step_by(meta_step).collect();
        cuts.extend((body_start + 16..at + len).step_by(131));
        eprintln!("{mode:?}: {} cuts of a {len}-byte record ({} bytes before its body)", cuts.len(), body_start - at);
        cuts.push(at + len - 1);
        let base = tempfile::tempdir().unwrap();
        copy_dir(src.path(), base.path());
        for cut in cuts {
            let d = tempfile::tempdir().unwrap();
            copy_dir(base.path(), d.path());
            std::fs::write(d.path().join("wal").join(&name), &data[..cut]).unwrap();
            match try_open(d.path(), wal_cfg(mode)) {
                Ok(Ok(engine)) => {
                    let t = engine.table("t").unwrap();
                    let mut keys = Vec::new();
                    for b in t.scan(ScanOptions::default()).unwrap() {
                        let b = b.unwrap();
                        keys.extend(b.column(0).as_primitive::<Int64Type>().values().iter().copied());
                    }
                    keys.sort_unstable();
                    if keys != (0..12).collect::<Vec<_>>() {
                        problems.push(format!("{mode:?} cut {} of record 2: {} keys", cut - at, keys.len()));
                    }
                }
                Ok(Err(e)) => problems.push(format!("{mode:?} cut {} of record 2 ({} bytes): {e}", cut - at, len)),
                Err(p) => problems.push(format!("{mode:?} cut {}: panic {p}", cut - at)),
            }
        }
    }
    let n = problems.len();
    problems.truncate(10);
    assert!(n == 0, "{n} failing cuts: {problems:#?}");
}

// =====================================================================================
// 3. Reader metadata estimate: wide files with many row groups at small limits
// =====================================================================================

fn wide_schema(cols: usize) -> SchemaRef {
    let mut f = vec![Field::new("k", DataType::Int64, false)];
    f.extend((0..cols).map(|c| Field::new(format!("c{c}"), DataType::Int64, true)));
    Arc::new(Schema::new(f))
}

fn wide_batch(cols: usize, from: i64, n: i64) -> RecordBatch {
    let mut a: Vec<ArrayRef> = vec![Arc::new(Int64Array::from_iter_values(from..from + n))];
    for c in 0..cols {
        a.push(Arc::new(Int64Array::from_iter_values((from..from + n).map(|k| (mix(k as u64 * 131 + c as u64) % 1000) as i64))));
    }
    RecordBatch::try_new(wide_schema(cols), a).unwrap()
}

/// A 120-column table flushed at 256 MiB into files of many row groups, then reopened at 4,
/// 8 and 16 MiB and scanned (full, projected, filtered): each open and scan is exact or a
/// typed `MemoryLimit`, and after every scan `scan_buffers` is 0 and `used` is back to what it
/// was before the scan.
#[test]
fn wide_many_row_group_files_scan_at_small_limits_and_release_everything() {
    const COLS: usize = 120;
    const ROWS: i64 = 60_000;
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = Engine::open(dir.path(), cfg(256 * MIB).flush_batch_bytes(256 << 10)).unwrap();
        let t = engine.create_table("w", wide_schema(COLS), &["k"]).unwrap();
        for from in (0..ROWS).step_by(10_000) {
            t.insert(&wide_batch(COLS, from, 10_000)).unwrap();
        }
        t.flush().unwrap();
        drop(t);
        engine.close().unwrap();
    }
    let mut report = Vec::new();
    for e in walk(dir.path()) {
        if e.extension().is_some_and(|x| x == "parquet") {
            use gritdb::parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
            let opts = ArrowReaderOptions::new().with_page_index_policy(gritdb::parquet::file::metadata::PageIndexPolicy::Optional);
            let b = ParquetRecordBatchReaderBuilder::try_new_with_options(std::fs::File::open(&e).unwrap(), opts).unwrap();
            let plain = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&e).unwrap()).unwrap();
            report.push(format!(
                "file {}: {} B, {} row groups, metadata {} B with page index, {} B without",
                e.display(),
                std::fs::metadata(&e).unwrap().len(),
                b.metadata().num_row_groups(),
                b.metadata().memory_size(),
                plain.metadata().memory_size()
            ));
        }
    }
    for limit in [4 * MIB, 8 * MIB, 16 * MIB] {
        let engine = match try_open(dir.path(), cfg(limit).backpressure_timeout(Duration::from_millis(300))).unwrap() {
            Ok(e) => e,
            Err(e @ (Error::MemoryLimit { .. } | Error::Storage(StorageError::Memory(_)))) => {
                report.push(format!("{} MiB: open refused: {e}", limit / MIB));
                continue;
            }
            Err(e) => panic!("open at {} MiB: {e}", limit / MIB),
        };
        let t = engine.table("w").unwrap();
        engine.release_cached_memory();
        let base = engine.memory().used() - engine.memory().category_bytes(Category::FreeChunks);
        for (what, opts) in [
            ("full", ScanOptions::default()),
            ("projected", ScanOptions::default().projection(["k", "c7"])),
            (
                "filtered",
                ScanOptions::default().filter(gritdb::ScanFilter::compare("k", gritdb::CompareOp::GtEq, Arc::new(Int64Array::from(vec![ROWS - 5_000])))),
            ),
        ] {
            let want = if what == "filtered" { 5_000 } else { ROWS as usize };
            let mut rows = 0usize;
            let mut sum = 0i64;
            let mut err = None;
            match t.scan(opts) {
                Ok(s) => {
                    for b in s {
                        match b {
                            Ok(b) => {
                                rows += b.num_rows();
                                sum += b.column(0).as_primitive::<Int64Type>().values().iter().sum::<i64>();
                            }
                            Err(e) => {
                                err = Some(e);
                                break;
                            }
                        }
                    }
                }
                Err(e) => err = Some(e),
            }
            match err {
                None => {
                    let first = ROWS - want as i64;
                    assert_eq!((rows, sum), (want, (first..ROWS).sum::<i64>()), "{what} at {} MiB", limit / MIB);
                }
                Some(e @ Error::MemoryLimit { .. }) => report.push(format!("{} MiB {what}: MemoryLimit after {rows} rows: {e}", limit / MIB)),
                Some(e) => panic!("{what} at {} MiB: {e}", limit / MIB),
            }
            assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0, "{what} at {} MiB", limit / MIB);
            engine.release_cached_memory();
            let now = engine.memory().used() - engine.memory().category_bytes(Category::FreeChunks);
            assert_eq!(now, base, "{what} at {} MiB: used back to its baseline", limit / MIB);
        }
        drop(t);
        engine.close().unwrap();
    }
    eprintln!("refusals: {report:#?}");
    assert!(!report.iter().any(|r| r.starts_with("16 MiB")), "16 MiB refused: {report:#?}");
    // At 8 MiB every scan runs since a reader keeps the page index only where it is used (no
    // byte-array column here) and a filter prunes row groups only when the column index does
    // not fit: the full and filtered scans were refused before.
    assert!(!report.iter().any(|r| r.starts_with("8 MiB")), "8 MiB refused: {report:#?}");
}

fn walk(d: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

// =====================================================================================
// 4. Scans leave the memory to flush the largest delta
// =====================================================================================

/// Rows of `width`-byte values that do not compress, keys `from..to`.
struct Pressured {
    _dir: tempfile::TempDir,
    engine: Engine,
    fs: FaultFs,
    wide: Table,
    fillers: Vec<(Table, i64)>,
}

const TIMEOUT: Duration = Duration::from_millis(500);

/// 8 MiB, one writer thread: table `wide` holds 400 rows of 10,000-byte values in a file;
/// seven filler tables hold about 700 KB of delta each, below their flush threshold.
fn pressured() -> Pressured {
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let config = EngineConfig::default()
        .memory_limit(8 * MIB)
        .writer_threads(1)
        .flush_age(Duration::from_secs(3600))
        .backpressure_timeout(TIMEOUT)
        .vfs(Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), config).unwrap();
    let (wide, fillers) = wide_and_fillers(&engine, 400);
    assert!(engine.memory().used() > 4 * MIB, "more than half the limit in use");
    Pressured { _dir: dir, engine, fs, wide, fillers }
}

/// Holds every batch of a `wide` scan (5 rows, 50 KB each) until it ends or errs; returns
/// (rows, sum of keys, error, batches that took at least the backpressure timeout).
fn held_scan(p: &Pressured, batch_rows: usize) -> (usize, i64, Option<Error>, usize, Duration) {
    let started = Instant::now();
    let mut held = Vec::new();
    let mut slow = 0;
    let mut err = None;
    let mut s = p.wide.scan(ScanOptions::default().batch_rows(batch_rows)).unwrap();
    loop {
        let t0 = Instant::now();
        let b = s.next();
        if t0.elapsed() >= TIMEOUT.saturating_sub(Duration::from_millis(50)) {
            slow += 1;
        }
        match b {
            Some(Ok(b)) => held.push(b),
            Some(Err(e)) => {
                err = Some(e);
                break;
            }
            None => break,
        }
    }
    let rows = held.iter().map(RecordBatch::num_rows).sum();
    let sum = held.iter().map(|b| b.column(0).as_primitive::<Int64Type>().values().iter().sum::<i64>()).sum();
    (rows, sum, err, slow, started.elapsed())
}

/// A `wide` scan held beside fillers whose flush `broken` breaks (`batch_rows` a batch): exact,
/// or a typed `MemoryLimit` at the hard limit with the rows before it exact, and at most two
/// batches that each waited the whole timeout (the flush-room wait is given up once per scan).
fn held_scan_beside_a_broken_flush(broken: impl FnOnce(&FaultFs), batch_rows: usize) {
    let p = pressured();
    broken(&p.fs);
    let (rows, sum, err, slow, took) = held_scan(&p, batch_rows);
    p.fs.heal();
    eprintln!("rows {rows}, err {err:?}, slow batches {slow}, took {took:?}");
    match &err {
        None => assert_eq!((rows, sum), (400, (0..400).sum::<i64>())),
        Some(Error::MemoryLimit { .. }) => assert_eq!(sum, (0..rows as i64).sum::<i64>()),
        Some(e) => panic!("{e}"),
    }
    assert!(slow <= 2, "{slow} batches each waited the whole {TIMEOUT:?} (scan took {took:?}, {rows} rows, {err:?})");
}

/// With the data directory failing every write (ENOSPC) the sealed deltas' flush can never
/// finish (its converted batches stay in batch_blocks for the retry).
#[test]
fn a_scan_beside_a_failing_flush_waits_once_not_per_batch() {
    held_scan_beside_a_broken_flush(|fs| fs.fail_all(28), 1);
}

/// The same with the data files' writes hung (a stalled disk): 18 batches waited the whole
/// timeout each (~9 s) before `12d38f3`.
#[test]
fn a_scan_beside_a_stalled_flush_waits_once_not_per_batch() {
    held_scan_beside_a_broken_flush(|fs| fs.stall_paths(".parquet"), 2);
}

/// With flushes working, the held scan goes through (or is a typed refusal at the hard
/// limit), the fillers lose no row, and once the batches are dropped and flushes settle,
/// scan_buffers is 0.
#[test]
fn a_held_scan_under_pressure_is_exact_and_releases_its_memory() {
    let p = pressured();
    let (rows, sum, err, _slow, _took) = held_scan(&p, 5);
    match &err {
        None => assert_eq!((rows, sum), (400, (0..400).sum::<i64>())),
        Some(Error::MemoryLimit { .. }) => assert_eq!(sum, (0..rows as i64).sum::<i64>()),
        Some(e) => panic!("{e}"),
    }
    settle(&p.engine);
    assert_eq!(p.engine.memory().category_bytes(Category::ScanBuffers), 0);
    for (t, k) in &p.fillers {
        assert_eq!(t.row_count().unwrap(), *k as u64);
    }
}

/// A scan of a filler (the table whose delta is among the largest) while it holds batches
/// of `wide`: exact; and `drop_table` of a filler and `close` while scans wait: every scan
/// ends (rows, `TableNotFound`, `Closed` or `MemoryLimit`) and nothing panics.
#[test]
fn scans_of_the_largest_delta_and_drop_and_close_during_waits_end() {
    let p = pressured();
    // Hold wide batches up to the threshold region.
    let mut held = Vec::new();
    for b in p.wide.scan(ScanOptions::default().batch_rows(5)).unwrap() {
        match b {
            Ok(b) => held.push(b),
            Err(_) => break,
        }
        if held.len() >= 50 {
            break;
        }
    }
    let (t0, k0) = &p.fillers[0];
    let mut rows = 0usize;
    let mut refused = false;
    for b in t0.scan(ScanOptions::default().batch_rows(64)).unwrap() {
        match b {
            Ok(b) => rows += b.num_rows(),
            Err(Error::MemoryLimit { .. }) => {
                refused = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(refused || rows == *k0 as usize, "filler0: {rows} rows of {k0}");
    let engine = Arc::new(p.engine);
    let mut scans = Vec::new();
    for (t, k) in p.fillers.into_iter().skip(1) {
        scans.push(std::thread::spawn(move || {
            let mut rows = 0usize;
            let mut end = String::from("done");
            match t.scan(ScanOptions::default().batch_rows(16)) {
                Ok(s) => {
                    for b in s {
                        match b {
                            Ok(b) => rows += b.num_rows(),
                            Err(e) => {
                                end = format!("{e:?}");
                                break;
                            }
                        }
                    }
                }
                Err(e) => end = format!("{e:?}"),
            }
            (rows, k, end)
        }));
    }
    let _ = engine.drop_table("filler1");
    drop(held);
    let started = Instant::now();
    let mut ends = Vec::new();
    for s in scans {
        let (rows, k, end) = s.join().expect("a scan panicked");
        if end == "done" {
            assert_eq!(rows as i64, k, "a completed scan is exact");
        } else {
            assert!(end.contains("TableNotFound") || end.contains("MemoryLimit") || end.contains("Closed"), "{end}");
        }
        ends.push(end);
    }
    assert!(started.elapsed() < Duration::from_secs(15), "scans took {:?}", started.elapsed());
    drop(p.wide);
    let engine = Arc::try_unwrap(engine).ok().unwrap();
    engine.close().unwrap();
}

/// Writers and scanners on four tables at 8 MiB for a fixed amount of work: every scan ends
/// with exact rows for what it saw (no key twice, every key written before it started and not
/// rewritten is present) or a typed `MemoryLimit`; afterwards every table holds exactly what
/// was written and `scan_buffers` is 0.
#[test]
fn concurrent_scans_and_writers_at_8_mib_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(Engine::open(dir.path(), cfg(8 * MIB).backpressure_timeout(Duration::from_secs(2))).unwrap());
    let tables: Vec<Table> = (0..4).map(|i| engine.create_table(&format!("c{i}"), kv_schema(), &["k"]).unwrap()).collect();
    let written: Vec<Arc<AtomicUsize>> = (0..4).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    let mut hs = Vec::new();
    for (i, t) in tables.iter().enumerate() {
        let t = engine.table(t.name()).unwrap();
        let w = Arc::clone(&written[i]);
        hs.push(std::thread::spawn(move || {
            let mut errors = 0;
            for b in 0..40i64 {
                let keys: Vec<i64> = (b * 1_000..b * 1_000 + 1_000).collect();
                match t.upsert(&kv_batch(&keys, 1, 60)) {
                    Ok(_) => {
                        w.store(((b + 1) * 1_000) as usize, Ordering::Release);
                    }
                    Err(Error::MemoryLimit { .. }) => {
                        errors += 1;
                        // Retry once: a write must not be lost.
                        t.upsert(&kv_batch(&keys, 1, 60)).unwrap();
                        w.store(((b + 1) * 1_000) as usize, Ordering::Release);
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            format!("writer errors {errors}")
        }));
    }
    for i in 0..4 {
        let t = engine.table(&format!("c{}", i % 4)).unwrap();
        let w = Arc::clone(&written[i % 4]);
        hs.push(std::thread::spawn(move || {
            let mut refused = 0;
            for _ in 0..15 {
                let before = w.load(Ordering::Acquire);
                let mut seen = std::collections::BTreeSet::new();
                let mut ok = true;
                for b in t.scan(ScanOptions::default().batch_rows(700)).unwrap() {
                    match b {
                        Ok(b) => {
                            for &k in b.column(0).as_primitive::<Int64Type>().values() {
                                assert!(seen.insert(k), "key {k} twice in one scan");
                            }
                        }
                        Err(Error::MemoryLimit { .. }) => {
                            refused += 1;
                            ok = false;
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                if ok {
                    assert!(seen.len() >= before, "scan saw {} keys, {before} were written before it", seen.len());
                    assert!((0..before as i64).all(|k| seen.contains(&k)));
                }
            }
            format!("scan refusals {refused}")
        }));
    }
    let outcomes: Vec<String> = hs.into_iter().map(|h| h.join().expect("a thread panicked")).collect();
    eprintln!("{outcomes:?}");
    for t in &tables {
        assert_eq!(t.row_count().unwrap(), 40_000);
        let rows: usize = t.scan(ScanOptions::default()).unwrap().map(|b| b.unwrap().num_rows()).sum();
        assert_eq!(rows, 40_000);
    }
    settle(&engine);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
}

/// Lowering the limit while scans hold batches: the scans end (rows or `MemoryLimit`) within
/// a few timeouts, the deltas lose nothing, and scan_buffers returns to 0.
#[test]
fn lowering_the_limit_during_held_scans_ends_them_and_loses_nothing() {
    let p = pressured();
    let engine = &p.engine;
    let started = Instant::now();
    let mut held = Vec::new();
    let mut s = p.wide.scan(ScanOptions::default().batch_rows(5)).unwrap();
    let mut out = String::from("done");
    let mut lowered = false;
    loop {
        match s.next() {
            Some(Ok(b)) => held.push(b),
            Some(Err(e)) => {
                out = format!("{e:?}");
                break;
            }
            None => break,
        }
        if held.len() == 20 && !lowered {
            engine.set_memory_limit(6 * MIB).unwrap();
            lowered = true;
        }
    }
    assert!(out == "done" || out.contains("MemoryLimit"), "{out}");
    let rows: usize = held.iter().map(RecordBatch::num_rows).sum();
    let sum: i64 = held.iter().map(|b| b.column(0).as_primitive::<Int64Type>().values().iter().sum::<i64>()).sum();
    assert_eq!(sum, (0..rows as i64).sum::<i64>());
    drop(held);
    drop(s);
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    settle(engine);
    assert_eq!(engine.memory().category_bytes(Category::ScanBuffers), 0);
    for (t, k) in &p.fillers {
        assert_eq!(t.row_count().unwrap(), *k as u64);
    }
}
