//! `soak.svg`: memory against the round, and the key index / file count below it.
//!
//! Top panel (MiB): RSS, `VmHWM`, engine used and outside-engine (each also with its highest
//! value during each load, dotted), allocator resident, and the memory limit as a dashed line. Bottom
//! panel: key-index MiB (left axis) and data files (right axis). Runs of more than 30 rounds
//! draw the in-load peaks as the highest value of each round. Every sample is drawn: a round's four samples sit at `round - 0.75`,
//! `- 0.5`, `- 0.25` and `round`; the base load at 0.

use crate::sample::Sample;
use anyhow::{Context, Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

const MIB: f64 = 1024.0 * 1024.0;
/// Runs longer than this draw in-load peaks per round instead of per sample.
const PEAKS_PER_SAMPLE_ROUNDS: u32 = 30;

/// The highest value of `f` over each round's samples (MiB), at `x = round`.
fn round_maxima(samples: &[Sample], f: fn(&Sample) -> u64) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = Vec::new();
    let mut current: Option<(u32, u64)> = None;
    for s in samples {
        current = match current {
            Some((r, v)) if r == s.round => Some((r, v.max(f(s)))),
            Some((r, v)) => {
                out.push((f64::from(r), v as f64 / MIB));
                Some((s.round, f(s)))
            }
            None => Some((s.round, f(s))),
        };
    }
    if let Some((r, v)) = current {
        out.push((f64::from(r), v as f64 / MIB));
    }
    out
}

/// Renders `samples` as an SVG file at `path`.
pub fn render(samples: &[Sample], title: &str, path: &Path) -> Result<()> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1100, 800)).into_drawing_area();
        draw(&root, samples, title).map_err(|e| anyhow!("drawing the plot: {e}"))?;
        root.present().map_err(|e| anyhow!("rendering the plot: {e}"))?;
    }
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))
}

/// A plotted figure: legend name, colour and how to read it from a sample.
type Series = (&'static str, RGBColor, fn(&Sample) -> u64);

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw(root: &DrawingArea<SVGBackend<'_>, Shift>, samples: &[Sample], title: &str) -> DrawResult {
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(560);
    let x_max = samples.iter().map(Sample::x).fold(1.0, f64::max);
    let limit = samples.last().map_or(0.0, |s| s.limit as f64 / MIB);

    let series: [Series; 5] = [
        ("RSS", RGBColor(31, 119, 180), |s| s.rss),
        ("VmHWM", RGBColor(214, 39, 40), |s| s.vmhwm),
        ("engine used", RGBColor(44, 160, 44), |s| s.used),
        ("outside-engine", RGBColor(255, 127, 14), |s| s.outside_engine),
        ("allocator resident", RGBColor(148, 103, 189), |s| s.alloc_resident),
    ];
    let y_max = samples
        .iter()
        .flat_map(|s| series.iter().map(move |(_, _, f)| f(s) as f64 / MIB))
        .chain(samples.iter().flat_map(|s| [s.outside_engine_max, s.used_max].map(|v| v as f64 / MIB)))
        .fold(limit, f64::max)
        * 1.4; // headroom above the lines for the legend

    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max.max(1.0))?;
    chart.configure_mesh().x_desc("round").y_desc("memory (MiB)").y_label_formatter(&|v| format!("{v:.0}")).x_label_formatter(&|v| format!("{v:.0}")).draw()?;
    for (name, color, f) in series {
        chart
            .draw_series(LineSeries::new(samples.iter().map(|s| (s.x(), f(s) as f64 / MIB)), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    // Highest values during each load (monitor thread), dotted in the colour of the series.
    // Up to PEAKS_PER_SAMPLE_ROUNDS rounds every load's peak is drawn; above, the highest of
    // each round's loads at `x = round`, so that a long run stays readable.
    let per_round = samples.last().is_some_and(|s| s.round > PEAKS_PER_SAMPLE_ROUNDS);
    let peaks: [Series; 3] = [
        ("RSS, max during load", RGBColor(31, 119, 180), |s| s.rss_max),
        ("engine used, max during load", RGBColor(44, 160, 44), |s| s.used_max),
        ("outside-engine, max during load", RGBColor(255, 127, 14), |s| s.outside_engine_max),
    ];
    for (name, color, f) in peaks {
        let points = if per_round { round_maxima(samples, f) } else { samples.iter().map(|s| (s.x(), f(s) as f64 / MIB)).collect() };
        let name = if per_round { name.replace("during load", "during round") } else { name.to_owned() };
        chart
            .draw_series(DashedLineSeries::new(points, 3, 3, color.mix(0.8).stroke_width(1)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1)));
    }
    chart
        .draw_series(DashedLineSeries::new([(0.0, limit), (x_max, limit)], 8, 6, BLACK.stroke_width(2)))?
        .label(format!("memory limit ({limit:.0} MiB)"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    chart.configure_series_labels().position(SeriesLabelPosition::UpperRight).background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;

    let ki_max = samples.iter().map(|s| s.key_index_bytes as f64 / MIB).fold(1.0, f64::max) * 1.1;
    let files_max = samples.iter().map(|s| s.files as f64).fold(1.0, f64::max) * 1.1;
    let mut low = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .right_y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..ki_max)?
        .set_secondary_coord(0.0..x_max, 0.0..files_max);
    low.configure_mesh()
        .x_desc("round")
        .y_desc("key index (MiB)")
        .y_label_formatter(&|v| format!("{v:.1}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    low.configure_secondary_axes().y_desc("data files").y_label_formatter(&|v| format!("{v:.0}")).draw()?;
    let ki = RGBColor(23, 190, 207);
    let fc = RGBColor(127, 127, 127);
    low.draw_series(LineSeries::new(samples.iter().map(|s| (s.x(), s.key_index_bytes as f64 / MIB)), ki.stroke_width(2)))?
        .label("key index (MiB, left)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], ki.stroke_width(2)));
    low.draw_secondary_series(LineSeries::new(samples.iter().map(|s| (s.x(), s.files as f64)), fc.stroke_width(2)))?
        .label("data files (right)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], fc.stroke_width(2)));
    low.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Load;
    use crate::sample::tests::sample;

    #[test]
    fn round_maxima_take_the_highest_load_of_each_round() {
        let mut samples: Vec<Sample> = (1..=2).flat_map(|r| Load::ROUND.into_iter().map(move |l| sample(r, l))).collect();
        samples[1].rss_max = 300 << 20;
        samples[6].rss_max = 400 << 20;
        assert_eq!(round_maxima(&samples, |s| s.rss_max), vec![(1.0, 300.0), (2.0, 400.0)]);
    }

    #[test]
    fn renders_an_svg_with_legend() {
        let samples: Vec<Sample> =
            std::iter::once(sample(0, Load::Base)).chain((1..=4).flat_map(|r| Load::ROUND.into_iter().map(move |l| sample(r, l)))).collect();
        let dir = std::env::temp_dir().join(format!("gritdb-soak-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("soak.svg");
        render(&samples, "test", &path).expect("render");
        let svg = std::fs::read_to_string(&path).expect("read");
        assert!(svg.starts_with("<svg"));
        for label in ["RSS", "VmHWM", "engine used", "outside-engine", "memory limit", "memory (MiB)", "round"] {
            assert!(svg.contains(label), "missing {label}");
        }
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
