//! Breaker trial 6: today's changes.
//!
//! - The page index read only where used (`read_file_with`): filtered scans over files with
//!   strings (long shared prefixes, 4-byte chars), binary and decimal(20) columns (nested
//!   types are refused at create_table), nulls,
//!   all-null pages, deletion vectors and deltas return exactly the rows of an unfiltered scan
//!   filtered in the test, with page pruning on and after the pruning budget flips; memory
//!   returns to its baseline after every scan; `ScanMetrics` stay consistent; numeric-only
//!   projections of wide string files under a byte cap.
//! - Config extremes (`deadline_after`, `MAX_THREADS`): zero backpressure under pressure, every
//!   duration / size extreme at open (no panic, in the caller or a background thread),
//!   `set_memory_limit(usize::MAX)` during load.
//! - Renames that happen and then report EIO (`rename_may_have_happened`) at every rename index of
//!   a flush that writes a data file, deletion vectors and a manifest and then compacts.

use arrow::array::{ArrayRef, AsArray, BinaryArray, Decimal128Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use gritdb::memory::Category;
use gritdb::vfs::{StdFs, Vfs, VfsFile};
use gritdb::{CompareOp, Engine, EngineConfig, Error, ScanFilter, ScanMetrics, ScanOptions, StorageError, Table, WalSync};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

const MIB: usize = 1 << 20;

fn cfg(limit: usize) -> EngineConfig {
    EngineConfig::default().memory_limit(limit).flush_age(Duration::from_secs(3600)).backpressure_timeout(Duration::from_secs(5))
}

// =====================================================================================
// The data table: k, v, s (strings), bin, dec; a model of key -> version
// =====================================================================================

fn prefix() -> String {
    "p".repeat(80)
}

fn high() -> String {
    "\u{10FFFF}".repeat(20)
}

fn data_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, false),
        Field::new("v", DataType::Int64, true),
        Field::new("s", DataType::Utf8, true),
        Field::new("bin", DataType::Binary, true),
        Field::new("dec", DataType::Decimal128(20, 2), true),
    ]))
}

fn v_of(k: i64, ver: i64) -> Option<i64> {
    (k % 7 != 0 && !(80_000..100_000).contains(&k)).then_some(k * 3 + ver)
}

fn s_of(k: i64, ver: i64) -> Option<String> {
    if k % 11 == 0 {
        None
    } else if (60_000..61_000).contains(&k) {
        Some(format!("{}{k:08}", high()))
    } else {
        Some(format!("{}{k:08}-{ver}", prefix()))
    }
}

fn bin_of(k: i64) -> Option<Vec<u8>> {
    (k % 5 != 0).then(|| format!("{:05x}", (k * 7919) % 100_000).into_bytes())
}

fn dec_of(k: i64) -> Option<i128> {
    (k % 19 != 0).then_some(i128::from(k) * 100 + 7)
}

fn data(keys: &[i64], ver: i64) -> RecordBatch {
    let bins: Vec<Option<Vec<u8>>> = keys.iter().map(|&k| bin_of(k)).collect();
    let dec = Decimal128Array::from(keys.iter().map(|&k| dec_of(k)).collect::<Vec<_>>()).with_precision_and_scale(20, 2).unwrap();
    RecordBatch::try_new(
        data_schema(),
        vec![
            Arc::new(Int64Array::from(keys.to_vec())),
            Arc::new(Int64Array::from(keys.iter().map(|&k| v_of(k, ver)).collect::<Vec<_>>())),
            Arc::new(StringArray::from(keys.iter().map(|&k| s_of(k, ver)).collect::<Vec<_>>())),
            Arc::new(BinaryArray::from(bins.iter().map(|b| b.as_deref()).collect::<Vec<_>>())),
            Arc::new(dec),
        ],
    )
    .unwrap()
}

fn keys_batch(keys: impl IntoIterator<Item = i64>) -> RecordBatch {
    let s = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
    RecordBatch::try_new(s, vec![Arc::new(Int64Array::from_iter_values(keys)) as ArrayRef]).unwrap()
}

type Model = BTreeMap<i64, i64>;

fn put(t: &Table, m: &mut Model, keys: std::ops::Range<i64>, ver: i64, upsert: bool) {
    let ks: Vec<i64> = keys.collect();
    for c in ks.chunks(10_000) {
        if upsert {
            t.upsert(&data(c, ver)).unwrap();
        } else {
            t.insert(&data(c, ver)).unwrap();
        }
        for &k in c {
            m.insert(k, ver);
        }
    }
}

fn del(t: &Table, m: &mut Model, keys: std::ops::Range<i64>) {
    t.delete(&keys_batch(keys.clone())).unwrap();
    for k in keys {
        m.remove(&k);
    }
}

/// Files: 0..100k (ver 1, multi-page row groups), a second file (upserts 30_000..30_500 ver 2)
/// with deletion vectors on the first (10_000..10_100, 60_500..60_510 deleted); delta: upserts
/// 50_000..50_050 (ver 3), inserts 100_000..100_100, delete 99_995.
fn build_data(t: &Table) -> Model {
    let mut m = Model::new();
    put(t, &mut m, 0..100_000, 1, false);
    t.flush().unwrap();
    put(t, &mut m, 30_000..30_500, 2, true);
    del(t, &mut m, 10_000..10_100);
    del(t, &mut m, 60_500..60_510);
    t.flush().unwrap();
    put(t, &mut m, 50_000..50_050, 3, true);
    put(t, &mut m, 100_000..100_100, 1, false);
    del(t, &mut m, 99_995..99_996);
    m
}

