#!/usr/bin/env bash
# Ingestion benchmark: one real ZMQ publisher per endpoint on loopback, the service subscribed to
# all of them (per-endpoint kvZmqEndpoint), block events through decode, keying and the index.
# Reports events/s, the service's CPU per event and the publish-to-index lag, with one hot
# publisher. Writes docs/bench-ingest.md. Takes a minute or two; run on an otherwise idle machine.
#
#   scripts/bench-ingest.sh
#   KVROUTE_BENCH_ENDPOINTS=16,256,1024 KVROUTE_BENCH_WINDOWS=20 KVROUTE_BENCH_BATCHES=50 KVROUTE_BENCH_MIN_EVENTS=2000000 scripts/bench-ingest.sh
#   KVROUTE_BENCH_OUT=/tmp/ingest.md scripts/bench-ingest.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# One socket per publisher and per subscriber: 2 x 1024 descriptors and more.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
cargo test --release -p kvroute-inventory --test ingest_bench -- --ignored --nocapture --test-threads 1
echo "bench-ingest.sh: results in ${KVROUTE_BENCH_OUT:-docs/bench-ingest.md}"
