//! `hash --events ADDR`: the preflight subscribes to the engine's own KV events and compares them
//! with the tokens and keys it computed, so no operator has to decode msgpack by hand.
//!
//! Which events count: a BlockStored whose chain the preflight can place in its own prompt
//! (no parent: it starts at token 0; a parent equal to one of the preflight's keys: it continues
//! after that block). Everything else (other traffic on the engine) is skipped. The first
//! placeable event decides:
//! * its token ids differ from the preflight's at the same position: a tokenizer or chat-template
//!   leg (the first differing position and both tokens are named);
//! * the tokens agree but the keys differ: a hash leg (seed, algorithm, block size or extra keys),
//!   diagnosed as the service's parity self-check does;
//! * both agree: `match`.
//!
//! Bounded: the wait (`--wait-ms`), the events read (at most [`MAX_EVENTS`]), and each payload
//! (the service's own decoder).

use std::time::Duration;

use kvroute_core::hash::{BlockKey, Engine, HashContract};
use serde_json::{json, Value};

use crate::ingest::decode::{decode_batch, split_frames, BytesKey, KvEvent, Stored};
use crate::ingest::parity::{place, Placed};
use crate::ingest::zmtp::{Conn, Role, SubListener, ZmtpError};

/// Events read at most before giving up on finding the prompt's.
pub const MAX_EVENTS: usize = 100_000;

/// Where to get the events, and for how long.
pub struct Watch {
    /// `tcp://HOST:PORT`.
    pub addr: String,
    /// Bind the address (the engine's publisher connects, vLLM with a named host) instead of
    /// connecting to the engine's bound publisher.
    pub bind: bool,
    pub wait: Duration,
}

/// What the comparison found (printed under `"events"`), and whether it passed.
pub struct Verdict {
    pub json: Value,
    pub ok: bool,
}

/// Subscribes, then compares the first event of the prompt with `tokens` / `keys`.
pub fn check(
    w: &Watch,
    engine: Engine,
    contract: &HashContract,
    tokens: &[u32],
    keys: &[BlockKey],
) -> Result<Verdict, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    rt.block_on(watch(w, engine, contract, tokens, keys))
}

