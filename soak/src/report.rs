//! The summary of a run (`summary.json`): first/last figures, least-squares growth per round,
//! checks against thresholds and the verdict. Computed from samples alone, so
//! `gritdb-soak report DIR` recomputes it from `soak.csv`.

use crate::sample::{Load, Sample};
use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Verdict thresholds (the defaults are documented in `docs/soak.md`).
#[derive(Debug, Clone, Serialize)]
pub struct Thresholds {
    /// Fraction of the rounds treated as warm-up and left out of the slopes (at least one round).
    pub warmup_fraction: f64,
    /// Slopes are only checked when at least this many rounds follow the warm-up.
    pub min_rounds_for_slopes: u32,
    /// `VmHWM` slope limit as a fraction of the memory limit per round (0.0005 = 0.05%).
    pub vmhwm_slope_max_fraction_of_limit: f64,
    /// `VmHWM` slope limit in bytes per round (the fraction applied to this run's limit).
    pub vmhwm_slope_max_bytes_per_round: f64,
    /// Outside-engine slope limit in bytes per round.
    pub outside_engine_slope_max_bytes_per_round: f64,
    /// Largest allowed engine `used / limit` at any sample.
    pub engine_used_max_over_limit: f64,
    /// Largest allowed create/drop residual in bytes.
    pub create_drop_residual_max_bytes: i64,
}

impl Thresholds {
    /// The default thresholds for a run with `limit` bytes.
    pub fn defaults(limit: u64) -> Self {
        let fraction = 0.0005;
        Self {
            warmup_fraction: 0.1,
            min_rounds_for_slopes: 20,
            vmhwm_slope_max_fraction_of_limit: fraction,
            vmhwm_slope_max_bytes_per_round: fraction * limit as f64,
            outside_engine_slope_max_bytes_per_round: 64.0 * 1024.0,
            engine_used_max_over_limit: 1.0,
            create_drop_residual_max_bytes: 0,
        }
    }

    /// Warm-up rounds for a run of `rounds` rounds: `ceil(rounds * warmup_fraction)`, at least 1.
    pub fn warmup_rounds(&self, rounds: u32) -> u32 {
        ((f64::from(rounds) * self.warmup_fraction).ceil() as u32).max(1)
    }
}

/// One line of the verdict table.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What is checked.
    pub name: String,
    /// The measured value, formatted.
    pub value: String,
    /// The threshold, formatted.
    pub threshold: String,
    /// Whether the check applied (slope checks need enough rounds).
    pub checked: bool,
    /// Whether it passed (`true` when not checked).
    pub pass: bool,
}

/// Mean duration and rows of one load over the run.
#[derive(Debug, Clone, Serialize)]
pub struct LoadStats {
    /// Samples of this load.
    pub count: u32,
    /// Mean duration in milliseconds.
    pub mean_ms: f64,
    /// Largest duration in milliseconds.
    pub max_ms: f64,
    /// Rows per second over the run (rows / total duration).
    pub rows_per_s: f64,
}

