# Shell helpers shared by the scripts that start processes (stack.sh, bench_gateways.sh).
# Source it after defining `die MESSAGE` (prints and exits).

# wait_http URL NAME LOG: polls until URL answers 2xx, at most 60 s, or dies with the log's tail.
wait_http() {
    local url=$1 name=$2 log=$3 deadline=$((SECONDS + 60))
    until curl -fs -o /dev/null --max-time 2 "$url"; do
        if ((SECONDS > deadline)); then
            tail -20 "$log" >&2 || true
            die "$name did not become ready at $url within 60 s (log: $log)"
        fi
        sleep 0.2
    done
}
