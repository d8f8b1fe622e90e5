#!/usr/bin/env bash
# /v1/route benchmark: queries/s and service CPU per query at 512 keys, a hit against a miss, in
# every body encoding the service accepts; the service alone on CPU 0, wrk on CPU 1; interleaved
# rounds. Writes docs/bench-route.md.
# Usage: ./scripts/bench-route.sh   (about ROUNDS x cases x SECS seconds; run on an idle machine)
# Knobs: KVROUTE_BENCH_ROUNDS (5), KVROUTE_BENCH_SECS (5).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
for t in wrk taskset; do
    command -v "$t" >/dev/null || { echo "bench-route.sh: $t is required (apt-get install wrk util-linux)" >&2; exit 1; }
done
(($(nproc) >= 2)) || { echo "bench-route.sh: needs 2 CPUs" >&2; exit 1; }
table="$(mktemp)"
trap 'rm -f "$table"' EXIT
before="$(cut -d' ' -f1-3 /proc/loadavg)"
KVROUTE_BENCH_OUT="$table" cargo test --release -p kvroute-inventory --test route_bench \
    -- --ignored --nocapture --test-threads 1
{
    echo "# Route benchmark"
    echo
    echo "Command: \`./scripts/bench-route.sh\` (release build; \`kvroute-inventory\` pinned to CPU 0, wrk with"
    echo "1 thread and 8 connections pinned to CPU 1, ${KVROUTE_BENCH_ROUNDS:-5} interleaved rounds of ${KVROUTE_BENCH_SECS:-5} s per case)."
    echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores;"
    echo "load average before: $before."
    echo
    echo "One rule of 4 endpoints (vLLM contract). A **hit** asks for 512 keys endpoint 0 holds (all"
    echo "matched); a **miss** asks for 512 keys nobody holds, with a first key new in every request, so"
    echo "each miss is a new conversation whose speculative credit is stored. CPU per query is the"
    echo "service's user+system time over the run divided by the queries answered; queries/s per core is"
    echo "its inverse. Figures are the median (min-max) over the rounds."
    echo
    cat "$table"
} >docs/bench-route.md
cat docs/bench-route.md