/// The content of `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Rounds completed.
    pub rounds: u32,
    /// Data verified against the model in every load of every round, and no error.
    pub verified: bool,
    /// Engine memory limit in bytes.
    pub limit_bytes: u64,
    /// Rounds left out of the slopes.
    pub warmup_rounds: u32,
    /// Whether enough rounds followed the warm-up for the slope checks to apply.
    pub slope_checked: bool,
    /// Seconds from start to the last sample.
    pub wall_seconds: f64,
    /// `VmHWM` at the end of round 1.
    pub vmhwm_first: u64,
    /// `VmHWM` at the end of the last round.
    pub vmhwm_last: u64,
    /// RSS at the end of round 1.
    pub rss_first: u64,
    /// RSS at the end of the last round.
    pub rss_last: u64,
    /// Outside-engine bytes at the end of round 1.
    pub outside_engine_first: u64,
    /// Outside-engine bytes at the end of the last round.
    pub outside_engine_last: u64,
    /// Engine accounted bytes at the end of round 1.
    pub engine_used_first: u64,
    /// Engine accounted bytes at the end of the last round.
    pub engine_used_last: u64,
    /// Least-squares slope of end-of-round `VmHWM` after the warm-up, bytes per round.
    pub vmhwm_slope_bytes_per_round: Option<f64>,
    /// Least-squares slope of end-of-round RSS after the warm-up, bytes per round.
    pub rss_slope_bytes_per_round: Option<f64>,
    /// Least-squares slope of end-of-round outside-engine bytes after the warm-up.
    pub outside_engine_slope_bytes_per_round: Option<f64>,
    /// Least-squares slope of end-of-round engine `used` after the warm-up.
    pub engine_used_slope_bytes_per_round: Option<f64>,
    /// Least-squares slope of end-of-round key-index bytes after the warm-up.
    pub key_index_slope_bytes_per_round: Option<f64>,
    /// Least-squares slope of end-of-round data-file count after the warm-up.
    pub files_slope_per_round: Option<f64>,
    /// Outside-engine bytes / allocator `allocated` at the last sample.
    pub outside_engine_share_last: f64,
    /// Max over samples of engine `used / limit` (including the monitor's readings during
    /// each load).
    pub engine_used_max_over_limit: f64,
    /// Highest outside-engine bytes seen during any load (monitor thread).
    pub outside_engine_max: u64,
    /// Highest RSS seen during any load (monitor thread; `VmHWM` is the kernel's exact peak).
    pub rss_max: u64,
    /// Engine high-water mark / limit at the last sample.
    pub engine_peak_over_limit: f64,
    /// Max over rounds of accounted bytes after the round's drops minus before its creates.
    pub create_drop_residual_bytes: i64,
    /// Max over rounds of accounted bytes per empty table just after the creates.
    pub empty_table_bytes: f64,
    /// Data files at the last sample.
    pub files_last: u64,
    /// Manifest commits (flushes) per round over the persistent tables: (commits at the end
    /// of the last round − commits after the base load) / rounds.
    pub commits_per_round: f64,
    /// Key-index bytes at the last sample.
    pub key_index_bytes_last: u64,
    /// Duration and throughput per load.
    pub loads: BTreeMap<String, LoadStats>,
    /// The thresholds applied.
    pub thresholds: Thresholds,
    /// Every check with its value and result.
    pub checks: Vec<Check>,
    /// `"pass"` or `"fail"`.
    pub verdict: String,
    /// The error that stopped the run early, if any.
    pub error: Option<String>,
    /// The run's settings (flags, allocator, versions).
    pub config: serde_json::Value,
}

/// Least-squares slope of `y` over `x`; `None` with fewer than two points or constant `x`.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    Some(sxy / sxx)
}

/// Formats a byte count with a binary unit (signed, fractional).
pub fn fmt_bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = v.abs();
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    let sign = if v < 0.0 { "-" } else { "" };
    if u == 0 { format!("{sign}{x:.0} B") } else { format!("{sign}{x:.1} {}", UNITS[u]) }
}

/// The last sample of each completed round (after load 4), by round.
pub fn end_of_round(samples: &[Sample]) -> Vec<&Sample> {
    samples.iter().filter(|s| s.load == Load::Mixed).collect()
}

