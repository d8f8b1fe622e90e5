//! `kvroute-plot`'s plots drawn from small fixtures (ratios from the published pages): each SVG
//! parses as XML and holds the expected series, data points and axis labels.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

use kvroute_engine_sim::bench::plot::{
    ratio_stats, ratio_svg, scale_svg, ttft_cdf_svg, RatioSeries, SERIES_WIDTH,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/plot")
        .join(name)
}

fn load(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(fixture(name)).unwrap()).unwrap()
}

/// What the test reads back from an SVG.
struct Parsed {
    texts: Vec<String>,
    /// Polylines drawn with the series width (data lines and whiskers).
    series_lines: Vec<usize>,
    /// Filled circles (data points).
    circles: usize,
    /// Filled legend swatches (10 x 10 rectangles).
    swatches: usize,
}

fn parse(svg: &str) -> Parsed {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("not XML: {e}\n{svg}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let width = SERIES_WIDTH.to_string();
    let mut p = Parsed {
        texts: Vec::new(),
        series_lines: Vec::new(),
        circles: 0,
        swatches: 0,
    };
    for n in doc.descendants().filter(|n| n.is_element()) {
        match n.tag_name().name() {
            "text" => p.texts.push(n.text().unwrap_or("").trim().to_string()),
            "polyline" if n.attribute("stroke-width") == Some(width.as_str()) => {
                p.series_lines
                    .push(n.attribute("points").unwrap().split_whitespace().count());
            }
            "circle" if n.attribute("fill").is_some_and(|f| f != "none") => p.circles += 1,
            "rect" if n.attribute("width") == Some("10") && n.attribute("height") == Some("10") => {
                p.swatches += 1
            }
            _ => {}
        }
    }
    p
}

fn has(p: &Parsed, text: &str) -> bool {
    p.texts.iter().any(|t| t == text)
}

fn placement_series() -> Vec<RatioSeries> {
    ["staggered", "burst"]
        .iter()
        .map(|a| RatioSeries {
            name: a.to_string(),
            runs: (1..=3)
                .map(|i| load(&format!("placement-{a}-{i}.json")))
                .collect(),
        })
        .collect()
}

#[test]
fn ratio_plot_has_a_median_and_whisker_per_strategy_and_series() {
    let series = placement_series();
    let (strategies, stats) = ratio_stats(&series, "multi-turn").unwrap();
    assert_eq!(
        strategies,
        [
            "round-robin",
            "sticky",
            "kvroute-engine",
            "sglang-router",
            "oracle"
        ]
    );
    // kvroute, staggered, runs 1-3: 71.1, 72.0, 69.0%.
    let (m, lo, hi) = stats[0][2].unwrap();
    assert!((m - 71.1).abs() < 1e-9 && (lo - 69.0).abs() < 1e-9 && (hi - 72.0).abs() < 1e-9);

    let svg = ratio_svg("placement", "multi-turn", &series).unwrap();
    let p = parse(&svg);
    // 2 series x 5 strategies: a median marker and a two-point whisker each; a swatch per series.
    assert_eq!(p.circles, 10, "{svg}");
    assert_eq!(p.series_lines, vec![2; 10]);
    assert_eq!(p.swatches, 2);
    for label in strategies.iter().map(String::as_str).chain([
        "staggered",
        "burst",
        "placement",
        "cached-token ratio, %",
        "strategy",
    ]) {
        assert!(has(&p, label), "no text {label:?} in {:?}", p.texts);
    }
    assert!(
        has(&p, "0") && has(&p, "100"),
        "y axis labels: {:?}",
        p.texts
    );

    assert!(ratio_svg("x", "doc-qa", &series).is_err());
}

#[test]
fn ttft_cdf_has_one_step_line_per_strategy_of_the_workload() {
    let records = load("records.json");
    let svg = ttft_cdf_svg("ttft", "multi-turn", &records).unwrap();
    let p = parse(&svg);
    // Two points per successful request (the step); the failed kvroute request and the doc-qa
    // run are left out.
    let mut lines = p.series_lines.clone();
    lines.sort_unstable();
    assert_eq!(lines, vec![6, 8, 10], "{svg}");
    assert_eq!(p.swatches, 3);
    for label in [
        "round-robin",
        "kvroute-engine",
        "oracle",
        "TTFT, ms (log scale)",
        "fraction of requests",
    ] {
        assert!(has(&p, label), "no text {label:?} in {:?}", p.texts);
    }
    assert!(ttft_cdf_svg("x", "one-shot", &records).is_err());
}

#[test]
fn scale_plot_has_a_line_and_points_per_strategy() {
    let svg = scale_svg("scale", "multi-turn", &load("scale.json")).unwrap();
    let p = parse(&svg);
    assert_eq!(p.series_lines, vec![3, 3, 3], "{svg}");
    assert!(
        has(&p, "0") && has(&p, "100"),
        "y axis labels: {:?}",
        p.texts
    );
    assert_eq!(p.circles, 9);
    assert_eq!(p.swatches, 3);
    for label in [
        "round-robin",
        "kvroute-engine",
        "oracle",
        "endpoints",
        "cached-token ratio, %",
    ] {
        assert!(has(&p, label), "no text {label:?} in {:?}", p.texts);
    }
}

#[test]
fn the_binary_writes_each_plot() {
    let dir = std::env::temp_dir().join(format!("kvroute-plot-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = |n: &str| fixture(n).display().to_string();
    let runs = |a: &str| {
        (1..=3)
            .map(|i| f(&format!("placement-{a}-{i}.json")))
            .collect::<Vec<_>>()
            .join(",")
    };
    let cases: Vec<(&str, Vec<String>)> = vec![
        (
            "ratio",
            vec![
                "--series".into(),
                format!("staggered={}", runs("staggered")),
                "--series".into(),
                format!("burst={}", runs("burst")),
            ],
        ),
        ("ttft", vec!["--records".into(), f("records.json")]),
        ("scale", vec!["--json".into(), f("scale.json")]),
    ];
    for (plot, args) in cases {
        let out = dir.join(format!("{plot}.svg"));
        let status = Command::new(env!("CARGO_BIN_EXE_kvroute-plot"))
            .arg(plot)
            .args(&args)
            .arg("--out")
            .arg(&out)
            .status()
            .unwrap();
        assert!(status.success(), "kvroute-plot {plot}: {status}");
        let p = parse(&std::fs::read_to_string(&out).unwrap());
        assert!(!p.series_lines.is_empty(), "{plot}: no series");
    }
    // A malformed series is refused with the expected form named.
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-plot"))
        .args(["ratio", "--series", "nofiles", "--out"])
        .arg(dir.join("bad.svg"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("LABEL=FILE"));
    let _ = std::fs::remove_dir_all(&dir);
}
