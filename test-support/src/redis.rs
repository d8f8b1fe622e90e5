//! A real `redis-server` for replication tests: a free port, no persistence, killed on drop; and
//! a real Redis Cluster of such servers ([`RedisCluster`]).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::{free_port, wait_until_blocking, ChildGuard, Poll, Probe, TempDir};

/// A `redis-server` on 127.0.0.1 and a free port, persisting nothing, killed on drop.
pub struct Redis {
    child: Option<Child>,
    /// Where it listens.
    pub port: u16,
    dir: TempDir,
}

impl Redis {
    /// Starts one and waits until it answers PING.
    pub fn start() -> Result<Redis> {
        let mut r = Redis {
            child: None,
            port: free_port()?,
            dir: TempDir::new("redis")?,
        };
        r.restart()?;
        Ok(r)
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops it if it runs, starts it again on the same port, empty, and waits until the new
    /// process itself answers (`INFO server` names its pid: a server left on the port does not
    /// count).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("redis-server (install it: apt-get install redis-server)")?;
        let pid = child.id().to_string();
        self.child = Some(child);
        let what = format!("redis-server on port {} (pid {pid}) to answer", self.port);
        wait_until_blocking(&what, Duration::from_secs(10), || {
            field(&self.cli(&["INFO", "server"]), "process_id").as_deref() == Some(pid.as_str())
        })
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
        cli_port(self.port, args)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster on 127.0.0.1: `masters` primaries with one replica each (`redis-server
/// --cluster-enabled yes`, joined by `redis-cli --cluster create --cluster-replicas 1`), every
/// node on free ports (client and bus), persisting nothing; every node killed on drop.
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    dir: TempDir,
}

struct ClusterNode {
    child: Option<ChildGuard>,
    port: u16,
}

/// A slot migration opened by [`RedisCluster::begin_move`], closed by
/// [`RedisCluster::finish_move`].
#[derive(Debug)]
pub struct SlotMove {
    key: String,
    slot: String,
    from: usize,
    to: usize,
    to_id: String,
}

/// A bound on each step of bringing a cluster up or over (the test's own deadlines are shorter).
const CLUSTER_STEP: Duration = Duration::from_secs(30);

impl RedisCluster {
    /// Starts `2 × masters` nodes, creates the cluster and waits until every node reports
    /// `cluster_state:ok` and every primary has its replica in sync. `node_timeout_ms` is
    /// `cluster-node-timeout`: how long a primary must be unreachable before its replica is
    /// promoted.
    pub fn start(masters: usize, node_timeout_ms: u64) -> Result<RedisCluster> {
        anyhow::ensure!(masters >= 3, "a Redis Cluster needs at least 3 primaries");
        let dir = TempDir::new("redis-cluster")?;
        let mut c = RedisCluster {
            nodes: Vec::new(),
            dir,
        };
        for _ in 0..2 * masters {
            let node = c.start_node(node_timeout_ms)?;
            c.nodes.push(node);
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &c.nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let log = c.dir.path().join("create.log");
        let mut creating = ChildGuard::spawn("redis-cli --cluster create", create, &log)?;
        let created = Poll::new("redis-cli --cluster create to finish", CLUSTER_STEP)
            .until_blocking(|| {
                Ok(creating
                    .exited()
                    .map_or(Probe::Pending(String::new()), Probe::Ready))
            })
            .with_context(|| creating.log_tail(20))?;
        anyhow::ensure!(
            created.success(),
            "redis-cli --cluster create: {created}\n{}",
            creating.log_tail(20)
        );
        let all: Vec<usize> = (0..c.nodes.len()).collect();
        c.wait_ok(&all)?;
        Poll::new("every primary's replica in sync", CLUSTER_STEP).until_blocking(|| {
            let primaries = c.masters();
            let synced = primaries.len() == masters
                && primaries.iter().all(|&m| {
                    c.cli(m, &["INFO", "replication"])
                        .lines()
                        .any(|l| l.starts_with("slave0:") && l.contains("state=online"))
                });
            Ok(Probe::from(synced))
        })?;
        Ok(c)
    }

    /// Starts one cluster node on free ports and waits until it answers PING. A free port can be
    /// taken by another process before the node binds it (an outgoing connection of a test running
    /// beside this one), so a node that exits or stays silent is started again on new ports, up to
    /// three times; the error names each attempt with its log tail.
    fn start_node(&self, node_timeout_ms: u64) -> Result<ClusterNode> {
        let mut attempts = Vec::new();
        for _ in 0..3 {
            let (port, bus) = (free_port()?, free_port()?);
            if port == bus {
                continue;
            }
            let data = self.dir.path().join(port.to_string());
            std::fs::create_dir_all(&data)?;
            let mut cmd = Command::new("redis-server");
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-port", &bus.to_string()])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", &node_timeout_ms.to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(&data);
            let log = data.join("redis.log");
            let mut child = ChildGuard::spawn(&format!("redis-server :{port}"), cmd, &log)
                .context("redis-server (install it: apt-get install redis-server)")?;
            let up = Poll::new(
                format!("cluster node {port} to answer PING"),
                Duration::from_secs(10),
            )
            .until_blocking(|| {
                if child.exited().is_some() {
                    return Ok(Probe::Ready(false));
                }
                Ok(match cli_port(port, &["PING"]).trim() == "PONG" {
                    true => Probe::Ready(true),
                    false => Probe::Pending(String::new()),
                })
            });
            match up {
                Ok(true) => {
                    return Ok(ClusterNode {
                        child: Some(child),
                        port,
                    })
                }
                Ok(false) => attempts.push(format!(":{port} exited\n{}", child.log_tail(10))),
                Err(e) => attempts.push(format!(":{port}: {e}\n{}", child.log_tail(10))),
            }
        }
        anyhow::bail!(
            "no cluster node came up in 3 attempts:\n{}",
            attempts.join("\n")
        )
    }

    /// `redis://127.0.0.1:<port>` of every node, comma-separated (seed nodes for a client).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Client port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].port
    }

