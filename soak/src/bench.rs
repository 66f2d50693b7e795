//! `gritdb-soak bench`: the keyed-DML benchmark of issue 7, the workload of
//! `peers/README.md` (and `peers/duckdb_ingest.py`) run on gritdb, beside the physical limits
//! of its paths and a naive baseline store, on the same batches in one process.
//!
//! ```text
//! load lineitem (Parquet file or tpchgen, 8,192-row batches)      base RSS read here
//!  1. engine, default config: insert all, upsert every 10th (0, 10, …), delete every 10th
//!     from 5 (5, 15, …), table.flush() (durable_s), count + sum(l_quantity), Q1, full scan
//!     -> RSS above base and VmHWM read here (the `DuckDB` script's figures)
//!  2. engine with a flush threshold above the data: insert all (allocations and accounted
//!     bytes per row, nothing flushed meanwhile), then one flush of all rows (flush rows/s)
//!     then, on a third engine with WalSync::Relaxed (group commit), insert all again: the
//!     insert rate without an fsync per call
//!  3. plain ArrowWriter (the engine's codec, `gritdb::DATA_FILE_COMPRESSION`, and row-group cut, fsync) and
//!     ParquetRecordBatchReader over the same batches: the physical limits
//!  4. the naive store (baseline.rs): the same insert / upsert / delete
//! ```
//!
//! Phases 1–4 run `--runs` times (default 5) on the same input, each run in a fresh directory
//! `run<i>`; the result printed is [`summarize`]d over the runs (medians; memory figures the
//! worst run; `VmHWM` run 1).
//!
//! One foreground thread runs every phase; the engine's background writer threads run as
//! configured. Allocation counts come from [`CountingAlloc`], the `gritdb-soak` binary's
//! global allocator; they are process-wide (background threads included).

use crate::baseline::{NaiveStore, Strs};
use crate::cli::BenchArgs;
use anyhow::{Context, Result, bail, ensure};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Decimal128Type};
use gritdb::memory::ProcessView;
use gritdb::{Engine, EngineConfig, ScanOptions, Table, WalSync};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde::{Deserialize, Serialize};
use std::alloc::{GlobalAlloc, Layout};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Rows per batch, as in the peer workload.
pub const BATCH_ROWS: usize = 8192;
/// lineitem rows at SF 0.1; the answers below are checked when the input has this many rows.
pub const SF01_ROWS: usize = 600_572;
/// count(*) after the workload at SF 0.1.
pub const SF01_COUNT: u64 = 543_228;
/// `sum(l_quantity)` after the workload at SF 0.1.
pub const SF01_SUM_QUANTITY: i128 = 13_875_088;
/// Primary key of lineitem.
pub const KEY: [&str; 2] = ["l_orderkey", "l_linenumber"];
/// `DuckDB` 2.0.1 on this machine (`peers/README.md`): insert, upsert, delete rows/s,
/// checkpoint s, Q1 ms.
pub const DUCKDB: Duck = Duck { insert: 165_000.0, upsert: 200_000.0, delete: 148_000.0, durable_s: 0.07, q1_ms: 18.0 };

/// The peer's figures.
#[derive(Debug, Clone, Copy)]
pub struct Duck {
    /// Insert rows/s.
    pub insert: f64,
    /// Upsert rows/s.
    pub upsert: f64,
    /// Delete rows/s.
    pub delete: f64,
    /// Checkpoint seconds.
    pub durable_s: f64,
    /// Q1 milliseconds.
    pub q1_ms: f64,
}

/// `DuckDB`'s figures measured by the peer script in this invocation (`--duckdb`): the median
/// of its runs, one after each of gritdb's, so both engines meet the same moments of a shared
/// machine. (The recorded [`DUCKDB`] figures came from a moment when this VM ran both engines
/// about half as fast as on 2026-12-01.)
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerFigures {
    /// The script's `engine` (`"duckdb 2.0.1"`).
    pub engine: String,
    /// Insert rows/s.
    pub insert_rows_per_s: f64,
    /// Upsert rows/s.
    pub upsert_rows_per_s: f64,
    /// Delete rows/s.
    pub delete_rows_per_s: f64,
    /// `CHECKPOINT` seconds.
    pub durable_s: f64,
    /// Q1 milliseconds.
    pub q1_ms: f64,
    /// Runs of the script the medians are taken over.
    pub runs: usize,
}

impl PeerFigures {
    /// The medians of `runs` (the script's JSON lines), which must all report `count` and
    /// `sum_quantity` equal to `count` and `sum` (gritdb's answers).
    ///
    /// # Errors
    /// No runs, or a run whose answers differ.
    pub fn median(runs: &[serde_json::Value], count: u64, sum: f64) -> Result<Self> {
        let first = runs.first().context("no DuckDB runs")?;
        let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(serde_json::Value::as_f64).with_context(|| format!("DuckDB result without {k}: {v}"));
        for r in runs {
            ensure!(
                num(r, "count")? as u64 == count && num(r, "sum_quantity")?.to_bits() == sum.to_bits(),
                "DuckDB answered count {} sum(l_quantity) {}, gritdb {count} {sum}",
                num(r, "count")?,
                num(r, "sum_quantity")?
            );
        }
        let median = |k: &str| -> Result<f64> {
            let mut xs = runs.iter().map(|r| num(r, k)).collect::<Result<Vec<_>>>()?;
            xs.sort_by(f64::total_cmp);
            Ok(f64::midpoint(xs[(xs.len() - 1) / 2], xs[xs.len() / 2]))
        };
        Ok(Self {
            engine: first.get("engine").and_then(serde_json::Value::as_str).unwrap_or("duckdb").to_owned(),
            insert_rows_per_s: median("insert_rows_per_s")?,
            upsert_rows_per_s: median("upsert_rows_per_s")?,
            delete_rows_per_s: median("delete_rows_per_s")?,
            durable_s: median("durable_s")?,
            q1_ms: median("q1_ms")?,
            runs: runs.len(),
        })
    }
}

/// Runs the peer script on `parquet` (database file in `dir`) and returns its JSON line.
fn run_peer(script: &Path, parquet: &Path, dir: &Path) -> Result<serde_json::Value> {
    let db = dir.join("duckdb.db");
    let out =
        std::process::Command::new("python3").arg(script).arg(parquet).arg(&db).output().with_context(|| format!("running python3 {}", script.display()))?;
    let _ = std::fs::remove_file(&db);
    let _ = std::fs::remove_file(dir.join("duckdb.db.wal"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "python3 {} failed ({}): {}{}", script.display(), out.status, stdout.trim(), String::from_utf8_lossy(&out.stderr).trim());
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).with_context(|| format!("no JSON line from {}: {stdout}", script.display()))?;
    Ok(serde_json::from_str(line)?)
}

/// The input as a Parquet file for the peer script: `--parquet` itself, else the batches
/// written to `dir/lineitem.parquet`.
fn peer_input(args: &BenchArgs, batches: &[RecordBatch], dir: &Path) -> Result<PathBuf> {
    if let Some(p) = &args.parquet {
        return Ok(p.clone());
    }
    let path = dir.join("lineitem.parquet");
    let mut w = ArrowWriter::try_new(std::fs::File::create(&path)?, batches[0].schema(), None)?;
    for b in batches {
        w.write(b)?;
    }
    w.close()?;
    Ok(path)
}

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

/// A global allocator that counts allocation calls (`alloc`, `alloc_zeroed`, `realloc`) in a
/// process-wide counter and delegates everything to `A`. `gritdb-soak` installs it around
/// jemalloc; [`allocation_count`] reads the counter.
#[derive(Debug)]
pub struct CountingAlloc<A>(pub A);

