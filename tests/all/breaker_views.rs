//! Adversarial checks of the third performance pass: the WAL's compact view columns
//! (Utf8View/BinaryView logged as Utf8/Binary, cast back at replay), the delta key map's
//! 12-byte slots (row lengths read back from the rows), and flush threads (caller and
//! background) under tiny limits. Every answer is compared exactly with a `BTreeMap` model.

use arrow::array::{Array, ArrayRef, AsArray, BinaryViewArray, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray, StringViewArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::{Engine, EngineConfig, Error, ScanOptions};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

// ---------------------------------------------------------------- views through the WAL

/// key Utf8View, s Utf8View?, b BinaryView?, u Utf8?, n Int64?; field and schema metadata.
fn view_schema() -> SchemaRef {
    let meta = |v: &str| HashMap::from([("origin".to_owned(), v.to_owned())]);
    Arc::new(Schema::new_with_metadata(
        vec![
            Field::new("k", DataType::Utf8View, false).with_metadata(meta("key")),
            Field::new("s", DataType::Utf8View, true).with_metadata(meta("s")),
            Field::new("b", DataType::BinaryView, true),
            Field::new("u", DataType::Utf8, true).with_metadata(meta("u")),
            Field::new("n", DataType::Int64, true),
        ],
        HashMap::from([("table".to_owned(), "breaker".to_owned())]),
    ))
}

type VRow = (Option<String>, Option<Vec<u8>>, Option<String>, Option<i64>);

/// A string of exactly `len` bytes (boundary lengths: 0, 11, 12, 13, ...).
fn text(tag: &str, len: usize) -> String {
    let mut s = format!("{tag}:");
    while s.len() < len {
        s.push(char::from(b'a' + (s.len() % 26) as u8));
    }
    s.truncate(len);
    s
}

const LENS: [usize; 9] = [0, 1, 11, 12, 13, 14, 31, 100, 12];

fn vrow(k: usize, tag: &str) -> (String, VRow) {
    // Keys of every boundary length too (distinct by their numeric suffix).
    let klen = LENS[k % LENS.len()].max(1);
    let key = format!("{}{k}", text("k", klen.saturating_sub(1)).replace(':', "_"));
    let s = (k % 7 != 3).then(|| text(tag, LENS[(k / 3) % LENS.len()]));
    let b = (k % 5 != 1).then(|| {
        let mut v = vec![0xff_u8, 0x00, 0xc3];
        v.extend(text(tag, LENS[(k / 2) % LENS.len()]).into_bytes());
        v.truncate(LENS[(k + 4) % LENS.len()]);
        v
    });
    let u = (!k.is_multiple_of(4)).then(|| text(tag, LENS[(k + 1) % LENS.len()]));
    let n = (!k.is_multiple_of(6)).then_some(k as i64 * 3);
    (key, (s, b, u, n))
}

fn vbatch(rows: &[(String, VRow)]) -> RecordBatch {
    RecordBatch::try_new(
        view_schema(),
        vec![
            Arc::new(StringViewArray::from_iter_values(rows.iter().map(|(k, _)| k.as_str()))),
            Arc::new(rows.iter().map(|(_, r)| r.0.as_deref()).collect::<StringViewArray>()),
            Arc::new(rows.iter().map(|(_, r)| r.1.as_deref()).collect::<BinaryViewArray>()),
            Arc::new(rows.iter().map(|(_, r)| r.2.as_deref()).collect::<StringArray>()),
            Arc::new(rows.iter().map(|(_, r)| r.3).collect::<Int64Array>()),
        ],
    )
    .unwrap()
}

fn vkeys(keys: &[String]) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8View, false)]));
    RecordBatch::try_new(schema, vec![Arc::new(StringViewArray::from_iter_values(keys.iter().map(String::as_str)))]).unwrap()
}

fn collect_views(t: &gritdb::Table) -> BTreeMap<String, VRow> {
    let want = view_schema();
    let mut out = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        for (g, w) in b.schema().fields().iter().zip(want.fields()) {
            assert_eq!(g.data_type(), w.data_type(), "column {} keeps its type", w.name());
        }
        let k = b.column(0).as_string_view();
        let s = b.column(1).as_string_view();
        let bin = b.column(2).as_binary_view();
        let u = b.column(3).as_string::<i32>();
        let n = b.column(4).as_primitive::<arrow::datatypes::Int64Type>();
        for i in 0..b.num_rows() {
            let row = (
                s.is_valid(i).then(|| s.value(i).to_owned()),
                bin.is_valid(i).then(|| bin.value(i).to_vec()),
                u.is_valid(i).then(|| u.value(i).to_owned()),
                n.is_valid(i).then(|| n.value(i)),
            );
            assert!(out.insert(k.value(i).to_owned(), row).is_none(), "key {} once", k.value(i));
        }
    }
    out
}

