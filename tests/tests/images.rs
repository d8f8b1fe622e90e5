//! The OCI images scripts/build-images.sh writes under .cache/images/, read back with real tools:
//! the inventory image's config (non-root numeric user, entrypoint, port, labels) as skopeo and
//! umoci see it, its unpacked rootfs (no shell, CA roots) running the service, which answers
//! /healthz; and both filter artifacts (Wasm image spec compat and oci variants) holding exactly
//! the built module.
//!
//! The images are built by `scripts/build-images.sh` (test.sh runs it before the tests); when they
//! are missing or older than the binaries they pack, these tests fail saying to run it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvroute_tests::harness::{self, ChildGuard, TempDir};
use serde_json::Value;

const BUILD_HINT: &str =
    "run ./scripts/build-images.sh (it builds the release binary, the .wasm and the images)";
const VERSION: &str = env!("CARGO_PKG_VERSION");
const NONROOT: u64 = 65532;
const BIN_PATH: &str = "/usr/local/bin/kvroute-inventory";
const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
const WASM_CONFIG: &str = "application/vnd.module.wasm.config.v1+json";
const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

fn layout(name: &str) -> PathBuf {
    let dir = harness::cache_dir().join("images").join(name);
    assert!(
        dir.join("index.json").is_file(),
        "no OCI layout at {}: {BUILD_HINT}",
        dir.display()
    );
    dir
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The blob a descriptor points at, after checking its size and sha256 against the descriptor.
fn blob(layout: &Path, desc: &Value) -> Vec<u8> {
    let digest = desc["digest"].as_str().unwrap();
    let hex = digest.strip_prefix("sha256:").unwrap();
    let path = layout.join("blobs/sha256").join(hex);
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        data.len() as u64,
        desc["size"].as_u64().unwrap(),
        "{digest} size"
    );
    let sum = run(Command::new("sha256sum").arg(&path));
    assert!(sum.starts_with(hex), "{digest}: content hashes to {sum}");
    data
}

/// The manifest tagged VERSION in the layout's index.
fn manifest(layout: &Path) -> Value {
    let index = read_json(&layout.join("index.json"));
    let desc = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == VERSION)
        .unwrap_or_else(|| {
            panic!(
                "{}: no manifest tagged {VERSION}: {BUILD_HINT}",
                layout.display()
            )
        });
    assert_eq!(desc["mediaType"], OCI_MANIFEST);
    let m: Value = serde_json::from_slice(&blob(layout, desc)).unwrap();
    assert_eq!(m["schemaVersion"], 2);
    m
}

/// Runs `cmd`, panicking with its output when it fails; returns stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} ({BUILD_HINT})"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn built_module() -> Vec<u8> {
    let path = harness::wasm_module().unwrap_or_else(|e| panic!("{e:#}: {BUILD_HINT}"));
    std::fs::read(path).unwrap()
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

