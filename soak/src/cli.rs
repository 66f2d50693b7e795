//! Command line: `gritdb-soak [run] [OPTIONS]` and `gritdb-soak report DIR`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Soak runner for gritdb: repeats rounds of four loads without restarting the engine and
/// checks that memory stays flat and the data stays right.
#[derive(Debug, Parser)]
#[command(name = "gritdb-soak", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do (default: `run`).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Options of `run` when no subcommand is named.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the soak (the default when no subcommand is given).
    Run(RunArgs),
    /// Run a short soak per memory limit (each in its own process) and write a table and plot
    /// of throughput, flushes and peak RSS against the limit, to help choose a limit.
    Tune(TuneArgs),
    /// Re-render `soak.svg` and `summary.json` from the `soak.csv` of an earlier run.
    Report {
        /// The output directory of an earlier run (holds `soak.csv`).
        dir: PathBuf,
    },
    /// Crash test: run a random keyed workload in a child process, SIGKILL it at random
    /// moments, reopen and compare with a model. Exits non-zero on any lost or resurrected row.
    Crash(CrashArgs),
    /// Keyed-DML benchmark: a keyed ingest workload on TPC-H lineitem (8,192-row batches;
    /// insert all, upsert every 10th batch, delete every 10th from the 5th, make durable, count,
    /// Q1), beside raw Parquet write/read and a naive store, repeated --runs times; prints
    /// medians in a table (DuckDB's column: figures recorded earlier on this machine, or, with
    /// --duckdb SCRIPT, measured by the peer script after each run) and one JSON line. Exits non-zero when count or
    /// `sum(l_quantity)` is wrong. docs/performance.md has the measured figures.
    #[allow(clippy::doc_markdown, reason = "a product name in the command's --help text, not code")]
    Bench(BenchArgs),
    /// The child process of `crash` (not for direct use).
    #[command(hide = true)]
    CrashChild(CrashChildArgs),
}

/// Options of `crash`.
#[derive(Debug, Clone, Args)]
pub struct CrashArgs {
    /// How many times to kill the child (at least 1).
    #[arg(long, default_value_t = 100, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub kills: usize,
    /// Seed of the workload and of the kill moments.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Data directory (must be empty or absent; default: a new temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Options of `bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// TPC-H lineitem Parquet file (read in 8,192-row batches); default: generated in process.
    #[arg(long)]
    pub parquet: Option<PathBuf>,
    /// TPC-H scale factor of the generated lineitem (ignored with `--parquet`).
    #[arg(long, default_value_t = 0.1, value_parser = parse_scale)]
    pub scale: f64,
    /// Data directory (must be empty or absent; default: a temporary directory, removed after).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Engine memory limit of the workload run (default: the engine's, 50% of RAM).
    #[arg(long, value_parser = parse_size)]
    pub memory_limit: Option<u64>,
    /// Threads one flush uses (`EngineConfig::flush_threads`; default: the engine's,
    /// min(2, available parallelism)).
    #[arg(long)]
    pub flush_threads: Option<usize>,
    /// Run background flushes under `SCHED_BATCH` (`EngineConfig::background_priority`,
    /// `BackgroundPriority::Batch(0)`) instead of the engine's default (`Inherit`).
    #[arg(long)]
    pub background_batch: bool,
    /// Nice value (0..=19) of `--background-batch`'s flush threads: `Batch(N)`. 19 lets the
    /// writes take the cores first (docs/performance.md, twenty-second pass).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i8).range(0..=19), requires = "background_batch")]
    pub background_nice: i8,
    /// Times the measured phases run on the same input (each in a fresh directory); every
    /// figure printed is the median over the runs (memory figures: the largest; `VmHWM`: run
    /// 1's, as later runs only add to the process's peak), with the smallest and largest rate
    /// of each phase beside it. At least 1.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// The peer script (`shared/peers/duckdb_ingest.py`): run it with `python3` once after
    /// each of gritdb's runs, on the same input (the generated lineitem is written to a
    /// Parquet file in the data directory first), and compare against the medians it measured
    /// here and now instead of the figures recorded earlier. Needs `pip install duckdb
    /// pyarrow`; fails when the script fails or its count or `sum(l_quantity)` differs.
    #[arg(long, value_name = "SCRIPT")]
    pub duckdb: Option<PathBuf>,
}

/// Options of the hidden `crash-child`.
#[derive(Debug, Clone, Args)]
pub struct CrashChildArgs {
    /// Data directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// Workload seed.
    #[arg(long)]
    pub seed: u64,
    /// Operations already applied.
    #[arg(long)]
    pub start: usize,
}