/// One row as text: the projected columns' displays joined.
fn row_texts(b: &RecordBatch) -> Vec<String> {
    let opts = FormatOptions::default().with_null("~");
    let fmts: Vec<ArrayFormatter> = b.columns().iter().map(|c| ArrayFormatter::try_new(c.as_ref(), &opts).unwrap()).collect();
    (0..b.num_rows()).map(|i| fmts.iter().map(|f| f.value(i).to_string()).collect::<Vec<_>>().join("|")).collect()
}

fn project(b: &RecordBatch, proj: Option<&[&str]>) -> RecordBatch {
    match proj {
        None => b.clone(),
        Some(names) => b.project(&names.iter().map(|n| b.schema().index_of(n).unwrap()).collect::<Vec<_>>()).unwrap(),
    }
}

/// What the model says a scan with `pred` and `proj` returns (sorted row texts).
fn expected(m: &Model, pred: &dyn Fn(i64, Option<i64>, Option<&str>) -> bool, proj: Option<&[&str]>) -> Vec<String> {
    let mut by_ver: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (&k, &ver) in m {
        if pred(k, v_of(k, ver), s_of(k, ver).as_deref()) {
            by_ver.entry(ver).or_default().push(k);
        }
    }
    let mut out = Vec::new();
    for (ver, ks) in by_ver {
        for c in ks.chunks(20_000) {
            out.extend(row_texts(&project(&data(c, ver), proj)));
        }
    }
    out.sort();
    out
}

fn scan_texts(t: &Table, filter: Option<ScanFilter>, proj: Option<&[&str]>, batch_rows: usize) -> Result<(Vec<String>, ScanMetrics), Error> {
    let mut o = ScanOptions::default().batch_rows(batch_rows);
    if let Some(p) = proj {
        o = o.projection(p.iter().copied());
    }
    if let Some(f) = filter {
        o = o.filter(f);
    }
    let mut s = t.scan(o)?;
    let mut out = Vec::new();
    for b in &mut s {
        out.extend(row_texts(&b?));
    }
    out.sort();
    Ok((out, s.metrics()))
}

fn i64lit(v: i64) -> ArrayRef {
    Arc::new(Int64Array::from(vec![v]))
}

fn strlit(v: &str) -> ArrayRef {
    Arc::new(StringArray::from(vec![v]))
}

type Pred = Box<dyn Fn(i64, Option<i64>, Option<&str>) -> bool>;

/// (name, filter, the same predicate in Rust).
fn predicates() -> Vec<(&'static str, ScanFilter, Pred)> {
    let p = prefix();
    let h = high();
    let (p1, p2, p3, h1) = (format!("{p}00070000"), format!("{p}00012345-1"), format!("{p}00030100"), h.clone());
    vec![
        ("k = 54321", ScanFilter::compare("k", CompareOp::Eq, i64lit(54_321)), Box::new(|k, _, _| k == 54_321)),
        (
            "k >= 99990 OR k < 5",
            ScanFilter::or([ScanFilter::compare("k", CompareOp::GtEq, i64lit(99_990)), ScanFilter::compare("k", CompareOp::Lt, i64lit(5))]),
            Box::new(|k, _, _| !(5..99_990).contains(&k)),
        ),
        (
            "20000 < k <= 40000 AND v IS NOT NULL",
            ScanFilter::and([
                ScanFilter::compare("k", CompareOp::Gt, i64lit(20_000)),
                ScanFilter::compare("k", CompareOp::LtEq, i64lit(40_000)),
                ScanFilter::is_not_null("v"),
            ]),
            Box::new(|k, v, _| k > 20_000 && k <= 40_000 && v.is_some()),
        ),
        ("s >= p..00070000", ScanFilter::compare("s", CompareOp::GtEq, strlit(&p1)), Box::new(move |_, _, s| s.is_some_and(|s| s >= p1.as_str()))),
        ("s = p..00012345-1", ScanFilter::compare("s", CompareOp::Eq, strlit(&p2)), Box::new(move |_, _, s| s == Some(p2.as_str()))),
        ("s < p..00030100", ScanFilter::compare("s", CompareOp::Lt, strlit(&p3)), Box::new(move |_, _, s| s.is_some_and(|s| s < p3.as_str()))),
        ("s > high", ScanFilter::compare("s", CompareOp::Gt, strlit(&h1)), Box::new(move |_, _, s| s.is_some_and(|s| s > h1.as_str()))),
        ("s IS NULL", ScanFilter::is_null("s"), Box::new(|_, _, s| s.is_none())),
        (
            "v IS NULL AND k > 85000",
            ScanFilter::and([ScanFilter::is_null("v"), ScanFilter::compare("k", CompareOp::Gt, i64lit(85_000))]),
            Box::new(|k, v, _| v.is_none() && k > 85_000),
        ),
        ("v > 285000 (all-null pages after)", ScanFilter::compare("v", CompareOp::Gt, i64lit(285_000)), Box::new(|_, v, _| v.is_some_and(|v| v > 285_000))),
        (
            "v >= int32 150000 AND k <> 50001",
            ScanFilter::and([
                ScanFilter::compare("v", CompareOp::GtEq, Arc::new(Int32Array::from(vec![150_000])) as ArrayRef),
                ScanFilter::compare("k", CompareOp::NotEq, i64lit(50_001)),
            ]),
            Box::new(|k, v, _| v.is_some_and(|v| v >= 150_000) && k != 50_001),
        ),
        (
            "OR(s IS NULL AND k < 1000, AND(), v = 30301)",
            ScanFilter::or([
                ScanFilter::and([ScanFilter::is_null("s"), ScanFilter::compare("k", CompareOp::Lt, i64lit(1000))]),
                ScanFilter::compare("v", CompareOp::Eq, i64lit(30_301)),
                ScanFilter::and([ScanFilter::or([]), ScanFilter::is_not_null("k")]),
            ]),
            Box::new(|k, v, s| (s.is_none() && k < 1000) || v == Some(30_301)),
        ),
        (
            "bin >= 8 AND dec < 500000.00",
            ScanFilter::and([
                ScanFilter::compare("bin", CompareOp::GtEq, Arc::new(BinaryArray::from(vec![&b"8"[..]])) as ArrayRef),
                ScanFilter::compare(
                    "dec",
                    CompareOp::Lt,
                    Arc::new(Decimal128Array::from(vec![50_000_000i128]).with_precision_and_scale(20, 2).unwrap()) as ArrayRef,
                ),
            ]),
            Box::new(|k, _, _| bin_of(k).is_some_and(|b| b.as_slice() >= &b"8"[..]) && dec_of(k).is_some_and(|d| d < 50_000_000)),
        ),
        (
            "dec IS NULL OR bin IS NULL",
            ScanFilter::or([ScanFilter::is_null("dec"), ScanFilter::is_null("bin")]),
            Box::new(|k, _, _| dec_of(k).is_none() || bin_of(k).is_none()),
        ),
        ("AND() (true)", ScanFilter::and([]), Box::new(|_, _, _| true)),
        ("OR() (false)", ScanFilter::or([]), Box::new(|_, _, _| false)),
    ]
}

