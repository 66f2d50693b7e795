//! Breaker pass 9: commit 41e2e8c (the WAL logs `Utf8View` / `BinaryView` columns as `Binary`
//! offset columns through a hand-written `views_to_binary`, replay casts `Binary` back with
//! `safe: false`) and commit def2309 (`BackgroundPriority::Batch(n)`: background flush threads
//! under `SCHED_BATCH` at nice max(n, current)).
//!
//! The WAL half writes view columns in unusual layouts (many small data buffers, concatenated
//! and `take`n arrays, nulls hiding long values, slices of bigger arrays, `gc`, views made from
//! an offset array), values at the inline boundary (12 / 13 bytes) with multi-byte UTF-8
//! characters, non-UTF-8 `BinaryView` keys, empty and all-null columns and big values, in both
//! sync modes and on both WAL paths (under and over 1,024 rows), and compares every row with a
//! model after drop-without-close + reopen (replay), twice, and after a flush.
//!
//! The priority half checks the nice range, that no caller's thread ever changes scheduling,
//! that flush threads get what the doc says (SCHED_BATCH at max(n, inherited nice); SCHED_IDLE
//! left alone), and that Batch(19) / Batch(0) at 8–16 MiB with many writers, drops, closes and
//! table churn still flushes everything and loses nothing.

use arrow::array::{
    Array, ArrayRef, AsArray, BinaryArray, BinaryViewArray, BinaryViewBuilder, BooleanArray, Int64Array, RecordBatch, StringViewArray, UInt32Array,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::{BackgroundPriority, Engine, EngineConfig, Error, ScanOptions, Table, WalSync};
use gritdb_tests::{current_thread_sched, process_threads};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

// ------------------------------------------------------------------------ view layouts

/// Lengths cycled through: inline boundary (12 / 13), empty, long, very long.
const LENS: [usize; 12] = [0, 1, 11, 12, 13, 14, 31, 100, 12, 13, 4000, 2];

/// A UTF-8 string of exactly `len` bytes mixing 1-, 2-, 3- and 4-byte characters (so a
/// character can end exactly at byte 12 or straddle it).
fn utf(k: usize, len: usize) -> String {
    const CH: [char; 6] = ['é', 'a', '😀', 'z', '中', 'Q'];
    let mut s = String::with_capacity(len);
    let mut i = k;
    while s.len() < len {
        let c = CH[i % CH.len()];
        i += 1;
        if s.len() + c.len_utf8() <= len {
            s.push(c);
        } else {
            s.push('.');
        }
    }
    assert_eq!(s.len(), len);
    s
}

/// Bytes that are not UTF-8 (high bit set on every byte), exactly `len` long.
fn raw(k: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 37 + k) as u8) | 0x80).collect()
}

/// Number of layouts [`layout`] knows.
const LAYOUTS: usize = 9;