async fn watch(
    w: &Watch,
    engine: Engine,
    contract: &HashContract,
    tokens: &[u32],
    keys: &[BlockKey],
) -> Result<Verdict, String> {
    let verb = if w.bind { "--events-bind" } else { "--events" };
    let deadline = tokio::time::Instant::now() + w.wait;
    let sa = kvroute_core::rule::ZmqAddr::parse(&w.addr)
        .ok_or_else(|| {
            format!(
                "{verb} {:?}: allowed: {}",
                w.addr,
                kvroute_core::rule::ZmqAddr::ALLOWED
            )
        })?
        .socket_addr();
    let mut conn = match tokio::time::timeout_at(deadline, subscribe(sa, w.bind, deadline)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(format!("{verb} {}: {e}", w.addr)),
        Err(_) => return Err(format!("{verb} {}: no publisher within --wait-ms", w.addr)),
    };
    eprintln!(
        "kvroute-inventory hash: subscribed to {}; send the same prompt to the engine now",
        w.addr
    );
    let key_rule = if engine == Engine::Sglang {
        BytesKey::First8
    } else {
        BytesKey::Last8
    };
    // The events get the whole wait again, from the subscription on.
    let deadline = tokio::time::Instant::now() + w.wait;
    let mut seen = 0usize;
    let mut skipped = 0usize;
    // The skipped chain start sharing the most leading tokens with the prompt (a template or
    // tokenizer mismatch at the very first block looks like someone else's prompt).
    let mut closest: Option<(usize, u32, u32)> = None;
    while seen < MAX_EVENTS {
        let msg = match tokio::time::timeout_at(deadline, conn.recv()).await {
            Ok(Ok(m)) => m,
            Ok(Err(e)) => return Err(format!("{verb} {}: {e}", w.addr)),
            Err(_) => break,
        };
        let Ok((_, _, payload)) = split_frames(&msg.frames()) else {
            continue;
        };
        let Ok(batch) = decode_batch(payload, key_rule) else {
            continue;
        };
        for ev in batch.events {
            seen += 1;
            let KvEvent::Stored(s) = ev else { continue };
            match compare(engine, contract, tokens, keys, &s) {
                Some(v) => return Ok(v),
                None => skipped += 1,
            }
            if s.parent.is_none() {
                let shared = tokens
                    .iter()
                    .zip(&s.token_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                if let (Some(&o), Some(&e)) = (tokens.get(shared), s.token_ids.get(shared)) {
                    if closest.is_none_or(|(c, _, _)| shared > c) {
                        closest = Some((shared, o, e));
                    }
                }
            }
        }
    }
    let closest = closest.map(|(position, ours, engine)| {
        json!({"position": position, "ours": ours, "engine": engine,
            "message": format!("if the engine served only this prompt, token {position} differs (kvroute {ours}, engine {engine}): the tokenizer or the chat template is not the engine's")})
    });
    Ok(Verdict {
        json: json!({
            "verdict": "no_event",
            "events_seen": seen,
            "stored_skipped": skipped,
            "closest_chain_start": closest,
            "message": "no BlockStored of this prompt arrived: check the address, that the engine has prefix caching and KV events on, and that the prompt was sent; a stored event whose chain is not this prompt's is skipped, so a wrong tokenizer or template at the very first block also shows as this",
        }),
        ok: false,
    })
}

/// A subscription to the engine's publisher: connecting to it (again every 100 ms while nothing
/// listens there), or binding `addr` and taking the first publisher that connects and greets.
async fn subscribe(
    addr: std::net::SocketAddr,
    bind: bool,
    deadline: tokio::time::Instant,
) -> Result<Conn, ZmtpError> {
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    if bind {
        let l = SubListener::bind(addr).await?;
        loop {
            let (stream, peer) = l.accept().await?;
            match Conn::handshake(Role::Sub, stream, peer, left()).await {
                Ok(c) => return Ok(c),
                Err(e) => eprintln!("kvroute-inventory hash: {peer} failed its handshake: {e}"),
            }
        }
    }
    loop {
        match Conn::connect(Role::Sub, addr, left()).await {
            Err(ZmtpError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await
            }
            r => return r,
        }
    }
}

/// The verdict for one stored event, or `None` when it is not this prompt's.
fn compare(
    engine: Engine,
    contract: &HashContract,
    tokens: &[u32],
    keys: &[BlockKey],
    s: &Stored,
) -> Option<Verdict> {
    Some(match place(engine, contract, tokens, keys, s)? {
        Placed::TokenMismatch {
            position,
            ours,
            engine,
        } => Verdict {
            json: json!({
                "verdict": "token_mismatch",
                "position": position,
                "ours": ours,
                "engine": engine,
                "message": format!("token {position} differs (kvroute {ours}, engine {engine}): the tokenizer or the chat template is not the engine's"),
            }),
            ok: false,
        },
        Placed::Match {
            first_block,
            blocks,
        } => Verdict {
            json: json!({
                "verdict": "match",
                "blocks_compared": blocks,
                "first_block": first_block,
                "message": "the engine's keys equal kvroute's: tokens and hash contract agree",
            }),
            ok: true,
        },
        Placed::KeyMismatch {
            first_block,
            engine_keys,
            report,
        } => Verdict {
            json: json!({
                "verdict": "key_mismatch",
                "first_block": first_block,
                "engine_keys": engine_keys,
                "message": report.message,
                "suggested_algo": report.suggested_algo,
                "suggested_seed": report.suggested_seed,
                "suggested_block_size": report.suggested_block_size,
            }),
            ok: false,
        },
    })
}
