//! Scan predicate pushdown (`ScanOptions::filter`): results equal a brute-force filter over a
//! model for many predicates (nulls, strings, dates, deleted rows, rows in deltas); row groups
//! and pages are pruned by Parquet statistics; bad filters are typed errors at scan creation.

use arrow::array::{Array, ArrayRef, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::{CompareOp, Engine, EngineConfig, Error, FilterError, ScanFilter, ScanOptions, Table};
use std::collections::BTreeMap;
use std::sync::Arc;

/// `(name, day, amount, score)` of one row; the key is `id`.
#[derive(Debug, Clone, PartialEq)]
struct R {
    name: Option<String>,
    day: Option<i32>,
    amount: Option<i32>,
    score: Option<f64>,
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("day", DataType::Date32, true),
        Field::new("amount", DataType::Int32, true),
        Field::new("score", DataType::Float64, true),
    ]))
}

fn row(id: i64, version: i64) -> R {
    let v = id + version * 7;
    R {
        name: (v % 11 != 0).then(|| format!("n-{:05}", v % 3000)),
        day: (v % 13 != 0).then_some(19_000 + (v % 400) as i32),
        amount: (v % 7 != 0).then_some((v % 50) as i32 - 10),
        score: (v % 17 != 0).then_some((v % 100) as f64 / 100.0),
    }
}

fn batch(rows: &[(i64, R)]) -> RecordBatch {
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(rows.iter().map(|r| r.1.name.clone()).collect::<StringArray>()),
            Arc::new(rows.iter().map(|r| r.1.day).collect::<Date32Array>()),
            Arc::new(rows.iter().map(|r| r.1.amount).collect::<Int32Array>()),
            Arc::new(rows.iter().map(|r| r.1.score).collect::<Float64Array>()),
        ],
    )
    .unwrap()
}

fn keys(ids: &[i64]) -> RecordBatch {
    let s = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(ids.to_vec()))]).unwrap()
}

/// Collects full-schema batches into `id -> row`.
fn collect(scan: impl Iterator<Item = gritdb::Result<RecordBatch>>) -> BTreeMap<i64, R> {
    let mut out = BTreeMap::new();
    for b in scan {
        let b = b.unwrap();
        let id = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
        let name = b.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        let day = b.column(2).as_any().downcast_ref::<Date32Array>().unwrap();
        let amount = b.column(3).as_any().downcast_ref::<Int32Array>().unwrap();
        let score = b.column(4).as_any().downcast_ref::<Float64Array>().unwrap();
        for i in 0..b.num_rows() {
            let r = R {
                name: name.is_valid(i).then(|| name.value(i).to_owned()),
                day: day.is_valid(i).then(|| day.value(i)),
                amount: amount.is_valid(i).then(|| amount.value(i)),
                score: score.is_valid(i).then(|| score.value(i)),
            };
            assert!(out.insert(id.value(i), r).is_none(), "key {} returned twice", id.value(i));
        }
    }
    out
}

fn lit<A: Array + 'static>(a: A) -> ArrayRef {
    Arc::new(a)
}

fn cmp(col: &str, op: CompareOp, value: ArrayRef) -> ScanFilter {
    ScanFilter::compare(col, op, value)
}

type Pred = Box<dyn Fn(i64, &R) -> bool>;

