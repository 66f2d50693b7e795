//! SQL over gritdb tables through `DataFusion` (the `sql` cargo feature).
//!
//! ```text
//! Engine::sql("SELECT ...")            (blocking) ─┐ a task on the engine's own "gritdb-sql"
//! Engine::sql_async("SELECT ...")      (awaited)  ─┘ runtime (64 MiB stacks; depth bounded)
//! Engine::session_context()            (a DataFusion SessionContext for DataFrames)
//!     │
//!     ▼  catalog `gritdb`, schema `public`: every engine table, resolved at planning time,
//!        plus the system tables `gritdb_memory`, `gritdb_tables`
//! TableProvider (one per table) ── projection, limit pushed into Table::scan
//!     │  GritScan: EngineConfig::sql_scan_partitions partitions (default 1) over one
//!     │  snapshot (Table::scan_partitions; one with a LIMIT); each partition's blocking scan iterator runs on a blocking
//!     │  thread (RecordBatchReceiverStream::spawn_blocking), 2 batches buffered
//!     ▼
//! DataFusion operators ── reservations ──> memory pool over memctl, category `query`
//!                                          (refusal = ResourcesExhausted: spill or
//!                                          Error::MemoryLimit)
//! ```
//!
//! Statements are read-only: queries, `EXPLAIN`, `DESCRIBE`, `SHOW TABLES`/`SHOW COLUMNS`.
//! Writes go through [`crate::Table`]. See `docs/sql.md`.

mod bounded;
mod catalog;
mod coerce;
mod deadline;
mod depth;
mod filter;
mod grouping;
mod pool;
mod provider;
mod system;
mod yields;

pub use datafusion;
pub use depth::{JOIN_LEVELS, MAX_DEPTH, MAX_EXPANDED_RELATIONS, MAX_SUBQUERY_DEPTH, MAX_TOKEN_DEPTH, PARSER_RECURSION_LIMIT, STACK_BYTES};
pub use grouping::{MAX_CUBE_EXPRESSIONS, MAX_GROUPING_SETS};

use crate::engine::{Engine, EngineInner};
use crate::error::{Error, Result};
use arrow_array::RecordBatch;
use datafusion::catalog::{CatalogProvider, MemoryCatalogProvider};
use datafusion::error::DataFusionError;
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::Statement as SqlStatement;
use datafusion::sql::sqlparser::parser::ParserError;
use gritdb_storage::StorageError;
use pool::{GritMemoryPool, LastRefusal};
use std::sync::{Arc, Mutex, PoisonError};

/// Names of the system tables, queryable like tables: `gritdb_memory` (one row per memory
/// category engine-wide and per table and category: `scope`, `name`, `category`, `bytes`,
/// `peak_bytes`, `allocs`, `frees`, `failures`; the columns of
/// [`Engine::memory_report_batch`]) and `gritdb_tables` (one row per table: `name`,
/// `primary_key`, `rows`, `files`, `file_rows`, `delta_bytes`, `sealed_deltas`, `index_bytes`,
/// `accounted_bytes`, `manifest_version`, `last_flush_error`, `damage`). They take precedence over
/// engine tables of the same name.
pub const SYSTEM_TABLES: [&str; 2] = system::NAMES;

/// The catalog and schema gritdb tables live in (`gritdb.public.<table>`; both are the
/// session's defaults, so plain names resolve).
pub const CATALOG: &str = "gritdb";
/// See [`CATALOG`].
pub const SCHEMA: &str = "public";

/// Which stage of a SQL query failed ([`Error::Sql`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SqlErrorKind {
    /// The text is not valid SQL (parser error), or holds no statement or more than one.
    Syntax,
    /// A column the query names does not exist (or is ambiguous).
    UnknownColumn,
    /// The query is valid SQL but cannot be planned (type mismatch, unknown function, ...).
    Plan,
    /// Not supported: writing statements (`INSERT`, `UPDATE`, `DELETE`, `CREATE`, `DROP`,
    /// `COPY`, `SET`, ...) — write through [`crate::Table`] — or a SQL feature `DataFusion` lacks.
    NotSupported,
    /// The query failed while running (e.g. a cast of a bad value, division by zero).
    Execution,
    /// An internal `DataFusion` error (a bug; please report it with the query), or a panic
    /// while the query ran.
    Internal,
    /// The statement nests deeper than [`MAX_DEPTH`] levels (each operator of a chain
    /// `a OR b OR ...`, function call, `CASE`, subquery, set operation, joined table; see
    /// `docs/sql.md`): refused before planning, which recurses once per level. Rewrite it
    /// shallower: `x = 1 OR x = 2 OR ...` as `x IN (1, 2, ...)`, many `UNION ALL` branches of
    /// constants as one `VALUES` list. Also: parentheses, calls, `CASE` and subqueries nested
    /// past the parser's [`PARSER_RECURSION_LIMIT`], subqueries inside expressions nested
    /// past [`MAX_SUBQUERY_DEPTH`], and, each CTE reference counted as its CTE's whole plan
    /// (`DataFusion` copies it there), more than [`MAX_DEPTH`] levels, more than
    /// [`MAX_SUBQUERY_DEPTH`] subqueries or more than [`MAX_EXPANDED_RELATIONS`] relations.
    TooDeep,
    /// The statement ran past [`crate::EngineConfig::sql_statement_timeout`] and was cancelled
    /// (returned at the deadline; its work stops at its next yield, and its scans and memory
    /// are given back then).
    Timeout,
}