/// A `BinaryViewArray` holding `vals` (logically) in layout `mode`:
/// 0 plain, 1 many 32-byte data buffers, 2 concatenation of two halves, 3 `take` in reverse
/// of a reversed array, 4 nulls hiding long (and short) values (`nullif`), 5 a slice of a
/// bigger array, 6 `gc` of layout 4, 7 views over one offset buffer (`From<&BinaryArray>`),
/// 8 concatenation of a slice and a `nullif`.
fn layout(vals: &[Option<Vec<u8>>], mode: usize) -> BinaryViewArray {
    let filler = |i: usize| if i.is_multiple_of(2) { b"hidden-filler-value-longer-than-12-bytes".to_vec() } else { b"short".to_vec() };
    let plain = |v: &[Option<Vec<u8>>]| v.iter().map(|x| x.as_deref()).collect::<BinaryViewArray>();
    let blocks = |v: &[Option<Vec<u8>>], size: u32| {
        let mut b = BinaryViewBuilder::new().with_fixed_block_size(size);
        for x in v {
            b.append_option(x.as_deref());
        }
        b.finish()
    };
    let hidden = |v: &[Option<Vec<u8>>]| {
        let full: Vec<Option<Vec<u8>>> = v.iter().enumerate().map(|(i, x)| Some(x.clone().unwrap_or_else(|| filler(i)))).collect();
        let arr = blocks(&full, 64);
        let mask: BooleanArray = v.iter().map(|x| Some(x.is_none())).collect();
        let out = arrow::compute::nullif(&arr, &mask).unwrap();
        out.as_binary_view().clone()
    };
    let sliced = |v: &[Option<Vec<u8>>]| {
        let mut big: Vec<Option<Vec<u8>>> = (0..37).map(|i| Some(filler(i))).collect();
        big.extend(v.iter().cloned());
        big.extend((0..11).map(|i| (i % 3 != 0).then(|| filler(i))));
        blocks(&big, 256).slice(37, v.len())
    };
    let out = match mode {
        0 => plain(vals),
        1 => blocks(vals, 32),
        2 => {
            let h = vals.len() / 2;
            let (a, b) = (blocks(&vals[..h], 64), plain(&vals[h..]));
            arrow::compute::concat(&[&a, &b]).unwrap().as_binary_view().clone()
        }
        3 => {
            let rev: Vec<_> = vals.iter().rev().cloned().collect();
            let arr = blocks(&rev, 48);
            let n = vals.len() as u32;
            let idx: UInt32Array = (0..n).map(|i| n - 1 - i).collect();
            arrow::compute::take(&arr, &idx, None).unwrap().as_binary_view().clone()
        }
        4 => hidden(vals),
        5 => sliced(vals),
        6 => hidden(vals).gc(),
        7 => {
            let b: BinaryArray = vals.iter().map(|x| x.as_deref()).collect();
            BinaryViewArray::from(&b)
        }
        8 => {
            let h = vals.len() / 3;
            let (a, b) = (sliced(&vals[..h]), hidden(&vals[h..]));
            arrow::compute::concat(&[&a, &b]).unwrap().as_binary_view().clone()
        }
        _ => unreachable!(),
    };
    assert_eq!(out.len(), vals.len());
    let back: Vec<Option<Vec<u8>>> = out.iter().map(|x| x.map(<[u8]>::to_vec)).collect();
    assert_eq!(back, vals, "layout {mode} holds the values");
    out
}

fn slayout(vals: &[Option<String>], mode: usize) -> StringViewArray {
    let b: Vec<Option<Vec<u8>>> = vals.iter().map(|v| v.as_ref().map(|s| s.as_bytes().to_vec())).collect();
    layout(&b, mode).to_string_view().unwrap()
}

// ------------------------------------------------------------------ table k / s / b / t / n

/// s Utf8View?, b BinaryView?, t Utf8View (not null), n Int64?
type VRow = (Option<String>, Option<Vec<u8>>, String, Option<i64>);
type VModel = BTreeMap<String, VRow>;

fn vschema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8View, false),
        Field::new("s", DataType::Utf8View, true),
        Field::new("b", DataType::BinaryView, true),
        Field::new("t", DataType::Utf8View, false),
        Field::new("n", DataType::Int64, true),
    ]))
}

fn key(k: usize) -> String {
    // Keys of 7, 12, 13 and 24 bytes (the number first, so they are distinct).
    let len = [7, 12, 13, 24][k % 4];
    let mut s = format!("{k:06}-");
    let pad = utf(k, len - s.len());
    s.push_str(&pad);
    s
}

fn vrow(k: usize, tag: usize) -> (String, VRow) {
    let s = (k % 5 != 2).then(|| utf(k + tag, LENS[(k + tag) % LENS.len()]));
    let b = (k % 4 != 1).then(|| raw(k + tag, LENS[(k / 2 + tag) % LENS.len()]));
    let t = utf(k * 3 + tag, LENS[(k / 3 + tag) % LENS.len()]);
    let n = (!k.is_multiple_of(6)).then_some((k * 10 + tag) as i64);
    (key(k), (s, b, t, n))
}

fn vbatch(rows: &[(String, VRow)], mode: usize) -> RecordBatch {
    let k: Vec<Option<String>> = rows.iter().map(|(k, _)| Some(k.clone())).collect();
    let s: Vec<Option<String>> = rows.iter().map(|(_, r)| r.0.clone()).collect();
    let b: Vec<Option<Vec<u8>>> = rows.iter().map(|(_, r)| r.1.clone()).collect();
    let t: Vec<Option<String>> = rows.iter().map(|(_, r)| Some(r.2.clone())).collect();
    RecordBatch::try_new(
        vschema(),
        vec![
            Arc::new(slayout(&k, (mode + 3) % LAYOUTS)) as ArrayRef,
            Arc::new(slayout(&s, mode)),
            Arc::new(layout(&b, (mode + 1) % LAYOUTS)),
            Arc::new(slayout(&t, (mode + 5) % LAYOUTS)),
            Arc::new(rows.iter().map(|(_, r)| r.3).collect::<Int64Array>()),
        ],
    )
    .unwrap()
}

