//! Crash-consistency workload: a deterministic generator of keyed operations over several
//! tables, with its own model. A child process executes the operations and prints `ACK n`
//! after operation `n` returned; the parent kills it with SIGKILL at a random moment, reopens
//! the data directory and checks the result against the model: every acknowledged operation
//! present, nothing deleted back, no duplicate primary key, and the one operation that was in
//! flight either fully applied or not at all.

use arrow::array::{Array, ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use gritdb::{Engine, EngineConfig, ScanOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `(k1 Int64, k2 Int32, v Int64 nullable, s Utf8 nullable)` with primary key `(k1, k2)`.
pub fn composite_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k1", DataType::Int64, false),
        Field::new("k2", DataType::Int32, false),
        Field::new("v", DataType::Int64, true),
        Field::new("s", DataType::Utf8, true),
    ]))
}

/// A row of [`composite_schema`] without its key: `(v, s)`.
pub type Row = (Option<i64>, Option<String>);

/// Builds a batch of [`composite_schema`] from `((k1, k2), (v, s))` rows.
///
/// # Panics
/// Never for rows of this shape (the arrays match the schema by construction).
pub fn composite_batch(rows: &[((i64, i32), Row)]) -> RecordBatch {
    let k1: Int64Array = rows.iter().map(|r| Some(r.0.0)).collect();
    let k2: Int32Array = rows.iter().map(|r| Some(r.0.1)).collect();
    let v: Int64Array = rows.iter().map(|r| r.1.0).collect();
    let s: StringArray = rows.iter().map(|r| r.1.1.clone()).collect();
    RecordBatch::try_new(composite_schema(), vec![Arc::new(k1), Arc::new(k2), Arc::new(v), Arc::new(s)]).expect("columns match the schema") // infallible by construction
}

/// Builds a key batch `(k1, k2)`.
///
/// # Panics
/// Never (the arrays match the key schema by construction).
pub fn composite_keys(keys: &[(i64, i32)]) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![Field::new("k1", DataType::Int64, false), Field::new("k2", DataType::Int32, false)]));
    let k1: ArrayRef = Arc::new(keys.iter().map(|k| Some(k.0)).collect::<Int64Array>());
    let k2: ArrayRef = Arc::new(keys.iter().map(|k| Some(k.1)).collect::<Int32Array>());
    RecordBatch::try_new(schema, vec![k1, k2]).expect("columns match the key schema") // infallible by construction
}

/// Reads a scan of [`composite_schema`] into a map; the second value counts keys seen more
/// than once (duplicate primary keys, which must never happen).
///
/// # Panics
/// When a batch is an error or does not have the composite schema.
pub fn collect_composite_counting(batches: impl IntoIterator<Item = gritdb::Result<RecordBatch>>) -> (TableModel, usize) {
    let mut out = TableModel::new();
    let mut dups = 0;
    for b in batches {
        let b = b.expect("scan batch");
        let col = |i: usize| Arc::clone(b.column(i));
        let k1 = col(0);
        let k1 = k1.as_any().downcast_ref::<Int64Array>().expect("k1 Int64");
        let k2 = col(1);
        let k2 = k2.as_any().downcast_ref::<Int32Array>().expect("k2 Int32");
        let v = col(2);
        let v = v.as_any().downcast_ref::<Int64Array>().expect("v Int64");
        let s = col(3);
        let s = s.as_any().downcast_ref::<StringArray>().expect("s Utf8");
        for i in 0..b.num_rows() {
            let key = (k1.value(i), k2.value(i));
            let row = ((!v.is_null(i)).then(|| v.value(i)), (!s.is_null(i)).then(|| s.value(i).to_owned()));
            if out.insert(key, row).is_some() {
                dups += 1;
            }
        }
    }
    (out, dups)
}

/// Reads a scan of [`composite_schema`] into a map, asserting no key appears twice.
///
/// # Panics
/// On a duplicate primary key or a scan error.
pub fn collect_composite(batches: impl IntoIterator<Item = gritdb::Result<RecordBatch>>) -> TableModel {
    let (m, dups) = collect_composite_counting(batches);
    assert_eq!(dups, 0, "duplicate primary keys in scan");
    m
}

