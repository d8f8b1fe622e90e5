//! Harness for the service's integration tests: spawn the built binary on 127.0.0.1 port 0, read
//! the address it prints, talk HTTP, publish engine events over real ZMQ, stop the process.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unused_imports
)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use rmpv::Value as Mp;
use serde_json::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

pub use kvroute_test_support::{free_port, Redis};
use kvroute_test_support::{wait_until, Poll, Probe, TempDir};

pub const TOKEN: &str = "s3cret-token";
/// Env value meaning "remove this variable" (the harness sets LLB_KV_NONE_HASH_SEED=0 by default,
/// as the golden vectors were produced with PYTHONHASHSEED=0).
pub const UNSET: &str = "<unset>";

/// A running `kvroute-inventory serve`.
pub struct Service {
    pub child: Child,
    pub base: String,
    /// The endpoint picker's address, when started with `--epp-listen`.
    pub epp: Option<String>,
    pub dir: PathBuf,
    pub http: reqwest::Client,
}

/// A fresh temp directory for one test, left in place afterwards (its logs explain a failure;
/// a [`Service`]'s own directory is removed when it drops in a passing test).
pub fn tempdir(tag: &str) -> PathBuf {
    TempDir::new(&format!("inv-{tag}")).unwrap().keep()
}

impl Service {
    /// Starts the service with `rules` (a JSON list) and extra env vars; waits for its address.
    pub fn start(tag: &str, rules: &Value, env: &[(&str, &str)]) -> Service {
        Service::start_with_args(tag, rules, env, &[])
    }

