//! Breaker audit 16: a second panic audit of the library code (`unwrap`, `expect`, indexing
//! and arithmetic reachable from the public API; breaker_audit14 was the first), here the
//! values a data directory's files hand the engine that no build of it wrote, each pinned by a
//! test of its own:
//!
//! - A manifest whose `primary_key` is empty or names a column twice (edited by hand and
//!   resealed): `create_table` refuses both, the open took them. With no key column every
//!   write panicked (the key encoder returns no rows for a batch of n, and the write indexed
//!   them); the open now refuses the manifest as `CorruptManifest`.
//! - A manifest whose `flushed_seq` or `version` is at the end of `u64`, or a WAL record whose
//!   sequence numbers are: the engine continues from them with `+ 1` (a panic with overflow
//!   checks; without, a wrap: writes numbered from 0 were then skipped at replay as already
//!   flushed, and a write numbered `u64::MAX` made the next open refuse the whole log).
//!   Sequence numbers and versions on disk are now below 2^63, which no table reaches.
//! - A manifest file entry not named as gritdb names that file id (`f<id>.parquet`, deletion
//!   vectors `f<id>.dv<version>`), or naming an id twice: a later flush wrote its new file
//!   under the name of a live one, and two entries with one id hid one of them.
//! - A manifest whose files claim `decoded_bytes` near the end of `u64`: the merge planner's
//!   sum of them wrapped, and the files looked small enough to merge.

use arrow::array::{Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig, Error, ScanOptions, StorageError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;

fn cfg() -> EngineConfig {
    EngineConfig::default().memory_limit(64 * MIB).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(5))
}

fn kv_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true)]))
}

fn kv(keys: impl Iterator<Item = i64> + Clone) -> RecordBatch {
    RecordBatch::try_new(kv_schema(), vec![Arc::new(Int64Array::from_iter_values(keys.clone())), Arc::new(Int64Array::from_iter_values(keys.map(|k| k * 10)))])
        .unwrap()
}

/// `(count, sum of k, sum of v)` of table `t`'s rows.
fn totals(engine: &Engine) -> (usize, i64, i64) {
    let t = engine.table("t").unwrap();
    let mut out = (0, 0, 0);
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let v = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        out.0 += b.num_rows();
        out.1 += arrow::compute::sum(k).unwrap_or(0);
        out.2 += arrow::compute::sum::<Int64Type>(v).unwrap_or(0);
    }
    out
}

fn table_dir(root: &Path) -> PathBuf {
    std::fs::read_dir(root.join("tables")).unwrap().flatten().next().unwrap().path()
}

/// Manifest text with its checksum line recomputed for the (edited) lines after it, as the
/// reseal snippet of docs/architecture.md does.
fn reseal(text: &str) -> String {
    let (first, rest) = text.split_once('\n').unwrap();
    let (line, body) = rest.split_once('\n').unwrap();
    assert!(line.starts_with("  \"manifest_crc32\": "), "{line}");
    format!("{first}\n  \"manifest_crc32\": {},\n{body}", crc32fast::hash(body.as_bytes()))
}

/// A table `t` (`k` key, `v`) with rows 0..100 in one data file with a deletion vector (rows
/// 0 and 1 deleted) and rows 100..150 in a second file; closed. Its manifest's text.
fn table_with_two_files(dir: &Path) -> String {
    let engine = Engine::open(dir, cfg()).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    t.insert(&kv(0..100)).unwrap();
    t.flush().unwrap();
    t.delete(
        &RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])), vec![Arc::new(Int64Array::from_iter_values(0..2))])
            .unwrap(),
    )
    .unwrap();
    t.insert(&kv(100..150)).unwrap();
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    std::fs::read_to_string(table_dir(dir).join("manifest.json")).unwrap()
}

/// The rows of [`table_with_two_files`]: 148 rows, keys 2..150.
fn two_file_totals() -> (usize, i64, i64) {
    let s: i64 = (2..150).sum();
    (148, s, s * 10)
}

