//! Breaker trial: the recent changes (flush in parts, big deletes' WAL record on the pool,
//! key-index rebuild at open, WAL torn-tail recovery, compaction removing a compacted
//! input's deletion-vector file) attacked from the public API and the data directory.
//!
//! Every test states what should happen; a failing test is a finding.

use crate::breaker_session12::{kv_batch, kv_keys, kv_read, kv_schema};
use crate::breaker_session13::records;
use crate::breaker_slices::copy_dir;
use arrow::array::{ArrayRef, AsArray, Int32Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::vfs::FaultFs;
use gritdb::{Engine, EngineConfig, Error, ScanOptions, StorageError, Table, WalSync};
use gritdb_memctl::Reservation;
use gritdb_tests::{edit_manifest, mix};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

pub(crate) fn cfg(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(5))
}

pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned())).unwrap_or_else(|| "<non-string panic>".into())
}

/// `Engine::open`, with a panic caught: `Err(text)`.
pub(crate) fn try_open(dir: &Path, config: EngineConfig) -> Result<gritdb::Result<Engine>, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Engine::open(dir, config))).map_err(|p| panic_text(&*p))
}

/// Reads the kv table, with a panic or error as text.
pub(crate) fn try_read(t: &Table) -> Result<BTreeMap<i64, i64>, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<BTreeMap<i64, i64>, String> {
        let mut out = BTreeMap::new();
        for b in t.scan(ScanOptions::default()).map_err(|e| format!("scan: {e}"))? {
            let b = b.map_err(|e| format!("batch: {e}"))?;
            let k = b.column(0).as_primitive::<Int64Type>();
            let v = b.column(1).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                if out.insert(k.value(i), v.value(i)).is_some() {
                    return Err(format!("key {} twice", k.value(i)));
                }
            }
        }
        Ok(out)
    }))
    .map_err(|p| format!("panic: {}", panic_text(&*p)))?
}

fn table_dir(dir: &Path) -> PathBuf {
    let mut ds: Vec<PathBuf> = std::fs::read_dir(dir.join("tables")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    ds.sort();
    assert_eq!(ds.len(), 1, "one table directory: {ds:?}");
    ds.pop().unwrap()
}

fn data_files(tdir: &Path) -> Vec<PathBuf> {
    let mut fs: Vec<PathBuf> = std::fs::read_dir(tdir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "parquet")).collect();
    fs.sort();
    fs
}

/// Every string value of a `"name"` or `"dv"` field of a manifest (file names; also the
/// schema's field names, which never clash with a file name).
fn manifest_names(tdir: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(tdir.join("manifest.json")).unwrap();
    let mut out = BTreeSet::new();
    for key in ["\"name\"", "\"dv\""] {
        let mut rest = text.as_str();
        while let Some(i) = rest.find(key) {
            rest = &rest[i + key.len()..];
            let r = rest.trim_start().strip_prefix(':').unwrap_or("").trim_start();
            if let Some(r) = r.strip_prefix('"')
                && let Some(end) = r.find('"')
            {
                out.insert(r[..end].to_owned());
            }
        }
    }
    out
}

/// Files in a table directory that its manifest does not name (besides manifest.json).
fn strays(tdir: &Path) -> Vec<String> {
    let named = manifest_names(tdir);
    let mut out: Vec<String> = std::fs::read_dir(tdir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "manifest.json" && !named.contains(n))
        .collect();
    out.sort();
    out
}

// =====================================================================================
// 1. Key index rebuild at open
// =====================================================================================

fn ab_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false), Field::new("b", DataType::Int64, false), Field::new("v", DataType::Int64, false)]))
}