fn vconfig() -> EngineConfig {
    EngineConfig::default().memory_limit(64 << 20).flush_age(Duration::from_hours(1))
}

/// Inserts, upserts, updates and deletes of view rows (1-row, sliced, >= 1,024-row batches,
/// all-null view columns), some flushed, the rest only in the WAL; the engine is dropped
/// without close and reopened three times (writes between the first two).
#[test]
fn view_columns_survive_crash_and_replay_with_types() {
    let dir = tempfile::tempdir().unwrap();
    let mut model: BTreeMap<String, VRow> = BTreeMap::new();
    {
        let engine = Engine::open(dir.path(), vconfig()).unwrap();
        let t = engine.create_table("v", view_schema(), &["k"]).unwrap();
        // >= 1,024 rows: the overlapped WAL append.
        let big: Vec<_> = (0..3_000).map(|k| vrow(k, "a")).collect();
        t.insert(&vbatch(&big)).unwrap();
        model.extend(big.iter().cloned());
        t.flush().unwrap();
        // One-row batches, each boundary length.
        for k in 3_000..3_020 {
            let r = vec![vrow(k, "one")];
            t.insert(&vbatch(&r)).unwrap();
            model.extend(r);
        }
        // A sliced batch (the views point into buffers shared with the unsent rows).
        let wide: Vec<_> = (4_000..6_000).map(|k| vrow(k, "slice-source-longer-than-12")).collect();
        let whole = vbatch(&wide);
        t.insert(&whole.slice(700, 1_100)).unwrap();
        model.extend(wide[700..1_800].iter().cloned());
        // Upserts over flushed rows, in a sliced big batch, and all-null value columns.
        let up: Vec<_> = (2_000..3_500)
            .map(|k| {
                let (key, _) = vrow(k, "x");
                (key, (None, None, None, None))
            })
            .collect();
        t.upsert(&vbatch(&up)).unwrap();
        model.extend(up.iter().cloned());
        let up2: Vec<_> = (100..1_300).map(|k| vrow(k, "up2")).collect();
        t.upsert(&vbatch(&up2).slice(1, 1_150)).unwrap();
        model.extend(up2[1..1_151].iter().cloned());
        // Update of existing keys (1 row and many).
        let upd: Vec<_> = (10..11).chain(4_800..4_900).map(|k| vrow(k, "upd-13-bytes!")).collect();
        t.update(&vbatch(&upd)).unwrap();
        model.extend(upd.iter().cloned());
        // Deletes of flushed rows, WAL-only rows, then reinsert some.
        let dels: Vec<String> = (0..3_000).step_by(7).chain(4_700..4_750).map(|k| vrow(k, "").0).collect();
        let existing = dels.iter().filter(|k| model.contains_key(*k)).count();
        assert_eq!(t.delete(&vkeys(&dels)).unwrap(), existing);
        for k in &dels {
            model.remove(k);
        }
        let back: Vec<_> = (0..3_000).step_by(14).map(|k| vrow(k, "back")).collect();
        t.insert(&vbatch(&back)).unwrap();
        model.extend(back.iter().cloned());
        assert_eq!(collect_views(&t), model, "before the crash");
        drop(t);
        drop(engine);
    }
    for round in 0..3 {
        let engine = Engine::open(dir.path(), vconfig()).unwrap();
        let t = engine.table("v").unwrap();
        assert_eq!(t.schema(), view_schema(), "round {round}: schema with metadata");
        assert_eq!(collect_views(&t), model, "round {round}: replayed answer");
        if round == 0 {
            // Writes between the reopenings: a >= 1,024-row upsert and deletes.
            let r: Vec<_> = (9_000..10_500).map(|k| vrow(k, "r2")).collect();
            t.upsert(&vbatch(&r)).unwrap();
            model.extend(r);
            let d: Vec<String> = (9_000..9_010).map(|k| vrow(k, "").0).collect();
            assert_eq!(t.delete(&vkeys(&d)).unwrap(), 10);
            for k in &d {
                model.remove(k);
            }
        }
        drop(t);
        drop(engine);
    }
    let engine = Engine::open(dir.path(), vconfig()).unwrap();
    let t = engine.table("v").unwrap();
    t.flush().unwrap();
    assert_eq!(collect_views(&t), model, "after a flush of the replayed rows");
    drop(t);
    engine.close().unwrap();
}