/// What opening `dir` with its manifest replaced by `text` (resealed) does, writes and a
/// flush included, panics caught: `Ok(())` when it all succeeds.
fn open_with_manifest(dir: &Path, text: &str) -> Result<Result<(), Error>, String> {
    std::fs::write(table_dir(dir).join("manifest.json"), reseal(text)).unwrap();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), Error> {
        let engine = Engine::open(dir, cfg())?;
        let t = engine.table("t")?;
        t.upsert(&kv(1000..1100))?;
        t.flush()?;
        t.upsert(&kv(2000..2010))?;
        drop(t);
        engine.close()
    }))
    .map_err(|p| p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned())).unwrap_or_default())
}

/// Asserts `got` is a `CorruptManifest` whose detail holds `fragment`.
fn assert_corrupt_manifest(what: &str, got: Result<Result<(), Error>, String>, fragment: &str) {
    match got {
        Ok(Err(Error::Storage(StorageError::CorruptManifest { detail, .. }))) => assert!(detail.contains(fragment), "{what}: {fragment:?} not in {detail}"),
        Ok(other) => panic!("{what}: expected CorruptManifest, got {other:?}"),
        Err(p) => panic!("{what}: expected CorruptManifest, panicked: {p}"),
    }
}

/// A manifest whose primary key is empty or names a column twice is `CorruptManifest` at
/// open (before: the open took it, and with no key column every write panicked indexing the
/// keys of its rows). The manifest put back, the table opens with its rows as they were.
#[test]
fn a_manifest_with_no_or_a_repeated_primary_key_column_is_corrupt_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let text = table_with_two_files(dir.path());
    let key = "\"primary_key\": [\n    \"k\"\n  ],";
    assert!(text.contains(key), "{text}");
    // A table without data files: the open took the empty key, and the first write panicked.
    let empty = tempfile::tempdir().unwrap();
    {
        let engine = Engine::open(empty.path(), cfg()).unwrap();
        drop(engine.create_table("t", kv_schema(), &["k"]).unwrap());
        engine.close().unwrap();
    }
    let empty_text = std::fs::read_to_string(table_dir(empty.path()).join("manifest.json")).unwrap();
    assert!(empty_text.contains(key), "{empty_text}");
    let no_key = empty_text.replace(key, "\"primary_key\": [],");
    assert_corrupt_manifest("no key column, no data file", open_with_manifest(empty.path(), &no_key), "no primary-key column");
    for (what, edit, fragment) in [
        ("no key column", "\"primary_key\": [],", "no primary-key column"),
        ("a repeated key column", "\"primary_key\": [\n    \"k\",\n    \"k\"\n  ],", "primary key names column `k` twice"),
    ] {
        assert_corrupt_manifest(what, open_with_manifest(dir.path(), &text.replace(key, edit)), fragment);
    }
    put_back_and_check(dir.path(), &text);
}

/// A manifest whose `flushed_seq` or `version` is at or past 2^63 is `CorruptManifest` at
/// open: the engine continues from them with `+ 1`, which wrapped at `u64::MAX` (a panic with
/// overflow checks; without, writes numbered from 0 that replay skipped as flushed). The
/// manifest put back, the table opens with its rows as they were.
#[test]
fn a_manifest_counter_at_the_end_of_u64_is_corrupt_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let text = table_with_two_files(dir.path());
    // `text` with field `name`'s number replaced by `value`.
    let with = |name: &str, value: u64| {
        let at = text.find(&format!("\"{name}\": ")).unwrap() + name.len() + 4;
        let end = at + text[at..].find(',').unwrap();
        format!("{}{value}{}", &text[..at], &text[end..])
    };
    for name in ["flushed_seq", "version"] {
        for value in [u64::MAX, u64::MAX - 1, 1 << 63] {
            let edited = with(name, value);
            assert_corrupt_manifest(&format!("{name} {value}"), open_with_manifest(dir.path(), &edited), &format!("{name} {value} is out of range"));
        }
    }
    put_back_and_check(dir.path(), &text);
}

