//! Processes the benchmark starts: simulators and the inventory service. Each is killed when its
//! handle drops; readiness is the process's own "listening on ADDR" line, awaited with a deadline.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};

/// A child process killed on drop.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    /// Its bound address.
    pub addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// Spawns `cmd`, whose readiness the caller checks itself (it will listen on `addr`); the
    /// handle kills it on drop from now on.
    pub fn spawn_unready(mut cmd: Command, addr: SocketAddr) -> anyhow::Result<Proc> {
        let child = cmd.spawn().with_context(|| format!("spawn {cmd:?}"))?;
        Ok(Proc { child, addr })
    }

    /// The exit status if the process has ended.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Spawns `cmd` and waits up to `deadline` for a stdout line containing `listening on ADDR`.
    pub fn spawn(mut cmd: Command, deadline: Duration) -> anyhow::Result<Proc> {
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().with_context(|| format!("spawn {cmd:?}"))?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !sent {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                        sent = true;
                    }
                }
            }
        });
        match rx.recv_timeout(deadline) {
            Ok(a) => {
                let addr = a
                    .parse()
                    .with_context(|| format!("bad ready address {a:?}"))?;
                Ok(Proc { child, addr })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                // Its stdout closed without the ready line: it exited (its stderr is inherited).
                let _ = child.kill();
                let status = child.wait()?;
                bail!("{cmd:?} exited before it was ready ({status}); its stderr is above")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{cmd:?} was not ready within {deadline:?}")
            }
        }
    }
}

/// A binary next to the running one (cargo puts workspace binaries in one directory).
pub fn sibling(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.join(name);
    p.is_file().then_some(p)
}

/// What every simulator of a fleet shares.
#[derive(Debug, Clone)]
pub struct SimSpec {
    /// The simulator binary.
    pub bin: PathBuf,
    /// `--engine`.
    pub engine: String,
    /// `--kv-blocks`.
    pub kv_blocks: usize,
    /// `--block-size`.
    pub block_size: u32,
    /// `--seed` (vLLM).
    pub seed: Option<String>,
    /// `--tokenizer-dir`.
    pub tokenizer_dir: Option<PathBuf>,
    /// `--prefill-us-per-token`.
    pub prefill_us: f64,
    /// `--decode-us-per-token`.
    pub decode_us: f64,
    /// `--prefill-base-us`.
    pub prefill_base_us: f64,
    /// `--cache-prompt-at`.
    pub cache_prompt_at: crate::config::CacheAt,
    /// `--max-concurrency`.
    pub max_concurrency: usize,
    /// `--cpu-blocks` (vLLM: the CPU tier per simulator; 0: none).
    pub cpu_blocks: usize,
}

/// Running simulators.
#[derive(Debug)]
pub struct Fleet {
    /// The processes, index = endpoint index.
    pub sims: Vec<Proc>,
    /// Their names (`x-kvroute-sim`).
    pub names: Vec<String>,
    /// ZMQ port shared by all (vLLM/SGLang: each sim on its own 127.0.0.x).
    pub zmq_port: Option<u16>,
}

/// A free TCP port on `ip` right now.
pub fn free_port(ip: &str) -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind((ip, 0))?.local_addr()?.port())
}

/// A TCP port free right now on every one of `ips` (the simulators of one fleet share the ZMQ
/// port on their own addresses; probing another address would not see a port that a
/// concurrently running fleet holds on these).
pub fn free_port_on_all(ips: &[String]) -> anyhow::Result<u16> {
    let first = ips.first().map_or("127.0.0.1", String::as_str);
    for _ in 0..64 {
        let probe = std::net::TcpListener::bind((first, 0))?;
        let port = probe.local_addr()?.port();
        let rest = ips.get(1..).unwrap_or(&[]);
        let held: Vec<_> = rest
            .iter()
            .map_while(|ip| std::net::TcpListener::bind((ip.as_str(), port)).ok())
            .collect();
        if held.len() == rest.len() {
            return Ok(port);
        }
    }
    Err(anyhow!("no port free on all of {ips:?} in 64 tries"))
}

