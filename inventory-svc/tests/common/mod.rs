//! Harness for the service's integration tests: spawn the built binary on 127.0.0.1 port 0, read
//! the address it prints, talk HTTP, publish engine events over real ZMQ, stop the process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rmpv::Value as Mp;
use serde_json::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

pub const TOKEN: &str = "s3cret-token";
/// Env value meaning "remove this variable" (the harness sets LLB_KV_NONE_HASH_SEED=0 by default,
/// as the golden vectors were produced with PYTHONHASHSEED=0).
pub const UNSET: &str = "<unset>";

/// A running `kvroute-inventory serve`.
pub struct Service {
    pub child: Child,
    pub base: String,
    pub dir: PathBuf,
    pub http: reqwest::Client,
}

static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A fresh temp directory for one test.
pub fn tempdir(tag: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kvroute-inv-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl Service {
    /// Starts the service with `rules` (a JSON list) and extra env vars; waits for its address.
    pub fn start(tag: &str, rules: &Value, env: &[(&str, &str)]) -> Service {
        let dir = tempdir(tag);
        let cfg = dir.join("rules.json");
        std::fs::write(&cfg, serde_json::to_string(rules).unwrap()).unwrap();
        let tok = dir.join("token");
        std::fs::write(&tok, format!("{TOKEN}\n")).unwrap();
        std::fs::create_dir_all(dir.join("tokenizers")).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-inventory"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&cfg)
            .arg("--auth-token-file")
            .arg(&tok)
            .arg("--tokenizer-dir")
            .arg(&dir)
            .env("KVROUTE_HEALTH_INTERVAL_MS", "0")
            .env("LLB_KV_NONE_HASH_SEED", "0")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("stderr.log")).unwrap(),
            ));
        for (k, v) in env {
            if *v == UNSET {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let mut child = cmd.spawn().expect("spawn kvroute-inventory");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("kvroute-inventory listening on ") {
                    let _ = tx.send(a.to_owned());
                }
                // Keep draining stdout so the child never blocks on a full pipe.
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "service did not start: {}",
                    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
                );
            }
        };
        let (scheme, addr) = match addr.strip_suffix(" (tls)") {
            Some(a) => ("https", a.to_owned()),
            None => ("http", addr),
        };
        let mut http = reqwest::Client::builder();
        if let Some(ca) = env
            .iter()
            .find(|(k, _)| *k == "KVROUTE_TEST_CA")
            .map(|(_, v)| *v)
        {
            http = http.add_root_certificate(
                reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap(),
            );
        }
        Service {
            child,
            base: format!("{scheme}://{addr}"),
            dir,
            http: http.build().unwrap(),
        }
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    pub async fn get_json(&self, path: &str) -> Value {
        let (s, b) = self.get(path).await;
        assert_eq!(s, 200, "{path}: {b}");
        serde_json::from_str(&b).unwrap()
    }

    pub async fn post(&self, path: &str, body: &str, token: Option<&str>) -> (u16, Value) {
        let mut r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().await.unwrap();
        let s = r.status().as_u16();
        let t = r.text().await.unwrap();
        (s, serde_json::from_str(&t).unwrap_or(Value::String(t)))
    }

    pub async fn metrics(&self) -> String {
        self.get("/metrics").await.1
    }

    /// Blocks of endpoint `ep` of rule `rule` (first page).
    pub async fn inventory(&self, rule: &str, ep: usize) -> Vec<u64> {
        let found = self.try_inventory(rule, ep).await;
        found.unwrap_or_else(|| panic!("no inventory for rule {rule} ep {ep}"))
    }

    /// [`Service::inventory`], or `None` while the service does not know the rule (not 200).
    pub async fn try_inventory(&self, rule: &str, ep: usize) -> Option<Vec<u64>> {
        let (s, body) = self
            .get(&format!(
                "/netlox/v1/config/ai/kv/inventory?service_id={rule}&ep_idx={ep}&limit=10000"
            ))
            .await;
        if s != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).unwrap();
        Some(
            v["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["hash_uint64"].as_u64().unwrap())
                .collect(),
        )
    }

    /// Polls `f` until it returns true, at most `secs` seconds.
    pub async fn wait_for<F, Fut>(&self, what: &str, secs: u64, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let end = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < end {
            if f().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("timed out waiting for {what}; stderr:\n{}", self.stderr());
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    /// SIGTERM, then the exit status (bounded wait; killed if it does not exit).
    pub fn terminate(&mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let end = Instant::now() + Duration::from_secs(15);
        while Instant::now() < end {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Value of one exact metric line (`name{labels}`), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
    })
}

/// Asserts that `series` reads `want` in the metrics `text` (printed whole otherwise).
#[track_caller]
pub fn assert_metric(text: &str, series: &str, want: f64) {
    assert_eq!(metric(text, series), Some(want), "{series}\n{text}");
}

/// A rule in loxilb's JSON shape.
pub fn rule(
    port: u16,
    engine: &str,
    zmq_port: u16,
    endpoints: &[(String, u16)],
    extra: Value,
) -> Value {
    let mut sa = if engine == "llamacpp" {
        serde_json::json!({"externalIP": "10.0.0.1", "port": port, "protocol": "tcp", "sel": 0, "mode": 4, "kvEngineType": engine})
    } else {
        serde_json::json!({
            "externalIP": "10.0.0.1", "port": port, "protocol": "tcp", "sel": 0, "mode": 4,
            "kvExactMode": 3, "kvBlockSize": 16, "kvEngineType": engine, "kvZmqPort": zmq_port,
        })
    };
    if let (Value::Object(m), Value::Object(x)) = (&mut sa, extra) {
        m.extend(x);
    }
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(ip, p)| serde_json::json!({"endpointIP": ip, "targetPort": p, "weight": 1}))
        .collect();
    serde_json::json!({"serviceArguments": sa, "endpoints": eps})
}

