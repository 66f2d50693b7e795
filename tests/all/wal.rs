//! Write-ahead log: acknowledged writes survive a drop without close; the log is truncated
//! once its rows are in committed files; a torn tail is dropped; damage in the middle is a
//! typed error.

use gritdb::{Engine, EngineConfig, Error, ScanOptions};
use gritdb_tests::*;
use std::collections::BTreeMap;
use std::io::Write;

fn rows(from: i64, n: i64, tag: &str) -> Vec<((i64, i32), Row)> {
    (from..from + n).map(|k| ((k, 0), (Some(k), Some(format!("{tag}-{k}"))))).collect()
}

fn config() -> EngineConfig {
    EngineConfig::default().memory_limit(64 << 20)
}

fn wal_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir.join("wal")).unwrap().flatten().map(|e| e.path()).collect();
    v.sort();
    v
}

/// Builds a table whose state is split across files, deletion vectors and the WAL, then drops
/// the engine without closing it.
fn crash_after_writes(dir: &std::path::Path) -> BTreeMap<(i64, i32), Row> {
    let engine = Engine::open(dir, config()).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let mut model: BTreeMap<_, _> = BTreeMap::new();
    t.insert(&composite_batch(&rows(0, 1000, "a"))).unwrap();
    model.extend(rows(0, 1000, "a"));
    t.flush().unwrap();
    // After the flush: upserts over flushed rows, deletes of flushed rows, new rows, and a
    // delete-then-reinsert of the same key.
    t.upsert(&composite_batch(&rows(900, 200, "b"))).unwrap();
    model.extend(rows(900, 200, "b"));
    let dels: Vec<(i64, i32)> = (0..50).map(|k| (k, 0)).collect();
    assert_eq!(t.delete(&composite_keys(&dels)).unwrap(), 50);
    for k in &dels {
        model.remove(k);
    }
    t.insert(&composite_batch(&rows(10, 1, "c"))).unwrap();
    model.extend(rows(10, 1, "c"));
    t.update(&composite_batch(&rows(500, 1, "d"))).unwrap();
    model.extend(rows(500, 1, "d"));
    drop(t);
    drop(engine); // no close: the rows after the flush are only in the WAL
    model
}

#[test]
fn acknowledged_writes_survive_drop_without_close() {
    let dir = tempfile::tempdir().unwrap();
    let model = crash_after_writes(dir.path());
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(collect_composite(t.scan(ScanOptions::default()).unwrap()), model);
    // Replayed rows behave like any others: insert of a replayed key is refused.
    assert!(matches!(t.insert(&composite_batch(&rows(10, 1, "x"))), Err(Error::KeyExists { .. })));
    // Twice in a row, with more writes in between.
    t.delete(&composite_keys(&[(999, 0)])).unwrap();
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), config()).unwrap();
    let mut model = model;
    model.remove(&(999, 0));
    assert_eq!(collect_composite(engine.table("t").unwrap().scan(ScanOptions::default()).unwrap()), model);
}

#[test]
fn wal_is_truncated_once_rows_are_committed() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 5000, "a"))).unwrap();
    let (segs, bytes) = engine.wal_usage();
    assert_eq!(segs, 1);
    assert!(bytes > 5000 * 8, "the WAL holds the rows ({bytes} bytes)");
    t.flush().unwrap();
    assert_eq!(engine.wal_usage(), (0, 0), "flushed rows need no WAL");
    // The files go on the writer's runtime, off the flushing thread: soon, not at once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !wal_files(dir.path()).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(wal_files(dir.path()).is_empty());
    // A dropped table's records are not needed either.
    let u = engine.create_table("u", composite_schema(), &["k1", "k2"]).unwrap();
    u.insert(&composite_batch(&rows(0, 10, "u"))).unwrap();
    assert_eq!(engine.wal_usage().0, 1);
    engine.drop_table("u").unwrap();
    assert_eq!(engine.wal_usage(), (0, 0));
}

