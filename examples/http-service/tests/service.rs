//! The service answers with real bodies: the memory report has every category, tables are
//! created, written and listed, bad input gets typed JSON errors, SQL counts what was
//! inserted, and shutdown closes the engine.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use gritdb::{Engine, EngineConfig};
use serde_json::{Value, json};
use std::sync::Arc;
use tower::ServiceExt as _;

const CATEGORIES: [&str; 8] = ["row_blocks", "batch_blocks", "key_index", "write_buffers", "scan_buffers", "metadata", "query", "free_chunks"];

async fn call(app: &Router, method: &str, uri: &str, body: Option<String>, content_type: &str) -> (StatusCode, Value) {
    let req = Request::builder().method(method).uri(uri).header("content-type", content_type);
    let req = req.body(body.map_or_else(Body::empty, Body::from)).unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 16 << 20).await.unwrap();
    let value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    (status, value)
}

async fn get(app: &Router, uri: &str) -> (StatusCode, Value) {
    call(app, "GET", uri, None, "application/json").await
}

async fn post_json(app: &Router, uri: &str, body: &Value) -> (StatusCode, Value) {
    call(app, "POST", uri, Some(body.to_string()), "application/json").await
}

fn engine(dir: &std::path::Path) -> Arc<Engine> {
    Arc::new(Engine::open(dir, EngineConfig::default().memory_limit(64 << 20)).unwrap())
}

fn events_table() -> Value {
    json!({
        "name": "events",
        "columns": [
            {"name": "id", "type": "Int64", "nullable": false},
            {"name": "name", "type": "Utf8"},
            {"name": "amount", "type": "Float64"}
        ],
        "primary_key": ["id"]
    })
}

fn rows(ids: std::ops::Range<i64>) -> Value {
    Value::Array(ids.map(|i| json!({"id": i, "name": format!("event {i}"), "amount": i as f64 / 2.0})).collect())
}

/// Creates `events` and inserts ids 0..250 in three requests.
async fn with_rows(app: &Router) {
    let (status, body) = post_json(app, "/tables", &events_table()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["name"], "events");
    assert_eq!(body["primary_key"], json!(["id"]));
    for (range, op) in [(0..100, "insert"), (100..200, "insert"), (200..250, "upsert")] {
        let n = range.end - range.start;
        let (status, body) = post_json(app, &format!("/tables/events/rows?op={op}"), &rows(range)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["rows"], n);
    }
}

#[tokio::test]
async fn memory_endpoint_reports_every_category_and_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let app = gritdb_http_service::router(Arc::clone(&engine));
    with_rows(&app).await;
    let (status, body) = get(&app, "/memory").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["limit"], 64 << 20);
    let cats: Vec<&str> = body["categories"].as_array().unwrap().iter().map(|c| c["category"].as_str().unwrap()).collect();
    for c in CATEGORIES {
        assert!(cats.contains(&c), "category {c} missing from {cats:?}");
    }
    let row_blocks = body["categories"].as_array().unwrap().iter().find(|c| c["category"] == "row_blocks").unwrap();
    assert!(row_blocks["bytes"].as_u64().unwrap() > 0, "250 rows in the delta: {row_blocks}");
    let used = body["used"].as_u64().unwrap();
    assert!(used > 0 && used <= 64 << 20, "used {used}");
    assert!(body["peak"].as_u64().unwrap() >= used);
    let tables = body["tables"].as_array().unwrap();
    assert!(tables.iter().any(|t| t["table"] == "events" && t["bytes"].as_u64().unwrap() > 0), "{tables:?}");
    assert!(body["process"].is_object());
}

