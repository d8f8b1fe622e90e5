#!/usr/bin/env bash
# README command one: the whole kvroute stack on 127.0.0.1, in memory (no Redis).
#
#   inventory service  http://127.0.0.1:${KVROUTE_INVENTORY_PORT:-8090}
#   3 vLLM simulators  http://127.0.0.10-12:8000 (ZMQ events on :5557, replay on :5657), Qwen3 tokenizer
#   Envoy + filter     http://127.0.0.1:${KVROUTE_GATEWAY_PORT:-10000}  (admin :${KVROUTE_ADMIN_PORT:-9901})
#
# It installs what is missing (scripts/setup.sh), builds the filter .wasm and the binaries (release),
# starts everything, waits until each part is ready, drives a short multi-turn workload through the
# gateway and a round-robin baseline over the same simulators (caches reset in between), prints
# the cached-token ratio and TTFT of both, then keeps the stack up until Ctrl-C.
# KVROUTE_STACK_EXIT=1 stops it after the demo (used by the end-to-end test of this script).
# KVROUTE_INVENTORY_BIN=PATH runs that kvroute-inventory binary instead of the workspace's (to
# compare two builds on the same demo).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
INV_PORT="${KVROUTE_INVENTORY_PORT:-8090}"
GW_PORT="${KVROUTE_GATEWAY_PORT:-10000}"
ADMIN_PORT="${KVROUTE_ADMIN_PORT:-9901}"
MODEL="Qwen/Qwen3-0.6B"
SLUG="Qwen__Qwen3-0.6B"
SIMS=(127.0.0.10 127.0.0.11 127.0.0.12)
SIM_PORT=8000
ZMQ_PORT=5557
REPLAY_PORT=5657
VIP="127.0.0.1"
RULE_ID="$VIP:$GW_PORT"

say() { echo "stack.sh: $*"; }
die() { echo "stack.sh: $*" >&2; exit 1; }

say "setup"
./scripts/setup.sh
say "building the filter .wasm"
./scripts/build-wasm.sh
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"
say "building kvroute-inventory, kvroute-engine-sim, kvroute-bench (release)"
# Two builds, not one: built alone, kvroute-inventory has the same dependency features as in
# scripts/build-images.sh, so the test command does not build its release binary twice.
cargo build --release -q -p kvroute-inventory
cargo build --release -q -p kvroute-engine-sim
BIN="$REPO/target/release"
INVENTORY_BIN="${KVROUTE_INVENTORY_BIN:-$BIN/kvroute-inventory}"
[[ -x "$INVENTORY_BIN" ]] || die "KVROUTE_INVENTORY_BIN=$INVENTORY_BIN is not an executable"

RUN="$KVROUTE_CACHE/stack"
rm -rf "$RUN"
mkdir -p "$RUN/tokenizers/$SLUG" "$RUN/logs"
cp "$KVROUTE_TOKENIZER_DIR"/tokenizer.json "$KVROUTE_TOKENIZER_DIR"/tokenizer_config.json "$RUN/tokenizers/$SLUG/"
head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$RUN/admin-token"

for port in "$INV_PORT" "$GW_PORT" "$ADMIN_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        die "port $port on 127.0.0.1 is in use (another stack running?); set KVROUTE_INVENTORY_PORT / KVROUTE_GATEWAY_PORT / KVROUTE_ADMIN_PORT"
    fi
done

