//! Samples: the figures taken after every load, and their CSV form (`soak.csv`).
//!
//! The CSV has a header naming every column; [`read_csv`] finds columns by name, so a file
//! written by a build with more columns still reads.

use anyhow::{Context, Result, bail};
use gritdb::Engine;
use gritdb::memory::{Category, MemoryController, ProcessView};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Which load a sample follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Load {
    /// The initial load of the TPC-H window (round 0).
    Base,
    /// Load 1: RF1 inserts, updates, RF2 deletes on orders + lineitem.
    Write,
    /// Load 2: create N tables, a few rows each, drop them all.
    CreateDrop,
    /// Load 3: Q1 / Q6 scans of lineitem and an orders check.
    Scan,
    /// Load 4: small mixed transactions across many tables.
    Mixed,
}

impl Load {
    /// The loads of one round, in order.
    pub const ROUND: [Load; 4] = [Load::Write, Load::CreateDrop, Load::Scan, Load::Mixed];

    /// Name in the CSV.
    pub const fn name(self) -> &'static str {
        match self {
            Load::Base => "base",
            Load::Write => "write",
            Load::CreateDrop => "create_drop",
            Load::Scan => "scan",
            Load::Mixed => "mixed",
        }
    }

    /// Position within a round (0 for base and write … 3 for mixed); used to place a sample
    /// on the x axis at `round - 1 + (position + 1) / 4`.
    pub const fn position(self) -> u32 {
        match self {
            Load::Base | Load::Write => 0,
            Load::CreateDrop => 1,
            Load::Scan => 2,
            Load::Mixed => 3,
        }
    }

    fn parse(s: &str) -> Option<Load> {
        [Load::Base, Load::Write, Load::CreateDrop, Load::Scan, Load::Mixed].into_iter().find(|l| l.name() == s)
    }
}

/// Highest figures seen by the [`Monitor`] during a load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peaks {
    /// Highest RSS.
    pub rss: u64,
    /// Highest engine `used`.
    pub used: u64,
    /// Highest outside-engine bytes (allocator `allocated` − engine `used`).
    pub outside_engine: u64,
}

#[derive(Debug, Default)]
struct MonitorShared {
    stop: AtomicBool,
    rss: AtomicU64,
    used: AtomicU64,
    outside: AtomicU64,
}

/// A thread that reads RSS, engine `used` and the allocator every few milliseconds and keeps
/// the highest values, so that transient peaks inside a load (a flush's encoding buffers, a
/// scan's decoded pages) show up even though the samples are taken between loads.
#[derive(Debug)]
pub struct Monitor {
    shared: Arc<MonitorShared>,
    handle: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Starts polling `ctl` and the process every `every`.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn start(ctl: Arc<MemoryController>, every: Duration) -> Result<Self> {
        let shared = Arc::new(MonitorShared::default());
        let s = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("gritdb-soak-monitor".into())
            .spawn(move || {
                while !s.stop.load(Ordering::Acquire) {
                    let p = ProcessView::read();
                    let used = ctl.used();
                    s.rss.fetch_max(p.rss as u64, Ordering::AcqRel);
                    s.used.fetch_max(used as u64, Ordering::AcqRel);
                    s.outside.fetch_max(p.allocator.allocated.saturating_sub(used) as u64, Ordering::AcqRel);
                    std::thread::park_timeout(every);
                }
            })
            .context("starting the monitor thread")?;
        Ok(Self { shared, handle: Some(handle) })
    }