/// Predicates with their brute-force meaning (SQL: a comparison with null is not true).
fn predicates() -> Vec<(ScanFilter, Pred)> {
    let s = |v: &str| lit(StringArray::from(vec![v]));
    vec![
        (cmp("id", CompareOp::Lt, lit(Int64Array::from(vec![1_000]))), Box::new(|id, _| id < 1_000)),
        (cmp("id", CompareOp::Eq, lit(Int64Array::from(vec![77_777]))), Box::new(|id, _| id == 77_777)),
        (
            ScanFilter::and([cmp("id", CompareOp::GtEq, lit(Int64Array::from(vec![95_000]))), ScanFilter::is_not_null("amount")]),
            Box::new(|id, r| id >= 95_000 && r.amount.is_some()),
        ),
        (cmp("name", CompareOp::Eq, s("n-00123")), Box::new(|_, r| r.name.as_deref() == Some("n-00123"))),
        (cmp("name", CompareOp::Gt, s("n-02900")), Box::new(|_, r| r.name.as_deref().is_some_and(|n| n > "n-02900"))),
        (cmp("name", CompareOp::NotEq, s("n-00001")), Box::new(|_, r| r.name.as_deref().is_some_and(|n| n != "n-00001"))),
        (
            ScanFilter::and([
                cmp("day", CompareOp::GtEq, lit(Date32Array::from(vec![19_100]))),
                cmp("day", CompareOp::Lt, lit(Date32Array::from(vec![19_110]))),
            ]),
            Box::new(|_, r| r.day.is_some_and(|d| (19_100..19_110).contains(&d))),
        ),
        (ScanFilter::is_null("amount"), Box::new(|_, r| r.amount.is_none())),
        (cmp("amount", CompareOp::NotEq, lit(Int32Array::from(vec![5]))), Box::new(|_, r| r.amount.is_some_and(|a| a != 5))),
        // An Int64 literal on an Int32 column (converted losslessly).
        (cmp("amount", CompareOp::LtEq, lit(Int64Array::from(vec![-8]))), Box::new(|_, r| r.amount.is_some_and(|a| a <= -8))),
        (
            ScanFilter::or([cmp("id", CompareOp::Eq, lit(Int64Array::from(vec![5]))), ScanFilter::is_null("name")]),
            Box::new(|id, r| id == 5 || r.name.is_none()),
        ),
        (cmp("score", CompareOp::Gt, lit(Float64Array::from(vec![0.95]))), Box::new(|_, r| r.score.is_some_and(|s| s > 0.95))),
        // A null literal: true for no row.
        (cmp("amount", CompareOp::Eq, lit(Int32Array::from(vec![None]))), Box::new(|_, _| false)),
        (ScanFilter::and([]), Box::new(|_, _| true)),
        (ScanFilter::or([]), Box::new(|_, _| false)),
    ]
}

fn check_all(t: &Table, model: &BTreeMap<i64, R>, when: &str) {
    assert_eq!(collect(t.scan(ScanOptions::default()).unwrap()), *model, "{when}: unfiltered");
    for (f, p) in predicates() {
        let want: BTreeMap<i64, R> = model.iter().filter(|(id, r)| p(**id, r)).map(|(k, v)| (*k, v.clone())).collect();
        let scan = t.scan(ScanOptions::default().filter(f.clone()).batch_rows(3000)).unwrap();
        let got = collect(scan);
        assert_eq!(got.len(), want.len(), "{when}: {f}");
        assert!(got == want, "{when}: {f}: rows differ");
    }
}

/// One table with files (several, one of 100k rows with many pages), deletion vectors,
/// upserted rows in files and in deltas, deletes in deltas: every predicate gives exactly the
/// model's rows, before and after the deltas are flushed, and after reopen.
#[test]
fn filtered_scans_equal_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let t = engine.create_table("f", schema(), &["id"]).unwrap();
    let mut model = BTreeMap::new();
    let put = |t: &Table, model: &mut BTreeMap<i64, R>, ids: std::ops::Range<i64>, version: i64| {
        let rows: Vec<(i64, R)> = ids.map(|id| (id, row(id, version))).collect();
        t.upsert(&batch(&rows)).unwrap();
        model.extend(rows);
    };
    put(&t, &mut model, 0..100_000, 0);
    t.flush().unwrap();
    put(&t, &mut model, 100_000..110_000, 0);
    t.flush().unwrap();
    // Upserts and deletes of flushed rows, flushed: deletion vectors.
    put(&t, &mut model, 500..700, 1);
    let del: Vec<i64> = (0..100_000).step_by(97).collect();
    t.delete(&keys(&del)).unwrap();
    for k in &del {
        model.remove(k);
    }
    t.flush().unwrap();
    // Still in deltas: a sealed-and-active mix of upserts, inserts and deletes.
    put(&t, &mut model, 90_000..96_000, 2);
    put(&t, &mut model, 110_000..111_000, 0);
    let del: Vec<i64> = (95_000..96_000).step_by(3).chain([5, 77_777]).collect();
    t.delete(&keys(&del)).unwrap();
    for k in &del {
        model.remove(k);
    }
    check_all(&t, &model, "with deltas");
    t.flush().unwrap();
    check_all(&t, &model, "flushed");
    drop(t);
    engine.close().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    check_all(&engine.table("f").unwrap(), &model, "reopened");
}