fn ab_batch(rows: &[(i64, i64, i64)]) -> RecordBatch {
    RecordBatch::try_new(
        ab_schema(),
        vec![
            Arc::new(Int64Array::from(rows.iter().map(|r| r.0).collect::<Vec<_>>())) as ArrayRef,
            Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())),
            Arc::new(Int64Array::from(rows.iter().map(|r| r.2).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

fn ab_read(t: &Table) -> BTreeMap<(i64, i64), i64> {
    let mut out = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let (a, bb, v) = (b.column(0).as_primitive::<Int64Type>(), b.column(1).as_primitive::<Int64Type>(), b.column(2).as_primitive::<Int64Type>());
        for i in 0..b.num_rows() {
            assert!(out.insert((a.value(i), bb.value(i)), v.value(i)).is_none(), "key ({}, {}) twice in a scan", a.value(i), bb.value(i));
        }
    }
    out
}

/// A table whose primary key lists its columns in another order than the schema
/// (`["b", "a"]` over `(a, b, v)`), flushed, closed and reopened: the open must rebuild the
/// file key index in key order, so the table reads the same and a re-insert of a stored key
/// is `KeyExists`. Returns what went wrong.
fn key_order_round_trip(rows: &[(i64, i64, i64)]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let model: BTreeMap<(i64, i64), i64> = rows.iter().map(|&(a, b, v)| ((a, b), v)).collect();
    {
        let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
        let t = engine.create_table("t", ab_schema(), &["b", "a"]).unwrap();
        t.insert(&ab_batch(rows)).unwrap();
        t.flush().unwrap();
        // Before the reopen the table knows its keys.
        assert!(matches!(t.insert(&ab_batch(&rows[3..4])), Err(Error::KeyExists { .. })), "before reopen: re-insert must be KeyExists");
        engine.close().unwrap();
    }
    let mut problems = Vec::new();
    match try_open(dir.path(), cfg(64 * MIB)) {
        Err(p) => problems.push(format!("open panicked: {p}")),
        Ok(Err(e)) => problems.push(format!("open failed: {e}")),
        Ok(Ok(engine)) => {
            let t = engine.table("t").unwrap();
            let got = ab_read(&t);
            if got != model {
                problems.push(format!("{} rows read, {} written", got.len(), model.len()));
            }
            match t.insert(&ab_batch(&rows[3..4])) {
                Err(Error::KeyExists { .. }) => {}
                other => problems.push(format!("re-insert of stored key {:?} after reopen: {other:?}", rows[3])),
            }
            let (a, b, _) = rows[5];
            match t.update(&ab_batch(&[(a, b, 99)])) {
                Ok(1) => {}
                other => problems.push(format!("update of stored key ({a}, {b}) after reopen: {other:?}")),
            }
            let got = ab_read(&t);
            if got.len() != model.len() || got.get(&(a, b)) != Some(&99) {
                problems.push(format!("{} rows after the re-insert and update ({} keys exist), ({a}, {b}) -> {:?}", got.len(), model.len(), got.get(&(a, b))));
            }
            drop(t);
            engine.close().unwrap();
        }
    }
    problems
}

/// Primary key `["b", "a"]` over schema `(a, b, v)`, keys ascending in both orders
/// (`a = i, b = i + 1`). Expected: after flush + reopen the table is unchanged and a stored
/// key is found (re-insert is `KeyExists`, update finds it).
#[test]
fn a_key_declared_out_of_schema_order_is_found_after_reopen() {
    let rows: Vec<(i64, i64, i64)> = (0..50).map(|i| (i, i + 1, i)).collect();
    let problems = key_order_round_trip(&rows);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// As above with `a` descending as `b` ascends (`a = 100 - i, b = i`): in key order
/// `(b, a)` the file is sorted; read in schema order `(a, b)` it is not. Expected: the
/// table opens unchanged.
#[test]
fn a_key_declared_out_of_schema_order_opens_when_its_columns_sort_differently() {
    let rows: Vec<(i64, i64, i64)> = (0..50).map(|i| (100 - i, i, i)).collect();
    let problems = key_order_round_trip(&rows);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A closed data directory with one table of keys 0..n (version 1) in one data file.
fn one_file_table(dir: &Path, n: i64) -> BTreeMap<i64, i64> {
    let engine = Engine::open(dir, cfg(64 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let keys: Vec<i64> = (0..n).collect();
    t.insert(&kv_batch(&keys, 1, 10)).unwrap();
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    keys.iter().map(|&k| (k, 1)).collect()
}

/// Opens a damaged copy: returns `None` when the open is a typed error, else what went wrong
/// (a panic, or an open whose table does not read the model).
fn damaged_open(dir: &Path, model: &BTreeMap<i64, i64>) -> Option<String> {
    match try_open(dir, cfg(64 * MIB)) {
        Err(p) => Some(format!("open panicked: {p}")),
        Ok(Err(_)) => None,
        Ok(Ok(engine)) => {
            let t = engine.table("t").unwrap();
            let r = try_read(&t);
            drop(t);
            drop(engine);
            match r {
                Ok(m) if &m == model => None,
                Ok(m) => Some(format!("opened and read {} rows (model {}): a silently wrong table", m.len(), model.len())),
                Err(e) if e.starts_with("panic") => Some(format!("opened, scan {e}")),
                Err(_) => None, // typed error at the scan
            }
        }
    }
}

/// The manifest's row count of the data file off by one either way, or by a lot: the open
/// must be a typed error (`CorruptFile`), never a panic or a table with wrong rows.
#[test]
fn a_manifest_row_count_that_is_wrong_is_a_typed_error() {
    let src = tempfile::tempdir().unwrap();
    let model = one_file_table(src.path(), 5000);
    let mut problems = Vec::new();
    for rows in [4999u64, 5001, 0, 1, 50_000, u64::from(u32::MAX) + 5000, u64::MAX] {
        let d = tempfile::tempdir().unwrap();
        copy_dir(src.path(), d.path());
        let tdir = table_dir(d.path());
        // Sealed again (`edit_manifest`): the check behind the manifest's checksum is the one
        // under test.
        edit_manifest(&tdir.join("manifest.json"), |text| {
            assert!(text.contains("\"rows\": 5000"), "manifest: {text}");
            text.replacen("\"rows\": 5000", &format!("\"rows\": {rows}"), 1)
        });
        match try_open(d.path(), cfg(64 * MIB)) {
            Err(p) => problems.push(format!("rows {rows}: open panicked: {p}")),
            Ok(Ok(_)) => problems.push(format!("rows {rows}: opened")),
            Ok(Err(Error::Storage(StorageError::CorruptFile { .. } | StorageError::CorruptManifest { .. }))) => {}
            Ok(Err(e)) => problems.push(format!("rows {rows}: not CorruptFile: {e:?}")),
        }
    }
    let _ = model;
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The data file truncated (to 0, 3, 7 bytes, half, all but 1 or 8 bytes), its middle
/// zeroed, its middle overwritten with pseudo-random bytes, or its footer magic damaged:
/// the open (or, if it opens, the scan) must be a typed error, never a panic or a table with
/// other rows.
#[test]
fn a_truncated_or_garbled_data_file_is_a_typed_error() {
    let src = tempfile::tempdir().unwrap();
    let model = one_file_table(src.path(), 20_000);
    let file = data_files(&table_dir(src.path())).pop().unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let len = bytes.len();
    let mut variants: Vec<(String, Vec<u8>)> = Vec::new();
    for cut in [0, 3, 7, len / 2, len - 8, len - 1] {
        variants.push((format!("cut to {cut} of {len}"), bytes[..cut].to_vec()));
    }
    let mut z = bytes.clone();
    z[4..len * 3 / 4].fill(0);
    variants.push(("middle zeroed".into(), z));
    for seed in 0..6u64 {
        let mut g = bytes.clone();
        let (from, to) = match seed % 3 {
            0 => (4, len / 2),
            1 => (len / 4, len * 3 / 4),
            _ => (4, len - 200),
        };
        for (i, b) in g[from..to].iter_mut().enumerate() {
            *b = mix(seed << 40 | i as u64) as u8;
        }
        variants.push((format!("garbage {from}..{to} (seed {seed})"), g));
    }
    // A few bytes of garbage at scattered offsets (the file mostly intact).
    for seed in 0..8u64 {
        let mut g = bytes.clone();
        for j in 0..16u64 {
            let at = 4 + (mix(seed * 1000 + j) as usize) % (len - 12);
            g[at] ^= 1 << (j % 8);
        }
        variants.push((format!("16 bit flips (seed {seed})"), g));
    }
    let mut m = bytes.clone();
    m[len - 2] ^= 0xff;
    variants.push(("footer magic damaged".into(), m));
    let mut problems = Vec::new();
    for (what, data) in variants {
        let d = tempfile::tempdir().unwrap();
        copy_dir(src.path(), d.path());
        let f = data_files(&table_dir(d.path())).pop().unwrap();
        std::fs::write(&f, &data).unwrap();
        if let Some(p) = damaged_open(d.path(), &model) {
            problems.push(format!("{what}: {p}"));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The data file replaced by one of the same row count and schema whose keys are not
/// strictly ascending (two keys swapped inside the first 8,192-row batch, across the batch
/// boundary, a duplicate key, all descending): the open must be a typed `CorruptFile`, never
/// a table that opens with an index it cannot search.
#[test]
fn a_data_file_whose_keys_are_not_sorted_is_corrupt() {
    let n = 10_000i64;
    let src = tempfile::tempdir().unwrap();
    let model = one_file_table(src.path(), n);
    let asc: Vec<i64> = (0..n).collect();
    let mut variants: Vec<(&str, Vec<i64>)> = Vec::new();
    let mut v = asc.clone();
    v.swap(10, 11);
    variants.push(("swap inside the first batch", v));
    let mut v = asc.clone();
    v.swap(8191, 8192);
    variants.push(("swap across the batch boundary", v));
    let mut v = asc.clone();
    v[5000] = 4999;
    variants.push(("duplicate key", v));
    let mut v = asc.clone();
    v[9000] = 1;
    variants.push(("a small key late", v));
    variants.push(("descending", asc.iter().rev().copied().collect()));
    let mut problems = Vec::new();
    for (what, keys) in variants {
        let d = tempfile::tempdir().unwrap();
        copy_dir(src.path(), d.path());
        let f = data_files(&table_dir(d.path())).pop().unwrap();
        let batch = kv_batch(&keys, 1, 10);
        let file = std::fs::File::create(&f).unwrap();
        let mut w = gritdb::parquet::arrow::ArrowWriter::try_new(file, kv_schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        match try_open(d.path(), cfg(64 * MIB)) {
            Err(p) => problems.push(format!("{what}: open panicked: {p}")),
            Ok(Err(Error::Storage(StorageError::CorruptFile { .. }))) => {}
            Ok(Err(e)) => problems.push(format!("{what}: open error is not CorruptFile: {e:?}")),
            Ok(Ok(engine)) => {
                let t = engine.table("t").unwrap();
                problems.push(format!("{what}: opened; read {:?} rows", try_read(&t).map(|m| m.len())));
            }
        }
    }
    let _ = model;
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A table of 200,000 keys in several files (five flushes) reopened at tight limits (128 KiB .. 4 MiB): each
/// open is exact or a typed memory error, never a panic or another error; and a failed open
/// leaves the directory intact (it opens exactly at 64 MiB afterwards).
#[test]
fn tight_limits_at_open_are_exact_or_a_memory_error() {
    let src = tempfile::tempdir().unwrap();
    {
        let engine = Engine::open(src.path(), cfg(64 * MIB)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        for f in 0..5i64 {
            let keys: Vec<i64> = (f * 40_000..(f + 1) * 40_000).collect();
            t.insert(&kv_batch(&keys, 1, 0)).unwrap();
            t.flush().unwrap();
        }
        // Compaction merges some of the five flushes' files; more than one stays.
        let files = t.stats().unwrap().files;
        assert!(files >= 2, "{files} data files after five flushes");
        drop(t);
        engine.close().unwrap();
    }
    let mut problems = Vec::new();
    let mut outcomes = Vec::new();
    for limit in [128usize << 10, 160 << 10, 256 << 10, 384 << 10, 512 << 10, MIB, 2 * MIB, 4 * MIB] {
        let d = tempfile::tempdir().unwrap();
        copy_dir(src.path(), d.path());
        match try_open(d.path(), cfg(limit)) {
            Err(p) => problems.push(format!("{limit}: open panicked: {p}")),
            Ok(Err(e)) => {
                let memory = matches!(e, Error::MemoryLimit { .. } | Error::Memory(_) | Error::Storage(StorageError::Memory(_)) | Error::Config(_));
                if !memory {
                    problems.push(format!("{limit}: open error is not a memory error: {e:?}"));
                }
                outcomes.push(format!("{limit}: {e}"));
            }
            Ok(Ok(engine)) => {
                let t = engine.table("t").unwrap();
                match t.row_count() {
                    Ok(200_000) => outcomes.push(format!("{limit}: opened, 200000 rows")),
                    Ok(n) => problems.push(format!("{limit}: opened, {n} rows")),
                    Err(e) => outcomes.push(format!("{limit}: opened, count: {e}")),
                }
                drop(t);
                drop(engine);
            }
        }
        match try_open(d.path(), cfg(64 * MIB)) {
            Ok(Ok(engine)) => {
                let n = engine.table("t").unwrap().row_count().unwrap();
                if n != 200_000 {
                    problems.push(format!("{limit}: reopened at 64 MiB with {n} rows"));
                }
            }
            other => problems.push(format!("{limit}: reopen at 64 MiB: {:?}", other.map(|r| r.map(|_| ())))),
        }
    }
    eprintln!("{outcomes:#?}");
    assert!(problems.is_empty(), "{problems:#?}");
}

// =====================================================================================
// 2. WAL torn-tail recovery
// =====================================================================================

pub(crate) fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut segs: Vec<PathBuf> =
        std::fs::read_dir(dir.join("wal")).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "log")).collect();
    segs.sort();
    segs
}

pub(crate) fn wal_cfg(mode: WalSync) -> EngineConfig {
    cfg(64 * MIB).wal_sync(mode)
}

/// The last WAL segment of `dir` (every older one must be empty), its bytes and its records.
pub(crate) fn last_segment(dir: &Path) -> (PathBuf, Vec<u8>, Vec<(usize, usize)>) {
    let mut segs = segments(dir);
    let seg = segs.pop().unwrap();
    for s in segs {
        assert_eq!(std::fs::metadata(&s).unwrap().len(), 0, "an older non-empty segment {}", s.display());
    }
    let data = std::fs::read(&seg).unwrap();
    let recs = records(&data);
    (seg, data, recs)
}

/// `n` acknowledged upserts of 10 keys each (record i: keys 10i..10i+10, version i + 1),
/// engine dropped without close: the last segment holds exactly `n` records.
fn small_records(dir: &Path, mode: WalSync, n: i64) -> (PathBuf, Vec<u8>, Vec<(usize, usize)>) {
    let engine = Engine::open(dir, wal_cfg(mode)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    for i in 0..n {
        t.upsert(&kv_batch(&(i * 10..i * 10 + 10).collect::<Vec<_>>(), i + 1, 2)).unwrap();
    }
    drop(t);
    drop(engine);
    let (seg, data, recs) = last_segment(dir);
    assert_eq!(recs.len(), n as usize, "records in the segment");
    assert_eq!(recs.last().map(|r| r.0 + r.1), Some(data.len()));
    (seg, data, recs)
}

fn rows_of(records: usize) -> BTreeMap<i64, i64> {
    (0..records as i64 * 10).map(|k| (k, k / 10 + 1)).collect()
}

/// Copies `src`, writes `bytes` as the segment named `name`, opens and reads the table.
fn open_with_segment(src: &Path, name: &std::ffi::OsStr, bytes: &[u8], mode: WalSync) -> Result<Result<BTreeMap<i64, i64>, Error>, String> {
    let d = tempfile::tempdir().unwrap();
    copy_dir(src, d.path());
    std::fs::write(d.path().join("wal").join(name), bytes).unwrap();
    match try_open(d.path(), wal_cfg(mode))? {
        Err(e) => Ok(Err(e)),
        Ok(engine) => {
            let t = engine.table("t").unwrap();
            let r = try_read(&t);
            drop(t);
            drop(engine);
            r.map(Ok)
        }
    }
}

/// The last segment cut at every byte offset (both sync modes; Relaxed every 3rd offset):
/// the open must replay exactly the records wholly before the cut — a cut is what a crash
/// leaves — never fail, panic or replay a partial record.
#[test]
fn a_wal_cut_at_any_offset_replays_exactly_the_whole_records_before_it() {
    let mut problems = Vec::new();
    for (mode, stride) in [(WalSync::PerBatch, 1usize), (WalSync::Relaxed, 3)] {
        let src = tempfile::tempdir().unwrap();
        let (seg, data, recs) = small_records(src.path(), mode, 3);
        let name = seg.file_name().unwrap().to_owned();
        let mut cut = 0;
        while cut <= data.len() {
            let whole = recs.iter().filter(|r| r.0 + r.1 <= cut).count();
            match open_with_segment(src.path(), &name, &data[..cut], mode) {
                Ok(Ok(m)) if m == rows_of(whole) => {}
                Ok(Ok(m)) => problems.push(format!("{mode:?} cut {cut}: {} rows, expected {}", m.len(), whole * 10)),
                Ok(Err(e)) => problems.push(format!("{mode:?} cut {cut}: open failed: {e}")),
                Err(p) => problems.push(format!("{mode:?} cut {cut}: {p}")),
            }
            cut += stride;
        }
    }
    let n = problems.len();
    problems.truncate(12);
    assert!(n == 0, "{n} failing cuts, first: {problems:#?}");
}

/// One byte flipped (xor 0x5a) at every offset of a three-record segment (PerBatch): damage
/// in the first two records has a whole record after it and must be `CorruptWal`; damage
/// in the last record may be cut (the first two records replay) or be `CorruptWal`. Never a
/// panic, never another error, never other rows.
#[test]
fn a_flipped_byte_anywhere_is_corruption_or_a_cut_of_the_last_record() {
    let src = tempfile::tempdir().unwrap();
    let (seg, data, recs) = small_records(src.path(), WalSync::PerBatch, 3);
    let name = seg.file_name().unwrap().to_owned();
    let last = recs[2].0;
    let mut problems = Vec::new();
    for at in 0..data.len() {
        let mut b = data.clone();
        b[at] ^= 0x5a;
        let r = open_with_segment(src.path(), &name, &b, WalSync::PerBatch);
        let ok = match &r {
            Ok(Err(Error::Storage(StorageError::CorruptWal { .. }))) => true,
            Ok(Ok(m)) => at >= last && *m == rows_of(2),
            _ => false,
        };
        if !ok {
            problems.push(format!("flip at {at} (record {}): {:?}", recs.iter().filter(|r| r.0 <= at).count() - 1, r.map(|x| x.map(|m| m.len()))));
        }
    }
    let n = problems.len();
    problems.truncate(12);
    assert!(n == 0, "{n} failing offsets, first: {problems:#?}");
}

/// `WalSync::Relaxed`: records written between two group commits reach the disk in any
/// order, so a crash can leave the last whole-length record with a bad checksum (a page not
/// written) followed by the first part of the next record. Nothing after the last group
/// commit was promised; no whole record follows the damage, so this is a torn tail. Expected:
/// the open replays the first two records. (The checksum branch of `read_segment` accepts only
/// zeros after a damaged last record, unlike the zero-length and past-the-end branches, which
/// look for a whole record after it.)
#[test]
fn relaxed_a_damaged_record_before_a_partial_one_is_a_torn_tail() {
    let src = tempfile::tempdir().unwrap();
    let (seg, data, recs) = small_records(src.path(), WalSync::Relaxed, 4);
    let name = seg.file_name().unwrap().to_owned();
    let mut problems = Vec::new();
    let (c_at, c_len) = recs[2];
    let (d_at, d_len) = recs[3];
    for (what, cut) in [("half of the next record", d_at + d_len / 2), ("the next record's header only", d_at + 8), ("5 bytes of the next header", d_at + 5)] {
        let mut b = data[..cut].to_vec();
        b[c_at + 8 + c_len / 2] ^= 0x10;
        match open_with_segment(src.path(), &name, &b, WalSync::Relaxed) {
            Ok(Ok(m)) if m == rows_of(2) => {}
            other => problems.push(format!("{what}: {:?}", other.map(|x| x.map(|m| m.len())))),
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// More than 16 MiB of records (two segments): damage in the older segment — a cut, a zeroed
/// tail page, a flipped byte — is damage in the middle of the log (acknowledged records
/// follow in the newer segment) and must be `CorruptWal`, never a silent loss of the newer
/// segment's records; a cut of the newest segment is a torn tail.
#[test]
fn damage_in_an_older_segment_is_corrupt_wal() {
    let src = tempfile::tempdir().unwrap();
    let config = || cfg(512 * MIB).table_flush_bytes(256 * MIB);
    let per = 2000i64;
    let mut batches = 0i64;
    {
        let engine = Engine::open(src.path(), config()).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        while segments(src.path()).iter().filter(|s| std::fs::metadata(s).unwrap().len() > 0).count() < 2 {
            t.upsert(&kv_batch(&(batches * per..(batches + 1) * per).collect::<Vec<_>>(), 1, 500)).unwrap();
            batches += 1;
            assert!(batches < 200, "no second segment");
        }
        // A few records more in the new segment.
        for _ in 0..3 {
            t.upsert(&kv_batch(&(batches * per..(batches + 1) * per).collect::<Vec<_>>(), 1, 500)).unwrap();
            batches += 1;
        }
        drop(t);
        drop(engine);
    }
    let segs: Vec<PathBuf> = segments(src.path()).into_iter().filter(|s| std::fs::metadata(s).unwrap().len() > 0).collect();
    assert_eq!(segs.len(), 2);
    let old = std::fs::read(&segs[0]).unwrap();
    let new = std::fs::read(&segs[1]).unwrap();
    let (old_name, new_name) = (segs[0].file_name().unwrap().to_owned(), segs[1].file_name().unwrap().to_owned());
    let big = |(): ()| cfg(512 * MIB).table_flush_bytes(256 * MIB);
    let open = |name: &std::ffi::OsStr, bytes: &[u8]| -> Result<Result<u64, Error>, String> {
        let d = tempfile::tempdir().unwrap();
        copy_dir(src.path(), d.path());
        std::fs::write(d.path().join("wal").join(name), bytes).unwrap();
        match try_open(d.path(), big(()))? {
            Err(e) => Ok(Err(e)),
            Ok(engine) => Ok(Ok(engine.table("t").unwrap().row_count().unwrap())),
        }
    };
    let recs = records(&old);
    let (l_at, l_len) = *recs.last().unwrap();
    let mut problems = Vec::new();
    let mut zeroed = old.clone();
    zeroed[l_at + l_len - 4096..].fill(0);
    let mut flipped = old.clone();
    flipped[l_at + l_len / 2] ^= 1;
    for (what, bytes) in [
        ("older segment cut", old[..l_at + l_len / 2].to_vec()),
        ("older segment's last page zeroed", zeroed),
        ("older segment's last record flipped", flipped),
    ] {
        match open(&old_name, &bytes) {
            Ok(Err(Error::Storage(StorageError::CorruptWal { .. }))) => {}
            other => problems.push(format!("{what}: {other:?}")),
        }
    }
    let nrecs = records(&new);
    let (n_at, n_len) = *nrecs.last().unwrap();
    match open(&new_name, &new[..n_at + n_len / 2]) {
        Ok(Ok(n)) if n == ((batches - 1) * per) as u64 => {}
        other => problems.push(format!("newest segment cut: {other:?} (expected {} rows)", (batches - 1) * per)),
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

// =====================================================================================
// 3. Deletes of >= 1,024 keys (WAL record on the pool)
// =====================================================================================

/// Each WAL segment's length in bytes (0 for one removed between the listing and the read).
fn segment_lengths(dir: &Path) -> BTreeMap<PathBuf, u64> {
    segments(dir).into_iter().map(|s| (s.clone(), std::fs::metadata(&s).map_or(0, |m| m.len()))).collect()
}

/// Panics when a segment of `now` is new or longer than in `before`. A flush's covered
/// segment may be unlinked on another thread meanwhile (`Wal::forget_covered`), so the
/// lengths' sum can shrink with nothing logged (a full-suite run saw 148,114 → 37,609 bytes);
/// a segment removed is no record written.
fn assert_nothing_logged(before: &BTreeMap<PathBuf, u64>, now: &BTreeMap<PathBuf, u64>, what: &str) {
    for (seg, &len) in now {
        assert!(
            before.get(seg).is_some_and(|&b| len == b || len == 0),
            "{what} wrote to the WAL ({}: {len} bytes, before {:?})",
            seg.display(),
            before.get(seg)
        );
    }
}

/// A table: keys 0..3000 in a file, 3000..4000 in the active delta (version 1).
fn file_and_delta(t: &Table) -> BTreeMap<i64, i64> {
    t.insert(&kv_batch(&(0..3000).collect::<Vec<_>>(), 1, 10)).unwrap();
    t.flush().unwrap();
    t.insert(&kv_batch(&(3000..4000).collect::<Vec<_>>(), 1, 10)).unwrap();
    (0..4000).map(|k| (k, 1)).collect()
}

/// Crash (drop without close), reopen, read.
fn crash_reopen_read(dir: &Path, engine: Engine, t: Table) -> (Engine, Table, BTreeMap<i64, i64>) {
    drop(t);
    drop(engine);
    let engine = Engine::open(dir, cfg(64 * MIB)).unwrap();
    let t = engine.table("t").unwrap();
    let m = kv_read(&t);
    (engine, t, m)
}

/// A delete of 2,000 keys none of which exists returns 0, writes no WAL record, and the
/// table is unchanged before and after a crash and reopen.
#[test]
fn a_big_delete_of_absent_keys_returns_zero_and_logs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let model = file_and_delta(&t);
    let before = segment_lengths(dir.path());
    let absent: Vec<i64> = (10_000..12_000).collect();
    assert_eq!(t.delete(&kv_keys(&absent)).unwrap(), 0);
    // Absent and repeated.
    let rep: Vec<i64> = (0..2000).map(|i| 20_000 + i % 7).collect();
    assert_eq!(t.delete(&kv_keys(&rep)).unwrap(), 0);
    assert_nothing_logged(&before, &segment_lengths(dir.path()), "a delete that deletes nothing");
    assert_eq!(kv_read(&t), model);
    let (_e, _t, m) = crash_reopen_read(dir.path(), engine, t);
    assert_eq!(m, model);
}

/// A delete of 3,700 keys — file keys each twice (interleaved), delta keys, absent keys —
/// returns the distinct existing keys (1,700) and deletes exactly those, before and after
/// a crash + reopen, and after close + reopen.
#[test]
fn a_big_delete_with_duplicates_and_absent_keys_deletes_each_once() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = file_and_delta(&t);
    let mut keys = Vec::new();
    for k in 0..1500i64 {
        keys.push(k);
        keys.push(1499 - k);
    }
    keys.extend(3000..3200);
    keys.extend(10_000..10_500);
    assert_eq!(t.delete(&kv_keys(&keys)).unwrap(), 1700);
    for k in &keys {
        model.remove(k);
    }
    assert_eq!(kv_read(&t), model);
    // The same delete again deletes nothing.
    assert_eq!(t.delete(&kv_keys(&keys)).unwrap(), 0);
    let (engine, t, m) = crash_reopen_read(dir.path(), engine, t);
    assert_eq!(m, model, "after crash + reopen");
    // And still correct after a flush and a second crash.
    t.flush().unwrap();
    let (engine, t, m) = crash_reopen_read(dir.path(), engine, t);
    assert_eq!(m, model, "after flush + crash + reopen");
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model, "after close + reopen");
}

/// Big deletes that must be refused whole — a null key at the end, a key column of the
/// wrong type or name, an extra column — apply nothing, log nothing, and the table is
/// unchanged after a crash + reopen.
#[test]
fn a_refused_big_delete_applies_and_logs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let model = file_and_delta(&t);
    let before = segment_lengths(dir.path());
    let n = 2000;
    let nullable = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
    let with_null = RecordBatch::try_new(
        Arc::clone(&nullable),
        vec![Arc::new(Int64Array::from((0..n).map(|i| if i == n - 1 { None } else { Some(i) }).collect::<Vec<_>>())) as ArrayRef],
    )
    .unwrap();
    let no_null_nullable = RecordBatch::try_new(nullable, vec![Arc::new(Int64Array::from((0..n).map(Some).collect::<Vec<_>>())) as ArrayRef]).unwrap();
    let int32 = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int32, false)])),
        vec![Arc::new(Int32Array::from((0..n as i32).collect::<Vec<_>>())) as ArrayRef],
    )
    .unwrap();
    let renamed = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("key", DataType::Int64, false)])),
        vec![Arc::new(Int64Array::from((0..n).collect::<Vec<_>>())) as ArrayRef],
    )
    .unwrap();
    let extra = RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, false)])),
        vec![Arc::new(Int64Array::from((0..n).collect::<Vec<_>>())) as ArrayRef, Arc::new(Int64Array::from((0..n).collect::<Vec<_>>()))],
    )
    .unwrap();
    let mut problems = Vec::new();
    for (what, b) in [("null key", &with_null), ("Int32 key", &int32), ("renamed key", &renamed), ("extra column", &extra)] {
        match t.delete(b) {
            Err(Error::Input(_)) => {}
            other => problems.push(format!("{what}: {other:?}")),
        }
    }
    assert_eq!(kv_read(&t), model, "a refused delete applied something");
    assert_nothing_logged(&before, &segment_lengths(dir.path()), "a refused delete");
    // A nullable key column without nulls: accepted or refused whole, and consistent
    // after reopen.
    let res = t.delete(&no_null_nullable);
    let mut model = model;
    if let Ok(k) = &res {
        assert_eq!(*k, 2000);
        for i in 0..2000 {
            model.remove(&i);
        }
    }
    assert_eq!(kv_read(&t), model, "nullable-typed delete: {res:?}");
    let (_e, _t, m) = crash_reopen_read(dir.path(), engine, t);
    assert_eq!(m, model, "after crash + reopen");
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Six threads delete overlapping 1,500-key batches drawn from 0..30,000 (keys in files and
/// deltas, background flushes running), while a seventh flushes: each key is deleted by
/// exactly one acknowledged call, so the counts returned sum to the keys deleted, and the
/// table is the complement before and after a crash + reopen.
#[test]
fn concurrent_big_deleters_count_each_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = || cfg(64 * MIB).table_flush_bytes(512 << 10).flush_age(Duration::from_millis(20));
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let n = 30_000i64;
    for c in 0..6 {
        t.insert(&kv_batch(&(c * 5000..(c + 1) * 5000).collect::<Vec<_>>(), 1, 20)).unwrap();
        if c % 2 == 0 {
            t.flush().unwrap();
        }
    }
    let stop = AtomicBool::new(false);
    let (total, deleted) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..6u64)
            .map(|w| {
                let t = t.clone();
                s.spawn(move || {
                    let mut total = 0usize;
                    let mut asked = BTreeSet::new();
                    for i in 0..10u64 {
                        let keys: Vec<i64> = (0..1500u64).map(|j| (mix(w << 32 | i << 16 | j) % n as u64) as i64).collect();
                        total += t.delete(&kv_keys(&keys)).unwrap();
                        asked.extend(keys);
                    }
                    (total, asked)
                })
            })
            .collect();
        let flusher = s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                t.flush().unwrap();
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        let mut total = 0;
        let mut deleted = BTreeSet::new();
        for h in hs {
            let (n, a) = h.join().unwrap();
            total += n;
            deleted.extend(a);
        }
        stop.store(true, Ordering::Release);
        flusher.join().unwrap();
        (total, deleted)
    });
    let model: BTreeMap<i64, i64> = (0..n).filter(|k| !deleted.contains(k)).map(|k| (k, 1)).collect();
    assert_eq!(total, deleted.len(), "deleted counts sum to {total}, {} distinct keys deleted", deleted.len());
    assert_eq!(kv_read(&t), model);
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model, "after crash + reopen");
}

