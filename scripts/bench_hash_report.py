"""Turns criterion's estimates, the V8 timings and openssl's figure into docs/bench-hash.md."""
import json
import os
import platform
import subprocess
import sys

crit, wasm_json, openssl_txt = sys.argv[1:4]
ALGOS = ["sha256_cbor", "xxhash_cbor", "sha256_sglang", "blockhash_trtllm", "tokens"]


def mean_ns(*parts):
    with open(os.path.join(crit, *parts, "new", "estimates.json")) as f:
        return json.load(f)["mean"]["point_estimate"]


def throughput(*parts):
    with open(os.path.join(crit, *parts, "new", "benchmark.json")) as f:
        t = json.load(f)["throughput"]
    return next(iter(t.values()))


wasm = json.load(open(wasm_json))
cpu = "unknown"
try:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
except OSError:
    pass
print("# Block-hash throughput\n")
print(f"Machine: {os.cpu_count()} cores, {cpu}, {platform.system()}. Block size 16; Qwen-range token ids.")
print("Native: criterion (`cargo bench -p kvroute-core --bench hash`). Wasm: the built filter module in V8")
print("(node, the engine Envoy's `envoy.wasm.runtime.v8` embeds), `scripts/wasm-bench.mjs`.")
print("Reproduce: `./scripts/bench-hash.sh`.\n")
print("| contract | native 1k tokens (keys/s) | native 32k tokens (keys/s) | wasm/V8 1k (keys/s) | wasm/V8 32k (keys/s) |")
print("|---|---|---|---|---|")
for a in ALGOS:
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
