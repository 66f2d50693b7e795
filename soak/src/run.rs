//! Running a soak: output files, data directory, logging, progress and the round loop; and
//! the `report` command that re-renders an earlier run's summary and plot.

use crate::cli::{Allocator, RunArgs};
use crate::loads::{Outcome, Sizes, Soak};
use crate::report::{Summary, fmt_bytes, summarize};
use crate::sample::{Load, LoadFigures, Monitor, Sample, csv_header, read_csv};
use crate::{data, plot};
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::{self, File};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Names a gritdb data directory holds at its top level: the marker
/// (`gritdb::DATA_DIR_MARKER`) and its temp file, `LOCK`, and three directories.
const GRITDB_ENTRIES: [&str; 6] = ["GRITDB", "GRITDB.tmp", "LOCK", "tables", "trash", "wal"];

/// The top-level entries of [`GRITDB_ENTRIES`] that are files.
const GRITDB_FILES: [&str; 3] = ["GRITDB", "GRITDB.tmp", "LOCK"];

/// Where the engine's data goes for this run.
#[derive(Debug)]
struct DataDir {
    path: PathBuf,
    /// A fresh subdirectory created for this run (removed at the end).
    fresh: bool,
}

/// True when every entry of `dir` is a file or directory gritdb creates: the marker `GRITDB`,
/// `LOCK`, the directories `tables/` and `trash/` holding only `t<id>` table directories,
/// and `wal/` holding only `wal-<id>.log` segments, each spelled as the engine spells it
/// (`gritdb::names`).
fn holds_only_gritdb_files(dir: &Path) -> Result<bool> {
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e.with_context(|| format!("reading {}", dir.display()))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return Ok(false);
        };
        if !GRITDB_ENTRIES.contains(&name) {
            return Ok(false);
        }
        let ty = e.file_type().with_context(|| format!("reading {}", e.path().display()))?;
        if GRITDB_FILES.contains(&name) {
            if !ty.is_file() {
                return Ok(false);
            }
            continue;
        }
        if !ty.is_dir() {
            return Ok(false);
        }
        for t in fs::read_dir(e.path()).with_context(|| format!("reading {}", e.path().display()))? {
            let t = t.with_context(|| format!("reading {}", e.path().display()))?;
            let n = t.file_name();
            // Spelled exactly as the engine spells them (`wal-1.log` or `t07` are not its).
            let ok =
                n.to_str().is_some_and(|n| if name == "wal" { gritdb::names::wal_segment_id(n).is_some() } else { gritdb::names::table_dir_id(n).is_some() });
            if !ok {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Refuses a `--data-dir` that exists and is not a directory, before anything is created
/// (a run refused for it left an empty `--out` behind).
fn check_data_dir_arg(dir: &Path) -> Result<()> {
    match fs::metadata(dir) {
        Ok(meta) if !meta.is_dir() => {
            bail!("--data-dir {} exists and is not a directory", dir.display())
        }
        _ => Ok(()),
    }
}

/// Creates `dir` with its parents, returning the topmost directory it created (`None` when
/// `dir` was there), so a set-up that fails later can remove what it made.
fn create_dir_tracked(dir: &Path) -> Result<Option<PathBuf>> {
    let topmost = dir.ancestors().take_while(|a| !a.as_os_str().is_empty() && !a.exists()).last().map(Path::to_path_buf);
    fs::create_dir_all(dir).with_context(|| format!("creating output dir {}", dir.display()))?;
    Ok(topmost)
}

/// Prepares `--data-dir`: created when missing; its contents wiped when it holds only gritdb
/// files and no other process has it open; otherwise a fresh subdirectory is used.
fn prepare_data_dir(dir: &Path) -> Result<DataDir> {
    if !dir.exists() {
        fs::create_dir_all(dir).with_context(|| format!("creating data dir {}", dir.display()))?;
        return Ok(DataDir { path: dir.to_path_buf(), fresh: false });
    }
    check_data_dir_arg(dir)?;
    if holds_only_gritdb_files(dir)? {
        let lock_path = dir.join("LOCK");
        if lock_path.exists() {
            let lock = File::options().read(true).write(true).open(&lock_path).with_context(|| format!("opening {}", lock_path.display()))?;
            match lock.try_lock() {
                Ok(()) => {}
                Err(fs::TryLockError::WouldBlock) => {
                    let holder = fs::read_to_string(&lock_path).unwrap_or_default();
                    bail!("data dir {} is in use by another gritdb process (pid {}); pass another --data-dir", dir.display(), holder.trim());
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("locking {}", lock_path.display()));
                }
            }
            drop(lock);
        }
        for name in GRITDB_ENTRIES {
            let p = dir.join(name);
            if p.is_dir() {
                fs::remove_dir_all(&p).with_context(|| format!("wiping {}", p.display()))?;
            } else if p.exists() {
                fs::remove_file(&p).with_context(|| format!("wiping {}", p.display()))?;
            }
        }
        tracing::info!(dir = %dir.display(), "wiped the data dir of an earlier run");
        return Ok(DataDir { path: dir.to_path_buf(), fresh: false });
    }
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let sub = dir.join(format!("gritdb-soak-{stamp}-{}", std::process::id()));
    fs::create_dir(&sub).with_context(|| format!("creating {}", sub.display()))?;
    eprintln!("gritdb-soak: {} holds files that are not gritdb's; leaving them and using {}", dir.display(), sub.display());
    Ok(DataDir { path: sub, fresh: true })
}

/// Installs the tracing subscriber writing to `soak.log` (filter from `RUST_LOG`, default
/// `info,gritdb::writer=debug` so background flushes are logged).
fn init_logging(out: &Path) -> Result<()> {
    use tracing_subscriber::EnvFilter;
    let path = out.join("soak.log");
    let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,gritdb::writer=debug"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::sync::Mutex::new(file))
        .with_ansi(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))
}