/// Four threads each delete disjoint 1,200-key batches of their own while `close` runs:
/// each call is acknowledged (its keys are gone after reopen) or refused (`Closed`; its
/// keys all still there). Nothing refused is applied, nothing acknowledged lost.
#[test]
fn big_deletes_racing_close_are_all_or_nothing() {
    let mut problems = Vec::new();
    for round in 0..4u64 {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let per = 1200i64;
        let batches = 25i64;
        let n = 4 * batches * per;
        for c in 0..4 {
            let keys: Vec<i64> = (c * n / 4..(c + 1) * n / 4).collect();
            t.insert(&kv_batch(&keys, 1, 0)).unwrap();
            if c < 2 {
                t.flush().unwrap();
            }
        }
        let hs: Vec<_> = (0..4i64)
            .map(|w| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut acked = Vec::new();
                    let mut refused = Vec::new();
                    let mut other = Vec::new();
                    for b in 0..batches {
                        let from = (w * batches + b) * per;
                        match t.delete(&kv_keys(&(from..from + per).collect::<Vec<_>>())) {
                            Ok(k) if k == per as usize => acked.push(from),
                            Ok(k) => other.push(format!("batch {from}: {k} deleted")),
                            Err(Error::Closed(_)) => refused.push(from),
                            Err(e) => other.push(format!("batch {from}: {e}")),
                        }
                    }
                    (acked, refused, other)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(5 + round * 7));
        drop(t);
        if let Err(e) = engine.close() {
            problems.push(format!("round {round}: close: {e}"));
        }
        let (mut acked, mut refused) = (Vec::new(), Vec::new());
        for h in hs {
            let (a, r, o) = h.join().unwrap();
            acked.extend(a);
            refused.extend(r);
            problems.extend(o.into_iter().map(|o| format!("round {round}: {o}")));
        }
        let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
        let m = kv_read(&engine.table("t").unwrap());
        for from in &acked {
            if (*from..from + per).any(|k| m.contains_key(&k)) {
                problems.push(format!("round {round}: acknowledged delete of {from}.. lost"));
            }
        }
        for from in &refused {
            if (*from..from + per).any(|k| !m.contains_key(&k)) {
                problems.push(format!("round {round}: refused delete of {from}.. applied"));
            }
        }
        eprintln!("round {round}: {} acknowledged, {} refused", acked.len(), refused.len());
        engine.close().unwrap();
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Big deletes racing `drop_table`: each returns a count or `TableNotFound` (no panic, no
/// other error); afterwards the engine holds no bytes of the table, a table of the same name
/// is created empty, and the engine reopens with that empty table only.
#[test]
fn big_deletes_racing_drop_table() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    let baseline: Vec<(Category, usize)> =
        Category::ALL.iter().filter(|c| **c != Category::FreeChunks).map(|c| (*c, engine.memory().category_bytes(*c))).collect();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv_batch(&(0..40_000).collect::<Vec<_>>(), 1, 10)).unwrap();
    t.flush().unwrap();
    t.insert(&kv_batch(&(40_000..60_000).collect::<Vec<_>>(), 1, 10)).unwrap();
    let mut problems = Vec::new();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..3i64)
            .map(|w| {
                let t = t.clone();
                s.spawn(move || {
                    let mut errs = Vec::new();
                    for b in 0..20i64 {
                        let from = w * 20_000 + b * 1000;
                        match t.delete(&kv_keys(&(from..from + 1000).chain(from + 100_000..from + 100_100).collect::<Vec<_>>())) {
                            Ok(_) | Err(Error::TableNotFound { .. }) => {}
                            Err(e) => errs.push(format!("{from}: {e}")),
                        }
                    }
                    errs
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(10));
        engine.drop_table("t").unwrap();
        for h in hs {
            problems.extend(h.join().unwrap());
        }
    });
    drop(t);
    let after: Vec<(Category, usize)> =
        Category::ALL.iter().filter(|c| **c != Category::FreeChunks).map(|c| (*c, engine.memory().category_bytes(*c))).collect();
    if after != baseline {
        problems.push(format!("categories after the drop {after:?}, baseline {baseline:?}"));
    }
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    assert_eq!(t.row_count().unwrap(), 0);
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    assert_eq!(engine.table_names(), vec!["t".to_owned()]);
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 0);
    assert!(problems.is_empty(), "{problems:#?}");
}