/// Table contents in the model.
pub type TableModel = BTreeMap<(i64, i32), Row>;
/// The whole database in the model (table name → rows).
pub type DbModel = BTreeMap<String, TableModel>;

/// One generated operation.
#[derive(Debug, Clone)]
pub enum Op {
    /// Insert new keys.
    Insert(String, Vec<((i64, i32), Row)>),
    /// Upsert existing and new keys.
    Upsert(String, Vec<((i64, i32), Row)>),
    /// Update existing keys.
    Update(String, Vec<((i64, i32), Row)>),
    /// Delete keys (existing and absent).
    Delete(String, Vec<(i64, i32)>),
    /// Flush a table.
    Flush(String),
    /// Drop a table (the model forgets it).
    Drop(String),
    /// Create a table.
    Create(String),
}

/// Deterministic operation generator with its model.
pub struct Workload {
    rng: StdRng,
    /// The model after every generated operation.
    pub model: DbModel,
}

const TABLES: [&str; 3] = ["c0", "c1", "c2"];

impl Workload {
    /// A generator for `seed`; the model starts with the three tables created empty.
    pub fn new(seed: u64) -> Self {
        let model = TABLES.iter().map(|t| ((*t).to_owned(), TableModel::new())).collect();
        Self { rng: StdRng::seed_from_u64(seed), model }
    }

    fn row(&mut self, n: usize) -> Row {
        let v = self.rng.random_bool(0.9).then(|| self.rng.random_range(-1000..1000));
        let s = self.rng.random_bool(0.9).then(|| format!("v{n}-{}", self.rng.random_range(0..1000)));
        (v, s)
    }

    fn key(&mut self) -> (i64, i32) {
        (self.rng.random_range(0..400), self.rng.random_range(0..2))
    }

    /// The next operation; the model is updated as if it succeeded.
    pub fn next_op(&mut self, n: usize) -> Op {
        let live: Vec<String> = self.model.keys().cloned().collect();
        if live.len() < TABLES.len() && self.rng.random_bool(0.3) {
            let missing = TABLES.iter().find(|t| !self.model.contains_key(**t)).map(|t| (*t).to_owned());
            if let Some(t) = missing {
                self.model.insert(t.clone(), TableModel::new());
                return Op::Create(t);
            }
        }
        let table = live[self.rng.random_range(0..live.len())].clone();
        let pick = self.rng.random_range(0..100);
        // One op in 25 is big: over a thousand keys from a wider range, so puts and deletes
        // take the path that writes their WAL record on a pool thread while the keys are
        // checked (1,024 rows or more), which small ops never reach.
        let big = self.rng.random_bool(0.04);
        let count = if big { self.rng.random_range(1300..1600) } else { self.rng.random_range(1..25) };
        let mut keys: BTreeSet<(i64, i32)> = BTreeSet::new();
        for _ in 0..count {
            keys.insert(if big { (self.rng.random_range(0..2000), self.rng.random_range(0..2)) } else { self.key() });
        }
        let m = self.model.get(&table).cloned().unwrap_or_default();
        match pick {
            0..=34 => {
                let rows: Vec<_> = keys.into_iter().filter(|k| !m.contains_key(k)).map(|k| (k, self.row(n))).collect();
                if rows.is_empty() {
                    return Op::Flush(table);
                }
                self.model.entry(table.clone()).or_default().extend(rows.clone());
                Op::Insert(table, rows)
            }
            35..=59 => {
                let rows: Vec<_> = keys.into_iter().map(|k| (k, self.row(n))).collect();
                self.model.entry(table.clone()).or_default().extend(rows.clone());
                Op::Upsert(table, rows)
            }
            60..=69 => {
                let rows: Vec<_> = keys.into_iter().filter(|k| m.contains_key(k)).map(|k| (k, self.row(n))).collect();
                if rows.is_empty() {
                    return Op::Flush(table);
                }
                self.model.entry(table.clone()).or_default().extend(rows.clone());
                Op::Update(table, rows)
            }
            70..=91 => {
                let mut ks: Vec<_> = keys.into_iter().collect();
                // Deletes of existing rows, flushed or not, and of absent keys.
                ks.extend(m.keys().take(self.rng.random_range(0..5)).copied());
                let t = self.model.entry(table.clone()).or_default();
                for k in &ks {
                    t.remove(k);
                }
                Op::Delete(table, ks)
            }
            92..=97 => Op::Flush(table),
            _ => {
                self.model.remove(&table);
                Op::Drop(table)
            }
        }
    }
}