impl Fleet {
    /// Starts `n` simulators. vLLM/SGLang publish ZMQ, and a router reaches `endpoint IP +
    /// kvZmqPort`, so each simulator then gets its own loopback address 127.0.0.(10+i) and all
    /// share one port; TensorRT-LLM and llama.cpp simulators all use 127.0.0.1.
    ///
    /// The ZMQ port is free when chosen, but a process starting meanwhile (another fleet's
    /// simulator binding its HTTP port to 0, say) can take it first: a simulator that exits
    /// before it is ready then has the fleet started again on a new port, at most 4 times.
    pub fn start(spec: &SimSpec, n: usize) -> anyhow::Result<Fleet> {
        let zmq = matches!(spec.engine.as_str(), "vllm" | "sglang");
        let ips: Vec<String> = (0..n)
            .map(|i| match zmq {
                true => format!("127.0.0.{}", 10 + i),
                false => "127.0.0.1".to_string(),
            })
            .collect();
        let mut attempt = 1;
        loop {
            let zmq_port = if zmq {
                Some(free_port_on_all(&ips)?)
            } else {
                None
            };
            match Self::start_on(spec, &ips, zmq_port) {
                Err(e) if zmq && attempt < 4 => {
                    eprintln!("kvroute-bench: {e:#}; starting the fleet again on a new ZMQ port");
                    attempt += 1;
                }
                done => return done,
            }
        }
    }

    fn start_on(spec: &SimSpec, ips: &[String], zmq_port: Option<u16>) -> anyhow::Result<Fleet> {
        let n = ips.len();
        let mut sims = Vec::with_capacity(n);
        let mut names = Vec::with_capacity(n);
        for (i, ip) in ips.iter().enumerate() {
            let name = format!("sim-{i}");
            let mut cmd = Command::new(&spec.bin);
            cmd.args([
                "--listen",
                &format!("{ip}:0"),
                "--engine",
                &spec.engine,
                "--name",
                &name,
            ])
            .args([
                "--kv-blocks",
                &spec.kv_blocks.to_string(),
                "--block-size",
                &spec.block_size.to_string(),
            ])
            .args([
                "--prefill-us-per-token",
                &spec.prefill_us.to_string(),
                "--decode-us-per-token",
                &spec.decode_us.to_string(),
                "--prefill-base-us",
                &spec.prefill_base_us.to_string(),
                "--cache-prompt-at",
                spec.cache_prompt_at.as_str(),
            ])
            .args(["--max-concurrency", &spec.max_concurrency.to_string()]);
            if spec.cpu_blocks > 0 {
                cmd.args(["--cpu-blocks", &spec.cpu_blocks.to_string()]);
            }
            if let Some(p) = zmq_port {
                cmd.args(["--zmq-port", &p.to_string()]);
            }
            if let Some(s) = &spec.seed {
                cmd.args(["--seed", s]);
            }
            if let Some(d) = &spec.tokenizer_dir {
                cmd.arg("--tokenizer-dir").arg(d);
            }
            sims.push(Proc::spawn(cmd, Duration::from_secs(60))?);
            names.push(name);
        }
        Ok(Fleet {
            sims,
            names,
            zmq_port,
        })
    }

    /// Base URLs.
    pub fn urls(&self) -> Vec<String> {
        self.sims
            .iter()
            .map(|p| format!("http://{}", p.addr))
            .collect()
    }
}

