//! Breaker audit 14: a panic audit of the library code (`unwrap`, `expect`, indexing,
//! narrowing casts and arithmetic reachable from the public API), each reachable site pinned
//! by a test of its own here:
//!
//! - Decimal types Parquet cannot store (precision 0 or above 38, scale above precision) are
//!   refused by `create_table`: a `Decimal128(40, 0)` table took rows and then panicked in
//!   its flush (parquet's decimal writer asserts the value fits 16 bytes).
//! - A deletion vector on disk that does not agree with its manifest entry (more positions
//!   than the file has rows, a position past them, a count other than the manifest's) is a
//!   `CorruptFile` at open: before, `rows - deleted` underflowed (a panic with overflow
//!   checks, a wrapped row count without) and a lost or moved position silently brought a
//!   deleted row back.
//! - A write-ahead-log record whose checksum holds but whose Arrow IPC stream is damaged is
//!   `CorruptWal` (also when it decodes to a batch the table refuses): arrow-ipc's reader took a damaged
//!   body length for an allocation (512 GB: the process aborted) and panicked on damaged
//!   buffer offsets and schema fields.
//! - A damaged data file is a `CorruptFile` (or a Parquet error), never a panic, at open and
//!   at scan: the key-index rebuild at open reads a file before its checksum is checked, and
//!   a manifest of an older build has no checksum, so parquet's decoder met damaged footers
//!   and pages, and panicked on some.

use arrow::array::{Array, ArrayRef, AsArray, Decimal128Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig, Error, ScanOptions, StorageError, Table, UnifyError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn cfg() -> EngineConfig {
    EngineConfig::default().memory_limit(64 * MIB).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(5))
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned())).unwrap_or_else(|| "<non-string panic>".into())
}

fn table_dir(root: &Path) -> PathBuf {
    std::fs::read_dir(root.join("tables")).unwrap().flatten().next().unwrap().path()
}

fn kv_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true)]))
}

fn kv(keys: impl Iterator<Item = i64> + Clone) -> RecordBatch {
    RecordBatch::try_new(kv_schema(), vec![Arc::new(Int64Array::from_iter_values(keys.clone())), Arc::new(Int64Array::from_iter_values(keys.map(|k| k * 10)))])
        .unwrap()
}

/// The keys and `v` values a full scan returns, sorted by key.
fn kv_rows(t: &Table) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let (k, v) = (b.column(0).as_primitive::<Int64Type>(), b.column(1).as_primitive::<Int64Type>());
        out.extend(k.values().iter().zip(v.values().iter()).map(|(k, v)| (*k, *v)));
    }
    out.sort_unstable();
    out
}

// =====================================================================================
// Decimal types Parquet cannot store
// =====================================================================================

fn decimal_schema(precision: u8, scale: i8) -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("d", DataType::Decimal128(precision, scale), true)]))
}

/// A batch of `decimal_schema(precision, scale)`: keys 0..n, `d` = key × 7 (a decimal array
/// of any declared type: `with_data_type` takes one Arrow's own constructors refuse).
fn decimal_batch(precision: u8, scale: i8, n: i64) -> RecordBatch {
    let d = Decimal128Array::from_iter_values((0..n).map(|k| i128::from(k) * 7)).with_data_type(DataType::Decimal128(precision, scale));
    RecordBatch::try_new(decimal_schema(precision, scale), vec![Arc::new(Int64Array::from_iter_values(0..n)), Arc::new(d)]).unwrap()
}