/// Sanity of one scan's metrics: rows returned = matched; pruned <= total; decoded and
/// page-pruned rows within the files' physical rows (`physical`: what an unfiltered scan
/// decodes, deleted rows included; `None` for that unfiltered scan itself, which prunes
/// nothing and decodes at least the live file rows). Returns the rows decoded.
#[track_caller]
fn check_metrics(what: &str, m: &ScanMetrics, rows: usize, t: &Table, physical: Option<u64>) -> u64 {
    let st = t.stats().unwrap();
    assert_eq!(m.rows_matched, rows as u64, "{what}: rows_matched {m:?}");
    assert!(m.row_groups_pruned <= m.row_groups_total, "{what}: {m:?}");
    assert!(m.files_opened <= st.files as u64, "{what}: {m:?} of {} files", st.files);
    if let Some(p) = physical {
        assert!(m.rows_decoded + m.rows_pruned_by_page_index <= p, "{what}: {m:?}, {p} physical file rows");
    } else {
        assert_eq!((m.row_groups_pruned, m.rows_pruned_by_page_index, m.files_opened), (0, 0, st.files as u64), "{what}: {m:?}");
        assert!(m.rows_decoded >= st.file_rows, "{what}: {m:?}, {} live file rows", st.file_rows);
    }
    m.rows_decoded
}

#[track_caller]
fn assert_baseline(engine: &Engine, base: usize, what: &str) {
    let ctl = engine.memory();
    assert_eq!(ctl.category_bytes(Category::ScanBuffers), 0, "{what}: scan buffers held after the scan");
    assert_eq!(ctl.used(), base, "{what}: used after the scan (baseline {base})");
}

// =====================================================================================
// 1. Filtered = unfiltered + in-test filter, with page pruning
// =====================================================================================