/// Checks that every simulator at `urls` runs the CPU tier of `blocks` blocks it was started
/// with (`GET /debug/cache`, every rank), so a run never measures a fleet without it.
pub async fn check_cpu_tier(
    http: &reqwest::Client,
    urls: &[String],
    blocks: usize,
) -> anyhow::Result<()> {
    for u in urls {
        let v: serde_json::Value = http
            .get(format!("{u}/debug/cache"))
            .send()
            .await
            .with_context(|| format!("{u}/debug/cache"))?
            .json()
            .await
            .with_context(|| format!("{u}/debug/cache"))?;
        let ranks = v["ranks"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        let ok = !ranks.is_empty()
            && ranks
                .iter()
                .all(|r| r["cpu"]["capacity"].as_u64() == Some(blocks as u64));
        if !ok {
            bail!("{u} does not report a CPU tier of {blocks} blocks per rank: {v}");
        }
    }
    Ok(())
}

/// The loxilb-shaped rule the inventory needs for this fleet.
pub fn rule_json(
    spec: &SimSpec,
    fleet: &Fleet,
    vip_port: u16,
    key_mode: &str,
) -> serde_json::Value {
    let endpoints: Vec<serde_json::Value> = fleet
        .sims
        .iter()
        .map(|p| serde_json::json!({"endpointIP": p.addr.ip().to_string(), "targetPort": p.addr.port(), "weight": 1}))
        .collect();
    let mut args = serde_json::json!({"externalIP": "127.0.0.1", "port": vip_port, "mode": 4, "sel": 0, "kvExactMode": 3,
        "kvEngineType": spec.engine, "kvBlockSize": spec.block_size, "kvKeyMode": key_mode});
    if let (Some(p), serde_json::Value::Object(m)) = (fleet.zmq_port, &mut args) {
        m.insert("kvZmqPort".into(), p.into());
    }
    serde_json::json!([{"serviceArguments": args, "endpoints": endpoints}])
}

/// The parity canary of an inventory the bench starts.
pub struct Canary {
    /// `KVROUTE_CANARY_INTERVAL_MS`.
    pub interval_ms: u64,
    /// The `--tokenizer-dir` holding the model's tokenizer ([`stage_tokenizer`]).
    pub tokenizers: PathBuf,
}

/// Names the served model in every rule of `rules` (`kvModel`: the canary's requests and
/// tokenizer).
pub fn name_model(rules: &mut serde_json::Value, model: &str) {
    for r in rules.as_array_mut().into_iter().flatten() {
        if let Some(a) = r["serviceArguments"].as_object_mut() {
            a.insert("kvModel".into(), model.into());
        }
    }
}

/// Copies the tokenizer files of `dir` where the inventory looks for `model`'s tokenizer
/// (`<root>/tokenizers/<slug>/`) under a root in `tmp`, and returns the root.
pub fn stage_tokenizer(dir: &Path, model: &str, tmp: &Path) -> anyhow::Result<PathBuf> {
    let slug = kvroute_core::slug::slug(model).map_err(|e| anyhow!("--model {model:?}: {e}"))?;
    let root = tmp.join(format!("kvroute-bench-tokenizers-{}", std::process::id()));
    let to = root.join("tokenizers").join(slug);
    std::fs::create_dir_all(&to).with_context(|| format!("create {}", to.display()))?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let from = dir.join(f);
        if from.exists() {
            std::fs::copy(&from, to.join(f)).with_context(|| format!("copy {}", from.display()))?;
        }
    }
    Ok(root)
}

/// How the bench runs an inventory beyond its rules.
#[derive(Default)]
pub struct InventoryOptions<'a> {
    /// `LLB_KV_NONE_HASH_SEED` (vLLM's PYTHONHASHSEED).
    pub seed: Option<&'a str>,
    /// The parity canary.
    pub canary: Option<&'a Canary>,
    /// Extra environment (`--inventory-env K=V`), set after the bench's own so it overrides them.
    pub env: &'a [(String, String)],
}

/// Starts the inventory service on 127.0.0.1 with `rules` (in-memory, no Redis), with the
/// parity canary when `opts.canary` is given.
pub fn start_inventory(
    bin: &Path,
    rules: &serde_json::Value,
    opts: &InventoryOptions<'_>,
    dir: &Path,
) -> anyhow::Result<Proc> {
    let cfg = dir.join(format!("kvroute-bench-rules-{}.json", std::process::id()));
    std::fs::write(&cfg, serde_json::to_vec_pretty(rules)?)?;
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&cfg);
    cmd.env("KVROUTE_TRTLLM_DRAIN_MS", "20")
        .env("KVROUTE_HEALTH_INTERVAL_MS", "1000")
        .env("KVROUTE_SCRAPE_INTERVAL_MS", "200");
    if let Some(s) = opts.seed {
        cmd.env("LLB_KV_NONE_HASH_SEED", s);
    }
    if let Some(c) = opts.canary {
        cmd.arg("--tokenizer-dir").arg(&c.tokenizers);
        cmd.env("KVROUTE_CANARY_INTERVAL_MS", c.interval_ms.to_string());
    }
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "warn");
    }
    for (k, v) in opts.env {
        cmd.env(k, v);
    }
    let inventory = Proc::spawn(cmd, Duration::from_secs(60));
    // The service reads its rules file once, before it listens: ready or failed, it is done with it.
    let _ = std::fs::remove_file(&cfg);
    inventory
}