/// Only view columns, the key a BinaryView; values of 12 and 13 bytes and empty ones; the
/// single-row and all-null paths, then a crash.
#[test]
fn binary_view_key_only_views_crash() {
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::BinaryView, false), Field::new("v", DataType::Utf8View, true)]));
    let mk = |rows: &[(Vec<u8>, Option<String>)]| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(rows.iter().map(|r| Some(r.0.as_slice())).collect::<BinaryViewArray>()) as ArrayRef,
                Arc::new(rows.iter().map(|r| r.1.as_deref()).collect::<StringViewArray>()),
            ],
        )
        .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let mut model: BTreeMap<Vec<u8>, Option<String>> = BTreeMap::new();
    {
        let engine = Engine::open(dir.path(), vconfig()).unwrap();
        let t = engine.create_table("b", Arc::clone(&schema), &["k"]).unwrap();
        let rows: Vec<(Vec<u8>, Option<String>)> =
            vec![(vec![], Some(String::new())), (vec![0; 12], Some("x".repeat(12))), (vec![0; 13], Some("y".repeat(13))), (vec![0xff; 11], None)];
        for r in &rows {
            t.insert(&mk(std::slice::from_ref(r))).unwrap();
            model.insert(r.0.clone(), r.1.clone());
        }
        // All-null value column, 2,000 rows.
        let many: Vec<_> = (0..2_000u32).map(|i| (i.to_be_bytes().repeat(4), None)).collect();
        t.insert(&mk(&many)).unwrap();
        model.extend(many.iter().cloned());
        // Delete with a BinaryView key (the WAL logs it as Binary).
        let keys = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("k", DataType::BinaryView, false)])),
            vec![Arc::new(BinaryViewArray::from_iter_values([vec![0u8; 12], vec![0u8; 13]])) as ArrayRef],
        )
        .unwrap();
        assert_eq!(t.delete(&keys).unwrap(), 2);
        model.remove(&vec![0u8; 12]);
        model.remove(&vec![0u8; 13]);
        drop(t);
        drop(engine);
    }
    for _ in 0..2 {
        let engine = Engine::open(dir.path(), vconfig()).unwrap();
        let t = engine.table("b").unwrap();
        let mut got = BTreeMap::new();
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            assert_eq!(b.schema().field(0).data_type(), &DataType::BinaryView);
            assert_eq!(b.schema().field(1).data_type(), &DataType::Utf8View);
            let (k, v) = (b.column(0).as_binary_view(), b.column(1).as_string_view());
            for i in 0..b.num_rows() {
                got.insert(k.value(i).to_vec(), v.is_valid(i).then(|| v.value(i).to_owned()));
            }
        }
        assert_eq!(got, model);
        drop(t);
        drop(engine);
    }
}

// ---------------------------------------------------------------- the delta key map