/// `Decimal128` columns whose precision is 0 or above 38 (Arrow's `DECIMAL128_MAX_PRECISION`),
/// or whose scale is above their precision, are refused by `create_table` with
/// `UnsupportedType` naming the column, and no table is left behind — as a value column and
/// as a key. Before, `Decimal128(39..=76, _)` was accepted: inserts succeeded, and the flush
/// panicked in parquet's decimal writer (`chunk_size <= T::BYTE_LENGTH`: a 17-byte
/// fixed-length value cannot be cut from an `i128`); a scale above the precision was accepted
/// and every flush then failed (the rows could never reach a file). Decimals at the valid
/// bounds still go through a flush, a reopen and a scan exactly.
#[test]
fn decimal_types_parquet_cannot_store_are_refused_at_create_table() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let mut wrong = Vec::new();
    for (precision, scale) in [(39u8, 0i8), (40, 2), (76, 0), (u8::MAX, 0), (0, 0), (5, 6), (20, 25), (38, 39)] {
        for key in [&["k"][..], &["k", "d"][..]] {
            let what = format!("Decimal128({precision}, {scale}) key {key:?}");
            let created = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<String, Error> {
                let t = engine.create_table("d", decimal_schema(precision, scale), key)?;
                let written = t.insert(&decimal_batch(precision, scale, 100));
                let flushed = t.flush();
                Ok(format!("created; insert {written:?}, flush {flushed:?}"))
            }));
            match created {
                Ok(Err(Error::Input(UnifyError::UnsupportedType { column, data_type }))) => {
                    assert_eq!((column.as_str(), &data_type), ("d", &DataType::Decimal128(precision, scale)), "{what}");
                }
                Ok(other) => wrong.push(format!("{what}: {other:?}")),
                Err(p) => wrong.push(format!("{what}: panicked: {}", panic_text(&*p))),
            }
            if engine.table_names().iter().any(|n| n == "d") {
                engine.drop_table("d").unwrap();
            }
            assert!(engine.table_names().is_empty(), "{what}: a refused create leaves no table");
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The bounds that are valid work end to end.
    let valid = [(1u8, 0i8), (1, 1), (18, 18), (19, 0), (38, 0), (38, 38)];
    for (i, &(precision, scale)) in valid.iter().enumerate() {
        let t = engine.create_table(&format!("ok{i}"), decimal_schema(precision, scale), &["k", "d"]).unwrap();
        // Precision 1 holds one digit: keys 0..=1 (d = 0, 7).
        let n = if precision == 1 { 2 } else { 100 };
        assert_eq!(t.insert(&decimal_batch(precision, scale, n)).unwrap(), n as usize);
        t.flush().unwrap();
    }
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    for (i, &(precision, scale)) in valid.iter().enumerate() {
        let t = engine.table(&format!("ok{i}")).unwrap();
        let n = if precision == 1 { 2 } else { 100 };
        let mut got: Vec<(i64, i128)> = Vec::new();
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            assert_eq!(b.column(1).data_type(), &DataType::Decimal128(precision, scale));
            let d = b.column(1).as_primitive::<arrow::datatypes::Decimal128Type>();
            got.extend(b.column(0).as_primitive::<Int64Type>().values().iter().zip(d.values().iter()).map(|(k, d)| (*k, *d)));
        }
        got.sort_unstable();
        assert_eq!(got, (0..n).map(|k| (k, i128::from(k) * 7)).collect::<Vec<_>>(), "Decimal128({precision}, {scale})");
    }
}

// =====================================================================================
// Deletion vectors on disk that disagree with their manifest entry
// =====================================================================================

/// The portable Roaring serialization of `values` (sorted, distinct, all below 65,536, at
/// most 4,096: one array container), as roaring-rs writes a bitmap without run containers
/// (RoaringFormatSpec: cookie 12346, container count, key and cardinality − 1, offsets,
/// then the container's `u16` values).
fn roaring(values: &[u32]) -> Vec<u8> {
    assert!(values.len() <= 4096 && values.windows(2).all(|w| w[0] < w[1]) && values.iter().all(|&v| v < 1 << 16));
    let mut out = Vec::new();
    out.extend_from_slice(&12346u32.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&((values.len() - 1) as u16).to_le_bytes());
    out.extend_from_slice(&16u32.to_le_bytes());
    for &v in values {
        out.extend_from_slice(&(v as u16).to_le_bytes());
    }
    out
}

/// A table of one data file of keys 0..1000 (row i holds key i) whose every 20th key is
/// deleted — 50 rows in a deletion vector, below the compaction threshold, so the file and
/// its vector stay — closed. Returns the deletion vector's path and its positions.
fn table_with_a_deletion_vector(dir: &Path) -> (PathBuf, Vec<u32>) {
    let engine = Engine::open(dir, cfg()).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv(0..1000)).unwrap();
    t.flush().unwrap();
    let gone: Vec<i64> = (0..1000).step_by(20).collect();
    let keys =
        RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])), vec![Arc::new(Int64Array::from(gone.clone())) as ArrayRef])
            .unwrap();
    assert_eq!(t.delete(&keys).unwrap(), 50);
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    let dv =
        std::fs::read_dir(table_dir(dir)).unwrap().flatten().map(|e| e.path()).find(|p| p.to_string_lossy().contains(".dv")).expect("a deletion vector file");
    let positions: Vec<u32> = gone.iter().map(|&k| k as u32).collect();
    assert_eq!(std::fs::read(&dv).unwrap(), roaring(&positions), "the helper writes the format the engine does");
    (dv, positions)
}

