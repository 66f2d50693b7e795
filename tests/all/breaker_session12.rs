//! Breaker pass 12: commit f5e0dd2 (the WAL logs Decimal128 columns of precision <= 18 as
//! Decimal64 and replay widens them back), commit 79098b0 (a flush / compaction builds its
//! key-index set off the table's state lock) and commit d57ba07 (a write refused beside a
//! flush that has since ended retries instead of giving up).
//!
//! Decimals: composite decimal keys (narrowed and not), value columns of precision 1, 9, 18
//! (narrowed) and 19, 38 (not), negative scales, scale = precision, ±(10^p − 1), nulls,
//! nullable vs not; big (early record) and small and sliced batches; upsert / update /
//! delete by decimal key; drop without close, an image of the directory taken while the
//! engine is open, and a replay at a much smaller limit (sliced replay), every cell compared.
//!
//! Key index: drop_table and close while background flushes and compactions run, concurrent
//! inserters racing on the same keys (never a duplicate; the winners exactly), deletes and
//! re-inserts racing flushes, memory categories back to their baseline exactly, key_index
//! equal to a rebuilt index after reopen.
//!
//! Backpressure: a batch that can never fit fails promptly (idle and beside busy flushes, CPU
//! time measured), many writers at 4–8 MiB with big batches never hang, writers during close.

use arrow::array::{Array, ArrayRef, AsArray, Decimal128Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Decimal128Type, Field, Int64Type, Schema, SchemaRef};
use gritdb::memory::Category;
use gritdb::{Engine, EngineConfig, Error, ScanOptions, Table};
use gritdb_tests::mix;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

use crate::breaker_slices::copy_dir;

/// Every category but the pool's cached free chunks.
fn cats(engine: &Engine) -> Vec<(Category, usize)> {
    Category::ALL.iter().filter(|c| **c != Category::FreeChunks).map(|c| (*c, engine.memory().category_bytes(*c))).collect()
}

fn used_wo_free(engine: &Engine) -> usize {
    engine.memory().used() - engine.memory().category_bytes(Category::FreeChunks)
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec the call writes.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

// =====================================================================================
// 1. Decimals through the WAL
// =====================================================================================

fn p10(p: u32) -> i128 {
    10i128.pow(p) - 1
}

/// (name, precision, scale, nullable) of the value columns.
const DEC_COLS: [(&str, u8, i8, bool); 10] = [
    ("c1", 1, 0, true),
    ("c1s", 1, 1, false),
    ("c9", 9, 4, true),
    ("c9s", 9, 9, true),
    ("c18", 18, 18, true),
    ("c18nn", 18, 3, false),
    ("c18s1", 18, 1, true),
    ("c19", 19, 2, true),
    ("c38", 38, 38, true),
    ("c38n", 38, 10, false),
];

fn dec_schema() -> SchemaRef {
    let mut f = vec![Field::new("k1", DataType::Decimal128(18, 2), false), Field::new("k2", DataType::Decimal128(38, 0), false)];
    for (n, p, s, null) in DEC_COLS {
        f.push(Field::new(n, DataType::Decimal128(p, s), null));
    }
    Arc::new(Schema::new(f))
}

fn dec_key_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k1", DataType::Decimal128(18, 2), false), Field::new("k2", DataType::Decimal128(38, 0), false)]))
}

/// Key id -> (k1, k2): extremes of both precisions at ids 0..4.
fn dec_key(id: i64) -> (i128, i128) {
    let i = i128::from(id);
    let k1 = match id {
        0 => p10(18),
        1 => -p10(18),
        2 => p10(18) - 1,
        3 => -p10(18) + 1,
        _ => (i - 50_000) * 123_456_789_012,
    };
    let k2 = match id.rem_euclid(3) {
        0 => p10(38) - i,
        1 => -p10(38) + i,
        _ => i * 100_000_000_000_000_000_000,
    };
    (k1, k2)
}

/// The cell of column `c` for key id `id` at version `ver`.
fn dec_cell(c: usize, id: i64, ver: u64) -> Option<i128> {
    let (_, p, _, null) = DEC_COLS[c];
    let h = mix((id as u64).wrapping_mul(0x9e37_79b9) ^ ver.wrapping_mul(1_000_003) ^ (c as u64) << 50);
    let m = p10(u32::from(p));
    match h % 9 {
        0 | 1 if null => None,
        0 => Some(m),
        1 => Some(-m),
        2 => Some(m),
        3 => Some(-m),
        4 => Some(0),
        5 => Some(1),
        6 => Some(-1),
        _ => {
            let v = i128::from((h >> 8) as i64).rem_euclid(m.min(i128::from(i64::MAX)) + 1) % (m + 1);
            Some(if h & 1 == 0 { v } else { -v })
        }
    }
}

fn dec_batch(rows: &[(i64, u64)]) -> RecordBatch {
    let mut cols: Vec<ArrayRef> = Vec::new();
    let keys: Vec<(i128, i128)> = rows.iter().map(|r| dec_key(r.0)).collect();
    cols.push(Arc::new(Decimal128Array::from_iter_values(keys.iter().map(|k| k.0)).with_precision_and_scale(18, 2).unwrap()));
    cols.push(Arc::new(Decimal128Array::from_iter_values(keys.iter().map(|k| k.1)).with_precision_and_scale(38, 0).unwrap()));
    for (c, (_, p, s, _)) in DEC_COLS.iter().enumerate() {
        let v: Vec<Option<i128>> = rows.iter().map(|&(id, ver)| dec_cell(c, id, ver)).collect();
        cols.push(Arc::new(Decimal128Array::from(v).with_precision_and_scale(*p, *s).unwrap()));
    }
    RecordBatch::try_new(dec_schema(), cols).unwrap()
}

fn dec_keys(ids: &[i64]) -> RecordBatch {
    let keys: Vec<(i128, i128)> = ids.iter().map(|&i| dec_key(i)).collect();
    RecordBatch::try_new(
        dec_key_schema(),
        vec![
            Arc::new(Decimal128Array::from_iter_values(keys.iter().map(|k| k.0)).with_precision_and_scale(18, 2).unwrap()) as ArrayRef,
            Arc::new(Decimal128Array::from_iter_values(keys.iter().map(|k| k.1)).with_precision_and_scale(38, 0).unwrap()),
        ],
    )
    .unwrap()
}

struct DecModel {
    rows: BTreeMap<i64, u64>,
    by_key: HashMap<(i128, i128), i64>,
    ver: u64,
}

impl DecModel {
    fn new() -> Self {
        Self { rows: BTreeMap::new(), by_key: HashMap::new(), ver: 0 }
    }

    fn rows(&mut self, ids: impl IntoIterator<Item = i64>) -> Vec<(i64, u64)> {
        self.ver += 1;
        let ver = self.ver;
        ids.into_iter()
            .map(|id| {
                self.by_key.insert(dec_key(id), id);
                (id, ver)
            })
            .collect()
    }

