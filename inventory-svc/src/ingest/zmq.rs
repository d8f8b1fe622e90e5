//! vLLM / SGLang ZMQ subscriber for one `(endpoint, rank)`: `tcp://<endpointIP>:<kvZmqPort + rank>`,
//! or the endpoint's `kvZmqEndpoint` plus the rank.
//!
//! Topologies: by default each session connects a SUB to the engine's bound PUB (vLLM binds only
//! a wildcard endpoint such as `tcp://*:5557`); with `kvZmqBind` the session binds the SUB on the
//! endpoint's `kvZmqEndpoint` and the engine's PUB connects to it (vLLM connects whenever its
//! endpoint names a host), as llm-d deploys it. Either way the session subscribes to every topic and applies batches in sequence order.
//! A gap triggers a replay through a DEALER (`[b"", start_seq]`, read until the `ff*8` end marker)
//! when the rule has `kvReplayPort`; otherwise (or when the replay fails) the endpoint's inventory
//! for this rank is cleared and rebuilt from new events. A sequence back at 0 — or lower than the
//! last one after a reconnect — is an engine restart: clear, then ingest. A run of
//! [`super::REWIND_RUN`] in-order sequences below the last one (the last was an out-of-range jump)
//! is a rewind: clear, then follow the new run.
//!
//! The subscription speaks ZMTP itself ([`super::zmtp`]: frames borrowed from the read buffer,
//! every limit checked before a body is buffered). A session runs in its own task; connecting,
//! it ends when the publisher closes the connection or after `KVROUTE_ZMQ_IDLE_RECONNECT_MS` of
//! silence (a publisher host gone without closing), and the next session reconnects (waiting
//! for the engine to come back); a restarted engine is then recognised by its sequence. A bound
//! session keeps its address for its whole life: an engine's publisher reconnects to it by
//! itself, and a publisher that leaves only shows as not connected until one connects again.
//! The replay DEALER speaks the same ZMTP, with the same limits, and bounds a replay's payload in
//! total ([`REPLAY_MAX_BYTES`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use kvroute_core::hash::Engine;
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};
use tokio_util::sync::CancellationToken;

use super::decode::{decode_batch_into, parse_seq, split_frames, BytesKey, EventBatch, Spare};
use super::keyer::Keyer;
use super::zmtp::{Conn, Message, Role, SubListener, ZmtpError};
use super::{clear_for, next_backoff, Feed, SeqTracker, SeqVerdict};
use crate::index::IndexOp;
use crate::metrics::ClearCause;
use crate::metrics::Replay;

/// How a session ended.
enum End {
    Cancelled,
    /// Silent for the idle period: reconnect at once.
    Idle,
    /// The publisher closed (or broke) a working connection: reconnect soon, backing off anew.
    Lost(String),
    Failed(String),
}

/// Publisher-side state carried across sessions.
pub(super) struct Pub {
    keyer: Keyer,
    seq: SeqTracker,
    /// The operations of the messages read but not yet applied (empty between reads; kept for
    /// its capacity).
    ops: Vec<IndexOp>,
    /// Keys those operations carry.
    op_keys: usize,
    /// The batch being decoded and the key vectors of applied operations, reused.
    batch: EventBatch,
    spare: Spare,
}

/// Most keys one apply gathers from messages already read ([`Conn::ready`]): several small
/// messages are applied under one lock of the index, which queries wait on for no longer than
/// about this many keys (plus one message) take.
const GATHER_KEYS: usize = 1024;

/// Most messages one apply gathers (the session checks for cancellation between applies).
const GATHER_MESSAGES: usize = 64;

