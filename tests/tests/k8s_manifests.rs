//! deploy/kubernetes (both overlays, rendered) and envoy/istio validate offline: core kinds with
//! kubernetes-validate --strict against Kubernetes 1.33, Istio kinds with check-jsonschema against
//! the CRD schemas vendored in deploy/kubernetes/schemas (deploy/kubernetes/validate.py). Broken
//! manifests are rejected (so the validation can fail), the renderer matches `kubectl kustomize`
//! when kubectl is installed, and the rendered overlays keep what the docs promise: the built
//! image names, secrets only by reference, non-root pods, the port policy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Command, Output};

use kvroute_tests::harness::{self, TempDir};
use serde_json::Value;

const VENV_HINT: &str =
    "run ./scripts/setup.sh (it installs kubernetes-validate and check-jsonschema into .cache/k8s-validate-venv)";
const VERSION: &str = env!("CARGO_PKG_VERSION");

fn python() -> PathBuf {
    let p = harness::cache_dir().join("k8s-validate-venv/bin/python");
    assert!(p.is_file(), "{} missing: {VENV_HINT}", p.display());
    p
}

fn validate_py(args: &[&str]) -> Output {
    let root = harness::repo_root();
    Command::new(python())
        .current_dir(&root)
        .arg(root.join("deploy/kubernetes/validate.py"))
        .args(args)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| {
            serde_json::to_value(<serde_yaml::Value as serde::Deserialize>::deserialize(d).unwrap())
                .unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The overlay rendered by validate.py's renderer.
fn render(overlay: &str) -> Vec<Value> {
    let out = validate_py(&["--render", &format!("deploy/kubernetes/overlays/{overlay}")]);
    assert!(out.status.success(), "render {overlay}: {}", text(&out));
    yaml_docs(&String::from_utf8(out.stdout).unwrap())
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn sorted(docs: &[Value]) -> Vec<String> {
    let mut v: Vec<String> = docs.iter().map(|d| d.to_string()).collect();
    v.sort();
    v
}

#[test]
fn overlays_and_istio_manifests_validate() {
    let mut args = vec![
        "deploy/kubernetes/overlays/standalone".to_string(),
        "deploy/kubernetes/overlays/replicated".to_string(),
    ];
    let istio = harness::repo_root().join("envoy/istio");
    let mut files: Vec<String> = std::fs::read_dir(&istio)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| format!("envoy/istio/{}", p.file_name().unwrap().to_str().unwrap()))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    args.extend(files);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = validate_py(&refs);
    let t = text(&out);
    assert!(out.status.success(), "validation failed:\n{t}");
    assert!(t.contains(", 0 errors"), "{t}");
    // Both validators saw objects: the overlays' core kinds and the Istio kinds.
    let counts: Vec<u64> = t
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(counts[0] >= 20 && counts.len() >= 3, "{t}");
    assert!(
        t.contains("Istio objects") && !t.contains(" 0 Istio objects"),
        "{t}"
    );
}

#[test]
fn broken_manifests_are_rejected() {
    let tmp = TempDir::new("kvroute-k8s-broken").unwrap();
    let cases = [
        // a core kind with a wrong type
        (
            "replicas-string.yaml",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec:\n  replicas: three\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec: {containers: [{name: c, image: i}]}\n",
        ),
        // a core kind with an unknown field (strict)
        (
            "service-unknown-field.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: b}\nspec:\n  ports: [{port: 80, targetPortt: 8080}]\n",
        ),
        // an Istio kind with a bad enum value
        (
            "envoyfilter-enum.yaml",
            "apiVersion: networking.istio.io/v1alpha3\nkind: EnvoyFilter\nmetadata: {name: c}\nspec:\n  configPatches: [{applyTo: HTTP_FILTERS}]\n",
        ),
        // the unquoted all-zero placeholder YAML 1.1 reads as the integer 0
        (
            "wasmplugin-sha-int.yaml",
            "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\nmetadata: {name: d}\nspec:\n  url: oci://kvroute/filter:0.1.0\n  sha256: 0000000000000000000000000000000000000000000000000000000000000000\n",
        ),
        // an Istio API version nothing is vendored for
        (
            "istio-unknown-version.yaml",
            "apiVersion: networking.istio.io/v9\nkind: EnvoyFilter\nmetadata: {name: e}\nspec: {}\n",
        ),
        // an InferencePool with a failure mode the API does not have
        (
            "inferencepool-failure-mode.yaml",
            "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: g}\nspec:\n  selector: {matchLabels: {a: b}}\n  targetPorts: [{number: 8000}]\n  endpointPickerRef: {name: e, port: {number: 9002}, failureMode: Sometimes}\n",
        ),
        // not a Kubernetes object
        ("no-kind.yaml", "metadata: {name: f}\n"),
    ];
    let mut args = Vec::new();
    for (name, body) in cases {
        let p = tmp.path().join(name);
        std::fs::write(&p, body).unwrap();
        args.push(p.to_str().unwrap().to_string());
    }
    // A kustomization with a field the renderer does not implement.
    let k = tmp.path().join("kustomization-unsupported");
    std::fs::create_dir(&k).unwrap();
    std::fs::write(
        k.join("kustomization.yaml"),
        "resources: []\nnamePrefix: x-\n",
    )
    .unwrap();
    args.push(k.to_str().unwrap().to_string());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = validate_py(&refs);
    let t = text(&out);
    assert!(!out.status.success(), "broken manifests accepted:\n{t}");
    for (name, _) in cases {
        assert!(t.contains(name), "{name} not reported:\n{t}");
    }
    assert!(t.contains("namePrefix"), "{t}");
    assert!(t.contains("'three' is not of type 'integer'"), "{t}");
    assert!(t.contains("targetPortt"), "{t}");
    assert!(t.contains("0 is not of type 'string'"), "{t}");
    assert!(t.contains("'Sometimes' is not one of"), "{t}");
}

/// deploy/gie (kvroute as an InferencePool's endpoint picker, for Istio and kgateway) validates
/// offline (the InferencePool against the vendored inference.networking.k8s.io/v1 CRD schema),
/// and its parts agree: the pool's endpointPickerRef names the picker's Service and gRPC port,
/// the picker serves the rule of the ConfigMap with the pool's failure mode, and each gateway's
/// HTTPRoute sends to the pool. (Gateway API kinds have no vendored schema: checked here only.)
#[test]
fn gie_manifests_validate_and_agree() {
    let out = validate_py(&["deploy/gie/istio", "deploy/gie/kgateway"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains(" 0 errors"), "{t}");
    let docs = render_dir("deploy/gie/base");
    let pool = find(&docs, "InferencePool", "vllm-qwen3");
    let epp_ref = &pool["spec"]["endpointPickerRef"];
    let svc = find(&docs, "Service", epp_ref["name"].as_str().unwrap());
    let port = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == epp_ref["port"]["number"])
        .expect("the Service has the pool's picker port");
    let dep = find(&docs, "Deployment", "kvroute-epp");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let cport = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == port["targetPort"])
        .expect("the container port the Service targets");
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let flag = |f: &str| args[args.iter().position(|a| *a == f).unwrap() + 1];
    assert_eq!(
        flag("--epp-listen"),
        format!("0.0.0.0:{}", cport["containerPort"])
    );
    assert_eq!(flag("--epp-failure-mode"), epp_ref["failureMode"]);
    let rules = find(&docs, "ConfigMap", "kvroute-epp-rules");
    let rules_text = rules["data"]["rules.yaml"].as_str().unwrap();
    let rules: Value = serde_yaml::from_str(rules_text).unwrap();
    let sa = &rules[0]["serviceArguments"];
    assert_eq!(
        flag("--epp-rule"),
        format!("{}:{}", sa["externalIP"].as_str().unwrap(), sa["port"])
    );
    // The picker follows the pool: its rule has no endpoints, the pool's ready pods will be.
    assert_eq!(flag("--epp-pool"), pool["metadata"]["name"]);
    assert!(rules[0].get("endpoints").is_none(), "{rules}");
    let sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    assert_eq!(
        dep["spec"]["template"]["spec"]["automountServiceAccountToken"],
        true
    );
    let binding = find(&docs, "RoleBinding", "kvroute-epp");
    assert_eq!(binding["subjects"][0]["name"], sa);
    let role = find(&docs, "Role", binding["roleRef"]["name"].as_str().unwrap());
    for (group, resource) in [
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
    ] {
        let r = role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["apiGroups"][0] == group && r["resources"][0] == resource)
            .unwrap_or_else(|| panic!("the Role grants {resource}"));
        assert_eq!(r["verbs"], serde_json::json!(["get", "list", "watch"]));
    }
    assert_eq!(pool["metadata"]["namespace"], role["metadata"]["namespace"]);
    // The shipped rule and arguments start the service (the API server is out of reach here:
    // the picker keeps trying while the service runs).
    let dir = TempDir::new("gie-args").unwrap();
    let cfg = dir.path().join("rules.yaml");
    std::fs::write(&cfg, rules_text).unwrap();
    let mut shipped: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    for (f, v) in [
        ("--listen", "127.0.0.1:0".to_owned()),
        ("--epp-listen", "127.0.0.1:0".to_owned()),
        ("--config", cfg.display().to_string()),
        ("--tokenizer-dir", dir.path().display().to_string()),
    ] {
        let i = shipped.iter().position(|a| a == f).unwrap();
        shipped[i + 1] = v;
    }
    shipped.extend(["--kube-api".into(), "http://127.0.0.1:1".into()]);
    let mut child = Command::new(kvroute_tests::envoy::inventory_bin().unwrap())
        .args(&shipped)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = kvroute_test_support::ready_line(
        &mut child,
        "kvroute-inventory listening on ",
        std::time::Duration::from_secs(20),
    );
    let _ = child.kill();
    let _ = child.wait();
    started.unwrap_or_else(|e| panic!("the shipped arguments {shipped:?}: {e}"));
    for gw in ["istio", "kgateway"] {
        let path = harness::repo_root().join(format!("deploy/gie/{gw}/gateway.yaml"));
        let g = yaml_docs(&std::fs::read_to_string(path).unwrap());
        let route = find(&g, "HTTPRoute", "vllm-qwen3");
        let backend = &route["spec"]["rules"][0]["backendRefs"][0];
        assert_eq!(
            (&backend["group"], &backend["kind"], &backend["name"]),
            (
                &Value::from("inference.networking.k8s.io"),
                &Value::from("InferencePool"),
                &pool["metadata"]["name"]
            ),
            "{gw}"
        );
        assert_eq!(
            find(&g, "Gateway", "inference-gateway")["spec"]["gatewayClassName"],
            gw
        );
    }
}