fn vkeys(keys: &[String], mode: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8View, false)]));
    let k: Vec<Option<String>> = keys.iter().map(|k| Some(k.clone())).collect();
    RecordBatch::try_new(schema, vec![Arc::new(slayout(&k, mode))]).unwrap()
}

fn vcontents(t: &Table) -> VModel {
    let want = vschema();
    let mut out = VModel::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        for (g, w) in b.schema().fields().iter().zip(want.fields()) {
            assert_eq!(g.data_type(), w.data_type(), "column {} keeps its type", w.name());
        }
        let (k, s, bin, tt) = (b.column(0).as_string_view(), b.column(1).as_string_view(), b.column(2).as_binary_view(), b.column(3).as_string_view());
        let n = b.column(4).as_primitive::<arrow::datatypes::Int64Type>();
        assert_eq!(k.null_count(), 0);
        assert_eq!(tt.null_count(), 0);
        for i in 0..b.num_rows() {
            let row = (
                s.is_valid(i).then(|| s.value(i).to_owned()),
                bin.is_valid(i).then(|| bin.value(i).to_vec()),
                tt.value(i).to_owned(),
                n.is_valid(i).then(|| n.value(i)),
            );
            assert!(out.insert(k.value(i).to_owned(), row).is_none(), "key {:?} once", k.value(i));
        }
    }
    out
}

/// First differing key between two models (a short message instead of a huge dump).
fn same(got: &VModel, want: &VModel, what: &str) {
    if got == want {
        return;
    }
    let diff = want
        .iter()
        .find(|(k, v)| got.get(*k) != Some(v))
        .map(|(k, v)| format!("key {k:?}: want {v:?}, got {:?}", got.get(k)))
        .or_else(|| got.keys().find(|k| !want.contains_key(*k)).map(|k| format!("extra key {k:?}")));
    panic!("{what}: {} rows, want {}; first difference: {diff:?}", got.len(), want.len());
}

fn vconfig(sync: WalSync) -> EngineConfig {
    EngineConfig::default().memory_limit(192 << 20).wal_sync(sync).flush_age(Duration::from_secs(3600))
}

/// Every layout on both WAL paths (300 rows inline, 1,100 rows pooled), upserts, updates and
/// deletes keyed by `Utf8View` keys in every layout, one flush in the middle; then two
/// drop-without-close + reopen rounds (replay) and a flush of the replayed rows.
fn layouts_replay(sync: WalSync) {
    let dir = tempfile::tempdir().unwrap();
    let mut model = VModel::new();
    {
        let engine = Engine::open(dir.path(), vconfig(sync)).unwrap();
        let t = engine.create_table("v", vschema(), &["k"]).unwrap();
        for mode in 0..LAYOUTS {
            let base = mode * 2_000;
            let small: Vec<_> = (base..base + 300).map(|k| vrow(k, mode)).collect();
            assert_eq!(t.insert(&vbatch(&small, mode)).unwrap(), 300);
            model.extend(small);
            let big: Vec<_> = (base + 300..base + 1_400).map(|k| vrow(k, mode)).collect();
            assert_eq!(t.insert(&vbatch(&big, mode)).unwrap(), 1_100);
            model.extend(big);
            // Upsert over half of both, plus new keys (1,200 rows: pooled).
            let up: Vec<_> = (base + 150..base + 1_350).map(|k| vrow(k, mode + 100)).collect();
            t.upsert(&vbatch(&up, (mode + 2) % LAYOUTS)).unwrap();
            model.extend(up);
            // Update 50 (inline).
            let upd: Vec<_> = (base + 10..base + 60).map(|k| vrow(k, mode + 200)).collect();
            assert_eq!(t.update(&vbatch(&upd, (mode + 4) % LAYOUTS)).unwrap(), 50);
            model.extend(upd);
            // Delete 1 in 9 plus keys that never existed.
            let mut dels: Vec<String> = (base..base + 1_400).step_by(9).map(key).collect();
            dels.extend((base + 1_500..base + 1_510).map(key));
            let existing = dels.iter().filter(|k| model.contains_key(*k)).count();
            assert_eq!(t.delete(&vkeys(&dels, (mode + 6) % LAYOUTS)).unwrap(), existing, "mode {mode} deletes");
            for k in &dels {
                model.remove(k);
            }
            if mode == 4 {
                t.flush().unwrap();
            }
        }
        same(&vcontents(&t), &model, "live");
        drop(t);
        drop(engine);
    }
    for round in 0..2 {
        let engine = Engine::open(dir.path(), vconfig(sync)).unwrap();
        let t = engine.table("v").unwrap();
        same(&vcontents(&t), &model, &format!("after reopen {round}"));
        if round == 0 {
            // More writes between the crashes: a big upsert and deletes in odd layouts.
            let up: Vec<_> = (50_000..51_100).map(|k| vrow(k, 7)).collect();
            t.upsert(&vbatch(&up, 8)).unwrap();
            model.extend(up);
            let d: Vec<String> = (50_000..50_040).map(key).collect();
            assert_eq!(t.delete(&vkeys(&d, 4)).unwrap(), 40);
            for k in &d {
                model.remove(k);
            }
        }
        drop(t);
        drop(engine);
    }
    let engine = Engine::open(dir.path(), vconfig(sync)).unwrap();
    let t = engine.table("v").unwrap();
    t.flush().unwrap();
    same(&vcontents(&t), &model, "after flushing the replayed rows");
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), vconfig(sync)).unwrap();
    same(&vcontents(&engine.table("v").unwrap()), &model, "after close + reopen");
}

