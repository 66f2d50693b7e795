use gritdb_storage::{StdFs, Vfs, WalSync};
use std::sync::Arc;
use std::time::Duration;

/// Engine settings. Build with `EngineConfig::default().memory_limit(256 << 20)`.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The one memory limit in bytes; `None` = 50% of RAM or of the cgroup limit.
    pub memory_limit: Option<usize>,
    /// Chunk size of row blocks in bytes (power of two, 4 KiB..=64 MiB). Default 64 KiB.
    pub chunk_size: usize,
    /// Largest encoded row accepted, in bytes. Rows above a chunk but under this get a
    /// dedicated (counted) allocation. Default 16 MiB; at most `u32::MAX` bytes (a row's
    /// lengths and offsets are `u32`s in the row format: more is [`crate::Error::Config`] at
    /// open). A write with a row above it is
    /// `Error::Input(UnifyError::RowTooLarge)` at any memory limit, checked before the write
    /// asks for memory (nothing is applied).
    pub max_row_bytes: usize,
    /// A table's active delta is sealed and flushed when it holds this many bytes.
    /// `None` = limit / 16, clamped to 1 MiB..=64 MiB. Any value is then held to at most
    /// limit / 8 and at least one row-block chunk (so 0 means one chunk), under the limit in
    /// force.
    pub table_flush_bytes: Option<usize>,
    /// How long a write waits for the background writer to free memory before it returns
    /// [`crate::Error::MemoryLimit`]. Default 30 s; `Duration::MAX` waits without end.
    /// Waiting writes are admitted in the order they began to wait, so this also bounds how
    /// long a write waits behind bigger writes that came first.
    pub backpressure_timeout: Duration,
    /// Background flush threads. Default 2; at most [`crate::MAX_THREADS`] (more is
    /// [`crate::Error::Config`] at open, as for the other thread counts).
    pub writer_threads: usize,
    /// Threads a flush a caller waits for ([`crate::Table::flush`], close, replay) and its
    /// compactions use, the flushing thread included (background flushes:
    /// [`Self::background_flush_threads`]): the sort and
    /// rows → Arrow conversion of a sealed delta, then the Parquet encoding of the file's
    /// columns (scoped threads that end with each step). 1 = all on the flushing thread.
    /// Default [`gritdb_storage::default_encode_threads`]: min(2, available parallelism).
    pub flush_threads: usize,
    /// Threads one flush of the background writer uses (its sealed deltas, during ingest).
    /// Default 1: a background flush runs beside the writes that fill the next delta, and on
    /// two cores a second flush thread takes the core those writes run on (`gritdb-soak
    /// bench`, 2 flush threads in the background: upsert 1.8 → 0.5 M rows/s, delete 2.3 → 0.8
    /// pinned). A flush a caller waits for ([`crate::Table::flush`], close, replay) uses
    /// [`Self::flush_threads`].
    pub background_flush_threads: usize,
    /// CPU scheduling of background flushes (their threads' policy and nice value). Default
    /// [`BackgroundPriority::Inherit`]; [`BackgroundPriority::Batch`]`(0)` makes a background
    /// flush yield to the writes it runs beside (see there for what that costs).
    pub background_priority: BackgroundPriority,
    /// A table's active delta is flushed once its first row is this old, however small.
    /// Default 30 s.
    pub flush_age: Duration,
    /// Arrow batches built from a sealed delta are cut at this many encoded row bytes, so
    /// string offsets (`i32`) never overflow however large a flush is, and each batch block
    /// stays bounded. Default 256 MiB; at most 1 GiB.
    pub flush_batch_bytes: usize,
    /// When write-ahead-log appends reach stable storage: fsync per write call (default) or
    /// group commit every [`Self::wal_sync_interval`].
    pub wal_sync: WalSync,
    /// Group-commit interval of [`WalSync::Relaxed`]. Default 10 ms.
    pub wal_sync_interval: Duration,
    /// Partitions of a table scan in SQL (`sql` feature: [`crate::Engine::sql`],
    /// [`crate::Engine::session_context`]): that many threads decode one snapshot of the table
    /// ([`crate::Table::scan_partitions`]); a scan with a LIMIT reads one. Default 1. Each
    /// partition holds its own reader and batches, and the operators above get as many
    /// inputs: a sort of 500,000 rows that spilled within a 64 MiB limit on one partition
    /// failed on two (`query` refused for a merge, with 19.5 MB of scan batches held:
    /// `sql::query_memory_spills_or_fails_typed_and_returns_to_the_baseline`). Raise it where
    /// memory is ample; Q1 at SF 0.1 on 2 partitions: docs/performance.md. At most
    /// [`crate::MAX_THREADS`].
    pub sql_scan_partitions: usize,
    /// How long one statement of [`crate::Engine::sql`] / [`crate::Engine::sql_async`] may run
    /// before it is cancelled and returns `Error::Sql { kind: SqlErrorKind::Timeout }`
    /// (`PostgreSQL`'s `statement_timeout`). `None` (default): no limit, as there. The clock
    /// starts when the statement is submitted and is kept by a thread of the engine's own
    /// (`gritdb-sql-deadline`, one per engine, started at the first statement with a timeout),
    /// not by the SQL workers: the caller gets `Timeout` at the deadline (plus scheduling
    /// delay) even while the statement holds its worker. The statement's work stops later, at
    /// its next yield, and its scans and query memory are given back then, not at the return:
    /// scans and exchanges yield often, joins and unnests at least every 128 batches they emit,
    /// but one batch's work of an operator runs to its end first — a join whose condition
    /// discards most pairs, a window over the whole input, a costly scan batch, planning. Until
    /// then it keeps its SQL thread, so the statements after it run on a new SQL runtime (the
    /// old one is shut down when its last task ends): on one core a join over 50,000² pairs,
    /// 300 ms timeout, returned `Timeout` after 0.31 s (before: it answered after 6.8 s), the
    /// next statements answered at once, and it gave its memory back 8–16 s later
    /// (docs/sql.md).
    pub sql_statement_timeout: Option<Duration>,
    /// The file layer data files, deletion vectors and manifests are written through.
    /// Default: the real file system ([`StdFs`]). Tests pass a [`gritdb_storage::FaultFs`].
    pub vfs: Arc<dyn Vfs>,
    /// Whether [`crate::Engine::open`] creates a data directory that does not exist (with its
    /// missing parents). Default `true`; with `false` a missing directory is
    /// [`crate::Error::NotADataDir`] (`found:` [`crate::DataDirFound::Missing`]), as `RocksDB`'s
    /// `create_if_missing = false` refuses. An existing directory is opened either way when it
    /// is empty or a gritdb data directory, and refused when it holds anything else.
    pub create_if_missing: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            memory_limit: None,
            chunk_size: gritdb_memctl::DEFAULT_CHUNK_SIZE,
            max_row_bytes: 16 << 20,
            table_flush_bytes: None,
            backpressure_timeout: Duration::from_secs(30),
            writer_threads: 2,
            flush_threads: gritdb_storage::default_encode_threads(),
            background_flush_threads: 1,
            background_priority: BackgroundPriority::Inherit,
            flush_age: Duration::from_secs(30),
            flush_batch_bytes: 256 << 20,
            vfs: Arc::new(StdFs),
            sql_scan_partitions: 1,
            sql_statement_timeout: None,
            wal_sync: WalSync::PerBatch,
            wal_sync_interval: Duration::from_millis(10),
            create_if_missing: true,
        }
    }
}