/// Applies `op` to the engine.
///
/// # Errors
/// Any engine error (the workload only generates valid operations, so this is a bug).
pub fn execute(engine: &Engine, op: &Op) -> gritdb::Result<()> {
    match op {
        Op::Insert(t, rows) => engine.table(t)?.insert(&composite_batch(rows)).map(drop),
        Op::Upsert(t, rows) => engine.table(t)?.upsert(&composite_batch(rows)).map(drop),
        Op::Update(t, rows) => engine.table(t)?.update(&composite_batch(rows)).map(drop),
        Op::Delete(t, keys) => engine.table(t)?.delete(&composite_keys(keys)).map(drop),
        Op::Flush(t) => engine.table(t)?.flush().map(drop),
        Op::Drop(t) => engine.drop_table(t),
        Op::Create(t) => engine.create_table(t, composite_schema(), &["k1", "k2"]).map(drop),
    }
}

/// Engine settings of the crash workload: small flush thresholds so background flushes and
/// deletes of flushed rows happen often.
pub fn crash_config() -> EngineConfig {
    EngineConfig::default().memory_limit(64 << 20).table_flush_bytes(16 << 10)
}

/// Creates the initial tables (idempotent).
///
/// # Errors
/// Engine errors.
pub fn setup(engine: &Engine) -> gritdb::Result<()> {
    for t in TABLES {
        if engine.table(t).is_err() {
            engine.create_table(t, composite_schema(), &["k1", "k2"])?;
        }
    }
    Ok(())
}

/// The child side: opens `dir`, skips the first `start` operations of `seed`'s sequence
/// (already applied), then executes operations forever, printing `ACK n` after each.
///
/// On any engine error it prints the error on stderr and exits with status 2 (the parent
/// sees the child end without being killed and fails).
pub fn child_main(dir: &Path, seed: u64, start: usize) -> ! {
    fn fail(what: &str, e: &dyn std::fmt::Display) -> ! {
        eprintln!("crash-child: {what}: {e}");
        std::process::exit(2)
    }
    // The parent reads only `ACK n` lines; keep the engine's own logging off stdout.
    let engine = Engine::open(dir, crash_config()).unwrap_or_else(|e| fail(&format!("open {}", dir.display()), &e));
    if start == 0 {
        setup(&engine).unwrap_or_else(|e| fail("setup", &e));
    }
    let mut w = Workload::new(seed);
    for n in 0..start {
        w.next_op(n);
    }
    let out = std::io::stdout();
    for n in start.. {
        let op = w.next_op(n);
        execute(&engine, &op).unwrap_or_else(|e| fail(&format!("op {n} {op:?}"), &e));
        let mut o = out.lock();
        let _ = writeln!(o, "ACK {n}");
        let _ = o.flush();
    }
    unreachable!("the loop runs until killed")
}

/// Result of a crash run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CrashReport {
    /// Children killed.
    pub kills: usize,
    /// Operations acknowledged over all children.
    pub acknowledged: usize,
    /// Acknowledged rows missing after recovery (must be 0).
    pub rows_lost: usize,
    /// Deleted rows that came back (must be 0).
    pub rows_resurrected: usize,
    /// Rows whose value differs from both allowed outcomes (must be 0).
    pub rows_wrong: usize,
    /// Duplicate primary keys seen in scans (must be 0).
    pub duplicate_keys: usize,
    /// Temp files left visible after recovery (must be 0).
    pub temp_files: usize,
}