/// At 256 MiB (page pruning on): every predicate (string with 80-byte shared prefixes beyond the
/// column index's 64-byte truncation, 4-byte chars, IS NULL, all-null pages, And/Or/empty,
/// NotEq, an Int32 literal on Int64, binary and decimal(20)) over two files, deletion vectors
/// and a delta, with full, [k, bin, dec] and filter-column-free ([dec, bin]) projections and two batch sizes: exactly
/// the model's rows; metrics consistent; memory back to its baseline after each scan; `k =
/// 54321` is pruned by statistics or pages.
#[test]
fn filtered_scans_match_the_model_over_strings_nested_nulls_dvs_and_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(256 * MIB)).unwrap();
    let t = engine.create_table("d", data_schema(), &["k"]).unwrap();
    let m = build_data(&t);
    assert_eq!(t.stats().unwrap().files, 2);
    let base = engine.memory().used();
    let (all, um) = scan_texts(&t, None, None, 8192).unwrap();
    assert_eq!(all, expected(&m, &|_, _, _| true, None), "unfiltered scan");
    let physical = check_metrics("unfiltered", &um, all.len(), &t, None);
    assert_baseline(&engine, base, "unfiltered");
    let projs: [Option<&[&str]>; 3] = [None, Some(&["k", "bin", "dec"]), Some(&["dec", "bin"])];
    let mut wrong = Vec::new();
    for (name, f, pred) in predicates() {
        for proj in projs {
            for batch_rows in [8192, 777] {
                let what = format!("{name} proj {proj:?} batch {batch_rows}");
                let (got, met) = scan_texts(&t, Some(f.clone()), proj, batch_rows).unwrap();
                let want = expected(&m, pred.as_ref(), proj);
                if got != want {
                    wrong.push(format!("{what}: {} rows, want {}", got.len(), want.len()));
                }
                check_metrics(&what, &met, got.len(), &t, Some(physical));
                assert_baseline(&engine, base, &what);
                if name == "k = 54321" {
                    assert!(met.row_groups_pruned + met.rows_pruned_by_page_index > 0, "{what}: nothing pruned: {met:?}");
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    drop(t);
    engine.close().unwrap();
}

// =====================================================================================
// 2. The pruning budget flips
// =====================================================================================

/// 1,000-byte incompressible values, keys `from..to`.
fn ballast(from: i64, to: i64) -> RecordBatch {
    crate::scan_memory::incompressible(from, to, 1000)
}

/// The data table and a 40 MB ballast table written at 256 MiB, reopened at 24 MiB. Holding
/// more and more ballast batches (1 row each) shrinks `limit - used`, the pruning budget, until
/// the filtered scan gives up the column index and then memory. At every step (bisected
/// around the flip) each predicate returns exactly the model's rows or a typed MemoryLimit,
/// and memory returns to the level before the scan.
#[test]
fn filtered_scans_stay_exact_while_the_pruning_budget_flips() {
    let dir = tempfile::tempdir().unwrap();
    let m = {
        let engine = Engine::open(dir.path(), cfg(256 * MIB)).unwrap();
        let t = engine.create_table("d", data_schema(), &["k"]).unwrap();
        let mut m = build_data(&t);
        // Everything in files for this test (the delta too).
        t.flush().unwrap();
        let b = engine.create_table("ballast", ballast(0, 1).schema(), &["k"]).unwrap();
        for at in (0..40_000).step_by(500) {
            b.insert(&ballast(at, at + 500)).unwrap();
        }
        b.flush().unwrap();
        m.retain(|_, _| true);
        drop((t, b));
        engine.close().unwrap();
        m
    };
    let engine = Engine::open(dir.path(), cfg(24 * MIB).backpressure_timeout(Duration::from_millis(300))).unwrap();
    let t = engine.table("d").unwrap();
    let b = engine.table("ballast").unwrap();
    let (all, um) = scan_texts(&t, None, None, 8192).unwrap();
    assert_eq!(all, expected(&m, &|_, _, _| true, None), "unfiltered scan at 24 MiB");
    let physical = check_metrics("unfiltered", &um, all.len(), &t, None);
    let probe_filter = ScanFilter::compare("k", CompareOp::Eq, i64lit(54_321));
    // (held batches) -> Ok(page-pruned?) or Err(memory)
    let probe = |held: usize| -> Result<bool, ()> {
        let mut keep = Vec::new();
        let mut s = b.scan(ScanOptions::default().batch_rows(1)).unwrap();
        while keep.len() < held {
            match s.next() {
                Some(Ok(x)) => keep.push(x),
                _ => break,
            }
        }
        drop(s);
        let before = engine.memory().used();
        let r = scan_texts(&t, Some(probe_filter.clone()), None, 8192);
        assert_eq!(engine.memory().used(), before, "held {held}: memory after the probe");
        match r {
            Ok((rows, met)) => {
                assert_eq!(rows, expected(&m, &|k, _, _| k == 54_321, None), "held {held}");
                Ok(met.rows_pruned_by_page_index > 0)
            }
            Err(e) => {
                assert!(e.is_memory_limit(), "held {held}: {e:?}");
                Err(())
            }
        }
    };
    assert_eq!(probe(0), Ok(true), "page pruning with nothing held");
    // The most batches the ballast scan hands out before memory runs out.
    let max_held = {
        let mut n = 0;
        let mut keep = Vec::new();
        for x in b.scan(ScanOptions::default().batch_rows(1)).unwrap() {
            match x {
                Ok(x) => {
                    keep.push(x);
                    n += 1;
                }
                Err(e) => {
                    assert!(e.is_memory_limit(), "{e:?}");
                    break;
                }
            }
        }
        n
    };
    // Bisect the last count that still page-prunes.
    let (mut lo, mut hi) = (0usize, max_held);
    while hi - lo > 1 {
        let mid = usize::midpoint(lo, hi);
        if probe(mid) == Ok(true) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut outcomes = BTreeMap::new();
    let preds = predicates();
    for held in [lo.saturating_sub(2), lo, lo + 1, lo + 2, lo + 4, lo + 8, lo + 16, lo + 64] {
        let outcome = probe(held);
        outcomes.insert(held, outcome);
        // Every predicate at this level: exact or typed.
        let mut keep = Vec::new();
        let mut s = b.scan(ScanOptions::default().batch_rows(1)).unwrap();
        while keep.len() < held {
            match s.next() {
                Some(Ok(x)) => keep.push(x),
                _ => break,
            }
        }
        drop(s);
        let before = engine.memory().used();
        for (name, f, pred) in &preds {
            match scan_texts(&t, Some(f.clone()), Some(&["k", "s", "dec"]), 8192) {
                Ok((got, met)) => {
                    assert_eq!(got, expected(&m, pred.as_ref(), Some(&["k", "s", "dec"])), "held {held}: {name}");
                    check_metrics(name, &met, got.len(), &t, Some(physical));
                }
                Err(e) => assert!(e.is_memory_limit(), "held {held}: {name}: {e:?}"),
            }
            assert_eq!(engine.memory().used(), before, "held {held}: {name}: memory after the scan");
        }
    }
    eprintln!("pruning budget probes (held batches -> Ok(page pruned) / Err(memory)): {outcomes:?}, max held {max_held}");
    drop((t, b));
    engine.close().unwrap();
}

// =====================================================================================
// 3. Numeric-only projections of wide string files under a byte cap
// =====================================================================================

/// Files of 10,000-byte strings at 8 MiB (the byte cap is small): projecting only `k` (no
/// byte-array column read, so no offset index), with and without a filter on `k`, and
/// projecting `k` with a filter on the string column (a byte-array column read for the filter
/// only): exact counts and key sums, memory back to the baseline.
#[test]
fn numeric_projections_of_wide_string_files_under_a_byte_cap_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(8 * MIB)).unwrap();
    let schema = crate::scan_memory::incompressible(0, 1, 8).schema();
    let t = engine.create_table("wide", schema, &["k"]).unwrap();
    for at in (0..400).step_by(50) {
        t.insert(&crate::scan_memory::incompressible(at, at + 50, 10_000)).unwrap();
    }
    t.flush().unwrap();
    t.delete(&keys_batch(100..150)).unwrap();
    t.flush().unwrap();
    let keys: Vec<i64> = (0..400).filter(|k| !(100..150).contains(k)).collect();
    // The strings of the table, for the string filter.
    let strings: BTreeMap<i64, String> = {
        let b = crate::scan_memory::incompressible(0, 400, 10_000);
        let s = b.column(1).as_string::<i32>();
        (0..400).map(|i| (i as i64, s.value(i).to_owned())).collect()
    };
    let pivot = strings[&200].clone();
    let base = engine.memory().used();
    let run = |f: Option<ScanFilter>| -> (usize, i64, ScanMetrics) {
        let mut o = ScanOptions::default().projection(["k"]);
        if let Some(f) = f {
            o = o.filter(f);
        }
        let mut s = t.scan(o).unwrap();
        let (mut n, mut sum) = (0, 0);
        for b in &mut s {
            let b = b.unwrap();
            assert_eq!(b.num_columns(), 1);
            n += b.num_rows();
            sum += b.column(0).as_primitive::<Int64Type>().values().iter().sum::<i64>();
        }
        (n, sum, s.metrics())
    };
    let (n, sum, met) = run(None);
    assert_eq!((n, sum), (keys.len(), keys.iter().sum::<i64>()));
    let physical = check_metrics("k only", &met, n, &t, None);
    assert_baseline(&engine, base, "k only");
    let (n, sum, met) = run(Some(ScanFilter::compare("k", CompareOp::GtEq, i64lit(300))));
    assert_eq!((n, sum), (100, (300..400).sum::<i64>()));
    check_metrics("k >= 300", &met, n, &t, Some(physical));
    assert_baseline(&engine, base, "k >= 300");
    let want: Vec<i64> = keys.iter().copied().filter(|k| strings[k].as_str() < pivot.as_str()).collect();
    let (n, sum, met) = run(Some(ScanFilter::compare("s", CompareOp::Lt, strlit(&pivot))));
    assert_eq!((n, sum), (want.len(), want.iter().sum::<i64>()), "k where s < s(200)");
    check_metrics("s < pivot", &met, n, &t, Some(physical));
    assert_baseline(&engine, base, "s < pivot");
    drop(t);
    engine.close().unwrap();
}

// =====================================================================================
// 4. Config extremes
// =====================================================================================

static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();

/// Records panics on engine threads (`gritdb-*`), whose panics a tokio runtime swallows.
fn watch_engine_panics() {
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            if name.starts_with("gritdb") {
                PANICS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(format!("{name}: {info}"));
            }
            prev(info);
        }));
    });
}