/// Progress display: a bar on a terminal, else one line per ~10% of the rounds.
struct Progress {
    bar: Option<ProgressBar>,
    rounds: u32,
    next_line: u32,
}

impl Progress {
    fn new(rounds: u32) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(u64::from(rounds));
            let style = ProgressStyle::with_template("{bar:30.cyan/blue} round {pos}/{len}  elapsed {elapsed_precise}  ETA {eta_precise}  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(500));
            bar
        });
        Self { bar, rounds, next_line: 1 }
    }

    fn update(&mut self, round: u32, start: Instant, s: &Sample) {
        let msg = format!("RSS {}  engine used {}", fmt_bytes(s.rss as f64), fmt_bytes(s.used as f64));
        if let Some(bar) = &self.bar {
            bar.set_position(u64::from(round));
            bar.set_message(msg);
        } else if round >= self.next_line * self.rounds.div_ceil(10) || round == self.rounds {
            let el = start.elapsed().as_secs_f64();
            let eta = el / f64::from(round) * f64::from(self.rounds - round);
            eprintln!(
                "gritdb-soak: round {round}/{} ({}%)  elapsed {el:.0} s  ETA {eta:.0} s  {msg}",
                self.rounds,
                u64::from(round) * 100 / u64::from(self.rounds)
            );
            self.next_line = round / self.rounds.div_ceil(10).max(1) + 1;
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `soak.csv`, written as samples arrive (flushed each time, so a crash keeps what was seen).
struct Csv {
    w: BufWriter<File>,
    path: PathBuf,
}

impl Csv {
    fn create(path: PathBuf) -> Result<Self> {
        let f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = BufWriter::new(f);
        writeln!(w, "{}", csv_header()).with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { w, path })
    }

    fn push(&mut self, s: &Sample) -> Result<()> {
        writeln!(self.w, "{}", s.csv_line()).and_then(|()| self.w.flush()).with_context(|| format!("writing {}", self.path.display()))
    }
}

/// State of a run while rounds go on.
struct Runner {
    soak: Soak,
    monitor: Monitor,
    csv: Csv,
    samples: Vec<Sample>,
    start: Instant,
}

impl Runner {
    /// Runs one load, takes its sample and writes it. Returns the mismatch text, if any.
    fn load(&mut self, round: u32, load: Load) -> Result<Option<String>> {
        self.monitor.take();
        let t = Instant::now();
        let outcome: Outcome = match load {
            Load::Base => self.soak.base_load(),
            Load::Write => self.soak.write_load(),
            Load::CreateDrop => self.soak.create_drop_load(round),
            Load::Scan => self.soak.scan_load(),
            Load::Mixed => self.soak.mixed_load(round),
        }
        .with_context(|| format!("round {round}, {} load", load.name()))?;
        let load_ms = t.elapsed().as_secs_f64() * 1000.0;
        let sample = Sample::take(
            self.soak.engine(),
            LoadFigures {
                round,
                load,
                elapsed_s: self.start.elapsed().as_secs_f64(),
                load_ms,
                rows: outcome.rows,
                verified: outcome.mismatch.is_none(),
                create_drop_residual: outcome.residual,
                empty_table_bytes: outcome.empty_table_bytes,
                peaks: self.monitor.take(),
            },
        );
        tracing::info!(
            round,
            load = load.name(),
            load_ms = format!("{load_ms:.1}"),
            rows = outcome.rows,
            rss = sample.rss,
            vmhwm = sample.vmhwm,
            used = sample.used,
            outside_engine = sample.outside_engine,
            files = sample.files,
            "load done"
        );
        self.csv.push(&sample)?;
        self.samples.push(sample);
        if let Some(m) = &outcome.mismatch {
            tracing::error!(round, load = load.name(), mismatch = %m, "verification failed");
        }
        Ok(outcome.mismatch.map(|m| format!("verification failed in round {round}, {} load: {m}", load.name())))
    }
}

fn config_json(args: &RunArgs, allocator: Allocator, sizes: &Sizes, data_dir: &Path) -> serde_json::Value {
    serde_json::json!({
        "rounds_requested": args.rounds,
        "tables": args.tables,
        "scale": args.scale,
        "memory_limit": args.memory_limit,
        "table_flush_bytes": args.flush_bytes(),
        "seed": args.seed,
        "duration_s": args.duration,
        "data_dir": data_dir.display().to_string(),
        "allocator": allocator.name(),
        "parts": data::PARTS,
        "sizes": sizes,
        "gritdb_soak_version": env!("CARGO_PKG_VERSION"),
    })
}

/// Runs the soak of `args`. Returns `true` when the verdict is "pass".
///
/// # Errors
/// Set-up failures (output or data directory, engine open). Failures during the rounds are
/// recorded in the summary and give `Ok(false)`.
pub fn run(args: &RunArgs, allocator: Allocator) -> Result<bool> {
    let limit = usize::try_from(args.memory_limit).context("--memory-limit does not fit this platform's address size")?;
    let flush_bytes = usize::try_from(args.flush_bytes()).context("--table-flush-bytes does not fit this platform's address size")?;
    let engine_config = gritdb::EngineConfig::default().memory_limit(limit).table_flush_bytes(flush_bytes);
    // A limit the engine would refuse is refused before the output log is replaced and the
    // previous run's data dir wiped (a new user's `--memory-limit 1KB` cleared both).
    gritdb::memory::MemoryController::check_limit_value(limit, engine_config.chunk_size)
        .with_context(|| format!("--memory-limit {}", fmt_bytes(limit as f64)))?;
    // A `--data-dir` that cannot be one is refused before `--out` is created.
    check_data_dir_arg(&args.data_dir)?;
    let created_out = create_dir_tracked(&args.out)?;
    let setup = || -> Result<(DataDir, gritdb::Engine)> {
        init_logging(&args.out)?;
        let data_dir = prepare_data_dir(&args.data_dir)?;
        match gritdb::Engine::open(&data_dir.path, engine_config) {
            Ok(engine) => Ok((data_dir, engine)),
            Err(e) => {
                if data_dir.fresh {
                    let _ = fs::remove_dir_all(&data_dir.path);
                }
                Err(e).with_context(|| format!("opening the engine in {} with limit {}", data_dir.path.display(), fmt_bytes(limit as f64)))
            }
        }
    };
    let (data_dir, engine) = match setup() {
        Ok(ready) => ready,
        Err(e) => {
            // Nothing ran: the output directory this run created (holding only its log
            // file) goes again.
            if let Some(dir) = created_out {
                let _ = fs::remove_dir_all(dir);
            }
            return Err(e);
        }
    };
    let sizes = Sizes::new(args.tables);
    let config = config_json(args, allocator, &sizes, &data_dir.path);
    tracing::info!(%config, "soak starting");
    let monitor = Monitor::start(std::sync::Arc::clone(engine.memory()), Duration::from_millis(25))?;
    let soak = Soak::new(engine, args.scale, sizes, args.seed)?;
    let mut runner = Runner { soak, monitor, csv: Csv::create(args.out.join("soak.csv"))?, samples: Vec::new(), start: Instant::now() };

    eprintln!(
        "gritdb-soak: {}, {} tables/round, scale {}, limit {}, allocator {}, output {}",
        crate::report::plural(u64::from(args.rounds), "round"),
        args.tables,
        args.scale,
        fmt_bytes(args.memory_limit as f64),
        allocator.name(),
        args.out.display()
    );
    let mut progress = Progress::new(args.rounds);
    let error = rounds(&mut runner, args, &mut progress);
    progress.finish();
    let Runner { soak, samples, start, monitor, .. } = runner;
    drop(monitor);
    let error = match (error, soak.close()) {
        (Err(e), _) | (Ok(()), Err(e)) => Some(format!("{e:#}")),
        (Ok(()), Ok(())) => None,
    };
    if let Some(e) = &error {
        tracing::error!(error = %e, "soak stopped");
    }
    if data_dir.fresh {
        fs::remove_dir_all(&data_dir.path).with_context(|| format!("removing {}", data_dir.path.display()))?;
    }
    tracing::info!(wall_s = start.elapsed().as_secs_f64(), "soak finished");
    if samples.is_empty() {
        bail!("the soak stopped before its first sample: {}", error.unwrap_or_default());
    }
    let summary = summarize(&samples, error, config)?;
    write_outputs(&summary, &samples, &args.out)?;
    println!("wrote {0}/soak.csv, {0}/summary.json, {0}/soak.svg, {0}/soak.log", args.out.display());
    Ok(summary.verdict == "pass")
}

/// The round loop. A verification mismatch or an engine error stops it.
fn rounds(runner: &mut Runner, args: &RunArgs, progress: &mut Progress) -> Result<()> {
    if let Some(m) = runner.load(0, Load::Base)? {
        bail!(m);
    }
    let limit = Duration::from_secs(args.duration);
    for round in 1..=args.rounds {
        for load in Load::ROUND {
            if let Some(m) = runner.load(round, load)? {
                bail!(m);
            }
        }
        if let Some(s) = runner.samples.last() {
            progress.update(round, runner.start, s);
        }
        if args.duration > 0 && runner.start.elapsed() >= limit {
            tracing::info!(round, "--duration reached");
            eprintln!("gritdb-soak: --duration {} s reached after round {round}", args.duration);
            break;
        }
    }
    Ok(())
}

fn write_outputs(summary: &Summary, samples: &[Sample], out: &Path) -> Result<()> {
    summary.write(out)?;
    let allocator = summary.config.get("allocator").and_then(serde_json::Value::as_str).unwrap_or("unknown allocator");
    let title = format!("gritdb soak: {} rounds, limit {}, {allocator}, verdict {}", summary.rounds, fmt_bytes(summary.limit_bytes as f64), summary.verdict);
    plot::render(samples, &title, &out.join("soak.svg"))?;
    println!("{}", summary.table());
    Ok(())
}

/// Runs the binary built with `allocator` (next to this executable) with this process's
/// arguments; returns its exit status.
///
/// # Errors
/// When the other binary is missing (with the command that builds it) or cannot be started.
pub fn exec_sibling(allocator: Allocator) -> Result<u8> {
    let me = std::env::current_exe().context("locating this executable")?;
    let other = me.with_file_name(format!("{}{}", allocator.binary(), std::env::consts::EXE_SUFFIX));
    if !other.exists() {
        bail!(
            "--allocator {} needs the binary {}; build it with `cargo build --release -p gritdb-soak --bins` \
             (or run it directly: `cargo run --release -p gritdb-soak --bin {}`)",
            allocator.name(),
            other.display(),
            allocator.binary()
        );
    }
    let status = std::process::Command::new(&other).args(std::env::args_os().skip(1)).status().with_context(|| format!("starting {}", other.display()))?;
    Ok(status.code().map_or(2, |c| u8::try_from(c).unwrap_or(2)))
}

/// `gritdb-soak report DIR`: recomputes `summary.json` and `soak.svg` from `DIR/soak.csv`,
/// keeping the `config` and `error` of an existing `summary.json`. Returns `true` on "pass".
///
/// # Errors
/// A missing or malformed `soak.csv`; write failures.
pub fn report(dir: &Path) -> Result<bool> {
    let samples = read_csv(&dir.join("soak.csv"))?;
    if samples.is_empty() {
        bail!("{} has no samples", dir.join("soak.csv").display());
    }
    let old: Option<serde_json::Value> = fs::read_to_string(dir.join("summary.json")).ok().and_then(|s| serde_json::from_str(&s).ok());
    let config = old.as_ref().and_then(|o| o.get("config").cloned()).unwrap_or(serde_json::Value::Null);
    let error = old.as_ref().and_then(|o| o.get("error")).and_then(|e| e.as_str()).map(str::to_owned);
    let summary = summarize(&samples, error, config)?;
    write_outputs(&summary, &samples, dir)?;
    // `report` reads soak.csv (and soak.log is the run's): only these two are rewritten.
    println!("rewrote {0}/summary.json, {0}/soak.svg", dir.display());
    Ok(summary.verdict == "pass")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gritdb-soak-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).expect("tmp dir");
        d
    }

    #[test]
    fn data_dir_is_wiped_only_when_it_is_gritdb_s() {
        let d = tmp("wipe");
        fs::create_dir_all(d.join("tables/t1")).expect("mk");
        fs::create_dir_all(d.join("wal")).expect("mk");
        fs::write(d.join("wal/wal-00000003.log"), "x").expect("w");
        fs::write(d.join("tables/t1/manifest.json"), "{}").expect("w");
        fs::write(d.join("LOCK"), "1").expect("w");
        fs::write(d.join(gritdb::DATA_DIR_MARKER), "gritdb data directory\nformat 1\n").expect("w");
        assert_eq!(GRITDB_FILES[0], gritdb::DATA_DIR_MARKER);
        let got = prepare_data_dir(&d).expect("prepare");
        assert!(!got.fresh);
        assert!(!d.join("tables").exists() && !d.join("LOCK").exists() && !d.join("wal").exists());
        assert!(!d.join(gritdb::DATA_DIR_MARKER).exists());

        fs::write(d.join("precious.txt"), "keep me").expect("w");
        let got = prepare_data_dir(&d).expect("prepare");
        assert!(got.fresh && got.path.starts_with(&d));
        assert!(d.join("precious.txt").exists());
        fs::remove_dir_all(&d).expect("cleanup");
    }

    /// Names shaped like the engine's but spelled otherwise are not its (the engine refuses
    /// or leaves them): a dir holding one is not wiped; the engine's own spelling is.
    #[test]
    fn names_the_engine_does_not_spell_so_are_not_wiped() {
        for (sub, name) in [("wal", "wal-1.log"), ("wal", "wal-000000003.log"), ("tables", "t07"), ("trash", "t+7")] {
            let d = tmp(&format!("wipe-{name}"));
            fs::create_dir_all(d.join(sub).join(name)).expect("mk");
            fs::write(d.join("LOCK"), "1").expect("w");
            let got = prepare_data_dir(&d).expect("prepare");
            assert!(got.fresh, "{sub}/{name}: a fresh subdirectory, nothing wiped");
            assert!(d.join(sub).join(name).exists(), "{sub}/{name} kept");
            fs::remove_dir_all(&d).expect("cleanup");
        }
        for (sub, name) in [("wal", "wal-00000001.log"), ("tables", "t7"), ("trash", "t12")] {
            let d = tmp(&format!("wipe-ok-{name}"));
            fs::create_dir_all(d.join(sub)).expect("mk");
            if sub == "wal" {
                fs::write(d.join(sub).join(name), "x").expect("w");
            } else {
                fs::create_dir_all(d.join(sub).join(name)).expect("mk");
            }
            let got = prepare_data_dir(&d).expect("prepare");
            assert!(!got.fresh, "{sub}/{name}: gritdb's, wiped in place");
            assert!(!d.join(sub).exists());
            fs::remove_dir_all(&d).expect("cleanup");
        }
    }

    #[test]
    fn report_rerenders_from_csv() {
        use crate::sample::tests::sample;
        let d = tmp("report");
        let mut csv = csv_header();
        csv.push('\n');
        for s in std::iter::once(sample(0, Load::Base)).chain((1..=3).flat_map(|r| Load::ROUND.into_iter().map(move |l| sample(r, l)))) {
            csv.push_str(&s.csv_line());
            csv.push('\n');
        }
        fs::write(d.join("soak.csv"), csv).expect("w");
        let pass = report(&d).expect("report");
        let summary: serde_json::Value = serde_json::from_str(&fs::read_to_string(d.join("summary.json")).expect("r")).expect("json");
        assert_eq!(summary["rounds"], 3);
        assert_eq!(summary["slope_checked"], false);
        // The test samples carry a residual of -64 B and pass otherwise.
        assert!(pass, "{summary:#}");
        assert!(d.join("soak.svg").exists());
        fs::remove_dir_all(&d).expect("cleanup");
    }
}
