#!/usr/bin/env bash
# Builds kvroute's container images as OCI image layouts (and an oci-archive of each) under
# ${KVROUTE_CACHE:-<repo>/.cache}/images/, with no registry and no container daemon:
#
#   inventory/      kvroute/inventory:VERSION   the kvroute-inventory release binary on a rootfs made
#                                               here (glibc loader and libs from `ldd`, CA roots,
#                                               passwd/group): no shell, numeric USER 65532,
#                                               entrypoint kvroute-inventory, cmd `serve`, port 8080
#   filter/         kvroute/filter:VERSION      the filter .wasm, Wasm image spec "compat" variant:
#                                               one tar+gzip layer holding /plugin.wasm
#   filter-oci/     kvroute/filter:VERSION      the same module, Wasm image spec "oci" variant:
#                                               config + layers with the application/vnd.module.wasm.*
#                                               media types (written here; umoci cannot set them)
#   *.tar           oci-archive of each layout (skopeo copy), for `skopeo copy oci-archive:...`
#   images.env      the versions and digests (manifest digests; the module's sha256)
#
# Tools: umoci (builds the layouts), skopeo (archives them and checks each one is readable) from
# Debian, installed here when missing; python3 for the oci variant's JSON. It also builds what it
# packs: the release binary (cargo build --release) and the .wasm (scripts/build-wasm.sh).
#
# Usage: scripts/build-images.sh            (one command; about a minute once both are built)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
OUT="$KVROUTE_CACHE/images"
APT_PACKAGES=(umoci skopeo ca-certificates)
NONROOT_UID=65532
LISTEN_PORT=8080
BIN_PATH=/usr/local/bin/kvroute-inventory
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
WASM_LAYER_TYPE=application/vnd.module.wasm.content.layer.v1+wasm
WASM_CONFIG_TYPE=application/vnd.module.wasm.config.v1+json

die() {
    echo "build-images.sh: $*" >&2
    exit 1
}

note() {
    echo "build-images.sh: $*"
}

cd "$REPO"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)"
[[ -n "$VERSION" ]] || die "no workspace version in Cargo.toml"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# Timestamps come from the commit, so rebuilding the same commit gives the same config JSON.
CREATED="$(TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ 2>/dev/null ||
    date -u +%Y-%m-%dT%H:%M:%SZ)"

SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-images.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
# shellcheck source=scripts/lib.sh
source "$REPO/scripts/lib.sh"

