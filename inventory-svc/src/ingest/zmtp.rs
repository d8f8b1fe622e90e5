//! ZMTP 3.0 (ZeroMQ's wire protocol, rfc.zeromq.org/spec/23) over one TCP connection: what the
//! inventory needs to read a vLLM or SGLang event publisher (a libzmq PUB) and to ask vLLM's
//! replay socket (a ROUTER) for missed batches, and nothing more.
//!
//! A [`Conn`] greets the peer as ZMTP 3.0 with the NULL mechanism and sends `READY` with its
//! [`Role`]'s socket type: as a `SUB` it requires the peer's `READY` to name a `PUB` or `XPUB` and
//! subscribes to every topic (the 3.0 form: a one-frame message `0x01`); as a `DEALER` it requires
//! a `ROUTER` and can [`Conn::send`]. It then yields whole messages, each as its frames borrowed
//! from the connection's read buffer: no allocation per message, and every message found in one
//! read is returned before the next read.
//!
//! Invariants: the decoder ([`Decoder`]) is synchronous and never panics on any byte sequence
//! (fuzzed by `fuzz/fuzz_targets/zmtp_stream.rs`); a message is bounded by [`MAX_MESSAGE_BYTES`]
//! and [`MAX_FRAMES`] and a command by [`MAX_COMMAND_BYTES`], checked on the frame headers before
//! any body is buffered, so a hostile peer costs at most that much memory; reserved flag bits, a
//! command inside a multi-frame message, or a second greeting end the connection with an error
//! naming what was wrong. [`Conn::recv`] is cancel safe (its only await is a read into the
//! buffer), so it can sit in a `select!`. A peer closing the connection is reported at once
//! ([`ZmtpError::Closed`]).
//!
//! A `PING` (ZMTP 3.1 heartbeats, which a 3.0 peer is not sent) is answered with a `PONG` written
//! without waiting; other commands after the handshake are ignored.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest message (all frames' bodies together) a publisher may send: a vLLM batch of a
/// 128k-token prompt with its token ids is about 2 MiB.
pub const MAX_MESSAGE_BYTES: u64 = 64 << 20;
/// Most frames in one message (vLLM and SGLang send 3: topic, sequence, payload).
pub const MAX_FRAMES: usize = 16;
/// Largest command body (`READY` with its properties, `PING`, `ERROR`).
pub const MAX_COMMAND_BYTES: u64 = 64 << 10;
/// The greeting's length.
pub const GREETING_LEN: usize = 64;
/// Bytes the read buffer starts with; it grows (doubling) only for a larger message.
const READ_CHUNK: usize = 64 << 10;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Why a connection could not be set up or was ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// The first bytes are not a ZMTP greeting.
    #[error("not a ZeroMQ peer: the greeting's signature is wrong")]
    Signature,
    /// A ZMTP 1.0 or 2.x peer (libzmq before 4.0).
    #[error("the peer speaks ZMTP {0}.{1}; 3.0 or later is needed (libzmq 4.0+)")]
    Version(u8, u8),
    /// A security mechanism other than NULL (CURVE, PLAIN).
    #[error("the peer asks for the {0} security mechanism; only NULL is supported")]
    Mechanism(String),
    /// The peer's socket type does not talk to this side's.
    #[error("the peer is a {got} socket; {expected} is expected")]
    SocketType {
        /// What the peer's `READY` names.
        got: String,
        /// What this side's role talks to.
        expected: &'static str,
    },
    /// The peer refused the handshake with an `ERROR` command.
    #[error("the peer refused the handshake: {0}")]
    Refused(String),
    /// A frame or command that breaks the protocol.
    #[error("malformed ZMTP stream: {0}")]
    Malformed(&'static str),
    /// A message over [`MAX_MESSAGE_BYTES`] or a command over [`MAX_COMMAND_BYTES`].
    #[error("a {what} of {size} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// "message" or "command".
        what: &'static str,
        /// Its announced size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A message of more than [`MAX_FRAMES`] frames.
    #[error("a message of more than {MAX_FRAMES} frames")]
    TooManyFrames,
}

/// What [`Decoder::parse`] found at the start of the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A whole message; its frames are [`Decoder::frames`].
    Message,
    /// A command: its name and body, as ranges of the buffer.
    Command {
        /// The command name.
        name: std::ops::Range<usize>,
        /// The command data after the name.
        data: std::ops::Range<usize>,
    },
}