fn render_dir(dir: &str) -> Vec<Value> {
    let out = validate_py(&["--render", dir]);
    assert!(out.status.success(), "render {dir}: {}", text(&out));
    yaml_docs(&String::from_utf8(out.stdout).unwrap())
}

#[test]
fn renderer_matches_kubectl_kustomize() {
    let kubectl = Command::new("kubectl")
        .args(["kustomize", "--help"])
        .output();
    if !kubectl.is_ok_and(|o| o.status.success()) {
        eprintln!("kubectl with kustomize not installed: comparing the renderer with it skipped");
        return;
    }
    for overlay in ["standalone", "replicated"] {
        let out = Command::new("kubectl")
            .arg("kustomize")
            .arg(
                harness::repo_root()
                    .join("deploy/kubernetes/overlays")
                    .join(overlay),
            )
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubectl kustomize {overlay}: {}",
            text(&out)
        );
        let theirs = yaml_docs(&String::from_utf8(out.stdout).unwrap());
        assert_eq!(sorted(&render(overlay)), sorted(&theirs), "{overlay}");
    }
}

fn env_names(container: &Value) -> Vec<String> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn overlays_use_built_images_secret_refs_non_root_and_port_policy() {
    let build =
        std::fs::read_to_string(harness::repo_root().join("scripts/build-images.sh")).unwrap();
    for (overlay, replicas) in [("standalone", 1), ("replicated", 3)] {
        let docs = render(overlay);
        assert!(
            !docs.iter().any(|d| d["kind"] == "Secret"),
            "{overlay}: inline Secret"
        );
        let dep = find(&docs, "Deployment", "kvroute-inventory");
        assert_eq!(dep["spec"]["replicas"], replicas, "{overlay}");
        let pod = &dep["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        assert_eq!(
            c["image"],
            format!("kvroute/inventory:{VERSION}"),
            "{overlay}"
        );
        assert!(build.contains("\"kvroute/inventory:$VERSION\""));
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(pod["securityContext"]["runAsUser"], 65532);
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        // Secrets by reference only: no env var carrying a password or token inline.
        for e in c["env"].as_array().unwrap() {
            let name = e["name"].as_str().unwrap();
            if name.contains("PASSWORD") || name.contains("TOKEN") {
                assert!(
                    name.ends_with("_FILE") || e.get("value").is_none(),
                    "{overlay}: {name} set inline"
                );
            }
        }
        let volumes = pod["volumes"].as_array().unwrap();
        let auth = volumes.iter().find(|v| v["name"] == "auth").unwrap();
        assert_eq!(auth["secret"]["secretName"], "kvroute-auth");
        // Probes, Service, PDB and NetworkPolicy select the Deployment's pods, on its port.
        let labels = &dep["spec"]["template"]["metadata"]["labels"];
        let matches = |sel: &Value| {
            sel.as_object()
                .unwrap()
                .iter()
                .all(|(k, v)| labels[k] == *v)
        };
        let svc = find(&docs, "Service", "kvroute-inventory");
        assert!(matches(&svc["spec"]["selector"]));
        let pdb = find(&docs, "PodDisruptionBudget", "kvroute-inventory");
        assert!(matches(&pdb["spec"]["selector"]["matchLabels"]));
        let np = find(&docs, "NetworkPolicy", "kvroute-inventory");
        assert!(matches(&np["spec"]["podSelector"]["matchLabels"]));
        assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
        let ingress = np["spec"]["ingress"].as_array().unwrap();
        assert_eq!(ingress.len(), 1);
        assert_eq!(
            ingress[0]["ports"],
            serde_json::json!([{"protocol": "TCP", "port": 8080}])
        );
        assert_eq!(c["ports"][0]["containerPort"], 8080);
        // The gateway's filter comes from the built filter image.
        let ef = find(&docs, "EnvoyFilter", "kvroute-filter-config");
        let remote = &ef["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]
            ["vm_config"]["code"]["remote"];
        assert_eq!(
            remote["http_uri"]["uri"],
            format!("oci://kvroute/filter:{VERSION}")
        );
        assert!(build.contains("\"kvroute/filter:$VERSION\""));
        let redis_env = env_names(c).iter().any(|n| n.starts_with("KVROUTE_REDIS"));
        if overlay == "standalone" {
            assert!(!redis_env, "standalone sets Redis variables");
            assert!(!docs.iter().any(|d| d["kind"] == "StatefulSet"));
        } else {
            let names = env_names(c);
            for n in ["KVROUTE_REDIS_URL", "KVROUTE_REDIS_PASSWORD_FILE"] {
                assert!(names.iter().any(|x| x == n), "{n} missing");
            }
            let redis_vol = volumes.iter().find(|v| v["name"] == "redis-auth").unwrap();
            assert_eq!(redis_vol["secret"]["secretName"], "kvroute-redis");
            let sts = find(&docs, "StatefulSet", "kvroute-redis");
            let vc = &sts["spec"]["template"]["spec"]["containers"][0];
            assert_eq!(
                vc["env"][0]["valueFrom"]["secretKeyRef"]["name"],
                "kvroute-redis"
            );
            assert!(vc["env"][0].get("value").is_none());
            let rnp = find(&docs, "NetworkPolicy", "kvroute-redis");
            assert_eq!(
                rnp["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
                    ["app.kubernetes.io/name"],
                "kvroute-inventory"
            );
        }
    }
}