fn small_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false), Field::new("v", DataType::Int64, true)]))
}

fn small(keys: std::ops::Range<i64>) -> RecordBatch {
    RecordBatch::try_new(
        small_schema(),
        vec![Arc::new(Int64Array::from_iter_values(keys.clone())), Arc::new(Int64Array::from_iter_values(keys.map(|k| k * 2)))],
    )
    .unwrap()
}

fn small_sum(t: &Table) -> (usize, i64) {
    let (mut n, mut s) = (0, 0);
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        n += b.num_rows();
        s += b.column(1).as_primitive::<Int64Type>().values().iter().sum::<i64>();
    }
    (n, s)
}

/// Each extreme setting: open either refuses it with `Error::Config` (and creates nothing on
/// disk) or the engine works — insert, flush, scan exact, upsert after 50 ms of ticks, close,
/// reopen exact. No panic in the caller, none on an engine thread.
#[test]
fn extreme_config_values_are_refused_typed_or_work_without_panics() {
    watch_engine_panics();
    let mut cases: Vec<(&str, EngineConfig)> = vec![
        ("wal_sync_interval MAX relaxed", cfg(64 * MIB).wal_sync(WalSync::Relaxed).wal_sync_interval(Duration::MAX)),
        ("wal_sync_interval ZERO relaxed (field)", {
            let mut c = cfg(64 * MIB).wal_sync(WalSync::Relaxed);
            c.wal_sync_interval = Duration::ZERO;
            c
        }),
        ("flush_age MAX", cfg(64 * MIB).flush_age(Duration::MAX)),
        ("flush_age ZERO (field)", {
            let mut c = cfg(64 * MIB);
            c.flush_age = Duration::ZERO;
            c
        }),
        ("backpressure MAX", cfg(64 * MIB).backpressure_timeout(Duration::MAX)),
        ("backpressure ZERO", cfg(64 * MIB).backpressure_timeout(Duration::ZERO)),
        ("max_row_bytes MAX", cfg(64 * MIB).max_row_bytes(usize::MAX)),
        ("table_flush_bytes 0", {
            let mut c = cfg(64 * MIB);
            c.table_flush_bytes = Some(0);
            c
        }),
        ("table_flush_bytes MAX", {
            let mut c = cfg(64 * MIB);
            c.table_flush_bytes = Some(usize::MAX);
            c
        }),
        ("flush_batch_bytes 0", {
            let mut c = cfg(64 * MIB);
            c.flush_batch_bytes = 0;
            c
        }),
        ("flush_batch_bytes MAX", {
            let mut c = cfg(64 * MIB);
            c.flush_batch_bytes = usize::MAX;
            c
        }),
        ("chunk_size 0", cfg(64 * MIB).chunk_size(0)),
        ("chunk_size 3", cfg(64 * MIB).chunk_size(3)),
        ("chunk_size MAX", cfg(64 * MIB).chunk_size(usize::MAX)),
        ("chunk_size 2^63", cfg(64 * MIB).chunk_size(1 << 63)),
        ("memory_limit 0", cfg(0)),
        ("memory_limit MAX", cfg(usize::MAX)),
        ("writer_threads 0 (field)", {
            let mut c = cfg(64 * MIB);
            c.writer_threads = 0;
            c
        }),
        ("flush_threads 0 (field)", {
            let mut c = cfg(64 * MIB);
            c.flush_threads = 0;
            c.background_flush_threads = 0;
            c
        }),
        ("flush_threads 1024", cfg(64 * MIB).flush_threads(gritdb::MAX_THREADS).background_flush_threads(gritdb::MAX_THREADS)),
    ];
    for (name, n) in [("writer_threads", 0), ("flush_threads", 1), ("background_flush_threads", 2)] {
        let c = match n {
            0 => cfg(64 * MIB).writer_threads(gritdb::MAX_THREADS + 1),
            1 => cfg(64 * MIB).flush_threads(usize::MAX),
            _ => cfg(64 * MIB).background_flush_threads(gritdb::MAX_THREADS + 1),
        };
        cases.push((name, c));
    }
    let mut wrong = Vec::new();
    for (name, c) in cases {
        let must_refuse = name.ends_with("threads");
        let before = PANICS.lock().unwrap().len();
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("db");
        let reopen_cfg = c.clone();
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<bool, String> {
            let engine = match Engine::open(&dir, c) {
                Ok(e) => e,
                Err(Error::Config(_)) => return Ok(false),
                Err(e) => return Err(format!("open: {e:?}")),
            };
            let t = engine.create_table("t", small_schema(), &["k"]).map_err(|e| format!("create: {e:?}"))?;
            t.insert(&small(0..1000)).map_err(|e| format!("insert: {e:?}"))?;
            t.flush().map_err(|e| format!("flush: {e:?}"))?;
            std::thread::sleep(Duration::from_millis(50));
            t.upsert(&small(500..1500)).map_err(|e| format!("upsert: {e:?}"))?;
            let want = (1500, (0..1500).map(|k| k * 2).sum::<i64>());
            if small_sum(&t) != want {
                return Err(format!("scan {:?}", small_sum(&t)));
            }
            drop(t);
            engine.close().map_err(|e| format!("close: {e:?}"))?;
            let engine = Engine::open(&dir, reopen_cfg).map_err(|e| format!("reopen: {e:?}"))?;
            let t = engine.table("t").unwrap();
            if small_sum(&t) != want {
                return Err(format!("after reopen {:?}", small_sum(&t)));
            }
            drop(t);
            engine.close().map_err(|e| format!("close 2: {e:?}"))?;
            Ok(true)
        }));
        let panics: Vec<String> = PANICS.lock().unwrap()[before..].to_vec();
        match res {
            Err(p) => wrong.push(format!(
                "{name}: panicked: {}",
                p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned())).unwrap_or_default()
            )),
            Ok(Err(e)) => wrong.push(format!("{name}: {e}")),
            Ok(Ok(false)) if must_refuse && dir.exists() => wrong.push(format!("{name}: refused, but {} was created", dir.display())),
            Ok(Ok(worked)) => {
                if must_refuse && worked {
                    wrong.push(format!("{name}: a thread count above MAX_THREADS was accepted"));
                }
            }
        }
        if !panics.is_empty() {
            wrong.push(format!("{name}: engine thread panicked: {panics:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// `backpressure_timeout(ZERO)` under real pressure (a 4 MiB limit and a writer whose files
/// cannot be written, FaultFs stalled): a write that does not fit returns a typed MemoryLimit
/// at once (no wait, no panic); once the disk is healed every acknowledged row is there.
#[test]
fn zero_backpressure_under_pressure_is_a_typed_memory_limit_then_exact() {
    let fs = gritdb::vfs::FaultFs::new();
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(4 * MIB).backpressure_timeout(Duration::ZERO).vfs(Arc::new(fs.clone()))).unwrap();
    let t = engine.create_table("t", small_schema(), &["k"]).unwrap();
    fs.stall_paths(".parquet");
    let mut acked = 0i64;
    let mut refused = None;
    for i in 0..400 {
        match t.insert(&small(i * 1000..(i + 1) * 1000)) {
            Ok(_) => acked = (i + 1) * 1000,
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    fs.heal();
    let e = refused.expect("4 MiB and a stalled disk: some write is refused");
    assert!(e.is_memory_limit(), "{e:?}");
    t.flush().unwrap();
    assert_eq!(small_sum(&t), (acked as usize, (0..acked).map(|k| k * 2).sum::<i64>()));
    t.insert(&small(acked..acked + 1000)).unwrap();
    assert_eq!(t.row_count().unwrap(), (acked + 1000) as u64);
    drop(t);
    engine.close().unwrap();
}

/// `set_memory_limit(usize::MAX)` while a thread writes: Ok, clamped (not above physical RAM,
/// not below the old limit); `set_memory_limit(0)` is `Error::Config` and changes nothing;
/// lowering back to 16 MiB works; every acknowledged row is there, also after reopen.
#[test]
fn set_memory_limit_extremes_during_load_are_typed_and_exact() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(16 * MIB)).unwrap();
    let t = engine.create_table("t", small_schema(), &["k"]).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let t = t.clone();
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut i = 0i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || i < 20 {
                t.insert(&small(i * 1000..(i + 1) * 1000)).unwrap();
                i += 1;
            }
            i * 1000
        })
    };
    for round in 0..5 {
        engine.set_memory_limit(usize::MAX).unwrap();
        let raised = engine.memory().limit();
        assert!(raised >= 16 * MIB, "round {round}: {raised}");
        let e = engine.set_memory_limit(0).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "round {round}: {e:?}");
        assert_eq!(engine.memory().limit(), raised, "round {round}: a refused limit changed the limit");
        engine.set_memory_limit(16 * MIB).unwrap();
        assert_eq!(engine.memory().limit(), 16 * MIB);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = writer.join().unwrap();
    assert_eq!(small_sum(&t), (n as usize, (0..n).map(|k| k * 2).sum::<i64>()));
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(16 * MIB)).unwrap();
    assert_eq!(small_sum(&engine.table("t").unwrap()), (n as usize, (0..n).map(|k| k * 2).sum::<i64>()));
    engine.close().unwrap();
}