    /// [`Service::start`] with extra `serve` arguments.
    pub fn start_with_args(
        tag: &str,
        rules: &Value,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Service {
        Service::start_program(
            env!("CARGO_BIN_EXE_kvroute-inventory").as_ref(),
            tag,
            (rules, env, args),
        )
    }

    /// [`Service::start_with_args`] of another build of the service (benches compare builds).
    pub fn start_program(
        program: &std::path::Path,
        tag: &str,
        (rules, env, args): (&Value, &[(&str, &str)], &[&str]),
    ) -> Service {
        let dir = tempdir(tag);
        let cfg = dir.join("rules.json");
        std::fs::write(&cfg, serde_json::to_string(rules).unwrap()).unwrap();
        let tok = dir.join("token");
        std::fs::write(&tok, format!("{TOKEN}\n")).unwrap();
        std::fs::create_dir_all(dir.join("tokenizers")).unwrap();
        let mut cmd = Command::new(program);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&cfg)
            .arg("--auth-token-file")
            .arg(&tok)
            .arg("--tokenizer-dir")
            .arg(&dir)
            .args(args)
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
        // Read the printed addresses: the endpoint picker's (with --epp-listen) comes before the
        // HTTP listener's; the thread keeps draining stdout so the child never blocks on it.
        let (epp_tx, epp_rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        let (line_tx, line_rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(a) = line.strip_prefix("kvroute-inventory epp listening on ") {
                    let _ = epp_tx.send(a.to_owned());
                }
                if let Some(a) = line.strip_prefix("kvroute-inventory listening on ") {
                    let _ = line_tx.send(a.to_owned());
                }
            }
        });
        let addr = match line_rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => a,
            Err(e) => {
                let _ = child.kill();
                panic!(
                    "service did not start ({e}):\n{}",
                    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
                )
            }
        };
        let epp = epp_rx.try_recv().ok();
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
            epp,
            dir,
            http: http.build().unwrap(),
        }
    }

    /// `method path` without a body, with `token` as the bearer token if given.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
    ) -> reqwest::Response {
        let mut r = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send().await.unwrap()
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.call(reqwest::Method::GET, path, None).await;
        (r.status().as_u16(), r.text().await.unwrap())
    }

    /// `DELETE path`: its status.
    pub async fn delete(&self, path: &str, token: Option<&str>) -> u16 {
        let r = self.call(reqwest::Method::DELETE, path, token).await;
        r.status().as_u16()
    }

    pub async fn get_json(&self, path: &str) -> Value {
        let (s, b) = self.get(path).await;
        assert_eq!(s, 200, "{path}: {b}");
        serde_json::from_str(&b).unwrap()
    }

    /// `POST path` with `body` as `content_type`: the status and the answer (JSON or text).
    pub async fn post_bytes(&self, path: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        let s = r.status().as_u16();
        let t = r.text().await.unwrap();
        (s, serde_json::from_str(&t).unwrap_or(Value::String(t)))
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

    /// Posts `rule` (a rule in loxilb's JSON shape) with the token: (status, answer).
    pub async fn post_rule(&self, rule: &Value) -> (u16, Value) {
        self.post(
            "/netlox/v1/config/loadbalancer",
            &rule.to_string(),
            Some(TOKEN),
        )
        .await
    }

    pub async fn metrics(&self) -> String {
        self.get("/metrics").await.1
    }

    /// Asserts every line of `want` in the current metrics ([`assert_metrics`]).
    pub async fn assert_metrics(&self, want: &str) {
        assert_metrics(&self.metrics().await, want);
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
    pub async fn wait_for(&self, what: &str, secs: u64, f: impl AsyncFnMut() -> bool) {
        if let Err(e) = wait_until(what, Duration::from_secs(secs), f).await {
            panic!("{e}; stderr:\n{}", self.stderr());
        }
    }

    /// Waits (at most 10 s) until the metric `series` reads `want`.
    pub async fn wait_metric(&self, series: &str, want: f64) {
        self.wait_for(series, 10, async || {
            metric(&self.metrics().await, series) == Some(want)
        })
        .await;
    }

    /// Waits (at most 10 s) until the inventory of endpoint `ep` of `rule` is exactly `want`.
    pub async fn wait_inventory(&self, what: &str, (rule, ep): (&str, usize), want: &[u64]) {
        self.wait_for(what, 10, async || self.inventory(rule, ep).await == want)
            .await;
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    /// SIGTERM, then the exit status (bounded wait; killed if it does not exit).
    pub fn terminate(&mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let exit = Poll::new("the service to exit", Duration::from_secs(15))
            .every(Duration::from_millis(20))
            .until_blocking(|| {
                Ok(match self.child.try_wait() {
                    Ok(Some(st)) => Probe::Ready(st.code()),
                    _ => Probe::Pending(String::new()),
                })
            });
        if exit.is_err() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        exit.ok().flatten()
    }
}

impl Drop for Service {
    /// Kills the service if it still runs; removes its directory unless the test is failing
    /// (then the directory stays, with the service's `stderr.log`).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A test CA and a leaf certificate for 127.0.0.1 signed by it (rustls refuses a CA as end
/// entity), made with `openssl` in `d`: (CA, leaf, leaf key), PEM files.
pub fn test_ca(d: &std::path::Path) -> (PathBuf, PathBuf, PathBuf) {
    let (ca, ca_key, cert, key) = (
        d.join("ca.pem"),
        d.join("ca.key"),
        d.join("cert.pem"),
        d.join("key.pem"),
    );
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let run = |args: Vec<&std::ffi::OsStr>| {
        let st = std::process::Command::new("openssl")
            .args(args)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl");
        assert!(st.success());
    };
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let mut a: Vec<&std::ffi::OsStr> = vec![os("req"), os("-x509")];
    a.extend(ec.iter().map(|s| os(s)));
    a.extend([
        os("-days"),
        os("1"),
        os("-subj"),
        os("/CN=kvroute-test-ca"),
        os("-keyout"),
        ca_key.as_os_str(),
        os("-out"),
        ca.as_os_str(),
    ]);
    run(a);
    let csr = d.join("leaf.csr");
    let mut a: Vec<&std::ffi::OsStr> = vec![os("req")];
    a.extend(ec.iter().map(|s| os(s)));
    a.extend([
        os("-subj"),
        os("/CN=127.0.0.1"),
        os("-keyout"),
        key.as_os_str(),
        os("-out"),
        csr.as_os_str(),
    ]);
    run(a);
    let ext = d.join("ext.cnf");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    let serial = d.join("ca.srl");
    run(vec![
        os("x509"),
        os("-req"),
        os("-in"),
        csr.as_os_str(),
        os("-CA"),
        ca.as_os_str(),
        os("-CAkey"),
        ca_key.as_os_str(),
        os("-CAserial"),
        serial.as_os_str(),
        os("-CAcreateserial"),
        os("-days"),
        os("1"),
        os("-extfile"),
        ext.as_os_str(),
        os("-out"),
        cert.as_os_str(),
    ]);
    (ca, cert, key)
}

/// Serves `app` on 127.0.0.1 and a kernel-picked port until the task is aborted.
pub async fn serve(app: axum::Router) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (port, task)
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

/// Asserts every line of `want` ("series value"; blank lines and `#` comments skipped) with
/// [`assert_metric`].
#[track_caller]
pub fn assert_metrics(text: &str, want: &str) {
    let lines = want.lines().map(str::trim);
    for line in lines.filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        assert_metric(text, series, value.parse().unwrap());
    }
}

/// Asserts that no line of the metrics `text` starts with `name` (printed whole otherwise).
#[track_caller]
pub fn assert_absent(text: &str, name: &str) {
    assert!(text.lines().all(|l| !l.starts_with(name)), "{text}");
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

/// [`stored`] on `medium` (`"CPU"`, `"STORAGE"`, ...), without tokens.
pub fn stored_on(keys: &[u64], medium: &str) -> Mp {
    with_medium(stored(keys, &[], false), medium)
}

/// [`removed`] on `medium`.
pub fn removed_on(keys: &[u64], medium: &str) -> Mp {
    with_medium(removed(keys), medium)
}

fn with_medium(event: Mp, medium: &str) -> Mp {
    match event {
        Mp::Map(fields) => Mp::Map(
            fields
                .into_iter()
                .map(|(k, v)| match k.as_str() == Some("medium") {
                    true => (k, Mp::from(medium)),
                    false => (k, v),
                })
                .collect(),
        ),
        other => other,
    }
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

    /// Connects to a SUB the inventory binds (`kvZmqBind`), as vLLM's publisher does when its
    /// endpoint names a host. The crate's connect retries until something listens: bounded here.
    pub async fn connect(addr: &str) -> Publisher {
        let port = addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap();
        let mut sock = PubSocket::new();
        tokio::time::timeout(Duration::from_secs(20), sock.connect(addr))
            .await
            .unwrap_or_else(|_| panic!("the inventory never listened on {addr}"))
            .unwrap();
        Publisher {
            sock,
            port,
            seq: 0,
            topic: "",
        }
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

/// One publisher on each of `ips`, all on the same port (each endpoint publishes on its own
/// address); tries ports from `base` until one is free on every address. Returns them and the port.
pub async fn bind_same_port(ips: &[&str], base: u16) -> (Vec<Publisher>, u16) {
    for attempt in 0..50u16 {
        let port = base + (std::process::id() as u16 % 1000) * 7 + attempt * 13;
        let mut ps = Vec::new();
        for ip in ips {
            if let Some(p) = Publisher::bind_on(ip, port).await {
                ps.push(p);
            }
        }
        if ps.len() == ips.len() {
            return (ps, port);
        }
    }
    panic!("no free port on every endpoint address");
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
    let seen = Poll::new("the subscriber to see the probe", Duration::from_secs(20))
        .every(Duration::from_millis(50))
        .until(async || {
            p.send(probe).await;
            Ok(Probe::from(svc.inventory(rule, ep).await.contains(&key)))
        })
        .await;
    if let Err(e) = seen {
        panic!("{e}; stderr:\n{}", svc.stderr());
    }
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

/// vLLM's golden keys for tokens 0..63 (sha256_cbor, seed "0", block 16) and those tokens.
pub fn vllm_range64() -> (Vec<u64>, Vec<u32>) {
    let v = vectors("vllm-0.33.0.json");
    let hv = v["hash_vectors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["algo"] == "sha256_cbor" && h["PYTHONHASHSEED"] == "0")
        .unwrap();
    let keys = hv["sequences"]["range64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["event_key_int_u64"].as_u64().unwrap())
        .collect();
    (keys, (0..64).collect())
}

/// The median of `v` (sorted in place; the upper of the middle two for an even count).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `median (min-max)` of `v`, each with `digits` decimals: the benches' figure over rounds.
pub fn spread(v: &[f64], digits: usize) -> String {
    let mut s = v.to_vec();
    let m = median(&mut s);
    format!(
        "{m:.digits$} ({:.digits$}-{:.digits$})",
        s[0],
        s[s.len() - 1]
    )
}

/// CPU seconds (user + system) `svc` has used so far, from /proc.
pub fn cpu_secs(svc: &Service) -> f64 {
    pid_cpu_secs(svc.child.id())
}

/// CPU seconds (user + system) process `pid` has used so far.
pub fn pid_cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

/// Publishes `keys` on the rule's endpoint 0 and waits until the index holds them.
pub async fn seed_ep0(svc: &Service, p: &mut Publisher, keys: &[u64]) {
    publish_until_seen(
        svc,
        p,
        "1",
        0,
        keys[0],
        &batch(vec![stored(keys, &[], false)]),
    )
    .await;
}