/// Runs the subscriber of one `(endpoint, rank)` until `cancel` (the rule's token, or the
/// endpoint's lease), resuming after the last sequence already applied (replicated takeover).
pub async fn run(feed: Feed, cancel: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    let mut first = new_pub(&feed);
    first.seq = SeqTracker::resume(feed.last_seq());
    let mut p = Some(first);
    let (name, ep, rank) = (feed.rule.spec.name(), feed.ep.0, feed.rank.0);
    while !cancel.is_cancelled() {
        let pubs = p.take().unwrap_or_else(|| new_pub(&feed));
        let h = tokio::spawn(session(feed.clone(), pubs, cancel.clone()));
        let res = h.await;
        feed.set_connected(false);
        match res {
            Ok((pubs, End::Cancelled)) => {
                p = Some(pubs);
                if cancel.is_cancelled() {
                    break;
                }
                backoff = Duration::from_millis(100);
            }
            Ok((mut pubs, End::Idle)) => {
                tracing::debug!(rule = %name, ep, rank, "subscriber idle: reconnecting");
                pubs.seq.reconnected();
                p = Some(pubs);
                backoff = Duration::from_millis(100);
                continue;
            }
            Ok((mut pubs, End::Lost(e))) => {
                tracing::info!(rule = %name, ep, rank, "publisher connection ended: {e}");
                pubs.seq.reconnected();
                p = Some(pubs);
                backoff = Duration::from_millis(100);
            }
            Ok((mut pubs, End::Failed(e))) => {
                tracing::warn!(rule = %name, ep, rank, "subscriber session ended: {e}");
                pubs.seq.reconnected();
                p = Some(pubs);
            }
            Err(join) => {
                // A panic in the session: sync state is lost, so start from empty.
                tracing::error!(rule = %name, ep, rank, "subscriber task failed: {join}");
                feed.clear(ClearCause::Reconnect);
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = next_backoff(backoff);
    }
    feed.set_connected(false);
}

pub(super) fn new_pub(feed: &Feed) -> Pub {
    Pub {
        keyer: feed.keyer(),
        seq: SeqTracker::default(),
        ops: Vec::new(),
        op_keys: 0,
        batch: EventBatch::default(),
        spare: Spare::default(),
    }
}

fn bytes_key(engine: Engine) -> BytesKey {
    if engine == Engine::Sglang {
        BytesKey::First8
    } else {
        BytesKey::Last8
    }
}

/// How long a cancelled session's subscription waits for a successor on the same address.
const HANDOVER: Duration = Duration::from_secs(2);

/// How long a new session waits for a live predecessor on its address to hand its subscription
/// over (a replaced rule's session is cancelled as the new one starts).
const HANDOVER_WAIT: Duration = Duration::from_millis(500);

type Key = (SocketAddr, bool);

/// Subscriptions handed from a cancelled session to the next one on the same address (a rule
/// replaced, its endpoint's event address unchanged): the connection stays subscribed (and a bound
/// address stays bound), so what the engine publishes meanwhile waits in the socket instead of
/// being dropped by the publisher, and the successor's sequence check finds no gap. A
/// subscription nobody takes within [`HANDOVER`] is closed. One per process ([`HANDOVERS`]):
/// an address is the process's, whichever rule subscribes to it.
#[derive(Debug, Default)]
struct Handover {
    state: std::sync::Mutex<HandoverState>,
    changed: tokio::sync::Notify,
    next: AtomicU64,
}

#[derive(Debug, Default)]
struct HandoverState {
    parked: HashMap<Key, Parked>,
    /// Sessions holding a subscription, per address.
    active: HashMap<Key, usize>,
}

#[derive(Debug)]
struct Parked {
    id: u64,
    conn: Option<Conn>,
    listener: Option<SubListener>,
}

/// The process's subscriptions in hand-over.
static HANDOVERS: std::sync::LazyLock<Handover> = std::sync::LazyLock::new(Handover::default);

/// A session's hold on its address; dropping it (however the session ends) lets a waiting
/// successor stop waiting.
struct Active {
    key: Key,
}

impl Drop for Active {
    fn drop(&mut self) {
        let h = &*HANDOVERS;
        {
            let mut st = h.lock();
            if let Some(n) = st.active.get_mut(&self.key) {
                *n -= 1;
                if *n == 0 {
                    st.active.remove(&self.key);
                }
            }
        }
        h.changed.notify_waiters();
    }
}

impl Handover {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandoverState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks a session holding a subscription on `key` until the guard drops.
    fn hold(&self, key: Key) -> Active {
        *self.lock().active.entry(key).or_default() += 1;
        Active { key }
    }

    /// Parks a cancelled session's subscription for [`HANDOVER`].
    fn park(&'static self, key: Key, conn: Option<Conn>, listener: Option<SubListener>) {
        if conn.is_none() && listener.is_none() {
            return;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock()
            .parked
            .insert(key, Parked { id, conn, listener });
        self.changed.notify_waiters();
        tokio::spawn(async move {
            tokio::time::sleep(HANDOVER).await;
            let mut st = self.lock();
            if st.parked.get(&key).is_some_and(|p| p.id == id) {
                st.parked.remove(&key);
            }
        });
    }

    /// The subscription a predecessor parked on `key`: at once, or once a predecessor still
    /// holding one parks it (within [`HANDOVER_WAIT`]); `None` when there is none.
    async fn take(&self, key: Key) -> Option<Parked> {
        let deadline = Instant::now() + HANDOVER_WAIT;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut st = self.lock();
                if let Some(p) = st.parked.remove(&key) {
                    return Some(p);
                }
                if !st.active.contains_key(&key) {
                    return None;
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return None;
            }
        }
    }
}

/// How long a publisher has to answer the ZMTP greeting, from connecting or being accepted.
const HANDSHAKE: Duration = Duration::from_secs(5);

/// Connections accepted on a bound address and not yet through their handshake; more are
/// refused (closed at once) until one finishes.
const MAX_GREETING: usize = 8;

/// The next message of `conn`, or never when there is no connection.
async fn recv(conn: Option<&mut Conn>) -> Result<Message<'_>, ZmtpError> {
    match conn {
        Some(c) => c.recv().await,
        None => std::future::pending().await,
    }
}

/// The next publisher connecting to `listener`, or never when the session connects.
async fn accept(listener: Option<&SubListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// One connection; returns the publisher state and how the session ended. Connects to the
/// engine's publisher (a closed or failed connection ends the session), or with `kvZmqBind` binds
/// the address the engine's publisher connects to and keeps it for the whole session: a
/// publisher that leaves shows as not connected until one connects again, and a new connection
/// replaces the current one (an engine restarted before its old connection was seen to close).
async fn session(feed: Feed, mut p: Pub, cancel: CancellationToken) -> (Pub, End) {
    let Some(addr) = feed.event_addr() else {
        return (p, End::Failed("no event address for this rank".into()));
    };
    let sa = addr.socket_addr();
    let bind = feed.rule.spec.zmq_bind;
    let (ep, rank) = (feed.ep.0, feed.rank.0);
    let mut conn: Option<Conn> = None;
    let mut listener: Option<SubListener> = None;
    let key = (sa, bind);
    let parked = tokio::select! {
        _ = cancel.cancelled() => return (p, End::Cancelled),
        pk = HANDOVERS.take(key) => pk,
    };
    let handed = parked.is_some();
    if let Some(pk) = parked {
        conn = pk.conn;
        listener = pk.listener;
    }
    let setup = async {
        if handed {
            return Ok(());
        }
        if bind {
            SubListener::bind(sa)
                .await
                .map(|l| listener = Some(l))
                .map_err(|e| format!("bind {addr}: {e}"))
        } else {
            Conn::connect(Role::Sub, sa, HANDSHAKE)
                .await
                .map(|c| conn = Some(c))
                .map_err(|e| format!("connect {addr}: {e}"))
        }
    };
    tokio::select! {
        _ = cancel.cancelled() => return (p, End::Cancelled),
        r = setup => if let Err(e) = r {
            return (p, End::Failed(e));
        },
    }
    let _active = HANDOVERS.hold(key);
    if conn.is_some() {
        feed.set_connected(true);
    }
    tracing::debug!(rule = %feed.rule.spec.name(), ep, rank, %addr, bind, handed, "subscribed");
    let idle = feed.fleet.settings.zmq_idle_reconnect;
    // Waited on across messages: a fresh `cancelled()` per message would join and leave the
    // token's waiter list (under its lock) for every message.
    let cancelled = cancel.cancelled();
    tokio::pin!(cancelled);
    // One timer for the whole session, not one per message: a message only notes its time, and
    // the timer, when it fires, re-arms itself for the silence left since the last message.
    let mut last = Instant::now();
    let silence = tokio::time::sleep(idle);
    tokio::pin!(silence);
    let mut greeting = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            _ = &mut cancelled => {
                HANDOVERS.park(key, conn.take(), listener.take());
                return (p, End::Cancelled);
            }
            msg = recv(conn.as_mut()) => match msg {
                Ok(m) => {
                    if !idle.is_zero() {
                        last = Instant::now();
                    }
                    if bind {
                        // Silence marked it not connected; the publisher is back.
                        feed.set_connected(true);
                    }
                    take(&feed, &mut p, &m.frames()).await;
                    // Messages already read join this apply (one index lock for all of them).
                    let mut gathered = 1;
                    while let Some(c) = conn.as_mut().filter(|_| {
                        gathered < GATHER_MESSAGES && p.op_keys < GATHER_KEYS
                    }) {
                        if !c.ready() {
                            break;
                        }
                        // A buffered message: never waits.
                        let Ok(m) = c.recv().await else { break };
                        take(&feed, &mut p, &m.frames()).await;
                        gathered += 1;
                    }
                    flush(&feed, &mut p);
                }
                Err(e) if bind => {
                    if matches!(e, ZmtpError::Closed) {
                        tracing::info!(rule = %feed.rule.spec.name(), ep, rank, %addr, "publisher connection ended: {e}");
                    } else {
                        tracing::warn!(rule = %feed.rule.spec.name(), ep, rank, %addr, "publisher connection dropped: {e}");
                    }
                    conn = None;
                    feed.set_connected(false);
                }
                Err(ZmtpError::Closed) => return (p, End::Lost(format!("{addr}: {}", ZmtpError::Closed))),
                // A protocol fault or a socket error: reconnect, backing off.
                Err(e) => return (p, End::Failed(format!("recv {addr}: {e}"))),
            },
            acc = accept(listener.as_ref()) => match acc {
                Ok((stream, peer)) if greeting.len() < MAX_GREETING => {
                    greeting.push(Conn::handshake(Role::Sub, stream, peer, HANDSHAKE));
                }
                Ok((_, peer)) => {
                    tracing::warn!(rule = %feed.rule.spec.name(), ep, rank, %addr, %peer, "{MAX_GREETING} connections already in their handshake: closing this one");
                }
                Err(e) => tracing::warn!(rule = %feed.rule.spec.name(), ep, rank, %addr, "accept: {e}"),
            },
            done = greeting.next(), if !greeting.is_empty() => match done {
                Some(Ok(c)) => {
                    tracing::info!(rule = %feed.rule.spec.name(), ep, rank, %addr, peer = %c.peer(), replaced = conn.is_some(), "publisher connected");
                    conn = Some(c);
                    // Most often a restarted engine's: its first sequence at or below the last
                    // applied one is a restart (cleared), not old news to skip.
                    p.seq.reconnected();
                    // The new connection's news counts as activity, as a message does.
                    last = Instant::now();
                    feed.set_connected(true);
                }
                Some(Err(e)) => tracing::warn!(rule = %feed.rule.spec.name(), ep, rank, %addr, "publisher handshake failed: {e}"),
                None => {}
            },
            _ = &mut silence, if !idle.is_zero() => {
                if last.elapsed() < idle {
                    silence.as_mut().reset(last + idle);
                    continue;
                }
                feed.set_connected(false);
                if !bind {
                    return (p, End::Idle);
                }
                silence.as_mut().reset(Instant::now() + idle);
            }
        }
    }
}

