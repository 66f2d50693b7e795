//! `gritdb-soak tune`: a short soak per memory limit, each in its own process (so that each
//! limit's peak RSS is its own), then a table (`tune.csv`) and plot (`tune.svg`) of write
//! throughput, flushes per round and peak RSS against the limit.

use crate::cli::TuneArgs;
use crate::report::fmt_bytes;
use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use serde_json::Value;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::process::Command;

/// The figures of one limit's run, read from its `summary.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct TunePoint {
    /// Memory limit in bytes.
    pub limit: u64,
    /// Rounds completed.
    pub rounds: u64,
    /// Write-load rows per second (inserts, updates and deletes).
    pub write_rows_per_s: f64,
    /// Manifest commits (flushes) per round.
    pub flushes_per_round: f64,
    /// Peak RSS (`VmHWM`) at the end of the run, bytes.
    pub peak_rss: u64,
    /// Max over samples of engine used / limit.
    pub used_over_limit: f64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
    /// `pass` / `fail`, or `error: …` when the run stopped early.
    pub verdict: String,
}

impl TunePoint {
    /// Reads a point from a run's `summary.json` value.
    pub fn from_summary(limit: u64, s: &Value) -> Self {
        let f = |k: &str| s.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        let verdict = match s.get("error").and_then(Value::as_str) {
            Some(e) => format!("error: {}", e.lines().next().unwrap_or(e)),
            None => s.get("verdict").and_then(Value::as_str).unwrap_or("unknown").to_owned(),
        };
        Self {
            limit,
            rounds: s.get("rounds").and_then(Value::as_u64).unwrap_or(0),
            write_rows_per_s: s.pointer("/loads/write/rows_per_s").and_then(Value::as_f64).unwrap_or(0.0),
            flushes_per_round: f("commits_per_round"),
            peak_rss: s.get("vmhwm_last").and_then(Value::as_u64).unwrap_or(0),
            used_over_limit: f("engine_used_max_over_limit"),
            wall_s: f("wall_seconds"),
            verdict,
        }
    }
}

/// Runs `tune`. Returns `true` when every limit's run passed.
///
/// # Errors
/// When the output directory cannot be written or a run cannot be started.
pub fn tune(args: &TuneArgs) -> Result<bool> {
    fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let me = std::env::current_exe().context("locating this executable")?;
    let mut points = Vec::new();
    for &limit in &args.limits {
        let name = format!("limit-{}", limit >> 20);
        let out = args.out.join(&name);
        let data = args.data_dir.join(format!("tune-{name}"));
        eprintln!("gritdb-soak tune: {} rounds with limit {} -> {}", args.rounds, fmt_bytes(limit as f64), out.display());
        // The run's own end-of-run table goes to `run.txt` in its directory; its progress
        // lines (stderr) stay on the terminal.
        fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        let run_txt = fs::File::create(out.join("run.txt")).with_context(|| format!("creating {}", out.join("run.txt").display()))?;
        let status = Command::new(&me)
            .arg("run")
            .args(["--rounds", &args.rounds.to_string()])
            .args(["--tables", &args.tables.to_string()])
            .args(["--scale", &args.scale.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args(["--memory-limit", &limit.to_string()])
            .args(["--allocator", args.allocator.name()])
            .arg("--out")
            .arg(&out)
            .arg("--data-dir")
            .arg(&data)
            .stdout(run_txt)
            .status()
            .with_context(|| format!("starting {}", me.display()))?;
        let summary = fs::read_to_string(out.join("summary.json")).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok());
        let point = match summary {
            Some(s) => TunePoint::from_summary(limit, &s),
            None => TunePoint {
                limit,
                rounds: 0,
                write_rows_per_s: 0.0,
                flushes_per_round: 0.0,
                peak_rss: 0,
                used_over_limit: 0.0,
                wall_s: 0.0,
                verdict: format!("error: run exited with {status} and wrote no summary"),
            },
        };
        let _ = fs::remove_dir_all(&data);
        points.push(point);
    }
    let csv = tune_csv(&points);
    let path = args.out.join("tune.csv");
    fs::write(&path, &csv).with_context(|| format!("writing {}", path.display()))?;
    let svg = args.out.join("tune.svg");
    render(&points, &svg)?;
    println!("{}", tune_table(&points));
    println!("wrote {}, {}", path.display(), svg.display());
    Ok(points.iter().all(|p| p.verdict == "pass"))
}

/// `tune.csv`: one line per limit.
pub fn tune_csv(points: &[TunePoint]) -> String {
    let mut s = String::from("limit_bytes,rounds,write_rows_per_s,flushes_per_round,peak_rss_bytes,engine_used_max_over_limit,wall_s,verdict\n");
    for p in points {
        let _ = writeln!(
            s,
            "{},{},{:.0},{:.2},{},{:.3},{:.1},{}",
            p.limit,
            p.rounds,
            p.write_rows_per_s,
            p.flushes_per_round,
            p.peak_rss,
            p.used_over_limit,
            p.wall_s,
            p.verdict.replace(',', ";")
        );
    }
    s
}

/// The table printed at the end of `tune`.
pub fn tune_table(points: &[TunePoint]) -> String {
    let mut s = format!(
        "{:>10} {:>7} {:>14} {:>14} {:>12} {:>10} {:>8}  verdict\n",
        "limit", "rounds", "write rows/s", "flushes/round", "peak RSS", "used/limit", "wall s"
    );
    for p in points {
        let _ = writeln!(
            s,
            "{:>10} {:>7} {:>14.0} {:>14.1} {:>12} {:>10.3} {:>8.1}  {}",
            fmt_bytes(p.limit as f64),
            p.rounds,
            p.write_rows_per_s,
            p.flushes_per_round,
            fmt_bytes(p.peak_rss as f64),
            p.used_over_limit,
            p.wall_s,
            p.verdict
        );
    }
    s
}

/// Three panels against the limit (MiB, log scale): write throughput, flushes per round,
/// peak RSS (with the limit itself as a dashed reference).
fn render(points: &[TunePoint], path: &Path) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1100, 900)).into_drawing_area();
        draw(&root, points).map_err(|e| anyhow!("drawing the tune plot: {e}"))?;
        root.present().map_err(|e| anyhow!("rendering the tune plot: {e}"))?;
    }
    fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
}

