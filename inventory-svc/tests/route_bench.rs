//! `/v1/route` benchmark (ignored; `scripts/bench-route.sh` runs it in release and writes
//! docs/bench-route.md): route queries/s and service CPU per query at 512 keys, the service alone
//! on CPU 0 and wrk (1 thread, 8 connections) on CPU 1, a hit against a miss, in every body
//! encoding the service accepts. Rounds are interleaved (each round runs every case, in an order
//! rotated by the round), so drift of the machine spreads over all cases alike.
//!
//! A hit asks for 512 keys endpoint 0 holds. A miss asks for 512 keys nobody holds, its first
//! key new in every request (a new conversation each time: the speculative credit of one miss
//! never turns the next into a hit).
//! Measurements, not assertions: only that the answers are what the case says is checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::fmt::Write as _;
use std::process::Command;

use common::{bind_same_port, pid_cpu_secs, rule, seed_ep0, spread, Publisher, Service};
use serde_json::json;

const RULE: &str = "10.0.0.1:8080";
const IPS: [&str; 4] = ["127.0.0.81", "127.0.0.82", "127.0.0.83", "127.0.0.84"];
const KEYS: u64 = 512;

fn n(var: &str, default: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Keys spread like real hashes.
fn key(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555
}

/// How a case's bodies are encoded.
#[derive(Clone, Copy, PartialEq)]
enum Form {
    Json,
    Binary,
}

/// One measured case: which service, its wrk script and the reason its answers must carry.
struct Case {
    name: String,
    svc: usize,
    lua: String,
    hit: bool,
}

/// A Lua string literal holding `bytes` exactly.
fn lua_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2 + 2);
    out.push('"');
    for &b in bytes {
        match b {
            b'"' | b'\\' => {
                out.push('\\');
                out.push(b as char);
            }
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\{b:03}")),
        }
    }
    out.push('"');
    out
}

/// Positions of a miss's keys that change in every request: the first (the index lookup stops
/// there) and every position the placement memory samples (3, 7, 15, ... and the last), so no
/// miss recalls an earlier one. The other keys are the same in every miss; no lookup reads them.
fn varying() -> Vec<usize> {
    let mut v = vec![0];
    v.extend(
        (2..)
            .map(|k| (1usize << k) - 1)
            .take_while(|&i| i < KEYS as usize),
    );
    v.push(KEYS as usize - 1);
    v.dedup();
    v
}

/// The wrk script of one case. A hit is one fixed body; a miss is fixed segments with fresh keys
/// at the [`varying`] positions (a per-run random base plus a counter).
fn script(form: Form, hit: bool) -> String {
    let held: Vec<u64> = (0..KEYS).map(key).collect();
    let other: Vec<u64> = (0..KEYS).map(|i| key(1_000_000 + i)).collect();
    let vary = varying();
    // A marker key at every varying position splits the body into its fixed segments.
    const MARK: u64 = 0xA5A5_A5A5_A5A5_A5A5;
    let mut marked = other.clone();
    for &i in &vary {
        marked[i] = MARK;
    }
    let (ct, full, body, mark, value) = match form {
        Form::Json => {
            let q = |keys: &[u64]| {
                let ks: Vec<String> = keys.iter().map(u64::to_string).collect();
                format!(
                    r#"{{"rule":"{RULE}","token_count":{},"keys":[{}]}}"#,
                    KEYS * 16,
                    ks.join(",")
                )
                .into_bytes()
            };
            (
                "application/json",
                q(&held),
                q(&marked),
                MARK.to_string().into_bytes(),
                "string.format(\"%d\",x)",
            )
        }
        Form::Binary => {
            let q = |keys: &[u64]| {
                kvroute_core::wire::binary::encode(kvroute_core::wire::RouteRequest {
                    rule: RULE.into(),
                    token_count: (KEYS * 16) as u32,
                    keys: keys
                        .iter()
                        .map(|&k| kvroute_core::wire::WireKey::Unsigned(k))
                        .collect(),
                    ..Default::default()
                })
            };
            (
                kvroute_core::wire::binary::CONTENT_TYPE,
                q(&held),
                q(&marked),
                MARK.to_le_bytes().to_vec(),
                "le8(x)",
            )
        }
    };
    let mut lua = format!("wrk.method=\"POST\"\nwrk.headers[\"content-type\"]=\"{ct}\"\n");
    if hit {
        lua += &format!("wrk.body={}\n", lua_bytes(&full));
        return lua;
    }
    let mut segs = Vec::new();
    let mut rest = &body[..];
    while let Some(at) = rest.windows(mark.len()).position(|w| w == mark) {
        segs.push(lua_bytes(&rest[..at]));
        rest = &rest[at + mark.len()..];
    }
    segs.push(lua_bytes(rest));
    assert_eq!(segs.len(), vary.len() + 1);
    lua += &format!(
        "local segs={{{}}}\nlocal n=0\nlocal base=math.random(1,2000000)*1000000000\n\
         local function le8(x) local t={{}} for i=1,8 do t[i]=string.char(x%256) x=math.floor(x/256) end return table.concat(t) end\n\
         request=function()\n n=n+1\n local p={{segs[1]}}\n for j=2,#segs do local x=base+n*64+j p[#p+1]={value} p[#p+1]=segs[j] end\n\
         return wrk.format(nil,nil,nil,table.concat(p))\nend\n",
        segs.join(",")
    );
    lua
}

