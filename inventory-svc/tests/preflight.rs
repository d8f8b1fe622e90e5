//! `kvroute-inventory hash`: the parity preflight, run as users run it (the real binary).
//!
//! Keys are checked against the engines' golden vectors, tokens against the HF reference fixtures,
//! and every bad argument must exit 2 with a single line naming the flag.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute-inventory"))
        .arg("hash")
        .args(args)
        .output()
        .expect("run binary")
}

fn ok_json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tokenizer_dir() -> String {
    let dir = std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/fixtures/qwen3"));
    assert!(
        dir.join("tokenizer.json").exists(),
        "tokenizer fixture missing at {}: run ./scripts/test.sh (it runs scripts/setup.sh)",
        dir.display()
    );
    dir.to_string_lossy().into_owned()
}

fn range(n: u32) -> String {
    (0..n).map(|t| t.to_string()).collect::<Vec<_>>().join(",")
}

fn fixture(name: &str) -> Value {
    let p = repo().join("shared/tests/fixtures/chat").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn vllm_keys_are_the_engines_unsigned_keys() {
    let v = ok_json(&[
        "--engine",
        "vllm",
        "--seed",
        "0",
        "--block-size",
        "16",
        "--tokens",
        &range(33),
    ]);
    // vLLM 0.33.0, sha256_cbor, PYTHONHASHSEED=0, range(32): the trailing partial block has no key.
    assert_eq!(
        v["keys"],
        serde_json::json!([12687895063098490012u64, 1814341696565857452u64])
    );
    assert_eq!(v["tokens"].as_array().unwrap().len(), 33);
    assert_eq!(v["algo"], "sha256_cbor");
}

#[test]
fn sglang_keys_are_signed_and_trtllm_unsigned() {
    let v = ok_json(&[
        "--engine",
        "sglang",
        "--block-size",
        "16",
        "--tokens",
        &range(64),
    ]);
    assert_eq!(
        v["keys"],
        serde_json::json!([
            6738917275443968386i64,
            5080553031686747138i64,
            -7164637995261029506i64,
            3374555260141370485i64
        ])
    );
    let v = ok_json(&[
        "--engine",
        "trtllm",
        "--block-size",
        "16",
        "--tokens",
        &range(64),
    ]);
    assert_eq!(v["keys"][2], serde_json::json!(16381328358817759988u64));
}

#[test]
fn text_and_chat_inputs_tokenize_like_the_reference() {
    let dir = tokenizer_dir();
    let completions = fixture("qwen3-completions.json");
    let case = &completions["cases"][0];
    let prompt = case["request"]["prompt"].as_str().unwrap();
    let v = ok_json(&[
        "--engine",
        "vllm",
        "--block-size",
        "1",
        "--text",
        prompt,
        "--tokenizer",
        &dir,
    ]);
    assert_eq!(v["tokens"], case["expected_ids"]);
    assert_eq!(
        v["keys"].as_array().unwrap().len(),
        case["expected_ids"].as_array().unwrap().len()
    );

    let chats = fixture("qwen3-chat.json");
    let case = chats["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "history_with_think_block")
        .unwrap();
    let tmp = std::env::temp_dir().join(format!("kvroute-preflight-{}.json", std::process::id()));
    std::fs::write(&tmp, case["request"].to_string()).unwrap();
    let v = ok_json(&[
        "--engine",
        "sglang",
        "--block-size",
        "16",
        "--chat",
        tmp.to_str().unwrap(),
        "--tokenizer",
        &dir,
    ]);
    std::fs::remove_file(&tmp).ok();
    assert_eq!(v["tokens"], case["expected_ids"]);
    let n = case["expected_ids"].as_array().unwrap().len();
    assert_eq!(v["keys"].as_array().unwrap().len(), n / 16);
}

#[test]
fn bad_arguments_exit_2_with_one_line_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--block-size", "16", "--tokens", "1"],
            "--engine is required",
        ),
        (
            &["--engine", "ollama", "--block-size", "16", "--tokens", "1"],
            "--engine \"ollama\"",
        ),
        (
            &[
                "--engine",
                "llamacpp",
                "--block-size",
                "16",
                "--tokens",
                "1",
            ],
            "--engine \"llamacpp\"",
        ),
        (
            &[
                "--engine",
                "sglang",
                "--algo",
                "sha256_cbor",
                "--block-size",
                "16",
                "--tokens",
                "1",
            ],
            "allowed: sha256_sglang, tokens",
        ),
        (
            &["--engine", "vllm", "--tokens", "1"],
            "--block-size is required",
        ),
        (
            &["--engine", "vllm", "--block-size", "0", "--tokens", "1"],
            "--block-size \"0\" must be an integer >= 1",
        ),
        (
            &["--engine", "vllm", "--block-size", "16", "--tokens", "1,x"],
            "--tokens: \"x\"",
        ),
        (
            &["--engine", "vllm", "--block-size", "16", "--text", "hi"],
            "need --tokenizer",
        ),
        (
            &["--engine", "vllm", "--block-size", "16"],
            "give exactly one of",
        ),
        (
            &[
                "--engine",
                "vllm",
                "--block-size",
                "16",
                "--tokens",
                "1",
                "--bogus",
            ],
            "unknown argument \"--bogus\"",
        ),
        (
            &[
                "--engine",
                "vllm",
                "--algo",
                "xxhash_cbor",
                "--block-size",
                "16",
                "--tokens",
                "1",
            ],
            "PYTHONHASHSEED",
        ),
        (
            &[
                "--engine",
                "vllm",
                "--block-size",
                "16",
                "--text",
                "hi",
                "--tokenizer",
                "/nonexistent",
            ],
            "cannot read",
        ),
    ];
    for (args, want) in cases {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(want),
            "{args:?}: stderr {err:?} lacks {want:?}"
        );
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{args:?}: more than one line: {err:?}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: printed on stdout");
    }
}