// =====================================================================================
// 4. Flush in parts, held between parts (a stalled part file write)
// =====================================================================================

/// The table of `flush_parts.rs`: keys 0..2000 in a file (version 1), then an active delta
/// upserting 1000..4000 (version 2, 400-byte strings) and deleting 0..500.
fn file_then_delta(t: &Table) -> BTreeMap<i64, i64> {
    t.insert(&kv_batch(&(0..2000).collect::<Vec<_>>(), 1, 100)).unwrap();
    t.flush().unwrap();
    t.upsert(&kv_batch(&(1000..4000).collect::<Vec<_>>(), 2, 400)).unwrap();
    t.delete(&kv_keys(&(0..500).collect::<Vec<_>>())).unwrap();
    (500..1000).map(|k| (k, 1)).chain((1000..4000).map(|k| (k, 2))).collect()
}

const PARTS_LIMIT: usize = 32 * MIB;

fn parts_cfg(fs: &FaultFs) -> EngineConfig {
    cfg(PARTS_LIMIT).backpressure_timeout(Duration::from_secs(3)).vfs(Arc::new(fs.clone()))
}

/// An engine whose table `t` is being flushed in parts on another thread, held inside the
/// second part's data-file write (a stalled disk). The reservation that forced the parts is
/// released once the flush is held. Returns the engine, the table, the model, and the
/// flush's thread.
struct HeldFlush {
    engine: Engine,
    t: Table,
    model: BTreeMap<i64, i64>,
    fs: FaultFs,
    flush: std::thread::JoinHandle<gritdb::Result<u64>>,
}