/// Fixed-width columns only (i64 key): many upserts of the same keys, delete and reinsert,
/// tombstones over flushed rows, and 300,000 rows (map growth).
#[test]
fn fixed_width_table_matches_model() {
    let schema =
        Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("a", DataType::Int32, true), Field::new("f", DataType::Float64, false)]));
    let mk = |rows: &[(i64, Option<i32>, f64)]| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))) as ArrayRef,
                Arc::new(rows.iter().map(|r| r.1).collect::<Int32Array>()),
                Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.2))),
            ],
        )
        .unwrap()
    };
    let keys = |ks: &[i64]| {
        RecordBatch::try_new(Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])), vec![Arc::new(Int64Array::from(ks.to_vec())) as ArrayRef])
            .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20).flush_age(Duration::from_hours(1))).unwrap();
    let t = engine.create_table("f", Arc::clone(&schema), &["k"]).unwrap();
    let mut model: BTreeMap<i64, (Option<i32>, u64)> = BTreeMap::new();
    let collect = |t: &gritdb::Table| {
        let mut out = BTreeMap::new();
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            let (k, a, f) = (
                b.column(0).as_primitive::<arrow::datatypes::Int64Type>(),
                b.column(1).as_primitive::<arrow::datatypes::Int32Type>(),
                b.column(2).as_primitive::<arrow::datatypes::Float64Type>(),
            );
            for i in 0..b.num_rows() {
                assert!(out.insert(k.value(i), (a.is_valid(i).then(|| a.value(i)), f.value(i).to_bits())).is_none());
            }
        }
        out
    };
    // 300,000 rows in 30 batches: the key map grows many times.
    for c in 0..30 {
        let rows: Vec<_> = (c * 10_000..(c + 1) * 10_000).map(|k| (k, (k % 3 != 0).then_some(k as i32), k as f64 * 0.5)).collect();
        t.insert(&mk(&rows)).unwrap();
        for r in &rows {
            model.insert(r.0, (r.1, r.2.to_bits()));
        }
    }
    assert_eq!(collect(&t), model, "after growth");
    t.flush().unwrap();
    // The replacement path: the same 1,000 keys upserted 50 times.
    for round in 0..50 {
        let rows: Vec<_> = (0..1_000).map(|k| (k * 7, (round % 2 == 0).then_some(round), f64::from(round) + k as f64)).collect();
        t.upsert(&mk(&rows)).unwrap();
        for r in &rows {
            model.insert(r.0, (r.1, r.2.to_bits()));
        }
    }
    // Tombstones over flushed rows, delete then reinsert in the same delta.
    let gone: Vec<i64> = (100_000..150_000).collect();
    assert_eq!(t.delete(&keys(&gone)).unwrap(), 50_000);
    for k in &gone {
        model.remove(k);
    }
    let back: Vec<_> = (100_000..100_500).map(|k| (k, None, -1.0)).collect();
    t.insert(&mk(&back)).unwrap();
    for r in &back {
        model.insert(r.0, (r.1, r.2.to_bits()));
    }
    assert_eq!(t.delete(&keys(&[100_000, 100_001, 1, 7])).unwrap(), 4);
    for k in [100_000, 100_001, 1, 7] {
        model.remove(&k);
    }
    // Deleting them again counts nothing.
    assert_eq!(t.delete(&keys(&[100_000, 100_001, 1, 7, 100_002 + 1_000])).unwrap(), 0);
    assert_eq!(collect(&t), model, "before flush");
    assert_eq!(t.row_count().unwrap(), model.len() as u64);
    t.flush().unwrap();
    assert_eq!(collect(&t), model, "after flush");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    assert_eq!(collect(&engine.table("f").unwrap()), model, "after reopen");
    engine.close().unwrap();
}

/// Only variable-length columns (Utf8 key, Utf8 value), keys whose rows differ in length
/// at each replacement (the slot's row length is read back from the row).
#[test]
fn variable_length_only_table_matches_model() {
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, false), Field::new("v", DataType::Utf8, true)]));
    let mk = |rows: &[(String, Option<String>)]| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0.as_str()))) as ArrayRef,
                Arc::new(rows.iter().map(|r| r.1.as_deref()).collect::<StringArray>()),
            ],
        )
        .unwrap()
    };
    let keys = |ks: &[String]| {
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, false)])),
            vec![Arc::new(StringArray::from_iter_values(ks.iter().map(String::as_str))) as ArrayRef],
        )
        .unwrap()
    };
    let collect = |t: &gritdb::Table| {
        let mut out = BTreeMap::new();
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            let (k, v) = (b.column(0).as_string::<i32>(), b.column(1).as_string::<i32>());
            for i in 0..b.num_rows() {
                assert!(out.insert(k.value(i).to_owned(), v.is_valid(i).then(|| v.value(i).to_owned())).is_none());
            }
        }
        out
    };
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(128 << 20).flush_age(Duration::from_hours(1))).unwrap();
    let t = engine.create_table("s", Arc::clone(&schema), &["k"]).unwrap();
    let mut model: BTreeMap<String, Option<String>> = BTreeMap::new();
    let key = |k: usize| "k".repeat(k % 40) + &k.to_string();
    for c in 0..10 {
        let rows: Vec<_> = (c * 20_000..(c + 1) * 20_000).map(|k| (key(k), (k % 11 != 0).then(|| "v".repeat(k % 70)))).collect();
        t.insert(&mk(&rows)).unwrap();
        model.extend(rows);
    }
    t.flush().unwrap();
    for round in 0..40usize {
        // Each round changes every value's length (longer, shorter, null, empty).
        let rows: Vec<_> = (0..2_000)
            .map(|k| {
                (
                    key(k * 3),
                    match round % 4 {
                        0 => None,
                        1 => Some(String::new()),
                        2 => Some("L".repeat(300 + round)),
                        _ => Some("s".repeat(round)),
                    },
                )
            })
            .collect();
        t.upsert(&mk(&rows)).unwrap();
        model.extend(rows);
        if round % 10 == 9 {
            let d: Vec<String> = (0..2_000).step_by(5).map(|k| key(k * 3)).collect();
            let want = d.iter().filter(|k| model.contains_key(*k)).count();
            assert_eq!(t.delete(&keys(&d)).unwrap(), want, "round {round}");
            for k in &d {
                model.remove(k);
            }
        }
    }
    assert_eq!(collect(&t), model, "deltas over files");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(128 << 20)).unwrap();
    let t = engine.table("s").unwrap();
    assert_eq!(collect(&t), model, "after crash and replay");
    t.flush().unwrap();
    assert_eq!(collect(&t), model, "after flush");
    drop(t);
    engine.close().unwrap();
}

