//! SVG plots of `kvroute-bench` results (the `kvroute-plot` binary; `scripts/bench.sh` draws them
//! beside the `docs/bench-*.md` tables).
//!
//! * [`ratio_svg`]: cached-token ratio per strategy, one marker per series at the median over
//!   its runs, whiskers from the lowest to the highest run;
//! * [`ttft_cdf_svg`]: TTFT cumulative distribution per strategy, from `--records` files;
//! * [`scale_svg`]: cached-token ratio against endpoint count, one line per strategy.
//!
//! Inputs are the JSON files `kvroute-bench` writes (`--json`: `{"summaries": [...]}`;
//! `--records`: `[{"workload", "strategy", "endpoints", "records": [...]}]`). Only the SVG
//! backend of `plotters` is used: text is emitted as `<text>` elements, laid out with plotters'
//! size estimate, so no font or system library is needed.

use std::fmt::Debug;

use anyhow::{anyhow, bail};
use plotters::coord::ranged1d::AsRangedCoord;
use plotters::prelude::*;
use serde_json::Value;

/// Width and height of every plot, px.
pub const SIZE: (u32, u32) = (800, 440);
/// Line width of data series (axes and grid are 1 px), which tells series apart in the SVG.
pub const SERIES_WIDTH: u32 = 2;

/// One series of the ratio plot: a name and the `--json` documents of its runs.
pub struct RatioSeries {
    /// Legend name.
    pub name: String,
    /// One `kvroute-bench --json` document per run.
    pub runs: Vec<Value>,
}

fn color(i: usize) -> RGBColor {
    const PALETTE: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    PALETTE[i % PALETTE.len()]
}

fn err<E: Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e:?}")
}

/// The chart every plot draws on: x and y axes of these ranges.
type Chart<'a, 'b, X, Y> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<<X as AsRangedCoord>::CoordDescType, <Y as AsRangedCoord>::CoordDescType>,
>;

/// One plot as an SVG string: a white [`SIZE`] canvas, `title`, axes over `axes`; `draw` sets up
/// the mesh and adds the series, then the legend goes at `legend`.
fn svg<X: AsRangedCoord, Y: AsRangedCoord>(
    title: &str,
    axes: (X, Y),
    legend: SeriesLabelPosition,
    draw: impl FnOnce(&mut Chart<'_, '_, X, Y>) -> anyhow::Result<()>,
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(axes.0, axes.1)
            .map_err(err)?;
        draw(&mut chart)?;
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// The legend's marker for a series drawn in `c`.
fn swatch(c: RGBColor) -> impl Fn((i32, i32)) -> Rectangle<(i32, i32)> {
    move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled())
}

fn summaries(doc: &Value) -> anyhow::Result<&Vec<Value>> {
    doc["summaries"]
        .as_array()
        .ok_or_else(|| anyhow!("not a kvroute-bench --json document: no \"summaries\" array"))
}

fn field<'a>(v: &'a Value, key: &str) -> anyhow::Result<&'a Value> {
    v.get(key)
        .ok_or_else(|| anyhow!("summary without field {key:?}"))
}

fn str_field<'a>(v: &'a Value, key: &str) -> anyhow::Result<&'a str> {
    field(v, key)?
        .as_str()
        .ok_or_else(|| anyhow!("field {key:?} is not a string"))
}

fn num_field(v: &Value, key: &str) -> anyhow::Result<f64> {
    field(v, key)?
        .as_f64()
        .ok_or_else(|| anyhow!("field {key:?} is not a number"))
}

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_string());
    }
}

/// Median of unsorted values (mean of the middle two for an even count); 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// (median, min, max) of one strategy's cached-token ratios (%) over a series' runs; `None` when
/// no run measured it.
pub type Spread = Option<(f64, f64, f64)>;

/// A named line: (x, y) points.
pub type Line = (String, Vec<(f64, f64)>);