fn held_flush(dir: &Path) -> HeldFlush {
    let fs = FaultFs::new();
    let engine = Engine::open(dir, parts_cfg(&fs)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let model = file_then_delta(&t);
    let tdir = table_dir(dir);
    let files: Vec<PathBuf> = data_files(&tdir);
    assert_eq!(files.len(), 1);
    // The next two file ids: the flush's first and second part.
    let first: u32 = files[0].file_stem().unwrap().to_str().unwrap()[1..].parse().unwrap();
    let second = format!("f{:06}.parquet", first + 2);
    let ctl = engine.memory();
    engine.release_cached_memory();
    let free = t.stats().unwrap().active_delta_bytes * 3 / 4;
    let mut hold = Reservation::new(ctl, Category::Metadata, None);
    hold.try_grow(PARTS_LIMIT - ctl.used() - free).unwrap();
    fs.stall_paths(&second);
    let t2 = t.clone();
    let flush = std::thread::spawn(move || t2.flush());
    let start = Instant::now();
    while !fs.is_stalled() {
        assert!(start.elapsed() < Duration::from_secs(20), "the flush never reached its second part ({second})");
        assert!(!flush.is_finished(), "the flush ended before its second part: {:?}", flush.join());
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(hold);
    HeldFlush { engine, t, model, fs, flush }
}

/// While a flush is held between its parts (first part committed, second part's file being
/// written): scans read exactly the model; an image of the directory (a crash at that
/// moment) opens exactly the model, with a stored key found by insert; after the flush goes
/// on, the table is the model, and again after close + reopen, with no stray files.
#[test]
fn a_flush_held_between_parts_is_consistent_and_its_crash_image_replays() {
    let dir = tempfile::tempdir().unwrap();
    let h = held_flush(dir.path());
    for _ in 0..3 {
        assert_eq!(kv_read(&h.t), h.model, "scan while held between parts");
    }
    let image = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), image.path());
    let _ = std::fs::remove_file(image.path().join("LOCK"));
    h.fs.heal();
    let rows = h.flush.join().unwrap().unwrap();
    assert_eq!(rows, 3000);
    assert_eq!(kv_read(&h.t), h.model);
    let HeldFlush { engine, t, model, .. } = h;
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(kv_read(&t), model, "after close + reopen");
    assert!(strays(&table_dir(dir.path())).is_empty(), "stray files {:?}", strays(&table_dir(dir.path())));
    drop(t);
    engine.close().unwrap();
    // The crash image.
    let engine = match try_open(image.path(), cfg(PARTS_LIMIT)) {
        Ok(Ok(e)) => e,
        other => panic!("crash image between parts: {:?}", other.map(|r| r.map(|_| ()))),
    };
    let t = engine.table("t").unwrap();
    assert_eq!(kv_read(&t), model, "crash image between parts");
    assert!(matches!(t.insert(&kv_batch(&[3999], 9, 1)), Err(Error::KeyExists { .. })), "a stored key is found in the image");
    t.flush().unwrap();
    assert_eq!(kv_read(&t), model, "crash image flushed");
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(image.path(), cfg(PARTS_LIMIT)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model, "crash image flushed and reopened");
}

