#!/usr/bin/env bash
# Ingestion benchmark: one real ZMQ publisher per endpoint on loopback, the service subscribed to
# all of them (per-endpoint kvZmqEndpoint), block events through decode, keying and the index.
# Reports events/s, the service's CPU per event and the publish-to-index lag, with one hot
# publisher, at capacity (stores and removals) and growing (stores only). Writes
# docs/bench-ingest.md. Takes about 15 minutes with a baseline; run on an otherwise idle machine.
#
#   scripts/bench-ingest.sh [--baseline REV]
#     --baseline REV  also runs the service built from git revision REV, run by run with this
#                     build's, and adds the paired ratios of CPU per event
#   KVROUTE_BENCH_ENDPOINTS=16,256,1024 KVROUTE_BENCH_WINDOWS=20 KVROUTE_BENCH_BATCHES=50 \
#     KVROUTE_BENCH_MIN_EVENTS=8000000 KVROUTE_BENCH_ROUNDS=5 KVROUTE_BENCH_FLEET_KEYS=1048576 scripts/bench-ingest.sh
#   KVROUTE_BENCH_OUT=/tmp/ingest.md scripts/bench-ingest.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# One socket per publisher and per subscriber: 2 x 1024 descriptors and more.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
[[ -f .cache/env.sh ]] && source .cache/env.sh
if [[ "${1:-}" == --baseline ]]; then
    die() { echo "bench-ingest.sh: $*" >&2; exit 1; }
    # shellcheck source=lib.sh
    source "$REPO/scripts/lib.sh"
    KVROUTE_BENCH_BASELINE_BIN="$(baseline_inventory "${2:?--baseline needs a revision}")"
    # The binary is named after the revision it was built from.
    KVROUTE_BENCH_BASELINE_LABEL="${KVROUTE_BENCH_BASELINE_BIN##*-}"
    export KVROUTE_BENCH_BASELINE_BIN KVROUTE_BENCH_BASELINE_LABEL
fi
cargo test --release -p kvroute-inventory --test ingest_bench -- --ignored --nocapture --test-threads 1
echo "bench-ingest.sh: results in ${KVROUTE_BENCH_OUT:-docs/bench-ingest.md}"