#[test]
fn torn_tail_is_dropped_and_nothing_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = crash_after_writes(dir.path());
    let last = wal_files(dir.path()).pop().unwrap();
    let len = std::fs::metadata(&last).unwrap().len();
    // A torn record: a header promising more bytes than were written, its op byte (1, a put)
    // beside it.
    let mut f = std::fs::OpenOptions::new().append(true).open(&last).unwrap();
    f.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 1, 9, 9]).unwrap();
    drop(f);
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(collect_composite(engine.table("t").unwrap().scan(ScanOptions::default()).unwrap()), model);
    assert_eq!(std::fs::metadata(&last).unwrap().len(), len, "the torn tail is cut off");
    let torn = engine.wal_torn_tail().expect("the open reports the tail it cut");
    assert_eq!((torn.segment.as_path(), torn.offset, torn.bytes), (last.as_path(), len, 11));
    assert!(torn.detail.contains("past the end"), "{}", torn.detail);
    drop(engine);
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(engine.wal_torn_tail(), None, "nothing cut at a clean open");
    engine.close().unwrap();
}

/// One flipped bit in the length of the last, acknowledged and fsynced record cannot be told
/// from a write a crash interrupted: the open drops it, as the recovery rules say, and
/// `Engine::wal_torn_tail` names the segment, the record's offset and its size, so the loss
/// is never silent to an application that checks (a trial found it was).
#[test]
fn a_damaged_last_record_dropped_as_a_torn_tail_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
        for (i, tag) in ["a", "b", "c"].iter().enumerate() {
            t.insert(&composite_batch(&rows(100 * i as i64, 100, tag))).unwrap();
        }
        assert_eq!(engine.wal_torn_tail(), None);
    } // dropped without close: the rows are only in the WAL
    let seg = wal_files(dir.path()).pop().unwrap();
    let mut data = std::fs::read(&seg).unwrap();
    // Records: | len u32 | crc u32 | payload |; the third starts after the first two.
    let mut at = 0usize;
    for _ in 0..2 {
        at += 8 + u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize;
    }
    let size = data.len() - at;
    assert_eq!(8 + u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize, size, "the third record ends the segment");
    data[at + 1] ^= 0x10; // its length grows by 4 KiB: it runs past the segment's end
    std::fs::write(&seg, &data).unwrap();
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 200);
    let torn = engine.wal_torn_tail().expect("the dropped record is reported");
    assert_eq!((torn.segment.as_path(), torn.offset, torn.bytes), (seg.as_path(), at as u64, size as u64));
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), at as u64);
    engine.close().unwrap();
}

#[test]
fn bad_checksum_in_the_middle_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    crash_after_writes(dir.path());
    let last = wal_files(dir.path()).pop().unwrap();
    let mut data = std::fs::read(&last).unwrap();
    // Flip a byte inside the first record's payload (records follow it).
    data[20] ^= 0xff;
    std::fs::write(&last, &data).unwrap();
    match Engine::open(dir.path(), config()) {
        Err(Error::Storage(e)) => assert!(e.to_string().contains("corrupt write-ahead log"), "{e}"),
        other => panic!("expected a corrupt-WAL error, got {other:?}"),
    }
}

/// Damage to a record header in the middle of the last segment (records follow it) is
/// corruption, not a torn tail: the open fails with a typed error and the file is left as it
/// was, so no acknowledged write after the damage is dropped. Both ways a tail is recognised
/// are tried: a zeroed header (as a zero-filled tail starts) and a length running past the end.
#[test]
fn damaged_header_before_records_in_the_last_segment_is_corruption() {
    for damage in ["zeroed header", "huge length"] {
        let dir = tempfile::tempdir().unwrap();
        crash_after_writes(dir.path());
        let last = wal_files(dir.path()).pop().unwrap();
        let mut data = std::fs::read(&last).unwrap();
        // The second record's offset (a whole record is 8 header bytes + its length).
        let first_len = u32::from_le_bytes(data[0..4].try_into().unwrap()) as usize;
        let at = 8 + first_len;
        assert!(at + 8 < data.len(), "{damage}: records after the damaged one");
        match damage {
            "zeroed header" => data[at..at + 8].fill(0),
            _ => data[at..at + 4].copy_from_slice(&0x7fff_ffff_u32.to_le_bytes()),
        }
        std::fs::write(&last, &data).unwrap();
        match Engine::open(dir.path(), config()) {
            Err(Error::Storage(e)) => assert!(e.to_string().contains("corrupt write-ahead log"), "{damage}: {e}"),
            other => panic!("{damage}: expected a corrupt-WAL error, got {other:?}"),
        }
        assert_eq!(std::fs::read(&last).unwrap(), data, "{damage}: the segment is not truncated");
    }
}

