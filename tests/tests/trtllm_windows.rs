//! A TensorRT-LLM model with variable sliding-window attention publishes each attention window's
//! block events with its `window_size`: the inventory, draining a real simulator of such an
//! engine, indexes the full-attention window only, so the sliding window's evictions neither
//! erase nor fake the prefix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use kvroute_test_support::{Poll, Probe};
use kvroute_tests::harness::{self, ChildGuard, TempDir};
use serde_json::{json, Value};

const TOKEN: &str = "trtllm-windows-token";

async fn get(client: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    Ok(client.get(url).send().await?.text().await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_full_attention_window_is_indexed() {
    let dir = TempDir::new("trtllm-windows").unwrap();
    let mut cmd = Command::new(harness::built_bin("kvroute-engine-sim").unwrap());
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--engine",
        "trtllm",
        "--block-size",
        "16",
    ])
    .args([
        "--sliding-window-blocks",
        "2",
        "--decode-us-per-token",
        "10",
    ]);
    let mut sim = ChildGuard::spawn("sim", cmd, &dir.path().join("sim.log")).unwrap();
    let sim_addr = harness::printed_addr(&mut sim, "listening on ")
        .await
        .unwrap();
    let (_inv, addr) =
        harness::start_inventory(dir.path(), TOKEN, &[("KVROUTE_TRTLLM_DRAIN_MS", "20")])
            .await
            .unwrap();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let rule = json!({"serviceArguments": {"externalIP": "127.0.0.1", "port": 21101, "protocol": "tcp",
        "sel": 0, "mode": 4, "kvExactMode": 3, "kvEngineType": "trtllm", "kvBlockSize": 16},
        "endpoints": [{"endpointIP": "127.0.0.1", "targetPort": sim_addr.port(), "weight": 1}]});
    harness::add_rule(addr, TOKEN, &rule).await.unwrap();

    // 12 full blocks: the sliding window keeps 2 and drops 10 in its own pool.
    let prompt: Vec<u32> = (0..12 * 16 + 3).map(|t| 1000 + t).collect();
    let r = client
        .post(format!("http://{sim_addr}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let inventory = format!(
        "http://{addr}/netlox/v1/config/ai/kv/inventory?service_id=127.0.0.1:21101&ep_idx=0&limit=1"
    );
    let metrics = format!("http://{addr}/metrics");
    let (held, skipped) = Poll::new(
        "the drain to bring both windows' events",
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(50))
    .until(async || {
        let v: Value = serde_json::from_str(&get(&client, &inventory).await?)?;
        let held = v["total"].as_u64().unwrap_or(0);
        let m = get(&client, &metrics).await?;
        let skipped: f64 = m
            .lines()
            .filter(|l| {
                l.starts_with("kvroute_ingest_partial_attention_blocks_total{")
                    && l.contains(r#"engine="trtllm""#)
                    && l.contains(r#"event="block_removed""#)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        Ok(match held >= 12 && skipped >= 10.0 {
            true => Probe::Ready((held, skipped)),
            false => Probe::Pending(format!(
                "{held} blocks held, {skipped} sliding removals skipped"
            )),
        })
    })
    .await
    .unwrap();
    assert_eq!(
        held, 12,
        "the full-attention window's blocks, no more and no fewer"
    );
    assert_eq!(skipped, 10.0);
    let m = get(&client, &metrics).await.unwrap();
    assert!(
        !m.lines()
            .any(|l| l.starts_with("kvroute_ingest_clears_total{") && l.contains("window")),
        "the full window came first: nothing to clear\n{m}"
    );
}