/// Options of a soak run.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Rounds to run (each round = write, create/drop, scan and mixed loads).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Tables created and dropped per round (load 2).
    #[arg(long, default_value_t = 500)]
    pub tables: u32,
    /// TPC-H scale factor of the lineitem/orders window kept in the engine.
    #[arg(long, default_value_t = 0.1, value_parser = parse_scale)]
    pub scale: f64,
    /// Engine memory limit: bytes or a size with unit (`256MiB`, `1GiB`, `512KiB`, `64MB`).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub memory_limit: u64,
    /// Output directory for `soak.csv`, `summary.json`, `soak.svg` and `soak.log`.
    #[arg(long, default_value = "./soak-out")]
    pub out: PathBuf,
    /// Per-table flush threshold of the engine (`EngineConfig::table_flush_bytes`): bytes or a
    /// size with unit. Default: the limit / 64, clamped to 1..=64 MiB (4 MiB at 256 MiB), so
    /// that each round's write load crosses it several times.
    #[arg(long, value_parser = parse_size)]
    pub table_flush_bytes: Option<u64>,
    /// Engine data directory. Its contents are wiped at the start of a run only when it holds
    /// nothing but gritdb files; otherwise a fresh subdirectory is used.
    #[arg(long, default_value = "./gritdb-data")]
    pub data_dir: PathBuf,
    /// Seed of the pseudo-random choices (which parts are updated, mixed transactions).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Stop after the round during which this many seconds have passed (0 = no time bound).
    #[arg(long, default_value_t = 0)]
    pub duration: u64,
    /// Global allocator: `jemalloc` (binary `gritdb-soak`) or `system` (glibc malloc, binary
    /// `gritdb-soak-system`, started when this binary uses the other one).
    #[arg(long, value_enum, default_value_t = Allocator::Jemalloc)]
    pub allocator: Allocator,
}

/// The process's global allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Allocator {
    /// jemalloc (`tikv-jemallocator`).
    Jemalloc,
    /// The system allocator (glibc malloc on Linux).
    System,
}

impl Allocator {
    /// The name used on the command line and in `summary.json`.
    pub const fn name(self) -> &'static str {
        match self {
            Allocator::Jemalloc => "jemalloc",
            Allocator::System => "system",
        }
    }

    /// The binary built with this allocator.
    pub const fn binary(self) -> &'static str {
        match self {
            Allocator::Jemalloc => "gritdb-soak",
            Allocator::System => "gritdb-soak-system",
        }
    }
}

/// Options of `tune`.
#[derive(Debug, Clone, Args)]
pub struct TuneArgs {
    /// Memory limits to try, comma separated (`64MiB,128MiB,256MiB,512MiB`).
    #[arg(long, value_delimiter = ',', default_value = "64MiB,128MiB,256MiB,512MiB", value_parser = parse_size)]
    pub limits: Vec<u64>,
    /// Rounds per limit.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Tables created and dropped per round.
    #[arg(long, default_value_t = 500)]
    pub tables: u32,
    /// TPC-H scale factor of the window.
    #[arg(long, default_value_t = 0.1, value_parser = parse_scale)]
    pub scale: f64,
    /// Output directory: `tune.csv`, `tune.svg`, and one soak output directory per limit.
    #[arg(long, default_value = "./soak-tune")]
    pub out: PathBuf,
    /// Engine data directory (each limit uses a subdirectory of it).
    #[arg(long, default_value = "./gritdb-data")]
    pub data_dir: PathBuf,
    /// Seed of the pseudo-random choices.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Global allocator of the soak runs.
    #[arg(long, value_enum, default_value_t = Allocator::Jemalloc)]
    pub allocator: Allocator,
}

impl RunArgs {
    /// The per-table flush threshold in bytes: `--table-flush-bytes`, else limit / 64 clamped
    /// to 1..=64 MiB.
    pub fn flush_bytes(&self) -> u64 {
        self.table_flush_bytes.unwrap_or_else(|| (self.memory_limit / 64).clamp(1 << 20, 64 << 20))
    }
}

impl Default for RunArgs {
    fn default() -> Self {
        Self {
            rounds: 200,
            tables: 500,
            scale: 0.1,
            memory_limit: 256 << 20,
            table_flush_bytes: None,
            out: PathBuf::from("./soak-out"),
            data_dir: PathBuf::from("./gritdb-data"),
            seed: 42,
            duration: 0,
            allocator: Allocator::Jemalloc,
        }
    }
}

/// Parses a positive TPC-H scale factor (`0.1`, `1`).
fn parse_scale(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number (example: 0.1)"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("scale must be a positive number, got `{s}`"));
    }
    if v > 1000.0 {
        return Err(format!("scale `{s}` is above 1000"));
    }
    Ok(v)
}