/// Applies one message of the publisher: sequence check (replay or clear on a gap, clear on a
/// restart or rewind), then its events.
#[cfg(test)]
pub(super) async fn handle(feed: &Feed, p: &mut Pub, frames: &[&[u8]]) {
    take(feed, p, frames).await;
    flush(feed, p);
}

/// Applies the operations gathered so far.
fn flush(feed: &Feed, p: &mut Pub) {
    feed.apply(&p.ops);
    p.spare.recycle(&mut p.ops);
    p.op_keys = 0;
}

/// One message of the publisher: sequence check (replay or clear on a gap, clear on a restart
/// or rewind), then its events' operations join `p.ops` for the next [`flush`] (a clear or a
/// replay first applies what was gathered before it).
async fn take(feed: &Feed, p: &mut Pub, frames: &[&[u8]]) {
    let engine = feed.engine();
    let m = &feed.fleet.metrics;
    let (ep, rank) = (feed.ep.0, feed.rank.0);
    let Ok((_topic, seq, payload)) = split_frames(frames) else {
        m.decode_errors.with_label_values(&[engine.as_str()]).inc();
        return;
    };
    match p.seq.observe(seq) {
        SeqVerdict::First | SeqVerdict::InOrder => {}
        SeqVerdict::Duplicate => return,
        v @ (SeqVerdict::Restart | SeqVerdict::Rewind) => {
            flush(feed, p);
            let cause = clear_for(v).unwrap_or(ClearCause::Restart);
            tracing::info!(rule = %feed.rule.spec.name(), ep, rank, seq, cause = cause.as_str(), "publisher restarted or rewound: clearing the endpoint inventory");
            p.keyer.reset();
            feed.clear(cause);
        }
        SeqVerdict::Gap { from } => {
            flush(feed, p);
            m.seq_gaps.with_label_values(&[engine.as_str()]).inc();
            let replayed = match feed.replay_addr() {
                Some(ra) => {
                    let raddr = ra.socket_addr();
                    match replay(raddr, from, seq, feed.fleet.settings.replay_timeout).await {
                        Ok(batches) => {
                            m.replay(engine.as_str(), Replay::Ok).inc();
                            tracing::info!(rule = %feed.rule.spec.name(), ep, rank, from, to = seq, n = batches.len(), "gap replayed");
                            for (bseq, b) in batches {
                                feed.note_seq(bseq);
                                apply_payload(feed, p, &b);
                                flush(feed, p);
                            }
                            true
                        }
                        Err(e) => {
                            m.replay(engine.as_str(), Replay::Failed).inc();
                            tracing::warn!(rule = %feed.rule.spec.name(), ep, rank, "replay failed: {e}");
                            false
                        }
                    }
                }
                None => false,
            };
            if !replayed {
                tracing::warn!(rule = %feed.rule.spec.name(), ep, rank, from, to = seq, "sequence gap: clearing the endpoint inventory");
                p.keyer.reset();
                feed.clear(ClearCause::Gap);
            }
        }
    }
    feed.note_seq(seq);
    apply_payload(feed, p, payload);
}