# --- 1. tools ---------------------------------------------------------------------------------
mapfile -t missing < <(apt_missing "${APT_PACKAGES[@]}")
if ((${#missing[@]} > 0)); then
    note "installing from apt: ${missing[*]}"
    apt_install "tools" --no-install-recommends "${missing[@]}"
fi
command -v umoci >/dev/null 2>&1 || die "tools: umoci missing after installing it"
command -v skopeo >/dev/null 2>&1 || die "tools: skopeo missing after installing it"
[[ -f "$CA_BUNDLE" ]] || die "tools: $CA_BUNDLE missing (package ca-certificates)"
# umoci unpacks as the calling user; without root it must map ownership (--rootless).
ROOTLESS=()
[[ "$(id -u)" == 0 ]] || ROOTLESS=(--rootless)

# --- 2. what goes in --------------------------------------------------------------------------
note "building the release binary (cargo build --release -p kvroute-inventory)"
cargo build --release -q -p kvroute-inventory --bin kvroute-inventory ||
    die "cargo build --release -p kvroute-inventory failed"
BIN="$REPO/target/release/kvroute-inventory"
[[ -x "$BIN" ]] || die "cargo succeeded but $BIN is missing"
KVROUTE_CACHE="$KVROUTE_CACHE" ./scripts/build-wasm.sh || die "scripts/build-wasm.sh failed"
WASM="$KVROUTE_CACHE/wasm/kvroute_filter.wasm"
[[ -f "$WASM" ]] || die "scripts/build-wasm.sh succeeded but $WASM is missing"
mkdir -p "$OUT"

LABELS=(
    --config.label "org.opencontainers.image.version=$VERSION"
    --config.label "org.opencontainers.image.revision=$REVISION"
    --config.label "org.opencontainers.image.created=$CREATED"
    --config.label "org.opencontainers.image.licenses=Apache-2.0"
    --config.label "org.opencontainers.image.vendor=kvroute"
)

# new_bundle LAYOUT: an empty image tagged $VERSION in a fresh layout, unpacked to $SCRATCH/bundle.
new_bundle() {
    local layout="$1"
    rm -rf "$layout" "$SCRATCH/bundle"
    umoci init --layout "$layout"
    umoci new --image "$layout:$VERSION"
    umoci unpack "${ROOTLESS[@]}" --image "$layout:$VERSION" "$SCRATCH/bundle" >/dev/null
}

# publish NAME: checks the layout with skopeo, archives it, moves both into $OUT atomically.
publish() {
    local name="$1" ref="$2"
    skopeo inspect --raw "oci:$SCRATCH/$name:$VERSION" >/dev/null ||
        die "$name: skopeo cannot read the layout it was just written to"
    rm -f "$SCRATCH/$name.tar"
    skopeo copy -q "oci:$SCRATCH/$name:$VERSION" "oci-archive:$SCRATCH/$name.tar:$ref" ||
        die "$name: skopeo copy to an oci-archive failed"
    rm -rf "$OUT/$name.old"
    [[ ! -e "$OUT/$name" ]] || mv "$OUT/$name" "$OUT/$name.old"
    mv "$SCRATCH/$name" "$OUT/$name"
    mv -f "$SCRATCH/$name.tar" "$OUT/$name.tar"
    rm -rf "$OUT/$name.old"
}

manifest_digest() {
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$OUT/$1/index.json"
}

# --- 3. kvroute/inventory ---------------------------------------------------------------------
note "kvroute/inventory:$VERSION"
new_bundle "$SCRATCH/inventory"
ROOTFS="$SCRATCH/bundle/rootfs"
install -D -m 0755 "$BIN" "$ROOTFS$BIN_PATH"
# The dynamic loader and every library the binary links (glibc, libgcc_s), at the paths ldd
# reports, copied through their symlinks. glibc >= 2.34 carries the files/dns NSS modules in
# libc.so.6, so name resolution needs only /etc/nsswitch.conf below.
libs="$(ldd "$BIN" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')"
[[ -n "$libs" ]] || die "inventory: ldd $BIN lists no libraries (a static binary needs none: adjust this script)"
for lib in $libs; do
    install -D -m 0755 "$(readlink -f "$lib")" "$ROOTFS$lib"
done
install -D -m 0644 "$CA_BUNDLE" "$ROOTFS$CA_BUNDLE"
mkdir -p "$ROOTFS/etc" "$ROOTFS/tmp" "$ROOTFS/var/lib/kvroute" "$ROOTFS/etc/kvroute"
chmod 1777 "$ROOTFS/tmp"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%s:%s:nonroot:/home/nonroot:/sbin/nologin\n' \
    "$NONROOT_UID" "$NONROOT_UID" >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nnonroot:x:%s:\n' "$NONROOT_UID" >"$ROOTFS/etc/group"
printf 'hosts: files dns\n' >"$ROOTFS/etc/nsswitch.conf"
umoci repack --image "$SCRATCH/inventory:$VERSION" --history.created "$CREATED" \
    --history.created_by "scripts/build-images.sh" "$SCRATCH/bundle" >/dev/null
umoci config --image "$SCRATCH/inventory:$VERSION" \
    --created "$CREATED" --history.created "$CREATED" --os linux --architecture amd64 \
    --config.user "$NONROOT_UID:$NONROOT_UID" \
    --config.entrypoint "$BIN_PATH" --config.cmd serve \
    --config.env "KVROUTE_LISTEN=0.0.0.0:$LISTEN_PORT" \
    --config.env "SSL_CERT_FILE=$CA_BUNDLE" \
    --config.env "PATH=/usr/local/bin" \
    --config.exposedports "$LISTEN_PORT/tcp" \
    --config.workingdir / \
    "${LABELS[@]}" \
    --config.label "org.opencontainers.image.title=kvroute-inventory" \
    --config.label "org.opencontainers.image.description=kvroute inventory service: KV-cache events, index, scoring and the filter's routing callout"
umoci gc --layout "$SCRATCH/inventory"
publish inventory "kvroute/inventory:$VERSION"

# --- 4. kvroute/filter, compat variant --------------------------------------------------------
note "kvroute/filter:$VERSION (compat variant)"
new_bundle "$SCRATCH/filter"
install -m 0644 "$WASM" "$SCRATCH/bundle/rootfs/plugin.wasm"
umoci repack --image "$SCRATCH/filter:$VERSION" --history.created "$CREATED" \
    --history.created_by "scripts/build-images.sh" "$SCRATCH/bundle" >/dev/null
umoci config --image "$SCRATCH/filter:$VERSION" \
    --created "$CREATED" --history.created "$CREATED" --os linux --architecture amd64 \
    "${LABELS[@]}" \
    --config.label "org.opencontainers.image.title=kvroute-filter" \
    --config.label "org.opencontainers.image.description=kvroute proxy-wasm HTTP filter (Wasm image spec, compat variant: /plugin.wasm)"
umoci gc --layout "$SCRATCH/filter"
publish filter "kvroute/filter:$VERSION"

# --- 5. kvroute/filter, oci variant -----------------------------------------------------------
# solo-io/wasm spec.md: a runtime config (application/vnd.module.wasm.config.v1+json) and the raw
# module (application/vnd.module.wasm.content.layer.v1+wasm). Istio's and Envoy Gateway's image
# fetchers take this variant when the manifest lists exactly two layers, one of them the module
# layer; the config blob is both the manifest's config and the first layer.
note "kvroute/filter:$VERSION (oci variant)"
python3 - "$SCRATCH/filter-oci" "$WASM" "$VERSION" "$REVISION" "$CREATED" \
    "$WASM_CONFIG_TYPE" "$WASM_LAYER_TYPE" <<'EOF'
import hashlib, json, os, sys

layout, wasm_path, version, revision, created, config_type, layer_type = sys.argv[1:]
os.makedirs(os.path.join(layout, "blobs", "sha256"))

def blob(data):
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(layout, "blobs", "sha256", digest), "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}

def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()

with open(wasm_path, "rb") as f:
    module = f.read()
config = blob(canonical({"type": "envoy_proxy", "abiVersions": ["proxy_abi_version_0_2_1"], "config": {}}))
manifest = {
    "schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": config_type, **config},
    "layers": [
        {"mediaType": config_type, **config,
         "annotations": {"org.opencontainers.image.title": "runtime-config.json"}},
        {"mediaType": layer_type, **blob(module),
         "annotations": {"org.opencontainers.image.title": "plugin.wasm"}},
    ],
    "annotations": {
        "org.opencontainers.image.title": "kvroute-filter",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.licenses": "Apache-2.0",
    },
}
desc = blob(canonical(manifest))
index = {
    "schemaVersion": 2,
    "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", **desc,
                   "annotations": {"org.opencontainers.image.ref.name": version}}],
}
with open(os.path.join(layout, "index.json"), "wb") as f:
    f.write(canonical(index))
with open(os.path.join(layout, "oci-layout"), "wb") as f:
    f.write(canonical({"imageLayoutVersion": "1.0.0"}))
EOF
publish filter-oci "kvroute/filter:$VERSION"

# --- 6. summary -------------------------------------------------------------------------------
cat >"$OUT/images.env.tmp" <<EOF
# Written by scripts/build-images.sh.
KVROUTE_IMAGE_VERSION=$VERSION
KVROUTE_INVENTORY_DIGEST=$(manifest_digest inventory)
KVROUTE_FILTER_DIGEST=$(manifest_digest filter)
KVROUTE_FILTER_OCI_DIGEST=$(manifest_digest filter-oci)
KVROUTE_FILTER_MODULE_SHA256=$(sha256sum "$WASM" | cut -d' ' -f1)
EOF
mv -f "$OUT/images.env.tmp" "$OUT/images.env"
sed -n 's/^KVROUTE_/  /p' "$OUT/images.env"
note "ok: $OUT/{inventory,filter,filter-oci} (OCI layouts) and .tar archives"