/// Splits a byte stream (after the greeting) into messages and commands.
#[derive(Debug, Default)]
pub struct Decoder {
    frames: Vec<std::ops::Range<usize>>,
}

impl Decoder {
    /// The frames of the last [`Item::Message`], as ranges of the buffer it was parsed from.
    pub fn frames(&self) -> &[std::ops::Range<usize>] {
        &self.frames
    }

    /// Parses the item at the start of `buf`: `Ok(None)` when it is not complete yet, else the
    /// item and the bytes it spans. Every limit is checked on the frame headers, before the
    /// bodies are needed.
    pub fn parse(&mut self, buf: &[u8]) -> Result<Option<(Item, usize)>, ZmtpError> {
        self.frames.clear();
        let mut pos = 0usize;
        let mut total = 0u64;
        loop {
            let Some(&flags) = buf.get(pos) else {
                return Ok(None);
            };
            if flags & !(MORE | LONG | COMMAND) != 0 {
                return Err(ZmtpError::Malformed("reserved frame flag bits are set"));
            }
            let (size, head) = if flags & LONG != 0 {
                let Some(b) = buf.get(pos + 1..pos + 9) else {
                    return Ok(None);
                };
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                (u64::from_be_bytes(a), 9)
            } else {
                let Some(&b) = buf.get(pos + 1) else {
                    return Ok(None);
                };
                (u64::from(b), 2)
            };
            if flags & COMMAND != 0 {
                if flags & MORE != 0 {
                    return Err(ZmtpError::Malformed("a command frame has the MORE flag"));
                }
                if !self.frames.is_empty() {
                    return Err(ZmtpError::Malformed(
                        "a command inside a multi-frame message",
                    ));
                }
                if size > MAX_COMMAND_BYTES {
                    return Err(ZmtpError::TooLarge {
                        what: "command",
                        size,
                        limit: MAX_COMMAND_BYTES,
                    });
                }
                // Bounded by MAX_COMMAND_BYTES above: fits a usize.
                let body = pos + head..pos + head + size as usize;
                if buf.len() < body.end {
                    return Ok(None);
                }
                let Some(&n) = buf.get(body.clone()).and_then(|b| b.first()) else {
                    return Err(ZmtpError::Malformed("an empty command"));
                };
                let name = body.start + 1..body.start + 1 + usize::from(n);
                if name.end > body.end {
                    return Err(ZmtpError::Malformed("a command name longer than its frame"));
                }
                let data = name.end..body.end;
                return Ok(Some((Item::Command { name, data }, body.end)));
            }
            total = total.saturating_add(size);
            if total > MAX_MESSAGE_BYTES {
                return Err(ZmtpError::TooLarge {
                    what: "message",
                    size: total,
                    limit: MAX_MESSAGE_BYTES,
                });
            }
            if self.frames.len() == MAX_FRAMES {
                return Err(ZmtpError::TooManyFrames);
            }
            // Bounded by MAX_MESSAGE_BYTES above: fits a usize.
            let body = pos + head..pos + head + size as usize;
            if buf.len() < body.end {
                return Ok(None);
            }
            pos = body.end;
            self.frames.push(body);
            if flags & MORE == 0 {
                return Ok(Some((Item::Message, pos)));
            }
        }
    }
}

/// Which ZeroMQ socket this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A subscriber to a `PUB` or `XPUB` (an engine's event publisher): subscribes to every topic
    /// once the handshake is done.
    Sub,
    /// A `DEALER` asking a `ROUTER` (vLLM's replay socket).
    Dealer,
}

impl Role {
    /// The socket type this side announces.
    fn socket_type(self) -> &'static [u8] {
        match self {
            Role::Sub => b"SUB",
            Role::Dealer => b"DEALER",
        }
    }

    /// Whether a peer announcing `ty` talks to this side.
    fn accepts(self, ty: &[u8]) -> bool {
        match self {
            Role::Sub => ty == b"PUB" || ty == b"XPUB",
            Role::Dealer => ty == b"ROUTER",
        }
    }

    /// The peers this side talks to, for errors.
    fn expected(self) -> &'static str {
        match self {
            Role::Sub => "a PUB or XPUB",
            Role::Dealer => "a ROUTER",
        }
    }
}