impl CrashReport {
    /// True when nothing was lost, resurrected, duplicated or left behind.
    pub fn clean(&self) -> bool {
        self.rows_lost == 0 && self.rows_resurrected == 0 && self.rows_wrong == 0 && self.duplicate_keys == 0 && self.temp_files == 0
    }
}

fn read_db(engine: &Engine, dup: &mut usize) -> anyhow::Result<DbModel> {
    use anyhow::Context as _;
    let mut out = DbModel::new();
    for t in engine.table_names() {
        let table = engine.table(&t).with_context(|| format!("table {t} listed after recovery"))?;
        let batches: Vec<RecordBatch> =
            table.scan(ScanOptions::default()).and_then(Iterator::collect).with_context(|| format!("scan of table {t} after recovery"))?;
        let (m, d) = collect_composite_counting(batches.into_iter().map(Ok));
        *dup += d;
        out.insert(t, m);
    }
    Ok(out)
}

fn diff(expected: &DbModel, got: &DbModel, report: &mut CrashReport) {
    for (t, rows) in expected {
        let g = got.get(t);
        for (k, v) in rows {
            match g.and_then(|g| g.get(k)) {
                None => report.rows_lost += 1,
                Some(x) if x != v => report.rows_wrong += 1,
                Some(_) => {}
            }
        }
    }
    for (t, rows) in got {
        let e = expected.get(t);
        for k in rows.keys() {
            if e.is_none_or(|e| !e.contains_key(k)) {
                report.rows_resurrected += 1;
            }
        }
    }
}

fn temp_files(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(".tmp") {
                n += 1;
            }
        }
    }
    n
}

/// `SIGKILL`'s number on Linux (`signal(7)`), what `Child::kill` sends.
const SIGKILL: i32 = 9;

/// The last bytes of a child's stderr kept for an error message.
const STDERR_TAIL: usize = 8 << 10;

/// Reads `from` to its end on a thread of its own (so a child that writes much to stderr
/// never blocks on a full pipe), keeping its last [`STDERR_TAIL`] bytes.
fn stderr_tail(from: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = std::io::Read::read(&mut r, &mut buf) {
            if n == 0 {
                break;
            }
            tail.extend_from_slice(&buf[..n]);
            if tail.len() > 2 * STDERR_TAIL {
                tail.drain(..tail.len() - STDERR_TAIL);
            }
        }
        let cut = tail.len().saturating_sub(STDERR_TAIL);
        String::from_utf8_lossy(&tail[cut..]).trim_end().to_string()
    })
}

