//! SQL through `DataFusion` (`sql` feature): tables as `DataFusion` tables (files minus deletion
//! vectors merged with the deltas), pushdown, typed errors, system tables, query memory
//! under the engine's limit, and TPC-H Q1/Q6 against the soak's model.

use arrow::array::{Array, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef, UInt64Type};
use gritdb::memory::Category;
use gritdb::sql::SqlErrorKind;
use gritdb::{Engine, EngineConfig, Error};
use gritdb_soak::data::{self, LINEITEM_KEY};
use gritdb_soak::model::LineitemAgg;
use gritdb_soak::sql as tpch;
use gritdb_tests::settled;
use std::sync::Arc;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("v", DataType::Int64, true), Field::new("s", DataType::Utf8, true)]))
}

/// Rows `ids` with `v = id * mul` and `s = "<tag><id>"`.
fn rows(ids: impl IntoIterator<Item = i64>, mul: i64, tag: &str) -> RecordBatch {
    let ids: Vec<i64> = ids.into_iter().collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(Int64Array::from(ids.iter().map(|i| i * mul).collect::<Vec<_>>())),
            Arc::new(StringArray::from(ids.iter().map(|i| format!("{tag}{i}")).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

fn keys(ids: impl IntoIterator<Item = i64>) -> RecordBatch {
    let s = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
    RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(ids.into_iter().collect::<Vec<_>>()))]).unwrap()
}

fn open(dir: &std::path::Path, limit: usize) -> Engine {
    // A scan waiting for memory gives up after 5 s (not the default 30 s) in these tests.
    Engine::open(dir, EngineConfig::default().memory_limit(limit).backpressure_timeout(std::time::Duration::from_secs(5))).unwrap()
}

/// The single value of a one-row, one-column `Int64`, `Int32` or `UInt64` answer.
fn scalar(batches: &[RecordBatch]) -> i64 {
    let b: Vec<&RecordBatch> = batches.iter().filter(|b| b.num_rows() > 0).collect();
    assert_eq!((b.len(), b[0].num_rows()), (1, 1), "{batches:?}");
    let c = b[0].column(0);
    match c.data_type() {
        DataType::Int64 => c.as_primitive::<Int64Type>().value(0),
        DataType::Int32 => i64::from(c.as_primitive::<arrow::datatypes::Int32Type>().value(0)),
        DataType::UInt64 => c.as_primitive::<UInt64Type>().value(0) as i64,
        t => panic!("not an integer: {t}"),
    }
}

fn total_rows(batches: &[RecordBatch]) -> usize {
    batches.iter().map(RecordBatch::num_rows).sum()
}

/// A table with rows in a committed file, deletes applied to the file (deletion vector),
/// updated rows in the sealed-and-flushed layer and in the active delta.
fn layered_table(engine: &Engine) -> gritdb::Table {
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(0..1000, 1, "a")).unwrap();
    t.flush().unwrap();
    t.delete(&keys(0..100)).unwrap(); // deletes of file rows
    t.update(&rows(100..200, 10, "b")).unwrap();
    t.flush().unwrap(); // second file + deletion vector on the first
    t.update(&rows(200..300, 100, "c")).unwrap(); // active delta, over the file rows
    t.insert(&rows(1000..1050, 1, "d")).unwrap(); // new keys in the active delta
    t.delete(&keys(1040..1050)).unwrap(); // removed again inside the active delta
    t
}

/// Expected `sum(v)` of [`layered_table`]: ids 100..200 ×10, 200..300 ×100, the rest ×1.
fn layered_sum() -> i64 {
    (100..200).map(|i| i * 10).sum::<i64>() + (200..300).map(|i| i * 100).sum::<i64>() + (300..1000).sum::<i64>() + (1000..1040).sum::<i64>()
}

#[test]
fn sql_reads_files_minus_deletes_merged_with_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let _t = layered_table(&engine);
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t").unwrap()), 940);
    assert_eq!(scalar(&engine.sql("SELECT sum(v) FROM t").unwrap()), layered_sum());
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t WHERE id < 100").unwrap()), 0);
    assert_eq!(scalar(&engine.sql("SELECT v FROM t WHERE id = 150").unwrap()), 1500);
    assert_eq!(scalar(&engine.sql("SELECT v FROM t WHERE id = 250").unwrap()), 25_000);
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t WHERE s LIKE 'c%'").unwrap()), 100);
    // A join of the table with itself, and a GROUP BY over the layers.
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t a JOIN t b ON a.id = b.id + 1").unwrap()), 939); // ids 100..1040: a.id in 101..1040
    let b = engine.sql("SELECT substr(s, 1, 1) AS tag, count(*) AS n FROM t GROUP BY tag ORDER BY tag").unwrap();
    let b = arrow::compute::concat_batches(&b[0].schema(), &b).unwrap();
    let tags: Vec<String> = (0..b.num_rows()).map(|i| gritdb_soak::data::str_at(b.column(0).as_ref(), i).unwrap().to_owned()).collect();
    let n: Vec<i64> = b.column(1).as_primitive::<Int64Type>().values().to_vec();
    assert_eq!(tags, ["a", "b", "c", "d"]);
    assert_eq!(n, [700, 100, 100, 40]);
    // Writes after the session was built are seen by the next query; so are new tables.
    engine.table("t").unwrap().delete(&keys([500])).unwrap();
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t").unwrap()), 939);
    let u = engine.create_table("u", schema(), &["id"]).unwrap();
    u.insert(&rows(0..7, 1, "u")).unwrap();
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM u").unwrap()), 7);
}

#[test]
fn sql_pushes_projection_and_limit_into_the_scan() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let _t = layered_table(&engine);
    let plan = |q: &str| -> String {
        let b = engine.sql(&format!("EXPLAIN {q}")).unwrap();
        let b = &b[0];
        (0..b.num_rows()).map(|i| b.column(1).as_string::<i32>().value(i).to_owned() + "\n").collect()
    };
    let p = plan("SELECT s FROM t LIMIT 5");
    assert!(p.contains("GritScan: table=t, projection=[s], limit=5"), "{p}");
    let p = plan("SELECT v, id FROM t");
    assert!(p.contains("GritScan: table=t, projection=[id, v]") || p.contains("GritScan: table=t, projection=[v, id]"), "{p}");
    let p = plan("SELECT count(*) FROM t");
    assert!(p.contains("GritScan: table=t, projection=[]"), "{p}");
    let b = engine.sql("SELECT id, s FROM t LIMIT 5").unwrap();
    assert_eq!(total_rows(&b), 5);
    assert_eq!(b[0].schema().fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>(), ["id", "s"]);
    assert_eq!(total_rows(&engine.sql("SELECT * FROM t LIMIT 0").unwrap()), 0);
    assert_eq!(total_rows(&engine.sql("SELECT * FROM t LIMIT 2000").unwrap()), 940);
}

/// The text of `EXPLAIN ANALYZE <q>` (the plan with each operator's metrics).
fn analyze(engine: &Engine, q: &str) -> String {
    let b = engine.sql(&format!("EXPLAIN ANALYZE {q}")).unwrap();
    b.iter().flat_map(|b| (0..b.num_rows()).map(move |i| b.column(1).as_string::<i32>().value(i).to_owned() + "\n")).collect()
}

#[test]
fn sql_pushes_filters_into_the_scan_and_prunes_by_statistics() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(0..1000, 1, "a")).unwrap();
    t.flush().unwrap();
    t.insert(&rows(1000..2000, 1, "b")).unwrap();
    t.flush().unwrap(); // two files, one row group each: ids 0..1000 and 1000..2000
    let count = |w: &str| scalar(&engine.sql(&format!("SELECT count(*) FROM t WHERE {w}")).unwrap());
    let explain = |q: &str| -> String {
        let b = engine.sql(&format!("EXPLAIN {q}")).unwrap();
        (0..b[0].num_rows()).map(|i| b[0].column(1).as_string::<i32>().value(i).to_owned() + "\n").collect()
    };
    let p = explain("SELECT s FROM t WHERE id >= 1500");
    assert!(p.contains("GritScan: table=t, projection=[s], filter=id >= 1500") || p.contains("filter=id >= 1500"), "{p}");
    // The first file's statistics (max id 999) rule it out: one of two row groups pruned.
    let a = analyze(&engine, "SELECT count(*) FROM t WHERE id >= 1500");
    assert!(a.contains("row_groups_total=2") && a.contains("row_groups_pruned=1"), "{a}");
    assert!(a.contains("rows_matched=500"), "{a}");
    assert_eq!(count("id >= 1500"), 500);
    assert_eq!(count("1500 <= id"), 500);
    assert_eq!(count("id >= 100 AND id < 200"), 100);
    assert_eq!(count("id BETWEEN 10 AND 19"), 10);
    assert_eq!(count("id = 7 OR id = 1007"), 2);
    assert_eq!(count("s = 'b1500'"), 1);
    assert_eq!(count("id <> 0"), 1999);
    // Not translatable (LIKE): DataFusion filters alone, same answer.
    assert!(!explain("SELECT id FROM t WHERE s LIKE 'b1%'").contains("filter="));
    assert_eq!(count("s LIKE 'b1%'"), 1000);
    // Over deltas: updated values are matched, the stale file versions are not.
    t.update(&rows(0..10, 10, "c")).unwrap();
    assert_eq!(count("v = 5"), 0);
    assert_eq!(count("v = 50"), 2); // id 5 (updated) and id 50 (file)
    // NULLs: IS NULL / IS NOT NULL, and a comparison is never true for a null.
    let nulls = RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(vec![5000, 5001, 5002])),
            Arc::new(Int64Array::from(vec![None, None, Some(1)])),
            Arc::new(StringArray::from(vec![None, Some("x"), None])),
        ],
    )
    .unwrap();
    t.insert(&nulls).unwrap();
    assert_eq!(count("v IS NULL"), 2);
    assert_eq!(count("s IS NULL"), 2);
    assert_eq!(count("v IS NOT NULL AND id >= 5000"), 1);
    assert_eq!(count("v <> 3 AND id >= 5000"), 1);
    assert_eq!(count("v = NULL"), 0);
    t.flush().unwrap();
    assert_eq!(count("v IS NULL"), 2);
    assert_eq!(count("s IS NULL AND id >= 5000"), 2);
}