// =====================================================================================
// 5. Renames that happen and then report EIO, at every rename index
// =====================================================================================

#[derive(Debug, Default)]
struct LieState {
    /// Renames seen (targets' file names), in order.
    log: Vec<String>,
    /// Lie at this rename (0 = the next one after arming).
    lie_at: Option<usize>,
    seen_since_arm: usize,
    lied: Option<String>,
}

/// The real file system, except that the armed rename happens and then returns EIO.
#[derive(Debug, Clone, Default)]
struct LyingFs(Arc<Mutex<LieState>>);

impl LyingFs {
    fn arm(&self, at: Option<usize>) {
        let mut s = self.0.lock().unwrap();
        s.lie_at = at;
        s.seen_since_arm = 0;
        s.log.clear();
        s.lied = None;
    }
}

impl Vfs for LyingFs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn VfsFile>> {
        StdFs.create(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        StdFs.rename(from, to)?;
        let mut s = self.0.lock().unwrap();
        let name = to.file_name().unwrap().to_string_lossy().into_owned();
        s.log.push(name.clone());
        let i = s.seen_since_arm;
        s.seen_since_arm += 1;
        if s.lie_at == Some(i) {
            s.lie_at = None;
            s.lied = Some(name);
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_file(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        StdFs.create_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        StdFs.sync_dir(path)
    }
}

type KvModel = BTreeMap<i64, i64>;

fn kv_read(t: &Table) -> KvModel {
    let mut out = KvModel::new();
    for b in t.scan(ScanOptions::default()).unwrap() {
        let b = b.unwrap();
        let k = b.column(0).as_primitive::<Int64Type>();
        let v = b.column(1).as_primitive::<Int64Type>();
        for i in 0..b.num_rows() {
            assert!(out.insert(k.value(i), v.value(i)).is_none(), "key {} twice", k.value(i));
        }
    }
    out
}

fn kv_put(t: &Table, m: &mut KvModel, keys: std::ops::Range<i64>, ver: i64) {
    let b = RecordBatch::try_new(
        small_schema(),
        vec![Arc::new(Int64Array::from_iter_values(keys.clone())), Arc::new(Int64Array::from_iter_values(keys.clone().map(|k| k * 10 + ver)))],
    )
    .unwrap();
    t.upsert(&b).unwrap();
    for k in keys {
        m.insert(k, k * 10 + ver);
    }
}

fn kv_del(t: &Table, m: &mut KvModel, keys: std::ops::Range<i64>) {
    t.delete(&keys_batch(keys.clone())).unwrap();
    for k in keys {
        m.remove(&k);
    }
}

/// Scenario "small files": three flushed files (the 2nd and 3rd flushes delete from earlier
/// files: deletion vectors), then upserts, deletes and inserts whose flush writes a data file,
/// deletion vectors and a manifest and then compacts the four files. Scenario "sparse": one
/// file of 1,000 rows, then 700 deleted: the flush writes a deletion vector and a manifest and
/// compacts the sparse file.
fn scenario(fs: &LyingFs, sparse: bool) -> (tempfile::TempDir, Engine, Table, KvModel) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB).vfs(Arc::new(fs.clone()))).unwrap();
    let t = engine.create_table("t", small_schema(), &["k"]).unwrap();
    let mut m = KvModel::new();
    if sparse {
        kv_put(&t, &mut m, 0..1000, 1);
        t.flush().unwrap();
        kv_del(&t, &mut m, 100..800);
    } else {
        for i in 0..3 {
            kv_put(&t, &mut m, i * 100..(i + 1) * 100, 1);
            if i > 0 {
                kv_del(&t, &mut m, (i - 1) * 100 + 10..(i - 1) * 100 + 20);
            }
            t.flush().unwrap();
        }
        kv_put(&t, &mut m, 50..60, 2);
        kv_del(&t, &mut m, 250..260);
        kv_put(&t, &mut m, 300..400, 3);
    }
    (dir, engine, t, m)
}