// ---------------------------------------------------------------- flush threads

fn frows(from: i64, n: i64, tag: &str) -> Vec<(String, VRow)> {
    (from..from + n).map(|k| vrow(k as usize, tag)).collect()
}

/// Every value of both thread settings (0 clamps to 1), under a 12 MiB limit with
/// background flushes and backpressure: exact answers, and the flush categories back at the
/// baseline after drop_table.
#[test]
fn flush_threads_settings_under_tiny_limit() {
    for (fg, bg) in [(0, 0), (1, 1), (2, 2), (3, 3), (64, 64), (1, 64), (64, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let config =
            EngineConfig::default().memory_limit(12 << 20).flush_threads(fg).background_flush_threads(bg).backpressure_timeout(Duration::from_secs(60));
        let engine = Engine::open(dir.path(), config).unwrap();
        let base: Vec<usize> = Category::ALL.iter().map(|c| engine.memory().category_bytes(*c)).collect();
        let t = engine.create_table("t", view_schema(), &["k"]).unwrap();
        let mut model = BTreeMap::new();
        for c in 0..12 {
            let rows = frows(c * 5_000, 5_000, &format!("r{c}"));
            t.upsert(&vbatch(&rows)).unwrap_or_else(|e| panic!("{fg}/{bg}: {e:?}"));
            model.extend(rows);
        }
        let d: Vec<String> = (0..60_000).step_by(9).map(|k| vrow(k, "").0).collect();
        t.delete(&vkeys(&d)).unwrap();
        for k in &d {
            model.remove(k);
        }
        assert_eq!(collect_views(&t), model, "{fg}/{bg} before flush");
        t.flush().unwrap();
        assert_eq!(collect_views(&t), model, "{fg}/{bg} after flush");
        drop(t);
        engine.drop_table("t").unwrap();
        let now: Vec<usize> = Category::ALL.iter().map(|c| engine.memory().category_bytes(*c)).collect();
        for ((c, b), n) in Category::ALL.iter().zip(&base).zip(&now) {
            if *c != Category::FreeChunks {
                assert_eq!(n, b, "{fg}/{bg}: {c:?} back at the baseline after drop_table");
            }
        }
        engine.close().unwrap();
    }
}

/// drop_table while background flushes of it run (writes from another thread), 8 MiB limit.
#[test]
fn drop_table_during_background_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(8 << 20).background_flush_threads(2).flush_threads(3);
    let engine = Arc::new(Engine::open(dir.path(), config).unwrap());
    let base: Vec<usize> = Category::ALL.iter().map(|c| engine.memory().category_bytes(*c)).collect();
    for round in 0..6 {
        let t = engine.create_table("d", view_schema(), &["k"]).unwrap();
        let writer = {
            let t = t.clone();
            std::thread::spawn(move || {
                for c in 0..200 {
                    match t.upsert(&vbatch(&frows(c * 2_000, 2_000, "w"))) {
                        Ok(_) => {}
                        Err(Error::TableNotFound { .. }) => return c,
                        Err(e) => panic!("round {round}: untyped or unexpected error {e:?}"),
                    }
                }
                200
            })
        };
        std::thread::sleep(Duration::from_millis(30 + 20 * round as u64));
        engine.drop_table("d").unwrap();
        let _ = writer.join().unwrap();
        drop(t);
        let now: Vec<usize> = Category::ALL.iter().map(|c| engine.memory().category_bytes(*c)).collect();
        for ((c, b), n) in Category::ALL.iter().zip(&base).zip(&now) {
            if *c != Category::FreeChunks {
                assert_eq!(n, b, "round {round}: {c:?} back at the baseline after drop_table");
            }
        }
    }
    assert!(engine.table_names().is_empty());
}

