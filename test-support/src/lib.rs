//! `kvroute-test-support`: what kvroute's test suites share, in one place.
//!
//! * [`poll`] — the one bounded polling helper: check a condition until it holds or a deadline
//!   passes, failing with a message that names what was awaited (STYLE.md: never sleep to
//!   synchronise).
//! * [`process`] — free loopback ports, temp dirs and child processes that are cleaned up on drop,
//!   and the ready line a spawned service prints.
//! * [`http`] — one-shot GET/POST helpers that return the status and the body.
//! * [`redis`] — a throwaway `redis-server` on a free port, and a throwaway Redis Cluster.
//! * [`machine`] — the date and the CPU a benchmark report names.
//!
//! It depends on no workspace crate, so any crate can take it as a dev-dependency (the end-to-end
//! crate `kvroute-tests` depends on the service and the core; this crate must not).
//! Everything binds 127.0.0.1 only.

pub mod http;
pub mod machine;
pub mod poll;
pub mod process;
pub mod redis;

pub use poll::{wait_until, wait_until_blocking, Poll, Probe, POLL_INTERVAL};
pub use process::{free_port, local, ready_line, wait_exit, ChildGuard, TempDir};
pub use redis::{Redis, RedisCluster};
