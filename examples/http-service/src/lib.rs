//! # gritdb embedded in a small HTTP service
//!
//! A tokio + axum service that owns one [`gritdb::Engine`] and serves:
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `GET /memory` | | `Engine::memory_report()` as JSON: limit, used, peak, every category, tables, process view |
//! | `GET /tables` | | every table: name, primary key, columns, `Table::stats()` |
//! | `GET /tables/{name}` | | the same for one table, plus its live row count (a scan) |
//! | `POST /tables` | `{"name", "columns": [{"name", "type", "nullable"}], "primary_key": [..]}` | creates a table; `type` is Arrow's spelling (`Int64`, `Utf8`, `Decimal128(15, 2)`, ...) |
//! | `DELETE /tables/{name}` | | drops the table |
//! | `POST /tables/{name}/rows?op=insert\|upsert\|update` | JSON array of row objects | rows written (default `insert`) |
//! | `POST /sql` | the query text | `{"columns", "rows", "row_count"}`; needs feature `sql` (else 501) |
//!
//! Errors are JSON `{"error": message, "kind": snake_case_kind}` with a fitting status (400 bad
//! input, 404 no such table, 409 key or table exists, 503 memory limit or closed engine).
//!
//! Every engine call blocks (locks, fsync, scans), so each one runs on tokio's blocking pool
//! through [`blocking`] and the handler awaits it; the async workers never block. [`serve`]
//! stops on its shutdown signal, lets running requests finish, then calls `Engine::close`
//! (flush every table, sync the write-ahead log).

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use gritdb::arrow_array::RecordBatch;
use gritdb::arrow_schema::{DataType, Field, Schema};
use gritdb::{Engine, Table};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// Shared state of the handlers: the engine.
#[derive(Clone, Debug)]
pub struct AppState {
    engine: Arc<Engine>,
}

/// An error answer: HTTP status, a stable `kind` and the message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, message: message.into() }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

impl ApiError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// A stable, `snake_case` name of the error (`table_not_found`, `memory_limit`, ...).
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The message shown to the client.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.kind, self.status, self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<gritdb::Error> for ApiError {
    fn from(e: gritdb::Error) -> Self {
        use gritdb::Error as E;
        let (status, kind) = match &e {
            E::TableNotFound { .. } => (StatusCode::NOT_FOUND, "table_not_found"),
            E::ColumnNotFound { .. } => (StatusCode::BAD_REQUEST, "column_not_found"),
            E::TableExists { .. } => (StatusCode::CONFLICT, "table_exists"),
            E::KeyExists { .. } => (StatusCode::CONFLICT, "key_exists"),
            E::KeyNotFound { .. } => (StatusCode::NOT_FOUND, "key_not_found"),
            E::DuplicateKey { .. } => (StatusCode::BAD_REQUEST, "duplicate_key"),
            E::InvalidTableName { .. } => (StatusCode::BAD_REQUEST, "invalid_table_name"),
            E::InvalidPrimaryKey(_) => (StatusCode::BAD_REQUEST, "invalid_primary_key"),
            E::Input(_) => (StatusCode::BAD_REQUEST, "invalid_input"),
            // Too large for the memory limit to read back: a larger limit admits it.
            E::ValueTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "value_too_large"),
            E::MemoryLimit { .. } => (StatusCode::SERVICE_UNAVAILABLE, "memory_limit"),
            E::Closed(_) => (StatusCode::SERVICE_UNAVAILABLE, "closed"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        Self::new(status, kind, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message, "kind": self.kind }))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs a blocking engine call on tokio's blocking pool and waits for it.
///
/// `clippy.toml` bans bare `spawn_blocking` because inside the library a detached task could
/// outlive the engine's runtime. Here the runtime is the service's own and the handle is
/// awaited at once, so the task never outlives its request; [`serve`] also waits for
/// straggling tasks (which hold the engine) before closing the engine.
///
/// # Errors
/// The call's own error, or an internal error when it panicked.
#[allow(clippy::disallowed_methods)] // awaited at once on the service's own runtime (see above)
pub async fn blocking<T, F>(f: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> ApiResult<T> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("engine call failed: {e}"))),
    }
}

/// The service's routes over `engine`.
pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/memory", get(memory))
        .route("/tables", get(list_tables).post(create_table))
        .route("/tables/{name}", get(table_info).delete(drop_table))
        .route("/tables/{name}/rows", post(write_rows))
        .route("/sql", post(sql))
        .with_state(AppState { engine })
}