/// A manifest file entry whose data file or deletion vector is not named as gritdb names it
/// for its id (`f<id>.parquet`, `f<id>.dv<version>` with a version up to the manifest's), or
/// that repeats an id, is `CorruptManifest` at open. Before, the open took them: a data file
/// listed under id 1 as `f000003.parquet` was overwritten by the table's third file (its rows
/// lost), and of two entries with one id only the last was read. The manifest put back, the
/// table opens with its rows as they were.
#[test]
fn a_manifest_file_entry_not_named_for_its_id_is_corrupt_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let text = table_with_two_files(dir.path());
    let tdir = table_dir(dir.path());
    let dv = std::fs::read_dir(&tdir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .find(|n| n.contains(".dv"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(dv.starts_with("f000001.dv"), "{dv}");
    assert!(text.contains("\"next_file_id\": 3,"), "{text}");
    // Data file 1 moved to the name a third file would get; the manifest lists it there.
    std::fs::rename(tdir.join("f000001.parquet"), tdir.join("f000003.parquet")).unwrap();
    let moved = text.replace("\"name\": \"f000001.parquet\"", "\"name\": \"f000003.parquet\"");
    assert_corrupt_manifest("data file named for another id", open_with_manifest(dir.path(), &moved), "is not named `f000001.parquet`");
    std::fs::rename(tdir.join("f000003.parquet"), tdir.join("f000001.parquet")).unwrap();
    // The deletion vector named for file 2, or for a version after the manifest's.
    let dv2 = dv.replace("f000001", "f000002");
    std::fs::copy(tdir.join(&dv), tdir.join(&dv2)).unwrap();
    assert_corrupt_manifest(
        "deletion vector named for another id",
        open_with_manifest(dir.path(), &text.replace(&format!("\"dv\": \"{dv}\""), &format!("\"dv\": \"{dv2}\""))),
        "deletion vector",
    );
    std::fs::remove_file(tdir.join(&dv2)).unwrap();
    let later = "f000001.dv99";
    std::fs::copy(tdir.join(&dv), tdir.join(later)).unwrap();
    assert_corrupt_manifest(
        "deletion vector of a later version",
        open_with_manifest(dir.path(), &text.replace(&format!("\"dv\": \"{dv}\""), &format!("\"dv\": \"{later}\""))),
        "deletion vector",
    );
    std::fs::remove_file(tdir.join(later)).unwrap();
    // File 2 listed under id 1 as well as its own, with file 1's name.
    let repeated = text.replace("\"id\": 2,", "\"id\": 1,").replace("\"name\": \"f000002.parquet\"", "\"name\": \"f000001.parquet\"");
    assert_corrupt_manifest("an id listed twice", open_with_manifest(dir.path(), &repeated), "lists file id 1 twice");
    put_back_and_check(dir.path(), &text);
}

/// A checksum-valid WAL record whose sequence numbers reach 2^63 is `CorruptWal` at open.
/// Before, only `u64::MAX` itself was refused: a record ending at `u64::MAX - 1` replayed, the
/// table numbered its next write `u64::MAX`, and the open after that refused the whole log (the
/// write acknowledged, then lost). The segment put back, the directory opens with its rows.
#[test]
fn a_wal_record_with_sequence_numbers_past_2_pow_63_is_corrupt_wal() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = Engine::open(dir.path(), cfg()).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        t.insert(&kv(0..10)).unwrap();
        // Dropped without a flush: the record stays in the log.
    }
    let seg_path = dir.path().join("wal").join("wal-00000001.log");
    let seg = std::fs::read(&seg_path).unwrap();
    assert_eq!(8 + u32::from_le_bytes(seg[..4].try_into().unwrap()) as usize, seg.len(), "one record");
    for (first, last) in [(u64::MAX - 10, u64::MAX - 1), (1 << 63, (1 << 63) + 9), ((1 << 63) - 9, 1 << 63)] {
        let mut bytes = seg.clone();
        // The payload: op (1 byte), table id, first and last sequence number (8 bytes each).
        bytes[8 + 9..8 + 17].copy_from_slice(&first.to_le_bytes());
        bytes[8 + 17..8 + 25].copy_from_slice(&last.to_le_bytes());
        let crc = crc32fast::hash(&bytes[8..]);
        bytes[4..8].copy_from_slice(&crc.to_le_bytes());
        std::fs::write(&seg_path, &bytes).unwrap();
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), Error> {
            let engine = Engine::open(dir.path(), cfg())?;
            engine.table("t")?.insert(&kv(10..11))?;
            engine.close()
        }));
        match got {
            Ok(Err(Error::Storage(StorageError::CorruptWal { path, offset: 0, detail }))) => {
                assert_eq!(path, seg_path);
                assert!(detail.contains("out of range"), "{first}..={last}: {detail}");
            }
            Ok(other) => panic!("{first}..={last}: expected CorruptWal, got {other:?}"),
            Err(_) => panic!("{first}..={last}: panicked"),
        }
        assert_eq!(std::fs::read(&seg_path).unwrap(), bytes, "{first}..={last}: the refused segment is left as it was");
    }
    std::fs::write(&seg_path, &seg).unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let s: i64 = (0..10).sum();
    assert_eq!(totals(&engine), (10, s, s * 10));
    engine.close().unwrap();
}