/// `(requests/s, service CPU µs per request)` of one wrk run against `pid`.
fn measure(pid: u32, url: &str, lua: &std::path::Path, secs: u64) -> (f64, f64) {
    let c0 = pid_cpu_secs(pid);
    let out = Command::new("taskset")
        .args(["-c", "1", "wrk", "-t1", "-c8", &format!("-d{secs}s"), "-s"])
        .arg(lua)
        .arg(url)
        .output()
        .expect("wrk (apt-get install wrk)");
    let c1 = pid_cpu_secs(pid);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("Non-2xx"),
        "wrk saw errors:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rps: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Requests/sec in wrk's output:\n{text}"));
    (rps, (c1 - c0) / (rps * secs as f64) * 1e6)
}

/// Decisions with `reason` so far, every tier.
fn decisions(metrics: &str, reason: &str) -> f64 {
    let label = format!(r#"reason="{reason}""#);
    metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_route_decisions_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Starts one service pinned to CPU 0 with endpoint 0 holding the hit keys (the publishers stay
/// open as long as the service runs).
async fn service(program: Option<&std::path::Path>, tag: &str) -> (Service, Vec<Publisher>) {
    let (mut pubs, port) = bind_same_port(&IPS, 43000).await;
    let eps: Vec<(String, u16)> = IPS.iter().map(|ip| (ip.to_string(), 9)).collect();
    let rules = json!([rule(8080, "vllm", port, &eps, json!({}))]);
    let env = [("RUST_LOG", "warn")];
    let svc = match program {
        Some(p) => Service::start_program(p, tag, (&rules, &env, &[])),
        None => Service::start(tag, &rules, &env),
    };
    let held: Vec<u64> = (0..KEYS).map(key).collect();
    seed_ep0(&svc, &mut pubs[0], &held).await;
    let pinned = Command::new("taskset")
        .args(["-a", "-p", "-c", "0", &svc.child.id().to_string()])
        .output()
        .expect("taskset");
    assert!(pinned.status.success(), "taskset: {pinned:?}");
    (svc, pubs)
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "benchmark: scripts/bench-route.sh"]
async fn route_queries_per_core_hit_and_miss() {
    let rounds = n("KVROUTE_BENCH_ROUNDS", 5) as usize;
    let secs = n("KVROUTE_BENCH_SECS", 5);
    // This build, and optionally an earlier one (JSON only) measured beside it.
    let mut builds: Vec<(String, Service, Vec<Form>)> = Vec::new();
    let mut publishers = Vec::new();
    if let Ok(bin) = std::env::var("KVROUTE_BENCH_BASELINE_BIN") {
        let label = std::env::var("KVROUTE_BENCH_BASELINE_LABEL").unwrap_or_else(|_| bin.clone());
        let (svc, pubs) = service(Some(bin.as_ref()), "route-bench-baseline").await;
        publishers.push(pubs);
        builds.push((label, svc, vec![Form::Json]));
    }
    let (svc, pubs) = service(None, "route-bench").await;
    publishers.push(pubs);
    builds.push(("this build".into(), svc, vec![Form::Json, Form::Binary]));
    let mut cases = Vec::new();
    for (b, (label, _, forms)) in builds.iter().enumerate() {
        for &form in forms {
            for hit in [true, false] {
                let f = if form == Form::Json { "JSON" } else { "binary" };
                let h = if hit { "hit" } else { "miss" };
                cases.push(Case {
                    name: format!("{label}, {f}, {h}"),
                    svc: b,
                    lua: script(form, hit),
                    hit,
                });
            }
        }
    }
    // `KVROUTE_BENCH_ONLY`: only the cases whose name contains it (for a profiler run).
    if let Ok(only) = std::env::var("KVROUTE_BENCH_ONLY") {
        cases.retain(|c| c.name.contains(&only));
    }
    let scripts: Vec<std::path::PathBuf> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let p = builds[c.svc].1.dir.join(format!("case{i}.lua"));
            std::fs::write(&p, &c.lua).unwrap();
            p
        })
        .collect();
    let url = |c: &Case| format!("{}/v1/route", builds[c.svc].1.base);
    // Every case once, checked: its answers carry the reason it is named after.
    for (i, c) in cases.iter().enumerate() {
        let svc = &builds[c.svc].1;
        let reason = if c.hit { "hit" } else { "miss_no_overlap" };
        let before = decisions(&svc.metrics().await, reason);
        let (q, _) = measure(svc.child.id(), &url(c), &scripts[i], 1);
        let grew = decisions(&svc.metrics().await, reason) - before;
        assert!(
            grew >= q * 0.9,
            "{}: {grew} {reason} answers of ~{q:.0} queries; stderr:\n{}",
            c.name,
            svc.stderr()
        );
    }
    let mut rps = vec![Vec::new(); cases.len()];
    let mut cpu = vec![Vec::new(); cases.len()];
    for r in 0..rounds {
        for j in 0..cases.len() {
            let i = (j + r) % cases.len();
            let c = &cases[i];
            let (q, u) = measure(builds[c.svc].1.child.id(), &url(c), &scripts[i], secs);
            eprintln!("round {r}: {}: {q:.0} q/s, {u:.1} us CPU per query", c.name);
            rps[i].push(q);
            cpu[i].push(u);
        }
    }

    let mut t = String::new();
    writeln!(
        t,
        "| case | queries/s | service CPU µs per query | queries/s per core (1e6 / CPU µs) |"
    )
    .unwrap();
    writeln!(t, "|---|---|---|---|").unwrap();
    for (i, c) in cases.iter().enumerate() {
        let per_core: Vec<f64> = cpu[i].iter().map(|u| 1e6 / u).collect();
        writeln!(
            t,
            "| {} | {} | {} | {} |",
            c.name,
            spread(&rps[i], 0),
            spread(&cpu[i], 1),
            spread(&per_core, 0)
        )
        .unwrap();
    }
    writeln!(t).unwrap();
    writeln!(t, "Paired ratios of CPU per query (median and range over the {rounds} rounds; each ratio compares two cases of the same round):").unwrap();
    writeln!(t).unwrap();
    let find = |name: &str| cases.iter().position(|c| c.name == name);
    let ratio = |t: &mut String, a: usize, b: usize| {
        let r: Vec<f64> = (0..rounds).map(|k| cpu[a][k] / cpu[b][k]).collect();
        writeln!(
            t,
            "- {} / {}: x{}",
            cases[a].name,
            cases[b].name,
            spread(&r, 2)
        )
        .unwrap();
    };
    // A miss against the hit of the same build and form.
    for (i, c) in cases.iter().enumerate() {
        if let Some(h) = c
            .name
            .strip_suffix(", miss")
            .and_then(|f| find(&format!("{f}, hit")))
        {
            ratio(&mut t, i, h);
        }
    }
    // This build's binary cases against its JSON ones, and this build against the baseline.
    for (i, c) in cases.iter().enumerate() {
        if let Some(j) = find(&c.name.replace(", binary,", ", JSON,")).filter(|&j| j != i) {
            ratio(&mut t, i, j);
        }
    }
    if let Some(base) = builds
        .iter()
        .find(|b| b.0 != "this build")
        .map(|b| b.0.clone())
    {
        for (i, c) in cases.iter().enumerate() {
            let theirs = c
                .name
                .replace("this build", &base)
                .replace(", binary,", ", JSON,");
            if let Some(j) = find(&theirs).filter(|&j| j != i) {
                ratio(&mut t, i, j);
            }
        }
    }
    println!("{t}");
    if let Ok(path) = std::env::var("KVROUTE_BENCH_OUT") {
        std::fs::write(path, &t).unwrap();
    }
}