/// `hash --events`: the preflight subscribes to a real ZMQ publisher standing in for the engine
/// (it publishes vLLM's golden BlockStored for tokens 0..63 until the preflight exits) and
/// names what it found, with the exit code.
mod events {
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    use super::common::{batch, stored, vllm_range64, Publisher};
    use serde_json::Value;

    use super::range;

    /// Runs the preflight with `args` against a publisher of the golden event; returns the exit
    /// code and the `events` verdict.
    async fn preflight(args: &[&str], wait_ms: &str) -> (i32, Value) {
        let mut p = Publisher::bind(0).await.unwrap();
        let addr = format!("tcp://127.0.0.1:{}", p.port);
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-inventory"))
            .arg("hash")
            .args(args)
            .args(["--events", &addr, "--wait-ms", wait_ms])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (keys, tokens) = vllm_range64();
        let payload = batch(vec![stored(&keys, &tokens, false)]);
        // A PUB drops what it sends before the subscriber has joined: send until the preflight exits.
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "preflight did not exit");
            p.send(&payload).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let out = child.wait_with_output().unwrap();
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        (status.code().unwrap_or(-1), v["events"].clone())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn matching_engine_passes() {
        let toks = range(64);
        let args = [
            "--engine",
            "vllm",
            "--seed",
            "0",
            "--block-size",
            "16",
            "--tokens",
            &toks,
        ];
        let (code, ev) = preflight(&args, "20000").await;
        assert_eq!((code, &ev["verdict"]), (0, &Value::from("match")), "{ev}");
        assert_eq!(ev["blocks_compared"], 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wrong_seed_is_named() {
        let toks = range(64);
        let args = [
            "--engine",
            "vllm",
            "--seed",
            "1234",
            "--block-size",
            "16",
            "--tokens",
            &toks,
        ];
        let (code, ev) = preflight(&args, "20000").await;
        assert_eq!(
            (code, &ev["verdict"]),
            (1, &Value::from("key_mismatch")),
            "{ev}"
        );
        assert_eq!(ev["suggested_seed"], "0", "{ev}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wrong_tokens_name_the_position() {
        // Tokens 0..9 agree, then differ: what a chat template or tokenizer mismatch looks like.
        let toks: String = (0..64u32)
            .map(|t| if t < 10 { t } else { t + 1000 }.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let args = [
            "--engine",
            "vllm",
            "--seed",
            "0",
            "--block-size",
            "16",
            "--tokens",
            &toks,
        ];
        let (code, ev) = preflight(&args, "20000").await;
        assert_eq!(
            (code, &ev["verdict"]),
            (1, &Value::from("token_mismatch")),
            "{ev}"
        );
        assert_eq!(
            (&ev["position"], &ev["ours"], &ev["engine"]),
            (&Value::from(10), &Value::from(1010), &Value::from(10))
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_event_of_the_prompt_times_out() {
        // Nothing in common with the published prompt: skipped, then the bounded wait ends.
        let toks: String = (5000..5064u32)
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let args = [
            "--engine",
            "vllm",
            "--seed",
            "0",
            "--block-size",
            "16",
            "--tokens",
            &toks,
        ];
        let (code, ev) = preflight(&args, "1500").await;
        assert_eq!(
            (code, &ev["verdict"]),
            (1, &Value::from("no_event")),
            "{ev}"
        );
        assert_eq!(ev["closest_chain_start"]["position"], 0, "{ev}");
    }

    #[test]
    fn bad_event_flags_exit_2() {
        for (args, want) in [
            (
                vec!["--events", "engine:5557"],
                "--events \"engine:5557\": allowed: tcp://IP:PORT",
            ),
            (
                vec![
                    "--events",
                    "tcp://127.0.0.1:1",
                    "--events-bind",
                    "tcp://127.0.0.1:2",
                ],
                "give one of --events and --events-bind",
            ),
            (
                vec!["--events", "tcp://127.0.0.1:1", "--wait-ms", "0"],
                "--wait-ms \"0\" must be 1-3600000",
            ),
        ] {
            let mut a = vec!["--engine", "vllm", "--block-size", "16", "--tokens", "1,2"];
            a.extend(args);
            let out = super::run(&a);
            assert_eq!(out.status.code(), Some(2), "{a:?}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(want), "{a:?}: {err}");
        }
        let out = super::run(&[
            "--engine",
            "trtllm",
            "--block-size",
            "16",
            "--tokens",
            "1,2",
            "--events",
            "tcp://127.0.0.1:1",
        ]);
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("trtllm publishes no ZMQ events"));
    }
}
