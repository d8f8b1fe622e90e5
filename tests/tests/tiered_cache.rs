//! A vLLM engine with KV offloading keeps a host-memory (CPU) tier behind its GPU cache and
//! publishes that tier's blocks with `medium: "CPU"`. Against two real simulators of such
//! engines, the inventory indexes the CPU tier apart from the GPU blocks: a prompt evicted from
//! one engine's GPU but kept in its CPU tier still draws the request there, the answer counts the
//! blocks the engine will load, and the engine reports exactly those as cached.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use kvroute_test_support::{Poll, Probe};
use kvroute_tests::harness::{self, ChildGuard, TempDir};
use serde_json::{json, Value};

const TOKEN: &str = "tiered-cache-token";
/// Loopback addresses no other test uses: both simulators publish on one `kvZmqPort`.
const IPS: [&str; 2] = ["127.0.0.181", "127.0.0.182"];
const BLOCK: usize = 16;
/// GPU blocks per engine: a few prompts evict the first one.
const GPU_BLOCKS: &str = "24";

fn spawn_sim(ip: &str, zmq: u16, dir: &TempDir) -> ChildGuard {
    let mut cmd = Command::new(harness::built_bin("kvroute-engine-sim").unwrap());
    cmd.args([
        "--listen",
        &format!("{ip}:0"),
        "--engine",
        "vllm",
        "--seed",
        "0",
    ])
    .args(["--kv-blocks", GPU_BLOCKS, "--cpu-blocks", "512"])
    .args(["--zmq-port", &zmq.to_string(), "--name", ip])
    .args(["--prefill-us-per-token", "1", "--decode-us-per-token", "10"]);
    ChildGuard::spawn(ip, cmd, &dir.path().join(format!("sim-{ip}.log"))).unwrap()
}

/// A prompt of `blocks` full blocks and one more token, its ids starting at `base`.
fn prompt(base: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK + 1) as u32).map(|t| base + t).collect()
}

async fn complete(client: &reqwest::Client, sim: SocketAddr, tokens: &[u32]) -> u64 {
    let r: Value = client
        .post(format!("http://{sim}/v1/completions"))
        .json(&json!({"prompt": tokens, "max_tokens": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_from_gpu_but_kept_in_cpu_draws_its_request() {
    let dir = TempDir::new("tiered-cache").unwrap();
    let zmq = harness::shared_port(&IPS, 11);
    assert_ne!(zmq, 0, "no port free on {IPS:?}");
    let mut children: Vec<ChildGuard> = IPS.iter().map(|ip| spawn_sim(ip, zmq, &dir)).collect();
    let mut sims = Vec::new();
    for c in &mut children {
        sims.push(harness::printed_addr(c, "listening on ").await.unwrap());
    }
    let env = [("LLB_KV_NONE_HASH_SEED", "0"), ("KVROUTE_SPEC_TTL_MS", "0")];
    let (_inv, addr) = harness::start_inventory(dir.path(), TOKEN, &env)
        .await
        .unwrap();
    let rule = json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": 21201, "protocol": "tcp",
        "sel": 0, "mode": 4, "kvExactMode": 3, "kvEngineType": "vllm", "kvBlockSize": BLOCK,
        "kvHashAlgo": "sha256_cbor", "kvZmqPort": zmq},
        "endpoints": sims.iter().map(|s| json!({"endpointIP": s.ip().to_string(),
            "targetPort": s.port(), "weight": 1})).collect::<Vec<_>>()});
    harness::add_rule(addr, TOKEN, &rule).await.unwrap();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let contract = HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(BLOCK as u32).unwrap())
        .with_seed("0");
    let keys = |tokens: &[u32]| -> Vec<u64> {
        contract
            .keys(tokens, &ExtraKeys::default())
            .unwrap()
            .into_iter()
            .map(|k| k.0)
            .collect()
    };
    let metric = async |series: &str| -> f64 {
        let m = harness::body_text(client.get(format!("http://{addr}/metrics")))
            .await
            .unwrap();
        harness::sample(&m, series)
    };
    let rule_id = "127.0.0.1:21201/tcp";
    let lower = |ep: usize| {
        format!(r#"kvroute_index_lower_blocks{{ep="{ep}",medium="cpu",rule="{rule_id}"}}"#)
    };
    let gpu = |ep: usize| format!(r#"kvroute_index_blocks{{ep="{ep}",rule="{rule_id}"}}"#);

    // The subscribers connect: a new probe prompt on each engine until both show GPU blocks
    // (an engine publishes a block once, so each round sends blocks it has not seen).
    let round = std::cell::Cell::new(0u32);
    Poll::new("both engines' events", Duration::from_secs(30))
        .every(Duration::from_millis(100))
        .until(async || {
            let mut seen = 0;
            round.set(round.get() + 1);
            for (i, s) in sims.iter().enumerate() {
                let base = 100_000 + 100 * round.get() + 50 * i as u32;
                complete(&client, *s, &prompt(base, 1)).await;
                seen += usize::from(metric(&gpu(i)).await > 0.0);
            }
            Ok(match seen == sims.len() {
                true => Probe::Ready(()),
                false => Probe::Pending(format!("{seen} of {} engines", sims.len())),
            })
        })
        .await
        .unwrap();

    // Engine 0 computes the prompt (8 blocks), then three others evict it from its 24 GPU
    // blocks; its CPU tier (512 blocks) keeps all of them.
    let p = prompt(1000, 8);
    let p_keys = keys(&p);
    assert_eq!(p_keys.len(), 8);
    complete(&client, sims[0], &p).await;
    for i in 0..3 {
        complete(&client, sims[0], &prompt(10_000 + 1000 * i, 8)).await;
    }
    let route = async |explain: bool| -> Value {
        let body =
            json!({"rule": rule_id, "keys": p_keys, "token_count": p.len(), "explain": explain});
        let r = client
            .post(format!("http://{addr}/v1/route"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        r.json().await.unwrap()
    };
    // The index shows the eviction from GPU and the prompt in engine 0's CPU tier.
    let seen = Poll::new(
        "the prompt in engine 0's CPU tier only",
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(50))
    .until(async || {
        let a = route(true).await;
        let e0 = &a["explain"]["endpoints"][0];
        Ok(
            match e0["matched_blocks"] == json!(0) && e0["lower_blocks"] == json!([8, 0]) {
                true => Probe::Ready(a),
                false => Probe::Pending(a.to_string()),
            },
        )
    })
    .await
    .unwrap();
    assert!(metric(&lower(0)).await >= 8.0, "{seen}");
    assert_eq!(seen["explain"]["endpoints"][1]["matched_blocks"], json!(0));

    // The request goes to engine 0, credited with the 8 blocks it will load...
    let a = route(false).await;
    assert_eq!(
        (
            &a["endpoint"],
            &a["tier"],
            &a["reason"],
            &a["matched_blocks"]
        ),
        (
            &json!(sims[0].to_string()),
            &json!("tier15"),
            &json!("hit"),
            &json!(8)
        ),
        "{a}"
    );
    assert_eq!(
        metric(r#"kvroute_route_lower_tier_blocks_total{medium="cpu"}"#).await,
        8.0
    );
    // ... and engine 0 serves it from its CPU tier: exactly the predicted blocks are cached.
    assert_eq!(complete(&client, sims[0], &p).await, 8 * BLOCK as u64);
    // The engine without the prompt in any tier computes it all.
    assert_eq!(complete(&client, sims[1], &p).await, 0);
}