#[test]
fn inventory_image_config_is_non_root_with_entrypoint_port_and_labels() {
    let dir = layout("inventory");
    let m = manifest(&dir);
    assert_eq!(
        m["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    let config: Value = serde_json::from_slice(&blob(&dir, &m["config"])).unwrap();
    assert_eq!(config["os"], "linux");
    assert_eq!(config["architecture"], "amd64");
    let c = &config["config"];
    let user = c["User"].as_str().unwrap();
    let uid: u64 = user.split(':').next().unwrap().parse().unwrap_or_else(|_| {
        panic!("User {user:?} is not numeric (Kubernetes runAsNonRoot needs a numeric uid)")
    });
    assert_eq!(uid, NONROOT, "User {user}");
    assert_eq!(c["Entrypoint"], serde_json::json!([BIN_PATH]));
    assert_eq!(c["Cmd"], serde_json::json!(["serve"]));
    assert!(c["ExposedPorts"]["8080/tcp"].is_object(), "{c}");
    let env: Vec<&str> = c["Env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert!(env.contains(&"KVROUTE_LISTEN=0.0.0.0:8080"), "{env:?}");
    assert!(
        env.contains(&"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"),
        "{env:?}"
    );
    let labels = &c["Labels"];
    assert_eq!(
        labels["org.opencontainers.image.title"],
        "kvroute-inventory"
    );
    assert_eq!(labels["org.opencontainers.image.version"], VERSION);
    for key in ["revision", "created", "licenses", "description"] {
        let k = format!("org.opencontainers.image.{key}");
        assert!(
            labels[&k].as_str().is_some_and(|v| !v.is_empty()),
            "label {k} missing"
        );
    }
    // skopeo (containers/image) reads the layout and sees the same configuration.
    let inspect: Value = serde_json::from_str(&run(Command::new("skopeo")
        .arg("inspect")
        .arg(format!("oci:{}:{VERSION}", dir.display()))))
    .unwrap();
    assert_eq!(inspect["Labels"], *labels);
    assert_eq!(inspect["Layers"].as_array().unwrap().len(), 1);
    // The oci-archive next to the layout holds the same manifest.
    let archive = dir.with_extension("tar");
    let raw = run(Command::new("skopeo")
        .arg("inspect")
        .arg("--raw")
        .arg(format!("oci-archive:{}", archive.display())));
    assert_eq!(serde_json::from_str::<Value>(&raw).unwrap(), m);
}

#[tokio::test]
async fn inventory_rootfs_has_no_shell_and_serves_healthz() {
    let dir = layout("inventory");
    let tmp = TempDir::new("kvroute-image").unwrap();
    let bundle = tmp.path().join("bundle");
    let mut unpack = Command::new("umoci");
    unpack.arg("unpack");
    if !is_root() {
        unpack.arg("--rootless");
    }
    run(unpack
        .arg("--image")
        .arg(format!("{}:{VERSION}", dir.display()))
        .arg(&bundle));
    let rootfs = bundle.join("rootfs");
    // umoci's runtime config: what a container runtime would execute, and as whom.
    let spec = read_json(&bundle.join("config.json"));
    assert_eq!(spec["process"]["user"]["uid"], NONROOT);
    assert_eq!(
        spec["process"]["args"],
        serde_json::json!([BIN_PATH, "serve"])
    );
    for shell in ["bin/sh", "bin/bash", "usr/bin/sh", "bin/busybox"] {
        assert!(!rootfs.join(shell).exists(), "{shell} present in the image");
    }
    let ca = std::fs::metadata(rootfs.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
    assert!(ca.len() > 10_000, "CA bundle is {} bytes", ca.len());
    // The packed binary is the current release build (else the image is stale).
    let packed = std::fs::read(rootfs.join(&BIN_PATH[1..])).unwrap();
    let release = harness::repo_root().join("target/release/kvroute-inventory");
    if let Ok(current) = std::fs::read(&release) {
        assert!(
            packed == current,
            "image holds an older kvroute-inventory than {}: {BUILD_HINT}",
            release.display()
        );
    }

    // Run it from the rootfs alone: chroot as the image's user when root, else through the
    // rootfs's own loader and libraries.
    let port = harness::free_port().unwrap();
    let listen = format!("127.0.0.1:{port}");
    let mut cmd;
    if is_root() {
        cmd = Command::new("chroot");
        cmd.arg(format!("--userspec={NONROOT}:{NONROOT}"))
            .arg(&rootfs)
            .arg(BIN_PATH);
    } else {
        cmd = Command::new(rootfs.join("lib64/ld-linux-x86-64.so.2"));
        cmd.arg("--library-path")
            .arg(rootfs.join("lib/x86_64-linux-gnu"))
            .arg(rootfs.join(&BIN_PATH[1..]));
    }
    // No host environment leaks in (PATH only to find chroot itself).
    cmd.args(["serve", "--listen", &listen])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin");
    let mut child = ChildGuard::spawn(
        "inventory (image rootfs)",
        cmd,
        &tmp.path().join("inventory.log"),
    )
    .unwrap();
    harness::wait_for_http(
        &format!("http://{listen}/healthz"),
        Duration::from_secs(30),
        Some(&mut child),
    )
    .await
    .unwrap();
    assert!(child.log().contains("listening"), "{}", child.log());
}

#[test]
fn filter_compat_image_holds_plugin_wasm_in_one_gzip_layer() {
    let dir = layout("filter");
    let m = manifest(&dir);
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "{m}");
    // Istio and Envoy Gateway read the last layer; it must be tar+gzip with plugin.wasm in it.
    assert_eq!(layers[0]["mediaType"], OCI_LAYER_GZIP);
    blob(&dir, &layers[0]);
    let path = dir.join("blobs/sha256").join(
        layers[0]["digest"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:"),
    );
    let listing = run(Command::new("tar").arg("-tzf").arg(&path));
    let files: Vec<&str> = listing
        .lines()
        .filter(|l| !l.ends_with('/') && *l != ".")
        .collect();
    assert_eq!(
        files
            .iter()
            .map(|f| f.trim_start_matches("./"))
            .collect::<Vec<_>>(),
        ["plugin.wasm"]
    );
    let out = Command::new("tar")
        .arg("-xzOf")
        .arg(&path)
        .arg(files[0])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        out.stdout == built_module(),
        "plugin.wasm differs from the built module: {BUILD_HINT}"
    );
    let config: Value = serde_json::from_slice(&blob(&dir, &m["config"])).unwrap();
    assert_eq!(
        config["config"]["Labels"]["org.opencontainers.image.title"],
        "kvroute-filter"
    );
}

#[test]
fn filter_oci_artifact_has_wasm_media_types_and_the_module() {
    let dir = layout("filter-oci");
    let m = manifest(&dir);
    assert_eq!(m["config"]["mediaType"], WASM_CONFIG);
    let config: Value = serde_json::from_slice(&blob(&dir, &m["config"])).unwrap();
    assert_eq!(config["type"], "envoy_proxy");
    // Istio's and Envoy Gateway's fetchers: exactly two layers, one of the module type (raw).
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "{m}");
    let wasm: Vec<&Value> = layers
        .iter()
        .filter(|l| l["mediaType"] == WASM_LAYER)
        .collect();
    assert_eq!(wasm.len(), 1, "{m}");
    assert!(
        blob(&dir, wasm[0]) == built_module(),
        "module layer differs from the built module: {BUILD_HINT}"
    );
    assert!(layers.iter().any(|l| l["mediaType"] == WASM_CONFIG));
    // skopeo reads the artifact's manifest from the layout and from the archive.
    for reference in [
        format!("oci:{}:{VERSION}", dir.display()),
        format!("oci-archive:{}", dir.with_extension("tar").display()),
    ] {
        let raw = run(Command::new("skopeo")
            .args(["inspect", "--raw"])
            .arg(&reference));
        assert_eq!(
            serde_json::from_str::<Value>(&raw).unwrap(),
            m,
            "{reference}"
        );
    }
}