#[test]
fn relaxed_sync_mode_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || config().wal_sync(gritdb::WalSync::Relaxed);
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    t.insert(&composite_batch(&rows(0, 100, "r"))).unwrap();
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 100);
}

/// View columns are logged as offset columns (smaller records) and come back as views: a
/// `Utf8View` key, a nullable `BinaryView` and a `Utf8View` with inline (≤ 12 bytes) and
/// out-of-line values, written with insert (the overlapped path: ≥ 1,024 rows), upsert,
/// update and delete, survive a drop without close byte for byte.
#[test]
fn view_columns_survive_replay_as_views() {
    use arrow::array::{Array, BinaryViewArray, Int64Array, RecordBatch, StringViewArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    type Model = BTreeMap<String, (i64, Option<String>, Option<Vec<u8>>)>;
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8View, false),
        Field::new("n", DataType::Int64, false),
        Field::new("s", DataType::Utf8View, true),
        Field::new("b", DataType::BinaryView, true),
    ]));
    let value = |k: i64, tag: &str| if k % 3 == 0 { format!("{tag}{k}") } else { format!("{tag}-a-value-longer-than-twelve-bytes-{k}") };
    let batch = |keys: &[i64], tag: &str| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringViewArray::from_iter_values(keys.iter().map(|k| format!("key-{k:06}")))),
                Arc::new(Int64Array::from_iter_values(keys.iter().copied())),
                Arc::new(keys.iter().map(|&k| (k % 7 != 0).then(|| value(k, tag))).collect::<StringViewArray>()),
                Arc::new(keys.iter().map(|&k| (k % 5 != 0).then(|| value(k, tag).into_bytes())).collect::<BinaryViewArray>()),
            ],
        )
        .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let mut model = Model::new();
    let apply = |keys: &[i64], tag: &str, model: &mut BTreeMap<_, _>| {
        for &k in keys {
            model.insert(format!("key-{k:06}"), (k, (k % 7 != 0).then(|| value(k, tag)), (k % 5 != 0).then(|| value(k, tag).into_bytes())));
        }
    };
    {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.create_table("v", Arc::clone(&schema), &["id"]).unwrap();
        let all: Vec<i64> = (0..3000).collect();
        assert_eq!(t.insert(&batch(&all, "a")).unwrap(), 3000);
        apply(&all, "a", &mut model);
        let some: Vec<i64> = (2500..3500).collect();
        assert_eq!(t.upsert(&batch(&some, "b")).unwrap(), 1000);
        apply(&some, "b", &mut model);
        let one = [42];
        assert_eq!(t.update(&batch(&one, "c")).unwrap(), 1);
        apply(&one, "c", &mut model);
        let gone: Vec<String> = (100..200).map(|k| format!("key-{k:06}")).collect();
        let keys = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("id", DataType::Utf8View, false)])),
            vec![Arc::new(StringViewArray::from_iter_values(gone.iter()))],
        )
        .unwrap();
        assert_eq!(t.delete(&keys).unwrap(), 100);
        for k in &gone {
            model.remove(k);
        }
        drop(t);
        drop(engine); // no close: everything is only in the WAL
    }
    let engine = Engine::open(dir.path(), config()).unwrap();
    let table = engine.table("v").unwrap();
    let mut got = BTreeMap::new();
    for b in table.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        assert_eq!(
            b.schema().fields().iter().map(|f| f.data_type().clone()).collect::<Vec<_>>(),
            vec![DataType::Utf8View, DataType::Int64, DataType::Utf8View, DataType::BinaryView]
        );
        let ids = b.column(0).as_any().downcast_ref::<StringViewArray>().unwrap();
        let nums = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        let strs = b.column(2).as_any().downcast_ref::<StringViewArray>().unwrap();
        let bins = b.column(3).as_any().downcast_ref::<BinaryViewArray>().unwrap();
        for r in 0..b.num_rows() {
            let s = (!strs.is_null(r)).then(|| strs.value(r).to_string());
            let x = (!bins.is_null(r)).then(|| bins.value(r).to_vec());
            got.insert(ids.value(r).to_string(), (nums.value(r), s, x));
        }
    }
    assert_eq!(got.len(), 3400);
    assert_eq!(got, model);
}