impl std::fmt::Display for SqlErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SqlErrorKind::Syntax => "syntax error",
            SqlErrorKind::UnknownColumn => "unknown column",
            SqlErrorKind::Plan => "planning error",
            SqlErrorKind::NotSupported => "not supported",
            SqlErrorKind::Execution => "execution error",
            SqlErrorKind::Internal => "internal error",
            SqlErrorKind::TooDeep => "statement too deeply nested",
            SqlErrorKind::Timeout => "statement timeout",
        })
    }
}

/// The engine's SQL state, built at the first query.
#[derive(Default)]
pub(crate) struct SqlSlot(Mutex<Option<Arc<SqlState>>>);

impl SqlSlot {
    fn get_or_init(&self, engine: &Arc<EngineInner>) -> Result<Arc<SqlState>> {
        let mut g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = g.as_ref() {
            return Ok(Arc::clone(s));
        }
        let s = Arc::new(SqlState::new(engine)?);
        *g = Some(Arc::clone(&s));
        Ok(s)
    }

    /// Stops the SQL runtime without blocking (safe inside another runtime).
    pub(crate) fn shutdown(&self) {
        let state = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(s) = state {
            // Dropping a `Pool` shuts its runtime down in the background.
            drop(s.runtime.lock().unwrap_or_else(PoisonError::into_inner).take());
            s.retired.lock().unwrap_or_else(PoisonError::into_inner).clear();
        }
    }
}

/// One SQL runtime and what tells whether it may still take statements and when it has no
/// more tasks. Dropped, it shuts its runtime down without blocking (`shutdown_background`:
/// a worker busy in a statement that does not yield ends when it next does).
struct Pool {
    rt: Option<tokio::runtime::Runtime>,
    /// One clone in each task spawned on `rt` (dropped with the task's future): the tasks
    /// still alive are the strong count less this one.
    tasks: Arc<()>,
    /// The tasks of `rt` that passed their deadline still running, with when: each was
    /// aborted and ends at its next yield, but one that does not yield for long holds a
    /// worker, and statements after it would wait behind it (helper-44: on one SQL thread,
    /// 13 trivial statements after a timed-out join timed out too, the first answer 3.98 s
    /// later).
    overdue: Overdue,
}

/// Tasks past their deadline, still running when their caller returned `Timeout`.
type Overdue = Arc<Mutex<Vec<(std::time::Instant, tokio::task::AbortHandle)>>>;

/// How long a task past its deadline may take to reach its next yield before its runtime is
/// taken as held by it ([`SqlState::runtime`]): tasks that yield end within microseconds of
/// their abort.
const OVERDUE_GRACE: std::time::Duration = std::time::Duration::from_millis(10);