fn sql_err(engine: &Engine, q: &str) -> Error {
    match engine.sql(q) {
        Ok(b) => panic!("{q}: expected an error, got {b:?}"),
        Err(e) => e,
    }
}

fn kind(e: &Error) -> SqlErrorKind {
    match e {
        Error::Sql { kind, .. } => *kind,
        other => panic!("expected Error::Sql, got {other:?}"),
    }
}

#[test]
fn sql_bad_input_is_a_typed_error_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(0..10, 1, "a")).unwrap();
    // Not SQL; two statements; nothing at all.
    assert_eq!(kind(&sql_err(&engine, "SELEKT * FROM t")), SqlErrorKind::Syntax);
    assert_eq!(kind(&sql_err(&engine, "SELECT 1; SELECT 2")), SqlErrorKind::Syntax);
    assert_eq!(kind(&sql_err(&engine, "")), SqlErrorKind::Syntax);
    // Unknown table: the engine's own error.
    assert!(matches!(sql_err(&engine, "SELECT * FROM nope"), Error::TableNotFound { name } if name == "nope"));
    assert!(matches!(sql_err(&engine, "SELECT * FROM t JOIN missing ON true"), Error::TableNotFound { name } if name == "missing"));
    // Unknown column, in the select list and in a filter.
    let e = sql_err(&engine, "SELECT nope FROM t");
    assert_eq!(kind(&e), SqlErrorKind::UnknownColumn);
    assert!(e.to_string().contains("nope"), "{e}");
    assert_eq!(kind(&sql_err(&engine, "SELECT id FROM t WHERE zzz > 1")), SqlErrorKind::UnknownColumn);
    // Type errors and unknown functions are planning errors.
    assert_eq!(kind(&sql_err(&engine, "SELECT no_such_function(id) FROM t")), SqlErrorKind::Plan);
    // Writes and settings: not through SQL.
    for q in [
        "INSERT INTO t VALUES (100, 1, 'x')",
        "DELETE FROM t WHERE id = 1",
        "UPDATE t SET v = 0",
        "CREATE TABLE x (a INT)",
        "CREATE TABLE x AS SELECT * FROM t",
        "DROP TABLE t",
        "SET datafusion.execution.batch_size = 10",
        "COPY t TO '/tmp/x.parquet'",
        "EXPLAIN DELETE FROM t",
    ] {
        let e = sql_err(&engine, q);
        assert_eq!(kind(&e), SqlErrorKind::NotSupported, "{q}: {e}");
    }
    // A runtime failure.
    assert_eq!(kind(&sql_err(&engine, "SELECT id / (v - id) FROM t")), SqlErrorKind::Execution);
    // The source is kept.
    let e = sql_err(&engine, "SELECT nope FROM t");
    assert!(std::error::Error::source(&e).is_some());
    // Nothing changed, and the engine still answers.
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t").unwrap()), 10);
    assert_eq!(engine.table_names(), ["t"]);
    // After the table is dropped, and after the engine is closed.
    engine.drop_table("t").unwrap();
    assert!(matches!(sql_err(&engine, "SELECT * FROM t"), Error::TableNotFound { .. }));
    engine.close().unwrap();
}

#[test]
fn sql_after_close_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    engine.create_table("t", schema(), &["id"]).unwrap().insert(&rows(0..3, 1, "a")).unwrap();
    let ctx = engine.session_context().unwrap();
    engine.close().unwrap();
    // The session outlives the engine: its tables are gone with it, as a typed error.
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let r = rt.block_on(async { ctx.sql("SELECT * FROM t").await.map(|_| ()) });
    let e = r.unwrap_err();
    assert!(e.to_string().contains("closed"), "{e}");
}

#[test]
fn table_names_resolve_like_engine_table() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    engine.create_table("Orders", schema(), &["id"]).unwrap().insert(&rows(0..3, 1, "a")).unwrap();
    engine.create_table("my-table.v2", schema(), &["id"]).unwrap().insert(&rows(0..4, 1, "a")).unwrap();
    // Unquoted names are lowercased by SQL; the one table matching ignoring case is found.
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM Orders").unwrap()), 3);
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM orders").unwrap()), 3);
    assert_eq!(scalar(&engine.sql(r#"SELECT count(*) FROM "Orders""#).unwrap()), 3);
    assert_eq!(scalar(&engine.sql(r#"SELECT count(*) FROM "my-table.v2""#).unwrap()), 4);
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM gritdb.public.orders").unwrap()), 3);
    let b = engine.sql("SHOW TABLES").unwrap();
    let names: Vec<String> = b
        .iter()
        .flat_map(|b| {
            let c = b.column_by_name("table_name").unwrap().clone();
            (0..b.num_rows()).map(move |i| gritdb_soak::data::str_at(c.as_ref(), i).unwrap().to_owned())
        })
        .collect();
    for n in ["Orders", "my-table.v2", "gritdb_memory", "gritdb_tables"] {
        assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
    }
}

#[test]
fn system_tables_show_tables_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let t = layered_table(&engine);
    let empty = engine.create_table("empty", schema(), &["id"]).unwrap();
    let b = engine
        .sql("SELECT name, primary_key, rows, files, file_rows, delta_bytes, sealed_deltas, index_bytes, accounted_bytes, manifest_version, last_flush_error, damage FROM gritdb_tables ORDER BY name")
        .unwrap();
    let b = arrow::compute::concat_batches(&b[0].schema(), &b).unwrap();
    assert_eq!(b.num_rows(), 2);
    let name = b.column(0).as_string::<i32>();
    assert_eq!((name.value(0), name.value(1)), ("empty", "t"));
    assert_eq!(b.column(1).as_string::<i32>().value(1), "id");
    let u = |c: usize, r: usize| b.column(c).as_primitive::<UInt64Type>().value(r);
    let st = t.stats().unwrap();
    assert_eq!(u(2, 1), 940);
    assert_eq!(u(3, 1), st.files as u64);
    assert_eq!(u(3, 1), 2);
    assert_eq!(u(4, 1), st.file_rows);
    assert_eq!(u(4, 1), 900);
    assert_eq!(u(5, 1), (st.active_delta_bytes + st.sealed_delta_bytes) as u64);
    assert!(u(5, 1) > 0);
    assert_eq!(u(6, 1), st.sealed_deltas as u64);
    assert_eq!(u(7, 1), st.key_index_bytes as u64);
    assert_eq!(u(8, 1), st.accounted_bytes as u64);
    assert_eq!(u(9, 1), st.manifest_version);
    assert!(b.column(10).is_null(1));
    assert!(b.column(11).is_null(0) && b.column(11).is_null(1), "no file is damaged");
    assert!(st.damaged_files.is_empty() && st.damage.is_none());
    let es = empty.stats().unwrap();
    assert_eq!((u(2, 0), u(3, 0), u(5, 0), u(8, 0)), (0, 0, 0, es.accounted_bytes as u64));

    // gritdb_memory: one engine row per category, summing to `used`; the table's rows.
    engine.release_cached_memory();
    let b = engine.sql("SELECT scope, name, category, bytes, peak_bytes, allocs, frees, failures FROM gritdb_memory").unwrap();
    let b = arrow::compute::concat_batches(&b[0].schema(), &b).unwrap();
    let scope = b.column(0).as_string::<i32>();
    let cat = b.column(2).as_string::<i32>();
    let bytes = b.column(3).as_primitive::<UInt64Type>();
    let engine_rows: Vec<usize> = (0..b.num_rows()).filter(|&i| scope.value(i) == "engine").collect();
    assert_eq!(engine_rows.len(), Category::ALL.len());
    let cats: Vec<&str> = engine_rows.iter().map(|&i| cat.value(i)).collect();
    assert_eq!(cats, Category::ALL.iter().map(|c| c.name()).collect::<Vec<_>>());
    assert!(cats.contains(&"query"));
    let sum: u64 = engine_rows.iter().map(|&i| bytes.value(i)).sum();
    assert_eq!(sum as usize, engine.memory().used());
    let query_row = engine_rows.iter().find(|&&i| cat.value(i) == "query").unwrap();
    assert_eq!(bytes.value(*query_row), 0, "no query holds memory while the system table is computed");
    // Per table and category: the table's rows sum to all bytes accounted to it.
    let t_rows: Vec<usize> = (0..b.num_rows()).filter(|&i| scope.value(i) == "table" && b.column(1).as_string::<i32>().value(i) == "t").collect();
    let t_total: u64 = t_rows.iter().map(|&i| bytes.value(i)).sum();
    assert_eq!(t_total as usize, t.stats().unwrap().accounted_bytes);
    let row_blocks = t_rows.iter().find(|&&i| cat.value(i) == "row_blocks").map(|&i| bytes.value(i)).unwrap();
    assert!(row_blocks >= 64 << 10, "the active delta holds row blocks: {row_blocks}");
    // Aggregates over the system table work like over any table.
    let n = scalar(&engine.sql("SELECT count(*) FROM gritdb_memory WHERE scope = 'engine'").unwrap());
    assert_eq!(n as usize, Category::ALL.len());
}

#[test]
fn sql_from_async_code() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let _t = layered_table(&engine);
    // Blocking `sql` called on a runtime's worker thread (current-thread and multi-thread).
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let n = rt.block_on(async { scalar(&engine.sql("SELECT count(*) FROM t").unwrap()) });
    assert_eq!(n, 940);
    let rt2 = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let n = rt2.block_on(async { scalar(&engine.sql_async("SELECT sum(v) FROM t").await.unwrap()) });
    assert_eq!(n, layered_sum());
    let n = rt.block_on(async { scalar(&engine.sql_async("SELECT count(*) FROM t WHERE id >= 1000").await.unwrap()) });
    assert_eq!(n, 40);
    // A session context for DataFrame users, on their runtime.
    let ctx = engine.session_context().unwrap();
    let b = rt2.block_on(async { ctx.sql("SELECT max(id) FROM t").await.unwrap().collect().await.unwrap() });
    assert_eq!(scalar(&b), 1039);
    // Polled outside any tokio runtime: a typed error, not a panic.
    let mut fut = std::pin::pin!(engine.sql_async("SELECT 1"));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(Err(Error::Config(msg))) => assert!(msg.contains("tokio runtime"), "{msg}"),
        other => panic!("expected Config error, got {other:?}"),
    }
}

#[test]
fn query_memory_spills_or_fails_typed_and_returns_to_the_baseline() {
    // 64 MiB: queries may use what the write soft limit leaves (limit − 16 MiB flush headroom).
    const LIMIT: usize = 64 << 20;
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), LIMIT);
    let t = engine.create_table("big", schema(), &["id"]).unwrap();
    let n = 500_000i64; // ~50 MiB of rows (ids, values, ~80-byte strings)
    let tag = "a-fairly-long-string-value-that-makes-every-row-weigh-about-eighty-bytes-";
    for start in (0..n).step_by(50_000) {
        t.insert(&rows(start..start + 50_000, 3, tag)).unwrap();
    }
    t.flush().unwrap();
    let base = settled(&engine);
    assert_eq!(engine.memory().category_bytes(Category::Query), 0);

    // One aggregate holding every string of the table (~40 MiB) cannot spill: typed error.
    let e = sql_err(&engine, "SELECT array_agg(s) FROM big");
    match &e {
        Error::MemoryLimit { category, requested, limit, used, .. } => {
            assert_eq!(*category, Category::Query);
            assert!(*requested > 0 && *used + *requested > *limit, "{e}");
            assert!(*limit <= LIMIT);
        }
        other => panic!("expected MemoryLimit, got {other:?}"),
    }
    assert!(e.to_string().contains("query"), "{e}");
    assert_eq!(settled(&engine), base);
    assert_eq!(engine.memory().category_bytes(Category::Query), 0);
    assert!(engine.memory().peak() <= LIMIT);

    // A sort of every row by a string spills to disk and answers correctly.
    let failures_before = query_failures(&engine);
    let b = engine.sql("SELECT id, s FROM big ORDER BY s DESC, id").unwrap();
    assert_eq!(total_rows(&b), n as usize);
    let first = b.iter().find(|b| b.num_rows() > 0).unwrap();
    assert_eq!(first.column(1).as_string::<i32>().value(0), format!("{tag}99999"));
    let ids: Vec<i64> = b.iter().flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec()).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..n).collect::<Vec<_>>());
    assert!(query_failures(&engine) > failures_before, "the sort was refused memory at least once (it spilled)");
    drop(b);
    assert_eq!(engine.memory().category_bytes(Category::Query), 0, "a query that succeeded released everything");
    assert_eq!(settled(&engine), base);
    assert!(engine.memory().peak() <= LIMIT, "never above the limit");
    // Writes still work after the queries.
    t.insert(&rows(n..n + 10, 1, "z")).unwrap();
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM big").unwrap()), n + 10);
}