/// The parent side: runs `kills` children (built by `child`, given the start operation), kills
/// each with SIGKILL after a random number of acknowledged operations, and checks recovery.
///
/// # Errors
/// When a child cannot be spawned, when a child ends other than by this function's SIGKILL
/// (an exit of its own, or another signal such as `SIGABRT`: the error gives its status and
/// the end of its stderr), and when the data directory cannot be reopened or scanned after a
/// kill (the engine's error, with the kill's number). The kills before it are not reported.
pub fn run_parent(dir: &Path, seed: u64, kills: usize, child: impl Fn(usize) -> Command) -> anyhow::Result<CrashReport> {
    use anyhow::Context as _;
    use std::os::unix::process::ExitStatusExt as _;
    let mut report = CrashReport::default();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut applied = 0usize; // operations known applied
    for kill in 1..=kills {
        let mut cmd = child(applied);
        let mut proc = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("crash: spawn child {kill}: {cmd:?}"))?;
        let stdout = proc.stdout.take().context("crash: child stdout")?;
        let stderr = stderr_tail(proc.stderr.take().context("crash: child stderr")?);
        let target = rng.random_range(5..120);
        let mut acked = None;
        let start = Instant::now();
        let mut lines = BufReader::new(stdout).lines();
        let parse = |line: &str| line.strip_prefix("ACK ").and_then(|n| n.trim().parse::<usize>().ok());
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(n) = parse(&line) {
                acked = Some(n);
                if n + 1 - applied >= target || start.elapsed() > Duration::from_secs(20) {
                    break;
                }
            }
        }
        let _ = proc.kill(); // SIGKILL on Unix
        let status = proc.wait().with_context(|| format!("crash: wait for child {kill}"))?;
        // The child went on until the kill: its later acknowledgements are still in the pipe.
        for line in lines.map_while(Result::ok) {
            if let Some(n) = parse(&line) {
                acked = Some(n);
            }
        }
        let stderr = stderr.join().unwrap_or_default();
        if status.signal() != Some(SIGKILL) {
            anyhow::bail!("crash: child {kill} ended on its own ({status}) instead of being killed; its stderr:\n{stderr}");
        }
        report.kills += 1;
        let acked_upto = acked.map_or(applied, |n| n + 1);
        report.acknowledged += acked_upto - applied;
        // Expected states: all acknowledged ops; or those plus the one in flight.
        let mut w = Workload::new(seed);
        for n in 0..acked_upto {
            w.next_op(n);
        }
        let without = w.model.clone();
        w.next_op(acked_upto);
        let with = w.model.clone();
        let engine = Engine::open(dir, crash_config()).with_context(|| format!("crash: reopen {} after kill {kill}", dir.display()))?;
        let mut dup = 0;
        let got = read_db(&engine, &mut dup).with_context(|| format!("crash: after kill {kill}"))?;
        report.duplicate_keys += dup;
        drop(engine);
        report.temp_files += temp_files(dir);
        if got == with && got != without {
            applied = acked_upto + 1;
        } else {
            applied = acked_upto;
            let before = report.clone();
            diff(&without, &got, &mut report);
            if !report.clean() && before.clean() && std::env::var("GRITDB_CRASH_DEBUG").is_ok() {
                let mut w = Workload::new(seed);
                for n in 0..=acked_upto {
                    let op = w.next_op(n);
                    if n + 8 >= acked_upto {
                        eprintln!("op {n}: {op:?}");
                    }
                }
                for (t, rows) in &got {
                    let e = without.get(t);
                    for (k, v) in rows {
                        if e.and_then(|e| e.get(k)) != Some(v) {
                            eprintln!("table {t} key {k:?}: got {v:?}, expected {:?}", e.and_then(|e| e.get(k)));
                        }
                    }
                }
                eprintln!("acked_upto {acked_upto} tables got {:?} expected {:?}", got.keys().collect::<Vec<_>>(), without.keys().collect::<Vec<_>>());
            }
        }
    }
    Ok(report)
}