/// This side's greeting: signature, version 3.0, NULL, not a server (ZMTP 3.0 ignores it).
fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks the peer's greeting.
pub fn check_greeting(g: &[u8; GREETING_LEN]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] & 0x01 == 0 {
        return Err(ZmtpError::Signature);
    }
    if g[10] < 3 {
        return Err(ZmtpError::Version(g[10], g[11]));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(&mech[..end]).into_owned(),
        ));
    }
    Ok(())
}

/// The `READY` command announcing `role`'s socket type.
fn ready(role: Role) -> Vec<u8> {
    let ty = role.socket_type();
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(ty.len() as u32).to_be_bytes());
    body.extend_from_slice(ty);
    let mut out = vec![COMMAND, body.len() as u8];
    out.extend_from_slice(&body);
    out
}

/// The value of property `name` (case-insensitive, as ZMTP says) in a `READY`'s data.
pub fn property<'a>(mut data: &'a [u8], name: &str) -> Result<Option<&'a [u8]>, ZmtpError> {
    let mut found = None;
    while !data.is_empty() {
        let n = usize::from(data[0]);
        let key = data
            .get(1..1 + n)
            .ok_or(ZmtpError::Malformed("a READY property name past its frame"))?;
        let len = data
            .get(1 + n..5 + n)
            .ok_or(ZmtpError::Malformed("a READY property without its length"))?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let value = data
            .get(5 + n..(5 + n).saturating_add(len))
            .ok_or(ZmtpError::Malformed(
                "a READY property value past its frame",
            ))?;
        if found.is_none() && key.eq_ignore_ascii_case(name.as_bytes()) {
            found = Some(value);
        }
        data = &data[5 + n + len..];
    }
    Ok(found)
}

/// Judges the peer's first command: a `READY` from a socket `role` talks to.
pub fn check_ready(name: &[u8], data: &[u8], role: Role) -> Result<(), ZmtpError> {
    match name {
        b"READY" => {
            let ty = property(data, "Socket-Type")?
                .ok_or(ZmtpError::Malformed("READY without a Socket-Type"))?;
            if role.accepts(ty) {
                Ok(())
            } else {
                Err(ZmtpError::SocketType {
                    got: String::from_utf8_lossy(ty).into_owned(),
                    expected: role.expected(),
                })
            }
        }
        b"ERROR" => {
            // ERROR: one byte of length, then the reason.
            let reason = data.get(1..).unwrap_or_default();
            Err(ZmtpError::Refused(
                String::from_utf8_lossy(reason).into_owned(),
            ))
        }
        _ => Err(ZmtpError::Malformed("the first command is not READY")),
    }
}

/// One connection: subscribed to a publisher, or a DEALER to a ROUTER.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Unparsed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    dec: Decoder,
    peer: SocketAddr,
}

/// A message: its frames, borrowed from the connection's buffer until the next `recv`.
pub struct Message<'a> {
    buf: &'a [u8],
    frames: &'a [std::ops::Range<usize>],
}

impl<'a> Message<'a> {
    /// Its frames, as slices of the buffer.
    pub fn frames(&self) -> Frames<'a> {
        let mut all: [&'a [u8]; MAX_FRAMES] = [&[]; MAX_FRAMES];
        // The decoder never yields more than MAX_FRAMES frames, each inside the buffer.
        for (slot, r) in all.iter_mut().zip(self.frames) {
            *slot = self.buf.get(r.clone()).unwrap_or_default();
        }
        Frames {
            all,
            n: self.frames.len().min(MAX_FRAMES),
        }
    }
}

/// A message's frames, held without allocating; derefs to the slice of them.
pub struct Frames<'a> {
    all: [&'a [u8]; MAX_FRAMES],
    n: usize,
}

impl<'a> std::ops::Deref for Frames<'a> {
    type Target = [&'a [u8]];

    fn deref(&self) -> &Self::Target {
        &self.all[..self.n]
    }
}

impl Conn {
    /// Connects to the peer bound at `addr` and greets it as `role` (a SUB subscribes), within
    /// `within`.
    pub async fn connect(
        role: Role,
        addr: SocketAddr,
        within: Duration,
    ) -> Result<Conn, ZmtpError> {
        let stream = tokio::time::timeout(within, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        Self::handshake(role, stream, addr, within).await
    }

    /// Greets, exchanges `READY` and, as a SUB, subscribes to every topic on an open connection
    /// (one accepted from a connecting publisher, or one this side opened), within `within`.
    pub async fn handshake(
        role: Role,
        stream: TcpStream,
        peer: SocketAddr,
        within: Duration,
    ) -> Result<Conn, ZmtpError> {
        let mut conn = Conn {
            stream,
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            dec: Decoder::default(),
            peer,
        };
        tokio::time::timeout(within, conn.greet(role))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "ZMTP handshake timed out"))??;
        Ok(conn)
    }