fn query_failures(engine: &Engine) -> u64 {
    engine.memory_report().categories.iter().find(|c| c.category == Category::Query).map_or(0, |c| c.failures)
}

/// Loads SF 0.01 lineitem (100 parts) through the soak's generator, flushes, updates and
/// deletes some parts (into files, deletion vectors and the active delta) and returns the
/// model of what the table must hold.
fn tpch_lineitem(engine: &Engine) -> LineitemAgg {
    const SF: f64 = 0.01;
    let t = engine.create_table("lineitem", data::lineitem_schema(), &LINEITEM_KEY).unwrap();
    let mut versions = vec![0u32; 100];
    for seq in 0..100 {
        for b in data::lineitems(SF, seq, 0).unwrap() {
            t.insert(&b).unwrap();
        }
    }
    t.flush().unwrap();
    for seq in 0..30 {
        for b in data::lineitems(SF, seq, 1).unwrap() {
            t.update(&b).unwrap();
        }
        versions[seq as usize] = 1;
    }
    let mut deleted = Vec::new();
    for seq in 90..100 {
        for b in data::lineitems(SF, seq, 0).unwrap() {
            t.delete(&data::key_columns(&b, &LINEITEM_KEY).unwrap()).unwrap();
        }
        deleted.push(seq);
    }
    t.flush().unwrap();
    for seq in 10..20 {
        for b in data::lineitems(SF, seq, 2).unwrap() {
            t.upsert(&b).unwrap(); // stays in the active delta
        }
        versions[seq as usize] = 2;
    }
    for seq in 85..90 {
        for b in data::lineitems(SF, seq, 0).unwrap() {
            t.delete(&data::key_columns(&b, &LINEITEM_KEY).unwrap()).unwrap(); // delete tombstones in the delta
        }
        deleted.push(seq);
    }
    let mut model = Vec::new();
    for seq in 0..100u64 {
        if !deleted.contains(&seq) {
            model.extend(data::lineitems(SF, seq, versions[seq as usize]).unwrap());
        }
    }
    assert!(t.stats().unwrap().active_delta_bytes > 0 && t.stats().unwrap().files >= 2);
    LineitemAgg::from_batches(&model).unwrap()
}

#[test]
fn tpch_q1_and_q6_through_sql_match_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 256 << 20);
    let model = tpch_lineitem(&engine);
    assert!(model.rows > 50_000, "{}", model.rows);
    let (rows, _) = tpch::run_q1(&engine).unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert_eq!(tpch::q1_diff(&model, &rows), None);
    assert_eq!(rows.iter().map(|r| r.count).sum::<u64>(), model.q1.values().map(|g| g.count).sum::<u64>());
    let revenue = tpch::q6_revenue(&engine.sql(tpch::Q6).unwrap()).unwrap();
    assert_eq!(revenue, model.q6_revenue);
    assert!(revenue > 0);
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM lineitem").unwrap()), model.rows as i64);
    // And the answers survive a reopen (deltas replayed from the WAL, files reread).
    drop(engine);
    let engine = open(dir.path(), 256 << 20);
    let (rows, _) = tpch::run_q1(&engine).unwrap();
    assert_eq!(tpch::q1_diff(&model, &rows), None);
    assert_eq!(tpch::q6_revenue(&engine.sql(tpch::Q6).unwrap()).unwrap(), model.q6_revenue);
    assert_eq!(engine.memory().category_bytes(Category::Query), 0);
}

/// A table `name` of `id` (Int64, the key) and `x` (Float64, nullable) holding `xs` at ids
/// 0, 1, ...: the first `in_file` rows flushed to a data file, the rest in the delta.
fn float_table(engine: &Engine, name: &str, xs: &[Option<f64>], in_file: usize) -> gritdb::Table {
    let s = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false), Field::new("x", DataType::Float64, true)]));
    let t = engine.create_table(name, Arc::clone(&s), &["id"]).unwrap();
    let batch = |range: std::ops::Range<usize>| {
        let ids = Int64Array::from_iter_values(range.clone().map(|i| i as i64));
        RecordBatch::try_new(Arc::clone(&s), vec![Arc::new(ids), Arc::new(arrow::array::Float64Array::from(xs[range].to_vec()))]).unwrap()
    };
    t.insert(&batch(0..in_file)).unwrap();
    t.flush().unwrap();
    t.insert(&batch(in_file..xs.len())).unwrap();
    t
}

/// A float column compared with DECIMAL constants (`1.5` parses as DECIMAL in this session)
/// compares in floating point: NaN, ±infinity and 1e20 in the column answer instead of failing
/// a cast to DECIMAL(30, 15); constant arithmetic is exact before the comparison
/// (`0.06 + 0.01` is 0.07); rows in files and in the delta answer alike; a DECIMAL column
/// still compares exactly (TPC-H Q6 above). Float comparisons follow `DataFusion`'s semantics
/// throughout (-0.0 = 0.0, a positive NaN above every number): they are not pushed into the
/// scan, whose filters order NaNs otherwise, so no row falls between the two.
#[test]
fn float_columns_compare_with_decimal_constants_in_floating_point() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let xs = [Some(1.5), Some(2.5), Some(f64::NAN), Some(f64::INFINITY), Some(f64::NEG_INFINITY), Some(1e20), Some(0.07), None, Some(-0.0)];
    float_table(&engine, "fx", &xs, 5); // the first five in a file, the rest in the delta
    let count = |q: &str| scalar(&engine.sql(q).unwrap_or_else(|e| panic!("{q}: {e}")));
    for (q, want) in [
        ("SELECT count(*) FROM fx WHERE x > 1.0", 5), // 1.5, 2.5, NaN (above every number), inf, 1e20
        ("SELECT count(*) FROM fx WHERE 1.0 < x", 5),
        ("SELECT count(*) FROM fx WHERE x = 1.5", 1),
        ("SELECT count(*) FROM fx WHERE x <> 1.5", 7), // NULL is neither
        ("SELECT count(*) FROM fx WHERE x < -1.0", 1),
        ("SELECT count(*) FROM fx WHERE x >= 100000000000000000000.0", 3), // 1e20, inf, NaN
        ("SELECT count(*) FROM fx WHERE x BETWEEN 0.06 - 0.01 AND 0.06 + 0.01", 1),
        ("SELECT count(*) FROM fx WHERE x NOT BETWEEN 0.0 AND 2.0", 5), // 2.5, NaN, inf, -inf, 1e20
        ("SELECT count(*) FROM fx WHERE x IN (1.5, 2.5, 3.5)", 2),
        ("SELECT count(*) FROM fx WHERE x = 0.0", 1), // -0.0 equals 0.0
        ("SELECT count(*) FROM fx WHERE x IS NOT DISTINCT FROM 2.5", 1),
        // The -0.0 row (id 8) is on exactly one side of every partition at 0 (it equals 0.0
        // here), whether the filter could be pushed into the scan or not.
        ("SELECT count(*) FROM fx WHERE id = 8 AND x < 0.0", 0),
        ("SELECT count(*) FROM fx WHERE id = 8 AND x >= 0.0", 1),
        ("SELECT count(*) FROM fx WHERE id = 8 AND x BETWEEN 0.0 AND 2.0", 1),
        ("SELECT count(*) FROM fx WHERE x < 0.0 OR x >= 0.0", 8), // all but the NULL
    ] {
        assert_eq!(count(q), want, "{q}");
    }
}