/// A view column's WAL copy (logged as offsets) is counted once: the IPC encoder writes the
/// copy's buffers as they are, and the record used to count them again beside the copy. At
/// 2 MiB a 2-row insert of two 404 KB values was refused as a `Utf8View` ("requested 790.7
/// KiB for write_buffers", helper-48's F1) where `Utf8` took it. Now each byte type takes it,
/// reads it back, flushes it and replays it at the same limit, and `write_buffers` comes back
/// to 0.
#[test]
fn two_values_near_the_row_bound_are_written_as_views_at_a_small_limit() {
    const LIMIT: usize = 2 << 20;
    const LEN: usize = 404_000;
    for data_type in [DataType::Utf8, DataType::Binary, DataType::Utf8View, DataType::BinaryView] {
        let dir = tempfile::tempdir().unwrap();
        let config = || EngineConfig::default().memory_limit(LIMIT).backpressure_timeout(Duration::from_secs(5));
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("s", data_type.clone(), true)]));
        let (a, b) = ("a".repeat(LEN), "b".repeat(LEN));
        let values = arrow::compute::cast(&StringArray::from(vec![a.as_str(), b.as_str()]), &data_type).unwrap();
        let batch = RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(Int64Array::from(vec![1, 2])), values]).unwrap();
        // (key, length, first byte) of every row.
        let read = |t: &gritdb::Table| -> Vec<(i64, usize, u8)> {
            let mut rows = Vec::new();
            for batch in t.scan(ScanOptions::default()).unwrap() {
                let batch = batch.unwrap();
                let s = arrow::compute::cast(batch.column(1), &DataType::Binary).unwrap();
                let (k, s) = (batch.column(0).as_primitive::<arrow::datatypes::Int64Type>(), s.as_binary::<i32>());
                rows.extend((0..batch.num_rows()).map(|i| (k.value(i), s.value(i).len(), s.value(i)[0])));
            }
            rows.sort_unstable();
            rows
        };
        let want = vec![(1, LEN, b'a'), (2, LEN, b'b')];
        {
            let engine = Engine::open(dir.path(), config()).unwrap();
            let t = engine.create_table("t", Arc::clone(&schema), &["k"]).unwrap();
            assert_eq!(t.insert(&batch).unwrap_or_else(|e| panic!("{data_type}: {e}")), 2);
            settled_write_buffers(&engine, &data_type);
            assert_eq!(read(&t), want, "{data_type}");
            t.flush().unwrap_or_else(|e| panic!("{data_type}: {e}"));
            assert_eq!(read(&t), want, "{data_type}");
            // Upserted over themselves: the old rows stay until the new ones are in.
            assert_eq!(t.upsert(&batch.slice(1, 1)).unwrap_or_else(|e| panic!("{data_type}: {e}")), 1);
            assert_eq!(read(&t), want, "{data_type}");
        }
        // Dropped without close: the upsert replays from the log at the same limit.
        let engine = Engine::open(dir.path(), config()).unwrap();
        assert_eq!(read(&engine.table("t").unwrap()), want, "{data_type}");
        settled_write_buffers(&engine, &data_type);
        engine.close().unwrap();
    }
}

/// Waits (up to 20 s) for `write_buffers` to come back to 0: the WAL record is released when
/// the write returns, but a background flush's Parquet writer counts there too while it runs.
fn settled_write_buffers(engine: &Engine, what: &DataType) {
    let start = std::time::Instant::now();
    while engine.memory().category_bytes(Category::WriteBuffers) != 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "{what}: write_buffers {} bytes", engine.memory().category_bytes(Category::WriteBuffers));
        std::thread::sleep(Duration::from_millis(5));
    }
}