/// A deletion vector whose contents disagree with the manifest entry of its file is refused
/// at open with `StorageError::CorruptFile` naming the vector, whatever the disagreement:
/// more positions than the file has rows (before: `live_rows` computed `1000 - 1500`, a panic
/// with overflow checks and a wrapped `file_rows` without), a position past the file's rows,
/// one position fewer (before: a deleted row came back, silently), one more. The untouched
/// vector opens with the 950 live rows; a truncated one stays the typed error it was, a
/// missing one is `MissingFile` naming it and its table.
#[test]
fn a_deletion_vector_that_disagrees_with_its_manifest_is_corrupt_at_open() {
    let src = tempfile::tempdir().unwrap();
    let (dv, positions) = table_with_a_deletion_vector(src.path());
    let dv_name = dv.file_name().unwrap().to_owned();
    let want: Vec<(i64, i64)> = (0..1000).filter(|k| k % 20 != 0).map(|k| (k, k * 10)).collect();
    let mut moved = positions.clone();
    *moved.last_mut().unwrap() = 5_000;
    let mut extra = positions.clone();
    extra.push(999);
    let original = std::fs::read(&dv).unwrap();
    let cases: Vec<(&str, Option<Vec<u8>>)> = vec![
        ("more positions than rows", Some(roaring(&(0..1500).collect::<Vec<u32>>()))),
        ("a position past the file's rows", Some(roaring(&moved))),
        ("one position lost", Some(roaring(&positions[1..]))),
        ("one position more", Some(roaring(&extra))),
        ("truncated", Some(original[..original.len() - 7].to_vec())),
        ("missing", None),
    ];
    let mut wrong = Vec::new();
    for (what, bytes) in cases {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("cp").arg("-a").arg(format!("{}/.", src.path().display())).arg(dir.path()).status().unwrap();
        assert!(status.success());
        let path = table_dir(dir.path()).join(&dv_name);
        match bytes {
            Some(b) => std::fs::write(&path, b).unwrap(),
            None => std::fs::remove_file(&path).unwrap(),
        }
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<String, Error> {
            let engine = Engine::open(dir.path(), cfg())?;
            let t = engine.table("t")?;
            let stats = t.stats()?;
            Ok(format!("opened: file_rows {}, rows scanned {}", stats.file_rows, kv_rows(&t).len()))
        }));
        match (what, opened) {
            ("missing", Ok(Err(Error::Storage(StorageError::MissingFile { path: p, table })))) if p == path && table == "t" => {}
            (_, Ok(Err(Error::Storage(StorageError::CorruptFile { path: p, .. })))) if p == path => {}
            (_, Ok(other)) => wrong.push(format!("{what}: {other:?}")),
            (_, Err(p)) => wrong.push(format!("{what}: panicked: {}", panic_text(&*p))),
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The directory itself was never changed: it opens with exactly the live rows.
    let engine = Engine::open(src.path(), cfg()).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(t.stats().unwrap().file_rows, 950);
    assert_eq!(kv_rows(&t), want);
}

// =====================================================================================
// A write-ahead-log record whose checksum holds but whose Arrow IPC stream is damaged
// =====================================================================================

