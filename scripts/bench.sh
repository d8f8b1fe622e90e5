#!/usr/bin/env bash
# Runs kvroute's end-to-end benchmarks and writes the result tables into docs/:
#
#   small      docs/bench-small.md      small preset: 4 workloads x 5 strategies on 4 endpoints
#   placement  docs/bench-placement.md  the constrained workload (2 endpoints x 256 blocks,
#                                       10 system prompts of ~600 tokens, 40 users x 4 turns),
#                                       staggered and burst (9 runs each, medians): round robin, sticky, kvroute,
#                                       sglang-router 0.3.2, oracle; one-shot and hot-prefix; targets
#   anthropic  docs/bench-anthropic.md  the constrained multi-turn workload as chat completions and
#                                       as Anthropic Messages, interleaved (5 runs per arrival)
#   scale      docs/bench-scale.md      multi-turn at 4, 8 and 16 endpoints
#   gateways   docs/bench-gateways.md   1 vs 4 Envoy gateways (kvroute filter) sharing one inventory
#   epp        docs/bench-epp-ratio.md  the endpoint picker (Envoy ext_proc) next to the Wasm filter on
#                                       one workload and fleet: paired, interleaved rounds (5 per
#                                       arrival), cached-token ratio compared
#   tiered     docs/bench-tiered.md     the constrained multi-turn workload on engines with a small
#                                       GPU cache and a CPU tier (vLLM KV offloading): the
#                                       inventory crediting the CPU tier against GPU-only credit,
#                                       with and without the placement memory, paired and
#                                       interleaved (5 runs per arrival)
#
# After each part kvroute-plot draws its SVG plots beside the page (docs/bench-small.svg and
# bench-small-ttft.svg, bench-placement.svg and bench-placement-ttft-{staggered,burst}.svg,
# bench-scale.svg), which the page embeds.
#
# Usage: scripts/bench.sh [small|placement|anthropic|scale|gateways|epp|tiered]...   (default: all seven)
#
# Before measuring it installs what is missing, idempotently: scripts/setup.sh (Envoy, the Qwen3
# tokenizer fixture, the wasm toolchain, sglang-router==0.3.2 into $KVROUTE_CACHE/sglang-router-venv),
# the filter .wasm (scripts/build-wasm.sh, only for `gateways` and `epp`), and the release binaries
# (under $CARGO_TARGET_DIR when set, else target/).
# Raw results (JSON) go to $KVROUTE_CACHE/bench/. KVROUTE_INVENTORY_BIN=PATH measures that
# kvroute-inventory binary instead of building the workspace's (e.g. a reviewed build while the
# tree is mid-change). KVROUTE_PLACEMENT_RUNS=N sets the placement part's runs per arrival
# (default 9; one run measures every strategy for ~3 s); KVROUTE_ANTHROPIC_RUNS=N the anthropic
# part's (default 5); KVROUTE_EPP_ROUNDS=N the epp part's rounds per arrival (default 5);
# KVROUTE_TIERED_RUNS=N the tiered part's runs per arrival and configuration (default 5). Every
# process a part starts is stopped when it ends (kvroute-bench kills its children on exit;
# bench_gateways.sh and bench_epp_ratio.sh kill the processes they start).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
OUT="$KVROUTE_CACHE/bench"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release"

say() { echo "bench.sh: $*"; }
die() {
    echo "bench.sh: $*" >&2
    exit 1
}