#[tokio::test]
async fn tables_are_created_written_listed_and_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let app = gritdb_http_service::router(Arc::clone(&engine));
    with_rows(&app).await;
    // Replace 10 rows, update 5.
    let (status, body) = post_json(&app, "/tables/events/rows?op=upsert", &rows(0..10)).await;
    assert_eq!((status, body["rows"].clone()), (StatusCode::OK, json!(10)));
    let (status, body) = post_json(&app, "/tables/events/rows?op=update", &rows(20..25)).await;
    assert_eq!((status, body["rows"].clone()), (StatusCode::OK, json!(5)));

    let (status, body) = get(&app, "/tables").await;
    assert_eq!(status, StatusCode::OK);
    let list = body.as_array().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["name"], "events");
    assert_eq!(list[0]["columns"][0], json!({"name": "id", "type": "Int64", "nullable": false}));
    assert_eq!(list[0]["columns"][1]["type"], "Utf8");
    assert!(list[0]["stats"]["active_delta_bytes"].as_u64().unwrap() > 0);

    let (status, body) = get(&app, "/tables/events").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["rows"], 250);
    assert_eq!(engine.table("events").unwrap().row_count().unwrap(), 250);

    let (status, _) = call(&app, "DELETE", "/tables/events", None, "application/json").await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(get(&app, "/tables").await.1, json!([]));
}

#[tokio::test]
async fn bad_requests_get_typed_json_errors() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let app = gritdb_http_service::router(Arc::clone(&engine));
    with_rows(&app).await;

    let (status, body) = post_json(&app, "/tables/nope/rows", &rows(0..1)).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::NOT_FOUND, Some("table_not_found")), "{body}");
    let (status, body) = get(&app, "/tables/nope").await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::NOT_FOUND, Some("table_not_found")));
    // insert of an existing key: the whole batch is refused.
    let (status, body) = post_json(&app, "/tables/events/rows", &rows(249..251)).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::CONFLICT, Some("key_exists")), "{body}");
    assert_eq!(engine.table("events").unwrap().row_count().unwrap(), 250);
    // update of a missing key.
    let (status, body) = post_json(&app, "/tables/events/rows?op=update", &rows(300..301)).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::NOT_FOUND, Some("key_not_found")));
    // null primary key, wrong type, unknown column.
    for bad in [json!([{"id": null}]), json!([{"id": "x"}]), json!([{"id": 1000, "colour": "red"}])] {
        let (status, body) = post_json(&app, "/tables/events/rows", &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad} -> {body}");
        assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()), "{body}");
    }
    // duplicate key inside one request.
    let (status, body) = post_json(&app, "/tables/events/rows", &json!([{"id": 500}, {"id": 500}])).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::BAD_REQUEST, Some("duplicate_key")));
    // create: existing name, unknown type, key column missing, unparsable body.
    let (status, body) = post_json(&app, "/tables", &events_table()).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::CONFLICT, Some("table_exists")));
    let mut t = events_table();
    t["name"] = json!("other");
    t["columns"][1]["type"] = json!("NoSuchType");
    let (status, body) = post_json(&app, "/tables", &t).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::BAD_REQUEST, Some("bad_request")), "{body}");
    let mut t = events_table();
    t["name"] = json!("other");
    t["primary_key"] = json!(["missing"]);
    let (status, body) = post_json(&app, "/tables", &t).await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_primary_key")), "{body}");
    let (status, _) = call(&app, "POST", "/tables", Some("{not json".into()), "application/json").await;
    assert!(status.is_client_error(), "{status}");
    let (status, _) = call(&app, "POST", "/tables/events/rows?op=merge", Some("[]".into()), "application/json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(engine.table_names(), ["events"]);
}

#[cfg(feature = "sql")]
#[tokio::test]
async fn sql_counts_what_was_inserted() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let app = gritdb_http_service::router(Arc::clone(&engine));
    with_rows(&app).await;
    engine.table("events").unwrap().flush().unwrap();
    // More rows after the flush: SQL sees files and delta together.
    let (status, _) = post_json(&app, "/tables/events/rows", &rows(250..300)).await;
    assert_eq!(status, StatusCode::OK);
    let q = "select count(*) as n, sum(id) as s from events";
    let (status, body) = call(&app, "POST", "/sql", Some(q.into()), "text/plain").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["row_count"], 1);
    assert_eq!(body["rows"][0]["n"], 300, "{body}");
    assert_eq!(body["rows"][0]["s"], (0..300).sum::<i64>(), "{body}");
    assert_eq!(body["columns"][0]["name"], "n");
    let (status, body) = call(&app, "POST", "/sql", Some("select * from no_such_table".into()), "text/plain").await;
    assert!(status.is_client_error(), "{status} {body}");
    assert!(body["error"].as_str().is_some_and(|e| e.contains("no_such_table")), "{body}");
}

