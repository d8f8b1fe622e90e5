//! `kvroute-plot`: draws SVG plots from `kvroute-bench` results (`--json` and `--records`
//! files); `scripts/bench.sh` calls it after each part. Plots in [`kvroute_engine_sim::bench::plot`].

use std::path::PathBuf;

use anyhow::{anyhow, Context};
use clap::{Parser, Subcommand};
use kvroute_engine_sim::bench::plot::{ratio_svg, scale_svg, ttft_cdf_svg, RatioSeries};
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(
    name = "kvroute-plot",
    about = "Draw SVG plots from kvroute-bench JSON results"
)]
struct Args {
    #[command(subcommand)]
    plot: Plot,
}

#[derive(Subcommand, Debug)]
enum Plot {
    /// Cached-token ratio per strategy: median over the runs of each series, min-max whiskers.
    Ratio {
        /// A series: LABEL=FILE[,FILE...], the `--json` files of its runs (repeatable).
        #[arg(long = "series", required = true)]
        series: Vec<String>,
        /// Workload whose summaries are plotted.
        #[arg(long, default_value = "multi-turn")]
        workload: String,
        /// Plot title.
        #[arg(long, default_value = "Cached-token ratio per strategy")]
        title: String,
        /// Output SVG file.
        #[arg(long)]
        out: PathBuf,
    },
    /// TTFT cumulative distribution per strategy, from a `kvroute-bench --records` file.
    Ttft {
        /// The `--records` file.
        #[arg(long)]
        records: PathBuf,
        /// Workload whose requests are plotted.
        #[arg(long, default_value = "multi-turn")]
        workload: String,
        /// Plot title.
        #[arg(long, default_value = "TTFT distribution per strategy")]
        title: String,
        /// Output SVG file.
        #[arg(long)]
        out: PathBuf,
    },
    /// Cached-token ratio against endpoint count, one line per strategy (a `--json` file of a
    /// run over several `--endpoints`).
    Scale {
        /// The `--json` file.
        #[arg(long)]
        json: PathBuf,
        /// Workload whose summaries are plotted.
        #[arg(long, default_value = "multi-turn")]
        workload: String,
        /// Plot title.
        #[arg(long, default_value = "Cached-token ratio against fleet size")]
        title: String,
        /// Output SVG file.
        #[arg(long)]
        out: PathBuf,
    },
}

fn read_json(p: &PathBuf) -> anyhow::Result<Value> {
    let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {} as JSON", p.display()))
}

fn series(spec: &str) -> anyhow::Result<RatioSeries> {
    let (name, files) = spec
        .split_once('=')
        .ok_or_else(|| anyhow!("--series {spec:?}: expected LABEL=FILE[,FILE...]"))?;
    let runs = files
        .split(',')
        .filter(|f| !f.is_empty())
        .map(|f| read_json(&PathBuf::from(f)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if runs.is_empty() {
        anyhow::bail!("--series {spec:?}: no files after '='");
    }
    Ok(RatioSeries {
        name: name.to_string(),
        runs,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (svg, out) = match args.plot {
        Plot::Ratio {
            series: specs,
            workload,
            title,
            out,
        } => {
            let s = specs
                .iter()
                .map(|x| series(x))
                .collect::<anyhow::Result<Vec<_>>>()?;
            (ratio_svg(&title, &workload, &s)?, out)
        }
        Plot::Ttft {
            records,
            workload,
            title,
            out,
        } => (ttft_cdf_svg(&title, &workload, &read_json(&records)?)?, out),
        Plot::Scale {
            json,
            workload,
            title,
            out,
        } => (scale_svg(&title, &workload, &read_json(&json)?)?, out),
    };
    std::fs::write(&out, svg).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("kvroute-plot: wrote {}", out.display());
    Ok(())
}