    async fn greet(&mut self, role: Role) -> Result<(), ZmtpError> {
        self.stream.write_all(&greeting()).await?;
        let mut g = [0u8; GREETING_LEN];
        self.stream.read_exact(&mut g).await.map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                ZmtpError::Closed
            } else {
                ZmtpError::Io(e)
            }
        })?;
        check_greeting(&g)?;
        self.stream.write_all(&ready(role)).await?;
        loop {
            match self.dec.parse(&self.buf[self.start..self.end])? {
                Some((Item::Command { name, data }, n)) => {
                    let b = &self.buf[self.start..];
                    check_ready(&b[name], &b[data], role)?;
                    self.start += n;
                    break;
                }
                Some((Item::Message, _)) => {
                    return Err(ZmtpError::Malformed("a message before the peer's READY"))
                }
                None => self.fill().await?,
            }
        }
        if role == Role::Sub {
            // Subscribe to every topic: ZMTP 3.0's form, a message of 0x01 and the (empty) prefix.
            self.stream.write_all(&[0x00, 0x01, 0x01]).await?;
        }
        Ok(())
    }

    /// Sends one message of `frames` (not cancel safe: a message cut short breaks the stream).
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        self.stream.write_all(&encode(frames)).await?;
        Ok(())
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Whether a whole message is already buffered at the front (a [`Conn::recv`] now returns it
    /// without waiting). A command first, or a fault, says no: `recv` then handles it.
    pub fn ready(&mut self) -> bool {
        matches!(
            self.dec.parse(&self.buf[self.start..self.end]),
            Ok(Some((Item::Message, _)))
        )
    }

    /// The next message. Cancel safe: dropped before it returns, it loses nothing.
    pub async fn recv(&mut self) -> Result<Message<'_>, ZmtpError> {
        loop {
            match self.dec.parse(&self.buf[self.start..self.end])? {
                Some((Item::Message, n)) => {
                    let at = self.start;
                    self.start += n;
                    return Ok(Message {
                        buf: &self.buf[at..at + n],
                        frames: self.dec.frames(),
                    });
                }
                Some((Item::Command { name, data }, n)) => {
                    let b = &self.buf[self.start..];
                    if &b[name] == b"PING" {
                        let context = b[data].get(2..).unwrap_or_default();
                        let pong = pong(context);
                        // Never waits: a PONG that does not fit the socket now is dropped (the
                        // peer's heartbeat then times out and it reconnects).
                        let _ = self.stream.try_write(&pong);
                    }
                    self.start += n;
                }
                None => self.fill().await?,
            }
        }
    }

    /// Reads more bytes, making room first (moving the unparsed tail to the front, or growing
    /// the buffer when one item needs more than it holds).
    async fn fill(&mut self) -> Result<(), ZmtpError> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.end == self.buf.len() {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            } else {
                // The item is over the buffer but within the limits the decoder checked.
                let n = (self.buf.len() * 2).max(READ_CHUNK);
                self.buf.resize(n, 0);
            }
        }
        match self.stream.read(&mut self.buf[self.end..]).await? {
            0 => Err(ZmtpError::Closed),
            n => {
                self.end += n;
                Ok(())
            }
        }
    }
}

/// One message of `frames` on the wire: every frame but the last flagged MORE, a body over 255
/// bytes with the 8-byte size.
fn encode(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, f) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { MORE } else { 0 };
        match u8::try_from(f.len()) {
            Ok(n) => out.extend_from_slice(&[more, n]),
            Err(_) => {
                out.push(more | LONG);
                out.extend_from_slice(&(f.len() as u64).to_be_bytes());
            }
        }
        out.extend_from_slice(f);
    }
    out
}

/// A `PONG` carrying the `PING`'s context (at most 16 bytes).
fn pong(context: &[u8]) -> Vec<u8> {
    let context = &context[..context.len().min(16)];
    let mut out = vec![COMMAND, (5 + context.len()) as u8, 4];
    out.extend_from_slice(b"PONG");
    out.extend_from_slice(context);
    out
}

/// A bound address that publishers connect to.
#[derive(Debug)]
pub struct SubListener {
    listener: TcpListener,
}

