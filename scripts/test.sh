#!/usr/bin/env bash
# THE test command (README, CI): installs what is missing, builds the filter .wasm and every
# workspace binary, checks formatting and lints, runs the fuzz smoke (scripts/fuzz.sh --smoke), then
# runs every test in the workspace. Exits non-zero on any failure.
#
# Works on a clean clone: scripts/setup.sh fetches Envoy, the tokenizer fixture and (when no rustup
# wasm32 target exists) the Debian wasm toolchain into ${KVROUTE_CACHE:-<repo>/.cache}.
# Extra arguments go to `cargo test` (e.g. `./scripts/test.sh -p kvroute-tests envoy`).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"

step() {
    echo "test.sh: $*"
}

step "setup"
./scripts/setup.sh
# The real-engine test (tests/tests/real_vllm.rs) runs against real vLLM engines only when asked:
# installing vLLM downloads about 3 GB once.
if [[ "${KVROUTE_REAL_VLLM:-}" == 1 ]]; then
    step "installing vLLM (KVROUTE_REAL_VLLM=1)"
    ./scripts/setup-vllm.sh
fi
step "building the filter .wasm"
./scripts/build-wasm.sh
# shellcheck source=/dev/null
source "$KVROUTE_CACHE/env.sh"

# Tests start the workspace's binaries (inventory service, engine simulator) as real processes,
# and `cargo test` only builds a package's own binaries: build them all first.
step "building workspace binaries"
cargo build --workspace --bins

# The service's OCI image and the filter's Wasm OCI artifacts (tests/tests/images.rs unpacks and
# runs them): builds the release binary and packs both into $KVROUTE_CACHE/images.
step "building the OCI images"
./scripts/build-images.sh

# The workspace lints (no unwrap/expect/panic outside tests) only bite under clippy.
step "formatting and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings

# Coverage-guided fuzz smoke: every decoder of outside input (fuzz/), fixed seed and exec count,
# fails on any crash naming the crashing input. KVROUTE_SKIP_FUZZ=1 skips it on a developer
# machine; CI (CI set) always runs it.
if [[ "${KVROUTE_SKIP_FUZZ:-}" == 1 && -z "${CI:-}" ]]; then
    step "fuzz smoke skipped (KVROUTE_SKIP_FUZZ=1)"
else
    step "fuzz smoke"
    ./scripts/fuzz.sh --smoke
fi

# Every process a test starts, the test stops. The processes tests start (by command name) that
# run after the tests and did not before are leaks: named, killed, and the run fails.
test_processes() {
    ps -eo pid=,comm= | awk '$2 ~ /^(redis-server|envoy|prometheus|kvroute-.*)$/ {print $1}' | sort
}
before="$(test_processes)"

step "running tests"
status=0
if (($# > 0)); then
    cargo test "$@" || status=$?
else
    cargo test --workspace --no-fail-fast || status=$?
fi

# A process a test's cleanup signalled may take a moment to exit: up to 10 s.
for _ in $(seq 50); do
    leaked="$(comm -13 <(echo "$before") <(test_processes))"
    [[ -z "$leaked" ]] && break
    sleep 0.2
done
if [[ -n "$leaked" ]]; then
    step "processes the tests started and left running (killed now):"
    # shellcheck disable=SC2086
    ps -o pid=,lstart=,args= -p $leaked || true
    # shellcheck disable=SC2086
    kill -9 $leaked 2>/dev/null || true
    status=1
fi
exit "$status"