async fn memory(State(s): State<AppState>) -> ApiResult<Json<gritdb::memory::MemoryReport>> {
    blocking(move || Ok(Json(s.engine.memory_report()))).await
}

/// One table as `GET /tables` shows it.
#[derive(Debug, Serialize)]
struct TableInfo {
    name: String,
    primary_key: Vec<String>,
    columns: Vec<ColumnSpec>,
    stats: gritdb::TableStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    rows: Option<u64>,
}

fn table_info_of(t: &Table, with_rows: bool) -> gritdb::Result<TableInfo> {
    let schema = t.schema();
    Ok(TableInfo {
        name: t.name().to_owned(),
        primary_key: t.primary_key(),
        columns: schema
            .fields()
            .iter()
            .map(|f| ColumnSpec { name: f.name().clone(), data_type: f.data_type().to_string(), nullable: f.is_nullable() })
            .collect(),
        stats: t.stats()?,
        rows: if with_rows { Some(t.row_count()?) } else { None },
    })
}

async fn list_tables(State(s): State<AppState>) -> ApiResult<Json<Vec<TableInfo>>> {
    blocking(move || {
        let mut out = Vec::new();
        for name in s.engine.table_names() {
            // A table dropped meanwhile is simply not listed.
            match s.engine.table(&name).and_then(|t| table_info_of(&t, false)) {
                Ok(info) => out.push(info),
                Err(gritdb::Error::TableNotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Json(out))
    })
    .await
}

async fn table_info(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<Json<TableInfo>> {
    blocking(move || Ok(Json(table_info_of(&s.engine.table(&name)?, true)?))).await
}

/// A column of `POST /tables`.
#[derive(Debug, Serialize, Deserialize)]
struct ColumnSpec {
    name: String,
    /// Arrow's spelling of the type (`Int64`, `Utf8`, `Decimal128(15, 2)`, `Date32`, ...).
    #[serde(rename = "type")]
    data_type: String,
    #[serde(default = "yes")]
    nullable: bool,
}

fn yes() -> bool {
    true
}

/// The body of `POST /tables`.
#[derive(Debug, Deserialize)]
struct CreateTable {
    name: String,
    columns: Vec<ColumnSpec>,
    primary_key: Vec<String>,
}

async fn create_table(State(s): State<AppState>, Json(req): Json<CreateTable>) -> ApiResult<(StatusCode, Json<TableInfo>)> {
    let mut fields = Vec::with_capacity(req.columns.len());
    for c in &req.columns {
        let t = DataType::from_str(&c.data_type).map_err(|e| ApiError::bad_request(format!("column `{}`: unknown type {:?}: {e}", c.name, c.data_type)))?;
        fields.push(Field::new(&c.name, t, c.nullable));
    }
    let schema = Arc::new(Schema::new(fields));
    blocking(move || {
        let pk: Vec<&str> = req.primary_key.iter().map(String::as_str).collect();
        let t = s.engine.create_table(&req.name, schema, &pk)?;
        Ok((StatusCode::CREATED, Json(table_info_of(&t, false)?)))
    })
    .await
}

async fn drop_table(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<StatusCode> {
    blocking(move || {
        s.engine.drop_table(&name)?;
        Ok(StatusCode::NO_CONTENT)
    })
    .await
}

/// `?op=` of `POST /tables/{name}/rows`.
#[derive(Debug, Deserialize)]
struct WriteQuery {
    #[serde(default)]
    op: WriteOp,
}

#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WriteOp {
    #[default]
    Insert,
    Upsert,
    Update,
}

/// JSON row objects -> one `RecordBatch` of the table's schema (arrow-json's decoder: missing
/// fields are null, unknown fields are an error).
fn rows_to_batch(schema: gritdb::arrow_schema::SchemaRef, rows: &[Value]) -> ApiResult<Option<RecordBatch>> {
    let bad = |e: gritdb::arrow_schema::ArrowError| ApiError::bad_request(format!("rows do not fit the table: {e}"));
    let mut decoder = arrow_json::ReaderBuilder::new(schema).with_strict_mode(true).build_decoder().map_err(bad)?;
    decoder.serialize(rows).map_err(bad)?;
    decoder.flush().map_err(bad)
}

async fn write_rows(State(s): State<AppState>, Path(name): Path<String>, Query(q): Query<WriteQuery>, Json(rows): Json<Vec<Value>>) -> ApiResult<Json<Value>> {
    blocking(move || {
        let t = s.engine.table(&name)?;
        let Some(batch) = rows_to_batch(t.schema(), &rows)? else { return Ok(Json(json!({ "rows": 0 }))) };
        let n = match q.op {
            WriteOp::Insert => t.insert(&batch)?,
            WriteOp::Upsert => t.upsert(&batch)?,
            WriteOp::Update => t.update(&batch)?,
        };
        Ok(Json(json!({ "rows": n })))
    })
    .await
}

/// Batches as `{"columns": [{"name", "type"}], "rows": [{..}], "row_count": n}`; rows are
/// written by arrow-json (nulls explicit, decimals as numbers).
///
/// # Errors
/// Arrow errors while encoding.
pub fn batches_to_json(batches: &[RecordBatch]) -> Result<Value, gritdb::arrow_schema::ArrowError> {
    let columns: Vec<Value> = batches
        .first()
        .map(|b| b.schema().fields().iter().map(|f| json!({ "name": f.name(), "type": f.data_type().to_string() })).collect())
        .unwrap_or_default();
    let mut writer = arrow_json::WriterBuilder::new().with_explicit_nulls(true).build::<_, arrow_json::writer::JsonArray>(Vec::new());
    let refs: Vec<&RecordBatch> = batches.iter().collect();
    writer.write_batches(&refs)?;
    writer.finish()?;
    let bytes = writer.into_inner();
    let rows: Value = if bytes.is_empty() {
        Value::Array(vec![])
    } else {
        serde_json::from_slice(&bytes).map_err(|e| gritdb::arrow_schema::ArrowError::JsonError(e.to_string()))?
    };
    let row_count = batches.iter().map(RecordBatch::num_rows).sum::<usize>();
    Ok(json!({ "columns": columns, "rows": rows, "row_count": row_count }))
}

#[cfg(feature = "sql")]
async fn sql(State(s): State<AppState>, query: String) -> ApiResult<Json<Value>> {
    blocking(move || {
        let batches = s.engine.sql(&query).map_err(|e| {
            if let gritdb::Error::Sql { kind: gritdb::sql::SqlErrorKind::Timeout, .. } = &e {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "statement_timeout", e.to_string());
            }
            let mut api = ApiError::from(e);
            if api.kind == "internal" {
                // Planning and execution errors of a query are the query's fault far more
                // often than the server's.
                api.status = StatusCode::BAD_REQUEST;
                api.kind = "query_failed";
            }
            api
        })?;
        Ok(Json(batches_to_json(&batches).map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?))
    })
    .await
}

#[cfg(not(feature = "sql"))]
#[allow(clippy::unused_async)] // an axum handler is an async fn
async fn sql(State(_): State<AppState>, _query: String) -> ApiResult<Json<Value>> {
    Err(ApiError::new(StatusCode::NOT_IMPLEMENTED, "sql_not_built", "this service was built without the `sql` feature: rebuild with `--features sql`"))
}

/// Serves `engine` on `listener` until `shutdown` completes, lets running requests finish,
/// then closes the engine (`Engine::close`: every table flushed, the write-ahead log synced).
///
/// # Errors
/// The server's I/O error, or the engine's close error.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Engine,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let engine = Arc::new(engine);
    let served = axum::serve(listener, router(Arc::clone(&engine))).with_graceful_shutdown(shutdown).await;
    tracing::info!("server stopped; closing the engine");
    // A request whose client went away leaves its blocking call running, holding the engine:
    // wait for such stragglers (bounded) so `close` gets the engine to itself.
    let mut engine = engine;
    let closed = {
        let mut waited = Duration::ZERO;
        loop {
            match Arc::try_unwrap(engine) {
                Ok(e) => break blocking(move || e.close().map_err(ApiError::from)).await,
                Err(still) if waited < Duration::from_secs(30) => {
                    engine = still;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    waited += Duration::from_millis(20);
                }
                Err(still) => {
                    // Still shared: flush what we can; the write-ahead log covers the rest.
                    let e = Arc::clone(&still);
                    break blocking(move || e.flush_all().map_err(ApiError::from)).await;
                }
            }
        }
    };
    served?;
    closed.map_err(|e| format!("closing the engine: {e}").into())
}