/// A msgpack KV batch `[ts, events, dp_rank]`.
pub fn batch(events: Vec<Mp>) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(
        &mut buf,
        &Mp::Array(vec![Mp::F64(1.0), Mp::Array(events), Mp::Nil]),
    )
    .unwrap();
    buf
}

fn map(kv: Vec<(&str, Mp)>) -> Mp {
    Mp::Map(kv.into_iter().map(|(k, v)| (Mp::from(k), v)).collect())
}

/// A BlockStored event (keys as u64; `signed` sends them as i64 like SGLang).
pub fn stored(keys: &[u64], tokens: &[u32], signed: bool) -> Mp {
    let ks: Vec<Mp> = keys
        .iter()
        .map(|k| {
            if signed {
                Mp::from(*k as i64)
            } else {
                Mp::from(*k)
            }
        })
        .collect();
    map(vec![
        ("type", Mp::from("BlockStored")),
        ("block_hashes", Mp::Array(ks)),
        ("parent_block_hash", Mp::Nil),
        (
            "token_ids",
            Mp::Array(tokens.iter().map(|t| Mp::from(*t)).collect()),
        ),
        ("block_size", Mp::from(16)),
        ("lora_id", Mp::Nil),
        ("medium", Mp::from("GPU")),
    ])
}

/// A BlockRemoved event.
pub fn removed(keys: &[u64]) -> Mp {
    map(vec![
        ("type", Mp::from("BlockRemoved")),
        (
            "block_hashes",
            Mp::Array(keys.iter().map(|k| Mp::from(*k)).collect()),
        ),
        ("medium", Mp::from("GPU")),
    ])
}

/// A ZMQ PUB bound on 127.0.0.1 (port 0 = any), with its own sequence counter.
pub struct Publisher {
    pub sock: PubSocket,
    pub port: u16,
    pub seq: u64,
    pub topic: &'static str,
}

impl Publisher {
    pub async fn bind(port: u16) -> Option<Publisher> {
        Publisher::bind_on("127.0.0.1", port).await
    }

    /// Binds on another loopback address (each vLLM endpoint publishes on its own IP).
    pub async fn bind_on(ip: &str, port: u16) -> Option<Publisher> {
        let mut sock = PubSocket::new();
        let ep = sock.bind(&format!("tcp://{ip}:{port}")).await.ok()?;
        let port = match ep {
            zeromq::Endpoint::Tcp(_, p) => p,
            _ => return None,
        };
        Some(Publisher {
            sock,
            port,
            seq: 0,
            topic: "",
        })
    }

    /// Sends `[topic, seq, payload]` with an explicit sequence number.
    pub async fn send_seq(&mut self, seq: u64, payload: &[u8]) {
        let m = ZmqMessage::try_from(vec![
            Bytes::from(self.topic.as_bytes().to_vec()),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ])
        .unwrap();
        self.sock.send(m).await.unwrap();
    }

    /// Sends with the next sequence number.
    pub async fn send(&mut self, payload: &[u8]) {
        let s = self.seq;
        self.seq += 1;
        self.send_seq(s, payload).await;
    }
}

/// Binds `n` publishers on consecutive ports (data-parallel ranks); retries a few bases.
pub async fn bind_consecutive(n: u16) -> Vec<Publisher> {
    for attempt in 0..50u16 {
        let base = 20000 + (std::process::id() as u16 % 2000) * 10 + attempt * 37;
        let mut pubs = Vec::new();
        for i in 0..n {
            match Publisher::bind(base + i).await {
                Some(p) => pubs.push(p),
                None => break,
            }
        }
        if pubs.len() == n as usize {
            return pubs;
        }
    }
    panic!("no {n} consecutive free ports");
}

/// Publishes `probe` (a batch storing `key`) until the service's inventory for `(rule, ep)` shows
/// `key`: the readiness check for PUB/SUB (messages before the subscription lands are dropped).
pub async fn publish_until_seen(
    svc: &Service,
    p: &mut Publisher,
    rule: &str,
    ep: usize,
    key: u64,
    probe: &[u8],
) {
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        p.send(probe).await;
        if svc.inventory(rule, ep).await.contains(&key) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("subscriber never saw the probe; stderr:\n{}", svc.stderr());
}

/// Loads a golden vector file from shared/tests/vectors.
pub fn vectors(name: &str) -> Value {
    let p = format!(
        "{}/../shared/tests/vectors/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

pub fn hx(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().unwrap()).unwrap()
}

/// A real `redis-server` on a free port, persisting nothing, killed on drop.
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

impl Redis {
    pub fn start() -> Redis {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut r = Redis {
            child: None,
            port,
            dir: tempdir("redis"),
        };
        r.restart();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port, empty, and waits until it answers PING.
    pub fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (install it: apt-get install redis-server)");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if self.cli(&["PING"]).trim() == "PONG" {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not answer PING", self.port);
    }

    /// SIGKILL (no goodbye to clients), then reaped.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// One `redis-cli` command's output ("" when the server is down).
    pub fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