    /// Indexes of the nodes still running (not killed).
    fn running(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].child.is_some())
    }

    /// Indexes of the running nodes that are primaries serving slots.
    pub fn masters(&self) -> Vec<usize> {
        self.running()
            .filter(|&i| self.cli(i, &["ROLE"]).lines().next() == Some("master"))
            .filter(|&i| {
                // A restarted or demoted primary with no slots serves nothing.
                self.cli(i, &["CLUSTER", "NODES"]).lines().any(|l| {
                    l.contains("myself") && l.contains("master") && l.split(' ').count() > 8
                })
            })
            .collect()
    }

    /// The running node that is the primary of `key`'s slot, as the cluster reports it.
    pub fn master_of(&self, key: &str) -> Option<usize> {
        let live = self.running().next()?;
        self.master_seen_by(live, key)
    }

    /// The running node that node `seer` names as the primary of `key`'s slot.
    fn master_seen_by(&self, seer: usize, key: &str) -> Option<usize> {
        let slot: u16 = self
            .cli(seer, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .ok()?;
        let nodes = self.cli(seer, &["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let serves = f[8..].iter().any(|r| match r.split_once('-') {
                Some((a, b)) => {
                    a.parse::<u16>().is_ok_and(|a| a <= slot)
                        && b.parse::<u16>().is_ok_and(|b| slot <= b)
                }
                None => r.parse::<u16>().is_ok_and(|s| s == slot),
            });
            let port = f[1]
                .split(['@', ','])
                .next()
                .and_then(|a| a.rsplit_once(':'));
            if serves {
                let port: u16 = port.and_then(|(_, p)| p.parse().ok())?;
                return self.running().find(|&i| self.nodes[i].port == port);
            }
        }
        None
    }

    /// Moves `key`'s slot, with its keys, to primary `to` as `redis-cli --cluster reshard` does
    /// ([`RedisCluster::begin_move`], then [`RedisCluster::finish_move`]), and waits until every
    /// running node names `to` as its primary. A client that knew the old owner keeps its slot map
    /// until a reply tells it otherwise.
    pub fn move_slot(&self, key: &str, to: usize) -> Result<()> {
        let m = self.begin_move(key, to)?;
        self.finish_move(m)
    }

    /// Opens the migration of `key`'s slot to primary `to` and moves its keys: `IMPORTING` on
    /// `to`, `MIGRATING` on the owner, `MIGRATE` of every key. Until [`RedisCluster::finish_move`]
    /// the owner answers `ASK` (to `to`) for the moved keys, and `to` serves a command for them
    /// only right after an `ASKING`.
    pub fn begin_move(&self, key: &str, to: usize) -> Result<SlotMove> {
        let from = self
            .master_of(key)
            .with_context(|| format!("no primary serves {key}"))?;
        anyhow::ensure!(from != to, "node {to} already serves {key}");
        let slot = self.cli(to, &["CLUSTER", "KEYSLOT", key]).trim().to_owned();
        let id = |i: usize| self.cli(i, &["CLUSTER", "MYID"]).trim().to_owned();
        let (from_id, to_id) = (id(from), id(to));
        self.ok(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])?;
        self.ok(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])?;
        let port = self.port(to).to_string();
        // Bounded: a slot holds the few keys a test writes, 100 per round.
        for _ in 0..1000 {
            let keys = self.cli(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(&keys);
            self.ok(from, &args)?;
        }
        Ok(SlotMove {
            key: key.to_owned(),
            slot,
            from,
            to,
            to_id,
        })
    }

    /// Closes a migration: the new owner set on `to`, on the old owner, then on every other
    /// primary; waits until every running node names `to` as the slot's primary.
    pub fn finish_move(&self, m: SlotMove) -> Result<()> {
        let SlotMove {
            key,
            slot,
            from,
            to,
            to_id,
        } = m;
        for p in [to, from].into_iter().chain(self.masters()) {
            self.ok(p, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id])?;
        }
        let live: Vec<usize> = self.running().collect();
        Poll::new(
            format!("every node to name node {to} for {key}"),
            CLUSTER_STEP,
        )
        .until_blocking(|| {
            let views: Vec<Option<usize>> =
                live.iter().map(|&i| self.master_seen_by(i, &key)).collect();
            Ok(match views.iter().all(|v| *v == Some(to)) {
                true => Probe::Ready(()),
                false => Probe::Pending(format!("{views:?}")),
            })
        })
    }

    /// `redis-cli` on node `i`, which must answer `OK`.
    fn ok(&self, i: usize, args: &[&str]) -> Result<()> {
        let out = self.cli(i, args);
        anyhow::ensure!(out.trim() == "OK", "{args:?} on node {i}: {out}");
        Ok(())
    }

    /// SIGKILL node `i` (no goodbye to clients or to the cluster).
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].child = None;
    }

    /// Waits until a running node other than `dead` is the primary of `key`'s slot and every
    /// running node reports `cluster_state:ok`; returns the new primary.
    pub fn wait_failover(&self, key: &str, dead: usize, timeout: Duration) -> Result<usize> {
        let promoted =
            Poll::new(format!("a replica promoted for {key}"), timeout).until_blocking(|| {
                Ok(match self.master_of(key) {
                    Some(m) if m != dead => Probe::Ready(m),
                    other => Probe::Pending(format!("primary {other:?}")),
                })
            })?;
        let live: Vec<usize> = self.running().collect();
        self.wait_ok(&live)?;
        Ok(promoted)
    }

    /// `CLUSTER INFO` field `name` of node `i`.
    pub fn info(&self, i: usize, name: &str) -> Option<String> {
        field(&self.cli(i, &["CLUSTER", "INFO"]), name)
    }

    /// One `redis-cli` command's output on node `i` ("" when it is down).
    pub fn cli(&self, i: usize, args: &[&str]) -> String {
        cli_port(self.nodes[i].port, args)
    }

    /// A `redis-cli` command's integer reply on node `i` (`None` when it is not one, or the node
    /// is down).
    pub fn cli_int(&self, i: usize, args: &[&str]) -> Option<i64> {
        self.cli(i, args).trim().parse().ok()
    }

    /// Every node in `nodes` reports `cluster_state:ok`.
    fn wait_ok(&self, nodes: &[usize]) -> Result<()> {
        Poll::new("cluster_state:ok on every node", CLUSTER_STEP).until_blocking(|| {
            let states: Vec<Option<String>> = nodes
                .iter()
                .map(|&i| self.info(i, "cluster_state"))
                .collect();
            Ok(match states.iter().all(|s| s.as_deref() == Some("ok")) {
                true => Probe::Ready(()),
                false => Probe::Pending(format!("{states:?}")),
            })
        })
    }
}

/// Field `name` of an `INFO`-style reply (`name:value` lines).
fn field(reply: &str, name: &str) -> Option<String> {
    reply.lines().find_map(|l| {
        l.strip_prefix(name)?
            .strip_prefix(':')
            .map(|v| v.trim().to_owned())
    })
}

/// One `redis-cli` command's output against the server on `port` ("" when it is down).
fn cli_port(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}