/// A panel: y-axis name, how to read the value, colour.
type Panel = (&'static str, fn(&TunePoint) -> f64, RGBColor);

fn draw(root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>, points: &[TunePoint]) -> std::result::Result<(), Box<dyn std::error::Error>> {
    const MIB: f64 = 1024.0 * 1024.0;
    root.fill(&WHITE)?;
    let root = root.titled("gritdb soak tune: figures against the memory limit", ("sans-serif", 22))?;
    let panels = root.split_evenly((3, 1));
    let xs: Vec<f64> = points.iter().map(|p| p.limit as f64 / MIB).collect();
    let x_min = xs.iter().copied().fold(f64::INFINITY, f64::min).max(1.0) / 1.3;
    let x_max = xs.iter().copied().fold(1.0, f64::max) * 1.3;
    let panel: [Panel; 3] = [
        ("write rows/s", |p| p.write_rows_per_s, RGBColor(31, 119, 180)),
        ("flushes per round", |p| p.flushes_per_round, RGBColor(44, 160, 44)),
        ("peak RSS (MiB)", |p| p.peak_rss as f64 / MIB, RGBColor(214, 39, 40)),
    ];
    for (area, (name, f, color)) in panels.iter().zip(panel) {
        let y_max = points.iter().map(f).fold(0.0, f64::max).max(if name.starts_with("peak") { x_max } else { 1.0 }) * 1.1;
        let mut chart =
            ChartBuilder::on(area).margin(10).x_label_area_size(35).y_label_area_size(80).build_cartesian_2d((x_min..x_max).log_scale(), 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc("memory limit (MiB, log scale)")
            .y_desc(name)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .draw()?;
        chart
            .draw_series(LineSeries::new(points.iter().map(|p| (p.limit as f64 / MIB, f(p))), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|p| Circle::new((p.limit as f64 / MIB, f(p)), 4, color.filled())))?;
        if name.starts_with("peak") {
            chart
                .draw_series(DashedLineSeries::new(points.iter().map(|p| (p.limit as f64 / MIB, p.limit as f64 / MIB)), 6, 4, BLACK.stroke_width(1)))?
                .label("limit")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(1)));
        }
        chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_from_summaries_and_table() {
        let s: Value = serde_json::json!({
            "rounds": 10, "commits_per_round": 6.5, "vmhwm_last": 300u64 << 20,
            "engine_used_max_over_limit": 0.5, "wall_seconds": 20.0, "verdict": "pass",
            "loads": { "write": { "rows_per_s": 400_000.0 } }, "error": null
        });
        let p = TunePoint::from_summary(256 << 20, &s);
        assert_eq!((p.rounds, p.verdict.as_str()), (10, "pass"));
        assert!((p.write_rows_per_s - 400_000.0).abs() < 1e-9);
        let e: Value = serde_json::json!({ "rounds": 2, "error": "round 3: memory limit\\nmore" });
        let q = TunePoint::from_summary(64 << 20, &e);
        assert!(q.verdict.starts_with("error: round 3"));
        let csv = tune_csv(&[p.clone(), q.clone()]);
        assert_eq!(csv.lines().count(), 3);
        assert!(tune_table(&[p.clone(), q.clone()]).contains("256.0 MiB"));
        let dir = std::env::temp_dir().join(format!("gritdb-soak-tune-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        render(&[q, p], &dir.join("tune.svg")).expect("render");
        assert!(fs::read_to_string(dir.join("tune.svg")).expect("svg").contains("peak RSS"));
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