fn apply_payload(feed: &Feed, p: &mut Pub, payload: &[u8]) {
    let engine = feed.engine();
    let m = &feed.fleet.metrics;
    match decode_batch_into(payload, bytes_key(engine), &mut p.batch, &mut p.spare) {
        Ok(()) => {
            for why in &p.batch.skips {
                m.malformed_events
                    .with_label_values(&[engine.as_str(), why.as_str()])
                    .inc();
            }
            let at = p.ops.len();
            p.keyer.take_ops(&mut p.batch, &mut p.ops, &mut p.spare);
            p.op_keys += p.ops[at..].iter().map(IndexOp::key_count).sum::<usize>();
            let (matched, mismatched) = p.keyer.take_parity();
            if let (Some(e), true) = (feed.endpoint(), matched + mismatched > 0) {
                e.record_parity(matched, mismatched, p.keyer.parity.clone());
            }
        }
        Err(e) => {
            m.decode_errors.with_label_values(&[engine.as_str()]).inc();
            tracing::debug!(rule = %feed.rule.spec.name(), ep = feed.ep.0, rank = feed.rank.0, "undecodable payload: {e}");
        }
    }
}

/// Most bytes of payload one replay may bring (a vLLM replay buffer of 10,000 steps of CPU-sized
/// batches is a few tens of MiB); a gap needing more is cleared instead.
const REPLAY_MAX_BYTES: usize = 256 << 20;