    /// Every cell of the table against the model, plus exact per-column sums.
    #[track_caller]
    fn check(&self, t: &Table, what: &str) {
        let want_schema = dec_schema();
        let mut seen = BTreeSet::new();
        let mut sums = [0i128; DEC_COLS.len()];
        let mut nulls = [0usize; DEC_COLS.len()];
        for b in t.scan(ScanOptions::default()).unwrap() {
            let b = b.unwrap();
            for (g, w) in b.schema().fields().iter().zip(want_schema.fields()) {
                assert_eq!(g.data_type(), w.data_type(), "{what}: column {}", w.name());
            }
            let cols: Vec<_> = (0..b.num_columns()).map(|i| b.column(i).as_primitive::<Decimal128Type>().clone()).collect();
            for r in 0..b.num_rows() {
                let key = (cols[0].value(r), cols[1].value(r));
                let id = *self.by_key.get(&key).unwrap_or_else(|| panic!("{what}: unknown key {key:?}"));
                assert!(seen.insert(id), "{what}: key id {id} twice");
                let ver = *self.rows.get(&id).unwrap_or_else(|| panic!("{what}: key id {id} should not exist"));
                for c in 0..DEC_COLS.len() {
                    let got = (!cols[c + 2].is_null(r)).then(|| cols[c + 2].value(r));
                    let want = dec_cell(c, id, ver);
                    assert_eq!(got, want, "{what}: id {id} ver {ver} column {}", DEC_COLS[c].0);
                    sums[c] += got.unwrap_or(0);
                    nulls[c] += usize::from(got.is_none());
                }
            }
        }
        assert_eq!(seen.len(), self.rows.len(), "{what}: row count");
        for c in 0..DEC_COLS.len() {
            let want: i128 = self.rows.iter().map(|(&id, &v)| dec_cell(c, id, v).unwrap_or(0)).sum();
            let wn = self.rows.iter().filter(|(id, v)| dec_cell(c, **id, **v).is_none()).count();
            assert_eq!((sums[c], nulls[c]), (want, wn), "{what}: sum / nulls of {}", DEC_COLS[c].0);
        }
        assert_eq!(t.row_count().unwrap(), self.rows.len() as u64, "{what}: row_count");
    }
}

fn dec_config(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600))
}

/// Composite decimal keys and ten decimal value columns (narrowed and not, negative scales,
/// scale = precision, extremes, nulls) through big, small and sliced inserts, upserts,
/// updates and deletes by key (plain and sliced key batches), on both sides of a flush;
/// compared cell for cell after drop without close (replay), after an image of the directory
/// taken while the engine is open, and after close.
#[test]
fn decimal_columns_of_every_precision_survive_replay_and_images() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = DecModel::new();
    {
        let engine = Engine::open(dir.path(), dec_config(256 * MIB)).unwrap();
        let t = engine.create_table("d", dec_schema(), &["k1", "k2"]).unwrap();
        // A big batch (early record path), with the extreme keys.
        let rows = m.rows(0..3000);
        assert_eq!(t.insert(&dec_batch(&rows)).unwrap(), 3000);
        m.rows.extend(rows.iter().copied());
        // A slice of a big batch (offset into the parent's buffers, null bitmaps unaligned).
        let rows = m.rows(3000..6000);
        let whole = dec_batch(&rows);
        let slice = whole.slice(701, 1501);
        assert_eq!(t.insert(&slice).unwrap(), 1501);
        m.rows.extend(rows[701..701 + 1501].iter().copied());
        // Small sliced batches (1..7 rows, odd offsets).
        let rows = m.rows(7000..7100);
        let whole = dec_batch(&rows);
        let mut at = 0;
        for len in (1..8).cycle() {
            if at + len > 100 {
                break;
            }
            if at % 3 != 0 {
                assert_eq!(t.insert(&whole.slice(at, len)).unwrap(), len);
                m.rows.extend(rows[at..at + len].iter().copied());
            }
            at += len;
        }
        m.check(&t, "live");
        t.flush().unwrap();
        m.check(&t, "flushed");
        // Upserts over file rows and new rows; updates; deletes by key (some sliced).
        let rows = m.rows((0..6000).step_by(7).chain(8000..8050));
        assert_eq!(t.upsert(&dec_batch(&rows)).unwrap(), rows.len());
        m.rows.extend(rows.iter().copied());
        let ids: Vec<i64> = m.rows.keys().copied().filter(|id| id % 11 == 3 || *id < 4).collect();
        let rows = m.rows(ids);
        assert_eq!(t.update(&dec_batch(&rows)).unwrap(), rows.len());
        m.rows.extend(rows.iter().copied());
        let del: Vec<i64> = m.rows.keys().copied().filter(|id| id % 13 == 5 || *id == 1).collect();
        assert_eq!(t.delete(&dec_keys(&del)).unwrap(), del.len());
        for id in &del {
            m.rows.remove(id);
        }
        let del2: Vec<i64> = m.rows.keys().copied().filter(|id| id % 17 == 2).collect();
        let kb = dec_keys(&del2);
        let (a, b) = (3usize, kb.num_rows() - 3);
        assert_eq!(t.delete(&kb.slice(a, b - a)).unwrap(), b - a);
        for id in &del2[a..b] {
            m.rows.remove(id);
        }
        m.check(&t, "after upsert/update/delete");
        drop(t);
        drop(engine); // no close: replay
    }
    {
        let engine = Engine::open(dir.path(), dec_config(256 * MIB)).unwrap();
        let t = engine.table("d").unwrap();
        m.check(&t, "replayed after drop without close");
        // More writes, then an image of the open directory (per-batch fsync: everything
        // acknowledged is in the image).
        let rows = m.rows(20_000..22_000);
        assert_eq!(t.upsert(&dec_batch(&rows)).unwrap(), 2000);
        m.rows.extend(rows.iter().copied());
        let del: Vec<i64> = (20_000..22_000).step_by(3).collect();
        assert_eq!(t.delete(&dec_keys(&del)).unwrap(), del.len());
        for id in &del {
            m.rows.remove(id);
        }
        let img = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), img.path());
        {
            let e2 = Engine::open(img.path(), dec_config(256 * MIB)).unwrap();
            m.check(&e2.table("d").unwrap(), "image of the open directory");
            e2.close().unwrap();
        }
        m.check(&t, "live after image");
        drop(t);
        engine.close().unwrap();
    }
    let engine = Engine::open(dir.path(), dec_config(256 * MIB)).unwrap();
    m.check(&engine.table("d").unwrap(), "after close and reopen");
    engine.close().unwrap();
}

