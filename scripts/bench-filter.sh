#!/usr/bin/env bash
# Measures the latency the kvroute filter adds in Envoy (p50/p99 versus Envoy without the filter)
# for ~1k and ~8k-token chat prompts, cold and as a multi-turn follow-up, with the filter
# tokenizing and with tokenization offloaded to the inventory service. Writes docs/filter-bench.md.
#
# Needs what scripts/setup.sh installs (Envoy 1.40, the Qwen3 tokenizer fixture). Builds the .wasm
# and the inventory service first. Takes a few minutes; run on an otherwise idle machine.
#
#   scripts/bench-filter.sh            # 100 samples per cell
#   KVROUTE_BENCH_SAMPLES=300 scripts/bench-filter.sh
#   KVROUTE_BENCH_OUT=/tmp/bench.md scripts/bench-filter.sh
#   KVROUTE_BENCH_ONLY="8k follow-up" KVROUTE_BENCH_OUT=/tmp/b.md scripts/bench-filter.sh  # one case
#   scripts/bench-filter.sh --baseline REV   # also the filter built from REV, paired with this one
#   KVROUTE_WASM=/tmp/old.wasm ...     # measure another build of the module (before/after)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# env.sh names the freshly built module; a caller's KVROUTE_WASM (another build) wins.
caller_wasm="${KVROUTE_WASM:-}"
[[ -f .cache/env.sh ]] && source .cache/env.sh
[[ -n "$caller_wasm" ]] && export KVROUTE_WASM="$caller_wasm"

# --baseline REV: also measure the filter built from git revision REV (vLLM contract) in the same
# interleaved run, and add the paired difference of this build against it.
if [[ "${1:-}" == --baseline ]]; then
    base="$(git rev-parse --short "${2:?--baseline needs a revision}")"
    wasm="$REPO/.cache/bench/kvroute_filter-$base.wasm"
    if [[ ! -f "$wasm" ]]; then
        wt="$(mktemp -d)/kvroute-$base"
        git worktree add -q --detach "$wt" "$base"
        mkdir -p "$REPO/.cache/bench"
        # Its own target dir: Cargo names a workspace member's artifacts without its source path,
        # so a baseline built into target-wasm would leave this tree's build below a no-op that
        # ships the baseline's module.
        KVROUTE_WASM_TARGET_DIR="$REPO/target-wasm-baseline" KVROUTE_WASM_OUT="$wasm" "$wt/scripts/build-wasm.sh"
        git worktree remove --force "$wt"
    fi
    export KVROUTE_BENCH_BASELINE_WASM="$wasm" KVROUTE_BENCH_BASELINE_LABEL="$base"
fi

./scripts/build-wasm.sh
if [[ -n "${base:-}" ]] && cmp -s "$KVROUTE_BENCH_BASELINE_WASM" .cache/wasm/kvroute_filter.wasm &&
    ! git diff --quiet "$base" -- filter shared Cargo.lock; then
    echo "bench-filter.sh: this build's module is byte for byte the one built from $base, although filter/ or shared/ differ: refusing to compare a build with itself" >&2
    exit 1
fi
# A release service: a debug build's route handler (and its offload tokenizer) would dominate.
cargo build --release -p kvroute-inventory
export KVROUTE_INVENTORY_BIN="$REPO/target/release/kvroute-inventory"
export KVROUTE_BENCH_OUT="${KVROUTE_BENCH_OUT:-$REPO/docs/filter-bench.md}"
cargo test -p kvroute-tests --test filter_bench -- --ignored --nocapture --test-threads 1
echo "bench-filter.sh: results in $KVROUTE_BENCH_OUT"