#[test]
fn view_layouts_replay_exactly_per_batch() {
    layouts_replay(WalSync::PerBatch);
}

#[test]
fn view_layouts_replay_exactly_relaxed() {
    layouts_replay(WalSync::Relaxed);
}

/// A `BinaryView` key of non-UTF-8 bytes (12 and 13 bytes long, and 1 and 40), a not-null
/// `Utf8View` value and a nullable `BinaryView` value: inserts, upserts and deletes by
/// `BinaryView` keys in every layout, small and big; crash; reopen twice.
#[test]
fn binary_view_key_non_utf8_replays() {
    let schema = Arc::new(Schema::new(vec![
        Field::new("bk", DataType::BinaryView, false),
        Field::new("s", DataType::Utf8View, false),
        Field::new("v", DataType::BinaryView, true),
    ]));
    let bkey = |k: usize| {
        let len = [12, 13, 1, 40][k % 4];
        let mut v = raw(k, len);
        // Distinct: the index in the first bytes (still not UTF-8: 0xff never is).
        let id = (k as u32).to_le_bytes();
        let n = len.min(4);
        v[..n].copy_from_slice(&id[..n]);
        if len > 4 {
            v[4] = 0xff;
        }
        v
    };
    // 1-byte keys only for k < 256 distinct: keep k % 4 == 2 keys below 256.
    let keys_of = |from: usize, n: usize| -> Vec<usize> { (from..from + n).filter(|k| k % 4 != 2 || *k < 256).collect() };
    type BModel = BTreeMap<Vec<u8>, (String, Option<Vec<u8>>)>;
    let row = |k: usize, tag: usize| {
        (bkey(k), (utf(k + tag, LENS[(k + tag) % LENS.len()]), (!k.is_multiple_of(3)).then(|| raw(k * 7 + tag, LENS[(k + 2 * tag) % LENS.len()]))))
    };
    let batch = |rows: &[(Vec<u8>, (String, Option<Vec<u8>>))], mode: usize| {
        let k: Vec<Option<Vec<u8>>> = rows.iter().map(|r| Some(r.0.clone())).collect();
        let s: Vec<Option<String>> = rows.iter().map(|r| Some(r.1.0.clone())).collect();
        let v: Vec<Option<Vec<u8>>> = rows.iter().map(|r| r.1.1.clone()).collect();
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(layout(&k, mode)) as ArrayRef, Arc::new(slayout(&s, (mode + 1) % LAYOUTS)), Arc::new(layout(&v, (mode + 2) % LAYOUTS))],
        )
        .unwrap()
    };
    let kschema = Arc::new(Schema::new(vec![Field::new("bk", DataType::BinaryView, false)]));
    let contents = |t: &Table| -> BModel {
        let mut out = BModel::new();
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            assert_eq!(b.schema().field(0).data_type(), &DataType::BinaryView);
            let (k, s, v) = (b.column(0).as_binary_view(), b.column(1).as_string_view(), b.column(2).as_binary_view());
            for i in 0..b.num_rows() {
                assert!(out.insert(k.value(i).to_vec(), (s.value(i).to_owned(), v.is_valid(i).then(|| v.value(i).to_vec()))).is_none());
            }
        }
        out
    };
    let dir = tempfile::tempdir().unwrap();
    let mut model = BModel::new();
    {
        let engine = Engine::open(dir.path(), vconfig(WalSync::PerBatch)).unwrap();
        let t = engine.create_table("b", Arc::clone(&schema), &["bk"]).unwrap();
        for mode in 0..LAYOUTS {
            let base = 300 + mode * 3_000;
            for (from, n) in [(base, 200), (base + 200, 1_500)] {
                let rows: Vec<_> = keys_of(from, n).into_iter().map(|k| row(k, mode)).collect();
                assert_eq!(t.insert(&batch(&rows, mode)).unwrap(), rows.len());
                model.extend(rows);
            }
            let up: Vec<_> = keys_of(base + 100, 1_200).into_iter().map(|k| row(k, mode + 50)).collect();
            t.upsert(&batch(&up, (mode + 3) % LAYOUTS)).unwrap();
            model.extend(up);
            let dels: Vec<Option<Vec<u8>>> = keys_of(base, 1_700).into_iter().step_by(5).map(|k| Some(bkey(k))).collect();
            let existing = dels.iter().flatten().filter(|k| model.contains_key(*k)).count();
            let kb = RecordBatch::try_new(Arc::clone(&kschema), vec![Arc::new(layout(&dels, (mode + 4) % LAYOUTS))]).unwrap();
            assert_eq!(t.delete(&kb).unwrap(), existing);
            for k in dels.iter().flatten() {
                model.remove(k);
            }
        }
        // The small keys (1 byte, 0..256).
        let tiny: Vec<_> = keys_of(0, 256).into_iter().map(|k| row(k, 9)).collect();
        t.insert(&batch(&tiny, 5)).unwrap();
        model.extend(tiny);
        assert_eq!(contents(&t), model, "live");
        drop(t);
        drop(engine);
    }
    for round in 0..2 {
        let engine = Engine::open(dir.path(), vconfig(WalSync::PerBatch)).unwrap();
        let t = engine.table("b").unwrap();
        assert_eq!(contents(&t).len(), model.len(), "round {round}: rows");
        assert!(contents(&t) == model, "round {round}: replayed values");
        if round == 1 {
            t.flush().unwrap();
            assert!(contents(&t) == model, "flushed after replay");
        }
    }
}