/// Upserts, updates, inserts and deletes (big and small) of keys of both parts' classes
/// while the flush is held between parts: each is applied as acknowledged; after the flush
/// the table is the model, after a crash + reopen too, and after close + reopen.
#[test]
fn writes_while_a_flush_is_held_between_parts_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let h = held_flush(dir.path());
    let HeldFlush { engine, t, mut model, fs, flush } = h;
    // Upsert half the delta's keys (both classes), a big delete across file, delta and
    // absent keys, an update, inserts of new and of deleted keys.
    t.upsert(&kv_batch(&(1500..3500).step_by(2).collect::<Vec<_>>(), 3, 50)).unwrap();
    model.extend((1500..3500).step_by(2).map(|k| (k, 3)));
    let del: Vec<i64> = (600..1400).chain(3000..3400).chain(50_000..50_200).collect();
    let n = t.delete(&kv_keys(&del)).unwrap();
    let expect = del.iter().filter(|k| model.contains_key(k)).count();
    assert_eq!(n, expect, "big delete count while held");
    for k in &del {
        model.remove(k);
    }
    t.update(&kv_batch(&(3600..3700).collect::<Vec<_>>(), 4, 10)).unwrap();
    model.extend((3600..3700).map(|k| (k, 4)));
    t.insert(&kv_batch(&(0..100).chain(4000..4100).collect::<Vec<_>>(), 5, 10)).unwrap();
    model.extend((0..100).chain(4000..4100).map(|k| (k, 5)));
    assert!(matches!(t.insert(&kv_batch(&[3999], 6, 1)), Err(Error::KeyExists { .. })));
    assert_eq!(kv_read(&t), model, "while held");
    fs.heal();
    flush.join().unwrap().unwrap();
    assert_eq!(kv_read(&t), model, "after the held flush");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(kv_read(&t), model, "after crash + reopen");
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model, "after close + reopen");
}