impl Pool {
    /// Whether a task past its deadline still runs [`OVERDUE_GRACE`] after its caller
    /// returned, waiting (1 ms at a time) until one has or all have ended: a task that yields
    /// ends within it. Tasks that have ended leave the list.
    fn held(&self) -> bool {
        let mut overdue = self.overdue.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            overdue.retain(|(_, task)| !task.is_finished());
            if overdue.is_empty() {
                return false;
            }
            if overdue.iter().any(|(at, _)| at.elapsed() >= OVERDUE_GRACE) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

pub(crate) struct SqlState {
    engine: std::sync::Weak<EngineInner>,
    env: Arc<RuntimeEnv>,
    /// The session of [`Engine::sql`] (users' `session_context()`s are separate).
    ctx: SessionContext,
    last_refusal: Arc<LastRefusal>,
    /// The runtime blocking [`Engine::sql`] calls run on, built at the first one, and again
    /// after a statement passed its deadline while still holding a worker.
    runtime: Mutex<Option<Pool>>,
    /// Runtimes replaced while their tasks (a statement past its deadline that has not yet
    /// reached a yield, and any others still running there) go on; each is shut down once
    /// it has none left, or with the engine.
    retired: Mutex<Vec<Pool>>,
    /// The deadlines of statements with a timeout, kept outside `runtime` (its thread ends
    /// when this state is dropped).
    watchdog: deadline::Watchdog,
}

impl SqlState {
    fn new(engine: &Arc<EngineInner>) -> Result<Self> {
        let last_refusal = Arc::new(LastRefusal::default());
        let pool = GritMemoryPool::new(Arc::clone(&engine.shared), Arc::clone(&last_refusal));
        let env = RuntimeEnvBuilder::new().with_memory_pool(Arc::new(pool)).build_arc().map_err(|e| sql_error(e, &last_refusal))?;
        let weak = Arc::downgrade(engine);
        // `Engine::sql` bounds depth itself and runs on `STACK_BYTES` stacks: its session
        // parses deeper than DataFusion's default (`PARSER_RECURSION_LIMIT`).
        let ctx = new_context(&weak, engine.shared.ctl.limit(), Arc::clone(&env), Some(PARSER_RECURSION_LIMIT)).map_err(|e| sql_error(e, &last_refusal))?;
        Ok(Self { engine: weak, env, ctx, last_refusal, runtime: Mutex::new(None), retired: Mutex::new(Vec::new()), watchdog: deadline::Watchdog::default() })
    }

    /// The runtime to spawn a statement on, with its task counter and overdue list. A
    /// runtime with a task past its deadline that has not reached a yield [`OVERDUE_GRACE`]
    /// after its caller returned (this call waits out the rest of that grace) is replaced by
    /// a new one, and retired: shut down once its tasks are gone, so a statement that does not
    /// yield holds no later one up. Retired runtimes without tasks are shut down here.
    fn runtime(&self) -> Result<(tokio::runtime::Handle, Arc<()>, Overdue)> {
        let mut g = self.runtime.lock().unwrap_or_else(PoisonError::into_inner);
        {
            let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(pool) = g.take_if(|p| p.held()) {
                tracing::warn!("a SQL statement past its deadline still holds a gritdb-sql worker; later statements run on a new runtime");
                retired.push(pool);
            }
            retired.retain(|p| Arc::strong_count(&p.tasks) > 1);
        }
        if let Some(p) = g.as_ref()
            && let Some(rt) = p.rt.as_ref()
        {
            return Ok((rt.handle().clone(), Arc::clone(&p.tasks), Arc::clone(&p.overdue)));
        }
        let threads = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        // Planning, optimizing and evaluating recurse once per level of a statement: every
        // statement runs on these threads (`Self::spawn`), with a stack for `MAX_DEPTH` levels.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("gritdb-sql")
            .thread_stack_size(STACK_BYTES)
            .enable_all()
            .build()
            .map_err(|e| Error::Io { path: "tokio runtime (gritdb-sql)".into(), source: e })?;
        let pool = Pool { rt: Some(rt), tasks: Arc::new(()), overdue: Overdue::default() };
        let out = (pool.rt.as_ref().map(|rt| rt.handle().clone()), Arc::clone(&pool.tasks), Arc::clone(&pool.overdue));
        *g = Some(pool);
        match out {
            (Some(handle), tasks, overdue) => Ok((handle, tasks, overdue)),
            (None, ..) => Err(Error::Closed("engine (its SQL runtime)".into())),
        }
    }

    /// Runs one statement as a task on the engine's SQL runtime ([`Self::run`] on its
    /// threads, which have the stack deep statements need), aborted when the returned future
    /// is dropped.
    ///
    /// With a `sql_statement_timeout`, the returned future is `Timeout` at the deadline
    /// (counted from now) even while the task holds its worker: the watchdog's thread marks it
    /// and aborts the task, which stops at its next yield. The task keeps a tokio timer too,
    /// which stops it at a yield point past the deadline whatever the watchdog does.
    fn spawn(self: &Arc<Self>, query: &str) -> Result<QueryTask> {
        let (handle, tasks, overdue) = self.runtime()?;
        let (state, query) = (Arc::clone(self), query.to_owned());
        let timeout = self.engine.upgrade().and_then(|e| e.shared.config.sql_statement_timeout);
        let start = std::time::Instant::now();
        // The runtime is the engine's own, shut down with it (clippy.toml); the task is
        // aborted when its `QueryTask` is dropped, or at its deadline.
        #[allow(clippy::disallowed_methods)]
        let task = handle.spawn(async move {
            // Counts this task on its runtime until its future is dropped (ended or aborted):
            // the binding's effect is that it is held, by the future, until then.
            #[allow(clippy::no_effect_underscore_binding)]
            let _alive = tasks;
            let Some(limit) = timeout else { return state.run(&query).await };
            // Dropping `run`'s future at the deadline drops the plan's streams: scans stop at
            // their next batch and the operators' reservations are released.
            tokio::time::timeout(limit, state.run(&query)).await.unwrap_or_else(|_| Err(timed_out(limit)))
        });
        // A deadline past what `Instant` holds never comes.
        let deadline = timeout.and_then(|limit| Some((limit, self.watchdog.register(start.checked_add(limit)?, task.abort_handle())?)));
        Ok(QueryTask { task, deadline, overdue })
    }

    /// Plans and runs one read-only statement on the current tokio runtime (the engine's SQL
    /// runtime: [`Self::spawn`]).
    async fn run(&self, query: &str) -> Result<Vec<RecordBatch>> {
        let err = |e| sql_error(e, &self.last_refusal);
        let state = self.ctx.state();
        let dialect = state.config().options().sql_parser.dialect;
        // Bounded on the tokens before the parser builds a tree it would recurse into.
        check_token_depth(query, dialect)?;
        // Any failure to get one statement out of the text (parser error, none, several).
        let statement = state.sql_to_statement(query, &dialect).map_err(|e| {
            // Nested past `PARSER_RECURSION_LIMIT`: a depth refusal, not a syntax error. The
            // parser reports its limit in some places, but in others (`CASE` inside a call)
            // it backtracks and reports the token where it gave up.
            // `find_root`: the parser's error may come wrapped (`DataFusionError::Diagnostic`),
            // as 600 `NOT`s in a row did, which then read as a syntax error (fresh-clone trial).
            let deep = match e.find_root() {
                DataFusionError::SQL(p, _) => matches!(**p, ParserError::RecursionLimitExceeded) || parses_deeper(query, dialect),
                // Several statements or none: not the parser's refusal.
                _ => false,
            };
            if deep { parser_too_deep() } else { Error::Sql { kind: SqlErrorKind::Syntax, source: Box::new(e) } }
        })?;
        check_read_only(&statement)?;
        if let Err(at_least) = depth::statement_depth(&statement, MAX_DEPTH) {
            return Err(too_deep(&format!("nests at least {at_least} levels, more than the {MAX_DEPTH} gritdb plans")));
        }
        // What DataFusion plans once each CTE reference is replaced by its CTE's plan.
        let expanded = depth::expansion(&statement);
        if expanded.subqueries > MAX_SUBQUERY_DEPTH {
            return Err(refused(
                SqlErrorKind::TooDeep,
                format!(
                    "the statement nests {} subqueries inside expressions (`(SELECT ..)`, `IN (SELECT ..)`, \
                 `EXISTS`; a CTE read inside one counts its own too), more than the {MAX_SUBQUERY_DEPTH} gritdb plans \
                 (DataFusion's planning time doubles with each); write the inner ones as joins",
                    expanded.subqueries
                ),
            ));
        }
        if expanded.relations > MAX_EXPANDED_RELATIONS {
            return Err(refused(
                SqlErrorKind::TooDeep,
                format!(
                    "the statement plans {} relations (each SELECT and table read, a CTE as many times as it is \
                 referenced, with what it references), more than the {MAX_EXPANDED_RELATIONS} gritdb plans \
                 (DataFusion copies a CTE's plan into each reference: a chain of CTEs each reading the one before \
                 twice doubles per CTE); read each CTE once, or split the statement",
                    if expanded.relations == usize::MAX { format!("at least {}", usize::MAX) } else { expanded.relations.to_string() }
                ),
            ));
        }
        if expanded.depth > MAX_DEPTH {
            return Err(too_deep(&format!(
                "nests {} levels once each CTE is read where it is referenced, more than the {MAX_DEPTH} gritdb plans",
                expanded.depth
            )));
        }
        if let Err(n) = grouping::check_cube_size(&statement) {
            return Err(refused(
                SqlErrorKind::Plan,
                format!(
                    "`CUBE` of {n} expressions stands for 2^{n} grouping sets, which DataFusion builds in memory while planning; \
                 gritdb plans at most {MAX_CUBE_EXPRESSIONS} ({MAX_GROUPING_SETS} sets, DataFusion's limit for grouping sets); \
                 list the grouping sets wanted with `GROUPING SETS (..)`"
                ),
            ));
        }
        let plan = state.statement_to_plan(statement).await.map_err(err)?;
        datafusion::execution::context::SQLOptions::new()
            .with_allow_ddl(false)
            .with_allow_dml(false)
            .with_allow_statements(false)
            .verify_plan(&plan)
            .map_err(|e| Error::Sql { kind: SqlErrorKind::NotSupported, source: Box::new(e) })?;
        let df = self.ctx.execute_logical_plan(plan).await.map_err(err)?;
        df.collect().await.map_err(err)
    }
}

/// `Error::Sql { kind: Timeout }` for a statement cancelled after `limit`.
fn timed_out(limit: std::time::Duration) -> Error {
    Error::Sql {
        kind: SqlErrorKind::Timeout,
        source: Box::new(DataFusionError::Execution(format!("statement cancelled after {limit:?} (EngineConfig::sql_statement_timeout)"))),
    }
}

/// A running [`SqlState::spawn`]ed statement: its answer, `Timeout` once its deadline has
/// passed (without waiting for its task), or a typed error when it panicked or the engine
/// shut its runtime down. Dropping it aborts the statement and removes its deadline.
struct QueryTask {
    task: tokio::task::JoinHandle<Result<Vec<RecordBatch>>>,
    /// The timeout and its deadline on the watchdog (`None`: no timeout, or no watchdog
    /// thread could be started, and then only the task's own timer).
    deadline: Option<(std::time::Duration, deadline::Deadline)>,
    /// The overdue list of the runtime the task runs on ([`Pool::overdue`]).
    overdue: Overdue,
}

impl std::future::Future for QueryTask {
    type Output = Result<Vec<RecordBatch>>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        let joined = std::pin::Pin::new(&mut this.task).poll(cx);
        // Asked after the task: a task the watchdog cancelled is seen as passed here.
        let passed = this.deadline.as_ref().and_then(|(limit, d)| d.passed(cx).then_some(*limit));
        std::task::Poll::Ready(match (joined, passed) {
            (std::task::Poll::Ready(Ok(answer)), _) => answer,
            (std::task::Poll::Ready(Err(e)), _) if e.is_panic() => {
                let panic = e.into_panic();
                let what = panic.downcast_ref::<&str>().map(|s| (*s).to_owned()).or_else(|| panic.downcast_ref::<String>().cloned());
                Err(Error::Sql {
                    kind: SqlErrorKind::Internal,
                    source: Box::new(DataFusionError::Internal(format!("the query panicked: {}", what.as_deref().unwrap_or("(no message)")))),
                })
            }
            // Still running (its worker busy, or not yet at a yield): it stops at its next one,
            // and the next statement goes to a new runtime in case that is far off.
            (joined, Some(limit)) => {
                if joined.is_pending() {
                    this.overdue.lock().unwrap_or_else(PoisonError::into_inner).push((std::time::Instant::now(), this.task.abort_handle()));
                }
                this.task.abort();
                Err(timed_out(limit))
            }
            (std::task::Poll::Ready(Err(_)), None) => Err(Error::Closed("engine (the query was stopped by its shutdown)".into())),
            (std::task::Poll::Pending, None) => return std::task::Poll::Pending,
        })
    }
}

impl Drop for QueryTask {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `Error::Sql { kind: TooDeep }` saying what was found against which limit, and how to
/// rewrite.
fn too_deep(found: &str) -> Error {
    refused(
        SqlErrorKind::TooDeep,
        format!(
            "the statement {found} (planning recurses once per level: each operator of a chain like `a OR b OR c`, \
         function call, CASE, subquery, UNION, joined table and CTE is one); write long OR chains of one column as \
         `col IN (v1, v2, ...)`, many UNION ALL branches of constants as one VALUES list, or split the statement"
        ),
    )
}

/// `Error::Sql { kind, .. }` for a statement gritdb refuses before planning, saying why
/// (a `DataFusion` `Plan` error as its source, as `DataFusion`'s own refusals have).
fn refused(kind: SqlErrorKind, why: String) -> Error {
    Error::Sql { kind, source: Box::new(DataFusionError::Plan(why)) }
}

/// `Error::Sql { kind: TooDeep }` for a text nested past [`PARSER_RECURSION_LIMIT`].
fn parser_too_deep() -> Error {
    refused(
        SqlErrorKind::TooDeep,
        format!(
            "the statement nests parentheses, function calls, CASE expressions and subqueries more than the \
         {PARSER_RECURSION_LIMIT} levels the SQL parser takes (each counts one, a subquery two); flatten \
         the nesting (a CASE with more WHEN branches, a join or CTE instead of a subquery in a subquery) \
         or split the statement"
        ),
    )
}

/// Whether a text the parser refused at [`PARSER_RECURSION_LIMIT`] parses as one statement
/// without that limit (up to [`MAX_TOKEN_DEPTH`], which [`check_token_depth`] already bounded
/// it by): then it was refused for its depth. Parsing is stack-safe here (`DataFusion`'s `recursive_protection`)
/// and the tree is only dropped.
fn parses_deeper(query: &str, dialect: datafusion::common::config::Dialect) -> bool {
    let Some(dialect) = datafusion::sql::sqlparser::dialect::dialect_from_str(dialect) else { return false };
    datafusion::sql::parser::DFParserBuilder::new(query)
        .with_dialect(dialect.as_ref())
        .with_recursion_limit(MAX_TOKEN_DEPTH)
        .build()
        .and_then(|mut p| p.parse_statements())
        .is_ok_and(|statements| statements.len() == 1)
}

/// Refuses, before parsing, a text whose tokens could make a syntax tree deeper than the
/// parser and the tree's drop may recurse ([`depth::token_depth`] above [`MAX_TOKEN_DEPTH`]),
/// or that nests data types deeper than [`gritdb_unify::MAX_TYPE_DEPTH`] (the parser builds
/// them by unguarded recursion, and Arrow recurses through nested types). A text that does
/// not tokenize is left to the parser's error.
fn check_token_depth(query: &str, dialect: datafusion::common::config::Dialect) -> Result<()> {
    let Some(dialect) = datafusion::sql::sqlparser::dialect::dialect_from_str(dialect) else { return Ok(()) };
    let Ok(tokens) = datafusion::sql::sqlparser::tokenizer::Tokenizer::new(dialect.as_ref(), query).tokenize() else { return Ok(()) };
    let found = depth::token_depth(&tokens);
    if found.depth > MAX_TOKEN_DEPTH {
        return Err(too_deep(&format!(
            "has tokens that could nest up to {} levels (a text that could nest more than {MAX_TOKEN_DEPTH} is not parsed), more than the {MAX_DEPTH} gritdb plans",
            found.depth
        )));
    }
    if found.type_depth > gritdb_unify::MAX_TYPE_DEPTH {
        return Err(too_deep(&format!(
            "nests data types {} levels deep (`ARRAY<..>`, `STRUCT<..>`, `INT[]`), more than the {} gritdb plans",
            found.type_depth,
            gritdb_unify::MAX_TYPE_DEPTH
        )));
    }
    Ok(())
}

/// A session over the engine's catalog and memory pool. `parser_recursion_limit` replaces
/// the SQL parser's (`DataFusion`'s default, 50) for a session whose statements run on the
/// engine's SQL runtime after the depth checks; `None` keeps the default (a
/// `session_context()` runs on the caller's threads, whatever their stack).
fn new_context(
    engine: &std::sync::Weak<EngineInner>,
    limit: usize,
    env: Arc<RuntimeEnv>,
    parser_recursion_limit: Option<usize>,
) -> datafusion::error::Result<SessionContext> {
    let mut config =
        SessionConfig::new().with_information_schema(true).with_create_default_catalog_and_schema(false).with_default_catalog_and_schema(CATALOG, SCHEMA);
    if let Some(n) = parser_recursion_limit {
        config.options_mut().sql_parser.recursion_limit = datafusion::common::config::ConfigNonZeroUsize::try_new(n)?;
    }
    // A sort that may spill sets this much aside for merging its spill files: a batch of
    // each file being merged must fit (DataFusion's default, 10 MiB, is most of a small limit).
    config.options_mut().execution.sort_spill_reservation_bytes = (limit / 16).min(10 << 20);
    // `0.06` is an exact DECIMAL, as in DuckDB and the SQL standard, not a binary float:
    // `l_discount BETWEEN 0.06 - 0.01 AND 0.06 + 0.01` must include 0.07.
    config.options_mut().sql_parser.parse_float_as_decimal = true;
    // ... and a float column compared with such a constant compares in floating point, not
    // by casting the column to DECIMAL (which fails on NaN, infinities and values ≥ 1e15).
    let mut rules: Vec<Arc<dyn datafusion::optimizer::AnalyzerRule + Send + Sync>> = vec![Arc::new(coerce::FloatComparedWithDecimal)];
    rules.extend(datafusion::optimizer::Analyzer::new().rules);
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(env)
        .with_default_features()
        .with_analyzer_rules(rules)
        // Yield points above joins, for `sql_statement_timeout` (`yields`).
        .with_physical_optimizer_rule(Arc::new(yields::JoinYields))
        .build();
    let ctx = SessionContext::new_with_state(state);
    // Functions whose result size an argument sets reserve it in the query pool first.
    bounded::register(&ctx, &ctx.runtime_env().memory_pool);
    let catalog = MemoryCatalogProvider::new();
    let table_functions = ctx.state().table_functions().keys().cloned().collect();
    catalog.register_schema(SCHEMA, Arc::new(catalog::EngineSchema::new(engine.clone(), table_functions)))?;
    ctx.register_catalog(CATALOG, Arc::new(catalog));
    Ok(ctx)
}

/// Only statements that read: queries, EXPLAIN of them, DESCRIBE, SHOW TABLES/COLUMNS.
fn check_read_only(statement: &DfStatement) -> Result<()> {
    fn sql_ok(s: &SqlStatement) -> bool {
        match s {
            SqlStatement::Query(_) | SqlStatement::ShowTables { .. } | SqlStatement::ShowColumns { .. } | SqlStatement::ExplainTable { .. } => true,
            SqlStatement::Explain { statement, .. } => sql_ok(statement),
            _ => false,
        }
    }
    fn ok(s: &DfStatement) -> bool {
        match s {
            DfStatement::Statement(s) => sql_ok(s),
            DfStatement::Explain(e) => ok(&e.statement),
            _ => false,
        }
    }
    if ok(statement) {
        return Ok(());
    }
    let first = statement.to_string();
    let first = first.split_whitespace().next().unwrap_or("").to_uppercase();
    Err(Error::Sql {
        kind: SqlErrorKind::NotSupported,
        source: Box::new(DataFusionError::NotImplemented(format!(
            "gritdb SQL is read-only: `{first}` statements are not supported; write through Table::insert/upsert/update/delete"
        ))),
    })
}

/// Carries a gritdb error through `DataFusion` (unwrapped again by `Engine::sql`).
pub(crate) fn to_datafusion(e: Error) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

/// The first gritdb error inside `e`, taken out when `e` owns it alone.
fn take_ours(e: DataFusionError) -> std::result::Result<Error, DataFusionError> {
    match e {
        DataFusionError::External(b) => match b.downcast::<Error>() {
            Ok(ours) => Ok(*ours),
            Err(b) => match b.downcast::<DataFusionError>() {
                Ok(inner) => take_ours(*inner),
                Err(b) => Err(DataFusionError::External(b)),
            },
        },
        DataFusionError::Context(c, inner) => take_ours(*inner).map_err(|i| DataFusionError::Context(c, Box::new(i))),
        DataFusionError::Diagnostic(d, inner) => take_ours(*inner).map_err(|i| DataFusionError::Diagnostic(d, Box::new(i))),
        DataFusionError::Shared(arc) => match Arc::try_unwrap(arc) {
            Ok(inner) => take_ours(inner),
            Err(arc) => Err(DataFusionError::Shared(arc)),
        },
        DataFusionError::ArrowError(a, ctx) => match *a {
            arrow_schema::ArrowError::ExternalError(b) => match b.downcast::<Error>() {
                Ok(ours) => Ok(*ours),
                Err(b) => match b.downcast::<DataFusionError>() {
                    Ok(inner) => take_ours(*inner),
                    Err(b) => Err(DataFusionError::ArrowError(Box::new(arrow_schema::ArrowError::ExternalError(b)), ctx)),
                },
            },
            other => Err(DataFusionError::ArrowError(Box::new(other), ctx)),
        },
        other => Err(other),
    }
}

/// A copy of a gritdb error found by reference (shared by several `DataFusion` consumers:
/// a scan's error reaches every partition of a repartition, sort or join as one `Arc`), for
/// the variants that can be rebuilt. An I/O error is rebuilt from its kind and text.
fn rebuild(e: &Error) -> Option<Error> {
    Some(match e {
        Error::Storage(s) => Error::Storage(rebuild_storage(s)?),
        Error::Memory(m) => Error::Memory(m.clone()),
        Error::Io { path, source } => Error::Io { path: path.clone(), source: copy_io(source) },
        Error::MemoryLimit { requested, used, limit, category, top } => {
            Error::MemoryLimit { requested: *requested, used: *used, limit: *limit, category: *category, top: top.clone() }
        }
        Error::TableNotFound { name } => Error::TableNotFound { name: name.clone() },
        Error::ColumnNotFound { table, column } => Error::ColumnNotFound { table: table.clone(), column: column.clone() },
        Error::Closed(s) => Error::Closed(s.clone()),
        Error::Config(s) => Error::Config(s.clone()),
        _ => return None,
    })
}

/// A copy of a storage error (see [`rebuild`]); `None` for Parquet and Arrow errors, which
/// stay [`Error::Sql`] with the shared error as source.
fn rebuild_storage(e: &StorageError) -> Option<StorageError> {
    Some(match e {
        StorageError::Io { path, source } => StorageError::Io { path: path.clone(), source: copy_io(source) },
        StorageError::CorruptManifest { path, detail } => StorageError::CorruptManifest { path: path.clone(), detail: detail.clone() },
        StorageError::CorruptFile { path, detail } => StorageError::CorruptFile { path: path.clone(), detail: detail.clone() },
        StorageError::MissingFile { path, table } => StorageError::MissingFile { path: path.clone(), table: table.clone() },
        StorageError::CorruptWal { path, offset, detail } => StorageError::CorruptWal { path: path.clone(), offset: *offset, detail: detail.clone() },
        StorageError::FileTooLarge { rows, max_rows } => StorageError::FileTooLarge { rows: *rows, max_rows: *max_rows },
        StorageError::FileIdsExhausted { table } => StorageError::FileIdsExhausted { table: table.clone() },
        StorageError::Memory(m) => StorageError::Memory(m.clone()),
        _ => return None,
    })
}

/// An I/O error of the same OS code, or else of the same kind and text (`std::io::Error` is
/// not `Clone`).
fn copy_io(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

/// Every error in `e`'s source chain, `e` first.
fn chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

/// The innermost `DataFusion` error of `e` (also inside `Collection`s: their first).
fn root(e: &DataFusionError) -> &DataFusionError {
    let mut last = e;
    for s in chain(e) {
        if let Some(d) = s.downcast_ref::<DataFusionError>() {
            last = d;
        } else if let Some(d) = s.downcast_ref::<Arc<DataFusionError>>() {
            last = d.as_ref();
        }
    }
    match last {
        DataFusionError::Collection(v) if !v.is_empty() => root(&v[0]),
        other => other,
    }
}

/// Turns a `DataFusion` error into gritdb's: a gritdb error carried inside (unknown table,
/// storage, memory) comes back as itself; a refusal of the query memory pool becomes
/// [`Error::MemoryLimit`] with the figures of the refusal; the rest is [`Error::Sql`] with
/// its [`SqlErrorKind`] and the `DataFusion` error as source.
fn sql_error(e: DataFusionError, last: &LastRefusal) -> Error {
    let e = match take_ours(e) {
        Ok(ours) => return ours,
        Err(e) => e,
    };
    if let Some(ours) = chain(&e).find_map(|s| s.downcast_ref::<Error>()).and_then(rebuild) {
        return ours;
    }
    let r = root(&e);
    if matches!(r, DataFusionError::ResourcesExhausted(_))
        && let Some(refusal) = last.get()
    {
        return refusal.into();
    }
    let kind = match r {
        DataFusionError::SQL(..) => SqlErrorKind::Syntax,
        DataFusionError::SchemaError(s, _)
            if matches!(**s, datafusion::common::SchemaError::FieldNotFound { .. } | datafusion::common::SchemaError::AmbiguousReference { .. }) =>
        {
            SqlErrorKind::UnknownColumn
        }
        DataFusionError::Plan(_) | DataFusionError::SchemaError(..) | DataFusionError::Configuration(_) => SqlErrorKind::Plan,
        DataFusionError::NotImplemented(_) => SqlErrorKind::NotSupported,
        DataFusionError::Internal(_) => SqlErrorKind::Internal,
        _ => SqlErrorKind::Execution,
    };
    Error::Sql { kind, source: Box::new(e) }
}

impl EngineInner {
    fn sql_state(self: &Arc<Self>) -> Result<Arc<SqlState>> {
        self.check_open()?;
        self.sql.get_or_init(self)
    }
}

impl Engine {
    /// Runs one read-only SQL statement and returns its result batches (all of them, or an
    /// error and none). Blocks the calling thread.
    ///
    /// Tables resolve like [`Engine::table`] (an exact name, else the one table whose name
    /// matches ignoring case, so the lowercase form SQL gives unquoted names finds
    /// `Orders`); each is read as one consistent snapshot (files minus deletion vectors,
    /// merged with the deltas), with projection and `LIMIT` pushed into the scan. The
    /// system tables [`SYSTEM_TABLES`] show memory and tables. Query operators reserve
    /// memory (category `query`) under the engine's limit; past what a query may use they
    /// spill (sorts, aggregates) or the query fails with [`Error::MemoryLimit`].
    ///
    /// The statement (parsing, planning, execution) runs as a task on the engine's own
    /// runtime (threads `gritdb-sql`, one per core, [`STACK_BYTES`] of stack each, built at
    /// the first call); the calling thread only waits, so its own stack does not matter. A
    /// statement nested deeper than [`MAX_DEPTH`] levels is refused before planning
    /// (`docs/sql.md`, "Deep statements"). Called from inside a tokio runtime it works too,
    /// but blocks that worker: in async code use [`Engine::sql_async`].
    ///
    /// # Errors
    /// [`Error::Sql`] with [`SqlErrorKind`] `Syntax` (not SQL, several statements),
    /// `UnknownColumn`, `Plan`, `NotSupported` (statements that write or change settings),
    /// `TooDeep` (nested past [`MAX_DEPTH`]), `Execution`, `Internal` (also a panic while the
    /// statement ran), `Timeout` (past [`crate::EngineConfig::sql_statement_timeout`]: at the
    /// deadline, while the work runs on to its next yield); [`Error::TableNotFound`] for an
    /// unknown table; [`Error::MemoryLimit`] when the query's operators cannot get memory and
    /// cannot spill; [`Error::Storage`] and other engine errors from the scans;
    /// [`Error::Closed`].
    pub fn sql(&self, query: &str) -> Result<Vec<RecordBatch>> {
        let state = self.inner.sql_state()?;
        // The statement runs on the engine's runtime; this thread only waits (also a tokio
        // worker: `futures`' executor is not tokio's, so it may block one).
        futures::executor::block_on(state.spawn(query)?)
    }

    /// [`Engine::sql`] for async code: awaits the statement, which runs on the engine's SQL
    /// runtime (not the caller's: its threads have the stack deep statements need). Dropping
    /// the future stops the statement.
    ///
    /// # Errors
    /// As [`Engine::sql`]; [`Error::Config`] when not polled inside a tokio runtime.
    pub async fn sql_async(&self, query: &str) -> Result<Vec<RecordBatch>> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Config("Engine::sql_async must run inside a tokio runtime; use Engine::sql from synchronous code".into()));
        }
        let state = self.inner.sql_state()?;
        state.spawn(query)?.await
    }