/// Batches whose view columns hold only empty strings and nulls (zero value bytes: the
/// compacted column's buffer is empty) on both paths, one all-null nullable column, then a
/// crash and reopen; and a batch of a few big values (256 KiB) among inline ones, in many
/// data buffers and sliced.
#[test]
fn empty_all_null_and_big_view_values_replay() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = VModel::new();
    {
        let engine = Engine::open(dir.path(), vconfig(WalSync::PerBatch)).unwrap();
        let t = engine.create_table("v", vschema(), &["k"]).unwrap();
        for (i, n) in [(0usize, 1usize), (1, 5), (2, 1_023), (3, 1_024), (4, 3_000)] {
            let rows: Vec<_> = (0..n).map(|j| (key(i * 10_000 + j), (None, (j % 2 == 0).then(Vec::new), String::new(), None))).collect();
            assert_eq!(t.insert(&vbatch(&rows, i * 2 % LAYOUTS)).unwrap(), n);
            model.extend(rows);
        }
        // Overwrite some empty rows with big values: 256 KiB values every 97th row.
        let big: Vec<_> = (0..2_500)
            .map(|j| {
                let (k, mut r) = vrow(40_000 + j, 1);
                if j % 97 == 0 {
                    r.0 = Some(utf(j, 256 << 10));
                    r.1 = Some(raw(j, (256 << 10) + 1));
                }
                (k, r)
            })
            .collect();
        for mode in [1, 5, 8] {
            t.upsert(&vbatch(&big, mode)).unwrap();
        }
        model.extend(big.iter().cloned());
        // A slice from the middle of the big batch (offset not a multiple of anything).
        let up: Vec<_> = big.iter().map(|(k, r)| (k.clone(), (r.0.clone(), None, format!("{}!", r.2), r.3))).collect();
        let b = vbatch(&up, 2);
        t.upsert(&b.slice(333, 1_777)).unwrap();
        model.extend(up[333..333 + 1_777].iter().cloned());
        same(&vcontents(&t), &model, "live");
        drop(t);
        drop(engine);
    }
    let engine = Engine::open(dir.path(), vconfig(WalSync::PerBatch)).unwrap();
    let t = engine.table("v").unwrap();
    same(&vcontents(&t), &model, "replayed");
    t.flush().unwrap();
    same(&vcontents(&t), &model, "flushed");
}

