#!/usr/bin/env bash
# Builds the Envoy filter (crate kvroute-filter) for wasm32-unknown-unknown and copies it to
# $KVROUTE_CACHE/wasm/kvroute_filter.wasm (the path setup.sh's env.sh exports as KVROUTE_WASM).
#
# Toolchain: a rustup-installed wasm32 target when there is one; otherwise Debian's rustc-web
# (/usr/bin/rustc) building std from source (-Zbuild-std, RUSTC_BOOTSTRAP) and linking with
# wasm-ld-19, as installed by scripts/setup.sh. Uses its own target dir (<repo>/target-wasm) so it
# never invalidates or locks the native build in <repo>/target.
#
# getrandom needs `--cfg getrandom_backend="custom"` on wasm32-unknown-unknown; the filter provides
# the function (filter/src/host.rs). It goes in RUSTFLAGS here because the repo has no .cargo/ dir.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
TARGET=wasm32-unknown-unknown
PROFILE=release-wasm
TARGET_DIR="${KVROUTE_WASM_TARGET_DIR:-$REPO/target-wasm}"
# KVROUTE_WASM_FEATURES / KVROUTE_WASM_OUT: a test build (e.g. the `test-crash-hook` feature) to
# another file; the default is the shipped module.
OUT="${KVROUTE_WASM_OUT:-$KVROUTE_CACHE/wasm/kvroute_filter.wasm}"

fail() {
    echo "build-wasm.sh: $*" >&2
    exit 1
}

cd "$REPO"
export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }--cfg getrandom_backend=\"custom\""

args=(build -p kvroute-filter --lib --profile "$PROFILE" --target "$TARGET" --target-dir "$TARGET_DIR")
[[ -n "${KVROUTE_WASM_FEATURES:-}" ]] && args+=(--features "$KVROUTE_WASM_FEATURES")
if command -v rustup >/dev/null 2>&1 &&
    [[ "$(rustup target list --installed 2>/dev/null)" == *"$TARGET"* ]]; then
    toolchain="rustup"
    cmd=(cargo "${args[@]}")
else
    toolchain="debian"
    [[ -x /usr/bin/rustc ]] || fail "no rustup $TARGET target and no /usr/bin/rustc: run scripts/setup.sh"
    command -v wasm-ld-19 >/dev/null 2>&1 || fail "no wasm-ld-19 (package lld-19): run scripts/setup.sh"
    export RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1
    cmd=(cargo "${args[@]}" -Zbuild-std=std,panic_abort
        --config "target.$TARGET.linker=\"wasm-ld-19\"")
fi

echo "build-wasm.sh: building kvroute-filter for $TARGET ($toolchain toolchain, profile $PROFILE)"
start=$SECONDS
"${cmd[@]}" || fail "cargo build for $TARGET failed (command: ${cmd[*]})"
built="$TARGET_DIR/$TARGET/$PROFILE/kvroute_filter.wasm"
[[ -f "$built" ]] || fail "cargo succeeded but $built is missing"

# wasm-bindgen imports (e.g. from a dependency's `js`/`wasm_js` feature) cannot be satisfied by
# Envoy: the module would fail to load at runtime, so refuse it here.
if grep -q '__wbindgen' "$built"; then
    fail "$built imports wasm-bindgen symbols (__wbindgen*); Envoy cannot load it: check dependency features"
fi

mkdir -p "$(dirname "$OUT")"
cp "$built" "$OUT.tmp"
mv -f "$OUT.tmp" "$OUT"
size=$(wc -c <"$OUT")
echo "build-wasm.sh: $OUT: $size bytes ($((size / 1024)) KiB), built in $((SECONDS - start)) s"