/// ~40 MB of decimal rows logged at 512 MiB (nothing flushed), replayed after drop without
/// close at 24 MiB (the replay flushes inline and applies records in slices), then at 16 MiB
/// after more unflushed writes and deletes: every cell compared.
#[test]
fn decimal_wal_replayed_at_a_much_smaller_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = DecModel::new();
    {
        let engine = Engine::open(dir.path(), dec_config(512 * MIB).table_flush_bytes(256 * MIB)).unwrap();
        let t = engine.create_table("d", dec_schema(), &["k1", "k2"]).unwrap();
        for chunk in 0..20 {
            let rows = m.rows(chunk * 10_000..(chunk + 1) * 10_000);
            assert_eq!(t.insert(&dec_batch(&rows)).unwrap(), 10_000);
            m.rows.extend(rows.iter().copied());
        }
        let rows = m.rows((0..200_000).step_by(5));
        assert_eq!(t.upsert(&dec_batch(&rows)).unwrap(), rows.len());
        m.rows.extend(rows.iter().copied());
        let del: Vec<i64> = (0..200_000).filter(|i| i % 9 == 4).collect();
        assert_eq!(t.delete(&dec_keys(&del)).unwrap(), del.len());
        for id in &del {
            m.rows.remove(id);
        }
        assert_eq!(t.stats().unwrap().files, 0, "nothing flushed");
        drop(t);
        drop(engine);
    }
    {
        let engine = Engine::open(dir.path(), dec_config(24 * MIB)).unwrap();
        let t = engine.table("d").unwrap();
        m.check(&t, "replayed at 24 MiB");
        for c in 0..6 {
            let rows = m.rows(300_000 + c * 5000..300_000 + (c + 1) * 5000);
            assert_eq!(t.upsert(&dec_batch(&rows)).unwrap(), rows.len());
            m.rows.extend(rows.iter().copied());
        }
        drop(t);
        drop(engine);
    }
    let engine = Engine::open(dir.path(), dec_config(16 * MIB)).unwrap();
    m.check(&engine.table("d").unwrap(), "replayed at 16 MiB");
    engine.close().unwrap();
}

/// A single-column decimal key of each narrowed precision (1, 9, 18) and of 19 and 38, one
/// nullable value column of the same type, keys at ±(10^p − 1): insert, delete by key,
/// re-insert, replay.
#[test]
fn single_decimal_keys_of_each_precision_replay() {
    for (p, s) in [(1u8, 0i8), (1, 1), (9, 5), (9, 9), (18, 0), (18, 18), (18, 9), (19, 0), (38, 3), (38, 38)] {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Decimal128(p, s), false), Field::new("v", DataType::Decimal128(p, s), true)]));
        let kschema = Arc::new(Schema::new(vec![Field::new("k", DataType::Decimal128(p, s), false)]));
        let m = p10(u32::from(p));
        let mut keys: Vec<i128> = vec![m, -m, 0];
        if p > 1 {
            keys.extend([m - 1, -m + 1, 1, -1]);
            keys.extend((1..2000).map(|i| (i * 7_919_191) % m - m / 2));
        } else {
            keys.extend(-8..=8);
        }
        keys.sort_unstable();
        keys.dedup();
        let val =
            |k: i128, ver: i128| -> Option<i128> { if (k + ver) % 5 == 0 { None } else { Some(((k + ver * 3) % m + m) % m * if k < 0 { -1 } else { 1 }) } };
        let batch = |ks: &[i128], ver: i128| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(Decimal128Array::from_iter_values(ks.iter().copied()).with_precision_and_scale(p, s).unwrap()) as ArrayRef,
                    Arc::new(Decimal128Array::from(ks.iter().map(|&k| val(k, ver)).collect::<Vec<_>>()).with_precision_and_scale(p, s).unwrap()),
                ],
            )
            .unwrap()
        };
        let kbatch = |ks: &[i128]| {
            RecordBatch::try_new(
                Arc::clone(&kschema),
                vec![Arc::new(Decimal128Array::from_iter_values(ks.iter().copied()).with_precision_and_scale(p, s).unwrap()) as ArrayRef],
            )
            .unwrap()
        };
        let read = |t: &Table| {
            let mut out = BTreeMap::new();
            for b in t.scan(ScanOptions::default()).unwrap() {
                let b = b.unwrap();
                assert_eq!(b.schema().field(0).data_type(), &DataType::Decimal128(p, s));
                let k = b.column(0).as_primitive::<Decimal128Type>();
                let v = b.column(1).as_primitive::<Decimal128Type>();
                for i in 0..b.num_rows() {
                    assert!(out.insert(k.value(i), (!v.is_null(i)).then(|| v.value(i))).is_none());
                }
            }
            out
        };
        let mut model: BTreeMap<i128, Option<i128>> = BTreeMap::new();
        {
            let engine = Engine::open(dir.path(), dec_config(128 * MIB)).unwrap();
            let t = engine.create_table("t", Arc::clone(&schema), &["k"]).unwrap();
            assert_eq!(t.insert(&batch(&keys, 1)).unwrap(), keys.len(), "p{p} s{s}");
            model.extend(keys.iter().map(|&k| (k, val(k, 1))));
            let del: Vec<i128> = keys.iter().copied().step_by(3).collect();
            assert_eq!(t.delete(&kbatch(&del)).unwrap(), del.len());
            for k in &del {
                model.remove(k);
            }
            let re: Vec<i128> = del.iter().copied().step_by(2).collect();
            assert_eq!(t.insert(&batch(&re, 2)).unwrap(), re.len());
            model.extend(re.iter().map(|&k| (k, val(k, 2))));
            assert_eq!(read(&t), model, "p{p} s{s}: live");
            drop(t);
            drop(engine);
        }
        let engine = Engine::open(dir.path(), dec_config(128 * MIB)).unwrap();
        let t = engine.table("t").unwrap();
        assert_eq!(read(&t), model, "p{p} s{s}: replayed");
        // Inserting an existing extreme key is still refused after replay.
        for k in [m, -m] {
            let r = t.insert(&batch(&[k], 9));
            if let std::collections::btree_map::Entry::Vacant(e) = model.entry(k) {
                assert_eq!(r.unwrap(), 1, "p{p} s{s} key {k}");
                e.insert(val(k, 9));
            } else {
                assert!(matches!(r, Err(Error::KeyExists { .. })), "p{p} s{s} key {k}: {r:?}");
            }
        }
        assert_eq!(read(&t), model, "p{p} s{s}: after re-insert of the extremes");
        drop(t);
        engine.close().unwrap();
    }
}

// =====================================================================================
// 2. Key-index sets built off the state lock
// =====================================================================================

pub(crate) fn kv_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, false), Field::new("s", DataType::Utf8, true)]))
}

