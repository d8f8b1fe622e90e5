//! One connection type for the writer, the tailer and the leases, over a single Redis or a Redis
//! (or Valkey) Cluster, chosen by `KVROUTE_REDIS_MODE`.
//!
//! * `single`: a [`ConnectionManager`] on the one URL; it reconnects by itself.
//! * `cluster`: a [`ClusterConnection`] seeded from the comma-separated URLs; it discovers the
//!   slot map, follows `MOVED`/`ASK` and refreshes the map after a failover. A command or a
//!   pipeline may only touch keys of one slot there: callers group keys with [`Backend::group`]
//!   (the hash tag; every key of one rule generation shares one, see [`super::Replica::rule_tag`]).
//!   A `MULTI` is not redirected (its `EXEC` fails and the map stays stale), so what must be
//!   atomic is a script call; and a pipeline of several commands cannot follow an `ASK` while
//!   its slot migrates (the new owner serves one command per `ASKING`), so a check that must
//!   answer then is sent command by command.
//!
//! Both connect lazily: a Redis that is down at start is retried on the first command.

use std::time::Duration;

use anyhow::Context;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, Value};

use crate::settings::{RedisMode, RedisSettings};

/// How each connection of this process is made.
#[allow(clippy::large_enum_variant)] // one per process
pub(crate) enum Backend {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

/// A connection of either kind; clones share the underlying connection(s).
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Backend {
    /// The client of `cfg` (URLs, credentials and mode checked; nothing is connected yet).
    pub(crate) fn open(cfg: &RedisSettings) -> anyhow::Result<Backend> {
        let urls = cfg.urls();
        if urls.iter().any(|u| u.starts_with("rediss://")) {
            // redis-rs' rustls connector uses the process-wide provider; ours is ring.
            let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
        }
        let password = match &cfg.password_file {
            Some(p) => {
                let pw = std::fs::read_to_string(p).with_context(|| {
                    format!("KVROUTE_REDIS_PASSWORD_FILE {}: unreadable", p.display())
                })?;
                let pw = pw.trim_end_matches(['\r', '\n']).to_owned();
                anyhow::ensure!(
                    !pw.is_empty(),
                    "KVROUTE_REDIS_PASSWORD_FILE {}: empty",
                    p.display()
                );
                Some(pw)
            }
            None => None,
        };
        let mut infos = Vec::with_capacity(urls.len());
        for url in &urls {
            let info = url.into_connection_info().with_context(|| {
                format!(
                    "KVROUTE_REDIS_URL {:?}: not a Redis URL",
                    super::redact(url)
                )
            })?;
            infos.push(info);
        }
        match cfg.mode {
            RedisMode::Single => {
                let [info] = <[_; 1]>::try_from(infos).map_err(|v| {
                    anyhow::anyhow!(
                        "KVROUTE_REDIS_URL: {} URLs, allowed: one (several seed nodes need KVROUTE_REDIS_MODE=cluster)",
                        v.len()
                    )
                })?;
                let mut rs = info.redis_settings().clone();
                if let Some(u) = &cfg.username {
                    rs = rs.set_username(u);
                }
                if let Some(p) = &password {
                    rs = rs.set_password(p);
                }
                let client = redis::Client::open(info.set_redis_settings(rs))
                    .context("KVROUTE_REDIS_URL")?;
                Ok(Backend::Single(client))
            }
            RedisMode::Cluster => {
                anyhow::ensure!(!infos.is_empty(), "KVROUTE_REDIS_URL: no seed URL");
                let mut b = ClusterClientBuilder::new(infos)
                    .retries(3)
                    .min_retry_wait(50)
                    .max_retry_wait(500);
                if let Some(u) = &cfg.username {
                    b = b.username(u);
                }
                if let Some(p) = &password {
                    b = b.password(p);
                }
                let client = b
                    .build()
                    .context("KVROUTE_REDIS_URL (cluster seed nodes)")?;
                Ok(Backend::Cluster(client))
            }
        }
    }

    /// A new connection whose commands fail within `timeout` while Redis (or the slot's
    /// primary) is away; it reconnects by itself.
    pub(crate) fn connect(&self, timeout: Duration) -> anyhow::Result<Conn> {
        match self {
            Backend::Single(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(1)))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_secs(1));
                let m = ConnectionManager::new_lazy_with_config(client.clone(), cfg)
                    .context("Redis connection")?;
                Ok(Conn::Single(m))
            }
            Backend::Cluster(client) => {
                let cfg = ClusterConfig::new()
                    .set_connection_timeout(Duration::from_secs(1))
                    .set_response_timeout(timeout);
                Ok(Conn::Cluster(
                    client.get_pending_async_connection_with_config(cfg),
                ))
            }
        }
    }

    /// Keys of one group may share a command, a pipeline or a script: all keys on a single
    /// server, the keys of one hash tag in a cluster.
    pub(crate) fn group<'k>(&self, key: &'k str) -> &'k str {
        match self {
            Backend::Single(_) => "",
            Backend::Cluster(_) => hash_tag(key),
        }
    }
}

/// What Redis Cluster hashes for `key`: the text between the first `{` and the next `}` when
/// non-empty, else the whole key.
pub(crate) fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        if let Some(len) = key[open + 1..].find('}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tags_follow_redis_cluster() {
        assert_eq!(hash_tag("kvroute:{r#0001}:log"), "r#0001");
        assert_eq!(hash_tag("kvroute:{rules}:set"), "rules");
        assert_eq!(hash_tag("a{}b{c}"), "a{}b{c}");
        assert_eq!(hash_tag("plain"), "plain");
        assert_eq!(hash_tag("x{y"), "x{y");
        assert_eq!(hash_tag("{a}{b}"), "a");
    }
}