/// Files in the table directories not named by their manifest (and tmp files).
fn strays(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries: Vec<_> = std::fs::read_dir(&d).unwrap().flatten().collect();
        let manifest = entries.iter().find(|e| e.file_name() == "manifest.json").map(|e| std::fs::read_to_string(e.path()).unwrap());
        for e in &entries {
            let n = e.file_name().to_string_lossy().into_owned();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else if n.ends_with(".tmp") {
                out.push(e.path());
            } else if let Some(man) = &manifest
                && n != "manifest.json"
                && !man.contains(&format!("\"{n}\""))
            {
                out.push(e.path());
            }
        }
    }
    out
}

/// At every rename of the faulted flush (its data file, deletion vectors, manifest, then the
/// compaction's file and manifest), in both scenarios, the rename happens and then reports
/// EIO. Then: the flush fails typed (or succeeds); rows served are exact; (a) a crash right
/// away, or (b) a retried flush, a write, and a crash; reopening with the real file system
/// shows exactly the acknowledged rows; a clean close + reopen leaves no stray file.
#[test]
fn renames_that_happen_then_fail_at_every_index_keep_rows_exact_and_leave_no_strays() {
    let mut wrong = Vec::new();
    for sparse in [false, true] {
        // Calibrate: the renames of the flush.
        let fs = LyingFs::default();
        let (_d, engine, t, m) = scenario(&fs, sparse);
        fs.arm(None);
        t.flush().unwrap();
        let renames = fs.0.lock().unwrap().log.clone();
        assert_eq!(kv_read(&t), m);
        drop(t);
        engine.close().unwrap();
        assert!(renames.iter().any(|n| n.ends_with(".parquet")) && renames.iter().any(|n| n.contains(".dv")), "sparse {sparse}: {renames:?}");
        assert!(renames.iter().filter(|n| *n == "manifest.json").count() >= 2, "sparse {sparse}: the flush compacts: {renames:?}");
        for at in 0..renames.len() {
            for retry in [false, true] {
                let what = format!("sparse {sparse} rename {at} ({}) retry {retry}", renames[at]);
                let fs = LyingFs::default();
                let (dir, engine, t, mut m) = scenario(&fs, sparse);
                fs.arm(Some(at));
                let res = t.flush();
                let lied = fs.0.lock().unwrap().lied.clone();
                if lied.is_none() {
                    wrong.push(format!("{what}: the lie never fired ({:?})", fs.0.lock().unwrap().log));
                }
                if let Err(e) = &res
                    && !matches!(e, Error::Storage(StorageError::Io { .. }))
                {
                    wrong.push(format!("{what}: flush error {e:?}"));
                }
                if kv_read(&t) != m {
                    wrong.push(format!("{what}: rows served after the failed flush differ"));
                }
                if retry {
                    if let Err(e) = t.flush() {
                        wrong.push(format!("{what}: retried flush: {e:?}"));
                    }
                    kv_put(&t, &mut m, 5000..5010, 4);
                    kv_del(&t, &mut m, 0..5);
                    if let Err(e) = t.flush() {
                        wrong.push(format!("{what}: flush after the retry: {e:?}"));
                    }
                    kv_put(&t, &mut m, 6000..6005, 5);
                    if kv_read(&t) != m {
                        wrong.push(format!("{what}: rows served after the retry differ"));
                    }
                }
                drop(t);
                drop(engine);
                match Engine::open(dir.path(), cfg(64 * MIB)) {
                    Err(e) => wrong.push(format!("{what}: reopen after the crash: {e}")),
                    Ok(engine) => {
                        let t = engine.table("t").unwrap();
                        let got = kv_read(&t);
                        if got != m {
                            wrong.push(format!("{what}: after the crash {} rows, want {}", got.len(), m.len()));
                        }
                        t.flush().unwrap();
                        drop(t);
                        engine.close().unwrap();
                        let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
                        let t = engine.table("t").unwrap();
                        if kv_read(&t) != m {
                            wrong.push(format!("{what}: after the clean reopen rows differ"));
                        }
                        drop(t);
                        engine.close().unwrap();
                        let s = strays(dir.path());
                        if !s.is_empty() {
                            wrong.push(format!("{what}: stray files after a clean reopen: {s:?}"));
                        }
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A table whose flush's manifest rename lied while other renames keep lying afterwards (every
/// later manifest rename lies once more, at the next flush): the engine keeps serving exact
/// rows across five failed-then-retried commits, and a crash after each reopens exactly.
#[test]
fn repeated_lying_manifest_renames_across_flushes_stay_exact() {
    let fs = LyingFs::default();
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB).vfs(Arc::new(fs.clone()))).unwrap();
    let t = engine.create_table("t", small_schema(), &["k"]).unwrap();
    let mut m = KvModel::new();
    let mut failed = 0;
    for round in 0..6i64 {
        kv_put(&t, &mut m, round * 50..round * 50 + 80, round);
        if round > 0 {
            kv_del(&t, &mut m, round * 50 - 40..round * 50 - 35);
        }
        // The manifest is renamed after the data file and the deletion vectors: lie at the
        // last rename of this flush's commit by lying at each index until one fails.
        fs.arm(Some(usize::try_from(round % 3).unwrap()));
        if t.flush().is_err() {
            failed += 1;
        }
        assert_eq!(kv_read(&t), m, "round {round}");
        fs.arm(None);
        t.flush().unwrap();
        assert_eq!(kv_read(&t), m, "round {round} after the retry");
    }
    assert!(failed >= 3, "{failed} flushes failed");
    drop(t);
    drop(engine);
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    assert_eq!(kv_read(&engine.table("t").unwrap()), m);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), cfg(64 * MIB)).unwrap();
    engine.close().unwrap();
    assert_eq!(strays(dir.path()), Vec::<PathBuf>::new());
}

/// `Engine::open` says (engine.rs) "a bad configuration is refused before anything is created
/// on disk": a chunk size that is not a power of two in range, or a memory limit below two
/// chunks, was refused with `Error::Config` only after the data directory (and its LOCK file)
/// was created; now, like the thread counts, `max_row_bytes` and `background_priority`, before.
#[test]
fn a_bad_chunk_size_or_memory_limit_is_refused_before_anything_is_created() {
    let mut wrong = Vec::new();
    for (name, c) in [
        ("chunk_size 0", cfg(64 * MIB).chunk_size(0)),
        ("chunk_size 3", cfg(64 * MIB).chunk_size(3)),
        ("chunk_size usize::MAX", cfg(64 * MIB).chunk_size(usize::MAX)),
        ("memory_limit 0", cfg(0)),
    ] {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("db");
        match Engine::open(&dir, c) {
            Err(Error::Config(_)) => {}
            other => wrong.push(format!("{name}: {:?}", other.map(|_| ()))),
        }
        if dir.exists() {
            let entries: Vec<String> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
            wrong.push(format!("{name}: refused, but {} exists holding {entries:?}", dir.display()));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