parts=("$@")
if ((${#parts[@]} == 0)); then
    parts=(small placement anthropic scale gateways epp tiered)
fi
for p in "${parts[@]}"; do
    case "$p" in
    small | placement | anthropic | scale | gateways | epp | tiered) ;;
    *) die "unknown part '$p' (allowed: small placement anthropic scale gateways epp tiered)" ;;
    esac
done
want() {
    local p
    for p in "${parts[@]}"; do [[ "$p" == "$1" ]] && return 0; done
    return 1
}

say "setup"
./scripts/setup.sh
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"

# setup.sh installed sglang-router into $KVROUTE_CACHE/sglang-router-venv (env.sh exports its python).

if want gateways || want epp; then
    say "building the filter .wasm"
    ./scripts/build-wasm.sh
fi
INVENTORY_BIN="${KVROUTE_INVENTORY_BIN:-}"
if [[ -n "$INVENTORY_BIN" ]]; then
    [[ -x "$INVENTORY_BIN" ]] || die "KVROUTE_INVENTORY_BIN=$INVENTORY_BIN is not an executable"
    say "building kvroute-engine-sim, kvroute-bench (release); inventory: $INVENTORY_BIN"
    cargo build --release -q -p kvroute-engine-sim
else
    say "building kvroute-inventory, kvroute-engine-sim, kvroute-bench (release)"
    cargo build --release -q -p kvroute-inventory -p kvroute-engine-sim
    INVENTORY_BIN="$BIN/kvroute-inventory"
fi
export KVROUTE_INVENTORY_BIN="$INVENTORY_BIN"
mkdir -p "$OUT"

bench() { "$BIN/kvroute-bench" --inventory-bin "$INVENTORY_BIN" "$@"; }
report() { python3 "$REPO/scripts/report.py" "$@"; }
plot() { "$BIN/kvroute-plot" "$@"; }
DOCS="$REPO/docs"
START=$SECONDS
# The placement loop's progress: in place on a terminal, one line per run otherwise.
progress() {
    local line
    line="bench.sh: $1/$2 placement runs done, $((SECONDS - START)) s elapsed; $3"
    if [[ -t 2 ]]; then printf '\r\033[K%s' "$line" >&2; else echo "$line" >&2; fi
}

if want small; then
    say "small preset"
    bench --preset small --json "$OUT/small.json" --markdown "$OUT/small.md" \
        --records "$OUT/small-records.json"
    plot ratio --title "Small preset, multi-turn: cached-token ratio" \
        --series "small=$OUT/small.json" --out "$DOCS/bench-small.svg"
    plot ttft --title "Small preset, multi-turn: TTFT" \
        --records "$OUT/small-records.json" --out "$DOCS/bench-small-ttft.svg"
    report small "$OUT" "$DOCS/bench-small.md"
fi

if want placement; then
    # The Qwen3 tokenizer: sglang-router loads the model's tokenizer from the workers'
    # /get_server_info model_path, and kvroute tokenizes exactly as the engines do.
    common=(--preset constrained --tokenizer-dir "$KVROUTE_TOKENIZER_DIR"
        --strategies round-robin,sticky,kvroute-engine,sglang-router,oracle)
    # Several runs per arrival: the report takes medians. One run of ~3 s per strategy is noisy
    # (burst: a standard deviation of 3-4 points of cached-token ratio), so a median of 3 decides
    # little; 9 runs take ~7 minutes.
    runs="${KVROUTE_PLACEMENT_RUNS:-9}"
    [[ "$runs" =~ ^[1-9][0-9]*$ ]] || die "KVROUTE_PLACEMENT_RUNS=$runs: allowed a positive integer"
    export KVROUTE_PLACEMENT_RUNS="$runs"
    rm -f "$OUT"/placement-staggered-*.json "$OUT"/placement-burst-*.json
    total=$((2 * runs)) finished=0 series=()
    for arrival in staggered burst; do
        files=()
        for run in $(seq 1 "$runs"); do
            what="multi-turn, $arrival arrival, run $run of $runs"
            progress "$finished" "$total" "$what"
            bench "${common[@]}" --workloads multi-turn --arrival "$arrival" \
                --progress-label "bench.sh: placement $finished/$total, $what" \
                --json "$OUT/placement-$arrival-$run.json" --markdown "$OUT/placement-$arrival-$run.md" \
                --records "$OUT/placement-$arrival-$run-records.json"
            files+=("$OUT/placement-$arrival-$run.json")
            finished=$((finished + 1))
        done
        series+=("--series" "$arrival=$(IFS=,; echo "${files[*]}")")
        plot ttft --title "Constrained fleet, multi-turn, $arrival arrival (run 1): TTFT" \
            --records "$OUT/placement-$arrival-1-records.json" --out "$DOCS/bench-placement-ttft-$arrival.svg"
    done
    progress "$finished" "$total" "finished"
    if [[ -t 2 ]]; then echo >&2; fi
    plot ratio --title "Constrained fleet, multi-turn: cached-token ratio, median and min-max of $runs runs" \
        "${series[@]}" --out "$DOCS/bench-placement.svg"
    say "constrained preset, one-shot and hot-prefix"
    bench "${common[@]}" --workloads one-shot,hot-prefix \
        --json "$OUT/placement-other.json" --markdown "$OUT/placement-other.md"
    # The alarms on this correctly configured fleet: kvroute again over every workload, with the
    # parity canary on (every 250 ms, so each run holds several canary runs per endpoint).
    rm -f "$OUT"/placement-canary-*.json
    for arrival in staggered burst; do
        say "constrained preset, every workload, $arrival arrival, with the parity canary"
        bench --preset constrained --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --strategies kvroute-engine \
            --workloads multi-turn,one-shot,hot-prefix --arrival "$arrival" --canary-ms 250 \
            --json "$OUT/placement-canary-$arrival.json" --markdown "$OUT/placement-canary-$arrival.md"
    done
    report placement "$OUT" "$REPO/docs/bench-placement.md"
fi

if want anthropic; then
    # The same constrained multi-turn workload sent as OpenAI chat completions and as Anthropic
    # Messages (system prompt as a block with a cache_control breakpoint), interleaved run by run
    # on fresh fleets: the two shapes must save the same prefill. sglang-router serves no
    # /v1/messages, so it is not in this part.
    common=(--preset constrained --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --workloads multi-turn
        --strategies round-robin,sticky,kvroute-engine,oracle)
    runs="${KVROUTE_ANTHROPIC_RUNS:-5}"
    [[ "$runs" =~ ^[1-9][0-9]*$ ]] || die "KVROUTE_ANTHROPIC_RUNS=$runs: allowed a positive integer"
    export KVROUTE_ANTHROPIC_RUNS="$runs"
    rm -f "$OUT"/anthropic-*.json "$OUT"/anthropic-*.md
    total=$((4 * runs)) finished=0
    for arrival in staggered burst; do
        for run in $(seq 1 "$runs"); do
            for api in openai anthropic; do
                what="$api, $arrival arrival, run $run of $runs"
                progress "$finished" "$total" "$what"
                bench "${common[@]}" --api "$api" --arrival "$arrival" \
                    --progress-label "bench.sh: anthropic $finished/$total, $what" \
                    --json "$OUT/anthropic-$arrival-$api-$run.json" --markdown "$OUT/anthropic-$arrival-$api-$run.md"
                finished=$((finished + 1))
            done
        done
    done
    progress "$finished" "$total" "finished"
    if [[ -t 2 ]]; then echo >&2; fi
    report anthropic "$OUT" "$REPO/docs/bench-anthropic.md"
fi

if want tiered; then
    # Engines with a GPU cache too small for the workload (96 blocks) and a CPU tier that holds
    # it (1024 blocks): the same runs with the inventory crediting the CPU tier (its default,
    # KVROUTE_CPU_TIER_WEIGHT=75) and with GPU-only credit (0), interleaved run by run, each
    # pair also without the placement memory (which keeps families home across evictions by
    # itself).
    common=(--preset constrained --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --workloads multi-turn
        --strategies round-robin,kvroute-engine,oracle --kv-blocks 96 --cpu-blocks 1024)
    runs="${KVROUTE_TIERED_RUNS:-5}"
    [[ "$runs" =~ ^[1-9][0-9]*$ ]] || die "KVROUTE_TIERED_RUNS=$runs: allowed a positive integer"
    export KVROUTE_TIERED_RUNS="$runs"
    rm -f "$OUT"/tiered-*.json "$OUT"/tiered-*.md
    total=$((8 * runs)) finished=0
    for arrival in staggered burst; do
        for run in $(seq 1 "$runs"); do
            for memory in on off; do
                entries=(); [[ "$memory" == off ]] && entries=(--inventory-env KVROUTE_PLACEMENT_MEMORY_ENTRIES=0)
                for credit in cpu gpu; do
                    weight=75; [[ "$credit" == gpu ]] && weight=0
                    what="$credit credit, memory $memory, $arrival arrival, run $run of $runs"
                    progress "$finished" "$total" "$what"
                    bench "${common[@]}" --arrival "$arrival" "${entries[@]}" \
                        --inventory-env "KVROUTE_CPU_TIER_WEIGHT=$weight" \
                        --progress-label "bench.sh: tiered $finished/$total, $what" \
                        --json "$OUT/tiered-$arrival-$memory-$credit-$run.json" \
                        --markdown "$OUT/tiered-$arrival-$memory-$credit-$run.md"
                    finished=$((finished + 1))
                done
            done
        done
    done
    progress "$finished" "$total" "finished"
    if [[ -t 2 ]]; then echo >&2; fi
    report tiered "$OUT" "$REPO/docs/bench-tiered.md"
fi

if want scale; then
    say "scale curve: multi-turn at 4, 8, 16 endpoints"
    bench --preset small --workloads multi-turn --endpoints 4,8,16 \
        --strategies round-robin,kvroute-engine,oracle \
        --json "$OUT/scale.json" --markdown "$OUT/scale.md"
    plot scale --title "Multi-turn: cached-token ratio against fleet size" \
        --json "$OUT/scale.json" --out "$DOCS/bench-scale.svg"
    report scale "$OUT" "$DOCS/bench-scale.md"
fi

if want gateways; then
    "$REPO/scripts/bench_gateways.sh" "$OUT"
    report gateways "$OUT" "$REPO/docs/bench-gateways.md"
fi

if want epp; then
    "$REPO/scripts/bench_epp_ratio.sh" "$OUT"
    report epp "$OUT" "$DOCS/bench-epp-ratio.md"
fi
say "done: tables in docs/bench-*.md, plots in docs/bench-*.svg, raw results in $OUT"
