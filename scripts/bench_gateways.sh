#!/usr/bin/env bash
# 1 vs 4 Envoy gateways (each with the kvroute filter) sharing one kvroute-inventory.
# Called by scripts/bench.sh (which has installed Envoy, built the .wasm and the release binaries);
# writes gateways-1.{json,md} and gateways-4.{json,md} into OUT_DIR.
#
#   4 vLLM simulators  127.0.0.20-23 (Qwen3 tokenizer, 96 KV blocks, ZMQ events)
#   1 inventory        127.0.0.1:<free port>, in memory; restarted before each run so the second
#                      run starts with no placement memory, like the first
#   4 Envoys           127.0.0.1:<free ports>, --concurrency 1 each (one filter VM per gateway)
#
# Each run drives the small preset's multi-turn workload (system prompts sized in tokens so the
# cache pressure matches the word-tokenizer preset) through the gateways, round robin over them, so
# consecutive turns of one conversation go through different gateways; then round robin straight to
# the same simulators (caches reset in between). Every process started here is stopped on exit.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${1:?usage: bench_gateways.sh OUT_DIR}"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release"
INVENTORY_BIN="${KVROUTE_INVENTORY_BIN:-$BIN/kvroute-inventory}"
MODEL="Qwen/Qwen3-0.6B"
SLUG="Qwen__Qwen3-0.6B"
SIMS=(127.0.0.20 127.0.0.21 127.0.0.22 127.0.0.23)
GATEWAYS=4

say() { echo "bench_gateways.sh: $*"; }
die() {
    echo "bench_gateways.sh: $*" >&2
    exit 1
}
[[ -f "$KVROUTE_WASM" ]] || die "no filter module at $KVROUTE_WASM: run scripts/build-wasm.sh"
[[ -x "$KVROUTE_ENVOY" ]] || die "no Envoy at $KVROUTE_ENVOY: run scripts/setup.sh"

RUN="$KVROUTE_CACHE/bench/gateways-run"
rm -rf "$RUN"
# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"
PIDS=()
INV_PID=""
trap stop_bench_processes EXIT
trap 'exit 130' INT TERM

INV_PORT=$(free_port)
VIP_PORT=$(free_port)
RULE_ID="127.0.0.1:$VIP_PORT"
sim_fleet "$RUN" "$BIN/kvroute-engine-sim" "$MODEL" "$SLUG" "$VIP_PORT" "${SIMS[@]}"

start_inventory() {
    # The parity canary on (KVROUTE_BENCH_CANARY_MS, default every second): the report counts
    # its verdicts and the divergence verdicts after each gateway run.
    LLB_KV_NONE_HASH_SEED=0 KVROUTE_SCRAPE_INTERVAL_MS=200 KVROUTE_HEALTH_INTERVAL_MS=1000 RUST_LOG=warn \
        KVROUTE_CANARY_INTERVAL_MS="${KVROUTE_BENCH_CANARY_MS:-1000}" \
        "$INVENTORY_BIN" serve --listen "127.0.0.1:$INV_PORT" --config "$RUN/rules.json" \
        --tokenizer-dir "$RUN" >>"$RUN/logs/inventory.log" 2>&1 &
    INV_PID=$!
    wait_http "http://127.0.0.1:$INV_PORT/healthz" "inventory" "$RUN/logs/inventory.log"
}
stop_inventory() {
    kill "$INV_PID" 2>/dev/null || true
    wait "$INV_PID" 2>/dev/null || true
    INV_PID=""
}

# Envoy configs: the shipped envoy/envoy.yaml with this machine's addresses (scripts/local_envoy.py,
# as stack.sh does), the engines cluster rewritten to the four simulators, and a 100 ms callout
# budget (2 cores shared by 4 gateways, the inventory, 4 simulators and the driver).
GW_URLS=()
for g in $(seq 1 "$GATEWAYS"); do
    gw_port=$(free_port)
    admin_port=$(free_port)
    sims_csv=$(IFS=,; echo "${SIMS[*]}")
    python3 "$REPO/scripts/local_envoy.py" "$REPO/envoy/envoy.yaml" "$RUN/envoy-$g.yaml" \
        --wasm "$KVROUTE_WASM" --rule "$RULE_ID" --timeout-ms 100 --listen "$gw_port" \
        --admin "$admin_port" --inventory "$INV_PORT" --sim-port "$SIM_PORT" --sims "$sims_csv"
    "$KVROUTE_ENVOY" -c "$RUN/envoy-$g.yaml" --disable-hot-restart --log-level warn --concurrency 1 \
        --base-id "$((7000 + g))" >"$RUN/logs/envoy-$g.log" 2>&1 &
    PIDS+=($!)
    GW_URLS+=("http://127.0.0.1:$gw_port")
    ADMIN_URLS[g]="http://127.0.0.1:$admin_port"
done

start_inventory
for g in $(seq 1 "$GATEWAYS"); do
    wait_http "${ADMIN_URLS[g]}/ready" "Envoy $g" "$RUN/logs/envoy-$g.log"
    wait_envoy_healthy "${ADMIN_URLS[g]}" "${#SIMS[@]}" "$RUN/logs/envoy-$g.log"
done

# Each gateway's VM fetches the tokenizer from the inventory on its first request; until then
# requests pass unpinned. Warm up each until a request no longer counts a missing tokenizer.
warm() {
    local gw=$1 admin=$2 i before deadline=$((SECONDS + 90))
    no_tok() { curl -fs "$admin/stats?filter=kvroute_filter_no_tokenizer_total" | awk '{s+=$2} END {print s+0}'; }
    for i in $(seq 1 600); do
        before=$(no_tok)
        curl -fs -o /dev/null "$gw/v1/chat/completions" -H 'content-type: application/json' \
            -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"warm-up $i\"}],\"max_tokens\":1}" || true
        if ((i > 2)) && [[ "$(no_tok)" == "$before" ]]; then return 0; fi
        ((SECONDS < deadline)) || die "gateway $gw did not load its tokenizer within 90 s"
    done
    die "gateway $gw did not load its tokenizer after 600 warm-up requests"
}
for g in $(seq 1 "$GATEWAYS"); do warm "${GW_URLS[g - 1]}" "${ADMIN_URLS[g]}"; done

sims_csv=""
for ip in "${SIMS[@]}"; do sims_csv+="${sims_csv:+,}http://$ip:$SIM_PORT"; done
for n in 1 "$GATEWAYS"; do
    say "multi-turn through $n gateway(s), then round robin"
    stop_inventory
    start_inventory
    gws=$(
        IFS=,
        echo "${GW_URLS[*]:0:n}"
    )
    "$BIN/kvroute-bench" --preset small --workloads multi-turn --strategies gateway,round-robin \
        --prefix-tokens 820 --gateway "$gws" --sims "$sims_csv" --model "$MODEL" \
        --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --concurrency 16 --inventory-url "http://127.0.0.1:$INV_PORT" \
        --json "$OUT/gateways-$n.json" --markdown "$OUT/gateways-$n.md" || die "the $n-gateway run failed"
done