pub(crate) fn kv_batch(keys: &[i64], ver: i64, pad: usize) -> RecordBatch {
    let s: Vec<String> = keys.iter().map(|k| format!("{k}:{ver}:{}", "x".repeat(pad))).collect();
    RecordBatch::try_new(
        kv_schema(),
        vec![Arc::new(Int64Array::from(keys.to_vec())) as ArrayRef, Arc::new(Int64Array::from(vec![ver; keys.len()])), Arc::new(StringArray::from(s))],
    )
    .unwrap()
}

pub(crate) fn kv_keys(keys: &[i64]) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
    RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(keys.to_vec())) as ArrayRef]).unwrap()
}

/// key -> version, asserting no key appears twice.
pub(crate) fn kv_read(t: &Table) -> BTreeMap<i64, i64> {
    let mut out = BTreeMap::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<Int64Type>();
        let v = b.column(1).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            if let Some(old) = out.insert(k.value(i), v.value(i)) {
                panic!("key {} twice in a scan (versions {old} and {})", k.value(i), v.value(i));
            }
        }
    }
    out
}

fn churn_config(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).table_flush_bytes(64 << 10).flush_age(Duration::from_millis(5)).backpressure_timeout(Duration::from_secs(20))
}

/// Eight threads insert batches drawn from one shared key space (every batch overlaps
/// others) into one table at a 12 MiB limit with 64 KiB flushes (constant flushes and
/// compactions). An insert is all or nothing: the keys of the accepted batches must be
/// pairwise disjoint, and the table must hold exactly them (no key twice in a scan), live,
/// after flush_all, and after drop without close.
#[test]
fn racing_inserters_never_duplicate_a_key_across_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), churn_config(12 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let accepted: Mutex<Vec<(usize, Vec<i64>)>> = Mutex::new(Vec::new());
    let refused_other = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs(6);
    std::thread::scope(|s| {
        for w in 0..8usize {
            let (t, accepted, refused_other, stop) = (&t, &accepted, &refused_other, &stop);
            s.spawn(move || {
                let mut i = 0u64;
                while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let h = mix((w as u64) << 40 | i);
                    let n = [1usize, 7, 64, 300, 1100][(h % 5) as usize];
                    let base = ((h >> 8) % 60_000) as i64;
                    let step = 1 + ((h >> 30) % 3) as i64;
                    let keys: Vec<i64> = (0..n as i64).map(|j| base + j * step).collect();
                    match t.insert(&kv_batch(&keys, (w as i64) << 32 | i as i64, 24)) {
                        Ok(k) => {
                            assert_eq!(k, n);
                            accepted.lock().unwrap().push((w, keys));
                        }
                        Err(Error::KeyExists { .. }) => {}
                        Err(e) => {
                            refused_other.fetch_add(1, Ordering::Relaxed);
                            if !e.is_memory_limit() {
                                stop.store(true, Ordering::Relaxed);
                                panic!("writer {w}: {e}");
                            }
                        }
                    }
                }
            });
        }
        // Readers scanning meanwhile: never a key twice.
        s.spawn(|| {
            while Instant::now() < deadline {
                let _ = kv_read(&t);
            }
        });
    });
    let accepted = accepted.into_inner().unwrap();
    let mut model: BTreeMap<i64, i64> = BTreeMap::new();
    let mut owners: HashMap<i64, usize> = HashMap::new();
    for (w, keys) in &accepted {
        for k in keys {
            if let Some(o) = owners.insert(*k, *w) {
                panic!("key {k} accepted twice (writers {o} and {w})");
            }
            model.insert(*k, 0);
        }
    }
    eprintln!("racing inserters: {} accepted batches, {} keys, {} memory refusals", accepted.len(), model.len(), refused_other.load(Ordering::Relaxed));
    assert!(accepted.len() > 50, "too few accepted batches to mean anything");
    let check = |t: &Table, what: &str| {
        let got = kv_read(t);
        assert_eq!(got.len(), model.len(), "{what}: row count");
        assert!(got.keys().eq(model.keys()), "{what}: key sets differ");
        assert_eq!(t.row_count().unwrap(), model.len() as u64, "{what}");
    };
    check(&t, "live");
    engine.flush_all().unwrap();
    check(&t, "after flush_all");
    // Every accepted key is still refused by an insert.
    for (_, keys) in accepted.iter().step_by(7) {
        assert!(matches!(t.insert(&kv_batch(&keys[..1], -1, 0)), Err(Error::KeyExists { .. })));
    }
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), churn_config(12 * MIB)).unwrap();
    check(&engine.table("t").unwrap(), "replayed");
    engine.close().unwrap();
}

/// Per thread a private key range with a deterministic model: insert, delete, re-insert,
/// upsert, update racing background flushes and compactions of the same table at 8 MiB. The
/// table equals the union of the thread models exactly (live, flushed, replayed, reopened);
/// a refused write (memory) applies nothing (the model is checked after each refusal).
#[test]
fn deletes_and_reinserts_racing_flushes_keep_exact_contents() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), churn_config(8 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let models: Vec<BTreeMap<i64, i64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..6i64)
            .map(|w| {
                let t = &t;
                s.spawn(move || {
                    let mut m: BTreeMap<i64, i64> = BTreeMap::new();
                    let base = w * 1_000_000;
                    let deadline = Instant::now() + Duration::from_secs(5);
                    let mut ver = 0i64;
                    while Instant::now() < deadline {
                        ver += 1;
                        let h = mix((w as u64) << 32 | ver as u64);
                        let lo = base + ((h >> 4) % 5000) as i64;
                        let n = [1i64, 10, 200, 1500][(h % 4) as usize];
                        let keys: Vec<i64> = (lo..lo + n).collect();
                        let op = (h >> 40) % 4;
                        let res = match op {
                            0 => {
                                let fresh: Vec<i64> = keys.iter().copied().filter(|k| !m.contains_key(k)).collect();
                                if fresh.is_empty() {
                                    continue;
                                }
                                let r = t.insert(&kv_batch(&fresh, ver, 16));
                                if r.is_ok() {
                                    m.extend(fresh.iter().map(|&k| (k, ver)));
                                }
                                r.map(|_| ())
                            }
                            1 => {
                                let r = t.delete(&kv_keys(&keys));
                                if let Ok(d) = r {
                                    let want = keys.iter().filter(|k| m.contains_key(k)).count();
                                    assert_eq!(d, want, "writer {w}: deleted count");
                                    for k in &keys {
                                        m.remove(k);
                                    }
                                }
                                r.map(|_| ())
                            }
                            2 => {
                                let r = t.upsert(&kv_batch(&keys, ver, 16));
                                if r.is_ok() {
                                    m.extend(keys.iter().map(|&k| (k, ver)));
                                }
                                r.map(|_| ())
                            }
                            _ => {
                                let present: Vec<i64> = keys.iter().copied().filter(|k| m.contains_key(k)).collect();
                                if present.is_empty() {
                                    continue;
                                }
                                let r = t.update(&kv_batch(&present, ver, 16));
                                if r.is_ok() {
                                    m.extend(present.iter().map(|&k| (k, ver)));
                                }
                                r.map(|_| ())
                            }
                        };
                        match res {
                            Ok(()) => {}
                            Err(e) if e.is_memory_limit() => {
                                // Nothing of the refused write may be visible.
                                let mut got = BTreeMap::new();
                                let lo_k = kv_keys(&[base]);
                                drop(lo_k);
                                for b in t.scan(ScanOptions::default()).unwrap() {
                                    let b = b.unwrap();
                                    let k = b.column(0).as_primitive::<Int64Type>();
                                    let v = b.column(1).as_primitive::<Int64Type>();
                                    for i in 0..b.num_rows() {
                                        if (base..base + 1_000_000).contains(&k.value(i)) {
                                            got.insert(k.value(i), v.value(i));
                                        }
                                    }
                                }
                                assert_eq!(got, m, "writer {w}: a refused write left something behind (op {op})");
                            }
                            Err(e) => panic!("writer {w}: {e}"),
                        }
                    }
                    m
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let model: BTreeMap<i64, i64> = models.into_iter().flatten().collect();
    assert_eq!(kv_read(&t), model, "live");
    engine.flush_all().unwrap();
    assert_eq!(kv_read(&t), model, "flushed");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), churn_config(8 * MIB)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model, "replayed");
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), churn_config(8 * MIB)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), model, "reopened");
    engine.close().unwrap();
}