/// `drop_table` while a flush is held between parts: it returns (within about
/// `backpressure_timeout`), the flush then ends with an error or `Ok` but writes nothing
/// back, every category of the engine returns to its baseline, and the engine reopens
/// without the table; a new table of that name is empty.
#[test]
fn drop_table_while_a_flush_is_held_between_parts() {
    let dir = tempfile::tempdir().unwrap();
    let h = held_flush(dir.path());
    let HeldFlush { engine, t, fs, flush, .. } = h;
    let start = Instant::now();
    engine.drop_table("t").unwrap();
    let took = start.elapsed();
    fs.heal();
    let res = flush.join().unwrap();
    drop(t);
    let mut problems = Vec::new();
    if took > Duration::from_secs(6) {
        problems.push(format!("drop_table took {took:?}"));
    }
    let wait = Instant::now();
    let nonzero = loop {
        let nz: Vec<(Category, usize)> = Category::ALL
            .iter()
            .filter(|c| !matches!(c, Category::FreeChunks | Category::Metadata))
            .map(|c| (*c, engine.memory().category_bytes(*c)))
            .filter(|c| c.1 > 0)
            .collect();
        if nz.is_empty() || wait.elapsed() > Duration::from_secs(3) {
            break nz;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if !nonzero.is_empty() {
        problems.push(format!("bytes left after the drop: {nonzero:?} (flush: {res:?})"));
    }
    let tables: Vec<PathBuf> = std::fs::read_dir(dir.path().join("tables")).unwrap().map(|e| e.unwrap().path()).collect();
    if !tables.is_empty() {
        problems.push(format!("table directories after the drop: {tables:?}"));
    }
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    assert_eq!(t.row_count().unwrap(), 0);
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 0);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// `close` while a flush is held between parts (the disk comes back 300 ms later): close
/// returns `Ok`, the flush returns, and the reopened table is the model.
#[test]
fn close_while_a_flush_is_held_between_parts() {
    let dir = tempfile::tempdir().unwrap();
    let h = held_flush(dir.path());
    let HeldFlush { engine, t, model, fs, flush } = h;
    drop(t);
    let healer = {
        let fs = fs.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            fs.heal();
        })
    };
    let closed = engine.close();
    healer.join().unwrap();
    let res = flush.join().unwrap();
    assert!(closed.is_ok(), "close: {closed:?} (flush: {res:?})");
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(kv_read(&t), model);
    assert_eq!(t.stats().unwrap().active_delta_bytes, 0, "close flushed everything");
}

/// `set_memory_limit` down to 12 MiB while a flush is held between parts: it returns (`Ok`,
/// or `MemoryLimit` within about `backpressure_timeout`), never hangs; the table is the
/// model before and after the flush goes on, and after close + reopen.
#[test]
fn set_memory_limit_while_a_flush_is_held_between_parts() {
    let dir = tempfile::tempdir().unwrap();
    let h = held_flush(dir.path());
    let HeldFlush { engine, t, model, fs, flush } = h;
    let start = Instant::now();
    let res = engine.set_memory_limit(12 * MIB);
    let took = start.elapsed();
    assert!(took < Duration::from_secs(8), "set_memory_limit took {took:?} ({res:?})");
    assert!(res.is_ok() || matches!(res, Err(Error::MemoryLimit { .. })), "{res:?}");
    assert_eq!(kv_read(&t), model, "after the lowering ({res:?})");
    fs.heal();
    flush.join().unwrap().unwrap();
    assert_eq!(kv_read(&t), model);
    assert!(engine.memory().used() <= engine.memory().limit().max(PARTS_LIMIT));
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(12 * MIB)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model);
}

/// The engine dropped (a crash as far as the files go) while a flush on another thread is
/// held between parts. The drop releases the directory's lock; the flush is still running
/// and will write its second part and the manifest when the disk comes back. Expected:
/// either the drop waits for that flush, or a new engine cannot open the directory while the
/// old engine's flush can still write into it (no two writers of one directory). What
/// happens: see the assertion message (the new engine opens, and the old flush then rewrites
/// the manifest under it).
#[test]
fn a_dropped_engine_does_not_write_into_a_reopened_directory() {
    let dir = tempfile::tempdir().unwrap();
    let h = held_flush(dir.path());
    let HeldFlush { engine, t, model, fs, flush } = h;
    drop(t);
    let healer = {
        let fs = fs.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            fs.heal();
        })
    };
    drop(engine);
    let dropped_while_held = fs.is_stalled();
    let tdir = table_dir(dir.path());
    let reopened = Engine::open(dir.path(), cfg(PARTS_LIMIT));
    let opened_while_held = fs.is_stalled() && reopened.is_ok();
    let manifest_at_open = std::fs::read(tdir.join("manifest.json")).unwrap();
    healer.join().unwrap();
    let res = flush.join().unwrap();
    let manifest_after = std::fs::read(tdir.join("manifest.json")).unwrap();
    let rewritten = manifest_at_open != manifest_after;
    let engine = match reopened {
        Ok(e) => e,
        Err(_) => Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap(),
    };
    let t = engine.table("t").unwrap();
    let live = kv_read(&t);
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    let again = kv_read(&engine.table("t").unwrap());
    assert!(
        !(opened_while_held && rewritten) && live == model && again == model,
        "engine drop returned while its flush was held: {dropped_while_held}; a new engine opened the directory while the old \
         flush was still held: {opened_while_held}; the old flush (result {res:?}) then rewrote manifest.json under the new \
         engine: {rewritten}; new engine read the model: {}; after its close + reopen: {}",
        live == model,
        again == model
    );
}

// =====================================================================================
// 5. Compaction removes what it replaces
// =====================================================================================

/// Twelve rounds of upserts and deletes of random keys with a flush each (compactions of
/// files past 10% deleted and of small files run after flushes): at every round the table
/// directory holds only `manifest.json` and the files its manifest names (data files and
/// deletion vectors), and the table reads the model; after close and after a crash +
/// reopen too.
#[test]
fn churn_leaves_only_files_the_manifest_names() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let mut model = BTreeMap::new();
    let mut problems = Vec::new();
    for round in 0..12u64 {
        let keys: BTreeSet<i64> = (0..3000u64).map(|j| (mix(round << 20 | j) % 10_000) as i64).collect();
        let keys: Vec<i64> = keys.into_iter().collect();
        t.upsert(&kv_batch(&keys, round as i64, 30)).unwrap();
        model.extend(keys.iter().map(|&k| (k, round as i64)));
        let gone: Vec<i64> = (0..(if round % 3 == 0 { 1500u64 } else { 400 })).map(|j| (mix(round << 40 | j) % 10_000) as i64).collect();
        t.delete(&kv_keys(&gone)).unwrap();
        for k in &gone {
            model.remove(k);
        }
        t.flush().unwrap();
        let tdir = table_dir(dir.path());
        let s = strays(&tdir);
        if !s.is_empty() {
            problems.push(format!("round {round}: files the manifest does not name: {s:?}"));
        }
        assert_eq!(kv_read(&t), model, "round {round}");
    }
    drop(t);
    engine.close().unwrap();
    let s = strays(&table_dir(dir.path()));
    if !s.is_empty() {
        problems.push(format!("after close: {s:?}"));
    }
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model);
    assert!(problems.is_empty(), "{problems:#?}");
}

// =====================================================================================
// 6. More: parts of a delta of few big rows; sliced big deletes of string keys
// =====================================================================================