/// The strategies of `workload` (in order of first appearance) and per series and strategy the
/// [`Spread`] of the cached-token ratio over its runs.
pub fn ratio_stats(
    series: &[RatioSeries],
    workload: &str,
) -> anyhow::Result<(Vec<String>, Vec<Vec<Spread>>)> {
    let mut strategies = Vec::new();
    for s in series {
        for doc in &s.runs {
            for sum in summaries(doc)? {
                if str_field(sum, "workload")? == workload {
                    push_unique(&mut strategies, str_field(sum, "strategy")?);
                }
            }
        }
    }
    let mut stats = Vec::new();
    for s in series {
        let mut row = Vec::new();
        for st in &strategies {
            let mut ratios = Vec::new();
            for doc in &s.runs {
                for sum in summaries(doc)? {
                    if str_field(sum, "workload")? == workload && str_field(sum, "strategy")? == st
                    {
                        ratios.push(num_field(sum, "cached_ratio")? * 100.0);
                    }
                }
            }
            row.push((!ratios.is_empty()).then(|| {
                let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                (median(&ratios), lo, hi)
            }));
        }
        stats.push(row);
    }
    Ok((strategies, stats))
}

/// Cached-token ratio (%) per strategy of `workload`: per series a marker at the median of its
/// runs and a whisker from the lowest to the highest run.
pub fn ratio_svg(title: &str, workload: &str, series: &[RatioSeries]) -> anyhow::Result<String> {
    let (strategies, stats) = ratio_stats(series, workload)?;
    if strategies.is_empty() {
        bail!("no summaries of workload {workload:?} in the given files");
    }
    let n = strategies.len();
    let x = -0.5f64..(n as f64 - 0.5);
    svg(
        title,
        (x, 0f64..100f64),
        SeriesLabelPosition::UpperRight,
        |chart| {
            let names = strategies.clone();
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(n * 2 + 1)
                .x_label_formatter(&|x| {
                    let r = x.round();
                    if (x - r).abs() < 1e-6 && r >= 0.0 && (r as usize) < names.len() {
                        names[r as usize].clone()
                    } else {
                        String::new()
                    }
                })
                .y_label_formatter(&|y| format!("{y:.0}"))
                .y_desc("cached-token ratio, %")
                .x_desc("strategy")
                .draw()
                .map_err(err)?;
            let k = series.len().max(1) as f64;
            let slot = 0.6 / k;
            for (si, s) in series.iter().enumerate() {
                let c = color(si);
                let offset = -0.3 + slot * (si as f64 + 0.5);
                let points: Vec<(f64, f64, f64, f64)> = stats[si]
                    .iter()
                    .enumerate()
                    .filter_map(|(i, v)| v.map(|(m, lo, hi)| (i as f64 + offset, m, lo, hi)))
                    .collect();
                chart
                    .draw_series(points.iter().map(|&(x, _, lo, hi)| {
                        PathElement::new(vec![(x, lo), (x, hi)], c.stroke_width(SERIES_WIDTH))
                    }))
                    .map_err(err)?;
                chart
                    .draw_series(
                        points
                            .iter()
                            .map(|&(x, m, _, _)| Circle::new((x, m), 5, c.filled())),
                    )
                    .map_err(err)?
                    .label(s.name.clone())
                    .legend(swatch(c));
            }
            Ok(())
        },
    )
}

/// Sorted TTFTs (ms) of the successful requests per (strategy, endpoints) of `workload` in a
/// `--records` document, in file order.
pub fn ttft_samples(records: &Value, workload: &str) -> anyhow::Result<Vec<(String, Vec<f64>)>> {
    let runs = records
        .as_array()
        .ok_or_else(|| anyhow!("not a kvroute-bench --records document: not an array"))?;
    let chosen: Vec<&Value> = runs
        .iter()
        .filter(|r| r["workload"].as_str() == Some(workload))
        .collect();
    let mut sizes = Vec::new();
    for r in &chosen {
        push_unique(&mut sizes, &field(r, "endpoints")?.to_string());
    }
    let mut out = Vec::new();
    for r in chosen {
        let strategy = str_field(r, "strategy")?;
        let name = if sizes.len() > 1 {
            format!("{strategy}, {} endpoints", field(r, "endpoints")?)
        } else {
            strategy.to_string()
        };
        let mut ttft = Vec::new();
        for rec in field(r, "records")?
            .as_array()
            .ok_or_else(|| anyhow!("field \"records\" is not an array"))?
        {
            if rec["error"].is_null() {
                ttft.push(num_field(rec, "ttft_ms")?);
            }
        }
        ttft.sort_by(f64::total_cmp);
        out.push((name, ttft));
    }
    Ok(out)
}