/// Fetches `(seq, payload)` for `from..to` from a replay ROUTER at `addr`, in order, within
/// `deadline`: a DEALER on this process's own ZMTP (every frame bounded before it is read),
/// asking `[b"", from]` and reading replies until the `ff*8` end marker.
async fn replay(
    addr: SocketAddr,
    from: u64,
    to: u64,
    deadline: Duration,
) -> Result<Vec<(u64, Vec<u8>)>, String> {
    let end = Instant::now() + deadline;
    let mut conn = Conn::connect(Role::Dealer, addr, deadline)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let left = || end.saturating_duration_since(Instant::now());
    timeout(left(), conn.send(&[b"", &from.to_be_bytes()]))
        .await
        .map_err(|_| "send: timed out".to_owned())?
        .map_err(|e| format!("send: {e}"))?;
    let (mut out, mut bytes) = (Vec::new(), 0usize);
    loop {
        let msg = timeout(left(), conn.recv())
            .await
            .map_err(|_| format!("no end marker within {deadline:?}"))?
            .map_err(|e| format!("recv: {e}"))?;
        let frames = msg.frames();
        // vLLM replies [b"", topic, seq, payload]; [b"", seq, payload] and [seq, payload] too.
        let (seq_frame, payload) = match &*frames {
            [[], _, s, pl] => (*s, *pl),
            [_, s, pl] | [s, pl] => (*s, *pl),
            other => {
                return Err(format!(
                    "unexpected replay reply with {} frames",
                    other.len()
                ))
            }
        };
        let seq = parse_seq(seq_frame).map_err(|e| e.to_string())?;
        if seq == u64::MAX {
            break;
        }
        let next = from.saturating_add(out.len() as u64);
        if seq < next || seq >= to {
            continue; // before the gap (or repeated), or past it: not needed
        }
        if seq > next {
            return Err(format!("the replay skips from {next} to {seq}"));
        }
        bytes += payload.len();
        if bytes > REPLAY_MAX_BYTES {
            return Err(format!(
                "the replay brings over {REPLAY_MAX_BYTES} bytes before its end marker"
            ));
        }
        out.push((seq, payload.to_vec()));
    }
    // A replay that does not cover the whole gap (buffer too short) cannot restore sync.
    if out.len() as u64 != to - from {
        return Err(format!(
            "replay returned {} of {} missing batches",
            out.len(),
            to - from
        ));
    }
    Ok(out)
}