/// Three files of 10k rows each in key order (fewer than compaction merges): `id >= 25_000`
/// reads one row group of three; in one 100k-row file, `id < 100` reads only the first pages
/// (the page index).
#[test]
fn filter_prunes_row_groups_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(256 << 20)).unwrap();
    let t = engine.create_table("p", schema(), &["id"]).unwrap();
    for f in 0..3 {
        let rows: Vec<(i64, R)> = (f * 10_000..(f + 1) * 10_000).map(|id| (id, row(id, 0))).collect();
        t.insert(&batch(&rows)).unwrap();
        t.flush().unwrap();
    }
    assert_eq!(t.stats().unwrap().files, 3);
    let f = cmp("id", CompareOp::GtEq, lit(Int64Array::from(vec![25_000])));
    let mut scan = t.scan(ScanOptions::default().filter(f).projection(["id"])).unwrap();
    let n: usize = scan.by_ref().map(|b| b.unwrap().num_rows()).sum();
    assert_eq!(n, 5_000);
    let m = scan.metrics();
    assert_eq!((m.files_opened, m.row_groups_total, m.row_groups_pruned, m.rows_matched), (3, 3, 2, 5_000), "{m:?}");
    assert!(m.rows_decoded <= 10_000, "{m:?}");
    // Unfiltered: nothing pruned, everything decoded.
    let mut scan = t.scan(ScanOptions::default().projection(["id"])).unwrap();
    assert_eq!(scan.by_ref().map(|b| b.unwrap().num_rows()).sum::<usize>(), 30_000);
    let m = scan.metrics();
    assert_eq!((m.row_groups_total, m.row_groups_pruned, m.rows_decoded, m.rows_matched), (3, 0, 30_000, 30_000));
    // A string predicate no file can satisfy prunes every row group.
    let f = cmp("name", CompareOp::Gt, lit(StringArray::from(vec!["zzz"])));
    let mut scan = t.scan(ScanOptions::default().filter(f)).unwrap();
    assert_eq!(scan.by_ref().count(), 0);
    let m = scan.metrics();
    assert_eq!((m.row_groups_pruned, m.rows_decoded), (3, 0), "{m:?}");

    let big = engine.create_table("big", schema(), &["id"]).unwrap();
    let rows: Vec<(i64, R)> = (0..100_000).map(|id| (id, row(id, 0))).collect();
    big.insert(&batch(&rows)).unwrap();
    big.flush().unwrap();
    let f = cmp("id", CompareOp::Lt, lit(Int64Array::from(vec![100])));
    let mut scan = big.scan(ScanOptions::default().filter(f)).unwrap();
    let got = collect(scan.by_ref());
    assert_eq!(got.len(), 100);
    let m = scan.metrics();
    assert_eq!((m.row_groups_total, m.row_groups_pruned, m.rows_matched), (1, 0, 100), "{m:?}");
    assert!(m.rows_pruned_by_page_index >= 50_000, "the page index must skip most pages: {m:?}");
    assert_eq!(m.rows_decoded + m.rows_pruned_by_page_index, 100_000, "{m:?}");
}

