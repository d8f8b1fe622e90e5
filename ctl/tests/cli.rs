//! `kvroutectl` end to end: the built binary against the real `kvroute-inventory` on 127.0.0.1:0.
//! Needs `cargo build -p kvroute-inventory` first (the service binary is looked up next to
//! `kvroutectl`, or at `KVROUTE_INVENTORY_BIN`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvroute_test_support::{free_port, http, ready_line, TempDir};
use serde_json::{json, Value};

const TOKEN: &str = "ctl-test-token";
const CTL: &str = env!("CARGO_BIN_EXE_kvroutectl");

/// The prompt of the explain and hash tests: several 16-token blocks.
const PROMPT: &str = "You are a helpful assistant. Please summarise the history of the Roman \
empire in great detail, covering the republic, the principate, the dominate and the fall of the \
west, with dates, names and the main causes historians give for each change.";

fn inventory_bin() -> PathBuf {
    let p = std::env::var_os("KVROUTE_INVENTORY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(CTL).with_file_name("kvroute-inventory"));
    assert!(
        p.is_file(),
        "{} not found: run `cargo build -p kvroute-inventory` (or set KVROUTE_INVENTORY_BIN)",
        p.display()
    );
    p
}

/// The Qwen3 tokenizer fixture (`source .cache/env.sh`), if present; says the test is skipped
/// otherwise.
fn tokenizer_dir() -> Option<String> {
    let d = std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3")
        });
    if !d.join("tokenizer.json").is_file() {
        eprintln!("skipped: no Qwen3 tokenizer fixture (source .cache/env.sh)");
        return None;
    }
    Some(d.display().to_string())
}

/// A running `kvroute-inventory serve`, stopped on drop.
struct Service {
    child: Child,
    base: String,
    dir: TempDir,
}

impl Service {
    fn start(tag: &str) -> Service {
        let dir = TempDir::new(&format!("ctl-{tag}")).unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        let stderr = dir.path().join("stderr.log");
        let mut child = Command::new(inventory_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--auth-token-file"])
            .arg(&token)
            .env_remove("KVROUTE_TOKENIZER_DIR")
            .env_remove("KVROUTE_CONFIG")
            .env("KVROUTE_HEALTH_INTERVAL_MS", "0")
            .env("LLB_KV_NONE_HASH_SEED", "0")
            // Speculative credit outlives the slowest step of the explain test (a debug build).
            .env("KVROUTE_SPEC_TTL_MS", "120000")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
            .spawn()
            .expect("spawn kvroute-inventory");
        let listening = "kvroute-inventory listening on ";
        let addr = ready_line(&mut child, listening, Duration::from_secs(20)).unwrap_or_else(|e| {
            let log = std::fs::read_to_string(&stderr).unwrap_or_default();
            panic!("service did not start: {e}\n{log}")
        });
        Service {
            child,
            base: format!("http://{addr}"),
            dir,
        }
    }

    fn token_file(&self) -> String {
        self.dir.path().join("token").display().to_string()
    }

    /// Runs `kvroutectl` against this service: (exit code, stdout, stderr).
    fn ctl(&self, args: &[&str]) -> (i32, String, String) {
        run_ctl(&self.base, args)
    }

    /// `kvroutectl explain` of [`PROMPT`] for `rule`, then `extra` arguments.
    fn explain(&self, rule: &str, tok: &str, extra: &[&str]) -> (i32, String, String) {
        let args = [
            "explain",
            "--rule",
            rule,
            "--prompt",
            PROMPT,
            "--tokenizer",
            tok,
        ];
        self.ctl(&[&args[..], extra].concat())
    }

    /// `GET path`, or `POST path` with `body` as JSON: (status, body).
    fn http(&self, path: &str, body: Option<Value>) -> (u16, String) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let url = format!("{}{path}", self.base);
        let req = match body {
            Some(b) => reqwest::Client::new().post(url).json(&b),
            None => reqwest::Client::new().get(url),
        };
        rt.block_on(http::answer(req)).unwrap()
    }