impl EngineConfig {
    /// Sets the memory limit in bytes.
    #[must_use]
    pub fn memory_limit(mut self, bytes: usize) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    /// Sets the chunk size in bytes.
    #[must_use]
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// Sets the largest accepted encoded row in bytes.
    #[must_use]
    pub fn max_row_bytes(mut self, bytes: usize) -> Self {
        self.max_row_bytes = bytes;
        self
    }

    /// Sets the per-table flush threshold in bytes (held to one chunk..=limit / 8: see
    /// [`Self::table_flush_bytes`]).
    #[must_use]
    pub fn table_flush_bytes(mut self, bytes: usize) -> Self {
        self.table_flush_bytes = Some(bytes);
        self
    }

    /// Sets [`Self::sql_statement_timeout`]: a SQL statement running longer is cancelled.
    #[must_use]
    pub fn sql_statement_timeout(mut self, d: Duration) -> Self {
        self.sql_statement_timeout = Some(d);
        self
    }

    /// Sets the backpressure wait (`Duration::MAX`: without end).
    #[must_use]
    pub fn backpressure_timeout(mut self, d: Duration) -> Self {
        self.backpressure_timeout = d;
        self
    }

    /// Sets the write-ahead-log sync mode.
    #[must_use]
    pub fn wal_sync(mut self, mode: WalSync) -> Self {
        self.wal_sync = mode;
        self
    }