/// How floats compare, on every operator, for −0.0, 0.0, NaNs of both signs and two payloads,
/// ±infinity, ±1.5, ±the smallest subnormal and NULL, as literals and as stored values, in a
/// file and in the delta:
/// - `ScanFilter` scans compare as `PostgreSQL` does (and as keys are identified): −0.0 = 0.0,
///   every NaN equals every NaN and is above every number. Before, they compared in totalOrder
///   (−0.0 < 0.0, NaNs by bits), so `x = 0.0` missed a stored −0.0 that SQL found.
/// - SQL compares as `DataFusion` 55 does (`apply_cmp` normalizes the sign of zero only): −0.0 =
///   0.0, NaNs in totalOrder, so a negative NaN is below −infinity and NaN payloads differ. That
///   is why float comparisons are not pushed into the scan (`sql/filter.rs`); on every value
///   but those NaNs the two agree, which the test checks too.
#[test]
fn floats_compare_in_scans_as_in_postgresql_and_in_sql_as_in_datafusion() {
    use gritdb::{CompareOp, ScanFilter, ScanOptions};
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let values: Vec<Option<f64>> = [0u64, 0x8000_0000_0000_0000, 0x7ff8_0000_0000_0000, 0xfff8_0000_0000_0000, 0x7ff8_0000_0000_0001, 0xfff0_0000_0000_0001]
        .iter()
        .chain(&[0x7ff0_0000_0000_0000, 0xfff0_0000_0000_0000, 0x3ff8_0000_0000_0000, 0xbff8_0000_0000_0000, 1, 0x8000_0000_0000_0001])
        .map(|b| Some(f64::from_bits(*b)))
        .chain([None])
        .collect();
    let t = float_table(&engine, "fz", &values, 7); // seven values in a file, six in the delta
    let pg = |v: f64, lit: f64| match (v.is_nan(), lit.is_nan()) {
        (true, true) => std::cmp::Ordering::Equal,
        (true, false) => std::cmp::Ordering::Greater,
        (false, true) => std::cmp::Ordering::Less,
        _ => v.partial_cmp(&lit).unwrap(),
    };
    let literals = [
        ("'0'", 0.0),
        ("'-0.0'", -0.0),
        ("'NaN'", f64::NAN),
        ("'-NaN'", -f64::NAN),
        ("'inf'", f64::INFINITY),
        ("'-inf'", f64::NEG_INFINITY),
        ("'1.5'", 1.5),
        ("'-1.5'", -1.5),
    ];
    let ops = [("=", CompareOp::Eq), ("<>", CompareOp::NotEq), ("<", CompareOp::Lt), ("<=", CompareOp::LtEq), (">", CompareOp::Gt), (">=", CompareOp::GtEq)];
    // DataFusion's rule: the sign of zero dropped, then totalOrder.
    let datafusion = |v: f64, lit: f64| (if v == 0.0 { 0.0 } else { v }).total_cmp(&(if lit == 0.0 { 0.0 } else { lit }));
    let holds = |op: CompareOp, c: std::cmp::Ordering| match op {
        CompareOp::Eq => c.is_eq(),
        CompareOp::NotEq => c.is_ne(),
        CompareOp::Lt => c.is_lt(),
        CompareOp::LtEq => c.is_le(),
        CompareOp::Gt => c.is_gt(),
        _ => c.is_ge(),
    };
    let odd_nan = |v: f64| v.is_nan() && v.to_bits() != f64::NAN.to_bits();
    for (text, lit) in literals {
        for (sym, op) in ops {
            let want = values.iter().flatten().filter(|v| holds(op, pg(**v, lit))).count();
            let f = ScanFilter::compare("x", op, Arc::new(arrow::array::Float64Array::from(vec![lit])));
            let scanned: usize = t.scan(ScanOptions::default().filter(f)).unwrap().map(|b| b.unwrap().num_rows()).sum();
            assert_eq!(scanned, want, "scan: x {sym} {lit}");
            let q = format!("SELECT count(*) FROM fz WHERE x {sym} CAST({text} AS DOUBLE)");
            let by_datafusion = values.iter().flatten().filter(|v| holds(op, datafusion(**v, lit))).count();
            assert_eq!(scalar(&engine.sql(&q).unwrap()), by_datafusion as i64, "{q}");
            // Away from the odd NaNs (negative, or with a payload), SQL and scans agree.
            if !odd_nan(lit) {
                let sane = |v: &&f64| !odd_nan(**v);
                let (a, b) = (
                    values.iter().flatten().filter(sane).filter(|v| holds(op, pg(**v, lit))).count(),
                    values.iter().flatten().filter(sane).filter(|v| holds(op, datafusion(**v, lit))).count(),
                );
                assert_eq!(a, b, "x {sym} {lit}");
            }
        }
    }
}

/// A table scan has `EngineConfig::sql_scan_partitions` partitions over one snapshot
/// (`Table::scan_partitions`), read on as many threads: every row once whatever the count,
/// with deletion vectors and in-memory updates, deletes and inserts; a LIMIT reads one
/// partition. A physical plan executed twice takes a new snapshot the second time and sees
/// the writes made between.
#[test]
fn sql_scans_read_one_snapshot_in_target_partitions() {
    use gritdb::sql::datafusion::physical_plan::collect;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let sum = layered_sum() + (2_000..6_000).sum::<i64>();
    for n in 1..=5usize {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig::default().memory_limit(64 << 20).sql_scan_partitions(n);
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = layered_table(&engine);
        // More files: row groups of several files for the partitions to share.
        for from in (2_000..6_000).step_by(1_000) {
            t.insert(&rows(from..from + 1_000, 1, "e")).unwrap();
            t.flush().unwrap();
        }
        let ctx = engine.session_context().unwrap();
        let q = |sql: &str| rt.block_on(async { ctx.sql(sql).await.unwrap().collect().await.unwrap() });
        let explain = q("EXPLAIN SELECT id, v FROM t");
        let text = arrow::util::pretty::pretty_format_batches(&explain).unwrap().to_string();
        let label =
            if n == 1 { "GritScan: table=t, projection=[id, v]\n".to_owned() } else { format!("GritScan: table=t, projection=[id, v], partitions={n}") };
        assert!(text.contains(label.trim_end()), "n = {n}: {text}");
        let b = q("SELECT id, v FROM t");
        let mut ids: Vec<i64> = b.iter().flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec()).collect();
        let v: i64 = b.iter().map(|b| b.column(1).as_primitive::<Int64Type>().values().iter().sum::<i64>()).sum();
        ids.sort_unstable();
        let want: Vec<i64> = (100..1040).chain(2_000..6_000).collect();
        assert_eq!(ids, want, "n = {n}: every row once");
        assert_eq!(v, sum, "n = {n}");
        assert_eq!(scalar(&q("SELECT count(*) FROM t WHERE s LIKE 'c%'")), 100, "n = {n}");
        let limited = q("EXPLAIN SELECT id FROM t LIMIT 3");
        let text = arrow::util::pretty::pretty_format_batches(&limited).unwrap().to_string();
        assert!(text.contains("GritScan: table=t, projection=[id], limit=3") && !text.contains("limit=3, partitions"), "n = {n}: {text}");
        assert_eq!(total_rows(&q("SELECT id FROM t LIMIT 3")), 3);
        // One physical plan (a scan, its partitions merged), executed twice: the second run is
        // a new snapshot.
        let plan = rt.block_on(async { ctx.sql("SELECT v FROM t").await.unwrap().create_physical_plan().await.unwrap() });
        let run = || {
            let b = rt.block_on(collect(std::sync::Arc::clone(&plan), ctx.task_ctx())).unwrap();
            (total_rows(&b) as i64, b.iter().map(|b| b.column(0).as_primitive::<Int64Type>().values().iter().sum::<i64>()).sum::<i64>())
        };
        assert_eq!(run(), (4_940, sum), "n = {n}");
        t.insert(&rows([10_000 + n as i64], 1, "f")).unwrap();
        assert_eq!(run(), (4_941, sum + 10_000 + n as i64), "n = {n}: the second run sees the insert");
        assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t").unwrap()), 4_941, "n = {n}: Engine::sql");
        // Result batches that are the scan's own stay counted while held (`b` above).
        drop((t, plan, b));
        assert_eq!(settled(&engine).iter().find(|(c, _)| *c == Category::ScanBuffers).map(|(_, b)| *b), Some(0), "n = {n}");
    }
    let e = Engine::open(tempfile::tempdir().unwrap().path(), EngineConfig { sql_scan_partitions: gritdb::MAX_THREADS + 1, ..EngineConfig::default() });
    assert!(matches!(e, Err(Error::Config(ref m)) if m.contains("sql_scan_partitions")), "{:?}", e.err());
}

/// A WHERE clause of 1,000 ORs (of ranges: `DataFusion` makes a chain of equalities an
/// `IN` list, which is not pushed), which the SQL parser builds as a tree 1,000 deep, is
/// pushed into the scan as one `Or` of 1,000 parts (the translation walks the chain with a
/// heap stack and flattens it; it recursed once per OR into a filter 1,000 deep, past
/// `MAX_FILTER_DEPTH`) and returns the matching rows. (`DataFusion` itself overflows a 2 MiB
/// stack cloning a chain of about 2,000: its `Expr::clone` recurses.)
#[test]
fn sql_pushes_a_long_or_chain_as_one_flat_filter() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(0..10_000, 1, "a")).unwrap();
    t.flush().unwrap();
    let ranges: Vec<String> = (0..1_000).map(|i| format!("id > {} AND id < {}", i * 3 - 1, i * 3 + 1)).collect();
    let q = format!("SELECT count(*) FROM t WHERE {}", ranges.join(" OR "));
    let b = engine.sql(&format!("EXPLAIN {q}")).unwrap();
    let plan: String = (0..b[0].num_rows()).map(|i| b[0].column(1).as_string::<i32>().value(i).to_owned() + "\n").collect();
    assert!(plan.contains("filter=((id > -1 AND id < 1) OR (id > 2 AND id < 4) OR (id > 5 AND id < 7) OR "), "{}", &plan[..plan.len().min(3000)]);
    assert!(plan.contains(" OR (id > 2996 AND id < 2998))"), "the whole chain is one flat Or");
    assert_eq!(scalar(&engine.sql(&q).unwrap()), 1_000);
}