    /// A new `DataFusion` [`SessionContext`] over this engine: catalog `gritdb`, schema
    /// `public` (the defaults) with every table and the system tables, and the engine's
    /// memory pool, so its queries are governed like [`Engine::sql`]'s. It is the caller's
    /// own session (settings, extra tables and `DataFrames` stay in it); use it on a tokio
    /// runtime. Unlike [`Engine::sql`] it does not restrict statements, but the engine's
    /// tables accept no writes through it.
    ///
    /// # Errors
    /// [`Error::Closed`]; `DataFusion` setup errors as [`Error::Sql`].
    pub fn session_context(&self) -> Result<SessionContext> {
        let state = self.inner.sql_state()?;
        new_context(&state.engine, self.inner.shared.ctl.limit(), Arc::clone(&state.env), None).map_err(|e| sql_error(e, &state.last_refusal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statement that panics on the SQL runtime is `Error::Sql { kind: Internal }` naming
    /// the panic, not a panic of the caller; one stopped by the runtime's shutdown is
    /// `Error::Closed`.
    #[test]
    #[allow(clippy::disallowed_methods)] // a runtime of the test's own
    fn a_panicking_or_stopped_query_is_a_typed_error() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        let task = QueryTask {
            overdue: Overdue::default(),
            task: rt.spawn(async {
                assert!(std::hint::black_box(false), "boom in the planner");
                Ok(Vec::new())
            }),
            deadline: None,
        };
        match futures::executor::block_on(task) {
            Err(Error::Sql { kind: SqlErrorKind::Internal, source }) => {
                assert!(source.to_string().contains("the query panicked: boom in the planner"), "{source}");
            }
            other => panic!("expected Internal, got {other:?}"),
        }
        let task = QueryTask { task: rt.spawn(std::future::pending::<Result<Vec<RecordBatch>>>()), deadline: None, overdue: Overdue::default() };
        rt.shutdown_background();
        assert!(matches!(futures::executor::block_on(task), Err(Error::Closed(_))));
    }
}
