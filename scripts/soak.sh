#!/usr/bin/env bash
# Soak: the whole stack (scripts/stack.sh: Envoy + filter + inventory + 3 simulators) under a mixed
# workload for a few minutes, sampling the resident memory and open file descriptors of Envoy and
# the inventory service, then writing docs/soak.md. Not part of the test command (it takes minutes).
#
#   ./scripts/soak.sh [MINUTES]          default 5
#
# Each cycle drives the multi-turn benchmark workload through the gateway (kvroute-bench, strategy
# `gateway`), then a hostile mix: non-UTF-8 values in the headers the filter reads, a body that is
# one long word, a body that is not JSON, a half-sent request, and a client-supplied pin. Every
# hostile request must get an answer (any status) within its time bound; a cycle whose ordinary
# workload reports an error fails the soak. Memory and descriptors are sampled every 10 s.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
MINUTES="${1:-5}"
[[ "$MINUTES" =~ ^[0-9]+$ ]] && ((MINUTES >= 1 && MINUTES <= 120)) || {
    echo "soak.sh: MINUTES must be a whole number from 1 to 120 (got '$MINUTES')" >&2
    exit 2
}
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
export KVROUTE_INVENTORY_PORT="${KVROUTE_INVENTORY_PORT:-18090}"
export KVROUTE_GATEWAY_PORT="${KVROUTE_GATEWAY_PORT:-18000}"
export KVROUTE_ADMIN_PORT="${KVROUTE_ADMIN_PORT:-18901}"
GW="http://127.0.0.1:$KVROUTE_GATEWAY_PORT"
ADMIN="http://127.0.0.1:$KVROUTE_ADMIN_PORT"
INV="http://127.0.0.1:$KVROUTE_INVENTORY_PORT"
MODEL="Qwen/Qwen3-0.6B"
SIMS="http://127.0.0.10:8000,http://127.0.0.11:8000,http://127.0.0.12:8000"
OUT="$REPO/docs/soak.md"
WORK="$KVROUTE_CACHE/soak"
rm -rf "$WORK"
mkdir -p "$WORK"

say() { echo "soak.sh: $*"; }
die() {
    echo "soak.sh: $*" >&2
    exit 1
}

