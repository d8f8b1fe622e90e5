#!/usr/bin/env python3
"""Writes the measured pages in docs/ (every markdown report the scripts produce).

usage: report.py PART RESULTS_DIR OUT.md     PART: small, placement, anthropic, scale, gateways, epp (scripts/bench.sh)
       report.py hash CRITERION_DIR WASM.json OPENSSL.txt    docs/bench-hash.md on stdout (scripts/bench-hash.sh)
       report.py soak SAMPLES.tsv OUT.md      figures in SOAK_* variables (scripts/soak.sh)
       report.py fuzz DOC.md RESULTS          one row per target run, other rows kept (scripts/fuzz.sh)

Each bench part reads the files bench.sh wrote into RESULTS_DIR (<part>*.json, and the markdown
table kvroute-bench printed, <part>*.md) and writes one page. `placement` also judges the constrained fleet's
targets from the figures (met / not met, with the numbers).
"""

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HEADER = (
    "| workload | strategy | endpoints | requests | errors | cached-token ratio | vs round robin "
    "| TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s | load spread | engines/prefix "
    "| route p50 ms | route p99 ms | pred exact/over/under | over-pred tokens "
    "| canary runs (failing) | divergent eps |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
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
    # Strategies that predict the engine's reuse (kvroute-bench judges it); "-" for the others
    # and for results written before the prediction fields.
    shares = [s.get(f"prediction_{k}_share") for k in ("exact", "over", "under")]
    pred = "-" if None in shares else "/".join(f"{v:.2f}" for v in shares)
    over = s.get("over_predicted_tokens")
    # The inventory's alarms over a kvroute run; "-" for the other strategies.
    g = s.get("signals")
    canary = "-" if g is None else f"{g['canary_runs']} ({g['canary_failing']})"
    divergent = "-" if g is None else str(g["divergent_endpoints"])
    return (
        f"| {s['workload']} | {s['strategy']} | {s['endpoints']} | {s['requests']} | {s['errors']} "
        f"| {pct(s['cached_ratio'])} | {vs} | {s['ttft_p50_ms']:.1f} | {s['ttft_p90_ms']:.1f} "
        f"| {s['ttft_p99_ms']:.1f} | {s['throughput_rps']:.1f} | {s['load_spread']:.2f} "
        f"| {s['engines_per_prefix']:.2f} | {opt(s.get('route_p50_ms'))} | {opt(s.get('route_p99_ms'))} "
        f"| {pred} | {'-' if over is None else over} | {canary} | {divergent} |\n"
    )


def prediction_cell(found):
    """Median exact / over / under shares over summaries that judged predictions, or '-'."""
    shares = [
        [s[f"prediction_{k}_share"] for k in ("exact", "over", "under")]
        for s in found
        if s.get("prediction_exact_share") is not None
    ]
    if not shares:
        return "-"
    return "/".join(f"{median([x[i] for x in shares]):.2f}" for i in range(3))


def alarms_line(summaries, what):
    """One sentence on the inventory's alarms over the kvroute runs among `summaries`."""
    sig = [s["signals"] for s in summaries if s.get("signals")]
    if not sig:
        return ""
    runs = sum(g["canary_runs"] for g in sig)
    failing = sum(g["canary_failing"] for g in sig)
    unreachable = sum(g["canary_unreachable"] for g in sig)
    legs = sorted({f for g in sig for f in g["canary_failures"]})
    divergent = sum(1 for g in sig if g["divergent_endpoints"])
    judged = sum(g["judged"] for g in sig)
    qualifying = sum(g["qualifying"] for g in sig)
    missed = sum(g["missed"] for g in sig)
    canary = (
        f"the parity canary ran {runs} times: {failing} named a failing leg"
        + (f" ({', '.join(legs)})" if legs else "")
        + f", {unreachable} found the engine unreachable"
        if runs
        else "the parity canary was off"
    )
    return (
        f"Alarms over {what} ({len(sig)} runs with the inventory's signals read): {canary}; "
        f"the divergence check judged {judged} reported responses, {qualifying} predicted to reuse "
        f"2 blocks or more, of which {missed} reused none, and found an endpoint divergent in "
        f"{divergent} of {len(sig)} runs.\n"
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


def machine():
    """The machine line of a page: CPU, cores and the load average while the bench ran."""
    one, five, fifteen = os.getloadavg()
    return (
        f"on {cpu_model('an unknown CPU')} ({os.cpu_count()} cores; load average "
        f"{one:.1f} / {five:.1f} / {fifteen:.1f} over 1 / 5 / 15 minutes as the page was written)"
    )


def cpu_model(unknown):
    """The CPU's model name from /proc/cpuinfo, or `unknown`."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return unknown


def small(res: Path, out: Path):
    d = load(res / "small.json")
    text = (
        f"# Benchmark: small preset\n\nMeasured {stamp()} by `scripts/bench.sh small` on "
        f"{cpu_model('an unknown CPU')} ({os.cpu_count()} cores).\n\n"
    )
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
        m = {k: median([s[k] for s in found]) for k in keys}
        m["pred"] = prediction_cell(found)
        return m

    text = (
        "# Benchmark: placement on a constrained fleet\n\n"
        f"Measured {stamp()} {machine()} by `scripts/bench.sh placement` (kvroute-bench `--preset constrained`, "
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
        "| pred exact/over/under | burst: cached-token ratio | engines per system prompt "
        "| TTFT p90 ms | pred exact/over/under |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for st in strategies:
        cells = []
        for a in ("staggered", "burst"):
            m = med(a, st)
            cells += (
                ["-", "-", "-", "-"]
                if m is None
                else [
                    pct(m["cached_ratio"]),
                    f"{m['engines_per_prefix']:.2f}",
                    f"{m['ttft_p90_ms']:.1f}",
                    m["pred"],
                ]
            )
        text += f"| {st} | " + " | ".join(cells) + " |\n"
    text += (
        "\nPredictions: the shares of judged requests whose engine reused exactly / fewer than / "
        "more than the blocks the strategy predicted, in whole blocks before the prompt's last "
        "token (median over the runs; `-` for strategies that make no prediction).\n"
    )
    all_runs = [s for a in ("staggered", "burst") for r in runs[a] for s in r["summaries"]]
    text += "\n" + alarms_line(all_runs, f"the {2 * RUNS} multi-turn runs above")

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
    canary = sorted(res.glob("placement-canary-*.json"))
    if canary:
        text += (
            "\n## Alarms on a correctly configured fleet\n\n"
            "kvroute-engine again over every workload and both arrivals, with the parity canary "
            "on (`--canary-ms`): its requests and blocks load these runs' simulators, so their "
            "ratios carry the canary's cost. The divergence check runs in every kvroute run "
            "above too (the driver sends the inventory the filter's outcome reports).\n\n"
        )
        sums = []
        for p in canary:
            text += command_of(p.with_suffix(".md"))
            d = load(p)
            text += full_table(d["summaries"]) + "\n"
            sums += d["summaries"]
        text += alarms_line(sums, "these runs")
    out.write_text(text)


def anthropic(res: Path, out: Path):
    """OpenAI chat completions against Anthropic Messages on the same workload, paired by run."""
    RUNS = int(os.environ.get("KVROUTE_ANTHROPIC_RUNS", "5"))
    strategies = ["round-robin", "sticky", "kvroute-engine", "oracle"]
    text = (
        "# Benchmark: Anthropic Messages against chat completions\n\n"
        f"Measured {stamp()} by `scripts/bench.sh anthropic` on {cpu_model('an unknown CPU')} "
        f"({os.cpu_count()} cores): the constrained multi-turn workload (kvroute-bench `--preset constrained`, "
        "2 simulated vLLM engines x 256 blocks, the Qwen3 tokenizer) sent as `POST /v1/chat/completions` "
        "(`--api openai`) and as `POST /v1/messages` (`--api anthropic`: the system prompt as a block with a "
        "`cache_control` breakpoint, turns as text blocks, the usage read from `message_delta`), "
        f"{RUNS} runs per arrival, the two shapes interleaved run by run on fresh fleets. "
        "The simulators convert the Anthropic body as vLLM does (kvroute-core `chat::anthropic`); kvroute "
        "keys it through the same conversion. Both shapes render to the same prompt, so the same "
        "prefill must be saved: **paired ratio** = Anthropic / OpenAI cached-token ratio of the same run, "
        "median (min-max).\n\n"
        "Regenerate: `./scripts/bench.sh anthropic` (`KVROUTE_ANTHROPIC_RUNS=N` for more runs).\n\n"
    )
    for a in ("staggered", "burst"):
        runs = {
            api: [load(res / f"anthropic-{a}-{api}-{i}.json") for i in range(1, RUNS + 1)]
            for api in ("openai", "anthropic")
        }
        text += f"## {a.capitalize()} arrival\n\n"
        text += (
            "| strategy | OpenAI cached-token ratio, median (min-max) | Anthropic cached-token ratio, median (min-max) "
            "| paired ratio | Anthropic TTFT p50 ms, median | pred exact/over/under, OpenAI | Anthropic "
            "| errors |\n|---|---|---|---|---|---|---|---|\n"
        )
        for st in strategies:
            o = [find(r["summaries"], "multi-turn", st) for r in runs["openai"]]
            n = [find(r["summaries"], "multi-turn", st) for r in runs["anthropic"]]
            if any(s is None for s in o + n):
                continue
            ov = [s["cached_ratio"] for s in o]
            nv = [s["cached_ratio"] for s in n]
            ratios = [b / x for x, b in zip(ov, nv) if x > 0]
            span = lambda v: f"{pct(median(v))} ({pct(min(v))}-{pct(max(v))})"  # noqa: E731
            pr = f"{median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
            errors = sum(s["errors"] for s in o + n)
            text += (
                f"| {st} | {span(ov)} | {span(nv)} | {pr} | {median([s['ttft_p50_ms'] for s in n]):.1f} "
                f"| {prediction_cell(o)} | {prediction_cell(n)} | {errors} |\n"
            )
        text += (
            "\nPredictions: the shares of judged requests whose engine reused exactly / fewer than / "
            "more than the predicted blocks (median over the runs; `-` for strategies that make none).\n"
        )
        every = [s for api in runs.values() for r in api for s in r["summaries"]]
        text += "\n" + alarms_line(every, f"the {a} kvroute runs") + "\n"
    text += command_of(res / "anthropic-staggered-anthropic-1.md")
    out.write_text(text)


def tiered(res: Path, out: Path):
    """CPU-tier credit against GPU-only credit on engines with a CPU tier, paired by run."""
    RUNS = int(os.environ.get("KVROUTE_TIERED_RUNS", "5"))
    strategies = ["round-robin", "kvroute-engine", "oracle"]
    text = (
        "# Benchmark: lower cache tiers (a CPU tier behind the GPU cache)\n\n"
        f"Measured {stamp()} by `scripts/bench.sh tiered` {machine()}: the constrained multi-turn "
        "workload (kvroute-bench `--preset constrained`: 2 simulated vLLM engines, 10 system prompts "
        "of ~600 tokens, 40 users x 4 turns, the Qwen3 tokenizer) on engines whose GPU cache (96 blocks "
        "of 16 tokens) cannot hold it and whose CPU tier (1024 blocks, vLLM's KV offloading as the "
        "simulator models it: write-through, looked up after the GPU prefix, loaded at a quarter of the "
        "prefill cost) can. Each run is made twice, interleaved: with the inventory crediting the CPU "
        "tier (**CPU credit**: `KVROUTE_CPU_TIER_WEIGHT=75`, the default) and with **GPU-only credit** "
        "(`KVROUTE_CPU_TIER_WEIGHT=0`); and each pair once with the placement memory on (the default) "
        "and once off (`KVROUTE_PLACEMENT_MEMORY_ENTRIES=0`), since the memory keeps a family on its "
        f"home after an eviction by itself. {RUNS} runs per arrival and configuration, fresh fleets "
        "each run. The cached-token ratio counts what the engines report: GPU hits and CPU-tier loads. "
        "**Paired ratio** = CPU credit / GPU-only credit cached-token ratio of the same run and "
        "strategy, median (min-max).\n\n"
        "Regenerate: `./scripts/bench.sh tiered` (`KVROUTE_TIERED_RUNS=N` for more runs).\n\n"
    )
    span = lambda v: f"{pct(median(v))} ({pct(min(v))}-{pct(max(v))})"  # noqa: E731
    for a in ("staggered", "burst"):
        text += f"## {a.capitalize()} arrival\n\n"
        text += (
            "| placement memory | strategy | CPU credit: cached-token ratio, median (min-max) "
            "| GPU-only credit | paired ratio | engines/prefix, CPU / GPU-only | TTFT p50 ms, CPU / GPU-only "
            "| pred exact/over/under, CPU credit | errors |\n|---|---|---|---|---|---|---|---|---|\n"
        )
        for memory in ("on", "off"):
            runs = {
                c: [load(res / f"tiered-{a}-{memory}-{c}-{i}.json") for i in range(1, RUNS + 1)]
                for c in ("cpu", "gpu")
            }
            for st in strategies:
                c = [find(r["summaries"], "multi-turn", st) for r in runs["cpu"]]
                g = [find(r["summaries"], "multi-turn", st) for r in runs["gpu"]]
                if any(x is None for x in c + g):
                    continue
                cv = [x["cached_ratio"] for x in c]
                gv = [x["cached_ratio"] for x in g]
                ratios = [x / y for x, y in zip(cv, gv) if y > 0]
                pr = f"{median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
                epp = f"{median([x['engines_per_prefix'] for x in c]):.2f} / {median([x['engines_per_prefix'] for x in g]):.2f}"
                ttft = f"{median([x['ttft_p50_ms'] for x in c]):.1f} / {median([x['ttft_p50_ms'] for x in g]):.1f}"
                errors = sum(x["errors"] for x in c + g)
                text += (
                    f"| {memory} | {st} | {span(cv)} | {span(gv)} | {pr} | {epp} | {ttft} "
                    f"| {prediction_cell(c)} | {errors} |\n"
                )
        text += (
            "\nRound robin and the oracle do not read the inventory: their two columns are the same "
            "routing measured twice, which shows the run-to-run noise. Predictions: the shares of "
            "judged requests whose engine reused exactly / fewer than / more than the predicted "
            "blocks (CPU-tier loads included), median over the runs.\n"
        )
        every = [
            s
            for memory in ("on", "off")
            for c in ("cpu", "gpu")
            for i in range(1, RUNS + 1)
            for s in load(res / f"tiered-{a}-{memory}-{c}-{i}.json")["summaries"]
        ]
        text += "\n" + alarms_line(every, f"the {a} kvroute runs") + "\n"
    text += command_of(res / "tiered-staggered-on-cpu-1.md")
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
        f"Measured {stamp()} by `scripts/bench.sh scale` on {cpu_model('an unknown CPU')} "
        f"({os.cpu_count()} cores). Workload: {shape_line(d)}; the same "
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
        f"Measured {stamp()} {machine()} by `scripts/bench.sh gateways`: one kvroute-inventory, the same "
        "simulators, Envoy + the kvroute filter; the driver spreads requests round robin over the "
        "gateways, so turns of one conversation cross gateways. Caches and the inventory are "
        "fresh for each run.\n\n"
        "| gateways | cached-token ratio | round robin (same sims) | TTFT p50 ms | TTFT p90 ms "
        "| engines/prefix | pred exact/over/under | errors |\n"
        "|---|---|---|---|---|---|---|---|\n"
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
                f"| {g['ttft_p50_ms']:.1f} | {g['ttft_p90_ms']:.1f} | {g['engines_per_prefix']:.2f} "
                f"| {prediction_cell([g])} | {g['errors']} |\n"
            )
    if 1 in sums and 4 in sums and sums[1][1] and sums[4][1]:
        a, b = sums[1][1]["cached_ratio"], sums[4][1]["cached_ratio"]
        text += (
            f"\nHit ratio flat as gateways multiply (4 gateways within 5 points of 1): "
            f"{judge(abs(a - b) <= 0.05)}: {pct(b)} vs {pct(a)}.\n"
        )
    text += (
        "\nPredictions: each gateway request's `x-kvroute-matched-blocks` (written by the filter, "
        "echoed by the simulator) against the engine's `cached_tokens`.\n"
    )
    text += "\n" + alarms_line([g for _, g in sums.values() if g], "the gateway runs")
    for n, (d, _) in sorted(sums.items()):
        text += f"\n## {n} gateway(s), every column\n\n" + command_of(res / f"gateways-{n}.md")
        text += full_table(d["summaries"])
    out.write_text(text)


def counters(path: Path) -> dict:
    """`name: value` (Envoy's /stats) or `name value` (Prometheus) lines of a file, as numbers."""
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            m = re.match(r"^([^\s:]+(?:\{[^}]*\})?):? (-?[0-9.]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def pinning(base: Path, path: str):
    """(pinned, unpinned) requests of one gateway run from the counters bench_epp_ratio.sh kept:
    the filter's pins and fail-opens (Envoy's counters after minus before), or the picker's picks
    and fail-opens (the fresh inventory's) plus the requests Envoy let through with the picker
    unreachable."""
    before = counters(base.with_name(base.name + ".envoy-before"))
    after = counters(base.with_name(base.name + ".envoy-after"))
    delta = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    if path == "wasm":
        f = "wasmcustom.kvroute_filter_"
        unpinned = sum(delta(k) for k in after if k.startswith(f + "fail_open_"))
        return delta(f + "pinned_total"), unpinned + delta(f + "no_tokenizer_total")
    inv = counters(base.with_name(base.name + ".inventory"))
    picked = inv.get('kvroute_epp_requests_total{outcome="picked"}', 0)
    unpinned = inv.get('kvroute_epp_requests_total{outcome="fail_open"}', 0)
    return picked, unpinned + sum(delta(k) for k in after if k.endswith("ext_proc.failure_mode_allowed"))


def epp(res: Path, out: Path):
    """The endpoint picker against the Wasm filter on one workload and fleet, paired by round."""
    order = [l.split() for l in (res / "epp-ratio-order").read_text().splitlines() if l.strip()]
    arrivals = list(dict.fromkeys(a for a, _, _ in order))
    rounds = max(int(r) for _, r, _ in order)
    loadavg = (res / "epp-ratio-load").read_text().splitlines()
    avg = lambda l: " ".join(l.split()[:3])  # noqa: E731
    paths = [("wasm", "Wasm filter", "gateway"), ("epp", "endpoint picker", "gateway"),
             ("rr", "round robin (reference)", "round-robin")]
    text = (
        "# Benchmark: the endpoint picker next to the Wasm filter\n\n"
        f"Measured {stamp()} by scripts/bench_epp_ratio.sh (the `epp` part of scripts/bench.sh) on "
        f"{cpu_model('an unknown CPU')} ({os.cpu_count()} cores), load average "
        f"{avg(loadavg[0])} before the first run, {avg(loadavg[-1])} after the last.\n\n"
        "One fleet, two data planes: 4 simulated vLLM engines (the small preset's 96 KV blocks each, the "
        "Qwen3 tokenizer) and one kvroute-inventory serving both the filter's callouts and the endpoint "
        "picker (`--epp-listen`). **Wasm filter**: Envoy 1.40 running envoy/envoy.yaml (the kvroute filter, "
        "100 ms callout budget). **Endpoint picker**: Envoy 1.40 with the ext_proc filter and the "
        "`override_host` policy of docs/epp.md, *Plain Envoy* (full-duplex streamed request body, "
        "response body `NONE`), the picker's defaults (`--epp-timeout-ms 150`, one fallback). Both decide "
        "with the same function; the filter also reports predicted-against-realised outcomes to the inventory "
        "every 5 s, which the picker, reading no response body, does not. Workload: kvroute-bench's small preset, multi-turn (48 users x 4 turns "
        "over 4 system prompts of ~820 tokens), 16 requests in flight, the `gateway` strategy through one "
        "Envoy at a time.\n\n"
        f"{rounds} rounds per arrival; each round runs both paths, the order alternating (odd rounds "
        "Wasm first), then round robin straight to the simulators. Before every run the simulators' caches "
        "are reset and the inventory is restarted (no placement memory or in-flight state carried over). "
        "**Paired ratio** = endpoint picker / Wasm filter cached-token ratio of the same round. "
        "*Pinned* counts the requests the filter pinned or the picker picked, *unpinned* those that "
        "failed open (Envoy's load balancer chose), summed over the rounds.\n\n"
        "Regenerate: `./scripts/bench.sh epp` (`KVROUTE_EPP_ROUNDS=N` for more rounds).\n\n"
    )
    span = lambda v: f"{pct(median(v))} ({pct(min(v))}-{pct(max(v))})"  # noqa: E731
    for a in arrivals:
        runs = {
            p: [load_opt(res / f"epp-ratio-{a}-{p}-{r}.json", st) for r in range(1, rounds + 1)]
            for p, _, st in paths
        }
        if any(s is None for v in runs.values() for s in v):
            continue
        ratio = {p: [s["cached_ratio"] for s in v] for p, v in runs.items()}
        paired = [e / w for w, e in zip(ratio["wasm"], ratio["epp"]) if w > 0]
        text += f"## {a.capitalize()} arrival\n\n"
        text += (
            "| path | cached-token ratio, median (min-max) | paired ratio, median (min-max) | TTFT p50 ms | "
            "TTFT p90 ms | engines/prefix | pred exact/over/under | errors | pinned / unpinned |\n"
            "|---|---|---|---|---|---|---|---|---|\n"
        )
        for p, name, _ in paths:
            v = runs[p]
            pr = f"{median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})" if p == "epp" and paired else "-"
            pins = "-"
            if p != "rr":
                both = [pinning(res / f"epp-ratio-{a}-{p}-{r}", p) for r in range(1, rounds + 1)]
                pins = f"{sum(x for x, _ in both):.0f} / {sum(y for _, y in both):.0f}"
            text += (
                f"| {name} | {span(ratio[p])} | {pr} | {median([s['ttft_p50_ms'] for s in v]):.1f} "
                f"| {median([s['ttft_p90_ms'] for s in v]):.1f} | {median([s['engines_per_prefix'] for s in v]):.2f} "
                f"| {prediction_cell(v)} | {sum(s['errors'] for s in v)} | {pins} |\n"
            )
        text += (
            "\nTTFT and engines/prefix: medians over the rounds. Predictions (median over the "
            "rounds): the Wasm path's `x-kvroute-matched-blocks`, echoed by the simulators, against "
            "the engine's `cached_tokens`; the picker writes no such header, so its predictions are "
            "judged by the picker itself when it reads response bodies (docs/epp.md), not here.\n\n"
        )
        turns = {p: turn_ttft(res, a, p, rounds) for p in ("wasm", "epp")}
        if all(turns.values()):
            text += (
                "TTFT p50 ms of turns 1 / 2 / 3 / 4, median over the rounds (the p50 over all requests can "
                "fall between the fast and the slow turns, where a small shift moves it far): "
                + "; ".join(
                    f"{name} " + " / ".join(f"{v:.0f}" for v in turns[p])
                    for p, name, _ in paths[:2]
                )
                + ".\n\n"
            )
        if paired:
            holds = min(paired) <= 1.0 <= max(paired)
            text += (
                f"Same cached-token ratio within noise (the paired ratio's range holds 1.0): {judge(holds)}: "
                f"{min(paired):.3f}-{max(paired):.3f} over {len(paired)} rounds.\n\n"
            )
        text += "| round | first | Wasm filter | endpoint picker | paired ratio | round robin |\n|---|---|---|---|---|---|\n"
        for r in range(rounds):
            first = next(p for aa, rr, p in order if aa == a and int(rr) == r + 1)
            w, e = ratio["wasm"][r], ratio["epp"][r]
            text += (
                f"| {r + 1} | {'Wasm filter' if first == 'wasm' else 'endpoint picker'} | {pct(w)} | {pct(e)} "
                f"| {e / w if w > 0 else 0:.3f} | {pct(ratio['rr'][r])} |\n"
            )
        text += "\n"
    first = arrivals[0] if arrivals else "staggered"
    text += f"## kvroute-bench commands (round 1, {first} arrival)\n\n"
    for p in ("wasm", "epp"):
        text += command_of(res / f"epp-ratio-{first}-{p}-1.md")
    out.write_text(text)


def turn_ttft(res: Path, arrival, path, rounds):
    """The TTFT p50 of each turn (from kvroute-bench's --records), median over the rounds; [] when a
    round has no records."""
    per_round = []
    for r in range(1, rounds + 1):
        f = res / f"epp-ratio-{arrival}-{path}-{r}-records.json"
        if not f.is_file():
            return []
        by_turn = {}
        for x in load(f)[0]["records"]:
            by_turn.setdefault(x["turn"], []).append(x["ttft_ms"])
        per_round.append([median(v) for _, v in sorted(by_turn.items())])
    return [median(v) for v in zip(*per_round)]


def load_opt(path: Path, strategy):
    """The multi-turn summary of `strategy` in a kvroute-bench JSON file, or None."""
    if not path.is_file():
        return None
    return find(load(path)["summaries"], "multi-turn", strategy)


HASH_ALGOS = ["sha256_cbor", "xxhash_cbor", "sha256_sglang", "blockhash_trtllm", "tokens"]


def hash_page(crit, wasm_json, openssl_txt):
    """Criterion's estimates, the V8 timings and openssl's figure as docs/bench-hash.md, on stdout."""

    def mean_ns(*parts):
        with open(os.path.join(crit, *parts, "new", "estimates.json")) as f:
            return json.load(f)["mean"]["point_estimate"]

    def throughput(*parts):
        with open(os.path.join(crit, *parts, "new", "benchmark.json")) as f:
            t = json.load(f)["throughput"]
        return next(iter(t.values()))

    wasm = json.load(open(wasm_json))
    cpu = cpu_model("unknown")
    print("# Block-hash throughput\n")
    print(f"Machine: {os.cpu_count()} cores, {cpu}, {platform.system()}. Block size 16; Qwen-range token ids.")
    print("Native: criterion (`cargo bench -p kvroute-core --bench hash`). Wasm: the built filter module in V8")
    print("(node, the engine Envoy's `envoy.wasm.runtime.v8` embeds), `scripts/wasm-bench.mjs`.")
    print("Reproduce: `./scripts/bench-hash.sh`.\n")
    print("| contract | native 1k tokens (keys/s) | native 32k tokens (keys/s) | wasm/V8 1k (keys/s) | wasm/V8 32k (keys/s) |")
    print("|---|---|---|---|---|")
    for a in HASH_ALGOS:
        row = [a]
        for n, label in [(1024, "1k"), (32768, "32k")]:
            ns = mean_ns(f"keys_{label}_tokens", a)
            row.append(f"{(n / 16) / (ns / 1e9):,.0f}")
        for n in ["1024", "32768"]:
            row.append(f"{wasm[a][n]:,}")
        print("| " + " | ".join(row) + " |")

    raw_ns = mean_ns("sha256_raw_32k_tokens", "sha256_cbor_input_bytes")
    full_ns = mean_ns("sha256_cbor_32k_tokens_bytes", "sha256_cbor")
    nbytes = throughput("sha256_cbor_32k_tokens_bytes", "sha256_cbor")
    openssl = open(openssl_txt).read().split()
    # openssl prints "sha256  NNNN.NNk" = thousands of bytes per second.
    ossl_bps = float(openssl[-1].rstrip("k")) * 1000
    ours_bps = nbytes / (full_ns / 1e9)
    raw_bps = nbytes / (raw_ns / 1e9)
    print("\n## sha256_cbor against openssl on the same bytes\n")
    print("| what | MB/s | share of openssl |")
    print("|---|---|---|")
    print(f"| `openssl speed -evp sha256 -bytes 85` | {ossl_bps / 1e6:,.1f} | 100% |")
    print(f"| SHA-256 alone over the CBOR block inputs (sha2 crate) | {raw_bps / 1e6:,.1f} | {raw_bps / ossl_bps:.0%} |")
    print(f"| `sha256_cbor` end to end (encode + hash + key) | {ours_bps / 1e6:,.1f} | {ours_bps / ossl_bps:.0%} |")
    print("\nTarget: `sha256_cbor` end to end at least 70% of openssl on the same bytes.")


def soak_page(samples, out_path):
    """docs/soak.md from the sampled RSS/descriptor table and the SOAK_* figures soak.sh exports."""
    e = os.environ
    rows = [[int(x) for x in l.rstrip("\n").split("\t")] for l in list(open(samples))[1:]]
    cpu = cpu_model("unknown CPU")

    def span(i):
        return rows[0][i], rows[-1][i], max(r[i] for r in rows)

    m = e["SOAK_MINUTES"]
    out = ["# Soak: memory and descriptors under a mixed workload\n"]
    out.append(f"Measured {datetime.date.today()} on {os.cpu_count()} cores ({cpu}) by `./scripts/soak.sh {m}`: "
               "the stack of `scripts/stack.sh` (Envoy 1.40 with 2 workers, the filter, the inventory, 3 vLLM simulators) "
               f"driven for {m} minutes by cycles of the multi-turn workload through the gateway (192 requests each) plus "
               "a hostile mix (non-UTF-8 header values, a 1 MB one-word body, a non-JSON body, a client pin, a half-sent "
               "request).\n")
    out.append(f"Cycles: {e['SOAK_CYCLES']}, failed cycles: {e['SOAK_ERRORS']}; hostile requests: {e['SOAK_HOSTILE']}, "
               f"unanswered within 10 s: {e['SOAK_UNANSWERED']}; filter requests: {e['SOAK_REQUESTS']}, pins honored / "
               f"overridden: {e['SOAK_HONORED']} / {e['SOAK_OVERRIDDEN']}.\n")
    out.append("| process | RSS start MiB | RSS end MiB | RSS peak MiB | fds start | fds end | fds peak |")
    out.append("|---|---|---|---|---|---|---|")
    for name, rss, fd in (("Envoy", 1, 2), ("kvroute-inventory", 3, 4)):
        a, b, c = span(rss)
        d, f, g = span(fd)
        out.append(f"| {name} | {a / 1024:.1f} | {b / 1024:.1f} | {c / 1024:.1f} | {d} | {f} | {g} |")
    out.append("\n## Samples\n")
    out.append("| t s | Envoy RSS MiB | Envoy fds | inventory RSS MiB | inventory fds |")
    out.append("|---|---|---|---|---|")
    for r in rows:
        out.append(f"| {r[0]} | {r[1] / 1024:.1f} | {r[2]} | {r[3] / 1024:.1f} | {r[4]} |")
    open(out_path, "w").write("\n".join(out) + "\n")


def fuzz_page(doc, results):
    """The results table in `doc` between fuzz.sh's markers: a row per target in `results` (fuzz.sh's
    per-target lines and `artifact PATH` lines), rows of targets not run this time kept."""
    lines = open(results).read().splitlines()
    rows, artifacts = {}, {}
    for ln in lines:
        if ln.startswith("artifact "):
            path = ln.split(" ", 1)[1]
            artifacts.setdefault(path.split("/")[-2], []).append(path)
        elif ln.strip():
            f = ln.split()
            rows[f[0]] = f[1:]
    cpu = cpu_model("unknown cpu")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rustc = subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip()
    machine = f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, {rustc}"
    # Rows kept from earlier runs of other targets, so a one-target run updates only its own row.
    text = open(doc).read() if os.path.exists(doc) else ""
    begin, end = "<!-- fuzz.sh results begin -->", "<!-- fuzz.sh results end -->"
    old = {}
    if begin in text and end in text:
        for l in text.split(begin, 1)[1].split(end, 1)[0].splitlines():
            m = re.match(r"\| `(\w+)` \|", l)
            if m:
                old[m.group(1)] = l
    table = ["| target | seconds | execs | coverage (edges) | features | corpus | crashes | timeouts | ooms | date | machine |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    # The table's order, then targets it lacks in the order they ran (no list of targets here to
    # drift from fuzz.sh's).
    for name in list(old) + [n for n in rows if n not in old]:
        if name in rows:
            execs, cov, ft, corp, crash, tmo, oom, t, rc = rows[name]
            table.append(f"| `{name}` | {t} | {execs} | {cov} | {ft} | {corp} | {crash} | {tmo} | {oom} | {date} | {machine} |")
        elif name in old:
            table.append(old[name])
    new_block = begin + "\n" + "\n".join(table) + "\n" + end
    if begin in text and end in text:
        text = text.split(begin, 1)[0] + new_block + text.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + new_block + "\n"
    open(doc, "w").write(text)
    for name, paths in artifacts.items():
        for p in paths:
            print(f"fuzz.sh: {name}: new artifact {p}")


def main():
    part = sys.argv[1] if len(sys.argv) > 1 else ""
    if part == "hash" and len(sys.argv) == 5:
        hash_page(*sys.argv[2:5])
    elif part == "soak" and len(sys.argv) == 4:
        soak_page(*sys.argv[2:4])
    elif part == "fuzz" and len(sys.argv) == 4:
        fuzz_page(*sys.argv[2:4])
    elif part in ("small", "placement", "anthropic", "scale", "gateways", "epp", "tiered") and len(sys.argv) == 4:
        res, out = Path(sys.argv[2]), Path(sys.argv[3])
        parts = {
            "small": small,
            "placement": placement,
            "anthropic": anthropic,
            "scale": scale,
            "gateways": gateways,
            "epp": epp,
            "tiered": tiered,
        }
        parts[part](res, out)
        print(f"report.py: wrote {out}")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