/// `gritdb-soak crash`: runs [`run_parent`] with this binary's hidden `crash-child`
/// subcommand as the child and prints kills, acknowledged operations, rows lost (must be 0)
/// and deleted rows resurrected (must be 0). Returns `Ok(false)` on any loss.
///
/// # Errors
/// When the data directory is not empty or this executable cannot be found.
pub fn run_cli(args: &crate::cli::CrashArgs) -> anyhow::Result<bool> {
    let tmp;
    let dir = if let Some(d) = &args.dir {
        if d.exists() && !d.is_dir() {
            anyhow::bail!("crash: --dir {} is not a directory; give an empty or new directory", d.display());
        }
        if d.exists() && anyhow::Context::with_context(std::fs::read_dir(d), || format!("crash: --dir {}", d.display()))?.next().is_some() {
            anyhow::bail!("crash: {} is not empty; give an empty or new directory", d.display());
        }
        // Made here, so a path that cannot be a directory (under a file, a dangling symbolic
        // link) is this error, not a child that fails to open it.
        anyhow::Context::with_context(std::fs::create_dir_all(d), || format!("crash: cannot create --dir {}", d.display()))?;
        d.clone()
    } else {
        tmp = std::env::temp_dir().join(format!("gritdb-crash-{}-{}", std::process::id(), args.seed));
        tmp.clone()
    };
    let exe = std::env::current_exe()?;
    println!("gritdb-soak crash: {} kills, seed {}, data dir {}", args.kills, args.seed, dir.display());
    let report = run_parent(&dir, args.seed, args.kills, |start| {
        let mut c = Command::new(&exe);
        c.arg("crash-child").arg("--dir").arg(&dir).arg("--seed").arg(args.seed.to_string()).arg("--start").arg(start.to_string());
        c
    })?;
    println!("kills                      {}", report.kills);
    println!("acknowledged operations    {}", report.acknowledged);
    println!("rows lost                  {} (must be 0)", report.rows_lost);
    println!("deleted rows resurrected   {} (must be 0)", report.rows_resurrected);
    println!("rows with a wrong value    {} (must be 0)", report.rows_wrong);
    println!("duplicate primary keys     {} (must be 0)", report.duplicate_keys);
    println!("temp files left visible    {} (must be 0)", report.temp_files);
    println!("verdict: {}", if report.clean() { "PASS" } else { "FAIL" });
    if args.dir.is_none() && report.clean() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(report.clean())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `--dir` that is a file, a non-empty directory, a path under a file or a dangling
    /// symbolic link is refused before any child starts, with the path in the message (the
    /// last two reached the parent's reopen and panicked there).
    #[test]
    fn a_bad_dir_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let args = |dir: &Path| crate::cli::CrashArgs { kills: 1, seed: 1, dir: Some(dir.to_path_buf()) };
        let err = run_cli(&args(&file)).unwrap_err().to_string();
        assert!(err.contains("not a directory") && err.contains("a-file"), "{err}");
        let err = run_cli(&args(tmp.path())).unwrap_err().to_string();
        assert!(err.contains("is not empty") && err.contains(&tmp.path().display().to_string()), "{err}");
        let err = run_cli(&args(&file.join("sub"))).unwrap_err().to_string();
        assert!(err.contains("cannot create") && err.contains("a-file"), "{err}");
        #[cfg(unix)]
        {
            let dangling = tmp.path().join("dangling");
            std::os::unix::fs::symlink(tmp.path().join("nowhere/at/all"), &dangling).unwrap();
            let err = run_cli(&args(&dangling)).unwrap_err().to_string();
            assert!(err.contains("cannot create") && err.contains("dangling"), "{err}");
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"x", "left as it was");
    }

    /// A child made of a shell script, run once.
    fn sh(script: &'static str) -> impl Fn(usize) -> Command {
        move |_| {
            let mut c = Command::new("sh");
            c.arg("-c").arg(script);
            c
        }
    }

    /// A child that ends other than by the parent's SIGKILL (an exit of its own, a crash of
    /// its own) is an error giving its status and its stderr, not a kill counted; a data
    /// directory that does not reopen after a kill is an error naming the kill, not a panic.
    #[test]
    fn a_child_that_ends_on_its_own_or_a_failed_reopen_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", run_parent(dir.path(), 1, 3, sh("echo 'ACK 0'; echo 'crash-child: setup: boom' >&2; exit 2")).unwrap_err());
        assert!(err.contains("child 1 ended on its own") && err.contains("exit status: 2") && err.contains("crash-child: setup: boom"), "{err}");
        let err = format!("{:#}", run_parent(dir.path(), 1, 3, sh("kill -ABRT $$")).unwrap_err());
        assert!(err.contains("child 1 ended on its own") && err.contains("signal: 6"), "{err}");
        // Killed as planned, but the directory holds a file named like a WAL segment that the
        // log never names so (`wal-1.log`), which the open refuses.
        drop(Engine::open(dir.path(), crash_config()).unwrap());
        std::fs::create_dir_all(dir.path().join("wal")).unwrap();
        std::fs::write(dir.path().join("wal/wal-1.log"), b"not a segment").unwrap();
        let err =
            format!("{:#}", run_parent(dir.path(), 1, 3, sh("i=0; while [ $i -lt 200 ]; do echo \"ACK $i\"; i=$((i+1)); done; exec sleep 60")).unwrap_err());
        assert!(err.contains("after kill 1") && err.contains("wal-1.log"), "{err}");
    }
}
