#!/usr/bin/env python3
"""Writes the docs/bench-*.md tables from kvroute-bench's JSON results (scripts/bench.sh).

usage: bench_report.py PART RESULTS_DIR OUT.md     PART: small, placement, scale, gateways

Each part reads the files bench.sh wrote into RESULTS_DIR (<part>*.json, and the markdown
table kvroute-bench printed, <part>*.md) and writes one page. `placement` also judges the constrained fleet's
targets from the figures (met / not met, with the numbers).
"""

import json
import os
import sys
import time
from pathlib import Path

HEADER = (
    "| workload | strategy | endpoints | requests | errors | cached-token ratio | vs round robin "
    "| TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s | load spread | engines/prefix "
    "| route p50 ms | route p99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def find(summaries, workload, strategy, endpoints=None):
    for s in summaries:
        if s["workload"] == workload and s["strategy"] == strategy:
            if endpoints is None or s["endpoints"] == endpoints:
                return s
    return None


def pct(v):
    return f"{v * 100:.1f}%"


def row(s, rr=None):
    vs = f"{s['cached_ratio'] / rr:.2f}x" if rr else "-"
    opt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return (
        f"| {s['workload']} | {s['strategy']} | {s['endpoints']} | {s['requests']} | {s['errors']} "
        f"| {pct(s['cached_ratio'])} | {vs} | {s['ttft_p50_ms']:.1f} | {s['ttft_p90_ms']:.1f} "
        f"| {s['ttft_p99_ms']:.1f} | {s['throughput_rps']:.1f} | {s['load_spread']:.2f} "
        f"| {s['engines_per_prefix']:.2f} | {opt(s.get('route_p50_ms'))} | {opt(s.get('route_p99_ms'))} |\n"
    )


def full_table(summaries):
    out = HEADER
    for s in summaries:
        rr = find(summaries, s["workload"], "round-robin", s["endpoints"])
        rr_ratio = rr["cached_ratio"] if rr and rr["cached_ratio"] > 0 else None
        out += row(s, rr_ratio)
    return out


def shape_line(d):
    sh = d["shape"]
    return (
        f"{sh['users']} users x {sh['turns']} turns over {sh['groups']} shared prefixes of "
        f"{sh['prefix_words']} words, {sh['max_tokens']} output tokens, KV {d['kv_blocks']} "
        f"blocks/endpoint, arrival {sh['arrival']}"
    )


def command_of(md_path: Path) -> str:
    """The `Command:` and parameters lines kvroute-bench wrote above its table."""
    if not md_path.is_file():
        return ""
    lines = md_path.read_text().splitlines()
    head = [l for l in lines[:4] if l.strip()]
    return "\n\n".join(head[:2]) + "\n\n"


def figures(out: Path, plots) -> str:
    """Embeds the SVG plots kvroute-plot drew beside the page (bench.sh), those that exist."""
    text = ""
    for name, alt in plots:
        if (out.parent / name).is_file():
            text += f"![{alt}]({name})\n\n"
    return text


def stamp():
    return time.strftime("%Y-%m-%d")


def small(res: Path, out: Path):
    d = load(res / "small.json")
    text = f"# Benchmark: small preset\n\nMeasured {stamp()} by `scripts/bench.sh small`.\n\n"
    text += figures(
        out,
        [
            ("bench-small.svg", "multi-turn cached-token ratio per strategy"),
            ("bench-small-ttft.svg", "multi-turn TTFT distribution per strategy"),
        ],
    )
    text += command_of(res / "small.md")
    text += full_table(d["summaries"])
    out.write_text(text)


def judge(ok):
    return "**met**" if ok else "**not met**"


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def mean_sd(values):
    n = len(values)
    m = sum(values) / n
    sd = (sum((x - m) ** 2 for x in values) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return m, sd


def placement(res: Path, out: Path):
    # Multi-turn runs per arrival (bench.sh exports it).
    RUNS = int(os.environ.get("KVROUTE_PLACEMENT_RUNS", "9"))
    runs = {
        a: [load(res / f"placement-{a}-{i}.json") for i in range(1, RUNS + 1)]
        for a in ("staggered", "burst")
    }
    other = load(res / "placement-other.json")
    strategies = ["round-robin", "sticky", "kvroute-engine", "sglang-router", "oracle"]

    def measured(a, st):
        """The multi-turn summaries of `st` in the runs of one arrival that measured it."""
        found = (find(r["summaries"], "multi-turn", st) for r in runs[a])
        return [s for s in found if s is not None]

    def med(a, st):
        """Per-field medians over the runs of one arrival, or None when not measured."""
        found = measured(a, st)
        if not found:
            return None
        keys = ("cached_ratio", "engines_per_prefix", "ttft_p90_ms")
        return {k: median([s[k] for s in found]) for k in keys}

    text = (
        "# Benchmark: placement on a constrained fleet\n\n"
        f"Measured {stamp()} by `scripts/bench.sh placement` (kvroute-bench `--preset constrained`, "
        "the Qwen3 tokenizer, vLLM simulators with a vLLM-like free-block queue). "
        f"Workload: {shape_line(runs['staggered'][0])}; burst = every user at once "
        f"(bounded by 8 requests in flight). Multi-turn figures are the median of {RUNS} runs "
        "(each run measures every strategy in turn on fresh simulators); the per-run values follow.\n\n"
    )
    text += figures(
        out,
        [
            ("bench-placement.svg", "multi-turn cached-token ratio per strategy, median and min-max over the runs"),
            ("bench-placement-ttft-staggered.svg", "TTFT distribution per strategy, staggered arrival, run 1"),
            ("bench-placement-ttft-burst.svg", "TTFT distribution per strategy, burst arrival, run 1"),
        ],
    )
    text += (
        "## Multi-turn, side by side (medians)\n\n"
        "| strategy | staggered: cached-token ratio | engines per system prompt | TTFT p90 ms "
        "| burst: cached-token ratio | engines per system prompt | TTFT p90 ms |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    for st in strategies:
        cells = []
        for a in ("staggered", "burst"):
            m = med(a, st)
            cells += (
                ["-", "-", "-"]
                if m is None
                else [pct(m["cached_ratio"]), f"{m['engines_per_prefix']:.2f}", f"{m['ttft_p90_ms']:.1f}"]
            )
        text += f"| {st} | " + " | ".join(cells) + " |\n"

    for a in ("staggered", "burst"):
        text += (
            f"\nPer run, {a} arrival, cached-token ratio (TTFT p90 ms), and the mean +- standard "
            "deviation of the ratio:\n\n| strategy | "
            + " | ".join(f"run {i}" for i in range(1, RUNS + 1))
            + " | mean +- sd |\n|---|" + "---|" * (RUNS + 1) + "\n"
        )
        for st in strategies:
            cells, ratios = [], []
            for r in runs[a]:
                s = find(r["summaries"], "multi-turn", st)
                cells.append("-" if s is None else f"{pct(s['cached_ratio'])} ({s['ttft_p90_ms']:.0f})")
                if s is not None:
                    ratios.append(s["cached_ratio"])
            if ratios:
                m, sd = mean_sd(ratios)
                cells.append(f"{100 * m:.1f} +- {100 * sd:.1f}%")
            else:
                cells.append("-")
            text += f"| {st} | " + " | ".join(cells) + " |\n"

    # Targets, on the medians.
    rows = []
    for a, factor in (("staggered", 1.05), ("burst", 1.0)):
        k = med(a, "kvroute-engine")
        g = med(a, "sglang-router")
        if k is None or g is None:
            rows.append((f"{a}: kvroute vs sglang-router", "not measured"))
            continue
        need = g["cached_ratio"] * factor

        def mean_of(st):
            return mean_sd([s["cached_ratio"] for s in measured(a, st)])[0]

        km, gm = mean_of("kvroute-engine"), mean_of("sglang-router")
        rows.append(
            (
                f"{a}: kvroute cached-token ratio >= sglang-router's x {factor:.2f} (medians of {RUNS})",
                f"{judge(k['cached_ratio'] >= need)}: {pct(k['cached_ratio'])} vs "
                f"{pct(g['cached_ratio'])} (x {k['cached_ratio'] / max(g['cached_ratio'], 1e-9):.3f}); "
                f"means {pct(km)} vs {pct(gm)} (x {km / max(gm, 1e-9):.3f})",
            )
        )
        rows.append(
            (
                f"{a}: engines per system prompt <= 1.1",
                f"{judge(k['engines_per_prefix'] <= 1.1)}: {k['engines_per_prefix']:.2f} "
                f"(sglang-router {g['engines_per_prefix']:.2f})",
            )
        )
        rows.append(
            (
                f"{a}: TTFT p90 no worse than sglang-router",
                f"{judge(k['ttft_p90_ms'] <= g['ttft_p90_ms'])}: {k['ttft_p90_ms']:.1f} ms vs "
                f"{g['ttft_p90_ms']:.1f} ms",
            )
        )
    for workload, target in (
        ("hot-prefix", "hot-prefix: TTFT p90 <= round robin x 1.2"),
        ("one-shot", "one-shot: no worse than round robin (TTFT p90, x 1.2 noise allowance)"),
    ):
        k = find(other["summaries"], workload, "kvroute-engine")
        r = find(other["summaries"], workload, "round-robin")
        if k and r:
            rows.append(
                (
                    target,
                    f"{judge(k['ttft_p90_ms'] <= 1.2 * r['ttft_p90_ms'])}: {k['ttft_p90_ms']:.1f} ms vs "
                    f"{r['ttft_p90_ms']:.1f} ms",
                )
            )
    text += "\n## Targets\n\n| target | result |\n|---|---|\n"
    text += "".join(f"| {t} | {r} |\n" for t, r in rows)

    for a in ("staggered", "burst"):
        text += f"\n## Multi-turn, {a} arrival, run 1 (every column)\n\n"
        text += command_of(res / f"placement-{a}-1.md")
        text += full_table(runs[a][0]["summaries"])
        text += "\nkvroute reasons: " + reasons_of(runs[a][0]["summaries"]) + "\n"
    text += "\n## One-shot and hot-prefix, same fleet\n\n"
    text += command_of(res / "placement-other.md")
    text += full_table(other["summaries"])
    out.write_text(text)


def reasons_of(summaries):
    parts = []
    for s in summaries:
        if s.get("reasons"):
            r = ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items()))
            parts.append(f"{s['workload']}/{s['strategy']}: {r}")
    return "; ".join(parts) or "-"


def scale(res: Path, out: Path):
    d = load(res / "scale.json")
    sums = d["summaries"]
    text = (
        "# Benchmark: scale curve\n\n"
        f"Measured {stamp()} by `scripts/bench.sh scale`. Workload: {shape_line(d)}; the same "
        "sessions at every fleet size, 4 requests in flight per endpoint.\n\n"
    )
    text += figures(out, [("bench-scale.svg", "multi-turn cached-token ratio against endpoints per strategy")])
    text += (
        "| endpoints | round robin | kvroute-engine | oracle | kvroute / round robin | kvroute / oracle "
        "| kvroute engines/prefix | kvroute TTFT p90 ms | round robin TTFT p90 ms | route p99 ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for n in sorted({s["endpoints"] for s in sums}):
        rr = find(sums, "multi-turn", "round-robin", n)
        kv = find(sums, "multi-turn", "kvroute-engine", n)
        orc = find(sums, "multi-turn", "oracle", n)
        if not (rr and kv and orc):
            continue
        text += (
            f"| {n} | {pct(rr['cached_ratio'])} | {pct(kv['cached_ratio'])} | {pct(orc['cached_ratio'])} "
            f"| {kv['cached_ratio'] / max(rr['cached_ratio'], 1e-9):.2f}x "
            f"| {kv['cached_ratio'] / max(orc['cached_ratio'], 1e-9) * 100:.0f}% "
            f"| {kv['engines_per_prefix']:.2f} | {kv['ttft_p90_ms']:.1f} | {rr['ttft_p90_ms']:.1f} "
            f"| {kv['route_p99_ms'] or 0:.2f} |\n"
        )
    text += "\n## Every column\n\n" + command_of(res / "scale.md") + full_table(sums)
    out.write_text(text)


def gateways(res: Path, out: Path):
    text = (
        "# Benchmark: 1 vs 4 Envoy gateways sharing one inventory\n\n"
        f"Measured {stamp()} by `scripts/bench.sh gateways`: one kvroute-inventory, the same "
        "simulators, Envoy + the kvroute filter; the driver spreads requests round robin over the "
        "gateways, so turns of one conversation cross gateways. Caches and the inventory are "
        "fresh for each run.\n\n"
        "| gateways | cached-token ratio | round robin (same sims) | TTFT p50 ms | TTFT p90 ms | engines/prefix | errors |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    sums = {}
    for n in (1, 4):
        p = res / f"gateways-{n}.json"
        if not p.is_file():
            continue
        d = load(p)
        g = find(d["summaries"], "multi-turn", "gateway")
        rr = find(d["summaries"], "multi-turn", "round-robin")
        sums[n] = (d, g)
        if g:
            text += (
                f"| {n} | {pct(g['cached_ratio'])} | {pct(rr['cached_ratio']) if rr else '-'} "
                f"| {g['ttft_p50_ms']:.1f} | {g['ttft_p90_ms']:.1f} | {g['engines_per_prefix']:.2f} | {g['errors']} |\n"
            )
    if 1 in sums and 4 in sums and sums[1][1] and sums[4][1]:
        a, b = sums[1][1]["cached_ratio"], sums[4][1]["cached_ratio"]
        text += (
            f"\nHit ratio flat as gateways multiply (4 gateways within 5 points of 1): "
            f"{judge(abs(a - b) <= 0.05)}: {pct(b)} vs {pct(a)}.\n"
        )
    for n, (d, _) in sorted(sums.items()):
        text += f"\n## {n} gateway(s), every column\n\n" + command_of(res / f"gateways-{n}.md")
        text += full_table(d["summaries"])
    out.write_text(text)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    part, res, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    {"small": small, "placement": placement, "scale": scale, "gateways": gateways}[part](res, out)
    print(f"bench_report.py: wrote {out}")


if __name__ == "__main__":
    main()
