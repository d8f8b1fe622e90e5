#!/usr/bin/env bash
# Route queries/s of ONE inventory replica, standalone vs replicated, with the replica alone on
# CPU 0 and the load generator (wrk) and redis-server on CPU 1; the two peer replicas are paused
# (SIGSTOP) while measuring, as if they ran on their own hosts. This isolates what replication
# costs the replica that answers (writer, tailer, encoding), which the unpinned benchmark
# (bench-replication.sh) cannot on a 2-core machine. Needs 2+ CPUs, wrk (apt-get install wrk),
# redis-server, taskset. Appends a table to docs/bench-replication.md.
# Usage: ./scripts/bench-replication-pinned.sh [ROUNDS (4)] [SECONDS (8)]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
ROUNDS="${1:-4}"
SECS="${2:-8}"
for t in wrk redis-server redis-cli taskset python3; do
    command -v "$t" >/dev/null || { echo "bench-replication-pinned.sh: $t is required" >&2; exit 1; }
done
(($(nproc) >= 2)) || { echo "bench-replication-pinned.sh: needs 2 CPUs" >&2; exit 1; }
cargo build --release -q -p kvroute-inventory
BIN="$REPO/target/release/kvroute-inventory"
RUN="$(mktemp -d)"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$RUN"
}
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RPORT=$(port)
taskset -c 1 redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$RUN" >/dev/null &
PIDS+=($!)
for _ in $(seq 1 100); do [[ "$(redis-cli -p "$RPORT" ping 2>/dev/null)" == PONG ]] && break; sleep 0.05; done
cat >"$RUN/rules.json" <<JSON
[{"serviceArguments":{"externalIP":"10.0.0.1","port":8080,"protocol":"tcp","sel":0,"mode":4,"kvExactMode":3,
"kvBlockSize":16,"kvEngineType":"vllm","kvZmqPort":$(port)},"endpoints":[{"endpointIP":"127.0.0.91","targetPort":9,"weight":1},
{"endpointIP":"127.0.0.92","targetPort":9,"weight":1}]}]
JSON
python3 -c "
import json
body = json.dumps({'rule': '10.0.0.1:8080', 'keys': list(range(1000, 1064)), 'token_count': 1024})
print('wrk.method=\"POST\"'); print('wrk.headers[\"content-type\"]=\"application/json\"'); print('wrk.body=' + json.dumps(body))
" >"$RUN/post.lua"
# start NAME CPU [redis]: starts a replica pinned to CPU, prints "pid port".
start() {
    local p; p=$(port)
    local env=(KVROUTE_HEALTH_INTERVAL_MS=0 RUST_LOG=warn)
    [[ "${3:-}" == redis ]] && env+=(KVROUTE_REDIS_URL="redis://127.0.0.1:$RPORT" KVROUTE_REPLICA_ID="$1")
    env "${env[@]}" taskset -c "$2" "$BIN" serve --listen "127.0.0.1:$p" --config "$RUN/rules.json" \
        >"$RUN/$1.out" 2>"$RUN/$1.err" &
    echo "$! $p"
}
read -r SOLO_PID SOLO_PORT < <(start solo 0)
read -r A_PID A_PORT < <(start a 0 redis)
read -r B_PID _ < <(start b 1 redis)
read -r C_PID _ < <(start c 1 redis)
PIDS+=("$SOLO_PID" "$A_PID" "$B_PID" "$C_PID")
for p in "$SOLO_PORT" "$A_PORT"; do
    for _ in $(seq 1 200); do curl -fs -o /dev/null "http://127.0.0.1:$p/readyz" && break; sleep 0.05; done
done
# The peers' tailers and writers must have started before they are paused.
for _ in $(seq 1 200); do
    [[ "$(redis-cli -p "$RPORT" hlen 'kvroute:{rules}:set')" -ge 1 ]] && break
    sleep 0.05
done
kill -STOP "$B_PID" "$C_PID"
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }
measure() { # PID PORT -> "qps us_cpu_per_query"
    local c0 c1 r
    c0=$(cpu "$1")
    r=$(taskset -c 1 wrk -t1 -c8 -d"${SECS}s" -s "$RUN/post.lua" "http://127.0.0.1:$2/v1/route" | awk '/Requests\/sec/ {print $2}')
    c1=$(cpu "$1")
    python3 -c "print(f'{$r:.0f}', f'{($c1-$c0)/100/($r*$SECS)*1e6:.1f}')"
}
rows=""
for i in $(seq 1 "$ROUNDS"); do
    read -r sq sc < <(measure "$SOLO_PID" "$SOLO_PORT")
    read -r rq rc < <(measure "$A_PID" "$A_PORT")
    rows+="| $i | $sq | $rq | $(python3 -c "print(f'{($rq/$sq-1)*100:+.1f}%')") | $sc | $rc |"$'\n'
    echo "round $i: standalone $sq q/s $sc us, replicated $rq q/s $rc us"
done
kill -CONT "$B_PID" "$C_PID"
{
    echo
    echo "## Pinned: one replica on its own CPU (\`./scripts/bench-replication-pinned.sh\`)"
    echo
    echo "The measured replica alone on CPU 0; wrk (1 thread, 8 connections, ${SECS} s, 64-key route queries) and"
    echo "redis-server on CPU 1; the two peer replicas paused while measuring (as on their own hosts)."
    echo "Standalone and replicated alternate. Measured $(date -u +%Y-%m-%d)."
    echo
    echo "| round | standalone q/s | replicated q/s | change | standalone CPU us/query | replicated CPU us/query |"
    echo "|---|---|---|---|---|---|"
    printf '%s' "$rows"
} >>docs/bench-replication.md
tail -n $((ROUNDS + 8)) docs/bench-replication.md