/// drop_table while writers keep a table's background flushes and compactions busy (16 MiB,
/// 64 KiB flushes), repeated; a second table lives on beside it. After each drop (and once
/// no flush is in flight) every category is back to what it was before the dropped table
/// was created, exactly, and the survivor's key_index equals what a reopen rebuilds.
#[test]
fn drop_table_during_flushes_returns_every_category_to_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), churn_config(16 * MIB)).unwrap();
    let keep = engine.create_table("keep", kv_schema(), &["k"]).unwrap();
    let mut keep_model = BTreeMap::new();
    for i in 0..20 {
        let keys: Vec<i64> = (i * 1000..(i + 1) * 1000).collect();
        keep.insert(&kv_batch(&keys, 1, 8)).unwrap();
        keep_model.extend(keys.iter().map(|&k| (k, 1i64)));
    }
    engine.flush_all().unwrap();
    wait_until("quiet", Duration::from_secs(20), || engine.flushes_in_flight() == 0);
    let base = cats(&engine);
    let base_used = used_wo_free(&engine);
    for round in 0..8 {
        let name = format!("tmp{round}");
        let t = engine.create_table(&name, kv_schema(), &["k"]).unwrap();
        let stop = AtomicBool::new(false);
        let written = AtomicU64::new(0);
        std::thread::scope(|s| {
            for w in 0..3i64 {
                let (t, stop, written) = (&t, &stop, &written);
                s.spawn(move || {
                    let mut i = 0i64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let keys: Vec<i64> = (0..500).map(|j| (w * 100_000_000) + i * 500 + j).collect();
                        match t.upsert(&kv_batch(&keys, i, 40)) {
                            Ok(_) => {
                                written.fetch_add(500, Ordering::Relaxed);
                            }
                            Err(Error::TableNotFound { .. }) => break,
                            Err(e) if e.is_memory_limit() => {}
                            Err(e) => panic!("round {round} writer {w}: {e}"),
                        }
                    }
                });
            }
            // Drop at a moment a flush is running (or after 3 s).
            let start = Instant::now();
            while written.load(Ordering::Relaxed) < 20_000 + round * 3000 && start.elapsed() < Duration::from_secs(3) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let spin = Instant::now();
            while engine.flushes_in_flight() == 0 && spin.elapsed() < Duration::from_millis(500) {
                std::hint::spin_loop();
            }
            engine.drop_table(&name).unwrap();
            stop.store(true, Ordering::Relaxed);
        });
        drop(t);
        wait_until("flushes to end", Duration::from_secs(20), || engine.flushes_in_flight() == 0);
        // Allow a moment for a cancelled flush to return its bytes.
        let start = Instant::now();
        while cats(&engine) != base && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(cats(&engine), base, "round {round}: categories after drop_table (written {})", written.load(Ordering::Relaxed));
        assert_eq!(used_wo_free(&engine), base_used, "round {round}: used after drop_table");
        assert!(engine.memory_report().tables.iter().all(|r| r.table != name || r.bytes == 0), "round {round}: dropped table still holds bytes");
    }
    assert_eq!(kv_read(&keep), keep_model);
    let ki = keep.stats().unwrap().key_index_bytes;
    drop(keep);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), churn_config(16 * MIB)).unwrap();
    let keep = engine.table("keep").unwrap();
    assert_eq!(kv_read(&keep), keep_model);
    assert_eq!(keep.stats().unwrap().key_index_bytes, ki, "key_index of the survivor against a rebuilt index");
    assert_eq!(engine.table_names(), vec!["keep".to_owned()]);
}

/// Flushes and compactions built off the lock: after a long churn with many small flushes,
/// flush_all and quiet, the key_index figure equals the one a reopen rebuilds from the same
/// files (nothing counted twice, nothing lost in `absorb`), and `used` equals the sum of the
/// categories.
#[test]
fn key_index_after_churn_equals_rebuilt_index() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), churn_config(24 * MIB)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let s =
        engine.create_table("s", Arc::new(Schema::new(vec![Field::new("a", DataType::Utf8, false), Field::new("v", DataType::Int64, false)])), &["a"]).unwrap();
    let mut model = BTreeMap::new();
    let mut smodel = BTreeMap::new();
    for i in 0..300i64 {
        let keys: Vec<i64> = (0..200).map(|j| (mix((i * 200 + j) as u64) % 50_000) as i64).collect::<BTreeSet<_>>().into_iter().collect();
        t.upsert(&kv_batch(&keys, i, 12)).unwrap();
        model.extend(keys.iter().map(|&k| (k, i)));
        if i % 5 == 0 {
            let del: Vec<i64> = (0..40).map(|j| (mix((i * 77 + j) as u64 ^ 0xdead) % 50_000) as i64).collect();
            t.delete(&kv_keys(&del)).unwrap();
            for k in &del {
                model.remove(k);
            }
        }
        let sk: Vec<String> = (0..50)
            .map(|j| format!("key-{:07}-{}", (mix((i * 50 + j) as u64) % 20_000), "p".repeat((j % 13) as usize)))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let b =
            RecordBatch::try_new(s.schema(), vec![Arc::new(StringArray::from(sk.clone())) as ArrayRef, Arc::new(Int64Array::from(vec![i; sk.len()]))]).unwrap();
        s.upsert(&b).unwrap();
        smodel.extend(sk.into_iter().map(|k| (k, i)));
    }
    engine.flush_all().unwrap();
    wait_until("quiet", Duration::from_secs(20), || engine.flushes_in_flight() == 0);
    t.flush().unwrap();
    s.flush().unwrap();
    assert_eq!(kv_read(&t), model);
    let (kt, ks) = (t.stats().unwrap(), s.stats().unwrap());
    let total_ki = engine.memory().category_bytes(Category::KeyIndex);
    let sum: usize = Category::ALL.iter().map(|c| engine.memory().category_bytes(*c)).sum();
    assert_eq!(sum, engine.memory().used(), "used against the sum of categories");
    eprintln!("files t {} s {}, key_index t {} s {} total {}", kt.files, ks.files, kt.key_index_bytes, ks.key_index_bytes, total_ki);
    drop((t, s));
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), churn_config(24 * MIB)).unwrap();
    let (t, s) = (engine.table("t").unwrap(), engine.table("s").unwrap());
    let (rt, rs) = (t.stats().unwrap(), s.stats().unwrap());
    assert_eq!((rt.files, rs.files), (kt.files, ks.files), "file counts after reopen");
    assert_eq!(rt.key_index_bytes, kt.key_index_bytes, "t: key_index built off the lock vs rebuilt");
    assert_eq!(rs.key_index_bytes, ks.key_index_bytes, "s: key_index built off the lock vs rebuilt");
    assert_eq!(kv_read(&t), model);
    assert_eq!(s.row_count().unwrap(), smodel.len() as u64);
    drop((t, s));
    engine.close().unwrap();
}

