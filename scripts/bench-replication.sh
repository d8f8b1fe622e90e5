#!/usr/bin/env bash
# Replication benchmark: route queries/s on one replica standalone vs replicated through Redis,
# block events/s through the replication log, replication lag p50/p99, bootstrap time of a late
# replica for 1M keys; then the replicated load through a Redis Cluster (3 primaries + 3 replicas).
# Starts its own redis-server and cluster nodes on free ports. Writes docs/bench-replication.md.
# Usage: ./scripts/bench-replication.sh   (a few minutes; run on an idle machine)
# Knobs: KVROUTE_BENCH_SECS (5), KVROUTE_BENCH_CONC (8), KVROUTE_BENCH_BOOT_KEYS (1000000),
#        KVROUTE_BENCH_BATCHES (2000 batches of 64 block events).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
command -v redis-server >/dev/null || { echo "redis-server is required (apt-get install redis-server)" >&2; exit 1; }
table="$(mktemp)"
trap 'rm -f "$table"' EXIT
KVROUTE_BENCH_OUT="$table" cargo test --release -p kvroute-inventory --test replication_bench \
    -- --ignored --nocapture --test-threads 1
{
    echo "# Replication benchmark"
    echo
    echo "Command: \`./scripts/bench-replication.sh\` (release build; three replicas and one redis-server,"
    echo "then three replicas and a six-node Redis Cluster, on this machine, $(nproc) cores shared with the"
    echo "load generator). Measured $(date -u +%Y-%m-%d)."
    echo "See [replication.md](replication.md) for what is measured and why."
    echo
    cat "$table"
} >docs/bench-replication.md
cat docs/bench-replication.md