/// Writes the table's manifest `text` back and checks the table opens with its two files'
/// rows as they were.
fn put_back_and_check(dir: &Path, text: &str) {
    std::fs::write(table_dir(dir).join("manifest.json"), text).unwrap();
    let engine = Engine::open(dir, cfg()).unwrap();
    assert_eq!(totals(&engine), two_file_totals());
    engine.close().unwrap();
}

/// A manifest whose files claim `decoded_bytes` near the end of `u64` (edited by hand and
/// resealed): the merge planner summed the inputs' decoded bytes with `+`, which wrapped
/// (a panic with overflow checks) and made the absurd files look small enough to merge.
/// The sum saturates now: such files are too big for a merge's budget, no merge is planned,
/// and the table's rows read back as they were.
#[test]
fn decoded_bytes_at_the_end_of_u64_do_not_wrap_the_merge_budget() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    for i in 0..3 {
        t.insert(&kv(i * 10..i * 10 + 10)).unwrap();
        t.flush().unwrap();
    }
    assert_eq!(t.stats().unwrap().files, 3, "three small files: below the merge trigger of 4");
    drop(t);
    engine.close().unwrap();
    let path = table_dir(dir.path()).join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut seen = 0;
    let edited: String = text
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("\"decoded_bytes\":") {
                seen += 1;
                // The first file keeps its size; the others claim u64::MAX - 7.
                if seen > 1 {
                    let indent = &l[..l.len() - l.trim_start().len()];
                    let comma = if l.trim_end().ends_with(',') { "," } else { "" };
                    return format!("{indent}\"decoded_bytes\": {}{comma}", u64::MAX - 7);
                }
            }
            l.to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(seen, 3, "one decoded_bytes per file:\n{text}");
    std::fs::write(&path, reseal(&(edited + "\n"))).unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let t = engine.table("t").unwrap();
    t.insert(&kv(30..40)).unwrap();
    t.flush().unwrap();
    assert_eq!(t.stats().unwrap().files, 4, "no merge of files whose decoded bytes are past any budget");
    drop(t);
    let s: i64 = (0..40).sum();
    assert_eq!(totals(&engine), (40, s, s * 10));
    engine.close().unwrap();
}