/// `n` terms `term(i)` joined by `op`.
fn chain(n: usize, op: &str, term: impl Fn(usize) -> String) -> String {
    (0..n).map(term).collect::<Vec<_>>().join(op)
}

/// A statement of `Error::Sql { kind: TooDeep }`, whose text names the limit and a rewrite.
fn assert_too_deep(r: gritdb::Result<Vec<RecordBatch>>, what: &str) {
    match r {
        Err(e @ Error::Sql { kind: SqlErrorKind::TooDeep, .. }) => {
            let text = e.to_string();
            assert!(text.contains(&format!("more than the {} gritdb plans", gritdb::sql::MAX_DEPTH)), "{what}: {text}");
            assert!(text.contains("IN (v1, v2, ...)"), "{what}: {text}");
        }
        other => panic!("{what}: expected TooDeep, got {:?}", other.map(|b| total_rows(&b))),
    }
}

/// A statement refused by the SQL parser's recursion limit: `TooDeep`, naming the limit.
fn assert_parser_too_deep(r: gritdb::Result<Vec<RecordBatch>>, what: &str) {
    match r {
        Err(e @ Error::Sql { kind: SqlErrorKind::TooDeep, .. }) => {
            let text = e.to_string();
            assert!(text.contains(&format!("{} levels the SQL parser takes", gritdb::sql::PARSER_RECURSION_LIMIT)), "{what}: {text}");
        }
        other => panic!("{what}: expected TooDeep, got {:?}", other.map(|b| total_rows(&b))),
    }
}

/// `n` subqueries in `FROM`, each keeping `id >= i`: `count(*)` is 10,000 - n.
fn nested_from(n: usize) -> String {
    let mut q = "SELECT * FROM t".to_owned();
    for i in 1..=n {
        q = format!("SELECT * FROM ({q}) s{i} WHERE id >= {i}");
    }
    format!("SELECT count(*) FROM ({q}) x")
}

/// An engine (128 MiB limit) with table `t` holding ids 0..10,000, flushed, and `check` run
/// with it on a caller thread of 256 KiB of stack; a panic or an overflow there fails the
/// test. Returns the data directory and the engine, for what runs after.
fn on_a_small_stack(check: impl FnOnce(Arc<Engine>) + Send + 'static) -> (tempfile::TempDir, Arc<Engine>) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(open(dir.path(), 128 << 20));
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(0..10_000, 1, "a")).unwrap();
    t.flush().unwrap();
    let e = Arc::clone(&engine);
    std::thread::Builder::new().stack_size(256 << 10).spawn(move || check(e)).unwrap().join().expect("no panic, no overflow");
    (dir, engine)
}

/// Nesting the SQL parser counts (parentheses, `NOT`, `CASE`, subqueries) runs well past the
/// parser's default limit of 50, at which 49 parentheses, 49 `NOT`s, a `CASE` 50 deep and 30
/// nested subqueries were confusing syntax errors ("Expected: end of statement, found:
/// NOT"); past `PARSER_RECURSION_LIMIT` it is `TooDeep`, and subqueries inside expressions
/// past `MAX_SUBQUERY_DEPTH` too. The deepest the limit lets through does not overflow the
/// stack (1,990 nested subqueries in `FROM` did, on the 64 MiB `gritdb-sql` stack, when the
/// limit was lifted). Run from a caller thread of 256 KiB.
#[test]
fn deep_nesting_through_the_parser_runs() {
    let (_dir, _engine) = on_a_small_stack(|engine| {
        let sum = (0..10_000i64).sum::<i64>();
        let parens = |n: usize| format!("SELECT count(*) FROM t WHERE {}id > 0{}", "(".repeat(n), ")".repeat(n));
        let nots = |n: usize| format!("SELECT count(*) FROM t WHERE {}id > 0", "NOT ".repeat(n));
        let case = |n: usize| format!("SELECT sum({}id{}) FROM t", "CASE WHEN id < 0 THEN 0 ELSE ".repeat(n), " END".repeat(n));
        let calls = |n: usize| format!("SELECT sum({}id{}) FROM t", "abs(".repeat(n), ")".repeat(n));
        assert_eq!(scalar(&engine.sql(&parens(49)).unwrap()), 9_999);
        assert_eq!(scalar(&engine.sql(&parens(200)).unwrap()), 9_999);
        assert_eq!(scalar(&engine.sql(&nots(49)).unwrap()), 1, "49 NOTs: id <= 0");
        assert_eq!(scalar(&engine.sql(&nots(200)).unwrap()), 9_999);
        assert_eq!(scalar(&engine.sql(&case(50)).unwrap()), sum);
        assert_eq!(scalar(&engine.sql(&case(100)).unwrap()), sum);
        assert_eq!(scalar(&engine.sql(&calls(100)).unwrap()), sum);
        assert_eq!(scalar(&engine.sql(&nested_from(30)).unwrap()), 10_000 - 30);
        assert_eq!(scalar(&engine.sql(&nested_from(100)).unwrap()), 10_000 - 100);
        // Subqueries inside expressions: scalar, IN and EXISTS.
        let scalars = |n: usize| format!("SELECT {}count(*) FROM t{}", "(SELECT ".repeat(n), ")".repeat(n));
        assert_eq!(scalar(&engine.sql(&scalars(10)).unwrap()), 10_000);
        let mut ins = "SELECT id FROM t".to_owned();
        for i in 1..=10 {
            ins = format!("SELECT id FROM t WHERE id >= {i} AND id IN ({ins})");
        }
        assert_eq!(scalar(&engine.sql(&format!("SELECT count(*) FROM ({ins}) x")).unwrap()), 10_000 - 10);
        // The deepest the parser's limit lets through runs, without overflowing the stack.
        assert_eq!(scalar(&engine.sql(&parens(480)).unwrap()), 9_999);
        assert_eq!(scalar(&engine.sql(&nots(480)).unwrap()), 9_999);
        assert_eq!(scalar(&engine.sql(&nested_from(240)).unwrap()), 10_000 - 240);
        // Past it: `TooDeep`, not a syntax error, and no overflow either.
        assert_parser_too_deep(engine.sql(&parens(600)), "600 parentheses");
        assert_parser_too_deep(engine.sql(&case(600)), "a CASE 600 deep");
        assert_parser_too_deep(engine.sql(&nested_from(300)), "300 subqueries in FROM");
        assert_parser_too_deep(engine.sql(&nested_from(1_990)), "1,990 subqueries in FROM");
        match engine.sql(&scalars(gritdb::sql::MAX_SUBQUERY_DEPTH + 1)) {
            Err(e @ Error::Sql { kind: SqlErrorKind::TooDeep, .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("more than the {} gritdb plans", gritdb::sql::MAX_SUBQUERY_DEPTH)), "{text}");
            }
            other => panic!("21 nested scalar subqueries: expected TooDeep, got {:?}", other.map(|b| total_rows(&b))),
        }
    });
}