/// Covered segment files are removed off the flushing thread; closing or dropping the engine
/// finishes their removal, so an engine reopened at once (same process) never lists a file
/// that then vanishes, and a closed engine leaves no WAL file.
#[test]
fn covered_segments_are_gone_when_the_engine_closes_and_reopen_at_once_works() {
    let dir = tempfile::tempdir().unwrap();
    let mut model: BTreeMap<(i64, i32), Row> = BTreeMap::new();
    for round in 0..12_i64 {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.table("t").or_else(|_| engine.create_table("t", composite_schema(), &["k1", "k2"])).unwrap();
        assert_eq!(collect_composite(t.scan(ScanOptions::default()).unwrap()), model, "round {round}");
        // Several flushes, each covering segments, then more rows left only in the WAL.
        for part in 0..3 {
            let r = rows(round * 10_000 + part * 2_000, 2_000, "r");
            t.upsert(&composite_batch(&r)).unwrap();
            model.extend(r);
            t.flush().unwrap();
        }
        let tail = rows(round * 10_000 + 9_000, 50, "tail");
        t.insert(&composite_batch(&tail)).unwrap();
        model.extend(tail);
        drop(t);
        if round % 2 == 0 {
            drop(engine); // no close: the tail is replayed
        } else {
            engine.close().unwrap();
            assert!(wal_files(dir.path()).is_empty(), "round {round}: {:?}", wal_files(dir.path()));
        }
    }
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(collect_composite(t.scan(ScanOptions::default()).unwrap()), model);
    t.flush().unwrap();
    drop(t);
    engine.close().unwrap();
    assert!(wal_files(dir.path()).is_empty(), "{:?}", wal_files(dir.path()));
}

/// `WalSync::Relaxed`: a failed group-commit fsync is final for the engine's log. Writes after
/// it are refused with an error naming the failure, also once the disk is healthy again (a
/// later fsync that succeeds proves nothing about the pages the failed one dropped: the
/// `PostgreSQL` fsync bug of 2018), `close` reports it, and a reopen recovers every write
/// acknowledged before it.
#[test]
fn relaxed_group_commit_failure_refuses_writes_until_reopen() {
    use gritdb::vfs::FaultFs;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let fs = FaultFs::new();
    let cfg = config().wal_sync(gritdb::WalSync::Relaxed).wal_sync_interval(Duration::from_millis(50)).vfs(std::sync::Arc::new(fs.clone()));
    let engine = Engine::open(dir.path(), cfg).unwrap();
    let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
    let mut acknowledged = 0i64;
    // Each attempt: acknowledge a batch, then fail the disk until the tick tries to fsync it.
    // (When the tick fsynced the batch before the disk failed, there is nothing to sync:
    // heal and try again with a new batch.)
    let failed_tick = (0..20).any(|_| {
        t.insert(&composite_batch(&rows(acknowledged, 10, "r"))).unwrap();
        acknowledged += 10;
        let before = fs.steps();
        fs.fail_all(5);
        let start = Instant::now();
        while fs.steps() == before && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let tried = fs.steps() > before;
        fs.heal();
        tried
    });
    assert!(failed_tick, "no group-commit fsync ran while the disk failed");
    for attempt in 0..3 {
        let err = t.insert(&composite_batch(&rows(1_000 + attempt, 1, "late"))).unwrap_err().to_string();
        assert!(err.contains("earlier fsync") && err.contains("reopen"), "insert {attempt}: {err}");
        std::thread::sleep(Duration::from_millis(60)); // ticks pass; the refusal stays
    }
    let err = t.delete(&composite_keys(&[(0, 0)])).unwrap_err().to_string();
    assert!(err.contains("earlier fsync"), "{err}");
    assert_eq!(t.row_count().unwrap(), acknowledged as u64, "refused writes changed nothing");
    drop(t);
    let err = engine.close().unwrap_err().to_string();
    assert!(err.contains("earlier fsync"), "close: {err}");
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(t.row_count().unwrap(), acknowledged as u64);
    let got = collect_composite(t.scan(ScanOptions::default()).unwrap());
    let want: BTreeMap<_, _> = (0..acknowledged).step_by(10).flat_map(|from| rows(from, 10, "r")).collect();
    assert_eq!(got, want);
}