/// A delta of one 1.2 MB row (plus a file of small rows) whose conversion cannot fit beside
/// it (3/4 of its bytes free): every class that holds the row is refused down to 1/256 of the
/// keys, so the flush fails with a typed `MemoryLimit`. The empty classes in between must
/// not commit anything (no file, no manifest naming a zero-row file), the table must still
/// read the model, and once memory is back the flush succeeds and the table reopens
/// exactly.
#[test]
fn a_delta_whose_one_row_cannot_convert_fails_typed_and_commits_nothing_empty() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv_batch(&(0..100).collect::<Vec<_>>(), 1, 10)).unwrap();
    t.flush().unwrap();
    t.upsert(&kv_batch(&[50], 2, 1_200_000)).unwrap();
    let mut model: BTreeMap<i64, i64> = (0..100).map(|k| (k, 1)).collect();
    model.insert(50, 2);
    let before = t.stats().unwrap();
    let version_before = before.manifest_version;
    let ctl = engine.memory();
    engine.release_cached_memory();
    let free = before.active_delta_bytes * 3 / 4;
    let mut hold = Reservation::new(ctl, Category::Metadata, None);
    hold.try_grow(PARTS_LIMIT - ctl.used() - free).unwrap();
    let res = t.flush();
    let after = t.stats().unwrap();
    let mut problems = Vec::new();
    if !matches!(res, Err(Error::MemoryLimit { .. })) {
        problems.push(format!("flush: {res:?} (expected MemoryLimit)"));
    }
    if after.files != before.files {
        problems.push(format!("{} files after the refused flush, {} before", after.files, before.files));
    }
    if after.manifest_version != version_before {
        problems.push(format!("manifest version {} -> {}: empty parts committed", version_before, after.manifest_version));
    }
    drop(hold);
    assert_eq!(kv_read(&t), model);
    t.flush().unwrap();
    assert_eq!(kv_read(&t), model);
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(PARTS_LIMIT)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Big deletes (>= 1,024 keys, the pool path) whose key column is a slice of a larger
/// string array (offsets not starting at 0), for `Utf8` and `Utf8View` keys: the rows deleted
/// are exactly the slice's, and after a crash + reopen still exactly those.
#[test]
fn a_sliced_big_delete_of_string_keys_replays_exactly() {
    for ty in [DataType::Utf8, DataType::Utf8View] {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", ty.clone(), false), Field::new("v", DataType::Int64, false)]));
        let key_schema = Arc::new(Schema::new(vec![Field::new("k", ty.clone(), false)]));
        let strs = |r: std::ops::Range<i64>| -> ArrayRef {
            let v: Vec<String> = r.map(|i| format!("key-{i:08}-{}", "p".repeat((i % 23) as usize))).collect();
            let a = arrow::array::StringArray::from(v);
            if ty == DataType::Utf8 { Arc::new(a) } else { arrow::compute::cast(&a, &DataType::Utf8View).unwrap() }
        };
        let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
        let t = match engine.create_table("t", Arc::clone(&schema), &["k"]) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{ty}: key type refused: {e}");
                continue;
            }
        };
        let all = RecordBatch::try_new(Arc::clone(&schema), vec![strs(0..6000), Arc::new(Int64Array::from((0..6000).collect::<Vec<_>>()))]).unwrap();
        t.insert(&all.slice(0, 3000)).unwrap();
        t.flush().unwrap();
        t.insert(&all.slice(3000, 3000)).unwrap();
        let keys = RecordBatch::try_new(Arc::clone(&key_schema), vec![strs(0..8000)]).unwrap();
        // Keys 1500..4500: half in the file, half in the delta.
        let n = t.delete(&keys.slice(1500, 3000)).unwrap();
        assert_eq!(n, 3000, "{ty}");
        let count = |t: &Table| -> Vec<i64> {
            let mut v = Vec::new();
            for b in t.scan(ScanOptions::default()).unwrap() {
                let b = b.unwrap();
                v.extend(b.column(1).as_primitive::<Int64Type>().values().iter().copied());
            }
            v.sort_unstable();
            v
        };
        let want: Vec<i64> = (0..1500).chain(4500..6000).collect();
        assert_eq!(count(&t), want, "{ty}: before reopen");
        drop(t);
        drop(engine);
        let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
        assert_eq!(count(&engine.table("t").unwrap()), want, "{ty}: after crash + reopen");
    }
}

// =====================================================================================
// 7. A key declared out of schema order, through every operation
// =====================================================================================

fn sa_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false), Field::new("s", DataType::Utf8, false), Field::new("v", DataType::Int64, false)]))
}

fn sa_batch(rows: &[((String, i64), i64)]) -> RecordBatch {
    RecordBatch::try_new(
        sa_schema(),
        vec![
            Arc::new(Int64Array::from(rows.iter().map(|r| r.0.1).collect::<Vec<_>>())) as ArrayRef,
            Arc::new(arrow::array::StringArray::from(rows.iter().map(|r| r.0.0.as_str()).collect::<Vec<_>>())),
            Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

/// The key batch of a delete: the key columns in key order (`s`, then `a`).
fn sa_keys(keys: &[(String, i64)]) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, false), Field::new("a", DataType::Int64, false)]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(arrow::array::StringArray::from(keys.iter().map(|k| k.0.as_str()).collect::<Vec<_>>())) as ArrayRef,
            Arc::new(Int64Array::from(keys.iter().map(|k| k.1).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

fn sa_read(t: &Table) -> BTreeMap<(String, i64), i64> {
    let mut out = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let (a, s, v) = (b.column(0).as_primitive::<Int64Type>(), b.column(1).as_string::<i32>(), b.column(2).as_primitive::<Int64Type>());
        for i in 0..b.num_rows() {
            let k = (s.value(i).to_owned(), a.value(i));
            assert!(out.insert(k.clone(), v.value(i)).is_none(), "key {k:?} twice in a scan");
        }
    }
    out
}

/// Primary key `["s", "a"]` (a string, then an integer) over schema `(a, s, v)`, with `a`
/// descending where `s` ascends: a seeded mix of inserts, upserts, updates and deletes
/// (each returning what the model says it must: `KeyExists` for a stored key, the rows
/// updated or deleted), flushes after every round (so compaction merges files) and a reopen
/// every fourth round. Expected: the table always reads as the model.
#[test]
fn a_key_out_of_schema_order_survives_writes_flushes_compaction_and_reopens() {
    use rand::{Rng, SeedableRng};
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut model: BTreeMap<(String, i64), i64> = BTreeMap::new();
    let key = |i: i64| (format!("k{:03}", i % 97), 1_000 - i);
    let mut engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    let mut t = engine.create_table("t", sa_schema(), &["s", "a"]).unwrap();
    for round in 0..16 {
        for _ in 0..6 {
            let picks: BTreeSet<i64> = (0..40).map(|_| rng.random_range(0..400)).collect();
            let keys: Vec<(String, i64)> = picks.iter().map(|&i| key(i)).collect();
            let v = rng.random_range(0..1_000_000);
            let rows: Vec<((String, i64), i64)> = keys.iter().map(|k| (k.clone(), v)).collect();
            let present = keys.iter().filter(|k| model.contains_key(*k)).count();
            match rng.random_range(0..4) {
                0 => {
                    let r = t.insert(&sa_batch(&rows));
                    if present > 0 {
                        assert!(matches!(r, Err(Error::KeyExists { .. })), "round {round}: insert over {present} stored keys: {r:?}");
                    } else {
                        r.unwrap();
                        model.extend(rows);
                    }
                }
                1 => {
                    t.upsert(&sa_batch(&rows)).unwrap();
                    model.extend(rows);
                }
                2 => {
                    let stored: Vec<_> = rows.into_iter().filter(|r| model.contains_key(&r.0)).collect();
                    assert_eq!(t.update(&sa_batch(&stored)).unwrap(), stored.len(), "round {round}: update");
                    model.extend(stored);
                }
                _ => {
                    assert_eq!(t.delete(&sa_keys(&keys)).unwrap(), present, "round {round}: delete");
                    for k in &keys {
                        model.remove(k);
                    }
                }
            }
        }
        t.flush().unwrap();
        assert_eq!(sa_read(&t), model, "round {round}: after the flush");
        if round % 4 == 3 {
            drop(t);
            engine.close().unwrap();
            engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
            t = engine.table("t").unwrap();
            assert_eq!(sa_read(&t), model, "round {round}: after the reopen");
        }
    }
    assert!(!model.is_empty());
    drop(t);
    engine.close().unwrap();
}