// SAFETY: every method delegates to `A`, a `GlobalAlloc`, with the caller's arguments
// unchanged; the counter is a relaxed atomic add that neither allocates nor panics.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `alloc`'s contract, which we pass on unchanged.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `self.0` (every allocation goes through it).
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ptr` came from `self.0` with `layout`; the caller upholds the rest.
        unsafe { self.0.realloc(ptr, layout, new_size) }
    }
}

/// Allocation calls so far in this process, or `None` when [`CountingAlloc`] is not the
/// global allocator (the `gritdb-soak-system` binary).
pub fn allocation_count() -> Option<u64> {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let probe = std::hint::black_box(Box::new(0u64));
    let after = ALLOCATIONS.load(Ordering::Relaxed);
    drop(probe);
    (after != before).then_some(after)
}

/// Everything the bench measures; serialised as the one JSON line (the keys of
/// `duckdb_ingest.py` first, then gritdb's own).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BenchResult {
    /// `"gritdb"`.
    pub engine: String,
    /// Input rows.
    pub rows: u64,
    /// Keyed insert of every batch.
    pub insert_rows_per_s: f64,
    /// Upsert of every 10th batch.
    pub upsert_rows_per_s: f64,
    /// Delete of the keys of every 10th batch from the 5th.
    pub delete_rows_per_s: f64,
    /// `table.flush()` after the DML, seconds.
    pub durable_s: f64,
    /// `count(*)`.
    pub count: u64,
    /// `sum(l_quantity)`.
    pub sum_quantity: f64,
    /// Q1-style aggregate, milliseconds.
    pub q1_ms: f64,
    /// RSS after Q1 minus RSS before the engine opened.
    pub rss_above_base_bytes: i64,
    /// Peak RSS after Q1.
    pub vmhwm_bytes: u64,
    /// Plain `ArrowWriter` (the engine's data-file properties and codec, `gritdb::DATA_FILE_COMPRESSION`; fsync) over the same batches.
    pub raw_write_rows_per_s: f64,
    /// The engine's flush of all rows from memory to a committed file (phase 2).
    pub flush_rows_per_s: f64,
    /// Plain `ParquetRecordBatchReader` over the raw file.
    pub raw_read_rows_per_s: f64,
    /// WAL bytes per inserted row (phase 2: every record is still in the log).
    pub wal_bytes_per_row: f64,
    /// The disk's ceiling for a per-batch-durable insert: plain `write` + `fsync` of one
    /// record of the WAL's average record size per batch, as many as there are batches, in the
    /// data directory (`soak/scripts/wal_disk_ceiling.py` measures the same outside).
    pub raw_wal_rows_per_s: f64,
    /// Full engine scan, all columns, after the workload.
    pub scan_rows_per_s: f64,
    /// Allocation calls per inserted row (phase 2, process-wide); `None` without the counter.
    pub allocations_per_row: Option<f64>,
    /// Engine-accounted bytes per inserted row before any flush (phase 2).
    pub accounted_bytes_per_row: f64,
    /// Accounted bytes per row at the engine's default flush threshold (phase 1, after the
    /// inserts, background flushes included).
    pub accounted_bytes_per_row_default: f64,
    /// Allocation calls per row during phase 1's inserts (default threshold, process-wide).
    pub allocations_per_row_default: Option<f64>,
    /// Arrow value bytes per input row (fixed widths + string bytes): the payload.
    pub payload_bytes_per_row: f64,
    /// jemalloc `allocated` growth per row during phase 2's inserts.
    pub allocated_bytes_per_row: f64,
    /// Outside-engine bytes (process allocated minus engine accounted) after phase 2's
    /// inserts, minus the same before.
    pub outside_engine_bytes: i64,
    /// Naive store: insert rows/s.
    pub naive_insert_rows_per_s: f64,
    /// Naive store: upsert rows/s.
    pub naive_upsert_rows_per_s: f64,
    /// Naive store: delete rows/s.
    pub naive_delete_rows_per_s: f64,
    /// Naive store: allocation calls per inserted row.
    pub naive_allocations_per_row: Option<f64>,
    /// Naive store: jemalloc `allocated` growth per inserted row.
    pub naive_bytes_per_row: f64,
    /// Naive store: all its bytes are outside any engine (allocated growth after insert).
    pub naive_outside_engine_bytes: i64,
    /// Phase 2's insert: the same batches, fsync per call as in phase 1, but with no flush
    /// running beside it (its flush threshold is above the data), so the insert alone: the
    /// difference from `insert_rows_per_s` is what phase 1's background flush of the first
    /// sealed delta takes from it (CPU and disk on the same cores).
    pub insert_alone_rows_per_s: f64,
    /// Insert of every batch with `WalSync::Relaxed` (group commit, no fsync per call) and
    /// nothing flushed meanwhile: the rate of the CPU path without the per-batch fsync.
    pub insert_relaxed_rows_per_s: f64,
    /// Phase 1's insert per second of the foreground thread's CPU time (Linux
    /// `/proc/thread-self/schedstat`, time on a CPU): the rate on one core, without the time
    /// the thread waited for an fsync or for a CPU. Less noisy than the wall-clock rate on a
    /// shared machine; `None` where the file is missing.
    pub insert_cpu_rows_per_s: Option<f64>,
    /// Phase 2's insert (no flush beside) per second of foreground CPU time, as above.
    pub insert_alone_cpu_rows_per_s: Option<f64>,
    /// Minor page faults of the foreground thread per row during phase 1's insert
    /// (`/proc/thread-self/stat`, `minflt`): first touches of fresh memory (4 KiB pages).
    pub insert_faults_per_row: Option<f64>,
    /// CPU time of every thread of the process (foreground, WAL record threads, background
    /// flush) during phase 1's insert, nanoseconds per inserted row: the sum over
    /// `/proc/self/task/*/schedstat` (see [`ProcessClock`]). With the wall time it says how
    /// busy the cores were ([`Self::insert_cores_busy`]); `None` off Linux.
    #[serde(default)]
    pub insert_process_cpu_ns_per_row: Option<f64>,
    /// Phase 1's insert: CPU time of every thread over (wall time × available parallelism),
    /// 0..=1. Near 1 the insert ran on a saturated machine, so only less CPU per row (on any
    /// thread, the flush's included) can make it faster; `None` off Linux.
    #[serde(default)]
    pub insert_cores_busy: Option<f64>,
    /// [`Self::insert_process_cpu_ns_per_row`] by thread name (the foreground thread has the
    /// program's name, `gritdb-soak`; `gritdb-wal` are the WAL record threads, `gritdb-writer`
    /// the background flush); not
    /// aggregated over runs (each run prints its own), so the first run's.
    #[serde(default)]
    pub insert_cpu_ns_per_row_by_thread: std::collections::BTreeMap<String, f64>,
    /// As [`Self::insert_process_cpu_ns_per_row`], for phase 2's insert (no flush beside).
    #[serde(default)]
    pub insert_alone_process_cpu_ns_per_row: Option<f64>,
    /// Rows phase 1's `table.flush()` wrote (the rest were flushed in the background).
    pub durable_rows: u64,
    /// `memory_limit` of phase 1 (the engine's default when not given).
    pub memory_limit_bytes: u64,
    /// Background flushes ran under `BackgroundPriority::Batch(0)` (`--background-batch`).
    pub background_batch: bool,
    /// Their nice value (`--background-nice`; 0 without `--background-batch`).
    pub background_nice: i8,
    /// TPC-H Q1 through SQL (`Engine::sql`, `DataFusion`) after phase 1's workload, ms, warm
    /// (the second run); `None` when built without the `sql` feature.
    pub sql_q1_ms: Option<f64>,
    /// The same Q1 on `q1_threads` threads, ms: `Table::scan_partitions` into that many scans,
    /// each aggregated on its own thread, the groups then merged. Not the peer comparison
    /// (the peer script runs `DuckDB` with `SET threads=1`, and `q1_ms` is on one thread).
    #[serde(default)]
    pub q1_parallel_ms: f64,
    /// Threads of `q1_parallel_ms`: the machine's available parallelism.
    #[serde(default)]
    pub q1_threads: u64,
    /// `flush_rows_per_s / raw_write_rows_per_s` of one run (target ≥ 0.85); in the
    /// aggregate, the median of the runs' ratios.
    pub flush_vs_raw_write: f64,
    /// `scan_rows_per_s / raw_read_rows_per_s` of one run (target ≥ 0.85); in the aggregate,
    /// the median of the runs' ratios.
    pub scan_vs_raw_read: f64,
    /// Runs aggregated into this result (`--runs`; 1 for a single run's result).
    pub runs: usize,
    /// Smallest and largest value over the runs of each rate (`*_per_s`) and ratio (`*_vs_*`)
    /// key; empty for a single run's result.
    pub spread: std::collections::BTreeMap<String, [f64; 2]>,
    /// `DuckDB` measured in this invocation (`--duckdb`); `None` otherwise (the table then
    /// compares with the recorded [`DUCKDB`] figures).
    #[serde(default)]
    pub duckdb: Option<PeerFigures>,
}

/// The Q1-style aggregate of one group (raw decimal sums, scale 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Q1Group {
    /// `l_returnflag`.
    pub returnflag: String,
    /// `l_linestatus`.
    pub linestatus: String,
    /// `sum(l_quantity)`, unscaled.
    pub sum_qty: i128,
    /// `sum(l_extendedprice)`, unscaled.
    pub sum_price: i128,
    /// `sum(l_discount)`, unscaled (avg = sum / count / 100).
    pub sum_disc: i128,
    /// `count(*)`.
    pub count: u64,
}

/// The calling thread's CPU time and minor page faults so far (Linux `/proc/thread-self`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ThreadClock {
    /// Nanoseconds on a CPU (`schedstat`, first field).
    cpu_ns: u64,
    /// Minor page faults (`stat`, field 10 `minflt`).
    minor_faults: u64,
}

impl ThreadClock {
    /// `None` off Linux or when either file cannot be read or parsed.
    fn read() -> Option<Self> {
        let sched = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
        Self::parse(&sched, &stat)
    }

    /// From the two files' text. `stat`'s second field (the thread's name, in parentheses)
    /// may hold spaces and parentheses, so fields are counted after its last `)`: `minflt` is
    /// field 10, the 8th after it (proc(5)).
    fn parse(schedstat: &str, stat: &str) -> Option<Self> {
        let cpu_ns = schedstat.split_whitespace().next()?.parse().ok()?;
        let after_name = &stat[stat.rfind(')')? + 1..];
        let minor_faults = after_name.split_whitespace().nth(7)?.parse().ok()?;
        Some(Self { cpu_ns, minor_faults })
    }
}

/// CPU time of every thread of this process, by thread id (Linux `/proc/self/task/<tid>/schedstat`,
/// first field, nanoseconds), with each thread's name (`comm`) and start time (`stat` field 22,
/// clock ticks since boot). The process-wide `utime`/`stime` of `/proc/self/stat` count in
/// clock ticks (10 ms), too coarse for a ~200 ms phase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ProcessClock {
    /// (tid, start time) -> (name, CPU nanoseconds). A thread id is reused once its thread
    /// has ended (the kernel hands ids out cyclically up to `pid_max`, 32,768 here), so the
    /// start time tells two threads of one id apart.
    threads: std::collections::BTreeMap<(u64, u64), (String, u64)>,
}

impl ProcessClock {
    /// `None` off Linux or when the task directory cannot be listed; a thread that ends while
    /// it is read is left out.
    fn read() -> Option<Self> {
        let tasks = std::fs::read_dir("/proc/self/task").ok()?;
        let texts = tasks.filter_map(|e| {
            let e = e.ok()?;
            let tid = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let name = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            Some((tid, start_ticks(&stat)?, name, std::fs::read_to_string(e.path().join("schedstat")).ok()?))
        });
        Some(Self::parse(texts))
    }

    /// From `(tid, start time, comm text, schedstat text)`; unparsable schedstat texts are
    /// left out.
    fn parse(texts: impl IntoIterator<Item = (u64, u64, String, String)>) -> Self {
        let threads = texts
            .into_iter()
            .filter_map(|(tid, start, name, t)| Some(((tid, start), (name.trim_end().to_owned(), t.split_whitespace().next()?.parse().ok()?))))
            .collect();
        Self { threads }
    }

    /// CPU nanoseconds spent from `earlier` to `self`, summed by thread name: each thread's
    /// growth, a thread born between the two counted from 0 (a reused thread id too: its
    /// start time differs). A thread that ended between them is missed (the engine's writer
    /// and WAL threads live as long as the engine; a scoped encode thread of a flush on
    /// `flush_threads` would be missed).
    fn by_name_since(&self, earlier: &Self) -> std::collections::BTreeMap<String, u64> {
        let mut out = std::collections::BTreeMap::new();
        for (id, (name, ns)) in &self.threads {
            let before = earlier.threads.get(id).map_or(0, |&(_, ns)| ns);
            *out.entry(name.clone()).or_insert(0) += ns.saturating_sub(before);
        }
        out
    }

    /// [`Self::by_name_since`], all threads together.
    fn since(&self, earlier: &Self) -> u64 {
        self.by_name_since(earlier).values().sum()
    }
}

/// A thread's start time from its `/proc/.../stat` text: field 22, in clock ticks since boot
/// (the fields counted after the name's closing parenthesis, as the name may hold spaces).
fn start_ticks(stat: &str) -> Option<u64> {
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(19)?.parse().ok()
}

fn rate(rows: u64, secs: f64) -> f64 {
    if secs > 0.0 { rows as f64 / secs } else { 0.0 }
}

fn decimal(a: &dyn Array, name: &str) -> Result<arrow::array::Decimal128Array> {
    match a.data_type() {
        DataType::Decimal128(_, 2) => Ok(a.as_primitive::<Decimal128Type>().clone()),
        t => bail!("column {name} is {t}, expected Decimal128(_, 2)"),
    }
}

/// The input: all lineitem batches.
fn load(args: &BenchArgs) -> Result<Vec<RecordBatch>> {
    if let Some(path) = &args.parquet {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let reader =
            ParquetRecordBatchReaderBuilder::try_new(file).with_context(|| format!("reading {}", path.display()))?.with_batch_size(BATCH_ROWS).build()?;
        Ok(reader.collect::<Result<Vec<_>, _>>()?)
    } else {
        let generator = tpchgen::generators::LineItemGenerator::new(args.scale, 1, 1);
        Ok(tpchgen_arrow::LineItemArrow::new(generator).with_batch_size(BATCH_ROWS).collect::<Result<Vec<_>, _>>()?)
    }
}

/// Arrow value bytes of a batch: fixed widths plus string bytes (no offsets, views, bitmaps).
pub fn payload_bytes(batch: &RecordBatch) -> u64 {
    let n = batch.num_rows() as u64;
    batch
        .columns()
        .iter()
        .map(|c| match Strs::of(c.as_ref()) {
            Some(s) => (0..c.len()).map(|i| s.value(i).len() as u64).sum(),
            None => c.data_type().primitive_width().map_or(0, |w| w as u64 * n),
        })
        .sum()
}

/// `count(*)` and `sum(l_quantity)` (unscaled) via a projected scan.
fn count_sum(table: &Table) -> Result<(u64, i128)> {
    let (mut n, mut sum) = (0u64, 0i128);
    for b in table.scan(ScanOptions::default().projection(["l_quantity"]))? {
        let b = b?;
        n += b.num_rows() as u64;
        let q = decimal(b.column(0).as_ref(), "l_quantity")?;
        sum += q.values().iter().copied().sum::<i128>();
    }
    Ok((n, sum))
}

/// The Q1-style aggregate: group by (`l_returnflag`, `l_linestatus`) over projected columns,
/// sorted by the group.
///
/// Rows are grouped by a 64-bit code of each string when both are at most 4 bytes (length in
/// the low byte, the bytes above: distinct strings, distinct codes), read straight from a
/// `Utf8View` column's inline view, and the pair of codes finds its group in a direct-mapped
/// table of 64 slots (a multiplicative hash; a pair whose slot holds another pair is looked up
/// in the list of coded pairs). Longer strings fall back to comparing the strings. The sums go
/// into per-group accumulators indexed by the group, without a branch on the group: TPC-H's
/// groups change every few rows (an order's lines have random dates), so the previous "same
/// group as the last row" test mispredicted often. A row whose two values are each one byte
/// long in `Utf8View` columns (TPC-H's flags) finds its group in a dense table of 65,536
/// entries indexed by the two bytes instead, with no hash and no compare. History: comparing every row's strings with every group's took
/// 7 of Q1's 15 ms at SF 0.1; the last-row test and a search took 4–6 ms of 11–19
/// (docs/performance.md, fourteenth pass); the dense table takes the aggregation from 3.5 to
/// 2.2 ms (twentieth pass).
pub fn q1(batches: impl IntoIterator<Item = Result<RecordBatch>>) -> Result<Vec<Q1Group>> {
    const SLOTS: usize = 64;
    const LANES: usize = 4;
    const NO_GROUP: u32 = u32::MAX;
    // No short code is all ones (its low 32 bits are a length of at most 4): an empty slot.
    const EMPTY: (u64, u64) = (u64::MAX, u64::MAX);
    let slot_of = |f: u64, s: u64| ((f.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ s).wrapping_mul(0xFF51_AFD7_ED55_8CCD) >> 58) as usize;
    let mut groups: Vec<Q1Group> = Vec::new();
    // Per group and lane (row number mod 4): sum(l_quantity), sum(l_extendedprice),
    // sum(l_discount) and count(*). Consecutive rows of a group add into different lanes, so
    // an add does not wait for the previous row's store to the same accumulator (that
    // read-modify-write chain was 40% of the aggregation's cycles in `perf annotate`).
    let mut acc: Vec<[([i128; 3], u64); LANES]> = Vec::new();
    let mut slots = [(EMPTY, 0usize); SLOTS];
    // (flag code, status code) of each group with short strings, and the group's index.
    let mut coded: Vec<((u64, u64), usize)> = Vec::new();
    // The group of each pair of one-byte values (flag byte << 8 | status byte), `NO_GROUP`
    // until the pair is first seen. 256 KiB, allocated once per call. A one-byte string is
    // ASCII, so no byte pair of two distinct pairs of strings is the same.
    let mut dense = vec![NO_GROUP; 1 << 16];
    let find = |groups: &mut Vec<Q1Group>, acc: &mut Vec<[([i128; 3], u64); LANES]>, f: &str, s: &str| {
        groups.iter().position(|g| g.returnflag == f && g.linestatus == s).unwrap_or_else(|| {
            groups.push(Q1Group { returnflag: f.to_owned(), linestatus: s.to_owned(), sum_qty: 0, sum_price: 0, sum_disc: 0, count: 0 });
            acc.push([([0; 3], 0); LANES]);
            groups.len() - 1
        })
    };
    for b in batches {
        let b = b?;
        let col = |name: &str| b.column_by_name(name).with_context(|| format!("scan returned no column {name}"));
        let string = |name: &str| -> Result<Strs<'_>> {
            let a = col(name)?;
            Strs::of(a.as_ref()).with_context(|| format!("column {name} is {}, expected a string type", a.data_type()))
        };
        let (flag, status) = (string("l_returnflag")?, string("l_linestatus")?);
        let qty = decimal(col("l_quantity")?.as_ref(), "l_quantity")?;
        let price = decimal(col("l_extendedprice")?.as_ref(), "l_extendedprice")?;
        let disc = decimal(col("l_discount")?.as_ref(), "l_discount")?;
        let (qty, price, disc) = (qty.values(), price.values(), disc.values());
        // The group of row `i` through the slots (any strings).
        let mut slot_group = |groups: &mut Vec<Q1Group>, acc: &mut Vec<[([i128; 3], u64); LANES]>, i: usize| match (flag.short_code(i), status.short_code(i)) {
            (Some(f), Some(s)) => {
                let slot = &mut slots[slot_of(f, s)];
                if slot.0 == (f, s) {
                    slot.1
                } else {
                    let g = if let Some(&(_, g)) = coded.iter().find(|c| c.0 == (f, s)) {
                        g
                    } else {
                        let g = find(groups, acc, flag.value(i), status.value(i));
                        coded.push(((f, s), g));
                        g
                    };
                    if slot.0 == EMPTY {
                        *slot = ((f, s), g);
                    }
                    g
                }
            }
            _ => find(groups, acc, flag.value(i), status.value(i)),
        };
        let add = |acc: &mut Vec<[([i128; 3], u64); LANES]>, g: usize, i: usize| {
            let (sums, count) = &mut acc[g][i % LANES];
            sums[0] += qty[i];
            sums[1] += price[i];
            sums[2] += disc[i];
            *count += 1;
        };
        if let (Strs::View(f), Strs::View(s)) = (flag, status) {
            for (i, (&fv, &sv)) in f.views().iter().zip(s.views().iter()).enumerate() {
                let g = if (fv as u32 ^ 1) | (sv as u32 ^ 1) == 0 {
                    // Both values one byte long (TPC-H's flags): the pair of bytes indexes the
                    // dense table, with no hash and no compare (Q1's aggregation in 2.2 ms
                    // against 3.5 ms through the slots at SF 0.1, twentieth pass).
                    let pair = usize::from((fv >> 32) as u8) << 8 | usize::from((sv >> 32) as u8);
                    if dense[pair] == NO_GROUP {
                        dense[pair] = u32::try_from(find(&mut groups, &mut acc, f.value(i), s.value(i))).context("more than 2^32 groups")?;
                    }
                    dense[pair] as usize
                } else {
                    slot_group(&mut groups, &mut acc, i)
                };
                add(&mut acc, g, i);
            }
        } else {
            for i in 0..b.num_rows() {
                let g = slot_group(&mut groups, &mut acc, i);
                add(&mut acc, g, i);
            }
        }
    }
    for (g, lanes) in groups.iter_mut().zip(acc) {
        for ([qty, price, disc], count) in lanes {
            (g.sum_qty, g.sum_price, g.sum_disc, g.count) = (g.sum_qty + qty, g.sum_price + price, g.sum_disc + disc, g.count + count);
        }
    }
    groups.sort_by(|a, b| (&a.returnflag, &a.linestatus).cmp(&(&b.returnflag, &b.linestatus)));
    Ok(groups)
}

/// [`q1`] over `threads` partitions of one snapshot of `table` (`Table::scan_partitions`),
/// each aggregated on its own thread; the groups' sums and counts then added up.
///
/// # Errors
/// A scan's error, or a thread that panicked.
pub fn q1_partitioned(table: &gritdb::Table, threads: usize) -> Result<Vec<Q1Group>> {
    let scans = table.scan_partitions(ScanOptions::default().projection(Q1_COLUMNS), threads)?;
    let parts: Vec<Vec<Q1Group>> = std::thread::scope(|s| {
        let handles: Vec<_> = scans.into_iter().map(|scan| s.spawn(move || q1(scan.map(|b| b.map_err(anyhow::Error::from))))).collect();
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("a Q1 thread panicked"))?).collect::<Result<_>>()
    })?;
    let mut out: Vec<Q1Group> = Vec::new();
    for g in parts.into_iter().flatten() {
        match out.iter_mut().find(|o| (&o.returnflag, &o.linestatus) == (&g.returnflag, &g.linestatus)) {
            Some(o) => {
                (o.sum_qty, o.sum_price, o.sum_disc, o.count) = (o.sum_qty + g.sum_qty, o.sum_price + g.sum_price, o.sum_disc + g.sum_disc, o.count + g.count);
            }
            None => out.push(g),
        }
    }
    out.sort_by(|a, b| (&a.returnflag, &a.linestatus).cmp(&(&b.returnflag, &b.linestatus)));
    Ok(out)
}

const Q1_COLUMNS: [&str; 5] = ["l_returnflag", "l_linestatus", "l_quantity", "l_extendedprice", "l_discount"];

fn allocated() -> usize {
    ProcessView::read().allocator.allocated
}

fn fresh_dir(args: &BenchArgs) -> Result<(PathBuf, bool)> {
    if let Some(d) = &args.data_dir {
        if d.exists() && std::fs::read_dir(d)?.next().is_some() {
            bail!("--data-dir {} is not empty; give an empty or absent directory", d.display());
        }
        std::fs::create_dir_all(d)?;
        Ok((d.clone(), false))
    } else {
        let d = std::env::temp_dir().join(format!("gritdb-bench-{}", std::process::id()));
        std::fs::create_dir_all(&d)?;
        Ok((d, true))
    }
}

/// Runs the bench `--runs` times on the same input, prints the table and the JSON line of the
/// aggregate ([`summarize`]); `Ok(false)` when an answer is wrong in any run.
pub fn run_cli(args: &BenchArgs) -> Result<bool> {
    ensure!(args.runs >= 1, "--runs must be at least 1");
    if let Some(script) = &args.duckdb {
        ensure!(
            script.is_file(),
            "--duckdb {}: no such file (the peer script is shared/peers/duckdb_ingest.py of the workspace around the repository, /work/shared/peers/duckdb_ingest.py on the machine it was written on; a relative path is taken from the current directory)",
            script.display()
        );
    }
    let (dir, temporary) = fresh_dir(args)?;
    let result = run(args, &dir, temporary);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (r, q1_groups, ok) = result?;
    print_table(&r, &q1_groups);
    println!("{}", serde_json::to_string(&r)?);
    Ok(ok)
}

/// Loads the input once, then measures it `args.runs` times, each run in its own
/// subdirectory `run<i>` of `dir` (removed after the run when `dir` is temporary).
fn run(args: &BenchArgs, dir: &Path, temporary: bool) -> Result<(BenchResult, Vec<Q1Group>, bool)> {
    let batches = load(args)?;
    ensure!(!batches.is_empty(), "no input rows");
    eprintln!(
        "bench: {} rows in {} batches, {} run(s); data dir {}",
        batches.iter().map(RecordBatch::num_rows).sum::<usize>(),
        batches.len(),
        args.runs,
        dir.display()
    );
    let peer = args.duckdb.as_ref().map(|script| peer_input(args, &batches, dir).map(|input| (script, input))).transpose()?;
    let mut peer_runs = Vec::new();
    let (mut results, mut groups, mut ok) = (Vec::with_capacity(args.runs), Vec::new(), true);
    for i in 1..=args.runs {
        let run_dir = dir.join(format!("run{i}"));
        let measured = measure(args, &batches, &run_dir);
        if temporary {
            let _ = std::fs::remove_dir_all(&run_dir);
        }
        let (r, g, run_ok) = measured?;
        eprintln!(
            "bench: run {i}/{}: insert {:.2} upsert {:.2} delete {:.2} M rows/s, flush/raw write {:.2}, scan/raw read {:.2}, RSS above base {:.1} MiB, VmHWM {:.1} MiB",
            args.runs,
            r.insert_rows_per_s / 1e6,
            r.upsert_rows_per_s / 1e6,
            r.delete_rows_per_s / 1e6,
            r.flush_vs_raw_write,
            r.scan_vs_raw_read,
            r.rss_above_base_bytes as f64 / f64::from(1u32 << 20),
            r.vmhwm_bytes as f64 / f64::from(1u32 << 20)
        );
        if !r.insert_cpu_ns_per_row_by_thread.is_empty() {
            let threads: Vec<String> =
                r.insert_cpu_ns_per_row_by_thread.iter().filter(|&(_, &ns)| ns >= 0.5).map(|(name, ns)| format!("{name} {ns:.0}")).collect();
            eprintln!("bench: run {i}/{}: insert CPU ns/row by thread: {}", args.runs, threads.join(", "));
        }
        ok &= run_ok;
        groups = g;
        results.push(r);
        if let Some((script, input)) = &peer {
            let p = run_peer(script, input, dir)?;
            eprintln!("bench: run {i}/{}: DuckDB {}", args.runs, p);
            peer_runs.push(p);
        }
    }
    let mut r = summarize(&results)?;
    if !peer_runs.is_empty() {
        r.duckdb = Some(PeerFigures::median(&peer_runs, r.count, r.sum_quantity)?);
    }
    Ok((r, groups, ok))
}

/// Figures aggregated by their maximum over the runs (memory: the worst run counts); every
/// other number is the median over the runs, except [`FIRST_RUN`].
const WORST_OF_RUNS: [&str; 9] = [
    "rss_above_base_bytes",
    "allocations_per_row",
    "accounted_bytes_per_row",
    "accounted_bytes_per_row_default",
    "allocations_per_row_default",
    "allocated_bytes_per_row",
    "outside_engine_bytes",
    "wal_bytes_per_row",
    "naive_outside_engine_bytes",
];

/// Figures taken from the first run: `VmHWM` is the process's peak so far, and after run 1
/// it holds the earlier runs' phases 2–4 (the naive store's 400 MiB), which the peer's one-run
/// figure does not.
const FIRST_RUN: [&str; 1] = ["vmhwm_bytes"];

/// One result from several runs of the same input: each number is the median over the runs
/// (the mean of the two middle values for an even count), except the memory figures of
/// [`WORST_OF_RUNS`], which take the largest, and those of [`FIRST_RUN`]; `min` and `max` of
/// the rates, ratios and times in ms (Q1) go to [`BenchResult::spread`]. Integer fields stay integers (a median
/// is rounded).
///
/// # Errors
/// No runs, or runs that disagree on the input (`rows`) or the answers (`count`,
/// `sum_quantity`).
pub fn summarize(runs: &[BenchResult]) -> Result<BenchResult> {
    let first = runs.first().context("no bench runs")?;
    for r in runs {
        ensure!(
            (r.rows, r.count, r.sum_quantity.to_bits()) == (first.rows, first.count, first.sum_quantity.to_bits()),
            "bench runs disagree: rows/count/sum {}/{}/{} vs {}/{}/{}",
            r.rows,
            r.count,
            r.sum_quantity,
            first.rows,
            first.count,
            first.sum_quantity
        );
    }
    let values: Vec<serde_json::Map<String, serde_json::Value>> = runs
        .iter()
        .map(|r| match serde_json::to_value(r) {
            Ok(serde_json::Value::Object(m)) => Ok(m),
            other => Err(anyhow::anyhow!("bench result is not a JSON object: {other:?}")),
        })
        .collect::<Result<_>>()?;
    let mut out = values[0].clone();
    let mut spread = std::collections::BTreeMap::new();
    for (key, v0) in &values[0] {
        if !v0.is_number() || key == "runs" || FIRST_RUN.contains(&key.as_str()) {
            continue;
        }
        let mut xs: Vec<f64> = values.iter().filter_map(|m| m.get(key).and_then(serde_json::Value::as_f64)).collect();
        if xs.len() != values.len() {
            continue; // `None` in some run (no allocation counter, no SQL): keep the first run's.
        }
        xs.sort_by(f64::total_cmp);
        let n = xs.len();
        let pick = if WORST_OF_RUNS.contains(&key.as_str()) { xs[n - 1] } else { f64::midpoint(xs[(n - 1) / 2], xs[n / 2]) };
        if key.ends_with("_per_s") || key.contains("_vs_") || key.ends_with("_ms") {
            spread.insert(key.clone(), [xs[0], xs[n - 1]]);
        }
        let integer = values.iter().all(|m| m.get(key).is_some_and(|v| v.is_i64() || v.is_u64()));
        let number = if integer {
            if v0.is_u64() { serde_json::Value::from(pick.round() as u64) } else { serde_json::Value::from(pick.round() as i64) }
        } else {
            serde_json::Value::from(pick)
        };
        out.insert(key.clone(), number);
    }
    let mut r: BenchResult = serde_json::from_value(serde_json::Value::Object(out))?;
    r.runs = runs.len();
    r.spread = spread;
    Ok(r)
}

fn every(batches: &[RecordBatch], start: usize) -> impl Iterator<Item = &RecordBatch> {
    batches.iter().skip(start).step_by(10)
}

/// One run of the four phases on `batches`, in `dir` (created).
fn measure(args: &BenchArgs, batches: &[RecordBatch], dir: &Path) -> Result<(BenchResult, Vec<Q1Group>, bool)> {
    std::fs::create_dir_all(dir)?;
    let schema = batches[0].schema();
    let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
    let ups_rows: u64 = every(batches, 0).map(|b| b.num_rows() as u64).sum();
    let del_rows: u64 = every(batches, 5).map(|b| b.num_rows() as u64).sum();
    let del_keys: Vec<RecordBatch> = every(batches, 5).map(|b| b.project(&[0, 3])).collect::<Result<_, _>>()?;
    let payload: u64 = batches.iter().map(payload_bytes).sum();
    let mut r = BenchResult { engine: "gritdb".into(), rows, runs: 1, payload_bytes_per_row: payload as f64 / rows as f64, ..BenchResult::default() };

    // Phase 1: the peer workload at the engine's defaults.
    let base = ProcessView::read();
    let mut defaults = match args.flush_threads {
        Some(n) => EngineConfig::default().flush_threads(n),
        None => EngineConfig::default(),
    };
    if args.background_batch {
        defaults = defaults.background_priority(gritdb::BackgroundPriority::Batch(args.background_nice));
    }
    let mut config = defaults.clone();
    if let Some(limit) = args.memory_limit {
        config = config.memory_limit(limit as usize);
    }
    let engine = Engine::open(dir.join("engine"), config)?;
    r.memory_limit_bytes = engine.memory_report().limit as u64;
    r.background_batch = args.background_batch;
    r.background_nice = args.background_nice;
    let table = engine.create_table("lineitem", schema.clone(), &KEY)?;
    let used0 = engine.memory_report().used;
    let a0 = allocation_count();
    let clock = ThreadClock::read();
    let process = ProcessClock::read();
    let t = Instant::now();
    for b in batches {
        table.insert(b)?;
    }
    let wall = t.elapsed().as_secs_f64();
    r.insert_rows_per_s = rate(rows, wall);
    if let (Some(p0), Some(p1)) = (process, ProcessClock::read()) {
        let cpu_ns = p1.since(&p0) as f64;
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get) as f64;
        r.insert_process_cpu_ns_per_row = Some(cpu_ns / rows as f64);
        r.insert_cpu_ns_per_row_by_thread = p1.by_name_since(&p0).into_iter().map(|(name, ns)| (name, ns as f64 / rows as f64)).collect();
        r.insert_cores_busy = Some(cpu_ns / 1e9 / (wall * cores));
    }
    if let (Some(c0), Some(c1)) = (clock, ThreadClock::read()) {
        r.insert_cpu_rows_per_s = Some(rate(rows, (c1.cpu_ns - c0.cpu_ns) as f64 / 1e9));
        r.insert_faults_per_row = Some((c1.minor_faults - c0.minor_faults) as f64 / rows as f64);
    }
    r.allocations_per_row_default = a0.zip(allocation_count()).map(|(a, b)| (b - a) as f64 / rows as f64);
    r.accounted_bytes_per_row_default = (engine.memory_report().used as f64 - used0 as f64) / rows as f64;
    let t = Instant::now();
    for b in every(batches, 0) {
        table.upsert(b)?;
    }
    r.upsert_rows_per_s = rate(ups_rows, t.elapsed().as_secs_f64());
    let t = Instant::now();
    for k in &del_keys {
        table.delete(k)?;
    }
    r.delete_rows_per_s = rate(del_rows, t.elapsed().as_secs_f64());
    let t = Instant::now();
    r.durable_rows = table.flush()?;
    r.durable_s = t.elapsed().as_secs_f64();
    let (count, sum) = count_sum(&table)?;
    r.count = count;
    r.sum_quantity = sum as f64 / 100.0;
    let t = Instant::now();
    let groups = q1(table.scan(ScanOptions::default().projection(Q1_COLUMNS))?.map(|b| b.map_err(anyhow::Error::from)))?;
    r.q1_ms = t.elapsed().as_secs_f64() * 1000.0;
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let t = Instant::now();
    let parallel = q1_partitioned(&table, threads)?;
    r.q1_parallel_ms = t.elapsed().as_secs_f64() * 1000.0;
    r.q1_threads = threads as u64;
    ensure!(parallel == groups, "Q1 on {threads} threads differs from Q1 on one: {parallel:?} vs {groups:?}");
    r.sql_q1_ms = sql_q1_ms(&engine)?;
    let after = ProcessView::read();
    r.rss_above_base_bytes = after.rss as i64 - base.rss as i64;
    r.vmhwm_bytes = after.vmhwm as u64;
    let t = Instant::now();
    let mut scanned = 0u64;
    for b in table.scan(ScanOptions::default())? {
        scanned += b?.num_rows() as u64;
    }
    r.scan_rows_per_s = rate(scanned, t.elapsed().as_secs_f64());
    drop(table);
    engine.close()?;

    // Phase 2: nothing flushed during the inserts, then one flush of everything.
    let big = 1usize << 40;
    let engine = Engine::open(dir.join("measured"), defaults.clone().memory_limit(big).table_flush_bytes(big >> 1))?;
    let table = engine.create_table("lineitem", schema.clone(), &KEY)?;
    let (acc0, out0) = (table.stats()?.accounted_bytes, engine.memory_report().outside_engine as i64);
    let al0 = allocated();
    let a0 = allocation_count();
    let clock = ThreadClock::read();
    let process = ProcessClock::read();
    let t = Instant::now();
    for b in batches {
        table.insert(b)?;
    }
    r.insert_alone_rows_per_s = rate(rows, t.elapsed().as_secs_f64());
    if let (Some(p0), Some(p1)) = (process, ProcessClock::read()) {
        r.insert_alone_process_cpu_ns_per_row = Some(p1.since(&p0) as f64 / rows as f64);
    }
    if let (Some(c0), Some(c1)) = (clock, ThreadClock::read()) {
        r.insert_alone_cpu_rows_per_s = Some(rate(rows, (c1.cpu_ns - c0.cpu_ns) as f64 / 1e9));
    }
    r.allocations_per_row = a0.zip(allocation_count()).map(|(a, b)| (b - a) as f64 / rows as f64);
    r.allocated_bytes_per_row = (allocated() as f64 - al0 as f64) / rows as f64;
    let stats = table.stats()?;
    ensure!(stats.files == 0, "phase 2 flushed during the inserts ({} files)", stats.files);
    r.accounted_bytes_per_row = (stats.accounted_bytes - acc0) as f64 / rows as f64;
    r.outside_engine_bytes = engine.memory_report().outside_engine as i64 - out0;
    let wal_bytes = engine.wal_usage().1;
    r.wal_bytes_per_row = wal_bytes as f64 / rows as f64;
    let t = Instant::now();
    let flushed = table.flush()?;
    r.flush_rows_per_s = rate(flushed, t.elapsed().as_secs_f64());
    drop(table);
    engine.close()?;

    // Phase 2, relaxed: the same inserts without an fsync per call.
    let engine = Engine::open(dir.join("relaxed"), defaults.memory_limit(big).table_flush_bytes(big >> 1).wal_sync(WalSync::Relaxed))?;
    let table = engine.create_table("lineitem", schema.clone(), &KEY)?;
    let t = Instant::now();
    for b in batches {
        table.insert(b)?;
    }
    r.insert_relaxed_rows_per_s = rate(rows, t.elapsed().as_secs_f64());
    drop(table);
    drop(engine);

    // Phase 3: the physical limits on the same batches.
    let raw = dir.join("raw.parquet");
    let t = Instant::now();
    {
        let file = std::fs::File::create(&raw)?;
        // The engine's writer settings (its codec, its dictionary page limit), so flush/raw
        // compares the engine's work around the writer, not two writer configurations.
        let props = gritdb::data_file_properties(1 << 20).build();
        let mut w = ArrowWriter::try_new(file, schema.clone(), Some(props))?;
        for b in batches {
            w.write(b)?;
            // The engine's row-group cut (storage WriteOptions::row_group_bytes = 32 MiB).
            if w.memory_size() >= 32 << 20 {
                w.flush()?;
            }
        }
        w.into_inner()?.sync_all()?;
    }
    r.raw_write_rows_per_s = rate(rows, t.elapsed().as_secs_f64());
    let t = Instant::now();
    let mut read = 0u64;
    for b in ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(&raw)?)?.with_batch_size(BATCH_ROWS).build()? {
        read += b?.num_rows() as u64;
    }
    r.raw_read_rows_per_s = rate(read, t.elapsed().as_secs_f64());
    r.flush_vs_raw_write = r.flush_rows_per_s / r.raw_write_rows_per_s.max(f64::MIN_POSITIVE);
    r.scan_vs_raw_read = r.scan_rows_per_s / r.raw_read_rows_per_s.max(f64::MIN_POSITIVE);
    let record = vec![0x5au8; usize::try_from(wal_bytes).unwrap_or(usize::MAX) / batches.len().max(1)];
    let raw_wal = dir.join("raw.wal");
    let t = Instant::now();
    {
        let mut f = std::fs::File::create(&raw_wal)?;
        for _ in batches {
            std::io::Write::write_all(&mut f, &record)?;
            f.sync_all()?;
        }
    }
    r.raw_wal_rows_per_s = rate(rows, t.elapsed().as_secs_f64());
    std::fs::remove_file(&raw_wal)?;

    // Phase 4: the naive store.
    let mut naive = NaiveStore::new(&[0, 3]);
    let al0 = allocated();
    let a0 = allocation_count();
    let t = Instant::now();
    for b in batches {
        naive.insert(b)?;
    }
    r.naive_insert_rows_per_s = rate(rows, t.elapsed().as_secs_f64());
    r.naive_allocations_per_row = a0.zip(allocation_count()).map(|(a, b)| (b - a) as f64 / rows as f64);
    let grown = allocated() as i64 - al0 as i64;
    r.naive_bytes_per_row = grown as f64 / rows as f64;
    r.naive_outside_engine_bytes = grown;
    let t = Instant::now();
    for b in every(batches, 0) {
        naive.upsert(b)?;
    }
    r.naive_upsert_rows_per_s = rate(ups_rows, t.elapsed().as_secs_f64());
    let t = Instant::now();
    for k in &del_keys {
        naive.delete(k)?;
    }
    r.naive_delete_rows_per_s = rate(del_rows, t.elapsed().as_secs_f64());
    let naive_sum = naive.sum_decimal(4);

    let mut ok = true;
    if (naive.len() as u64, naive_sum) != (count, sum) {
        eprintln!("bench: FAIL engine count/sum {count}/{sum} != naive store {}/{naive_sum}", naive.len());
        ok = false;
    }
    if rows == SF01_ROWS as u64 && (count, sum) != (SF01_COUNT, SF01_SUM_QUANTITY * 100) {
        eprintln!("bench: FAIL at SF 0.1 expected count {SF01_COUNT}, sum(l_quantity) {SF01_SUM_QUANTITY}; got {count}, {}", sum as f64 / 100.0);
        ok = false;
    }
    if scanned != count {
        eprintln!("bench: FAIL full scan returned {scanned} rows, count(*) {count}");
        ok = false;
    }
    Ok((r, groups, ok))
}

/// TPC-H Q1 through SQL in ms: the second of two runs (the first builds the SQL session).
#[cfg(feature = "sql")]
fn sql_q1_ms(engine: &Engine) -> Result<Option<f64>> {
    crate::sql::run_q1(engine)?;
    let (rows, took) = crate::sql::run_q1(engine)?;
    ensure!(!rows.is_empty(), "SQL Q1 returned no groups");
    Ok(Some(took.as_secs_f64() * 1000.0))
}

/// Without the `sql` feature there is no SQL Q1.
#[cfg(not(feature = "sql"))]
#[allow(clippy::unnecessary_wraps)] // the same signature as with the feature
fn sql_q1_ms(_engine: &Engine) -> Result<Option<f64>> {
    Ok(None)
}

fn mrows(v: f64) -> String {
    format!("{:.3} M rows/s", v / 1e6)
}

fn print_table(r: &BenchResult, groups: &[Q1Group]) {
    let (d, peer_label, peer_note) = match &r.duckdb {
        Some(p) => (
            Duck { insert: p.insert_rows_per_s, upsert: p.upsert_rows_per_s, delete: p.delete_rows_per_s, durable_s: p.durable_s, q1_ms: p.q1_ms },
            "DuckDB (here)",
            format!("{} measured by the peer script in this run, median of {}, one after each of gritdb's", p.engine, p.runs),
        ),
        None => (
            DUCKDB,
            "DuckDB 2.0.1*",
            "* DuckDB's figures were recorded on this machine with the peer script, not measured by this command (--duckdb SCRIPT measures them)".to_owned(),
        ),
    };
    let mib = |b: f64| b / f64::from(1u32 << 20);
    println!(
        "gritdb-soak bench: {} rows, memory limit {:.0} MiB, background flushes {}; median of {} run(s), [min-max] beside",
        r.rows,
        mib(r.memory_limit_bytes as f64),
        if r.background_batch { format!("SCHED_BATCH at nice {} (--background-batch)", r.background_nice) } else { "as the engine's default".to_owned() },
        r.runs
    );
    let range = |key: &str, scale: f64| r.spread.get(key).map_or_else(String::new, |[lo, hi]| format!("  [{:.2}-{:.2}]", lo / scale, hi / scale));
    println!("{:<26} {:>20} {:>16} {:>10}", "phase", "gritdb", peer_label, "ratio");
    for (name, key, ours, theirs) in [
        ("insert", "insert_rows_per_s", r.insert_rows_per_s, d.insert),
        ("upsert 10%", "upsert_rows_per_s", r.upsert_rows_per_s, d.upsert),
        ("delete 10%", "delete_rows_per_s", r.delete_rows_per_s, d.delete),
        ("insert, no flush beside", "insert_alone_rows_per_s", r.insert_alone_rows_per_s, d.insert),
        ("insert, WAL relaxed", "insert_relaxed_rows_per_s", r.insert_relaxed_rows_per_s, d.insert),
    ] {
        println!("{name:<26} {:>20} {:>16} {:>9.2}x{}", mrows(ours), mrows(theirs), ours / theirs, range(key, 1e6));
    }
    if let (Some(cpu), Some(alone)) = (r.insert_cpu_rows_per_s, r.insert_alone_cpu_rows_per_s) {
        // Not compared with DuckDB: the foreground thread's CPU time only (see the JSON keys).
        println!(
            "{:<26} {:>20}{}  (alone {}{}; {:.3} page faults/row)",
            "insert per CPU-second",
            mrows(cpu),
            range("insert_cpu_rows_per_s", 1e6),
            mrows(alone),
            range("insert_alone_cpu_rows_per_s", 1e6),
            r.insert_faults_per_row.unwrap_or(f64::NAN)
        );
    }
    if let (Some(ns), Some(busy), Some(alone)) = (r.insert_process_cpu_ns_per_row, r.insert_cores_busy, r.insert_alone_process_cpu_ns_per_row) {
        // The machine's ceiling for phase 1: at most `cores` CPU-seconds a second, so a rate of
        // 10× the peer's needs at most cores / (10 × peer rate) of CPU a row, on all threads.
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get) as f64;
        println!(
            "{:<26} {:>15.0} ns/row  (alone {alone:.0}; cores busy {:.0}% of the insert's wall time; 10x the peer's insert on {cores} cores needs <= {:.0} ns/row)",
            "insert CPU, all threads",
            ns,
            busy * 100.0,
            cores * 1e9 / (10.0 * d.insert)
        );
    }
    println!("{:<26} {:>18.3} s {:>14.2} s {:>9.2}x", "durable (flush)", r.durable_s, d.durable_s, d.durable_s / r.durable_s);
    println!("{:<26} {:>17.1} ms {:>13.1} ms {:>9.2}x{}", "Q1", r.q1_ms, d.q1_ms, d.q1_ms / r.q1_ms, range("q1_ms", 1.0));
    println!("{:<26} {:>17.1} ms   (gritdb on {} threads, scan_partitions; not the peer comparison)", "Q1, partitioned", r.q1_parallel_ms, r.q1_threads);
    if let Some(ms) = r.sql_q1_ms {
        println!("{:<26} {:>17.1} ms {:>13.0} ms {:>9.2}x", "Q1 through SQL (TPC-H)", ms, d.q1_ms, d.q1_ms / ms);
    }
    println!("(ratio > 1: gritdb faster; {peer_note})");
    println!("count {} sum(l_quantity) {}", r.count, r.sum_quantity);
    for g in groups {
        println!(
            "  Q1 {} {}: sum_qty {} sum_price {} avg_disc {:.4} count {}",
            g.returnflag,
            g.linestatus,
            g.sum_qty as f64 / 100.0,
            g.sum_price as f64 / 100.0,
            g.sum_disc as f64 / 100.0 / g.count.max(1) as f64,
            g.count
        );
    }
    println!("RSS above base {:.1} MiB; VmHWM {:.1} MiB", mib(r.rss_above_base_bytes as f64), mib(r.vmhwm_bytes as f64));
    println!("{:<26} {:>20} {:>20} {:>9}", "physical limit", "raw", "gritdb", "ratio");
    println!(
        "{:<26} {:>20} {:>20} {:>9.2}{}",
        format!("write ({:?}) vs flush", gritdb::DATA_FILE_COMPRESSION),
        mrows(r.raw_write_rows_per_s),
        mrows(r.flush_rows_per_s),
        r.flush_vs_raw_write,
        range("flush_vs_raw_write", 1.0)
    );
    println!(
        "{:<26} {:>20} {:>20} {:>9.2}{}",
        "read vs full scan",
        mrows(r.raw_read_rows_per_s),
        mrows(r.scan_rows_per_s),
        r.scan_vs_raw_read,
        range("scan_vs_raw_read", 1.0)
    );
    println!(
        "{:<26} {:>20} {:>20} {:>9.2}   ({:.1} WAL bytes/row)",
        "write+fsync vs insert",
        mrows(r.raw_wal_rows_per_s),
        mrows(r.insert_rows_per_s),
        r.insert_rows_per_s / r.raw_wal_rows_per_s,
        r.wal_bytes_per_row
    );
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}"));
    println!("{:<26} {:>20} {:>20}", "memory per row", "gritdb", "naive store");
    println!("{:<26} {:>20} {:>20}", "allocations / row", opt(r.allocations_per_row), opt(r.naive_allocations_per_row));
    println!("{:<26} {:>20.1} {:>20}", "accounted bytes / row", r.accounted_bytes_per_row, "0 (none)");
    println!("{:<26} {:>20.1} {:>20.1}", "allocated bytes / row", r.allocated_bytes_per_row, r.naive_bytes_per_row);
    println!("{:<26} {:>20.1} {:>20.1}", "outside-engine MiB", mib(r.outside_engine_bytes as f64), mib(r.naive_outside_engine_bytes as f64));
    println!("{:<26} {:>20.1} {:>20.1}", "payload bytes / row", r.payload_bytes_per_row, r.payload_bytes_per_row);
    println!(
        "{:<26} {:>20} {:>20}",
        "insert / upsert / delete",
        format!("{:.2}/{:.2}/{:.2} M", r.insert_rows_per_s / 1e6, r.upsert_rows_per_s / 1e6, r.delete_rows_per_s / 1e6),
        format!("{:.2}/{:.2}/{:.2} M", r.naive_insert_rows_per_s / 1e6, r.naive_upsert_rows_per_s / 1e6, r.naive_delete_rows_per_s / 1e6)
    );
    println!("(memory per row: phase 2, every row still in the delta; outside-engine can read negative when the allocator gave memory back)");
    println!(
        "default flush threshold (phase 1): accounted {:.1} B/row after inserts (sealed deltas and flush batches in flight included), {} allocations/row; the durable step's table.flush() wrote {} rows itself (background flushes wrote the rest; its time is mostly the wait for the flush in progress)",
        r.accounted_bytes_per_row_default,
        opt(r.allocations_per_row_default),
        r.durable_rows
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_line_has_the_peer_keys_and_ours() {
        let v: serde_json::Value = serde_json::from_str(&serde_json::to_string(&BenchResult::default()).unwrap()).unwrap();
        let o = v.as_object().unwrap();
        for k in [
            "engine",
            "rows",
            "insert_rows_per_s",
            "upsert_rows_per_s",
            "delete_rows_per_s",
            "durable_s",
            "count",
            "sum_quantity",
            "q1_ms",
            "rss_above_base_bytes",
            "vmhwm_bytes",
            "raw_write_rows_per_s",
            "flush_rows_per_s",
            "raw_read_rows_per_s",
            "scan_rows_per_s",
            "allocations_per_row",
            "accounted_bytes_per_row",
            "sql_q1_ms",
            "flush_vs_raw_write",
            "scan_vs_raw_read",
            "runs",
            "spread",
            "wal_bytes_per_row",
            "raw_wal_rows_per_s",
            "insert_alone_rows_per_s",
        ] {
            assert!(o.contains_key(k), "missing {k}");
        }
    }

    fn run_result(insert: f64, vmhwm: u64, rss: i64, alloc: Option<f64>) -> BenchResult {
        BenchResult {
            engine: "gritdb".into(),
            rows: 600_572,
            count: 543_228,
            sum_quantity: 13_875_088.0,
            insert_rows_per_s: insert,
            scan_vs_raw_read: insert / 2e6,
            q1_ms: insert / 1e5,
            vmhwm_bytes: vmhwm,
            rss_above_base_bytes: rss,
            allocations_per_row: alloc,
            runs: 1,
            ..BenchResult::default()
        }
    }

    /// `minflt` is counted after the thread name's last `)`, whatever the name holds; a
    /// truncated file gives `None`; on Linux the clock moves with work done.
    #[test]
    fn thread_clock_parses_proc_and_counts_this_threads_work() {
        let stat = "4242 (a) (b c) R 1 4242 4242 0 -1 4194304 1234 0 7 0 55 3 0 0 20 0 1 0 99";
        assert_eq!(ThreadClock::parse("987654321 1000 20\n", stat), Some(ThreadClock { cpu_ns: 987_654_321, minor_faults: 1234 }));
        assert_eq!(ThreadClock::parse("987654321 1000 20\n", "4242 (x) R 1 2"), None);
        assert_eq!(ThreadClock::parse("", stat), None);
        if let Some(c0) = ThreadClock::read() {
            let mut pages = vec![0u8; 8 << 20];
            let mut acc = 0u64;
            for i in (0..pages.len()).step_by(4096) {
                pages[i] = 1;
                acc = acc.wrapping_add(u64::from(std::hint::black_box(pages[i])));
            }
            assert_eq!(acc, 2048);
            // The kernel updates a running thread's CPU time at scheduler ticks: work until it
            // moves (at most 10 s, on a loaded machine).
            let began = std::time::Instant::now();
            let mut c1 = ThreadClock::read().unwrap();
            while c1.cpu_ns == c0.cpu_ns && began.elapsed() < std::time::Duration::from_secs(10) {
                acc = (0..100_000u64).fold(acc, |a, x| std::hint::black_box(a.wrapping_mul(31).wrapping_add(x)));
                c1 = ThreadClock::read().unwrap();
            }
            assert!(c1.cpu_ns > c0.cpu_ns, "{c0:?} -> {c1:?} ({acc})");
            assert!(c1.minor_faults >= c0.minor_faults, "{c0:?} -> {c1:?}");
        }
    }

    /// Each thread's growth is summed by name, a thread born between two reads counts from 0, one that
    /// went away is left out, and unparsable texts are skipped; on Linux a spawned thread's
    /// work shows in the sum.
    #[test]
    fn process_clock_sums_every_threads_growth() {
        let t = |rows: &[(u64, &str, &str)]| ProcessClock::parse(rows.iter().map(|&(tid, name, s)| (tid, 7, name.to_owned(), s.to_owned())));
        let before = t(&[(1, "main\n", "1000 5 5\n"), (2, "gritdb-wal\n", "500 1 1\n"), (3, "gritdb-wal\n", "70 1 1\n"), (4, "x", "garbage")]);
        assert_eq!(before.threads.len(), 3);
        let after = t(&[(1, "main\n", "1600 5 5\n"), (2, "gritdb-wal\n", "530 1 1\n"), (5, "gritdb-wal\n", "40 1 1\n"), (6, "gritdb-writer", "9 1 1")]);
        let by_name = after.by_name_since(&before);
        assert_eq!(by_name.get("main"), Some(&600));
        assert_eq!(by_name.get("gritdb-wal"), Some(&(30 + 40)), "thread 3 went away, thread 5 was born");
        assert_eq!(by_name.get("gritdb-writer"), Some(&9));
        assert_eq!(after.since(&before), 600 + 70 + 9);
        // Thread id 2 reused by a thread started later (the CI run's kernel wraps ids at
        // 32,768): its 40 ns count from 0, not as 500 -> 40 (which read as 0 and failed the
        // spawned-thread check below once in CI).
        let reused = ProcessClock::parse([(2, 9, "gritdb-wal".to_owned(), "40 1 1".to_owned())]);
        assert_eq!(reused.since(&before), 40);
        let stat = "4242 (gritdb wal) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 123456 20 21";
        assert_eq!(start_ticks(stat), Some(123_456), "field 22, after a name with a space");
        if let Some(p0) = ProcessClock::read() {
            let (worked, wait) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
            let (worked_tx, release_rx) = (worked.0, wait.1);
            let spun = std::thread::spawn(move || {
                let c0 = ThreadClock::read().map_or(0, |c| c.cpu_ns);
                let began = std::time::Instant::now();
                let mut acc = 0u64;
                let mut spent = 0;
                // Work until the kernel's clock of this thread moves (at most 10 s).
                while spent == 0 && began.elapsed() < std::time::Duration::from_secs(10) {
                    acc = (0..100_000u64).fold(acc, |a, x| std::hint::black_box(a.wrapping_mul(31).wrapping_add(x)));
                    spent = ThreadClock::read().map_or(0, |c| c.cpu_ns) - c0;
                }
                worked_tx.send(spent).unwrap();
                release_rx.recv().unwrap(); // stay alive until read
                acc
            });
            let spent = worked.1.recv().unwrap();
            let p1 = ProcessClock::read().unwrap();
            wait.0.send(()).unwrap();
            spun.join().unwrap();
            assert!(spent > 0);
            assert!(p1.since(&p0) >= spent, "{} < {spent}", p1.since(&p0));
        }
    }

    #[test]
    #[allow(clippy::float_cmp)] // the medians picked are input values (or an exact midpoint)
    fn summarize_takes_medians_worst_memory_and_the_first_peak() {
        let runs = [run_result(2.0e6, 700, -5, Some(0.03)), run_result(1.5e6, 1_000, 90, Some(0.05)), run_result(2.6e6, 1_200, 40, Some(0.04))];
        let r = summarize(&runs).unwrap();
        assert_eq!(r.runs, 3);
        assert_eq!(r.insert_rows_per_s, 2.0e6, "median of 1.5, 2.0, 2.6 M");
        assert_eq!(r.scan_vs_raw_read, 1.0);
        assert_eq!(r.spread["insert_rows_per_s"], [1.5e6, 2.6e6]);
        assert_eq!(r.spread["scan_vs_raw_read"], [0.75, 1.3]);
        assert_eq!((r.q1_ms, r.spread["q1_ms"]), (20.0, [15.0, 26.0]), "times: the median, with their range");
        assert_eq!(r.rss_above_base_bytes, 90, "memory: the worst run");
        assert_eq!(r.allocations_per_row, Some(0.05));
        assert_eq!(r.vmhwm_bytes, 700, "the peak after run 1, not the process's later peak");
        assert_eq!((r.rows, r.count, r.sum_quantity), (600_572, 543_228, 13_875_088.0));
        assert!(!r.spread.contains_key("rows") && !r.spread.contains_key("vmhwm_bytes"));

        // An even count: the mean of the two middle values; integers stay integers.
        let r = summarize(&runs[..2]).unwrap();
        assert_eq!(r.insert_rows_per_s, 1.75e6);
        assert_eq!(r.rss_above_base_bytes, 90);
        // One run: itself, with a spread of one value.
        let r = summarize(&runs[1..2]).unwrap();
        assert_eq!((r.insert_rows_per_s, r.vmhwm_bytes, r.runs), (1.5e6, 1_000, 1));
    }

    #[test]
    #[allow(clippy::float_cmp)] // the medians picked are input values (or an exact midpoint)
    fn summarize_refuses_no_runs_and_runs_with_other_answers() {
        assert!(summarize(&[]).is_err());
        let mut other = run_result(2.0e6, 700, 0, None);
        other.count = 543_227;
        let err = summarize(&[run_result(2.0e6, 700, 0, None), other]).unwrap_err().to_string();
        assert!(err.contains("disagree") && err.contains("543227"), "{err}");
        // A figure missing in some run (no allocation counter there) keeps the first run's.
        let r = summarize(&[run_result(2.0e6, 700, 0, None), run_result(2.2e6, 700, 0, Some(0.1))]).unwrap();
        assert_eq!(r.allocations_per_row, None);
    }

    #[test]
    fn zero_runs_and_a_missing_peer_script_are_refused_before_anything_is_created() {
        let dir = std::env::temp_dir().join(format!("gritdb-bench-zero-runs-{}", std::process::id()));
        let args = BenchArgs {
            parquet: None,
            scale: 0.1,
            data_dir: Some(dir.clone()),
            memory_limit: None,
            flush_threads: None,
            background_batch: false,
            background_nice: 0,
            runs: 0,
            duckdb: None,
        };
        let err = run_cli(&args).unwrap_err().to_string();
        assert!(err.contains("--runs must be at least 1"), "{err}");
        assert!(!dir.exists(), "the data dir was created");
        let missing = dir.join("no-such-script.py");
        let err = run_cli(&BenchArgs { runs: 1, duckdb: Some(missing), ..args }).unwrap_err().to_string();
        assert!(err.contains("no-such-script.py: no such file"), "{err}");
        assert!(!dir.exists(), "the data dir was created");
    }

    #[test]
    fn q1_groups_and_payload_of_generated_rows() {
        // One part of the soak's generator (small text pool): a few hundred rows.
        let parts = crate::data::lineitems(0.01, 0, 0).unwrap();
        let b = arrow::compute::concat_batches(&parts[0].schema(), &parts).unwrap();
        let n = b.num_rows() as u64;
        let cols: Vec<usize> = Q1_COLUMNS.iter().map(|c| b.schema().index_of(c).unwrap()).collect();
        let groups = q1([Ok(b.project(&cols).unwrap())]).unwrap();
        assert_eq!(groups.iter().map(|g| g.count).sum::<u64>(), n);
        assert!(groups.windows(2).all(|w| (&w[0].returnflag, &w[0].linestatus) < (&w[1].returnflag, &w[1].linestatus)));
        let qty = decimal(b.column(4).as_ref(), "l_quantity").unwrap();
        assert_eq!(groups.iter().map(|g| g.sum_qty).sum::<i128>(), qty.values().iter().sum::<i128>());
        // 3 x Int64 + Int32 + 4 x Decimal128 + 3 x Date32 = 100 fixed bytes, plus strings.
        assert!(payload_bytes(&b) > 100 * n);
    }

    /// A Q1 input batch of `rows` rows: flags cycling through `flags`, statuses through
    /// `statuses` every two rows, as `Utf8View` (`view`) or `Utf8` columns; quantity `i + salt`,
    /// price `7i + salt`, discount `3i + salt` (unscaled `Decimal128(15, 2)`).
    fn q1_batch(view: bool, flags: &[&str], statuses: &[&str], rows: usize, salt: i128) -> RecordBatch {
        use arrow::array::{ArrayRef, Decimal128Array, StringArray, StringViewArray};
        use arrow::datatypes::{Field, Schema};
        use std::sync::Arc;
        let f: Vec<&str> = (0..rows).map(|i| flags[i % flags.len()]).collect();
        let s: Vec<&str> = (0..rows).map(|i| statuses[(i / 2) % statuses.len()]).collect();
        let str_col = |v: &[&str]| -> ArrayRef {
            if view { Arc::new(StringViewArray::from_iter_values(v.iter().copied())) } else { Arc::new(StringArray::from_iter_values(v.iter().copied())) }
        };
        let dec = |m: i128| -> ArrayRef {
            Arc::new(Decimal128Array::from_iter_values((0..rows as i128).map(|i| i * m + salt)).with_precision_and_scale(15, 2).unwrap())
        };
        let t = if view { DataType::Utf8View } else { DataType::Utf8 };
        let schema = Arc::new(Schema::new(vec![
            Field::new("l_returnflag", t.clone(), false),
            Field::new("l_linestatus", t, false),
            Field::new("l_quantity", DataType::Decimal128(15, 2), false),
            Field::new("l_extendedprice", DataType::Decimal128(15, 2), false),
            Field::new("l_discount", DataType::Decimal128(15, 2), false),
        ]));
        RecordBatch::try_new(schema, vec![str_col(&f), str_col(&s), dec(1), dec(7), dec(3)]).unwrap()
    }

    /// Q1's answer computed row by row, comparing the strings: (flag, status) → (sum qty, sum
    /// price, sum discount, count).
    fn q1_by_strings(input: &[RecordBatch]) -> std::collections::BTreeMap<(String, String), (i128, i128, i128, u64)> {
        let mut want: std::collections::BTreeMap<(String, String), (i128, i128, i128, u64)> = std::collections::BTreeMap::new();
        for batch in input {
            let (flag, status) = (Strs::of(batch.column(0).as_ref()).unwrap(), Strs::of(batch.column(1).as_ref()).unwrap());
            let dec = |c: usize| batch.column(c).as_primitive::<Decimal128Type>().clone();
            let (qty, price, disc) = (dec(2), dec(3), dec(4));
            for row in 0..batch.num_rows() {
                let sums = want.entry((flag.value(row).to_owned(), status.value(row).to_owned())).or_default();
                *sums = (sums.0 + qty.value(row), sums.1 + price.value(row), sums.2 + disc.value(row), sums.3 + 1);
            }
        }
        want
    }

    /// [`q1`]'s groups as the map [`q1_by_strings`] gives.
    fn q1_map(input: Vec<RecordBatch>) -> std::collections::BTreeMap<(String, String), (i128, i128, i128, u64)> {
        q1(input.into_iter().map(Ok)).unwrap().into_iter().map(|g| ((g.returnflag, g.linestatus), (g.sum_qty, g.sum_price, g.sum_disc, g.count))).collect()
    }

    /// The grouping by short-string codes gives the groups (and sums) that comparing the
    /// strings gives: `Utf8View` and `Utf8` columns, strings of 0–4 bytes (coded) and longer
    /// (compared), a 4-byte string and its 5-byte extension, across batches.
    #[test]
    fn q1_groups_by_short_codes_as_by_strings() {
        let (flags, statuses) = (["A", "R", "", "NNNN", "NNNNN", "A"], ["F", "O", "F", "F", "F", "O"]);
        let input = vec![q1_batch(true, &flags, &statuses, 1000, 0), q1_batch(false, &flags, &statuses, 777, 5), q1_batch(true, &flags, &statuses, 333, 9)];
        let want = q1_by_strings(&input);
        assert!(want.len() >= 8, "{} groups", want.len());
        assert_eq!(q1_map(input), want);
    }

    /// Rows whose flags are both one byte (the dense table) and rows that are not (empty and
    /// longer strings in the same batch, `Utf8` batches: through the slots) find the same
    /// groups: each pair's sums and count are those of its rows, whichever path saw it first.
    /// A sliced batch reads its own views only.
    #[test]
    fn q1_dense_pairs_and_slot_pairs_agree() {
        let one = ["A", "N", "R", "~"];
        let input = vec![
            q1_batch(true, &one, &["F", "O"], 5_000, 0),
            q1_batch(true, &["A", "", "NN"], &["F", "O"], 700, 3),
            q1_batch(false, &one, &["O", "F", "Z"], 900, 11),
            q1_batch(true, &["N", "A", "Q"], &["F", "Z"], 2_000, 5).slice(17, 1_500),
        ];
        let want = q1_by_strings(&input);
        assert_eq!(want.values().map(|v| v.3).sum::<u64>(), 5_000 + 700 + 900 + 1_500);
        assert!(want.len() >= 14, "{} groups", want.len());
        assert_eq!(q1_map(input), want);
    }

    /// More distinct short pairs (300) than the 64 slots of the group table: pairs whose slot
    /// holds another pair are found through the list, each group's sums and count exact, rows
    /// of one group spread over all four lanes.
    #[test]
    fn q1_groups_more_pairs_than_slots() {
        use arrow::array::{ArrayRef, Decimal128Array, StringViewArray};
        use arrow::datatypes::{Field, Schema};
        use std::sync::Arc;
        let rows = 9_000usize;
        let pair = |i: usize| (format!("f{}", i % 20), format!("s{}", (i / 20) % 15));
        let (f, s): (Vec<String>, Vec<String>) = (0..rows).map(pair).unzip();
        let dec =
            |m: i128| -> ArrayRef { Arc::new(Decimal128Array::from_iter_values((0..rows as i128).map(|i| i * m)).with_precision_and_scale(15, 2).unwrap()) };
        let schema = Arc::new(Schema::new(vec![
            Field::new("l_returnflag", DataType::Utf8View, false),
            Field::new("l_linestatus", DataType::Utf8View, false),
            Field::new("l_quantity", DataType::Decimal128(15, 2), false),
            Field::new("l_extendedprice", DataType::Decimal128(15, 2), false),
            Field::new("l_discount", DataType::Decimal128(15, 2), false),
        ]));
        let cols: Vec<ArrayRef> =
            vec![Arc::new(StringViewArray::from_iter_values(f.iter())), Arc::new(StringViewArray::from_iter_values(s.iter())), dec(1), dec(3), dec(5)];
        let b = RecordBatch::try_new(schema, cols).unwrap();
        let mut want: std::collections::BTreeMap<(String, String), (i128, u64)> = std::collections::BTreeMap::new();
        for i in 0..rows {
            let e = want.entry(pair(i)).or_default();
            *e = (e.0 + i as i128, e.1 + 1);
        }
        let got = q1([Ok(b.slice(0, 4_000)), Ok(b.slice(4_000, rows - 4_000))]).unwrap();
        assert_eq!(want.len(), 300, "distinct pairs");
        let got_map: std::collections::BTreeMap<_, _> = got.iter().map(|g| ((g.returnflag.clone(), g.linestatus.clone()), (g.sum_qty, g.count))).collect();
        assert_eq!(got_map, want);
        assert!(got.iter().all(|g| g.sum_price == 3 * g.sum_qty && g.sum_disc == 5 * g.sum_qty));
    }

    /// The peer's figures are the medians of its runs; a run whose count or sum differs from
    /// gritdb's is refused (the two engines must have done the same work).
    #[test]
    fn peer_figures_are_medians_of_runs_with_the_same_answers() {
        let run = |ins: f64, q1: f64, count: u64| {
            serde_json::json!({"engine": "duckdb 2.0.1", "insert_rows_per_s": ins, "upsert_rows_per_s": ins * 2.0,
                "delete_rows_per_s": ins / 2.0, "durable_s": 0.03, "q1_ms": q1, "count": count, "sum_quantity": 13_875_088.0})
        };
        let p = PeerFigures::median(&[run(3.0, 9.0, 5), run(1.0, 7.0, 5), run(2.0, 11.0, 5)], 5, 13_875_088.0).unwrap();
        assert_eq!((p.insert_rows_per_s, p.upsert_rows_per_s, p.delete_rows_per_s, p.q1_ms, p.runs), (2.0, 4.0, 1.0, 9.0, 3));
        assert_eq!(p.engine, "duckdb 2.0.1");
        let e = PeerFigures::median(&[run(3.0, 9.0, 5), run(1.0, 7.0, 6)], 5, 13_875_088.0).unwrap_err();
        assert!(e.to_string().contains("count 6"), "{e}");
        assert!(PeerFigures::median(&[], 5, 1.0).is_err());
    }
}