STACK_PID=""
cleanup() {
    trap - EXIT INT TERM
    if [[ -n "$STACK_PID" ]]; then
        # TERM, not INT: a background job of a script ignores SIGINT.
        kill -TERM "$STACK_PID" 2>/dev/null || true
        wait "$STACK_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "starting the stack (scripts/stack.sh; log $WORK/stack.log)"
KVROUTE_STACK_EXIT=0 ./scripts/stack.sh >"$WORK/stack.log" 2>&1 &
STACK_PID=$!
deadline=$((SECONDS + 1800))
until grep -q "kvroute is running" "$WORK/stack.log"; do
    kill -0 "$STACK_PID" 2>/dev/null || die "stack.sh exited early: $(tail -5 "$WORK/stack.log")"
    ((SECONDS < deadline)) || die "the stack was not up within 30 minutes (log: $WORK/stack.log)"
    sleep 1
done
RUN="$KVROUTE_CACHE/stack"
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh" # KVROUTE_TOKENIZER_DIR (stack.sh ran setup.sh, which wrote it)
envoy_pid=$(pgrep -f -- "-c $RUN/envoy.yaml" | head -1) || die "no Envoy process found"
inv_pid=$(pgrep -f -- "serve --listen 127.0.0.1:$KVROUTE_INVENTORY_PORT" | head -1) || die "no inventory process found"
say "Envoy pid $envoy_pid, inventory pid $inv_pid; soaking for $MINUTES min"

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
fds() { find "/proc/$1/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l; }
stat_sum() { curl -fs --max-time 5 "$ADMIN/stats?filter=$1" | awk '{s+=$2} END {print s+0}'; }

SAMPLES="$WORK/samples.tsv"
printf 't_s\tenvoy_rss_kib\tenvoy_fds\tinventory_rss_kib\tinventory_fds\n' >"$SAMPLES"
sample() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$(rss_kib "$envoy_pid")" "$(fds "$envoy_pid")" \
        "$(rss_kib "$inv_pid")" "$(fds "$inv_pid")" >>"$SAMPLES"
}

# hostile_mix: one request of each hostile kind; counts answers and the ones past their bound.
HOSTILE_SENT=0
HOSTILE_UNANSWERED=0
hostile() {
    HOSTILE_SENT=$((HOSTILE_SENT + 1))
    curl -s -o /dev/null --max-time 10 "$@" || HOSTILE_UNANSWERED=$((HOSTILE_UNANSWERED + 1))
}
long_word="$WORK/long-word.json"
python3 -c "import json; print(json.dumps({'model': '$MODEL', 'messages': [{'role': 'user', 'content': 'a' * 1000000}], 'max_tokens': 1}))" >"$long_word"
hostile_mix() {
    local body="{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":1}"
    for h in x-kvroute-tier x-prefiller-host-port content-type; do
        hostile "$GW/v1/chat/completions" -H "$(printf '%s: \xff\xfe' "$h")" -H 'content-type: application/json' -d "$body"
    done
    hostile "$GW/v1/chat/completions" -H 'content-type: application/json' --data-binary "@$long_word"
    hostile "$GW/v1/chat/completions" -H 'content-type: application/json' -d 'not json {'
    hostile "$GW/v1/chat/completions" -H 'content-type: application/json' -H 'x-kvroute-pin: MTI3LjAuMC4xOjE=' -d "$body"
    # A half-sent request: headers promise a body that never comes; the client gives up after 2 s.
    curl -s -o /dev/null --max-time 2 "$GW/v1/chat/completions" -H 'content-type: application/json' \
        -H 'content-length: 1000' -d '{"model":' || true
}

start=$SECONDS
end=$((start + MINUTES * 60))
next_sample=$start
cycles=0
errors=0
sample 0
while ((SECONDS < end)); do
    ((cycles += 1))
    if ! timeout 300 "$REPO/target/release/kvroute-bench" --preset small --workloads multi-turn --strategies gateway \
        --gateway "$GW" --sims "$SIMS" --model "$MODEL" --prefix-tokens 820 --groups 3 --concurrency 16 \
        --tokenizer-dir "$KVROUTE_TOKENIZER_DIR" --markdown "$WORK/cycle.md" >"$WORK/cycle.log" 2>&1; then
        ((errors += 1))
        say "cycle $cycles: the workload failed ($(tail -1 "$WORK/cycle.log"))"
    fi
    hostile_mix
    if ((SECONDS >= next_sample)); then
        sample $((SECONDS - start))
        next_sample=$((SECONDS + 10))
    fi
    say "cycle $cycles done, $((SECONDS - start)) s elapsed"
done
sample $((SECONDS - start))
kill -0 "$envoy_pid" 2>/dev/null || die "Envoy died during the soak"
kill -0 "$inv_pid" 2>/dev/null || die "the inventory died during the soak"
honored=$(stat_sum kvroute_filter_pin_honored_total)
overridden=$(stat_sum kvroute_filter_pin_overridden_total)
requests=$(stat_sum kvroute_filter_requests_total)

SOAK_MINUTES=$MINUTES SOAK_CYCLES=$cycles SOAK_ERRORS=$errors SOAK_HOSTILE=$HOSTILE_SENT \
    SOAK_UNANSWERED=$HOSTILE_UNANSWERED SOAK_REQUESTS=$requests SOAK_HONORED=$honored \
    SOAK_OVERRIDDEN=$overridden python3 "$REPO/scripts/report.py" soak "$SAMPLES" "$OUT"
say "wrote $OUT ($cycles cycles, $errors failed, $HOSTILE_UNANSWERED of $HOSTILE_SENT hostile requests unanswered)"
((errors == 0 && HOSTILE_UNANSWERED == 0)) || exit 1