/// Two put records (`amount_column` an `Int64`): the second one's column name is changed in
/// its Arrow IPC schema, `amount_column` → `amount_colXmn`, and its checksum recomputed, so
/// the log reads it as a whole, valid record for a table it does not fit. `Engine::open` is
/// `CorruptWal` naming the segment and the record's offset, with the table's refusal as the
/// detail. Before, it was a bare `Error::Input(SchemaMismatch)` naming no file. The segment
/// restored, the directory opens with every row.
#[test]
fn a_record_whose_column_name_is_damaged_under_a_valid_checksum_is_corrupt_wal_naming_the_segment() {
    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("amount_column", DataType::Int64, true)]));
    let batch = |from: i64| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(Int64Array::from_iter_values(from..from + 10)), Arc::new(Int64Array::from_iter_values(from..from + 10))],
        )
        .unwrap()
    };
    {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.create_table("t", Arc::clone(&schema), &["k"]).unwrap();
        t.insert(&batch(0)).unwrap();
        t.insert(&batch(10)).unwrap();
        // Dropped without a flush: both records stay in the log.
    }
    let seg_path = dir.path().join("wal").join("wal-00000001.log");
    let seg = std::fs::read(&seg_path).unwrap();
    let a_len = 8 + u32::from_le_bytes(seg[..4].try_into().unwrap()) as usize;
    let b_len = 8 + u32::from_le_bytes(seg[a_len..a_len + 4].try_into().unwrap()) as usize;
    assert_eq!(a_len + b_len, seg.len(), "two records");
    let mut damaged = seg.clone();
    let name = b"amount_column";
    let at = a_len + damaged[a_len..].windows(name.len()).position(|w| w == name).expect("the column name in record b");
    damaged[at + 10] = b'X';
    let crc = crc32fast::hash(&damaged[a_len + 8..]);
    damaged[a_len + 4..a_len + 8].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&seg_path, &damaged).unwrap();
    match Engine::open(dir.path(), config()) {
        Err(Error::Storage(gritdb::StorageError::CorruptWal { path, offset, detail })) => {
            assert_eq!(path, seg_path);
            assert_eq!(offset, a_len as u64);
            assert_eq!(
                detail,
                "put record of table `t` (id 1, sequence numbers 11..=20) cannot be replayed into the table: \
                 schema mismatch: column 1 is `amount_colXmn`, expected `amount_column` (Int64)"
            );
        }
        other => panic!("expected CorruptWal naming {}: {other:?}", seg_path.display()),
    }
    std::fs::write(&seg_path, &seg).unwrap();
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 20);
}

/// A record holding a row above this engine's `max_row_bytes` (written under a larger one) is
/// `CorruptWal` naming its segment and offset at open, with a detail that says so and what
/// to do; reopened with the larger maximum, every row is back.
#[test]
fn a_record_above_max_row_bytes_names_its_segment_and_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let big = "x".repeat(100_000);
    {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let t = engine.create_table("t", composite_schema(), &["k1", "k2"]).unwrap();
        t.insert(&composite_batch(&[((1, 0), (Some(1), Some(big.clone())))])).unwrap();
    }
    let seg_path = dir.path().join("wal").join("wal-00000001.log");
    match Engine::open(dir.path(), config().max_row_bytes(10_000)) {
        Err(Error::Storage(gritdb::StorageError::CorruptWal { path, offset, detail })) => {
            assert_eq!((path, offset), (seg_path, 0));
            assert!(
                detail.starts_with("put record of table `t` (id 1, sequence numbers 1..=1) cannot be replayed into the table: row 0 encodes to "),
                "{detail}"
            );
            assert!(detail.ends_with("reopen with one at least this large to replay it)"), "{detail}");
        }
        other => panic!("expected CorruptWal: {other:?}"),
    }
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert_eq!(engine.table("t").unwrap().row_count().unwrap(), 1);
}