/// CRC-32 (IEEE 802.3, reflected; what `crc32fast` computes), bit by bit.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// A WAL record damaged inside its Arrow IPC stream, its checksum recomputed (a record a
/// faulty build wrote, or one crafted: the checksum proves nothing then), at ~160 places
/// across the stream: `Engine::open` either replays it — record `a`'s 10 rows whole, `b`'s
/// rows with whatever values the damage left — or refuses it (`CorruptWal` naming the
/// segment and record, also when the damage renamed or retyped a column), and never panics. Before, arrow-ipc's reader took a damaged body length for an
/// allocation (512 GB: the process aborted) and sliced buffers by damaged offsets (a panic).
/// The segment restored, the directory opens with all 30 rows.
#[test]
fn a_damaged_ipc_stream_under_a_valid_wal_checksum_is_corrupt_wal_not_a_panic() {
    let src = tempfile::tempdir().unwrap();
    {
        let engine = Engine::open(src.path(), cfg()).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        t.insert(&kv(0..10)).unwrap();
        t.insert(&kv(10..30)).unwrap();
        // Dropped without a flush: both records stay in the log.
    }
    let seg_path = src.path().join("wal").join("wal-00000001.log");
    let seg = std::fs::read(&seg_path).unwrap();
    let a_len = 8 + u32::from_le_bytes(seg[..4].try_into().unwrap()) as usize;
    let b_len = 8 + u32::from_le_bytes(seg[a_len..a_len + 4].try_into().unwrap()) as usize;
    assert_eq!(a_len + b_len, seg.len(), "two records");
    assert_eq!(crc32(&seg[a_len + 8..]), u32::from_le_bytes(seg[a_len + 4..a_len + 8].try_into().unwrap()), "the checksum the log uses");
    // The IPC stream starts after b's frame (8 bytes) and payload header (25 bytes).
    let ipc = a_len + 8 + 25;
    let positions: Vec<usize> = (ipc..seg.len()).step_by(((seg.len() - ipc) / 160).max(1)).collect();
    let (mut replayed, mut refused, mut wrong) = (0, 0, Vec::new());
    for (i, &at) in positions.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("cp").arg("-a").arg(format!("{}/.", src.path().display())).arg(dir.path()).status().unwrap();
        assert!(status.success());
        let mut bytes = seg.clone();
        bytes[at] ^= [0x80u8, 0xff, 0x01][i % 3];
        let crc = crc32(&bytes[a_len + 8..]);
        bytes[a_len + 4..a_len + 8].copy_from_slice(&crc.to_le_bytes());
        let path = dir.path().join("wal").join("wal-00000001.log");
        std::fs::write(&path, &bytes).unwrap();
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<Vec<i64>, Error> {
            let engine = Engine::open(dir.path(), cfg())?;
            let t = engine.table("t")?;
            Ok(kv_rows(&t).into_iter().map(|(k, _)| k).collect())
        }));
        match opened {
            // Damage to a value (or a key: one that lands on another key replaces its row)
            // decodes to other values; record `a` is whole either way.
            Ok(Ok(keys)) if keys.len() <= 30 && (0..10).all(|k| keys.contains(&k)) => replayed += 1,
            // Including a column name or type damaged (a batch that is not the table's): that
            // was a bare `SchemaMismatch` naming no file before.
            Ok(Err(Error::Storage(StorageError::CorruptWal { path: p, offset, .. }))) if p == path && offset == a_len as u64 => refused += 1,
            Ok(other) => wrong.push(format!("byte {at}: {other:?}")),
            Err(p) => wrong.push(format!("byte {at}: panicked: {}", panic_text(&*p))),
        }
    }
    assert!(wrong.is_empty(), "{} of {} damaged records: {wrong:#?}", wrong.len(), positions.len());
    assert!(refused > positions.len() / 4, "{refused} refused, {replayed} replayed");
    let engine = Engine::open(src.path(), cfg()).unwrap();
    assert_eq!(kv_rows(&engine.table("t").unwrap()), (0..30).map(|k| (k, k * 10)).collect::<Vec<_>>());
}

// =====================================================================================
// Damaged data files reach the Parquet decoder
// =====================================================================================

/// One data file of 3,000 rows (`k`, `v` with nulls, `s` dictionary-encoded strings with
/// nulls), closed.
fn table_with_one_data_file(dir: &Path) {
    let schema =
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true), Field::new("s", DataType::Utf8, true)]));
    let engine = Engine::open(dir, cfg()).unwrap();
    let t = engine.create_table("t", Arc::clone(&schema), &["k"]).unwrap();
    let n = 3000i64;
    let b = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from_iter_values(0..n)),
            Arc::new(Int64Array::from_iter((0..n).map(|k| (k % 7 != 0).then_some(k * 31 % 1000)))),
            Arc::new(StringArray::from_iter((0..n).map(|k| (k % 5 != 0).then(|| format!("s{}", k % 40))))),
        ],
    )
    .unwrap();
    t.insert(&b).unwrap();
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
}

