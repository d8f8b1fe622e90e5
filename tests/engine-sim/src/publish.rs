//! ZMQ publishing as vLLM and SGLang do it: a PUB per rank sending `[topic, seq u64 BE, payload]`
//! (seq from 0 per publisher), one batch per scheduler step, and vLLM's replay ROUTER answering
//! a DEALER's `[b"", start_seq]` with `[b"", topic, seq, payload]` per buffered batch and the end
//! marker `[b"", b"", ff*8, b""]`.
//!
//! Sockets bind on the HTTP listen IP and are bound before the HTTP server starts, so a ready simulator is already publishing.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute_core::hash::Engine as EngineKind;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::{lock, Engine};
use crate::events::{encode_batch, KvEvent, Layout, WireOptions};

/// The last `buffer_steps` batches, for replay.
type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Binds rank `rank`'s PUB (and replay ROUTER) and spawns the tasks that feed them.
pub async fn start(
    engine: Arc<Engine>,
    rank: usize,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let Some(base) = engine.cfg.zmq_port else {
        return Ok(());
    };
    if !matches!(engine.cfg.engine, EngineKind::Vllm | EngineKind::Sglang) {
        return Ok(());
    }
    // Publish on the serving IP, as an engine does: a router reaches endpoint IP + kvZmqPort
    // (several simulators on one host then use 127.0.0.x addresses and one port).
    let host = match engine.cfg.listen.ip() {
        std::net::IpAddr::V4(a) => a.to_string(),
        std::net::IpAddr::V6(a) => format!("[{a}]"),
    };
    let port = u32::from(base) + rank as u32;
    let mut pub_sock = PubSocket::new();
    pub_sock.bind(&format!("tcp://{host}:{port}")).await?;
    let buffer: ReplayBuffer = Arc::new(Mutex::new(VecDeque::new()));
    if let Some(rbase) = engine.cfg.replay_port {
        let rport = u32::from(rbase) + rank as u32;
        let mut router = RouterSocket::new();
        router.bind(&format!("tcp://{host}:{rport}")).await?;
        tokio::spawn(replay_loop(
            router,
            buffer.clone(),
            Bytes::from(engine.cfg.topic.clone()),
            cancel.clone(),
        ));
    }
    tokio::spawn(publish_loop(engine, rank, pub_sock, buffer, cancel));
    Ok(())
}

fn wire_options(engine: &Engine) -> WireOptions {
    WireOptions {
        sliding_window: engine.cfg.sliding_window,
        lora_name: engine.cfg.lora.as_ref().map(|(name, _)| name.clone()),
        ..WireOptions::gpu(match engine.cfg.engine {
            EngineKind::Sglang => Layout::Sglang,
            _ => Layout::Vllm,
        })
    }
}

async fn publish_loop(
    engine: Arc<Engine>,
    rank: usize,
    mut sock: PubSocket,
    buffer: ReplayBuffer,
    cancel: CancellationToken,
) {
    let opts = wire_options(&engine);
    let topic = Bytes::from(engine.cfg.topic.clone());
    let cap = engine.cfg.event_buffer;
    let r = &engine.ranks[rank];
    let mut seq: u64 = 0;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = r.step.notified() => {}
        }
        let events: Vec<KvEvent> = lock(&r.kv)
            .take_events()
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        if events.is_empty() {
            continue;
        }
        let payload = Bytes::from(encode_batch(
            &opts,
            Engine::unix_now(),
            &events,
            Some(r.idx),
        ));
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        if let Ok(msg) = ZmqMessage::try_from(frames) {
            if let Err(e) = sock.send(msg).await {
                tracing::warn!(rank, "PUB send failed: {e}");
            }
        }
        {
            let mut b = lock(&buffer);
            if b.len() >= cap {
                b.pop_front();
            }
            b.push_back((seq, payload));
        }
        seq += 1;
    }
}

async fn replay_loop(
    mut router: RouterSocket,
    buffer: ReplayBuffer,
    topic: Bytes,
    cancel: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = cancel.cancelled() => break,
            m = router.recv() => m,
        };
        let Ok(msg) = msg else { continue };
        let frames = msg.into_vec();
        let (Some(identity), Some(last)) = (frames.first().cloned(), frames.last()) else {
            continue;
        };
        let start = match <[u8; 8]>::try_from(last.as_ref()) {
            Ok(b) => u64::from_be_bytes(b),
            Err(_) => {
                tracing::debug!("replay request without an 8-byte start seq");
                continue;
            }
        };
        let batches: Vec<(u64, Bytes)> = lock(&buffer)
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let empty = Bytes::new();
        for (s, payload) in batches {
            let frames = vec![
                identity.clone(),
                empty.clone(),
                topic.clone(),
                Bytes::copy_from_slice(&s.to_be_bytes()),
                payload,
            ];
            if !send(&mut router, frames).await {
                break;
            }
        }
        let end = vec![
            identity,
            empty.clone(),
            empty.clone(),
            Bytes::from_static(&[0xff; 8]),
            empty,
        ];
        send(&mut router, end).await;
    }
}

async fn send(router: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    match ZmqMessage::try_from(frames) {
        Ok(m) => match router.send(m).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("replay send failed: {e}");
                false
            }
        },
        Err(_) => false,
    }
}