/// Replay under a much smaller limit than the write: the record is replayed in slices
/// (`rec.batch.slice`) of a `Binary` column cast back to views; each slice keeps the right
/// values. Written at 192 MiB in 4,000-row records with 4 KiB values, replayed at 12 MiB.
#[test]
fn replay_in_slices_at_a_smaller_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = VModel::new();
    {
        let engine = Engine::open(dir.path(), vconfig(WalSync::PerBatch)).unwrap();
        let t = engine.create_table("v", vschema(), &["k"]).unwrap();
        for r in 0..3 {
            let rows: Vec<_> = (r * 4_000..(r + 1) * 4_000)
                .map(|k| {
                    let (key, mut row) = vrow(k, r);
                    if k % 3 == 0 {
                        row.0 = Some(utf(k, 4_000));
                    }
                    (key, row)
                })
                .collect();
            t.insert(&vbatch(&rows, r * 3 % LAYOUTS)).unwrap();
            model.extend(rows);
        }
        let dels: Vec<String> = (0..12_000).step_by(11).map(key).collect();
        assert_eq!(t.delete(&vkeys(&dels, 1)).unwrap(), dels.len());
        for k in &dels {
            model.remove(k);
        }
        drop(t);
        drop(engine);
    }
    let small = EngineConfig::default().memory_limit(12 << 20).flush_age(Duration::from_secs(3600));
    let engine = Engine::open(dir.path(), small.clone()).unwrap();
    same(&vcontents(&engine.table("v").unwrap()), &model, "replayed at 12 MiB");
    drop(engine);
    let engine = Engine::open(dir.path(), small).unwrap();
    same(&vcontents(&engine.table("v").unwrap()), &model, "second replay at 12 MiB");
}

// ------------------------------------------------------------------------ priorities

/// (policy, nice) of the calling thread.
fn my_sched() -> (u32, i32) {
    let s = current_thread_sched();
    (s.policy, s.nice)
}

/// (name, (policy, nice)) of every thread of the process.
fn threads() -> Vec<(String, (u32, i32))> {
    process_threads().into_iter().map(|t| (t.name, (t.policy, t.nice))).collect()
}

const SCHED_OTHER: u32 = 0;
const SCHED_BATCH: u32 = 3;
const SCHED_IDLE: u32 = 5;

fn prio_config(p: BackgroundPriority, limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).background_priority(p).backpressure_timeout(Duration::from_secs(15)).flush_age(Duration::from_secs(3600))
}

type IModel = BTreeMap<i64, (i64, String)>;

fn ischema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("v", DataType::Int64, false), Field::new("s", DataType::Utf8View, false)]))
}

fn irows(from: i64, n: i64, tag: i64) -> Vec<(i64, (i64, String))> {
    (from..from + n).map(|k| (k, (k * 3 + tag, format!("{k}-{tag}-{}", "p".repeat((k % 40) as usize))))).collect()
}

fn ibatch(rows: &[(i64, (i64, String))]) -> RecordBatch {
    RecordBatch::try_new(
        ischema(),
        vec![
            Arc::new(rows.iter().map(|r| r.0).collect::<Int64Array>()) as ArrayRef,
            Arc::new(rows.iter().map(|r| r.1.0).collect::<Int64Array>()),
            Arc::new(StringViewArray::from_iter_values(rows.iter().map(|r| r.1.1.as_str()))),
        ],
    )
    .unwrap()
}

