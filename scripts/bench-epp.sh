#!/usr/bin/env bash
# Measures the latency the kvroute endpoint picker adds in Envoy (ext_proc, p50/p99 versus the
# same Envoy without the ext_proc filter) for ~8k-token chat prompts, cold and as a multi-turn
# follow-up. Writes docs/epp-bench.md (the filter's figures: scripts/bench-filter.sh).
#
# Needs what scripts/setup.sh installs (Envoy 1.40, the Qwen3 tokenizer fixture). Builds the
# release service first. Takes a few minutes; run on an otherwise idle machine.
#
#   scripts/bench-epp.sh                        # 100 samples per cell
#   KVROUTE_BENCH_SAMPLES=300 scripts/bench-epp.sh
#   KVROUTE_BENCH_OUT=/tmp/epp.md scripts/bench-epp.sh
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
[[ -f .cache/env.sh ]] && source .cache/env.sh
# A release service: a debug build's tokenizer would dominate.
cargo build --release -p kvroute-inventory
export KVROUTE_INVENTORY_BIN="$REPO/target/release/kvroute-inventory"
export KVROUTE_BENCH_OUT="${KVROUTE_BENCH_OUT:-$REPO/docs/epp-bench.md}"
cargo test -p kvroute-tests --test epp_bench -- --ignored --nocapture --test-threads 1
echo "bench-epp.sh: results in $KVROUTE_BENCH_OUT"