/// Computes the summary of `samples`. `error` is the error that stopped the run, if any;
/// `config` is recorded as given.
pub fn summarize(samples: &[Sample], error: Option<String>, config: serde_json::Value) -> Result<Summary> {
    let last = samples.last().context("no samples")?;
    let limit = last.limit;
    let th = Thresholds::defaults(limit);
    let ends = end_of_round(samples);
    let rounds = ends.last().map_or(0, |s| s.round);
    let warmup = th.warmup_rounds(rounds);
    let after: Vec<&&Sample> = ends.iter().filter(|s| s.round > warmup).collect();
    let slope_checked = after.len() >= th.min_rounds_for_slopes as usize;
    let slope_of = |f: fn(&Sample) -> f64| slope(&after.iter().map(|s| (f64::from(s.round), f(s))).collect::<Vec<_>>());
    let first = ends.first().copied();
    let lastr = ends.last().copied();
    let pick = |s: Option<&Sample>, f: fn(&Sample) -> u64| s.map_or(0, f);

    let verified = error.is_none() && rounds > 0 && samples.iter().all(|s| s.verified);
    let used_max = samples.iter().map(|s| s.used.max(s.used_max) as f64 / s.limit.max(1) as f64).fold(0.0, f64::max);
    let residual = samples.iter().filter_map(|s| s.create_drop_residual).max().unwrap_or(0);
    let empty = samples.iter().filter_map(|s| s.empty_table_bytes).fold(0.0, f64::max);
    let vmhwm_slope = slope_of(|s| s.vmhwm as f64);
    let outside_slope = slope_of(|s| s.outside_engine as f64);

    let mut loads: BTreeMap<String, LoadStats> = BTreeMap::new();
    for load in Load::ROUND {
        let of: Vec<&Sample> = samples.iter().filter(|s| s.load == load).collect();
        if of.is_empty() {
            continue;
        }
        let total_ms: f64 = of.iter().map(|s| s.load_ms).sum();
        let rows: u64 = of.iter().map(|s| s.rows).sum();
        loads.insert(
            load.name().to_owned(),
            LoadStats {
                count: of.len() as u32,
                mean_ms: total_ms / of.len() as f64,
                max_ms: of.iter().map(|s| s.load_ms).fold(0.0, f64::max),
                rows_per_s: if total_ms > 0.0 { rows as f64 / (total_ms / 1000.0) } else { 0.0 },
            },
        );
    }

    let not_enough = format!("not checked: {} after {warmup} warm-up, need {}", plural(after.len() as u64, "round"), th.min_rounds_for_slopes);
    let slope_check = |name: &str, v: Option<f64>, max: f64| -> Check {
        let checked = slope_checked && v.is_some();
        // A slope fitted over too few rounds is no verdict: the check shows none (the figures
        // above and the JSON summary keep the fitted value). A trial read "40.8 KiB/round"
        // beside "not checked" as a result.
        let value = match v {
            Some(v) if checked => format!("{}/round", fmt_bytes(v)),
            Some(_) => "-".to_owned(),
            None => "n/a".to_owned(),
        };
        Check {
            name: name.to_owned(),
            value,
            threshold: if checked { format!("<= {}/round", fmt_bytes(max)) } else { not_enough.clone() },
            checked,
            pass: !checked || v.is_some_and(|v| v <= max),
        }
    };
    let checks = vec![
        Check {
            name: "data verified every round".into(),
            value: if verified { "yes".into() } else { "NO".into() },
            threshold: "required".into(),
            checked: true,
            pass: verified,
        },
        Check {
            name: "engine used / limit (max)".into(),
            value: format!("{used_max:.3}"),
            threshold: format!("<= {:.2}", th.engine_used_max_over_limit),
            checked: true,
            pass: used_max <= th.engine_used_max_over_limit,
        },
        Check {
            name: "create/drop residual (max)".into(),
            value: format!("{residual} B"),
            threshold: format!("<= {} B", th.create_drop_residual_max_bytes),
            checked: true,
            pass: residual <= th.create_drop_residual_max_bytes,
        },
        slope_check("VmHWM slope", vmhwm_slope, th.vmhwm_slope_max_bytes_per_round),
        slope_check("outside-engine slope", outside_slope, th.outside_engine_slope_max_bytes_per_round),
    ];
    let verdict = if checks.iter().all(|c| c.pass) { "pass" } else { "fail" };
    Ok(Summary {
        rounds,
        verified,
        limit_bytes: limit,
        warmup_rounds: warmup,
        slope_checked,
        wall_seconds: last.elapsed_s,
        vmhwm_first: pick(first, |s| s.vmhwm),
        vmhwm_last: pick(lastr, |s| s.vmhwm),
        rss_first: pick(first, |s| s.rss),
        rss_last: pick(lastr, |s| s.rss),
        outside_engine_first: pick(first, |s| s.outside_engine),
        outside_engine_last: pick(lastr, |s| s.outside_engine),
        engine_used_first: pick(first, |s| s.used),
        engine_used_last: pick(lastr, |s| s.used),
        vmhwm_slope_bytes_per_round: vmhwm_slope,
        rss_slope_bytes_per_round: slope_of(|s| s.rss as f64),
        outside_engine_slope_bytes_per_round: outside_slope,
        engine_used_slope_bytes_per_round: slope_of(|s| s.used as f64),
        key_index_slope_bytes_per_round: slope_of(|s| s.key_index_bytes as f64),
        files_slope_per_round: slope_of(|s| s.files as f64),
        outside_engine_share_last: if last.alloc_allocated > 0 { last.outside_engine as f64 / last.alloc_allocated as f64 } else { 0.0 },
        engine_used_max_over_limit: used_max,
        outside_engine_max: samples.iter().map(|s| s.outside_engine_max).max().unwrap_or(0),
        rss_max: samples.iter().map(|s| s.rss_max).max().unwrap_or(0),
        engine_peak_over_limit: last.peak as f64 / limit.max(1) as f64,
        create_drop_residual_bytes: residual,
        empty_table_bytes: empty,
        files_last: last.files,
        commits_per_round: match (samples.iter().find(|s| s.load == Load::Base), lastr) {
            (Some(b), Some(l)) if rounds > 0 => l.commits.saturating_sub(b.commits) as f64 / f64::from(rounds),
            _ => 0.0,
        },
        key_index_bytes_last: last.key_index_bytes,
        loads,
        thresholds: th,
        checks,
        verdict: verdict.to_owned(),
        error,
        config,
    })
}