fn icontents(t: &Table) -> IModel {
    let mut out = IModel::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let (id, v, s) = (
            b.column(0).as_primitive::<arrow::datatypes::Int64Type>(),
            b.column(1).as_primitive::<arrow::datatypes::Int64Type>(),
            b.column(2).as_string_view(),
        );
        for i in 0..b.num_rows() {
            assert!(out.insert(id.value(i), (v.value(i), s.value(i).to_owned())).is_none());
        }
    }
    out
}

/// Batch(n) outside 0..=19 is Error::Config and leaves the directory usable; 0 and 19 open.
#[test]
fn batch_nice_out_of_range_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    for n in [-1i8, -20, i8::MIN, 20, 21, i8::MAX] {
        match Engine::open(dir.path(), EngineConfig::default().background_priority(BackgroundPriority::Batch(n))) {
            Err(Error::Config(msg)) => assert!(msg.contains(&format!("Batch({n})")), "{msg}"),
            other => panic!("Batch({n}): want Error::Config, got {other:?}"),
        }
    }
    for n in [0i8, 19] {
        let e = Engine::open(dir.path(), EngineConfig::default().background_priority(BackgroundPriority::Batch(n))).unwrap();
        e.close().unwrap();
    }
    assert_eq!(EngineConfig::default().background_priority, BackgroundPriority::Inherit);
}