impl SubListener {
    /// Binds `addr` (the port is released when this is dropped).
    pub async fn bind(addr: SocketAddr) -> io::Result<SubListener> {
        Ok(SubListener {
            listener: TcpListener::bind(addr).await?,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connecting peer, not yet greeted (see [`Conn::handshake`]). Cancel safe.
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        self.listener.accept().await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![flags];
        if body.len() > 255 {
            out[0] |= LONG;
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            out.push(body.len() as u8);
        }
        out.extend_from_slice(body);
        out
    }

    fn message(frames: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { MORE } else { 0 };
            out.extend(frame(more, f));
        }
        out
    }

    #[test]
    fn a_sent_message_parses_back_to_its_frames() {
        let long = vec![3u8; 256];
        let frames: [&[u8]; 4] = [b"", &7u64.to_be_bytes(), &long, &[9u8; 255]];
        let wire = encode(&frames);
        assert_eq!(
            wire,
            message(&frames),
            "short and long frames as the spec writes them"
        );
        let mut dec = Decoder::default();
        let (item, n) = dec.parse(&wire).unwrap().unwrap();
        assert_eq!((item, n), (Item::Message, wire.len()));
        let back: Vec<&[u8]> = dec.frames().iter().map(|r| &wire[r.clone()]).collect();
        assert_eq!(back, frames);
    }

    /// Every item of `stream`, parsed as a reader would meet it: the bytes arriving `step` at a
    /// time, each item parsed once it is whole.
    fn items(stream: &[u8], step: usize) -> Result<Vec<Vec<Vec<u8>>>, ZmtpError> {
        let mut dec = Decoder::default();
        let (mut start, mut end, mut out) = (0, 0, Vec::new());
        loop {
            match dec.parse(&stream[start..end])? {
                Some((Item::Message, n)) => {
                    let b = &stream[start..];
                    out.push(dec.frames().iter().map(|r| b[r.clone()].to_vec()).collect());
                    start += n;
                }
                Some((Item::Command { name, data }, n)) => {
                    let b = &stream[start..];
                    out.push(vec![b[name].to_vec(), b[data].to_vec()]);
                    start += n;
                }
                None if end == stream.len() => return Ok(out),
                None => end = (end + step).min(stream.len()),
            }
        }
    }

    #[test]
    fn messages_split_anywhere_parse_the_same_as_whole() {
        let big = vec![7u8; 300];
        let mut stream = message(&[b"topic", &5u64.to_be_bytes(), b"payload"]);
        stream.extend(frame(COMMAND, b"\x04PINGxx"));
        stream.extend(message(&[b"", &6u64.to_be_bytes(), &big]));
        stream.extend(message(&[b"one"]));
        let whole = items(&stream, stream.len()).unwrap();
        assert_eq!(whole.len(), 4);
        assert_eq!(whole[0][2], b"payload");
        assert_eq!(whole[1], vec![b"PING".to_vec(), b"xx".to_vec()]);
        assert_eq!(whole[2][2], big, "a long frame (8-byte size)");
        assert_eq!(whole[3], vec![b"one".to_vec()]);
        for step in [1, 2, 3, 7, 64] {
            assert_eq!(
                items(&stream, step).unwrap(),
                whole,
                "{step} bytes at a time"
            );
        }
    }

    #[test]
    fn limits_are_checked_on_headers_before_bodies_arrive() {
        let mut dec = Decoder::default();
        // A long frame announcing 1 TiB: refused with only its header present.
        let mut huge = vec![LONG];
        huge.extend_from_slice(&(1u64 << 40).to_be_bytes());
        assert!(matches!(
            dec.parse(&huge),
            Err(ZmtpError::TooLarge {
                what: "message",
                ..
            })
        ));
        // Frames adding up past the limit, each under it.
        let mut parts = vec![LONG | MORE];
        parts.extend_from_slice(&(MAX_MESSAGE_BYTES - 1).to_be_bytes());
        assert!(dec.parse(&parts).unwrap().is_none(), "waits for the body");
        let mut cmd = vec![COMMAND | LONG];
        cmd.extend_from_slice(&(MAX_COMMAND_BYTES + 1).to_be_bytes());
        assert!(matches!(
            dec.parse(&cmd),
            Err(ZmtpError::TooLarge {
                what: "command",
                ..
            })
        ));
        let many: Vec<&[u8]> = vec![b"x"; MAX_FRAMES + 1];
        assert!(matches!(
            dec.parse(&message(&many)),
            Err(ZmtpError::TooManyFrames)
        ));
        let ok: Vec<&[u8]> = vec![b"x"; MAX_FRAMES];
        assert!(dec.parse(&message(&ok)).unwrap().is_some());
    }

    #[test]
    fn protocol_breaches_are_errors_naming_the_fault() {
        let mut dec = Decoder::default();
        let cases: [(&[u8], &str); 6] = [
            (&[0x08, 0], "reserved"),
            (&[COMMAND | MORE, 1, 0], "MORE"),
            (&[MORE, 1, b'a', COMMAND, 1, 0], "inside a multi-frame"),
            (&[COMMAND, 0], "empty command"),
            // The byte after an empty command belongs to the next frame, not to its name.
            (&[COMMAND, 0, 5, b'R'], "empty command"),
            (&[COMMAND, 2, 5, b'R'], "name longer"),
        ];
        for (bytes, what) in cases {
            let e = dec.parse(bytes).unwrap_err().to_string();
            assert!(e.contains(what), "{bytes:?}: {e}");
        }
    }

    #[test]
    fn greetings_and_ready_are_judged() {
        let g = greeting();
        check_greeting(&g).unwrap();
        let mut bad = g;
        bad[0] = 0;
        assert!(matches!(check_greeting(&bad), Err(ZmtpError::Signature)));
        let mut old = g;
        old[10] = 2;
        assert!(matches!(
            check_greeting(&old),
            Err(ZmtpError::Version(2, 0))
        ));
        let mut curve = g;
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(matches!(check_greeting(&curve), Err(ZmtpError::Mechanism(m)) if m == "CURVE"));

        for (role, ty) in [(Role::Sub, &b"SUB"[..]), (Role::Dealer, b"DEALER")] {
            let ours = ready(role);
            let (item, n) = Decoder::default().parse(&ours).unwrap().unwrap();
            assert_eq!(n, ours.len());
            let Item::Command { name, data } = item else {
                panic!("READY is a command")
            };
            assert_eq!(&ours[name.clone()], b"READY");
            assert_eq!(
                property(&ours[data.clone()], "socket-type").unwrap(),
                Some(ty)
            );
            assert_eq!(
                check_ready(&ours[name], &ours[data], role)
                    .unwrap_err()
                    .to_string(),
                format!(
                    "the peer is a {} socket; {} is expected",
                    String::from_utf8_lossy(ty),
                    role.expected()
                ),
                "{role:?} does not talk to its own kind"
            );
        }
        let socket = |ty: &[u8]| {
            let mut p = vec![11u8];
            p.extend_from_slice(b"Socket-Type");
            p.extend_from_slice(&(ty.len() as u32).to_be_bytes());
            p.extend_from_slice(ty);
            p
        };
        let xpub = socket(b"XPUB");
        check_ready(b"READY", &xpub, Role::Sub).unwrap();
        check_ready(b"READY", &socket(b"PUB"), Role::Sub).unwrap();
        check_ready(b"READY", &socket(b"ROUTER"), Role::Dealer).unwrap();
        for (ty, role) in [
            (&b"ROUTER"[..], Role::Sub),
            (b"PUB", Role::Dealer),
            (b"router", Role::Dealer),
        ] {
            assert!(
                matches!(
                    check_ready(b"READY", &socket(ty), role),
                    Err(ZmtpError::SocketType { .. })
                ),
                "{ty:?} to {role:?}"
            );
        }
        assert!(matches!(
            check_ready(b"READY", &xpub[..xpub.len() - 1], Role::Sub),
            Err(ZmtpError::Malformed(_))
        ));
        assert!(
            matches!(check_ready(b"ERROR", b"\x06denied", Role::Dealer), Err(ZmtpError::Refused(r)) if r == "denied")
        );
        assert!(matches!(
            check_ready(b"READY", b"", Role::Sub),
            Err(ZmtpError::Malformed(_))
        ));
    }

    #[test]
    fn a_pong_carries_the_ping_context() {
        let p = pong(b"abc");
        let (item, _) = Decoder::default().parse(&p).unwrap().unwrap();
        let Item::Command { name, data } = item else {
            panic!("PONG is a command")
        };
        assert_eq!(&p[name], b"PONG");
        assert_eq!(&p[data], b"abc");
    }
}