/// Deep statements run or are refused typed; none overflows a stack, also when the caller's
/// thread has only 256 KiB of it (every statement runs on the engine's SQL runtime, whose
/// threads have `gritdb::sql::STACK_BYTES`). Before, a WHERE clause of 2,000 ORs overflowed
/// a 2 MiB stack inside `DataFusion`'s planner and aborted the process; so did 3,000 ANDs or
/// `+`s, 3,000 casts, 3,000 UNIONs and 1,000 joins (measured on the caller's thread, and
/// for ANDs and `+` on the `gritdb-sql` workers that evaluated them).
#[test]
fn deep_sql_runs_or_is_refused_typed_and_never_overflows_the_stack() {
    let (_dir, engine) = on_a_small_stack(|engine| {
        let or = |n: usize| format!("SELECT count(*) FROM t WHERE {}", chain(n, " OR ", |i| format!("id = {i}")));
        // 1,000 ORs run; the same chain at the limit runs (depth: the query, 1,997
        // ORs, the `=` and its operand is exactly `MAX_DEPTH`), one more is refused.
        assert_eq!(scalar(&engine.sql(&or(1_000)).unwrap()), 1_000);
        let limit = gritdb::sql::MAX_DEPTH;
        assert_eq!(scalar(&engine.sql(&or(limit - 2)).unwrap()), (limit - 2) as i64);
        assert_too_deep(engine.sql(&or(limit - 1)), "one OR past the limit");
        // 10,000 ORs: measured on the parsed tree; 100,000: on the tokens, never parsed.
        assert_too_deep(engine.sql(&or(10_000)), "10,000 ORs");
        assert_too_deep(engine.sql(&or(100_000)), "100,000 ORs");
        assert_too_deep(engine.sql(&format!("EXPLAIN {}", or(10_000))), "EXPLAIN of 10,000 ORs");
        // The rewrite the error proposes runs.
        let list = format!("SELECT count(*) FROM t WHERE id IN ({})", chain(10_000, ", ", |i| i.to_string()));
        assert_eq!(scalar(&engine.sql(&list).unwrap()), 10_000);
        // ANDs, and `+` evaluated per row (DataFusion's physical expressions recurse per level).
        let and = |n: usize| format!("SELECT count(*) FROM t WHERE {}", chain(n, " AND ", |i| format!("id <> {}", 20_000 + i)));
        assert_eq!(scalar(&engine.sql(&and(1_000)).unwrap()), 10_000);
        assert_too_deep(engine.sql(&and(10_000)), "10,000 ANDs");
        let plus = |n: usize| format!("SELECT sum({}) FROM t", chain(n, " + ", |_| "v".to_owned()));
        assert_eq!(scalar(&engine.sql(&plus(1_000)).unwrap()), 1_000 * (0..10_000i64).sum::<i64>());
        assert_too_deep(engine.sql(&plus(10_000)), "a chain of 10,000 `+`");
        let casts = |n: usize| format!("SELECT sum(id{}) FROM t", "::bigint".repeat(n));
        assert_eq!(scalar(&engine.sql(&casts(1_000)).unwrap()), (0..10_000i64).sum::<i64>());
        assert_too_deep(engine.sql(&casts(10_000)), "10,000 casts");
        // Parentheses, function calls and CASE nest through the parser's recursion, which
        // stops at `PARSER_RECURSION_LIMIT` levels: `TooDeep` (before, at the parser's
        // default of 50, a syntax error).
        let case = |n: usize| format!("SELECT sum({}id{}) FROM t", "CASE WHEN id < 0 THEN 0 ELSE ".repeat(n), " END".repeat(n));
        for (what, q) in [
            ("10,000 parentheses", format!("SELECT count(*) FROM t WHERE {}id > 0{}", "(".repeat(10_000), ")".repeat(10_000))),
            ("10,000 nested calls", format!("SELECT sum({}id{}) FROM t", "abs(".repeat(10_000), ")".repeat(10_000))),
            ("10,000 nested CASEs", case(10_000)),
        ] {
            assert_parser_too_deep(engine.sql(&q), what);
        }
        assert_eq!(scalar(&engine.sql(&case(40)).unwrap()), (0..10_000i64).sum::<i64>());
        // A CASE of 5,000 branches is flat (its branches are siblings): it runs.
        let branches = format!("SELECT sum(CASE {} ELSE 0 END) FROM t", chain(5_000, " ", |i| format!("WHEN id = {i} THEN 1")));
        assert_eq!(scalar(&engine.sql(&branches).unwrap()), 5_000);
        // Many UNIONs: a set operation per level of the plan.
        let unions = |n: usize| chain(n, " UNION ALL ", |i| format!("SELECT {i} AS x"));
        assert_eq!(total_rows(&engine.sql(&unions(500)).unwrap()), 500);
        assert_too_deep(engine.sql(&unions(5_000)), "5,000 UNION ALLs");
        assert_too_deep(engine.sql(&chain(5_000, " UNION ", |i| format!("SELECT id FROM t WHERE id = {i}"))), "5,000 UNIONs of scans");
        // Joins and CTEs are flat lists in the syntax tree and a left-deep plan.
        let joins = format!("SELECT count(*) FROM t a0 {}", chain(3_000, " ", |i| format!("JOIN t a{} ON a{}.id = a0.id", i + 1, i + 1)));
        assert_too_deep(engine.sql(&joins), "3,000 joins");
        let ctes =
            format!("WITH c0 AS (SELECT id FROM t), {} SELECT count(*) FROM c3000", chain(3_000, ", ", |i| format!("c{} AS (SELECT id FROM c{i})", i + 1)));
        assert_too_deep(engine.sql(&ctes), "3,000 chained CTEs");
        // Nested types are parsed by unguarded recursion: bounded on the tokens, at
        // `gritdb_unify::MAX_TYPE_DEPTH` (64) levels, as column types are.
        let types = |n: usize| format!("SELECT CAST(NULL AS {}BIGINT{})", "ARRAY<".repeat(n), ">".repeat(n));
        assert_too_deep(engine.sql(&types(100_000)), "an ARRAY type nested 100,000 deep");
        assert_eq!(total_rows(&engine.sql(&types(64)).unwrap()), 1);
        for q in [types(65), format!("SELECT CAST(NULL AS BIGINT{})", "[]".repeat(65))] {
            match engine.sql(&q) {
                Err(e @ Error::Sql { kind: SqlErrorKind::TooDeep, .. }) => assert!(e.to_string().contains("nests data types 65 levels deep"), "{e}"),
                other => panic!("a type nested 65 deep: expected TooDeep, got {:?}", other.map(|b| total_rows(&b))),
            }
        }
    });
    // Async code: refused the same way, and a deep chain within the limit runs, also on a
    // current-thread runtime (the statement runs on the engine's runtime).
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let q = format!("SELECT count(*) FROM t WHERE {}", chain(1_500, " OR ", |i| format!("id = {i}")));
        assert_eq!(scalar(&engine.sql_async(&q).await.unwrap()), 1_500);
        let q = format!("SELECT count(*) FROM t WHERE {}", chain(10_000, " OR ", |i| format!("id = {i}")));
        assert_too_deep(engine.sql_async(&q).await, "sql_async, 10,000 ORs");
    });
    // The engine still answers.
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t").unwrap()), 10_000);
}

/// 600 and 2,000 `NOT`s in a row, and a `CASE … ELSE -1 END` nested 600 deep, hold no
/// parentheses for the token bound to count, so the parser's own limit refuses them; its
/// error came wrapped in a `DataFusionError::Diagnostic` and read as a `Syntax` error
/// ("Expected: end of statement, found: NOT"; fresh-clone trial, 2026-12-04). They are
/// `TooDeep`, and 480 of each still run, with their values.
#[test]
fn not_and_case_chains_past_the_parser_limit_are_too_deep() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 64 << 20);
    let not = |n: usize| format!("SELECT {}true AS v", "NOT ".repeat(n));
    let case = |n: usize| {
        let mut c = String::from("7");
        for _ in 0..n {
            c = format!("CASE WHEN 1 >= 0 THEN {c} ELSE -1 END");
        }
        format!("SELECT {c} AS v")
    };
    let b = engine.sql(&not(480)).unwrap();
    assert!(b[0].column(0).as_boolean().value(0), "480 NOTs of true");
    let b = engine.sql(&not(481)).unwrap();
    assert!(!b[0].column(0).as_boolean().value(0), "481 NOTs of true");
    let b = engine.sql(&case(480)).unwrap();
    assert_eq!(b[0].column(0).as_primitive::<Int64Type>().value(0), 7);
    for (what, q) in [("600 NOTs", not(600)), ("2,000 NOTs", not(2_000)), ("a CASE 600 deep", case(600))] {
        match engine.sql(&q) {
            Err(e @ Error::Sql { kind: SqlErrorKind::TooDeep, .. }) => {
                assert!(e.to_string().contains(&format!("more than the {} level", gritdb::sql::PARSER_RECURSION_LIMIT)), "{what}: {e}");
            }
            other => panic!("{what}: expected TooDeep, got {:?}", other.map(|b| total_rows(&b))),
        }
    }
}

/// `CUBE (..)` past `MAX_CUBE_EXPRESSIONS` is a `Plan` error before DataFusion builds its
/// 2^n grouping sets in memory no limit governs (30 expressions asked for about 50 GiB), also
/// inside a subquery and under `EXPLAIN`; 12 expressions (4,096 sets) run with the right
/// answer, and so do `ROLLUP` and `GROUPING SETS` of 30.
#[test]
fn cube_past_twelve_expressions_is_refused_before_planning() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 256 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(1..=3, 10, "s")).unwrap();
    let items = |n: usize| (0..n).map(|i| format!("id + {i}")).collect::<Vec<_>>().join(", ");
    let groups = |grouping: &str| format!("SELECT count(*) FROM (SELECT 1 FROM t GROUP BY {grouping})");
    let max = gritdb::sql::MAX_CUBE_EXPRESSIONS;
    assert_eq!(max, 12);
    // Every set holding an expression has the 3 ids' groups; the empty set one group.
    assert_eq!(scalar(&engine.sql(&groups(&format!("CUBE ({})", items(max)))).unwrap()), 3 * 4095 + 1);
    assert_eq!(scalar(&engine.sql(&groups(&format!("ROLLUP ({})", items(30)))).unwrap()), 3 * 30 + 1);
    let sets = (0..30).map(|i| format!("(id + {i})")).collect::<Vec<_>>().join(", ");
    assert_eq!(scalar(&engine.sql(&groups(&format!("GROUPING SETS ({sets}, ())"))).unwrap()), 3 * 30 + 1);
    for n in [max + 1, 30, 63, 64, 200] {
        for q in [
            groups(&format!("CUBE ({})", items(n))),
            format!("SELECT id, ({}) FROM t", groups(&format!("CUBE ({})", items(n)))),
            format!("EXPLAIN {}", groups(&format!("CUBE ({})", items(n)))),
            groups(&format!("id, CUBE ({})", items(n))),
        ] {
            let e = sql_err(&engine, &q);
            assert_eq!(kind(&e), SqlErrorKind::Plan, "{n}: {e}");
            assert!(e.to_string().contains(&format!("`CUBE` of {n} expressions")), "{n}: {e}");
        }
    }
    // The table is untouched and answers.
    assert_eq!(scalar(&engine.sql("SELECT sum(v) FROM t").unwrap()), 60);
}

/// `WITH c0 AS (SELECT 1 AS x), c1 AS (<body(0)>), ..., cn AS (<body(n - 1)>) <tail>`.
fn cte_chain(n: usize, body: impl Fn(usize) -> String, tail: &str) -> String {
    format!("WITH c0 AS (SELECT 1 AS x), {} {tail}", chain(n, ", ", |i| format!("c{} AS ({})", i + 1, body(i))))
}

/// `TooDeep` whose text says `says`.
fn assert_too_deep_saying(r: gritdb::Result<Vec<RecordBatch>>, says: &str, what: &str) {
    match r {
        Err(e @ Error::Sql { kind: SqlErrorKind::TooDeep, .. }) => assert!(e.to_string().contains(says), "{what}: {e}"),
        other => panic!("{what}: expected TooDeep, got {:?}", other.map(|b| total_rows(&b))),
    }
}

