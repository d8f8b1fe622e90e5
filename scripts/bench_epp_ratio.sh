#!/usr/bin/env bash
# The endpoint picker next to the Wasm filter: the same workload on the same fleet routed by
# Envoy + the kvroute filter and by Envoy + ext_proc pointed at the inventory's picker, in paired,
# interleaved runs, so their cached-token ratios can be compared run by run.
# Called by scripts/bench.sh (part epp, which has installed Envoy, built the .wasm and the release
# binaries); docs/bench-epp-ratio.md is written from its results by `report.py epp`.
#
#   4 vLLM simulators  127.0.0.40-43 (Qwen3 tokenizer, 96 KV blocks, ZMQ events)
#   1 inventory        127.0.0.1:<free port> (HTTP API: the filter's callouts) and its endpoint
#                      picker on 127.0.0.1:<free port> (--epp-listen); in memory, restarted before
#                      every run, so each run starts with no placement memory or in-flight state
#   Envoy "wasm"       envoy/envoy.yaml with this machine's addresses (scripts/local_envoy.py, as
#                      bench_gateways.sh), 100 ms callout budget, --concurrency 1
#   Envoy "epp"        the ext_proc + override_host bootstrap of the real-Envoy tests
#                      (tests/src/envoy.rs, epp_bootstrap; docs/epp.md, *Plain Envoy*): full-duplex
#                      streamed request body, response body NONE, failing open, --concurrency 1
#
# Per arrival (staggered, burst) and round r = 1..KVROUTE_EPP_ROUNDS (default 5): one run of
# kvroute-bench's `gateway` strategy through each Envoy, the order alternating by round (odd rounds
# wasm first), then one round-robin run straight to the simulators for reference. kvroute-bench
# resets the simulators' caches (POST /reset_prefix_cache) at the start of every run. Workload:
# the small preset's multi-turn sessions with system prompts sized in tokens (--prefix-tokens 820,
# as bench_gateways.sh).
#
# Writes into OUT_DIR, for arrival A, path P (wasm, epp, rr) and round R:
#   epp-ratio-A-P-R.{json,md}      kvroute-bench's results (and -records.json, per request, for
#                                  the gateway paths)
#   epp-ratio-A-P-R.envoy-{before,after}  that Envoy's kvroute counters around the run (wasm:
#                                  wasmcustom.kvroute_filter_*, epp: ext_proc and cluster engines)
#   epp-ratio-A-P-R.inventory      the inventory's /metrics at the end of the run (P: wasm, epp)
#   epp-ratio-order                one line per run: arrival round path, in the order run
#   epp-ratio-load                 /proc/loadavg before the first run and after the last
#
# KVROUTE_EPP_ROUNDS=N sets the rounds, KVROUTE_EPP_ARRIVALS="staggered burst" the arrivals. Every
# process started here is stopped on exit; every wait is bounded (scripts/lib.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${1:?usage: bench_epp_ratio.sh OUT_DIR}"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"
BIN="${CARGO_TARGET_DIR:-$REPO/target}/release"
INVENTORY_BIN="${KVROUTE_INVENTORY_BIN:-$BIN/kvroute-inventory}"
MODEL="Qwen/Qwen3-0.6B"
SLUG="Qwen__Qwen3-0.6B"
SIMS=(127.0.0.40 127.0.0.41 127.0.0.42 127.0.0.43)
ROUNDS="${KVROUTE_EPP_ROUNDS:-5}"
read -r -a ARRIVALS <<<"${KVROUTE_EPP_ARRIVALS:-staggered burst}"