/// Parses a byte size: a positive integer or decimal with an optional unit. Binary units
/// `KiB`, `MiB`, `GiB`, `TiB` (and the short forms `K`, `M`, `G`, `T`) are powers of 1024;
/// `KB`, `MB`, `GB`, `TB` are powers of 1000; `B` or no unit means bytes. Units are
/// case-insensitive and may follow a space. The result must be a whole, positive number of
/// bytes that fits in 64 bits.
///
/// # Errors
/// A message naming the bad input and the accepted forms.
pub fn parse_size(s: &str) -> Result<u64, String> {
    const HELP: &str = "expected bytes or a size with unit, e.g. 268435456, 256MiB, 1GiB, 1.5GiB, 64MB";
    let t = s.trim();
    if t.is_empty() {
        return Err(format!("empty size; {HELP}"));
    }
    if t.starts_with('-') {
        return Err(format!("size `{s}` is negative; {HELP}"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() || num == "." {
        return Err(format!("no number in `{s}`; {HELP}"));
    }
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("unknown unit `{unit}` in `{s}`; {HELP}")),
    };
    let (int, frac) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if frac.contains('.') || frac.len() > 12 || int.len() > 20 {
        return Err(format!("`{s}` is not a valid number; {HELP}"));
    }
    let parse =
        |d: &str| -> Result<u128, String> { if d.is_empty() { Ok(0) } else { d.parse::<u128>().map_err(|_| format!("`{s}` is not a valid number; {HELP}")) } };
    let scale = 10u128.pow(frac.len() as u32);
    let value = parse(int)? * scale + parse(frac)?;
    let bytes = value * multiplier;
    if !bytes.is_multiple_of(scale) {
        return Err(format!("`{s}` is not a whole number of bytes; {HELP}"));
    }
    let bytes = bytes / scale;
    if bytes == 0 {
        return Err(format!("size must be positive, got `{s}`"));
    }
    u64::try_from(bytes).map_err(|_| format!("size `{s}` does not fit in 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_size("268435456"), Ok(268_435_456));
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("256 mib"), Ok(256 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("64MB"), Ok(64_000_000));
        assert_eq!(parse_size("10B"), Ok(10));
        assert_eq!(parse_size(" 2TiB "), Ok(2 << 40));
    }

    #[test]
    fn bad_sizes_are_rejected_with_a_reason() {
        for (input, needle) in [
            ("0", "positive"),
            ("0MiB", "positive"),
            ("-5MiB", "negative"),
            ("-1", "negative"),
            ("", "empty"),
            ("MiB", "no number"),
            ("abc", "no number"),
            ("12XB", "unknown unit"),
            ("1.2.3MiB", "not a valid number"),
            ("0.5B", "whole number"),
            ("99999999999TiB", "64 bits"),
            ("1e9", "unknown unit"),
        ] {
            let err = parse_size(input).expect_err(input);
            assert!(err.contains(needle), "`{input}` gave `{err}`, expected it to mention `{needle}`");
        }
    }

    #[test]
    fn cli_defaults_and_subcommands() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["gritdb-soak"]).expect("no args");
        assert!(cli.command.is_none());
        assert_eq!(cli.run.rounds, 200);
        assert_eq!(cli.run.memory_limit, 256 << 20);
        let cli = Cli::try_parse_from(["gritdb-soak", "run", "--rounds", "3", "--memory-limit", "1GiB"]).expect("run");
        match cli.command {
            Some(Command::Run(a)) => assert_eq!((a.rounds, a.memory_limit), (3, 1 << 30)),
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["gritdb-soak", "--memory-limit", "0"]).is_err());
        assert!(Cli::try_parse_from(["gritdb-soak", "--memory-limit", "lots"]).is_err());
        assert!(Cli::try_parse_from(["gritdb-soak", "--rounds", "0"]).is_err());
        // A crash run of no kills would print PASS having checked nothing.
        assert!(Cli::try_parse_from(["gritdb-soak", "crash", "--kills", "0"]).is_err());
        match Cli::try_parse_from(["gritdb-soak", "crash", "--kills", "2"]).expect("crash").command {
            Some(Command::Crash(c)) => assert_eq!(c.kills, 2),
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["gritdb-soak", "--scale", "-1"]).is_err());
        let cli = Cli::try_parse_from(["gritdb-soak", "report", "/tmp/x"]).expect("report");
        assert!(matches!(cli.command, Some(Command::Report { .. })));
        let cli = Cli::try_parse_from(["gritdb-soak", "--allocator", "system"]).expect("allocator");
        assert_eq!(cli.run.allocator, Allocator::System);
        let cli = Cli::try_parse_from(["gritdb-soak", "tune", "--limits", "64MiB,1GiB"]).expect("tune");
        match cli.command {
            Some(Command::Tune(t)) => assert_eq!(t.limits, vec![64 << 20, 1 << 30]),
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["gritdb-soak", "tune", "--limits", "64MiB,0"]).is_err());
    }
}