/// A data file with one byte changed — every byte of its last 700 (footer, page index and
/// the last pages), and ~120 across the rest — opened and scanned, with the manifest's
/// checksum and without it (a manifest of an older build): never a panic. With the checksum
/// every damage is a `CorruptFile` (at open, from the key-index rebuild, or at the scan's
/// check) or a Parquet error; without it the scan may also return the rows (a changed value
/// is undetectable then). Before, the key-index rebuild at open — which reads the key column
/// before the checksum is checked — panicked inside parquet on a damaged footer ("column
/// start and length should not be negative", "Type <UNKNOWN 28> not supported", "Decoder
/// for dict should have been set"), and scans of an unchecksummed file panicked too ("offset
/// + len out of bounds").
#[test]
fn a_damaged_data_file_is_an_error_at_open_or_scan_never_a_panic() {
    let src = tempfile::tempdir().unwrap();
    table_with_one_data_file(src.path());
    let file = std::fs::read_dir(table_dir(src.path())).unwrap().flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == "parquet")).unwrap();
    let name = file.file_name().unwrap().to_owned();
    let original = std::fs::read(&file).unwrap();
    let len = original.len();
    let mut positions: Vec<usize> = (0..len).step_by((len / 120).max(1)).collect();
    positions.extend(len.saturating_sub(700)..len);
    positions.sort_unstable();
    positions.dedup();
    let mut wrong = Vec::new();
    let mut outcomes = std::collections::BTreeMap::new();
    for checksum in [true, false] {
        for (i, &at) in positions.iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let status = std::process::Command::new("cp").arg("-a").arg(format!("{}/.", src.path().display())).arg(dir.path()).status().unwrap();
            assert!(status.success());
            let tdir = table_dir(dir.path());
            let mut bytes = original.clone();
            bytes[at] ^= [0x01u8, 0x80, 0xff][i % 3];
            std::fs::write(tdir.join(&name), &bytes).unwrap();
            if !checksum {
                let path = tdir.join("manifest.json");
                // A format-1 manifest: no checksum line, no file checksums.
                let mut m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                m.as_object_mut().unwrap().remove("manifest_crc32");
                m["format"] = 1.into();
                for f in m["files"].as_array_mut().unwrap() {
                    f.as_object_mut().unwrap().remove("crc32");
                }
                std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<usize, (&'static str, Error)> {
                let engine = Engine::open(dir.path(), cfg()).map_err(|e| ("open", e))?;
                let t = engine.table("t").unwrap();
                let mut rows = 0;
                for b in t.scan(ScanOptions::default()).unwrap() {
                    rows += b.map_err(|e| ("scan", e))?.num_rows();
                }
                Ok(rows)
            }));
            let what = format!("checksum {checksum}, byte {at} of {len}");
            let outcome = match r {
                Err(p) => {
                    wrong.push(format!("{what}: panicked: {}", panic_text(&*p)));
                    continue;
                }
                Ok(Ok(rows)) if !checksum => format!("rows {}", if rows == 3000 { "all" } else { "other" }),
                Ok(Ok(rows)) => {
                    wrong.push(format!("{what}: the checksum let a damaged file be read ({rows} rows)"));
                    continue;
                }
                Ok(Err((step, Error::Storage(StorageError::CorruptFile { path, .. })))) if path == tdir.join(&name) => format!("{step}: corrupt file"),
                Ok(Err((step, Error::Storage(StorageError::Parquet(_) | StorageError::Arrow(_))))) => format!("{step}: parquet or arrow error"),
                Ok(Err((step, e))) => {
                    wrong.push(format!("{what}: {step}: {e:?}"));
                    continue;
                }
            };
            *outcomes.entry((checksum, outcome)).or_insert(0) += 1;
        }
    }
    assert!(wrong.is_empty(), "{} of {} damaged files: {wrong:#?}", wrong.len(), 2 * positions.len());
    // Both steps catch damage in both modes.
    for key in [(true, "open: corrupt file"), (true, "scan: corrupt file"), (false, "open: corrupt file"), (false, "scan: corrupt file")] {
        assert!(outcomes.contains_key(&(key.0, key.1.to_owned())), "{key:?} never came up: {outcomes:?}");
    }
}