/// Projection order is kept for file batches too, and filter columns need not be projected.
#[test]
fn filter_with_projection_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("o", schema(), &["id"]).unwrap();
    let rows: Vec<(i64, R)> = (0..1000).map(|id| (id, row(id, 0))).collect();
    t.insert(&batch(&rows[..500])).unwrap();
    t.flush().unwrap();
    t.insert(&batch(&rows[500..])).unwrap();
    let f = cmp("amount", CompareOp::Eq, lit(Int32Array::from(vec![3])));
    let want: Vec<(Option<String>, i64)> = rows.iter().filter(|(_, r)| r.amount == Some(3)).map(|(id, r)| (r.name.clone(), *id)).collect();
    let mut got = Vec::new();
    for b in t.scan(ScanOptions::default().projection(["name", "id"]).filter(f)).unwrap() {
        let b = b.unwrap();
        assert_eq!(b.schema().field(0).name(), "name");
        assert_eq!(b.schema().field(1).name(), "id");
        let name = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
        let id = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        for i in 0..b.num_rows() {
            got.push((name.is_valid(i).then(|| name.value(i).to_owned()), id.value(i)));
        }
    }
    got.sort_by_key(|g| g.1);
    assert!(!want.is_empty());
    assert_eq!(got, want);
}

/// Bad filters are typed errors at scan creation; nothing else changes.
#[test]
fn bad_filters_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("b", schema(), &["id"]).unwrap();
    let rows: Vec<(i64, R)> = (0..100).map(|id| (id, row(id, 0))).collect();
    t.insert(&batch(&rows)).unwrap();
    let scan = |f: ScanFilter| t.scan(ScanOptions::default().filter(f)).unwrap_err();

    let e = scan(ScanFilter::is_null("nope"));
    assert!(matches!(&e, Error::ColumnNotFound { column, .. } if column == "nope"), "{e:?}");
    let e = scan(ScanFilter::and([ScanFilter::is_null("id"), cmp("missing", CompareOp::Eq, lit(Int64Array::from(vec![1])))]));
    assert!(matches!(&e, Error::ColumnNotFound { column, .. } if column == "missing"), "{e:?}");

    let not_comparable = |e: &Error, col: &str| matches!(e, Error::InvalidFilter { source: FilterError::NotComparable { column, .. }, .. } if column == col);
    let e = scan(cmp("id", CompareOp::Eq, lit(StringArray::from(vec!["1"]))));
    assert!(not_comparable(&e, "id"), "{e:?}");
    assert_eq!(
        e.to_string(),
        "invalid scan filter for table `b`: filter on column `id` (Int64): a Utf8 literal cannot be compared with it; pass a literal of type Int64"
    );
    let e = scan(cmp("day", CompareOp::Lt, lit(Int32Array::from(vec![19_000]))));
    assert!(not_comparable(&e, "day"), "{e:?}");
    let e = scan(cmp("amount", CompareOp::Eq, lit(Int64Array::from(vec![1i64 << 40]))));
    assert!(not_comparable(&e, "amount"), "{e:?}");
    assert!(e.to_string().contains("the Int64 literal amount = 1099511627776 is not representable as Int32"), "{e}");
    let e = scan(cmp("amount", CompareOp::Eq, lit(Float64Array::from(vec![1.5]))));
    assert!(not_comparable(&e, "amount"), "{e:?}");
    let e = scan(cmp("id", CompareOp::Eq, lit(Int64Array::from(vec![1, 2]))));
    assert!(not_comparable(&e, "id"), "{e:?}");
    assert!(e.to_string().contains("one element"), "{e}");

    // Nothing changed: the table scans as before.
    assert_eq!(collect(t.scan(ScanOptions::default()).unwrap()).len(), 100);
}

/// Runs `work` on a thread with a stack of `bytes` (scoped: it may borrow).
fn on_stack<T: Send>(bytes: usize, work: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| std::thread::Builder::new().stack_size(bytes).spawn_scoped(s, work).unwrap().join().unwrap())
}

