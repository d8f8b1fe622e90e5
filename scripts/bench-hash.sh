#!/usr/bin/env bash
# Block-hash throughput per engine contract, native (criterion) and inside V8 (the built .wasm),
# beside `openssl speed -evp sha256` on the same message size. Writes docs/bench-hash.md.
# Usage: ./scripts/bench-hash.sh   (takes a few minutes; run on an idle machine)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
./scripts/setup.sh
./scripts/build-wasm.sh
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"

cargo bench -p kvroute-core --bench hash -- --warm-up-time 1 --measurement-time 4 >"$KVROUTE_CACHE/bench-hash.log"
node scripts/wasm-bench.mjs "$KVROUTE_WASM" >"$KVROUTE_CACHE/bench-hash-wasm.json"
# A sha256_cbor block input for Qwen-sized ids is ~85 bytes: parent (34) + array head + 16 ints + null.
openssl speed -seconds 3 -evp sha256 -bytes 85 2>/dev/null | tail -1 >"$KVROUTE_CACHE/bench-hash-openssl.txt"
python3 scripts/report.py hash "$REPO/target/criterion" "$KVROUTE_CACHE/bench-hash-wasm.json" \
    "$KVROUTE_CACHE/bench-hash-openssl.txt" >docs/bench-hash.md
cat docs/bench-hash.md