/// Many writers at a small limit with background flushes under `p`: every write succeeds
/// (backpressure 15 s), the writers' and the opener's threads keep their scheduling, the
/// contents match after close + reopen.
fn many_writers(p: BackgroundPriority, limit: usize) {
    let me = my_sched();
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), prio_config(p, limit).table_flush_bytes(1 << 20)).unwrap();
    let tables: Vec<Table> = (0..6).map(|i| engine.create_table(&format!("t{i}"), ischema(), &["id"]).unwrap()).collect();
    let start = Instant::now();
    let models: Vec<IModel> = std::thread::scope(|s| {
        let hs: Vec<_> = tables
            .iter()
            .enumerate()
            .map(|(i, t)| {
                s.spawn(move || {
                    let before = my_sched();
                    let mut m = IModel::new();
                    for b in 0..30i64 {
                        // Alternate pooled (1,500) and inline (300) writes; upsert over old keys.
                        let n = if b % 2 == 0 { 1_500 } else { 300 };
                        let rows = irows(b * 1_000, n, i as i64);
                        t.upsert(&ibatch(&rows)).unwrap_or_else(|e| panic!("writer {i} batch {b} ({:?} in): {e}", start.elapsed()));
                        m.extend(rows);
                    }
                    assert_eq!(my_sched(), before, "writer {i}'s scheduling unchanged");
                    m
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(my_sched(), me, "the opener's scheduling unchanged");
    let flushed: usize = tables.iter().map(|t| t.stats().unwrap().files).sum();
    assert!(flushed > 0, "background flushes ran");
    for (t, m) in tables.iter().zip(&models) {
        assert!(icontents(t) == *m, "table {} live", t.name());
        assert_eq!(t.stats().unwrap().last_flush_error, None);
    }
    drop(tables);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), prio_config(p, limit)).unwrap();
    for (i, m) in models.iter().enumerate() {
        assert!(icontents(&engine.table(&format!("t{i}")).unwrap()) == *m, "table t{i} after reopen");
    }
    assert_eq!(my_sched(), me);
}

#[test]
fn batch19_many_writers_at_12_mib() {
    many_writers(BackgroundPriority::Batch(19), 12 << 20);
}

#[test]
fn batch0_many_writers_at_8_mib() {
    many_writers(BackgroundPriority::Batch(0), 8 << 20);
}

#[test]
fn inherit_many_writers_at_8_mib() {
    many_writers(BackgroundPriority::Inherit, 8 << 20);
}

/// The opener runs at nice 13 (a dedicated thread): with Batch(2) the flush threads it starts
/// run SCHED_BATCH at nice 13 (never raised to 2), the opener stays SCHED_OTHER at 13.
/// With an opener under SCHED_IDLE (nice 11) and Batch(5), every engine thread stays SCHED_IDLE
/// at nice 11.
#[test]
fn flush_threads_follow_the_opener_and_callers_never_change() {
    fn run(nice: i32, idle: bool, p: BackgroundPriority) -> (Vec<(u32, i32)>, (u32, i32)) {
        std::thread::spawn(move || {
            // SAFETY: no pointers (setpriority); `param` outlives the call.
            unsafe {
                assert_eq!(libc::setpriority(libc::PRIO_PROCESS, 0, nice), 0);
                if idle {
                    let param = libc::sched_param { sched_priority: 0 };
                    assert_eq!(libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const param), 0);
                }
            }
            let me = my_sched();
            assert_eq!(me, (if idle { SCHED_IDLE } else { SCHED_OTHER }, nice));
            let dir = tempfile::tempdir().unwrap();
            let engine = Engine::open(dir.path(), prio_config(p, 64 << 20).table_flush_bytes(256 << 10)).unwrap();
            let t = engine.create_table("t", ischema(), &["id"]).unwrap();
            let mut m = IModel::new();
            for b in 0..6 {
                let rows = irows(b * 2_000, 2_000, 1);
                t.insert(&ibatch(&rows)).unwrap();
                m.extend(rows);
            }
            let start = Instant::now();
            while t.stats().unwrap().files == 0 {
                assert!(start.elapsed() < Duration::from_secs(15), "no background flush");
                std::thread::sleep(Duration::from_millis(5));
            }
            // Our engine's threads: the only gritdb-writer threads at this nice value (other
            // tests open from nice-0 threads).
            let ours: Vec<(u32, i32)> = threads().into_iter().filter(|(n, (_, ni))| n.starts_with("gritdb-writer") && *ni == nice).map(|(_, s)| s).collect();
            assert_eq!(my_sched(), me, "opener unchanged by its own writes");
            assert!(icontents(&t) == m);
            t.flush().unwrap();
            assert_eq!(my_sched(), me, "opener unchanged by a flush it waits for");
            drop(t);
            engine.close().unwrap();
            (ours, my_sched())
        })
        .join()
        .unwrap()
    }
    let (ours, me) = run(13, false, BackgroundPriority::Batch(2));
    assert_eq!(me, (SCHED_OTHER, 13));
    assert!(ours.contains(&(SCHED_BATCH, 13)), "a flush thread under SCHED_BATCH at nice 13: {ours:?}");
    assert!(ours.iter().all(|s| s.1 == 13), "{ours:?}");
    let (ours, me) = run(11, true, BackgroundPriority::Batch(5));
    assert_eq!(me, (SCHED_IDLE, 11));
    assert!(!ours.is_empty());
    assert!(ours.iter().all(|s| *s == (SCHED_IDLE, 11)), "SCHED_IDLE threads left alone: {ours:?}");
}

/// Batch(19): the engine is dropped (and, in a second round, closed) while background flushes
/// run; another thread creates and drops tables meanwhile. Nothing acknowledged is lost.
#[test]
fn drop_close_and_table_churn_during_low_priority_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = || prio_config(BackgroundPriority::Batch(19), 16 << 20).table_flush_bytes(512 << 10);
    let mut model = IModel::new();
    for round in 0..4i64 {
        let engine = Engine::open(dir.path(), cfg()).unwrap();
        let t = match engine.table("t") {
            Ok(t) => t,
            Err(_) => engine.create_table("t", ischema(), &["id"]).unwrap(),
        };
        assert!(icontents(&t) == model, "round {round}: contents at open");
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let churn = s.spawn(|| {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    let name = format!("churn{round}_{i}");
                    let c = engine.create_table(&name, ischema(), &["id"]).unwrap();
                    c.insert(&ibatch(&irows(0, 1_200, i))).unwrap();
                    drop(c);
                    engine.drop_table(&name).unwrap();
                    i += 1;
                }
                i
            });
            for b in 0..12 {
                let rows = irows(round * 100_000 + b * 1_500, 1_500, round);
                t.insert(&ibatch(&rows)).unwrap();
                model.extend(rows);
            }
            stop.store(true, std::sync::atomic::Ordering::Release);
            assert!(churn.join().unwrap() > 0);
        });
        drop(t);
        if round % 2 == 0 {
            drop(engine);
        } else {
            engine.close().unwrap();
        }
    }
    let engine = Engine::open(dir.path(), cfg()).unwrap();
    assert!(icontents(&engine.table("t").unwrap()) == model, "final");
    let names = engine.table_names();
    assert_eq!(names, vec!["t".to_owned()], "churn tables all dropped");
}