    /// The highest values since the last call (and resets them).
    pub fn take(&self) -> Peaks {
        Peaks {
            rss: self.shared.rss.swap(0, Ordering::AcqRel),
            used: self.shared.used.swap(0, Ordering::AcqRel),
            outside_engine: self.shared.outside.swap(0, Ordering::AcqRel),
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// Figures taken after one load. Bytes unless named otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Round (0 = base load).
    pub round: u32,
    /// The load just finished.
    pub load: Load,
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// Duration of the load in milliseconds.
    pub load_ms: f64,
    /// Rows the load wrote or read.
    pub rows: u64,
    /// Whether the load's checks against the model passed (loads without checks: true).
    pub verified: bool,
    /// Engine memory limit.
    pub limit: u64,
    /// Engine accounted bytes.
    pub used: u64,
    /// Engine high-water mark of `used` since the start.
    pub peak: u64,
    /// Current bytes per category, in [`Category::ALL`] order.
    pub categories: Vec<u64>,
    /// Peak bytes per category, in [`Category::ALL`] order.
    pub category_peaks: Vec<u64>,
    /// Allocator `allocated` minus engine `used` (saturating).
    pub outside_engine: u64,
    /// Allocator figures: allocated, active, resident, retained.
    pub alloc_allocated: u64,
    /// Allocator active bytes.
    pub alloc_active: u64,
    /// Allocator resident bytes.
    pub alloc_resident: u64,
    /// Allocator retained bytes (virtual, not returned to the OS).
    pub alloc_retained: u64,
    /// `VmRSS`.
    pub rss: u64,
    /// `VmHWM`.
    pub vmhwm: u64,
    /// Highest RSS seen during the load (monitor thread and this sample).
    pub rss_max: u64,
    /// Highest engine `used` seen during the load.
    pub used_max: u64,
    /// Highest outside-engine bytes seen during the load.
    pub outside_engine_max: u64,
    /// Live tables.
    pub tables: u64,
    /// Data files over all tables.
    pub files: u64,
    /// Key-index bytes over all tables ([`gritdb::TableStats::key_index_bytes`]).
    pub key_index_bytes: u64,
    /// Manifest commits (flushes) so far over all live tables (sum of
    /// [`gritdb::TableStats::manifest_version`]).
    pub commits: u64,
    /// Create/drop load only: accounted bytes after the drops minus before the creates.
    pub create_drop_residual: Option<i64>,
    /// Create/drop load only: accounted bytes per empty table just after the creates.
    pub empty_table_bytes: Option<f64>,
}

/// Per-load figures the caller measures; the rest are read from the engine.
#[derive(Debug, Clone, Copy)]
pub struct LoadFigures {
    /// Round.
    pub round: u32,
    /// Load.
    pub load: Load,
    /// Seconds since the run started.
    pub elapsed_s: f64,
    /// Load duration in milliseconds.
    pub load_ms: f64,
    /// Rows written or read.
    pub rows: u64,
    /// Checks passed.
    pub verified: bool,
    /// Create/drop residual.
    pub create_drop_residual: Option<i64>,
    /// Bytes per empty table.
    pub empty_table_bytes: Option<f64>,
    /// Peaks seen by the monitor during the load.
    pub peaks: Peaks,
}

impl Sample {
    /// Reads the engine's memory report and every table's stats.
    pub fn take(engine: &Engine, f: LoadFigures) -> Sample {
        let mut files = 0u64;
        let mut key_index = 0u64;
        let mut commits = 0u64;
        let names = engine.table_names();
        for name in &names {
            if let Ok(stats) = engine.table(name).and_then(|t| t.stats()) {
                files += stats.files as u64;
                key_index += stats.key_index_bytes as u64;
                commits += stats.manifest_version;
            }
        }
        let r = engine.memory_report();
        let cat = |c: Category| r.categories.iter().find(|x| x.category == c);
        let a = r.process.allocator;
        Sample {
            round: f.round,
            load: f.load,
            elapsed_s: f.elapsed_s,
            load_ms: f.load_ms,
            rows: f.rows,
            verified: f.verified,
            limit: r.limit as u64,
            used: r.used as u64,
            peak: r.peak as u64,
            categories: Category::ALL.iter().map(|&c| cat(c).map_or(0, |x| x.bytes as u64)).collect(),
            category_peaks: Category::ALL.iter().map(|&c| cat(c).map_or(0, |x| x.peak_bytes as u64)).collect(),
            outside_engine: r.outside_engine as u64,
            alloc_allocated: a.allocated as u64,
            alloc_active: a.active as u64,
            alloc_resident: a.resident as u64,
            alloc_retained: a.retained as u64,
            rss: r.process.rss as u64,
            vmhwm: r.process.vmhwm as u64,
            rss_max: f.peaks.rss.max(r.process.rss as u64),
            used_max: f.peaks.used.max(r.used as u64),
            outside_engine_max: f.peaks.outside_engine.max(r.outside_engine as u64),
            tables: names.len() as u64,
            files,
            key_index_bytes: key_index,
            commits,
            create_drop_residual: f.create_drop_residual,
            empty_table_bytes: f.empty_table_bytes,
        }
    }

    /// Position on the plot's x axis (rounds; the base load sits at 0).
    pub fn x(&self) -> f64 {
        if self.load == Load::Base { 0.0 } else { f64::from(self.round) - 1.0 + f64::from(self.load.position() + 1) / 4.0 }
    }
}

const FIXED_HEAD: [&str; 7] = ["round", "load", "elapsed_s", "load_ms", "rows", "verified", "limit"];
const MID: [&str; 2] = ["used", "peak"];
const TAIL: [&str; 16] = [
    "outside_engine",
    "alloc_allocated",
    "alloc_active",
    "alloc_resident",
    "alloc_retained",
    "rss",
    "vmhwm",
    "rss_max",
    "used_max",
    "outside_engine_max",
    "tables",
    "files",
    "key_index_bytes",
    "commits",
    "create_drop_residual",
    "empty_table_bytes",
];

/// The CSV header line (without newline).
pub fn csv_header() -> String {
    let mut cols: Vec<String> = FIXED_HEAD.iter().chain(&MID).map(|s| (*s).to_owned()).collect();
    cols.extend(Category::ALL.iter().map(|c| c.name().to_owned()));
    cols.extend(Category::ALL.iter().map(|c| format!("{}_peak", c.name())));
    cols.extend(TAIL.iter().map(|s| (*s).to_owned()));
    cols.join(",")
}

impl Sample {
    /// One CSV line (without newline), columns as in [`csv_header`].
    pub fn csv_line(&self) -> String {
        let mut s = String::new();
        let _ = write!(
            s,
            "{},{},{:.3},{:.3},{},{},{},{},{}",
            self.round,
            self.load.name(),
            self.elapsed_s,
            self.load_ms,
            self.rows,
            u8::from(self.verified),
            self.limit,
            self.used,
            self.peak
        );
        for v in self.categories.iter().chain(&self.category_peaks) {
            let _ = write!(s, ",{v}");
        }
        let _ = write!(
            s,
            ",{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            self.outside_engine,
            self.alloc_allocated,
            self.alloc_active,
            self.alloc_resident,
            self.alloc_retained,
            self.rss,
            self.vmhwm,
            self.rss_max,
            self.used_max,
            self.outside_engine_max,
            self.tables,
            self.files,
            self.key_index_bytes,
            self.commits,
            self.create_drop_residual.map(|v| v.to_string()).unwrap_or_default(),
            self.empty_table_bytes.map(|v| format!("{v:.1}")).unwrap_or_default(),
        );
        s
    }
}

/// Reads the samples of a `soak.csv`.
///
/// # Errors
/// I/O errors, a missing column, or a value that does not parse (with line and column).
pub fn read_csv(path: &Path) -> Result<Vec<Sample>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_csv(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Parses CSV text as written by [`csv_header`] and [`Sample::csv_line`].
pub fn parse_csv(text: &str) -> Result<Vec<Sample>> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let Some((_, header)) = lines.next() else { bail!("empty file (no header)") };
    let index: HashMap<&str, usize> = header.split(',').enumerate().map(|(i, h)| (h.trim(), i)).collect();
    let col = |name: &str| index.get(name).copied().with_context(|| format!("column `{name}` missing"));
    let cat_cols: Vec<usize> = Category::ALL.iter().map(|c| col(c.name())).collect::<Result<_>>()?;
    let cat_peak_cols: Vec<usize> = Category::ALL.iter().map(|c| col(&format!("{}_peak", c.name()))).collect::<Result<_>>()?;
    let mut out = Vec::new();
    for (lineno, line) in lines {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |name: &str| -> Result<&str> {
            let i = col(name)?;
            fields.get(i).copied().with_context(|| format!("line {}: column `{name}` missing", lineno + 1))
        };
        let num = |name: &str| -> Result<u64> {
            let v = get(name)?;
            v.parse().with_context(|| format!("line {}: `{name}` = `{v}` is not a whole number", lineno + 1))
        };
        let float = |name: &str| -> Result<f64> {
            let v = get(name)?;
            v.parse().with_context(|| format!("line {}: `{name}` = `{v}` is not a number", lineno + 1))
        };
        let at = |i: usize| -> Result<u64> {
            let v = fields.get(i).copied().with_context(|| format!("line {}: too few columns", lineno + 1))?;
            v.parse().with_context(|| format!("line {}: `{v}` is not a whole number", lineno + 1))
        };
        let load_name = get("load")?;
        let residual = get("create_drop_residual")?;
        let empty = get("empty_table_bytes")?;
        out.push(Sample {
            round: u32::try_from(num("round")?).context("round out of range")?,
            load: Load::parse(load_name).with_context(|| format!("line {}: unknown load `{load_name}`", lineno + 1))?,
            elapsed_s: float("elapsed_s")?,
            load_ms: float("load_ms")?,
            rows: num("rows")?,
            verified: num("verified")? == 1,
            limit: num("limit")?,
            used: num("used")?,
            peak: num("peak")?,
            categories: cat_cols.iter().map(|&i| at(i)).collect::<Result<_>>()?,
            category_peaks: cat_peak_cols.iter().map(|&i| at(i)).collect::<Result<_>>()?,
            outside_engine: num("outside_engine")?,
            alloc_allocated: num("alloc_allocated")?,
            alloc_active: num("alloc_active")?,
            alloc_resident: num("alloc_resident")?,
            alloc_retained: num("alloc_retained")?,
            rss: num("rss")?,
            vmhwm: num("vmhwm")?,
            rss_max: num("rss_max")?,
            used_max: num("used_max")?,
            outside_engine_max: num("outside_engine_max")?,
            tables: num("tables")?,
            files: num("files")?,
            key_index_bytes: num("key_index_bytes")?,
            commits: num("commits")?,
            create_drop_residual: if residual.is_empty() {
                None
            } else {
                Some(residual.parse().with_context(|| format!("line {}: bad create_drop_residual", lineno + 1))?)
            },
            empty_table_bytes: if empty.is_empty() {
                None
            } else {
                Some(empty.parse().with_context(|| format!("line {}: bad empty_table_bytes", lineno + 1))?)
            },
        });
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A sample with distinct values in every field.
    pub(crate) fn sample(round: u32, load: Load) -> Sample {
        let n = Category::ALL.len() as u64;
        Sample {
            round,
            load,
            elapsed_s: 1.25 * f64::from(round),
            load_ms: 12.5,
            rows: 1000,
            verified: true,
            limit: 256 << 20,
            used: 100 << 20,
            peak: 120 << 20,
            categories: (0..n).map(|i| i * 1000 + u64::from(round)).collect(),
            category_peaks: (0..n).map(|i| i * 2000 + 1).collect(),
            outside_engine: 30 << 20,
            alloc_allocated: 130 << 20,
            alloc_active: 131 << 20,
            alloc_resident: 140 << 20,
            alloc_retained: 10 << 20,
            rss: 200 << 20,
            vmhwm: 220 << 20,
            rss_max: 210 << 20,
            used_max: 110 << 20,
            outside_engine_max: 40 << 20,
            tables: 52,
            files: 300,
            key_index_bytes: 5 << 20,
            commits: 7 * u64::from(round),
            create_drop_residual: (load == Load::CreateDrop).then_some(-64),
            empty_table_bytes: (load == Load::CreateDrop).then_some(1024.5),
        }
    }

    #[test]
    fn csv_round_trip() {
        let samples: Vec<Sample> = (1..=3).flat_map(|r| Load::ROUND.into_iter().map(move |l| sample(r, l))).chain([sample(0, Load::Base)]).collect();
        let mut text = csv_header();
        text.push('\n');
        for s in &samples {
            text.push_str(&s.csv_line());
            text.push('\n');
        }
        let back = parse_csv(&text).expect("parse");
        assert_eq!(back, samples);
    }

    #[test]
    fn csv_errors_name_the_problem() {
        let err = parse_csv("").expect_err("empty");
        assert!(err.to_string().contains("empty"));
        let err = parse_csv("round,load\n1,write\n").expect_err("missing column");
        assert!(format!("{err:#}").contains("missing"), "{err:#}");
        let mut text = csv_header();
        text.push('\n');
        text.push_str(&sample(1, Load::Write).csv_line().replacen("write", "nonsense", 1));
        let err = parse_csv(&text).expect_err("bad load");
        assert!(format!("{err:#}").contains("unknown load `nonsense`"), "{err:#}");
    }
}