/// A statement past the engine's `sql_statement_timeout` is 503 `statement_timeout`, and the
/// service answers the next request.
#[cfg(feature = "sql")]
#[tokio::test]
async fn a_sql_statement_past_the_timeout_is_503_statement_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig::default().memory_limit(64 << 20).sql_statement_timeout(std::time::Duration::from_secs(1));
    let engine = Arc::new(Engine::open(dir.path(), config).unwrap());
    let app = gritdb_http_service::router(Arc::clone(&engine));
    let endless = "WITH RECURSIVE r AS (SELECT 1 AS n UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r";
    let (status, body) = call(&app, "POST", "/sql", Some(endless.into()), "text/plain").await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("statement_timeout")), "{body}");
    assert!(body["error"].as_str().is_some_and(|e| e.contains("sql_statement_timeout")), "{body}");
    with_rows(&app).await;
    let (status, body) = call(&app, "POST", "/sql", Some("select count(*) as n from events".into()), "text/plain").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["rows"][0]["n"], 250, "{body}");
}

#[cfg(not(feature = "sql"))]
#[tokio::test]
async fn sql_without_the_feature_says_how_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let app = gritdb_http_service::router(engine(dir.path()));
    let (status, body) = call(&app, "POST", "/sql", Some("select 1".into()), "text/plain").await;
    assert_eq!((status, body["kind"].as_str()), (StatusCode::NOT_IMPLEMENTED, Some("sql_not_built")));
    assert!(body["error"].as_str().unwrap().contains("--features sql"));
}

/// A real server on a loopback port: a request is answered, then the shutdown signal stops
/// the server and `serve` closes the engine — the directory lock is released and every row is
/// in committed files (nothing left to replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_closes_the_engine() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let dir = tempfile::tempdir().unwrap();
    {
        let e = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
        let app = gritdb_http_service::router(Arc::new(e));
        with_rows(&app).await;
        // `app` (and the engine) dropped here without close: the rows are in the WAL only.
    }
    let e = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    assert!(e.table("events").unwrap().stats().unwrap().active_delta_bytes > 0, "replayed into the delta");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = gritdb_http_service::serve(listener, e, async {
        let _ = stopped.await;
    });
    let client = async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /tables/events HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).await.unwrap();
        stop.send(()).unwrap();
        text
    };
    let (outcome, text) = tokio::join!(server, client);
    outcome.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"rows\":250"), "{text}");
    // Closed: the lock is free and the rows are in files.
    let e = Engine::open(dir.path(), EngineConfig::default().memory_limit(64 << 20)).unwrap();
    let s = e.table("events").unwrap().stats().unwrap();
    assert!(s.files >= 1 && s.active_delta_bytes == 0 && s.file_rows == 250, "{s:?}");
    e.close().unwrap();
}

/// A value no scan could read back under the memory limit is 413 `value_too_large`, and the
/// request applies nothing: a 300 KB name at a 1 MiB limit (a row of one value beside an
/// integer key holds at most about 196 KB: `gritdb::row_memory_bytes`).
#[tokio::test]
async fn a_value_too_large_for_the_limit_is_413_and_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(Engine::open(dir.path(), EngineConfig::default().memory_limit(1 << 20)).unwrap());
    let app = gritdb_http_service::router(Arc::clone(&engine));
    let (status, body) = post_json(&app, "/tables", &events_table()).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let big = json!([{"id": 1, "name": "n", "amount": 1.0}, {"id": 2, "name": "x".repeat(300_000), "amount": 2.0}]);
    let (status, body) = post_json(&app, "/tables/events/rows?op=insert", &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body}");
    assert_eq!(body["kind"], "value_too_large");
    assert!(body["error"].as_str().unwrap().contains("column `name`"), "{body}");
    assert_eq!(engine.table("events").unwrap().row_count().unwrap(), 0);
    let (status, body) = post_json(&app, "/tables/events/rows?op=insert", &rows(0..3)).await;
    assert_eq!((status, body["rows"].clone()), (StatusCode::OK, json!(3)));
}