/// Engine close (and drop without close) while writers keep background flushes and
/// compactions of two tables busy (8 MiB, 64 KiB flushes): close returns (bounded), every
/// writer then gets Closed, no write call takes longer than the backpressure timeout, and a
/// reopen holds exactly the acknowledged writes.
#[test]
fn close_during_flushes_and_compactions_keeps_acknowledged_writes() {
    for round in 0..6u64 {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), churn_config(8 * MIB)).unwrap();
        let tables: Vec<Table> = ["a", "b"].iter().map(|n| engine.create_table(n, kv_schema(), &["k"]).unwrap()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let hs: Vec<_> = (0..4i64)
            .map(|w| {
                let t = engine.table(if w % 2 == 0 { "a" } else { "b" }).unwrap();
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut m: BTreeMap<i64, i64> = BTreeMap::new();
                    let mut i = 0i64;
                    let mut max_call = Duration::ZERO;
                    while !stop.load(Ordering::Acquire) {
                        i += 1;
                        let keys: Vec<i64> = (0..300).map(|j| w * 10_000_000 + ((i * 300 + j) % 40_000)).collect::<BTreeSet<_>>().into_iter().collect();
                        let start = Instant::now();
                        let r = if i % 4 == 3 { t.delete(&kv_keys(&keys[..100])).map(|_| ()) } else { t.upsert(&kv_batch(&keys, i, 30)).map(|_| ()) };
                        max_call = max_call.max(start.elapsed());
                        match r {
                            Ok(()) if i % 4 == 3 => {
                                for k in &keys[..100] {
                                    m.remove(k);
                                }
                            }
                            Ok(()) => m.extend(keys.iter().map(|&k| (k, i))),
                            Err(Error::Closed(_)) => break,
                            Err(e) if e.is_memory_limit() => {}
                            Err(e) => panic!("writer {w}: {e}"),
                        }
                    }
                    (w, m, max_call)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200 + 150 * round));
        let spin = Instant::now();
        while engine.flushes_in_flight() == 0 && spin.elapsed() < Duration::from_millis(500) {
            std::hint::spin_loop();
        }
        // Even rounds: the writers stop (their last calls return), then close runs beside the
        // background flushes still in flight. Odd rounds: drop without close while they write.
        let mut joined = Vec::new();
        let mut hs = Some(hs);
        if round % 2 == 0 {
            stop.store(true, Ordering::Release);
            joined = hs.take().unwrap().into_iter().map(|h| h.join().unwrap()).collect();
            eprintln!("round {round}: {} flushes in flight at close", engine.flushes_in_flight());
        }
        let closing = Instant::now();
        if round % 2 == 0 {
            engine.close().unwrap();
        } else {
            drop(engine);
            joined = hs.take().unwrap().into_iter().map(|h| h.join().unwrap()).collect();
        }
        let close_took = closing.elapsed();
        let mut model: BTreeMap<(i64, i64), i64> = BTreeMap::new();
        for (w, m, max_call) in joined {
            assert!(max_call < Duration::from_secs(20), "round {round} writer {w}: a write call took {max_call:?}");
            model.extend(m.into_iter().map(|(k, v)| ((w % 2, k), v)));
        }
        assert!(close_took < Duration::from_secs(12), "round {round}: close took {close_took:?}");
        for t in &tables {
            assert!(matches!(t.insert(&kv_batch(&[-1], 0, 0)), Err(Error::Closed(_))));
        }
        drop(tables);
        let engine = Engine::open(dir.path(), churn_config(8 * MIB)).unwrap();
        let mut got: BTreeMap<(i64, i64), i64> = BTreeMap::new();
        for (i, n) in ["a", "b"].iter().enumerate() {
            got.extend(kv_read(&engine.table(n).unwrap()).into_iter().map(|(k, v)| ((i as i64, k), v)));
        }
        assert_eq!(got.len(), model.len(), "round {round}: rows after reopen");
        assert!(got == model, "round {round}: contents after reopen differ");
        engine.close().unwrap();
    }
}

// =====================================================================================
// 3. Backpressure retries
// =====================================================================================

fn bp_config(limit: usize, timeout: Duration) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).backpressure_timeout(timeout).flush_age(Duration::from_secs(3600))
}

/// Rows of about `bytes` encoded bytes (keys from `from`).
fn fat_batch(from: i64, bytes: usize) -> RecordBatch {
    let n = (bytes / 1000).max(1) as i64;
    let keys: Vec<i64> = (from..from + n).collect();
    kv_batch(&keys, 1, 980)
}