PIDS=()
cleanup() {
    trap - EXIT INT TERM
    if ((${#PIDS[@]})); then
        kill "${PIDS[@]}" 2>/dev/null || true
        wait "${PIDS[@]}" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'echo; say "stopping"; exit 0' INT TERM

# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"

say "starting the inventory service on 127.0.0.1:$INV_PORT"
# Load comes from the engines' /metrics (running + waiting), scraped every 200 ms: without it the
# service estimates load from its own decisions only, and placement and spill relief see less.
# LLB_KV_NONE_HASH_SEED is the simulators' PYTHONHASHSEED (--seed 0): one leg of the key contract.
LLB_KV_NONE_HASH_SEED=0 KVROUTE_SCRAPE_INTERVAL_MS=200 \
    "$INVENTORY_BIN" serve --listen "127.0.0.1:$INV_PORT" --tokenizer-dir "$RUN" \
    --auth-token-file "$RUN/admin-token" >"$RUN/logs/inventory.log" 2>&1 &
PIDS+=($!)
# 6.4 ms per output token, a GPU's pace for a small model: a request lasts ~0.1 s, so the 16 in
# flight overlap on the engines as a fleet's do (at the simulator's 0.4 ms default each lasts a
# few ms and the demo's load swings faster than placement can follow).
for ip in "${SIMS[@]}"; do
    say "starting a vLLM simulator on $ip:$SIM_PORT"
    "$BIN/kvroute-engine-sim" --listen "$ip:$SIM_PORT" --engine vllm --seed 0 --block-size 16 \
        --kv-blocks 96 --zmq-port "$ZMQ_PORT" --replay-port "$REPLAY_PORT" --topic kv-events \
        --prefill-us-per-token 40 --decode-us-per-token 6400 --max-concurrency 4 \
        --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --model "$MODEL" --name "sim-$ip" \
        >"$RUN/logs/sim-$ip.log" 2>&1 &
    PIDS+=($!)
done
wait_http "http://127.0.0.1:$INV_PORT/healthz" "inventory" "$RUN/logs/inventory.log"
for ip in "${SIMS[@]}"; do
    wait_http "http://$ip:$SIM_PORT/health" "simulator $ip" "$RUN/logs/sim-$ip.log"
done

say "loading the rule $RULE_ID (vLLM, sha256_cbor, PYTHONHASHSEED=0, block 16, kvExactMode 3)"
endpoints=""
for ip in "${SIMS[@]}"; do
    endpoints+="${endpoints:+,}{\"endpointIP\":\"$ip\",\"targetPort\":$SIM_PORT,\"weight\":1}"
done
rule="{\"serviceArguments\":{\"externalIP\":\"$VIP\",\"port\":$GW_PORT,\"protocol\":\"tcp\",\"sel\":0,\"mode\":4,
\"kvExactMode\":3,\"kvEngineType\":\"vllm\",\"kvHashAlgo\":\"sha256_cbor\",\"kvBlockSize\":16,\"kvZmqPort\":$ZMQ_PORT,
\"kvReplayPort\":$REPLAY_PORT,\"kvModel\":\"$MODEL\"},\"endpoints\":[$endpoints]}"
created=$(curl -fsS -X POST "http://127.0.0.1:$INV_PORT/netlox/v1/config/loadbalancer" \
    -H "authorization: Bearer $(cat "$RUN/admin-token")" -H 'content-type: application/json' \
    --data "$rule") || die "the inventory refused the rule (log: $RUN/logs/inventory.log)"
SERVICE_ID=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])' <<<"$created")

say "starting Envoy with the filter on 127.0.0.1:$GW_PORT"
# The shipped envoy/envoy.yaml, with this machine's addresses: what a user copies is what runs here.
# One change: the route callout budget is 100 ms instead of 25 ms, because on a small machine the
# gateway, the service, three simulators and the load generator share the same cores.
sims_csv=$(IFS=,; echo "${SIMS[*]}")
python3 scripts/local_envoy.py envoy/envoy.yaml "$RUN/envoy.yaml" --wasm "$KVROUTE_WASM" \
    --rule "$RULE_ID" --timeout-ms 100 --listen "$GW_PORT" --admin "$ADMIN_PORT" \
    --inventory "$INV_PORT" --sim-port "$SIM_PORT" --sims "$sims_csv" ||
    die "could not write $RUN/envoy.yaml from envoy/envoy.yaml"
"$KVROUTE_ENVOY" -c "$RUN/envoy.yaml" --disable-hot-restart --log-level warn --concurrency 2 \
    >"$RUN/logs/envoy.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$ADMIN_PORT/ready" "Envoy" "$RUN/logs/envoy.log"
hosts=$(curl -fsS "http://127.0.0.1:$ADMIN_PORT/clusters" | grep -c "^engines::.*:$SIM_PORT::cx_active::" || true)
((hosts == ${#SIMS[@]})) || die "Envoy's engines cluster has $hosts hosts, the rule ${#SIMS[@]} endpoints ($RUN/envoy.yaml)"
# Pins take effect only on hosts that passed a health check; the first probes can fail while
# Envoy's main thread compiles the module.
wait_envoy_healthy "http://127.0.0.1:$ADMIN_PORT" "${#SIMS[@]}" "$RUN/logs/envoy.log"

# Each Envoy worker VM fetches and parses the tokenizer on its first request (about a second);
# until then requests pass unpinned. Warm up until a request no longer finds the tokenizer missing.
# stat NAME: the sum of Envoy's stats matching NAME (one per worker VM).
stat() { curl -fs "http://127.0.0.1:$ADMIN_PORT/stats?filter=$1" | awk '{s+=$2} END {print s+0}'; }
no_tok() { stat kvroute_filter_no_tokenizer_total; }
deadline=$((SECONDS + 60))
for i in $(seq 1 600); do
    before=$(no_tok)
    curl -fs -o /dev/null "http://127.0.0.1:$GW_PORT/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"warm-up $i\"}],\"max_tokens\":1}" || true
    if ((i > 4)) && [[ "$(no_tok)" == "$before" ]]; then break; fi
    ((SECONDS < deadline)) || die "the filter did not load its tokenizer within 60 s (log: $RUN/logs/envoy.log)"
done

sims_csv=""
for ip in "${SIMS[@]}"; do sims_csv+="${sims_csv:+,}http://$ip:$SIM_PORT"; done
say "driving a multi-turn workload: kvroute through the gateway, then round robin (caches reset in between)"
# The simulators' costs and the prompt sizes (in Qwen3 tokens) are the benchmark's (docs/benchmarks.md).
"$BIN/kvroute-bench" --preset small --workloads multi-turn --strategies gateway,round-robin \
    --gateway "http://127.0.0.1:$GW_PORT" --sims "$sims_csv" --model "$MODEL" \
    --prefix-tokens 820 --groups 3 --concurrency 16 \
    --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --markdown "$RUN/demo.md" || die "the workload failed"

# Did Envoy send each pinned request where the filter pinned it? (Counted by the filter.)
honored=$(stat kvroute_filter_pin_honored_total)
overridden=$(stat kvroute_filter_pin_overridden_total)
say "Envoy followed $honored pins and overrode $overridden"
if ((overridden > 0)); then
    say "WARNING: Envoy sent $overridden pinned requests elsewhere (an engine unhealthy or not yet health-checked?); see http://127.0.0.1:$ADMIN_PORT/clusters"
fi

# The service's parity self-check: a mismatched key contract would make the demo meaningless.
if curl -fs "http://127.0.0.1:$INV_PORT/healthz" | grep -q '"status":"degraded"'; then
    say "WARNING: /healthz is degraded (a parity mismatch or a missing tokenizer); see $RUN/logs/inventory.log"
fi

cat <<MSG

kvroute is running:
  gateway (OpenAI API)  http://127.0.0.1:$GW_PORT/v1/chat/completions   model "$MODEL"
  inventory service     http://127.0.0.1:$INV_PORT  (/metrics, /healthz, /netlox/v1/config/loadbalancer/all)
  inventory of sim 0    http://127.0.0.1:$INV_PORT/netlox/v1/config/ai/kv/inventory?service_id=$SERVICE_ID&ep_idx=0
  Envoy admin           http://127.0.0.1:$ADMIN_PORT/stats?filter=kvroute
  simulators            $sims_csv
  logs                  $RUN/logs/
Try:
  curl -s http://127.0.0.1:$GW_PORT/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"$MODEL","messages":[{"role":"user","content":"Hello"}]}' -D - | grep -i x-kvroute
MSG
if [[ "${KVROUTE_STACK_EXIT:-0}" == 1 ]]; then
    exit 0
fi
say "Ctrl-C stops everything"
wait "${PIDS[0]}"