    /// Sets the group-commit interval of [`WalSync::Relaxed`] (at least 1 ms).
    #[must_use]
    pub fn wal_sync_interval(mut self, interval: Duration) -> Self {
        self.wal_sync_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Sets the file layer (for fault injection).
    #[must_use]
    pub fn vfs(mut self, vfs: Arc<dyn Vfs>) -> Self {
        self.vfs = vfs;
        self
    }

    /// Sets the flush batch cut in bytes (clamped to 1 KiB..=1 GiB).
    #[must_use]
    pub fn flush_batch_bytes(mut self, bytes: usize) -> Self {
        self.flush_batch_bytes = bytes.clamp(1 << 10, 1 << 30);
        self
    }

    /// Sets the age at which a delta is flushed however small.
    #[must_use]
    pub fn flush_age(mut self, age: Duration) -> Self {
        self.flush_age = age.max(Duration::from_millis(10));
        self
    }

    /// Sets the threads one background flush uses (at least 1, at most
    /// [`crate::MAX_THREADS`]; see [`Self::background_flush_threads`]).
    #[must_use]
    pub fn background_flush_threads(mut self, n: usize) -> Self {
        self.background_flush_threads = n.max(1);
        self
    }

    /// Sets the CPU scheduling of background flushes (see [`BackgroundPriority`]).
    #[must_use]
    pub fn background_priority(mut self, priority: BackgroundPriority) -> Self {
        self.background_priority = priority;
        self
    }

    /// Sets the threads one flush or compaction uses (at least 1, at most
    /// [`crate::MAX_THREADS`]; see [`Self::flush_threads`]).
    #[must_use]
    pub fn flush_threads(mut self, n: usize) -> Self {
        self.flush_threads = n.max(1);
        self
    }

    /// Sets the partitions of a table scan in SQL (at least 1; more than
    /// [`crate::MAX_THREADS`] is refused at open; see [`Self::sql_scan_partitions`]).
    #[must_use]
    pub fn sql_scan_partitions(mut self, n: usize) -> Self {
        self.sql_scan_partitions = n.max(1);
        self
    }

    /// Sets whether a missing data directory is created (see [`Self::create_if_missing`]).
    #[must_use]
    pub fn create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// Sets the number of background flush threads (at least 1; more than
    /// [`crate::MAX_THREADS`] is refused at open).
    #[must_use]
    pub fn writer_threads(mut self, n: usize) -> Self {
        self.writer_threads = n.max(1);
        self
    }
}

/// CPU scheduling of the background writer's flush threads (and the encoding threads a
/// background flush starts, which inherit it). A flush a caller waits for
/// ([`crate::Table::flush`], close, replay) runs on the caller's thread as the caller runs.
///
/// A background flush competes for the same cores as the writes that fill the next delta and
/// as their write-ahead-log records; when it wins, the write waits
/// (`gritdb-soak bench` at SF 0.1, `perf sched timehist`: the insert's thread was blocked 112
/// of 316 ms waiting for WAL records that waited for a core the flush held;
/// docs/performance.md, eighth pass). `RocksDB` lowers its background threads too, further and
/// when asked (`Env::LowerThreadPoolCPUPriority`, `port::SetCpuPriority`: `SCHED_OTHER` at nice 19).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackgroundPriority {
    /// Flush threads keep the scheduling policy and nice value they inherit from the thread
    /// that opened the engine (a real-time caller's flushes are real-time too).
    Inherit,
    /// Linux `SCHED_BATCH` at this nice value (0..=19), or at the inherited nice value when that
    /// is higher. A flush thread keeps its fair share of CPU (at nice 0, the same weight as any
    /// other thread), but the scheduler treats it as CPU-bound and mildly disfavors it at
    /// wakeups: it never preempts a running thread when it wakes (`sched(7)`, `SCHED_BATCH`).
    /// Real-time threads (a caller under `SCHED_FIFO` / `SCHED_RR`) always run before it. A
    /// thread already under `SCHED_IDLE` is left there. The OS may refuse (the thread then
    /// keeps its scheduling; logged at debug level). Ignored on other systems.
    ///
    /// The cost: a flush that yields finishes later, so under a small limit its memory is held
    /// longer, and a reader started beside it is likelier to take the room it still needs
    /// (scans may use the flush headroom; exports flush first under pressure since an export
    /// at a 6 MiB limit failed that way in 7 of 8 runs with `Batch(0)`). It is not the default:
    /// unpinned, `Batch(0)`'s gain is inside the run-to-run spread (docs/performance.md, eighth
    /// pass). `Batch(19)` lets the writes take the cores first (`gritdb-soak bench`, upsert
    /// 1.9–2.7 → 3.9–4.3 M rows/s, insert 2.7–2.9 → 3.2–3.5, the durable step 0.51 → 0.57 s;
    /// twenty-second pass), but a thread cannot raise its priority back without
    /// `CAP_SYS_NICE`: beside other busy threads such a flush gets ~1.5% of a core, and
    /// writers waiting for the memory it would free time out. Ask for it in an ingest-only
    /// process.
    Batch(i8),
}