/// A batch bigger than the whole limit, into an idle engine (nothing in flight) and into one
/// whose own table has an active delta to flush first: MemoryLimit well before the 20 s
/// backpressure timeout, nothing applied, memory back to where it was.
#[test]
fn a_batch_bigger_than_the_limit_fails_promptly_when_idle() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), bp_config(8 * MIB, Duration::from_secs(20))).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let base = cats(&engine);
    for (what, bytes) in [("12 MB", 12 * MIB), ("30 MB", 30 * MIB)] {
        let b = fat_batch(1_000_000, bytes);
        let start = Instant::now();
        let cpu = thread_cpu();
        let r = t.insert(&b);
        let (took, cpu) = (start.elapsed(), thread_cpu().saturating_sub(cpu));
        assert!(matches!(r, Err(ref e) if e.is_memory_limit()), "{what}: {r:?}");
        assert!(took < Duration::from_secs(3), "{what} idle: refused after {took:?} (cpu {cpu:?})");
        assert_eq!(t.row_count().unwrap(), 0);
        assert_eq!(cats(&engine), base, "{what}: categories after the refusal");
    }
    // Now with an active delta of its own table (relieve_pressure seals and flushes it).
    let mut model = 0u64;
    for i in 0..4 {
        t.insert(&fat_batch(i * 1000, 400_000)).unwrap();
        model += 400;
    }
    let b = fat_batch(1_000_000, 12 * MIB);
    let start = Instant::now();
    let r = t.insert(&b);
    let took = start.elapsed();
    assert!(matches!(r, Err(ref e) if e.is_memory_limit()), "{r:?}");
    assert!(took < Duration::from_secs(5), "with a delta to flush: refused after {took:?}");
    assert_eq!(t.row_count().unwrap(), model);
    // An upsert and an update of too many rows likewise.
    let start = Instant::now();
    assert!(t.upsert(&b).is_err_and(|e| e.is_memory_limit()));
    assert!(start.elapsed() < Duration::from_secs(5), "upsert: {:?}", start.elapsed());
    drop(t);
    engine.close().unwrap();
}