say() { echo "bench_epp_ratio.sh: $*"; }
die() {
    echo "bench_epp_ratio.sh: $*" >&2
    exit 1
}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "KVROUTE_EPP_ROUNDS=$ROUNDS: allowed a positive integer"
((${#ARRIVALS[@]} > 0)) || die "KVROUTE_EPP_ARRIVALS is empty (allowed: staggered, burst)"
for a in "${ARRIVALS[@]}"; do
    [[ "$a" == staggered || "$a" == burst ]] || die "KVROUTE_EPP_ARRIVALS: '$a' (allowed: staggered, burst)"
done
[[ -f "$KVROUTE_WASM" ]] || die "no filter module at $KVROUTE_WASM: run scripts/build-wasm.sh"
[[ -x "$KVROUTE_ENVOY" ]] || die "no Envoy at $KVROUTE_ENVOY: run scripts/setup.sh"
for b in "$INVENTORY_BIN" "$BIN/kvroute-engine-sim" "$BIN/kvroute-bench"; do
    [[ -x "$b" ]] || die "no $b: cargo build --release -p kvroute-inventory -p kvroute-engine-sim"
done

mkdir -p "$OUT"
RUN="$OUT/epp-ratio-run"
rm -rf "$RUN"
rm -f "$OUT"/epp-ratio-*
# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"
PIDS=()
INV_PID=""
trap stop_bench_processes EXIT
trap 'exit 130' INT TERM

INV_PORT=$(free_port)
EPP_PORT=$(free_port)
VIP_PORT=$(free_port)
RULE_ID="127.0.0.1:$VIP_PORT"
sim_fleet "$RUN" "$BIN/kvroute-engine-sim" "$MODEL" "$SLUG" "$VIP_PORT" "${SIMS[@]}"

# The picker's gRPC readiness (grpc.health.v1.Health/Check, service "readiness": the rule is
# installed and its tokenizer loaded), asked as a Kubernetes gRPC probe would, over h2c with curl.
# The answer SERVING is the message 08 01 behind gRPC's 5-byte frame header.
printf '\x00\x00\x00\x00\x0b\x0a\x09readiness' >"$RUN/health-readiness.bin"
picker_ready() {
    curl -s --http2-prior-knowledge --max-time 2 -H 'content-type: application/grpc' -H 'te: trailers' \
        --data-binary @"$RUN/health-readiness.bin" "http://127.0.0.1:$EPP_PORT/grpc.health.v1.Health/Check" |
        od -An -tx1 | tr -d ' \n' | grep -qx '00000000020801'
}
# The inventory knows the fleet: every endpoint healthy and its ZMQ subscriber connected (a run
# started earlier would lose the first BlockStored events, and with them part of the ratio).
fleet_ready() {
    local m
    m=$(curl -fs --max-time 2 "http://127.0.0.1:$INV_PORT/metrics") || return 1
    (($(grep -c '^kvroute_endpoint_healthy{.*} 1$' <<<"$m") == ${#SIMS[@]})) &&
        (($(grep -c '^kvroute_ingest_subscriber_connected{.*} 1$' <<<"$m") == ${#SIMS[@]}))
}
start_inventory() {
    LLB_KV_NONE_HASH_SEED=0 KVROUTE_SCRAPE_INTERVAL_MS=200 KVROUTE_HEALTH_INTERVAL_MS=1000 RUST_LOG=warn \
        "$INVENTORY_BIN" serve --listen "127.0.0.1:$INV_PORT" --config "$RUN/rules.json" \
        --tokenizer-dir "$RUN" --epp-listen "127.0.0.1:$EPP_PORT" --epp-rule "$RULE_ID" \
        >>"$RUN/logs/inventory.log" 2>&1 &
    INV_PID=$!
    wait_http "http://127.0.0.1:$INV_PORT/healthz" "inventory" "$RUN/logs/inventory.log"
    poll "$RUN/logs/inventory.log" picker_ready ||
        die "the endpoint picker on 127.0.0.1:$EPP_PORT did not report ready within 60 s"
    poll "$RUN/logs/inventory.log" fleet_ready ||
        die "the inventory did not see ${#SIMS[@]} healthy, subscribed endpoints within 60 s"
}
stop_inventory() {
    kill "$INV_PID" 2>/dev/null || true
    wait "$INV_PID" 2>/dev/null || true
    INV_PID=""
}

sims_csv=$(IFS=,; echo "${SIMS[*]}")
WASM_PORT=$(free_port)
WASM_ADMIN=$(free_port)
python3 "$REPO/scripts/local_envoy.py" "$REPO/envoy/envoy.yaml" "$RUN/envoy-wasm.yaml" \
    --wasm "$KVROUTE_WASM" --rule "$RULE_ID" --timeout-ms 100 --listen "$WASM_PORT" \
    --admin "$WASM_ADMIN" --inventory "$INV_PORT" --sim-port "$SIM_PORT" --sims "$sims_csv"

# The endpoint picker's Envoy, as tests/src/envoy.rs's epp_bootstrap writes it for the real-Envoy
# tests (docs/epp.md shows the same as *Plain Envoy*; no plain-Envoy file ships in envoy/, and
# deploy/gie/ leaves the proxy's configuration to the GIE gateway).
EPP_GW_PORT=$(free_port)
EPP_ADMIN=$(free_port)
{
    cat <<EOF
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $EPP_ADMIN}}
static_resources:
  listeners:
    - name: ingress
      address: {socket_address: {address: 127.0.0.1, port_value: $EPP_GW_PORT}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          route:
                            cluster: engines
                            timeout: 0s
                            retry_policy: {retry_on: "connect-failure,refused-stream,reset", num_retries: 1}
                http_filters:
                  - name: envoy.filters.http.header_mutation
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
                      mutations: {request_mutations: [{remove: x-gateway-destination-endpoint}]}
                  - name: envoy.filters.http.ext_proc
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
                      grpc_service: {envoy_grpc: {cluster_name: kvroute_epp}}
                      failure_mode_allow: true
                      message_timeout: 0.2s
                      processing_mode:
                        request_header_mode: SEND
                        response_header_mode: SEND
                        request_body_mode: FULL_DUPLEX_STREAMED
                        request_trailer_mode: SEND
                        response_body_mode: NONE
                        response_trailer_mode: SKIP
                      metadata_options:
                        forwarding_namespaces: {untyped: [envoy.lb]}
                        receiving_namespaces: {untyped: [envoy.lb]}
                  - name: envoy.filters.http.router
                    typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
    - name: engines
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: engines
        endpoints:
          - lb_endpoints:
EOF
    for ip in "${SIMS[@]}"; do
        echo "              - endpoint: {address: {socket_address: {address: $ip, port_value: $SIM_PORT}}}"
    done
    cat <<EOF
      load_balancing_policy:
        policies:
          - typed_extension_config:
              name: envoy.load_balancing_policies.override_host
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
                override_host_sources:
                  - header: x-gateway-destination-endpoint
                  - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
                selected_host_key: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint-served}]}
                fallback_policy:
                  policies:
                    - typed_extension_config:
                        name: envoy.load_balancing_policies.round_robin
                        typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin}
    - name: kvroute_epp
      type: STATIC
      connect_timeout: 0.25s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {http2_protocol_options: {}}
      load_assignment:
        cluster_name: kvroute_epp
        endpoints:
          - lb_endpoints:
              - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $EPP_PORT}}}
EOF
} >"$RUN/envoy-epp.yaml"

"$KVROUTE_ENVOY" -c "$RUN/envoy-wasm.yaml" --disable-hot-restart --log-level warn --concurrency 1 \
    --base-id 7401 >"$RUN/logs/envoy-wasm.log" 2>&1 &
PIDS+=($!)
"$KVROUTE_ENVOY" -c "$RUN/envoy-epp.yaml" --disable-hot-restart --log-level warn --concurrency 1 \
    --base-id 7402 >"$RUN/logs/envoy-epp.log" 2>&1 &
PIDS+=($!)
declare -A GW=([wasm]="http://127.0.0.1:$WASM_PORT" [epp]="http://127.0.0.1:$EPP_GW_PORT")
declare -A ADMIN=([wasm]="http://127.0.0.1:$WASM_ADMIN" [epp]="http://127.0.0.1:$EPP_ADMIN")
# What each Envoy counts about routing (compared around every run by report.py).
declare -A STATS=([wasm]="^wasmcustom\.kvroute_filter_" [epp]="ext_proc|^cluster\.engines\.upstream_rq_total")
envoy_stats() { curl -fsG --max-time 5 --data-urlencode "filter=${STATS[$1]}" "${ADMIN[$1]}/stats"; }

start_inventory
wait_http "${ADMIN[wasm]}/ready" "Envoy wasm" "$RUN/logs/envoy-wasm.log"
wait_envoy_healthy "${ADMIN[wasm]}" "${#SIMS[@]}" "$RUN/logs/envoy-wasm.log"
wait_http "${ADMIN[epp]}/ready" "Envoy epp" "$RUN/logs/envoy-epp.log"

# The filter's worker VM fetches the tokenizer from the inventory on its first request; until
# then requests pass unpinned. Warm it up until a request no longer counts a missing tokenizer
# (as bench_gateways.sh). The picker loads its tokenizer itself (its readiness, above).
no_tok() { curl -fs "${ADMIN[wasm]}/stats?filter=kvroute_filter_no_tokenizer_total" | awk '{s+=$2} END {print s+0}'; }
warmed=""
deadline=$((SECONDS + 90))
for i in $(seq 1 600); do
    before=$(no_tok)
    curl -fs -o /dev/null "${GW[wasm]}/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"warm-up $i\"}],\"max_tokens\":1}" || true
    if ((i > 2)) && [[ "$(no_tok)" == "$before" ]]; then
        warmed=1
        break
    fi
    ((SECONDS < deadline)) || break
done
[[ -n "$warmed" ]] || die "the Wasm gateway did not load its tokenizer within 90 s"

cat /proc/loadavg >"$OUT/epp-ratio-load"
sims_urls=""
for ip in "${SIMS[@]}"; do sims_urls+="${sims_urls:+,}http://$ip:$SIM_PORT"; done
common=(--preset small --workloads multi-turn --prefix-tokens 820 --sims "$sims_urls" --model "$MODEL"
    --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --concurrency 16)

# run ARRIVAL ROUND PATH: one kvroute-bench run; for a gateway path on a fresh inventory, with
# that Envoy's counters before and after and the inventory's metrics at the end.
run() {
    local arrival=$1 round=$2 path=$3 base
    base="$OUT/epp-ratio-$arrival-$path-$round"
    say "$arrival arrival, round $round of $ROUNDS: $path"
    echo "$arrival $round $path" >>"$OUT/epp-ratio-order"
    if [[ "$path" == rr ]]; then
        "$BIN/kvroute-bench" "${common[@]}" --arrival "$arrival" --strategies round-robin \
            --json "$base.json" --markdown "$base.md" >/dev/null || die "the $path run failed"
        return 0
    fi
    stop_inventory
    start_inventory
    envoy_stats "$path" >"$base.envoy-before"
    "$BIN/kvroute-bench" "${common[@]}" --arrival "$arrival" --strategies gateway --gateway "${GW[$path]}" \
        --json "$base.json" --markdown "$base.md" --records "$base-records.json" >/dev/null ||
        die "the $path run failed"
    envoy_stats "$path" >"$base.envoy-after"
    curl -fs "http://127.0.0.1:$INV_PORT/metrics" >"$base.inventory"
}

for arrival in "${ARRIVALS[@]}"; do
    for round in $(seq 1 "$ROUNDS"); do
        if ((round % 2)); then order=(wasm epp); else order=(epp wasm); fi
        for path in "${order[@]}" rr; do run "$arrival" "$round" "$path"; done
    done
done
cat /proc/loadavg >>"$OUT/epp-ratio-load"
say "done: results in $OUT/epp-ratio-*"