/// TTFT cumulative distribution (log-scaled ms) per strategy of `workload`.
pub fn ttft_cdf_svg(title: &str, workload: &str, records: &Value) -> anyhow::Result<String> {
    let samples = ttft_samples(records, workload)?;
    let all = samples.iter().flat_map(|(_, v)| v.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0f64), |(a, b), x| (a.min(x), b.max(x)));
    if !lo.is_finite() {
        bail!("no successful requests of workload {workload:?} in the records");
    }
    let (lo, hi) = ((lo * 0.9).max(0.01), (hi * 1.1).max(lo * 2.0));
    let axes = ((lo..hi).log_scale(), 0f64..1f64);
    svg(title, axes, SeriesLabelPosition::LowerRight, |chart| {
        chart
            .configure_mesh()
            .x_desc("TTFT, ms (log scale)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_desc("fraction of requests")
            .draw()
            .map_err(err)?;
        for (si, (name, v)) in samples.iter().enumerate() {
            let c = color(si);
            let n = v.len() as f64;
            // A step function: at each sample the fraction rises by 1/n.
            let mut pts = Vec::with_capacity(v.len() * 2 + 1);
            for (i, &x) in v.iter().enumerate() {
                pts.push((x, i as f64 / n));
                pts.push((x, (i + 1) as f64 / n));
            }
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(SERIES_WIDTH)))
                .map_err(err)?
                .label(name.clone())
                .legend(swatch(c));
        }
        Ok(())
    })
}

/// Per strategy of `workload`: (endpoints, cached-token ratio %) sorted by endpoints.
pub fn scale_points(doc: &Value, workload: &str) -> anyhow::Result<Vec<Line>> {
    let mut out: Vec<Line> = Vec::new();
    for s in summaries(doc)? {
        if str_field(s, "workload")? != workload {
            continue;
        }
        let st = str_field(s, "strategy")?;
        let p = (
            num_field(s, "endpoints")?,
            num_field(s, "cached_ratio")? * 100.0,
        );
        match out.iter_mut().find(|(n, _)| n == st) {
            Some((_, v)) => v.push(p),
            None => out.push((st.to_string(), vec![p])),
        }
    }
    for (_, v) in &mut out {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(out)
}

/// Cached-token ratio (%) against endpoints, one line per strategy of `workload`.
pub fn scale_svg(title: &str, workload: &str, doc: &Value) -> anyhow::Result<String> {
    let lines = scale_points(doc, workload)?;
    let xs: Vec<f64> = lines
        .iter()
        .flat_map(|(_, v)| v.iter().map(|p| p.0))
        .collect();
    let (lo, hi) = xs
        .iter()
        .fold((f64::INFINITY, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
    if !lo.is_finite() {
        bail!("no summaries of workload {workload:?} in the given file");
    }
    let x = 0f64..(hi * 1.1).max(lo + 1.0);
    svg(
        title,
        (x, 0f64..100f64),
        SeriesLabelPosition::LowerLeft,
        |chart| {
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_desc("endpoints")
                .y_desc("cached-token ratio, %")
                .y_label_formatter(&|y| format!("{y:.0}"))
                .x_label_formatter(&|x| format!("{x:.0}"))
                .draw()
                .map_err(err)?;
            for (si, (name, v)) in lines.iter().enumerate() {
                let c = color(si);
                chart
                    .draw_series(LineSeries::new(v.clone(), c.stroke_width(SERIES_WIDTH)))
                    .map_err(err)?
                    .label(name.clone())
                    .legend(swatch(c));
                chart
                    .draw_series(v.iter().map(|&p| Circle::new(p, 4, c.filled())))
                    .map_err(err)?;
            }
            Ok(())
        },
    )
}