/// A batch bigger than the limit while writers on another table keep flushes in flight the
/// whole time (8 MiB, 256 KiB flushes): the refusal must come (by the 6 s timeout at the
/// latest, plus slack), and the waiting write must not spin: its thread's CPU time stays
/// well under its wall time.
#[test]
fn an_impossible_batch_beside_busy_flushes_neither_spins_nor_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let timeout = Duration::from_secs(6);
    let engine = Engine::open(dir.path(), bp_config(8 * MIB, timeout).table_flush_bytes(256 << 10)).unwrap();
    let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let busy = engine.create_table("busy", kv_schema(), &["k"]).unwrap();
    let stop = AtomicBool::new(false);
    let results: Mutex<Vec<(Duration, Duration, bool)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for w in 0..2i64 {
            let (busy, stop) = (&busy, &stop);
            s.spawn(move || {
                let mut i = 0i64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let keys: Vec<i64> = (0..200).map(|j| w * 1_000_000_000 + i * 200 + j).collect();
                    match busy.upsert(&kv_batch(&keys, i, 200)) {
                        Ok(_) => {}
                        Err(e) if e.is_memory_limit() => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..3 {
            let b = fat_batch(5_000_000, 12 * MIB);
            let start = Instant::now();
            let cpu = thread_cpu();
            let r = t.insert(&b);
            results.lock().unwrap().push((start.elapsed(), thread_cpu().saturating_sub(cpu), matches!(r, Err(ref e) if e.is_memory_limit())));
        }
        stop.store(true, Ordering::Relaxed);
    });
    for (took, cpu, refused) in results.into_inner().unwrap() {
        eprintln!("impossible batch beside busy flushes: {took:?} wall, {cpu:?} cpu");
        assert!(refused, "not refused with MemoryLimit");
        assert!(took < timeout + Duration::from_secs(3), "refused only after {took:?}");
        assert!(cpu < took / 2 + Duration::from_millis(300), "spinning: {cpu:?} of CPU over {took:?}");
    }
    assert_eq!(t.row_count().unwrap(), 0);
    drop((t, busy));
    engine.close().unwrap();
}

/// Many writers at 4, 6 and 8 MiB with batches of 0.5–3 MB into two tables: every call
/// returns within the timeout plus slack, each result is Ok or MemoryLimit, the accepted
/// rows are exactly the table's contents (after reopen too), and at least some succeed.
#[test]
fn many_writers_at_tiny_limits_with_big_batches_never_hang() {
    for limit in [4 * MIB, 6 * MIB, 8 * MIB] {
        let dir = tempfile::tempdir().unwrap();
        let timeout = Duration::from_secs(8);
        let engine = Engine::open(dir.path(), bp_config(limit, timeout)).unwrap();
        for n in ["a", "b"] {
            engine.create_table(n, kv_schema(), &["k"]).unwrap();
        }
        let ok = AtomicUsize::new(0);
        let refused = AtomicUsize::new(0);
        let models: Vec<(usize, BTreeMap<i64, i64>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8i64)
                .map(|w| {
                    let t = engine.table(if w % 2 == 0 { "a" } else { "b" }).unwrap();
                    let (ok, refused) = (&ok, &refused);
                    s.spawn(move || {
                        let mut m = BTreeMap::new();
                        for i in 0..12i64 {
                            let bytes = [500_000usize, 1_000_000, 2_000_000, 3_000_000][((w + i) % 4) as usize];
                            let from = w * 100_000_000 + i * 10_000;
                            let b = fat_batch(from, bytes);
                            let start = Instant::now();
                            let r = t.upsert(&b);
                            let took = start.elapsed();
                            assert!(took < timeout + Duration::from_secs(4), "writer {w} call {i}: {took:?} ({r:?})");
                            match r {
                                Ok(n) => {
                                    assert_eq!(n, b.num_rows());
                                    ok.fetch_add(1, Ordering::Relaxed);
                                    m.extend((from..from + b.num_rows() as i64).map(|k| (k, 1)));
                                }
                                Err(e) if e.is_memory_limit() => {
                                    refused.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => panic!("writer {w}: {e}"),
                            }
                        }
                        ((w % 2) as usize, m)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        eprintln!("limit {} MiB: {} ok, {} refused", limit / MIB, ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
        assert!(ok.load(Ordering::Relaxed) > 0);
        let mut want = [BTreeMap::new(), BTreeMap::new()];
        for (i, m) in models {
            want[i].extend(m);
        }
        for (i, n) in ["a", "b"].iter().enumerate() {
            let t = engine.table(n).unwrap();
            if let Err(e) = t.scan(ScanOptions::default()) {
                let st = t.stats().unwrap();
                eprintln!(
                    "limit {} MiB: scan of {n} after the writers: {e}; stats: active {} sealed {} ({} B) files {} last_flush_error {:?}; in flight {}; degraded {:?}",
                    limit / MIB,
                    st.active_delta_bytes,
                    st.sealed_deltas,
                    st.sealed_delta_bytes,
                    st.files,
                    st.last_flush_error,
                    engine.flushes_in_flight(),
                    engine.degraded_tables()
                );
                let f = t.flush();
                eprintln!("  explicit flush: {f:?}");
                panic!("limit {} MiB: table {n} cannot be scanned after the writers stopped: {e}", limit / MIB);
            }
            assert_eq!(kv_read(&t), want[i], "limit {}: table {n}", limit / MIB);
        }
        assert!(engine.memory().used() <= limit, "used above limit");
        drop(engine);
        let engine = Engine::open(dir.path(), bp_config(limit, timeout)).unwrap();
        for (i, n) in ["a", "b"].iter().enumerate() {
            assert_eq!(kv_read(&engine.table(n).unwrap()), want[i], "limit {}: table {n} replayed", limit / MIB);
        }
        engine.close().unwrap();
    }
}

/// Writers blocked in backpressure (and one with an impossible batch) when the engine is
/// closed: every call returns promptly (Closed, MemoryLimit or Ok), close returns within a
/// bound, and what was acknowledged is there after reopen.
#[test]
fn writers_in_backpressure_during_close_return_promptly() {
    let close_errors = AtomicUsize::new(0);
    for round in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let engine = Engine::open(dir.path(), bp_config(6 * MIB, Duration::from_secs(30))).unwrap();
        let t = engine.create_table("t", kv_schema(), &["k"]).unwrap();
        let hs: Vec<_> = (0..6i64)
            .map(|w| {
                let t = engine.table("t").unwrap();
                std::thread::spawn(move || {
                    let mut m = BTreeMap::new();
                    let mut worst = Duration::ZERO;
                    for i in 0..1000i64 {
                        let bytes = if w == 5 { 20 * MIB } else { 1_500_000 };
                        let from = w * 100_000_000 + i * 10_000;
                        let b = fat_batch(from, bytes);
                        let start = Instant::now();
                        let r = t.upsert(&b);
                        worst = worst.max(start.elapsed());
                        match r {
                            Ok(_) => m.extend((from..from + b.num_rows() as i64).map(|k| (k, 1i64))),
                            Err(Error::Closed(_)) => return (m, worst, start.elapsed()),
                            Err(e) if e.is_memory_limit() => {}
                            Err(e) => panic!("writer {w}: {e}"),
                        }
                    }
                    (m, worst, Duration::ZERO)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(400 + 300 * round));
        let closing = Instant::now();
        if round == 1 {
            drop(engine);
        } else if let Err(e) = engine.close() {
            eprintln!("round {round}: close returned {e}");
            close_errors.fetch_add(1, Ordering::Relaxed);
        }
        let close_took = closing.elapsed();
        let mut model = BTreeMap::new();
        for (w, h) in hs.into_iter().enumerate() {
            let (m, worst, _) = h.join().unwrap();
            let since = closing.elapsed();
            assert!(since < close_took + Duration::from_secs(3), "round {round} writer {w}: returned {since:?} after close began");
            assert!(worst < Duration::from_secs(30), "round {round} writer {w}: a call took {worst:?}");
            model.extend(m);
        }
        assert!(close_took < Duration::from_secs(12), "round {round}: close took {close_took:?}");
        drop(t);
        let engine = Engine::open(dir.path(), bp_config(64 * MIB, Duration::from_secs(30))).unwrap();
        assert_eq!(kv_read(&engine.table("t").unwrap()), model, "round {round}: after reopen");
        engine.close().unwrap();
    }
    assert_eq!(close_errors.load(Ordering::Relaxed), 0, "close() returned an error (see above)");
}

/// `Engine::close` stops admitting writes before its last flush, so writers that never stop
/// cannot keep that flush going (before, 80 s seen): four writers upsert 200-row batches
/// until they get `Closed` (16 MiB, 256 KiB flushes). Close returns Ok within 30 s, and
/// after reopen exactly the acknowledged rows are there, all of them in files (the WAL
/// replays nothing).
#[test]
fn close_while_writers_keep_writing_returns() {
    let dir = tempfile::tempdir().unwrap();
    let config = || EngineConfig::default().memory_limit(16 * MIB).table_flush_bytes(256 << 10).flush_age(Duration::from_secs(3600));
    let engine = Engine::open(dir.path(), config()).unwrap();
    engine.create_table("t", kv_schema(), &["k"]).unwrap();
    let hs: Vec<_> = (0..4i64)
        .map(|w| {
            let t = engine.table("t").unwrap();
            std::thread::spawn(move || {
                let mut acked = BTreeMap::new();
                let mut i = 0i64;
                loop {
                    i += 1;
                    let keys: Vec<i64> = (0..200).map(|j| w * 1_000_000_000 + i * 200 + j).collect();
                    match t.upsert(&kv_batch(&keys, i, 100)) {
                        Ok(n) => {
                            assert_eq!(n, 200);
                            acked.extend(keys.iter().map(|&k| (k, i)));
                        }
                        Err(Error::Closed(_)) => return acked,
                        Err(e) if e.is_memory_limit() => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let start = Instant::now();
    let r = engine.close();
    let took = start.elapsed();
    let mut want = BTreeMap::new();
    for h in hs {
        want.extend(h.join().unwrap());
    }
    eprintln!("close while writing: {took:?} ({r:?}), {} rows acknowledged", want.len());
    assert!(took < Duration::from_secs(30), "close took {took:?}");
    r.unwrap();
    assert!(want.len() >= 200, "no write was acknowledged in 500 ms");
    let engine = Engine::open(dir.path(), config()).unwrap();
    let t = engine.table("t").unwrap();
    assert_eq!(t.stats().unwrap().active_delta_bytes, 0, "close left rows for the WAL to replay");
    assert_eq!(kv_read(&t), want);
    drop(t);
    engine.close().unwrap();
}

/// Minimal form of the wedge seen in `many_writers_at_tiny_limits_with_big_batches_never_hang`:
/// four writers upsert 3 MB batches into one table at 8 MiB (default flush threshold, 8 s
/// backpressure). Once they stop, the table must be scannable and flushable: its sealed
/// deltas may not be left holding more than the flush can convert.
#[test]
fn big_writers_at_8_mib_leave_a_flushable_table() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), bp_config(8 * MIB, Duration::from_secs(8))).unwrap();
    engine.create_table("a", kv_schema(), &["k"]).unwrap();
    let oks: Vec<usize> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4i64)
            .map(|w| {
                let t = engine.table("a").unwrap();
                s.spawn(move || (0..6i64).filter(|i| t.upsert(&fat_batch(w * 100_000_000 + i * 10_000, 3_000_000)).is_ok()).count())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    wait_until("flushes to end", Duration::from_secs(30), || engine.flushes_in_flight() == 0);
    let t = engine.table("a").unwrap();
    let st = t.stats().unwrap();
    let flushed = t.flush();
    let scanned = t.scan(ScanOptions::default()).map(std::iter::Iterator::count);
    assert!(
        flushed.is_ok() && scanned.is_ok(),
        "accepted {oks:?}; before: sealed {} ({} B), files {}, used {} of {}; flush: {flushed:?}; scan: {:?}",
        st.sealed_deltas,
        st.sealed_delta_bytes,
        st.files,
        engine.memory().used(),
        8 * MIB,
        scanned.err()
    );
    drop(t);
    engine.close().unwrap();
}