/// Nesting past `MAX_FILTER_DEPTH` is `InvalidFilter(TooDeep)` at scan creation, on a thread
/// with the default 2 MiB stack, for a filter 1,000,000 levels deep — which the scan options
/// then drop without overflowing the stack (before: a stack overflow aborted the process, in
/// the filter's bind and again in its drop). At the limit a filter scans exactly, from files
/// and deltas alike; one level more is refused. A literal of a type nested 10,000 deep is
/// `NotComparable` without the type being formatted.
#[test]
fn filters_nested_past_the_limit_are_refused_typed() {
    use gritdb::MAX_FILTER_DEPTH;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let t = engine.create_table("d", schema(), &["id"]).unwrap();
    let rows: Vec<(i64, R)> = (0..1000).map(|id| (id, row(id, 0))).collect();
    t.insert(&batch(&rows[..600])).unwrap();
    t.flush().unwrap();
    t.insert(&batch(&rows[600..])).unwrap();
    let model: BTreeMap<i64, R> = rows.into_iter().collect();
    let id = |op: CompareOp, v: i64| cmp("id", op, lit(Int64Array::from(vec![v])));
    // `id >= 500` at the bottom, then levels alternating `Or([below, id = level])` and
    // `And([below, id < 900])`: ids 1, 3, ..., and 500..900.
    let nested = |depth: usize| {
        let mut f = id(CompareOp::GtEq, 500);
        for level in 1..depth {
            f = if level % 2 == 1 { ScanFilter::or([f, id(CompareOp::Eq, level as i64)]) } else { ScanFilter::and([f, id(CompareOp::Lt, 900)]) };
        }
        f
    };
    let at_limit = collect(t.scan(ScanOptions::default().filter(nested(MAX_FILTER_DEPTH))).unwrap());
    let want: Vec<i64> = model.keys().copied().filter(|&k| (500..900).contains(&k) || (k % 2 == 1 && k < MAX_FILTER_DEPTH as i64)).collect();
    assert_eq!(at_limit.keys().copied().collect::<Vec<_>>(), want);
    let too_deep = |e: &Error, want: usize| matches!(e, Error::InvalidFilter { table, source: FilterError::TooDeep { depth, limit } } if table == "d" && *depth == want && *limit == MAX_FILTER_DEPTH);
    let e = t.scan(ScanOptions::default().filter(nested(MAX_FILTER_DEPTH + 1))).unwrap_err();
    assert!(too_deep(&e, MAX_FILTER_DEPTH + 1), "{e:?}");
    let e = on_stack(2 << 20, || {
        let mut f = ScanFilter::is_null("id");
        for _ in 1..1_000_000 {
            f = ScanFilter::and([ScanFilter::or([f])]);
        }
        let options = ScanOptions::default().filter(f);
        let copy = options.clone();
        let e = t.scan(options).unwrap_err();
        drop(copy);
        e
    });
    assert!(too_deep(&e, 1_999_999), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "invalid scan filter for table `d`: the filter is nested 1999999 levels deep, more than the {MAX_FILTER_DEPTH} a scan accepts; put a chain of ANDs (or ORs) into one And (Or) of many parts"
        )
    );
    // A literal of a deeply nested type: built and dropped on a large stack (Arrow's own
    // constructors and drops of it recurse), refused on a normal one.
    let deep_literal = on_stack(256 << 20, || {
        let mut ty = DataType::Int64;
        for _ in 1..10_000 {
            ty = DataType::List(Arc::new(Field::new("item", ty, true)));
        }
        arrow::array::new_null_array(&ty, 1)
    });
    let e = on_stack(2 << 20, || t.scan(ScanOptions::default().filter(cmp("id", CompareOp::Eq, Arc::clone(&deep_literal)))).unwrap_err());
    assert!(matches!(&e, Error::InvalidFilter { source: FilterError::NotComparable { column, .. }, .. } if column == "id"), "{e:?}");
    assert_eq!(
        e.to_string(),
        "invalid scan filter for table `d`: filter on column `id` (Int64): the literal's type is nested 10000 levels deep (more than 64); pass a literal of type Int64"
    );
    on_stack(256 << 20, move || drop(deep_literal));
    assert_eq!(collect(t.scan(ScanOptions::default()).unwrap()), model);
}
