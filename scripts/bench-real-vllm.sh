#!/usr/bin/env bash
# Routers compared on two real vLLM engines (CPU, dummy-weight Qwen3 with the real tokenizer):
# round robin, a static partition, Envoy alone, sglang-router 0.3.2 and kvroute (Envoy + filter +
# inventory), paired and interleaved, staggered and burst arrival; then the same workloads on the
# simulator timed as the real engines were. Writes docs/bench-real-vllm.md (what is measured and
# how: scripts/bench_real_vllm.py).
#
# Installs what it needs first (scripts/setup.sh, then vLLM into .cache/vllm-venv: about 3 GB to
# download once) and builds the filter and the release binaries. Run on an otherwise idle machine:
# the engines take one core each.
#
#   scripts/bench-real-vllm.sh                     # 5 rounds + 5 simulator rounds (about 30 minutes on 2 cores with AVX-512 BF16, about 55 without)
#   scripts/bench-real-vllm.sh --rounds 1 --out /tmp/b.md --strategies kvroute,sglang-router
#   scripts/bench-real-vllm.sh --engine-nice 10 ...   # the engines below every other process's priority
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
./scripts/setup.sh
./scripts/setup-vllm.sh
./scripts/build-wasm.sh
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"
cargo build --release -q -p kvroute-inventory -p kvroute-engine-sim
run="$KVROUTE_CACHE/bench/real-vllm-run"
rm -rf "$run"
exec python3 scripts/bench_real_vllm.py --run-dir "$run" \
    --inventory-bin target/release/kvroute-inventory --bench-bin target/release/kvroute-bench \
    --envoy "$KVROUTE_ENVOY" --wasm "$KVROUTE_WASM" --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" \
    --json "$run/runs.json" "$@"