/// `DataFusion` copies a CTE's plan into each reference, so a chain of CTEs each holding a
/// scalar subquery of the one before nested subqueries past `MAX_SUBQUERY_DEPTH` (fresh-user
/// trial: 20 planned in 6.3 s, 25 and 30 still planning after 45 s, `Engine::sql` blocked),
/// and a chain each reading the one before twice doubled its plan per CTE (2^31 relations at
/// 30). A reference now counts its CTE's subqueries and relations where it stands: just under
/// each bound runs with its value, just over is `TooDeep`, scoped as `DataFusion` resolves
/// names; a long chain of CTEs each read once still runs.
#[test]
fn cte_references_count_the_plan_they_copy() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 128 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(0..10_000, 1, "a")).unwrap();
    t.flush().unwrap();
    let max = gritdb::sql::MAX_SUBQUERY_DEPTH;
    let subqueries = format!("more than the {max} gritdb plans");
    // Each CTE a scalar subquery of the one before: one subquery more per CTE.
    let sub = |n: usize| cte_chain(n, |p| format!("SELECT (SELECT x FROM c{p}) AS x"), &format!("SELECT x FROM c{n}"));
    assert_eq!(scalar(&engine.sql(&sub(max)).unwrap()), 1);
    assert_too_deep_saying(engine.sql(&sub(max + 1)), &subqueries, "one CTE past the bound");
    assert_too_deep_saying(engine.sql(&sub(30)), "nests 30 subqueries", "the trial's chain of 30");
    // Read from inside subqueries: those count on top of the CTE's own.
    let read_inside = |n: usize, k: usize| {
        cte_chain(n, |p| format!("SELECT (SELECT x FROM c{p}) AS x"), &format!("SELECT {}x FROM c{n}{} AS y", "(SELECT ".repeat(k), ")".repeat(k)))
    };
    assert_eq!(scalar(&engine.sql(&read_inside(max - 2, 2)).unwrap()), 1);
    assert_too_deep_saying(engine.sql(&read_inside(max - 2, 3)), &subqueries, "a CTE read inside three subqueries");
    // A whole WITH inside a subquery counts from there; its names stay inside: outside,
    // `c<n>` is an (unknown) table, not the chain.
    let inner = |n: usize| format!("SELECT ({}) + 1 AS y", sub(n));
    assert_eq!(scalar(&engine.sql(&inner(max - 1)).unwrap()), 2);
    assert_too_deep_saying(engine.sql(&inner(max)), &subqueries, "a chain inside a subquery");
    match engine.sql(&format!("SELECT ({}) AS y FROM c{}", sub(3), 3)) {
        Err(Error::TableNotFound { name }) => assert!(name.contains("c3"), "{name}"),
        other => panic!("a CTE read outside its WITH: expected TableNotFound, got {:?}", other.map(|b| total_rows(&b))),
    }
    // A CTE `t` shadows the table `t`; the chain beside it (`max` deep), never read, is
    // planned once and adds nothing to the two subqueries reading `t`.
    let shadow = cte_chain(max, |p| format!("SELECT (SELECT x FROM c{p}) AS x"), "SELECT (SELECT (SELECT count(*) FROM t)) AS y");
    let shadow = shadow.replacen("WITH ", "WITH t AS (SELECT 7 AS x), ", 1);
    assert_eq!(scalar(&engine.sql(&shadow).unwrap()), 1, "t is the one-row CTE");
    // An inner WITH reusing an outer CTE's name: DataFusion refuses it ("specified more than
    // once"); counted with the inner (shallow) one, it reaches the planner.
    let reuse = cte_chain(max, |p| format!("SELECT (SELECT x FROM c{p}) AS x"), &format!("SELECT (WITH c{max} AS (SELECT 5 AS x) SELECT x FROM c{max}) AS y"));
    match engine.sql(&reuse) {
        Err(e @ Error::Sql { kind: SqlErrorKind::Plan, .. }) => assert!(e.to_string().contains("specified more than once"), "{e}"),
        other => panic!("an inner WITH reusing a name: expected Plan, got {:?}", other.map(|b| total_rows(&b))),
    }
    // Each CTE read twice by the one before: relations double per CTE.
    let relations = gritdb::sql::MAX_EXPANDED_RELATIONS;
    let twice = |n: usize| cte_chain(n, |p| format!("SELECT a.x FROM c{p} a, c{p} b"), &format!("SELECT x FROM c{n}"));
    let under = relations.ilog2() as usize - 1;
    assert_eq!(scalar(&engine.sql(&twice(under)).unwrap()), 1, "{} relations", 1 << (under + 1));
    assert_too_deep_saying(engine.sql(&twice(under + 1)), &format!("more than the {relations} gritdb plans"), "one doubling past");
    assert_too_deep_saying(engine.sql(&twice(30)), "plans 2147483648 relations", "30 doublings");
    assert_too_deep_saying(engine.sql(&twice(100)), "plans at least 18446744073709551615 relations", "saturated");
    // A recursive CTE reads its own work table; its references count, and the count ends.
    let recursive = "WITH RECURSIVE r AS (SELECT 1 AS x UNION ALL SELECT x + 1 FROM r WHERE x < 10) SELECT sum(a.x) FROM r a, r b";
    assert_eq!(scalar(&engine.sql(recursive).unwrap()), 10 * 55);
    // 200 CTEs each read once, without subqueries: legitimate, runs.
    let once = cte_chain(200, |p| format!("SELECT x + 1 AS x FROM c{p}"), "SELECT x FROM c200");
    assert_eq!(scalar(&engine.sql(&once.replacen("SELECT 1 AS x", "SELECT count(*) AS x FROM t", 1)).unwrap()), 10_000 + 200);
    // Each CTE's body nesting three queries: those count at each reference (DataFusion nests
    // them), as the same queries nested in FROM would (303 levels, 302 relations run; 3,003
    // levels and 3,002 relations are refused, on the relations first).
    let from = |n: usize| cte_chain(n, |p| format!("SELECT x FROM (SELECT x FROM (SELECT x FROM c{p}) a) b"), &format!("SELECT x FROM c{n}"));
    assert_eq!(scalar(&engine.sql(&from(100)).unwrap()), 1);
    assert_too_deep_saying(engine.sql(&from(1_000)), "plans 3002 relations", "1,000 CTEs of three nested queries");
}

/// Functions whose result size an argument sets (`repeat`, `lpad`, `rpad`, `replace`,
/// `regexp_replace`, `array_repeat`, `array_resize`, `range`) reserve a bound of their result
/// in the query's memory before they run: past the limit the statement is `MemoryLimit` in the
/// `query` category before the bytes are allocated (before: `lpad('a', 1000000000)` took
/// 3.9 GB at a 256 MiB limit, `rpad('a', 2147483647, 'xy')` aborted the process), on
/// constants (folded while planning) and on a column alike. Under the limit they answer, and
/// nothing stays reserved.
#[test]
fn functions_sized_by_an_argument_are_held_to_the_memory_limit() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 256 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(1..=3, 10, "s")).unwrap();
    for q in [
        "SELECT length(lpad('a', 1000000000))",
        "SELECT length(rpad('a', 2147483647, 'xy'))",
        "SELECT length(repeat('x', 3000000000))",
        "SELECT cardinality(array_repeat(1, 100000000))",
        "SELECT cardinality(array_resize(make_array(1, 2), 100000000))",
        "SELECT cardinality(range(1, 1000000000))",
        "SELECT cardinality(generate_series(-500000000, 500000000, 1))",
        "SELECT cardinality(range(TIMESTAMP '1970-01-01', TIMESTAMP '2100-01-01', INTERVAL '1 second'))",
        "SELECT length(replace(repeat('a', 20000), 'a', repeat('b', 20000)))",
        "SELECT length(regexp_replace(repeat('a', 20000), 'a', repeat('b', 20000), 'g'))",
        "SELECT sum(length(repeat(s, 100000000))) FROM t",
        "SELECT sum(length(lpad(s, id * 400000000))) FROM t",
        "SELECT sum(cardinality(array_repeat(id, v * 10000000))) FROM t",
        // Units mixed: second timestamps stepped by a millisecond (a trial's 806 MiB).
        "SELECT cardinality(range(to_timestamp_seconds(0), to_timestamp_seconds(100000), INTERVAL '1 millisecond'))",
        "SELECT cardinality(generate_series(to_timestamp_millis(0), to_timestamp_millis(100000000), INTERVAL '1 millisecond'))",
        // The fill of a resize (1,954 MiB), and one row's large element among small ones
        // (an average over the batch let 1,012 MiB through).
        "SELECT cardinality(array_resize(['a'], 1000, repeat('x', 1000000)))",
        "SELECT sum(cardinality(array_repeat(e, k))) FROM (SELECT CASE WHEN id = 1 THEN repeat('x', 1000000) ELSE '' END AS e, CASE WHEN id = 1 THEN 1000 ELSE 0 END AS k FROM t)",
        // The same value inside a struct (its fields were averaged over the batch: 1 GB).
        "SELECT sum(cardinality(array_repeat(named_struct('a', e), k))) FROM (SELECT CASE WHEN id = 1 THEN repeat('x', 1000000) ELSE '' END AS e, CASE WHEN id = 1 THEN 1000 ELSE 0 END AS k FROM t)",
        "SELECT sum(cardinality(array_resize([named_struct('a', '')], k, named_struct('a', e)))) FROM (SELECT CASE WHEN id = 1 THEN repeat('x', 1000000) ELSE '' END AS e, CASE WHEN id = 1 THEN 1000 ELSE 0 END AS k FROM t)",
        // A step that is 0 or negative in some months: DataFusion's range never ends (33 MB/s).
        "SELECT cardinality(range(to_timestamp_seconds(0), to_timestamp_seconds(1000000000), INTERVAL '1 month -30 days'))",
        "SELECT cardinality(range(to_timestamp_seconds(0), to_timestamp_seconds(100000000), INTERVAL '1 month -29 days'))",
    ] {
        match engine.sql(q) {
            Err(Error::MemoryLimit { category, requested, .. }) => {
                assert_eq!(category, Category::Query, "{q}");
                assert!(requested > 200 << 20, "{q}: requested {requested}");
            }
            other => panic!("{q}: expected MemoryLimit, got {:?}", other.map(|b| total_rows(&b))),
        }
        assert_eq!(engine.memory().category_bytes(Category::Query), 0, "{q}");
    }
    for (q, want) in [
        ("SELECT length(repeat('x', 1000000))", 1_000_000),
        ("SELECT length(lpad('a', 5000000, 'é'))", 5_000_000),
        ("SELECT cardinality(range(1, 1000000))", 999_999),
        ("SELECT cardinality(array_repeat(7, 100000))", 100_000),
        // 1 to 4 days a step, calendar months: 392 steps before 1973-03-03 09:46:40 (counted
        // in Python's datetime, each step a month on then 27 days back).
        ("SELECT cardinality(range(to_timestamp_seconds(0), to_timestamp_seconds(100000000), INTERVAL '1 month -27 days'))", 392),
        ("SELECT cardinality(array_repeat(named_struct('a', 'xyz', 'b', 1), 100000))", 100_000),
        ("SELECT cardinality(array_resize([repeat('x', 5000000)], 1000))", 1_000),
        ("SELECT cardinality(range(to_timestamp_seconds(0), to_timestamp_seconds(100000), INTERVAL '1 second'))", 100_000),
        ("SELECT cardinality(range(DATE '1970-01-01', DATE '2100-01-01', INTERVAL '1 day'))", 47_482),
        ("SELECT sum(length(repeat(s, 100000))) FROM t", 600_000),
        ("SELECT sum(length(replace(repeat(s, 1000), '1', 'xyz'))) FROM t", 6_000 + 2_000),
        // A group reference in the replacement of 1 MB strings: each `s` becomes `<s>`.
        ("SELECT sum(length(regexp_replace(repeat(s, 500000), '(s)', '<$1>', 'g'))) FROM t", 3 * 2_000_000),
    ] {
        assert_eq!(scalar(&engine.sql(q).unwrap()), want, "{q}");
        assert_eq!(engine.memory().category_bytes(Category::Query), 0, "{q}");
    }
}

