#!/usr/bin/env python3
"""Writes the shipped envoy/envoy.yaml with this machine's addresses, for the local stack and benches.

What a user copies is what runs here: only the module path, the rule, the callout budget, the
listener, admin and inventory addresses change, and the engines cluster gets one entry per
simulator (the shipped file has two examples). Every endpoint of the rule must be a host of that
cluster, or its pins fall back to the cluster's load balancer and a run measures a smaller fleet
than the inventory scores. Exits non-zero, naming what it could not rewrite, when the shipped file
does not have the expected shape.

usage: local_envoy.py SRC DST --wasm PATH --rule RULE --listen PORT --admin PORT
                      --inventory PORT --sims IP[:PORT][,...] [--sim-port PORT] [--timeout-ms MS]
                      [--no-filter] [--access-log PATH]

A simulator given without its port listens on --sim-port. --no-filter drops the Wasm filter and
nothing else: Envoy alone, the baseline the real-vLLM bench measures kvroute's added latency against.
--access-log writes one JSON line per request to PATH with Envoy's own timestamps of the stream
(microseconds from the first downstream byte): the request read, the first and last byte sent
upstream, the last byte received from it and the last byte sent downstream. The scripts (stack.sh,
bench_gateways.sh) and the end-to-end test of the whole stack (tests/tests/stack_e2e.rs) write
their configs with it.
"""

import argparse
import re
import sys


def render(src: str, a: argparse.Namespace) -> str:
    y = src
    for old, new in (
        ("/etc/kvroute/kvroute_filter.wasm", a.wasm),
        ('"rule": "10.0.0.1:8080"', f'"rule": "{a.rule}"'),
        ('"timeout_ms": 25,', f'"timeout_ms": {a.timeout_ms},'),
        ("address: 0.0.0.0, port_value: 10000", f"address: 127.0.0.1, port_value: {a.listen}"),
        ("address: 127.0.0.1, port_value: 9901", f"address: 127.0.0.1, port_value: {a.admin}"),
        (
            "address: kvroute-inventory, port_value: 8080",
            f"address: 127.0.0.1, port_value: {a.inventory}",
        ),
    ):
        if old not in y:
            sys.exit(f"local_envoy.py: {old!r} not found in the shipped envoy.yaml")
        y = y.replace(old, new)
    # The engines: every endpoint entry of the first lb_endpoints list (the engines cluster).
    m = re.search(r"( *)- lb_endpoints:[^\n]*\n((?:\1  +[^\n]*\n)+)", y)
    if not m:
        sys.exit("local_envoy.py: no lb_endpoints list in cluster engines")
    ind = m.group(1) + "    "
    sims = [s.partition(":") for s in a.sims.split(",") if s]
    if not sims:
        sys.exit("local_envoy.py: --sims is empty")
    if any(not port for _, _, port in sims) and not a.sim_port:
        sys.exit("local_envoy.py: a simulator without its port needs --sim-port")
    eps = "".join(
        f"{ind}- endpoint:\n{ind}    address:\n"
        f"{ind}      socket_address: {{ address: {ip}, port_value: {port or a.sim_port} }}\n"
        for ip, _, port in sims
    )
    y = y[: m.start(2)] + eps + y[m.end(2) :]
    if a.no_filter:
        w = re.search(r"\n( *)- name: envoy\.filters\.http\.wasm\n(?:\1  [^\n]*\n|\1 *#[^\n]*\n)+", y)
        if not w:
            sys.exit("local_envoy.py: no envoy.filters.http.wasm entry to drop")
        y = y[: w.start() + 1] + y[w.end() :]
    if a.access_log:
        hcm = "                stat_prefix: kvroute_ingress\n"
        if hcm not in y:
            sys.exit("local_envoy.py: no kvroute_ingress connection manager to log for")
        y = y.replace(hcm, hcm + access_log(a.access_log, " " * 16), 1)
    if "10.0.0." in y:
        sys.exit("local_envoy.py: an example address was not rewritten (the shipped file changed?)")
    return y


# Envoy's stream timestamps, as microseconds from the first downstream byte (COMMON_DURATION):
# what the real-vLLM bench splits a request's time with.
STAMPS = {
    "rx_end": "DS_RX_END",
    "us_tx_beg": "US_TX_BEG",
    "us_tx_end": "US_TX_END",
    "us_rx_end": "US_RX_END",
    "ds_tx_end": "DS_TX_END",
}


def access_log(path: str, ind: str) -> str:
    """The connection manager's access_log entry (indented by `ind`): a JSON line per request."""
    fields = {
        "id": "%REQ(X-REQUEST-ID)%",
        "upstream": "%UPSTREAM_HOST%",
        "code": "%RESPONSE_CODE%",
        **{k: f"%COMMON_DURATION(DS_RX_BEG:{v}:us)%" for k, v in STAMPS.items()},
    }
    lines = [
        "access_log:",
        "  - name: envoy.access_loggers.file",
        "    typed_config:",
        '      "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog',
        f"      path: {path}",
        "      log_format:",
        "        json_format:",
        *(f'          {k}: "{v}"' for k, v in fields.items()),
    ]
    return "".join(f"{ind}{l}\n" for l in lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    for flag in ("--wasm", "--rule", "--listen", "--admin", "--inventory", "--sims"):
        p.add_argument(flag, required=True)
    p.add_argument("--sim-port")
    p.add_argument("--timeout-ms", default="25")
    p.add_argument("--no-filter", action="store_true")
    p.add_argument("--access-log")
    a = p.parse_args()
    with open(a.src) as f:
        text = render(f.read(), a)
    with open(a.dst, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