    /// The decision counters and placement gauges (everything a decision commits shows here).
    fn decision_metrics(&self) -> Vec<String> {
        let (s, m) = self.http("/metrics", None);
        assert_eq!(s, 200);
        m.lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("kvroute_http_"))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run_ctl(server: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(CTL)
        .args(args)
        .env("KVROUTE_SERVER", server)
        .env_remove("KVROUTE_TOKEN")
        .output()
        .expect("run kvroutectl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The rule as loxicmd's docs write it, with kvroute's KV flags.
fn create_args(token_file: &str) -> Vec<String> {
    [
        "create",
        "lb",
        "20.20.20.1",
        "--tcp=2020:8000",
        "--endpoints=127.0.0.1:1,127.0.0.2:1",
        "--mode=fullproxy",
        "--select=rr",
        "--name=chat",
        "--kv-exact-mode=3",
        "--kv-engine-type=vllm",
        "--kv-block-size=16",
        "--kv-zmq-port=5557",
        "--kv-hash-algo=sha256_cbor",
        "--token-file",
        token_file,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn create(svc: &Service) {
    let args = create_args(&svc.token_file());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = svc.ctl(&args);
    assert_eq!(code, 0, "create lb: {out} {err}");
    assert!(out.contains("20.20.20.1:2020/tcp"), "{out}");
}

/// `create lb` of a second rule (port 2021, one endpoint) with `extra` flags, without a token.
fn create_2021(svc: &Service, extra: &[&str]) -> (i32, String, String) {
    let args = [
        "create",
        "lb",
        "20.20.20.1",
        "--tcp=2021:8000",
        "--endpoints=127.0.0.1:1",
    ];
    svc.ctl(&[&args[..], extra].concat())
}

/// One line on stderr.
fn one_line(err: &str) -> &str {
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "not one line: {err:?}");
    lines[0]
}

#[test]
fn create_get_health_delete_as_loxicmd_does() {
    let svc = Service::start("crud");
    create(&svc);

    let (code, table, _) = svc.ctl(&["get", "lb"]);
    assert_eq!(code, 0);
    let row = table
        .lines()
        .find(|l| l.contains("20.20.20.1"))
        .unwrap_or_else(|| panic!("no rule row: {table}"));
    for cell in [
        "2020",
        "tcp",
        "fullproxy",
        "rr",
        "127.0.0.1:8000(1)",
        "127.0.0.2:8000(1)",
        "vllm",
        "16",
    ] {
        assert!(row.contains(cell), "{cell} missing from {row}");
    }
    let (code, j, _) = svc.ctl(&["get", "lb", "-o", "json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&j).unwrap();
    let a = &v["lbAttr"][0]["serviceArguments"];
    assert_eq!(
        (
            &a["externalIP"],
            &a["port"],
            &a["mode"],
            &a["kvExactMode"],
            &a["kvEngineType"],
            &a["kvBlockSize"]
        ),
        (
            &json!("20.20.20.1"),
            &json!(2020),
            &json!(4),
            &json!(3),
            &json!("vllm"),
            &json!(16)
        )
    );
    assert_eq!(v["lbAttr"][0]["endpoints"].as_array().unwrap().len(), 2);

    // A bad value is refused locally: one line naming the flag and the allowed values, exit 2.
    let mut bad = create_args(&svc.token_file());
    bad[9] = "--kv-engine-type=vlm".into();
    let bad: Vec<&str> = bad.iter().map(String::as_str).collect();
    let (code, _, err) = svc.ctl(&bad);
    assert_eq!(code, 2, "{err}");
    let line = one_line(&err);
    assert!(
        line.contains("--kv-engine-type") && line.contains("vllm, sglang"),
        "{line}"
    );
    let (code, _, err) = create_2021(&svc, &["--select=fastest"]);
    assert_eq!(code, 2);
    assert!(
        one_line(&err)
            .contains("--select: got \"fastest\", allowed: rr, hash, priority, persist, lc"),
        "{err}"
    );
    let (code, _, err) = create_2021(&svc, &["--kv-exact-mode=3", "--kv-block-size=0"]);
    assert_eq!(code, 2);
    assert!(
        one_line(&err).starts_with("kvroutectl: --kv-block-size: got 0"),
        "{err}"
    );
    let (code, _, err) = svc.ctl(&["get", "lb", "--no-such-flag"]);
    assert_eq!(code, 2);
    one_line(&err);

    // Without a token the server refuses: exit 1 with its message.
    let (code, _, err) = create_2021(&svc, &[]);
    assert_eq!(code, 1, "{err}");
    let line = one_line(&err);
    assert!(
        line.contains("401") && line.contains("bearer token"),
        "{line}"
    );

    let (code, out, _) = svc.ctl(&["health"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("status: ok"), "{out}");
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("20.20.20.1:2020/tcp"))
            .count(),
        2,
        "{out}"
    );
    let (code, out, _) = svc.ctl(&["health", "-o", "json"]);
    assert_eq!(code, 0);
    let h: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(h["rules"][0]["endpoints"][1]["blocks"], json!(0));

    let (code, out, _) = svc.ctl(&[
        "get",
        "kv-inventory",
        "--service-id",
        "1",
        "--ep-idx",
        "0",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0);
    let inv: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((&inv["total"], &inv["blocks"]), (&json!(0), &json!([])));
    let (code, _, err) = svc.ctl(&["get", "kv-inventory", "--service-id", "1", "--ep-idx", "7"]);
    assert_eq!(code, 1);
    assert!(one_line(&err).contains("out of range"), "{err}");

    let tf = svc.token_file();
    let delete = [
        "delete",
        "lb",
        "20.20.20.1",
        "--tcp=2020",
        "--token-file",
        &tf,
    ];
    let (code, _, err) = svc.ctl(&delete);
    assert_eq!(code, 0, "{err}");
    let (_, table, _) = svc.ctl(&["get", "lb"]);
    assert!(!table.contains("20.20.20.1"), "{table}");
    let (code, _, err) = svc.ctl(&delete);
    assert_eq!(code, 1);
    assert!(one_line(&err).contains("404"), "{err}");

    // Nothing listening: exit 3.
    let port = free_port().unwrap();
    let (code, _, err) = run_ctl(&format!("http://127.0.0.1:{port}"), &["get", "lb"]);
    assert_eq!(code, 3, "{err}");
    assert!(one_line(&err).contains("cannot reach"), "{err}");
}

/// `explain` answers the decision a real request would get and commits nothing: no metric moves,
/// and a real request afterwards is decided as if the explain never happened (a committed miss
/// would have left speculative credit, turning that request into a hit).
#[test]
fn explain_decides_without_side_effects() {
    let Some(tok) = tokenizer_dir() else {
        return;
    };
    let svc = Service::start("explain");
    create(&svc);
    let explain = || {
        let (code, out, err) = svc.explain("1", &tok, &["-o", "json"]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Value>(&out).unwrap()
    };
    let before = svc.decision_metrics();
    let e1 = explain();
    let e2 = explain();
    assert_eq!(svc.decision_metrics(), before, "explain changed a metric");
    assert_eq!(e1, e2, "a second explain saw the first");
    assert_eq!(
        (&e1["reason"], &e1["matched_blocks"]),
        (&json!("miss_no_overlap"), &json!(0))
    );
    let keys = e1["request"]["keys"].as_array().unwrap().clone();
    assert!(keys.len() >= 3, "{e1}");
    assert_eq!(e1["explain"]["endpoints"].as_array().unwrap().len(), 2);

    let route = |k: &[Value]| {
        let (s, b) = svc.http(
            "/v1/route",
            Some(json!({"rule": "1", "keys": k, "token_count": e1["request"]["token_count"]})),
        );
        assert_eq!(s, 200, "{b}");
        serde_json::from_str::<Value>(&b).unwrap()
    };
    // The first real request: the decision explain announced (a miss placed on its endpoint).
    let r1 = route(&keys);
    assert_eq!(
        (&r1["endpoint"], &r1["reason"], &r1["matched_blocks"]),
        (&e1["endpoint"], &json!("miss_no_overlap"), &json!(0))
    );
    assert!(r1.get("explain").is_none(), "{r1}");
    assert_ne!(
        svc.decision_metrics(),
        before,
        "a real decision moves the counters"
    );
    // Its speculative credit is real: the next request hits, and explain now sees it.
    let e3 = explain();
    assert_eq!(
        (&e3["reason"], &e3["matched_blocks"]),
        (&json!("hit"), &json!(keys.len()))
    );
    let r2 = route(&keys);
    assert_eq!(
        (&r2["reason"], &r2["endpoint"]),
        (&json!("hit"), &r1["endpoint"])
    );
    // A conversation bound by a real request shows in explain, as JSON and in the table.
    let (s, b) = svc.http(
        "/v1/route",
        Some(json!({"rule": "1", "keys": [], "token_count": 0, "session": "conv-9"})),
    );
    assert_eq!(s, 200, "{b}");
    let bound: Value = serde_json::from_str(&b).unwrap();
    let idx = e1["explain"]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .position(|e| e["endpoint"] == bound["endpoint"])
        .unwrap();
    let (code, out, err) = svc.explain("1", &tok, &["--session", "conv-9", "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let e4: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&e4["tier"], &e4["endpoint"], &e4["explain"]["session"]),
        (&json!("session"), &bound["endpoint"], &json!(idx)),
        "{e4}"
    );
    let (code, out, err) = svc.explain("1", &tok, &["--session", "conv-9"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("session: bound to endpoint {idx}")) && out.contains("CPU/STORAGE"),
        "{out}"
    );
}

/// `kvroutectl hash` is `kvroute-inventory hash`; `explain` hashes a prompt to the same keys.
#[test]
fn hash_is_the_preflight_and_explain_uses_the_same_keys() {
    let Some(tok) = tokenizer_dir() else {
        return;
    };
    let args = [
        "--engine",
        "vllm",
        "--algo",
        "sha256_cbor",
        "--seed",
        "0",
        "--block-size",
        "16",
        "--text",
        PROMPT,
        "--tokenizer",
        &tok,
    ];
    let (code, ours, err) = run_ctl("http://127.0.0.1:9", &[&["hash"], &args[..]].concat());
    assert_eq!(code, 0, "{err}");
    let theirs = Command::new(inventory_bin())
        .arg("hash")
        .args(args)
        .output()
        .unwrap();
    assert!(theirs.status.success());
    assert_eq!(ours, String::from_utf8_lossy(&theirs.stdout));
    let (code, _, err) = run_ctl("http://127.0.0.1:9", &["hash", "--engine", "vllx"]);
    assert_eq!(code, 2);
    assert!(one_line(&err).contains("--engine"), "{err}");

    let svc = Service::start("hash");
    create(&svc);
    let (code, out, err) = svc.explain("20.20.20.1:2020", &tok, &["-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let e: Value = serde_json::from_str(&out).unwrap();
    let h: Value = serde_json::from_str(&ours).unwrap();
    assert_eq!(e["request"]["keys"], h["keys"]);
    let (code, out, _) = svc.explain("1", &tok, &[]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("endpoint 127.0.0.1:8000 (fallback miss_no_overlap"),
        "{out}"
    );
}