/// Table functions answer in `FROM` (`generate_series`, `range`; before: `TableNotFound`, the
/// engine's schema was asked first), joined with a table too; a table of that name is the
/// table, and an unknown name is still `TableNotFound`.
#[test]
fn table_functions_answer_in_from() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open(dir.path(), 256 << 20);
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(1..=3, 10, "s")).unwrap();
    assert_eq!(scalar(&engine.sql("SELECT sum(value) FROM generate_series(1, 100)").unwrap()), 5050);
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM range(0, 1000000, 3)").unwrap()), 333_334);
    assert_eq!(scalar(&engine.sql("SELECT sum(t.v) FROM t JOIN generate_series(1, 2) g ON t.id = g.value").unwrap()), 30);
    let r = engine.create_table("range", schema(), &["id"]).unwrap();
    r.insert(&rows(1..=4, 1, "r")).unwrap();
    assert_eq!(scalar(&engine.sql("SELECT count(*) FROM range").unwrap()), 4);
    match engine.sql("SELECT * FROM no_such_table") {
        Err(Error::TableNotFound { name }) => assert_eq!(name, "no_such_table"),
        other => panic!("expected TableNotFound, got {:?}", other.map(|b| total_rows(&b))),
    }
}

/// Waits up to `within` for the engine's query memory to come back to 0, as it does once a
/// cancelled statement's work stops (at its next yield), and returns how long that took.
fn query_memory_comes_back(engine: &Engine, within: std::time::Duration, what: &str) -> std::time::Duration {
    let start = std::time::Instant::now();
    while engine.memory().category_bytes(Category::Query) != 0 && start.elapsed() < within {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(engine.memory().category_bytes(Category::Query), 0, "{what}: query memory not back to 0 within {within:?}");
    start.elapsed()
}

/// Runs the test `name` again in a child process pinned to one CPU (`taskset -c 0`), so that
/// the engine sees one core and runs one SQL thread, and asserts that it passed there.
/// Returns `true` in that child, where the caller does the test's work; `false` in the parent
/// (also when `taskset` is missing: skipped).
fn in_one_cpu_child(name: &str) -> bool {
    if std::env::var_os("GRITDB_ONE_CPU_CHILD").is_some() {
        assert_eq!(std::thread::available_parallelism().unwrap().get(), 1);
        return true;
    }
    let me = std::env::current_exe().unwrap();
    let out = match std::process::Command::new("taskset")
        .args(["-c", "0"])
        .arg(&me)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("GRITDB_ONE_CPU_CHILD", "1")
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("skipped: taskset: {e}");
            return false;
        }
    };
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "the one-CPU child failed:\n{text}");
    false
}

/// A statement running past `EngineConfig::sql_statement_timeout` is cancelled with
/// `SqlErrorKind::Timeout` (a recursive CTE without an end never returned before; a count
/// of a 1.25e14-row cross join), its memory given back; without one (the default) the table
/// answers and a finite recursion runs to its end.
///
/// The cross join was two-way (`t a, t b ORDER BY ...`, whose sort DataFusion drops: a
/// 2.5e9-row count that runs 0.74 s alone): on one core (`taskset -c 0`, one SQL thread) it
/// finished before its worker came back to the deadline and returned its answer, and this
/// test failed (2026-12-07). Three-way, it cannot finish first.
#[test]
fn a_statement_past_the_timeout_is_cancelled_and_gives_back_its_memory() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(256 << 20).sql_statement_timeout(std::time::Duration::from_millis(300));
    let engine = Engine::open(dir.path(), config).unwrap();
    let t = engine.create_table("t", schema(), &["id"]).unwrap();
    t.insert(&rows(1..=50_000, 1, "s")).unwrap();
    let endless = "WITH RECURSIVE r AS (SELECT 1 AS n UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r";
    let cross = "SELECT count(*) FROM t a, t b, t c";
    for q in [endless, cross] {
        match engine.sql(q) {
            Err(e @ Error::Sql { kind: SqlErrorKind::Timeout, .. }) => {
                assert!(e.to_string().contains("sql_statement_timeout"), "{e}");
            }
            other => panic!("{q}: expected Timeout, got {:?}", other.map(|b| total_rows(&b))),
        }
        // The cancelled plan's reservations go with it (its scans stop at their next batch).
        query_memory_comes_back(&engine, std::time::Duration::from_secs(10), q);
    }
    drop(t);
    engine.close().unwrap();
    // Without a timeout (the default; a loaded machine cannot fail this part).
    let engine = open(dir.path(), 256 << 20);
    assert_eq!(scalar(&engine.sql("SELECT sum(v) FROM t").unwrap()), 50_000 * 50_001 / 2);
    let finite = "WITH RECURSIVE r AS (SELECT 1 AS n UNION ALL SELECT n + 1 FROM r WHERE n < 2000) SELECT sum(n) FROM r";
    assert_eq!(scalar(&engine.sql(finite).unwrap()), 2000 * 2001 / 2);
}

/// With one SQL thread (one core: `taskset -c 0`, a one-CPU container) a statement past
/// `sql_statement_timeout` whose plan is a cross join is cancelled too. Before, the join
/// emitted a whole left side for each batch of the right without giving its thread back, so
/// the deadline's timer never ran: a two-way count answered after 1.39 s (limit 300 ms) and a
/// three-way one ran on for minutes (helper-41, 2026-12-07). Run in a child process pinned to
/// one CPU, so that the engine sees one core; skipped where `taskset` is missing.
#[test]
fn a_cross_join_past_the_timeout_is_cancelled_on_one_sql_thread() {
    if in_one_cpu_child("sql::a_cross_join_past_the_timeout_is_cancelled_on_one_sql_thread") {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig::default().memory_limit(256 << 20).sql_statement_timeout(std::time::Duration::from_millis(300));
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.create_table("t", schema(), &["id"]).unwrap();
        t.insert(&rows(1..=50_000, 1, "s")).unwrap();
        for q in
            ["SELECT count(*) FROM t a, t b, t c", "SELECT sum(a.id + b.id) FROM t a JOIN t b ON a.v % 2 = b.v % 2", "SELECT max(a.id + b.id) FROM t a, t b"]
        {
            match engine.sql(q) {
                Err(Error::Sql { kind: SqlErrorKind::Timeout, .. }) => {}
                other => panic!("{q}: expected Timeout, got {:?}", other.map(|b| total_rows(&b))),
            }
            query_memory_comes_back(&engine, std::time::Duration::from_secs(10), q);
        }
        // A join that ends answers as before.
        assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t a JOIN t b ON a.id = b.id").unwrap()), 50_000);
    }
}

/// With one SQL thread, a statement whose operator works long without yielding returns
/// `Timeout` to its caller at the deadline all the same: the engine's watchdog thread, not
/// the busy SQL worker, keeps it. A join whose condition discards every pair emits nothing,
/// so neither its `CooperativeExec` nor the tokio timer inside the task ever ran: over two
/// 50,000-row tables it answered `0` after 6.8 s with a 300 ms timeout (helper-42). Its work
/// stops at its next yield, which gives back its query memory then, not at the return.
#[test]
fn a_join_that_never_yields_returns_timeout_on_time_on_one_sql_thread() {
    if in_one_cpu_child("sql::a_join_that_never_yields_returns_timeout_on_time_on_one_sql_thread") {
        let dir = tempfile::tempdir().unwrap();
        let config = EngineConfig::default().memory_limit(256 << 20).sql_statement_timeout(std::time::Duration::from_millis(300));
        let engine = Engine::open(dir.path(), config).unwrap();
        let t = engine.create_table("t", schema(), &["id"]).unwrap();
        t.insert(&rows(1..=50_000, 1, "s")).unwrap();
        let q = "SELECT count(*) FROM t a JOIN t b ON a.id + b.id < 0";
        let start = std::time::Instant::now();
        match engine.sql(q) {
            Err(e @ Error::Sql { kind: SqlErrorKind::Timeout, .. }) => assert!(e.to_string().contains("sql_statement_timeout"), "{e}"),
            other => panic!("{q}: expected Timeout, got {:?} after {:?}", other.map(|b| total_rows(&b)), start.elapsed()),
        }
        let returned = start.elapsed();
        // Generous: the deadline is 300 ms; a loaded machine delays the wake-up, not the work.
        assert!(returned < std::time::Duration::from_secs(3), "{q}: Timeout after {returned:?}");
        // The statements after it do not wait behind it: they run on a new runtime while the
        // join holds the old one's only worker (before: 13 trivial statements timed out, the
        // first answer 3.98 s later, helper-44).
        for i in 0..3 {
            let start = std::time::Instant::now();
            let answer = engine.sql("SELECT count(*) FROM t WHERE id > 10");
            assert_eq!(
                answer.as_ref().map(|b| scalar(b)).ok(),
                Some(49_990),
                "statement {i} after the timeout: {:?} after {:?}",
                answer.err(),
                start.elapsed()
            );
        }
        let sql_threads = || gritdb_tests::process_threads().iter().filter(|t| t.name == "gritdb-sql").count();
        let freed = query_memory_comes_back(&engine, std::time::Duration::from_mins(1), q);
        eprintln!("{q}: Timeout after {returned:?}, query memory back to 0 {freed:?} later");
        // Once the join has ended, the next statement shuts its old runtime down: one SQL
        // thread again.
        assert_eq!(scalar(&engine.sql("SELECT count(*) FROM t").unwrap()), 50_000);
        let waited = std::time::Instant::now();
        while sql_threads() != 1 && waited.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(sql_threads(), 1, "gritdb-sql threads after the old runtime's last task ended");
    }
}