/// `n` and `noun`, with an `s` unless `n` is 1 ("1 round", "3 rounds").
pub(crate) fn plural(n: u64, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

impl Summary {
    /// The short table printed at the end of a run.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let b = |v: u64| fmt_bytes(v as f64);
        let _ = writeln!(
            s,
            "gritdb soak: {} in {:.1} s, limit {}, warm-up {}",
            plural(u64::from(self.rounds), "round"),
            self.wall_seconds,
            b(self.limit_bytes),
            plural(u64::from(self.warmup_rounds), "round")
        );
        let _ = writeln!(s, "{:<22} {:>12} {:>12} {:>16}", "figure", "round 1", "last round", "slope/round");
        let sl = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), fmt_bytes);
        for (name, first, last, slope) in [
            ("RSS", self.rss_first, self.rss_last, self.rss_slope_bytes_per_round),
            ("VmHWM", self.vmhwm_first, self.vmhwm_last, self.vmhwm_slope_bytes_per_round),
            ("outside-engine", self.outside_engine_first, self.outside_engine_last, self.outside_engine_slope_bytes_per_round),
            ("engine used", self.engine_used_first, self.engine_used_last, self.engine_used_slope_bytes_per_round),
        ] {
            let _ = writeln!(s, "{name:<22} {:>12} {:>12} {:>16}", b(first), b(last), sl(slope));
        }
        // The slopes are fitted either way; say which of them the verdict reads, so a short
        // run's warm-up growth is not read as a leak (a 5-round run showed RSS rising 21 MiB a
        // round with no word that no check looks at it).
        let _ = if self.slope_checked {
            writeln!(s, "(checked: the VmHWM and outside-engine slopes; RSS moves with pages the allocator has not returned yet, and is shown only)")
        } else {
            writeln!(
                s,
                "(slopes not checked: {} after the warm-up, {} needed; too few to tell a trend from the warm-up)",
                plural(u64::from(self.rounds.saturating_sub(self.warmup_rounds)), "round"),
                self.thresholds.min_rounds_for_slopes
            )
        };
        let _ = writeln!(
            s,
            "files {}  flushes/round {:.1}  key index {} ({}/round)  empty table {}  outside-engine share {:.1}%",
            self.files_last,
            self.commits_per_round,
            b(self.key_index_bytes_last),
            sl(self.key_index_slope_bytes_per_round),
            fmt_bytes(self.empty_table_bytes),
            self.outside_engine_share_last * 100.0
        );
        let _ = writeln!(
            s,
            "peaks during loads: RSS {}  outside-engine {}  engine used/limit {:.3} (high-water mark {:.3})",
            b(self.rss_max),
            b(self.outside_engine_max),
            self.engine_used_max_over_limit,
            self.engine_peak_over_limit
        );
        let _ = writeln!(s, "{:<28} {:>18}  {:<40} result", "check", "value", "threshold");
        for c in &self.checks {
            let result = match (c.checked, c.pass) {
                (false, _) => "-",
                (true, true) => "pass",
                (true, false) => "FAIL",
            };
            let _ = writeln!(s, "{:<28} {:>18}  {:<40} {result}", c.name, c.value, c.threshold);
        }
        if let Some(e) = &self.error {
            let _ = writeln!(s, "error: {e}");
        }
        let _ = writeln!(s, "verdict: {}", self.verdict.to_uppercase());
        s
    }

    /// Writes `summary.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join("summary.json");
        let json = serde_json::to_string_pretty(self).context("serializing summary")?;
        std::fs::write(&path, json + "\n").with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::tests::sample;

    #[test]
    fn counts_read_as_words() {
        assert_eq!(plural(0, "round"), "0 rounds");
        assert_eq!(plural(1, "round"), "1 round");
        assert_eq!(plural(200, "round"), "200 rounds");
    }

    #[test]
    fn least_squares_slope() {
        assert_eq!(slope(&[]), None);
        assert_eq!(slope(&[(1.0, 5.0)]), None);
        assert_eq!(slope(&[(2.0, 1.0), (2.0, 3.0)]), None);
        let line: Vec<(f64, f64)> = (0..10).map(|x| (f64::from(x), 3.0 * f64::from(x) + 7.0)).collect();
        assert!((slope(&line).expect("slope") - 3.0).abs() < 1e-9);
        // Symmetric noise around a flat line gives slope 0.
        let flat = [(1.0, 10.0), (2.0, 12.0), (3.0, 10.0), (4.0, 12.0), (5.0, 11.0)];
        assert!(slope(&flat).expect("slope").abs() < 0.5);
        let noisy = [(1.0, 1.0), (2.0, 3.0), (3.0, 2.0), (4.0, 5.0)];
        assert!((slope(&noisy).expect("slope") - 1.1).abs() < 1e-9);
    }

    #[test]
    fn verdict_follows_thresholds() {
        let mut samples = vec![sample(0, Load::Base)];
        for r in 1..=30 {
            for l in Load::ROUND {
                let mut s = sample(r, l);
                s.create_drop_residual = (l == Load::CreateDrop).then_some(0);
                s.vmhwm = 300 << 20;
                samples.push(s);
            }
        }
        let sum = summarize(&samples, None, serde_json::Value::Null).expect("summary");
        assert_eq!(sum.rounds, 30);
        assert_eq!(sum.warmup_rounds, 3);
        assert!(sum.slope_checked);
        assert_eq!(sum.verdict, "pass", "{}", sum.table());
        assert_eq!(sum.vmhwm_slope_bytes_per_round, Some(0.0));

        // VmHWM growing by 1 MiB a round breaks 0.05% of 256 MiB (131 KiB).
        let mut grow = samples.clone();
        for s in &mut grow {
            s.vmhwm += u64::from(s.round) << 20;
        }
        let sum = summarize(&grow, None, serde_json::Value::Null).expect("summary");
        assert_eq!(sum.verdict, "fail");
        assert!((sum.vmhwm_slope_bytes_per_round.expect("slope") - f64::from(1 << 20)).abs() < 1.0);

        // Few rounds: slopes not checked, but a residual still fails.
        let mut few: Vec<Sample> = samples.iter().filter(|s| s.round <= 3).cloned().collect();
        let sum = summarize(&few, None, serde_json::Value::Null).expect("summary");
        assert!(!sum.slope_checked);
        assert_eq!(sum.verdict, "pass");
        let vmhwm = sum.checks.iter().find(|c| c.name == "VmHWM slope").expect("VmHWM check");
        assert_eq!((vmhwm.value.as_str(), vmhwm.checked), ("-", false));
        assert_eq!(vmhwm.threshold, "not checked: 2 rounds after 1 warm-up, need 20");
        few[2].create_drop_residual = Some(4096);
        let sum = summarize(&few, None, serde_json::Value::Null).expect("summary");
        assert_eq!(sum.verdict, "fail");
        let sum = summarize(&samples, Some("boom".into()), serde_json::Value::Null).expect("summary");
        assert!(!sum.verified);
        assert_eq!(sum.verdict, "fail");
    }
}
