//! Wire format of the replication log and the endpoint snapshots (little-endian, versioned).
//!
//! A log entry is one of: the index operations of one engine message (with the publisher sequence
//! they came from, so a new owner can resume the subscription), a routing decision (speculative
//! credit and placement memory), or a snapshot marker telling tailers to load an endpoint's
//! snapshot at this point of the log. Keys are 8 bytes each; nothing is JSON on this path.
//!
//! A decision may end with the session it bound (`1` and the session's 8-byte hash; absent or
//! `0`: none). Entries without the tail decode as binding no session, and a reader that predates
//! the tail ignores it (entries are length-delimited in a batch and a single entry ends the
//! payload), so the version did not change.
//!
//! Operations are tagged `s` (store), `r` (remove), `c` (clear), and for a lower cache tier `l`
//! (store) and `m` (remove), each followed by the tier (`0` host memory, `1` storage) and the
//! keys. A reader that predates the lower-tier tags rejects such an entry as an unknown tag
//! (counted; the owner's next snapshot carries the GPU tier), which is why a fleet is upgraded
//! before its engines publish lower tiers.
//!
//! Versions (the first byte of every entry and batch): 2 writes the endpoint as a `u16` (a rule
//! holds up to 1,024 endpoints); 1 wrote it as one byte. Entries of version 1 still decode (a
//! replica reading a log a version-1 replica wrote during a rolling upgrade); any other version
//! is [`CodecError::Version`]. Snapshots carry no endpoint and are unchanged.

use kvroute_core::hash::BlockKey;

use crate::index::{IndexOp, Lower};
use crate::score::Update;

/// The version written.
pub const VERSION: u8 = 2;
/// The version before the endpoint was widened to `u16`; still decoded.
const VERSION_U8_EP: u8 = 1;
const SNAP_MAGIC: &[u8; 4] = b"KVS1";

/// "No sequence known" on the wire.
const NO_SEQ: u64 = u64::MAX;

/// Tag of a log payload holding several entries (one XADD for a writer batch).
const BATCH: u8 = b'B';

/// One replication log entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// What the owner applied for `(ep, rank)` from one engine message.
    Ops {
        ep: u16,
        rank: u8,
        seq: Option<u64>,
        ops: Vec<IndexOp>,
    },
    /// A routing decision: speculative credit for `ttl_ms`, the placement memory update, and
    /// the session bound to `ep` (its hash), if any.
    Decision {
        ep: u16,
        update: Option<Update>,
        ttl_ms: u32,
        keys: Vec<BlockKey>,
        session: Option<u64>,
    },
    /// The owner wrote `ep`'s snapshot right before this entry. `resync`: entries were lost
    /// (Redis outage, full outbox, takeover), so every replica loads it here; otherwise it is a
    /// periodic snapshot for replicas that start later, and replicas in sync ignore it.
    Snapshot { ep: u16, resync: bool },
}

/// Why bytes could not be decoded.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("truncated at byte {0}")]
    Truncated(usize),
    #[error("replication log entry version {0} is not one this build reads (1, 2)")]
    Version(u8),
    #[error("unknown tag {0}")]
    Tag(u8),
    #[error("snapshot position at byte {0} is not UTF-8")]
    NotUtf8(usize),
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self
            .at
            .checked_add(n)
            .ok_or(CodecError::Truncated(self.at))?;
        let s = self
            .b
            .get(self.at..end)
            .ok_or(CodecError::Truncated(self.at))?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, CodecError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    /// An endpoint as version `v` wrote it.
    fn ep(&mut self, v: u8) -> Result<u16, CodecError> {
        if v == VERSION_U8_EP {
            self.u8().map(u16::from)
        } else {
            self.u16()
        }
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn keys(&mut self) -> Result<Vec<BlockKey>, CodecError> {
        let n = self.u32()? as usize;
        // Bound the allocation by what the input can hold.
        if n > (self.b.len() - self.at) / 8 {
            return Err(CodecError::Truncated(self.at));
        }
        (0..n).map(|_| self.u64().map(BlockKey)).collect()
    }
}

fn put_keys(out: &mut Vec<u8>, keys: &[BlockKey]) {
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        out.extend_from_slice(&k.0.to_le_bytes());
    }
}

fn seq_in(s: Option<u64>) -> u64 {
    s.unwrap_or(NO_SEQ)
}

fn seq_out(s: u64) -> Option<u64> {
    (s != NO_SEQ).then_some(s)
}

impl Entry {
    /// The endpoint the entry is about.
    pub fn ep(&self) -> u16 {
        match self {
            Entry::Ops { ep, .. } | Entry::Decision { ep, .. } | Entry::Snapshot { ep, .. } => *ep,
        }
    }

    /// Encodes the entry.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        match self {
            Entry::Ops { ep, rank, seq, ops } => {
                out.push(b'O');
                out.extend_from_slice(&ep.to_le_bytes());
                out.push(*rank);
                out.extend_from_slice(&seq_in(*seq).to_le_bytes());
                out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
                for op in ops {
                    match op {
                        IndexOp::Store(k) => {
                            out.push(b's');
                            put_keys(&mut out, k);
                        }
                        IndexOp::Remove(k) => {
                            out.push(b'r');
                            put_keys(&mut out, k);
                        }
                        IndexOp::Clear => out.push(b'c'),
                        IndexOp::StoreLower(l, k) | IndexOp::RemoveLower(l, k) => {
                            out.push(match op {
                                IndexOp::StoreLower(..) => b'l',
                                _ => b'm',
                            });
                            out.push(l.index() as u8);
                            put_keys(&mut out, k);
                        }
                    }
                }
            }
            Entry::Decision {
                ep,
                update,
                ttl_ms,
                keys,
                session,
            } => {
                let u = match update {
                    None => 0,
                    Some(Update::Place) => 1,
                    Some(Update::Keep) => 2,
                };
                out.push(b'D');
                out.extend_from_slice(&ep.to_le_bytes());
                out.push(u);
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                put_keys(&mut out, keys);
                if let Some(h) = session {
                    out.push(1);
                    out.extend_from_slice(&h.to_le_bytes());
                }
            }
            Entry::Snapshot { ep, resync } => {
                out.push(b'S');
                out.extend_from_slice(&ep.to_le_bytes());
                out.push(u8::from(*resync));
            }
        }
        out
    }

    /// Decodes an entry.
    pub fn decode(b: &[u8]) -> Result<Entry, CodecError> {
        let mut r = Reader { b, at: 0 };
        let v = r.u8()?;
        if v != VERSION && v != VERSION_U8_EP {
            return Err(CodecError::Version(v));
        }
        match r.u8()? {
            b'O' => {
                let ep = r.ep(v)?;
                let rank = r.u8()?;
                let seq = seq_out(r.u64()?);
                let n = r.u32()? as usize;
                let mut ops = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    ops.push(match r.u8()? {
                        b's' => IndexOp::Store(r.keys()?),
                        b'r' => IndexOp::Remove(r.keys()?),
                        b'c' => IndexOp::Clear,
                        t @ (b'l' | b'm') => {
                            let l = match r.u8()? {
                                0 => Lower::Cpu,
                                1 => Lower::Storage,
                                x => return Err(CodecError::Tag(x)),
                            };
                            match t {
                                b'l' => IndexOp::StoreLower(l, r.keys()?),
                                _ => IndexOp::RemoveLower(l, r.keys()?),
                            }
                        }
                        t => return Err(CodecError::Tag(t)),
                    });
                }
                Ok(Entry::Ops { ep, rank, seq, ops })
            }
            b'D' => {
                let ep = r.ep(v)?;
                let update = match r.u8()? {
                    0 => None,
                    1 => Some(Update::Place),
                    2 => Some(Update::Keep),
                    t => return Err(CodecError::Tag(t)),
                };
                let ttl_ms = r.u32()?;
                let keys = r.keys()?;
                let session = match r.at == r.b.len() {
                    true => None,
                    false => match r.u8()? {
                        0 => None,
                        1 => Some(r.u64()?),
                        t => return Err(CodecError::Tag(t)),
                    },
                };
                Ok(Entry::Decision {
                    ep,
                    update,
                    ttl_ms,
                    keys,
                    session,
                })
            }
            b'S' => Ok(Entry::Snapshot {
                ep: r.ep(v)?,
                resync: r.u8()? != 0,
            }),
            t => Err(CodecError::Tag(t)),
        }
    }
}

/// Encodes several entries as one log payload (a single entry is encoded as itself).
pub fn encode_batch(entries: &[Entry]) -> Vec<u8> {
    if let [one] = entries {
        return one.encode();
    }
    let mut out = vec![VERSION, BATCH];
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        let b = e.encode();
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(&b);
    }
    out
}

/// Decodes a log payload: one entry or a batch, in order.
pub fn decode_batch(b: &[u8]) -> Result<Vec<Entry>, CodecError> {
    if b.get(1) != Some(&BATCH) {
        return Entry::decode(b).map(|e| vec![e]);
    }
    let mut r = Reader { b, at: 0 };
    let v = r.u8()?;
    if v != VERSION && v != VERSION_U8_EP {
        return Err(CodecError::Version(v));
    }
    r.u8()?;
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let len = r.u32()? as usize;
        out.push(Entry::decode(r.take(len)?)?);
    }
    Ok(out)
}

/// One rank's part of an endpoint snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSnap {
    pub rank: u8,
    /// The last publisher sequence applied (resumes a subscription on takeover).
    pub seq: Option<u64>,
    pub keys: Vec<BlockKey>,
}

/// An endpoint's inventory as of log entry `upto` (every entry of this endpoint up to and
/// including `upto` is in it; later entries apply on top).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub upto: String,
    /// Unix milliseconds when it was taken.
    pub taken_ms: u64,
    pub ranks: Vec<RankSnap>,
}

impl Snapshot {
    /// Encodes the snapshot.
    pub fn encode(&self) -> Vec<u8> {
        let n: usize = self.ranks.iter().map(|r| 13 + 8 * r.keys.len()).sum();
        let mut out = Vec::with_capacity(16 + self.upto.len() + n);
        out.extend_from_slice(SNAP_MAGIC);
        out.extend_from_slice(&self.taken_ms.to_le_bytes());
        out.push(self.upto.len().min(255) as u8);
        out.extend_from_slice(&self.upto.as_bytes()[..self.upto.len().min(255)]);
        out.push(self.ranks.len().min(255) as u8);
        for r in self.ranks.iter().take(255) {
            out.push(r.rank);
            out.extend_from_slice(&seq_in(r.seq).to_le_bytes());
            put_keys(&mut out, &r.keys);
        }
        out
    }

    /// Decodes a snapshot.
    pub fn decode(b: &[u8]) -> Result<Snapshot, CodecError> {
        let mut r = Reader { b, at: 0 };
        if r.take(4)? != SNAP_MAGIC {
            return Err(CodecError::Version(b.first().copied().unwrap_or(0)));
        }
        let taken_ms = r.u64()?;
        let n = r.u8()? as usize;
        let at = r.at;
        // A stream id is ASCII: a lossy decode could grow it past the 255 bytes encode keeps.
        let upto = std::str::from_utf8(r.take(n)?)
            .map_err(|_| CodecError::NotUtf8(at))?
            .to_owned();
        let nr = r.u8()?;
        let mut ranks = Vec::with_capacity(nr as usize);
        for _ in 0..nr {
            let rank = r.u8()?;
            let seq = seq_out(r.u64()?);
            let keys = r.keys()?;
            ranks.push(RankSnap { rank, seq, keys });
        }
        Ok(Snapshot {
            upto,
            taken_ms,
            ranks,
        })
    }
}

/// A Redis stream id `ms-seq`, ordered numerically (ids compare as pairs, not as strings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct StreamId {
    pub ms: u64,
    pub seq: u64,
}

impl StreamId {
    /// Parses `ms-seq` (or `ms`); `None` if malformed.
    pub fn parse(s: &str) -> Option<StreamId> {
        let (ms, seq) = s.split_once('-').unwrap_or((s, "0"));
        Some(StreamId {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn k(v: &[u64]) -> Vec<BlockKey> {
        v.iter().map(|x| BlockKey(*x)).collect()
    }

    #[test]
    fn entries_round_trip() {
        let all = [
            Entry::Ops {
                ep: 3,
                rank: 1,
                seq: Some(42),
                ops: vec![
                    IndexOp::Store(k(&[1, u64::MAX])),
                    IndexOp::Remove(k(&[7])),
                    IndexOp::StoreLower(Lower::Cpu, k(&[8, 9])),
                    IndexOp::RemoveLower(Lower::Storage, k(&[10])),
                    IndexOp::Clear,
                ],
            },
            Entry::Ops {
                ep: 0,
                rank: 0,
                seq: None,
                ops: vec![],
            },
            Entry::Decision {
                ep: 1023,
                update: Some(Update::Place),
                ttl_ms: 2000,
                keys: k(&[5, 6]),
                session: None,
            },
            Entry::Decision {
                ep: 1,
                update: None,
                ttl_ms: 0,
                keys: vec![],
                session: Some(u64::MAX - 7),
            },
            Entry::Snapshot {
                ep: 300,
                resync: true,
            },
            Entry::Snapshot {
                ep: 2,
                resync: false,
            },
        ];
        for e in all {
            assert_eq!(Entry::decode(&e.encode()).unwrap(), e);
        }
    }

    #[test]
    fn damaged_entries_are_errors_not_panics() {
        let e = Entry::Ops {
            ep: 1,
            rank: 0,
            seq: Some(1),
            ops: vec![IndexOp::Store(k(&[1, 2, 3]))],
        }
        .encode();
        for cut in 0..e.len() {
            assert!(Entry::decode(&e[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = e.clone();
        bad[0] = 9;
        assert_eq!(Entry::decode(&bad), Err(CodecError::Version(9)));
        assert_eq!(
            CodecError::Version(9).to_string(),
            "replication log entry version 9 is not one this build reads (1, 2)"
        );
        let one = Entry::Snapshot {
            ep: 1,
            resync: false,
        };
        let mut batch = encode_batch(&[one.clone(), one]);
        batch[0] = 3;
        assert_eq!(decode_batch(&batch), Err(CodecError::Version(3)));
        // A lower tier this build does not know.
        let mut tier = Entry::Ops {
            ep: 1,
            rank: 0,
            seq: None,
            ops: vec![IndexOp::StoreLower(Lower::Cpu, k(&[1]))],
        }
        .encode();
        // version, 'O', ep (2), rank, seq (8), op count (4), 'l', then the tier.
        assert_eq!((tier[17], tier[18]), (b'l', 0));
        tier[18] = 7;
        assert_eq!(Entry::decode(&tier), Err(CodecError::Tag(7)));
        // A key count larger than the payload must not allocate it.
        let mut huge = vec![VERSION, b'D', 0, 0, 0, 0, 0, 0, 0];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Entry::decode(&huge).is_err());
    }

    /// Bytes as version 1 wrote them (the endpoint in one byte) still decode.
    #[test]
    fn version_1_entries_still_decode() {
        let mut ops = vec![1, b'O', 7, 2];
        ops.extend_from_slice(&42u64.to_le_bytes());
        ops.extend_from_slice(&1u32.to_le_bytes());
        ops.push(b's');
        ops.extend_from_slice(&1u32.to_le_bytes());
        ops.extend_from_slice(&99u64.to_le_bytes());
        let want_ops = Entry::Ops {
            ep: 7,
            rank: 2,
            seq: Some(42),
            ops: vec![IndexOp::Store(k(&[99]))],
        };
        assert_eq!(Entry::decode(&ops).unwrap(), want_ops);
        let mut dec = vec![1, b'D', 63, 1];
        dec.extend_from_slice(&2000u32.to_le_bytes());
        dec.extend_from_slice(&1u32.to_le_bytes());
        dec.extend_from_slice(&5u64.to_le_bytes());
        let want_dec = Entry::Decision {
            ep: 63,
            update: Some(Update::Place),
            ttl_ms: 2000,
            keys: k(&[5]),
            session: None,
        };
        assert_eq!(Entry::decode(&dec).unwrap(), want_dec);
        let snap = [1, b'S', 9, 1];
        assert_eq!(
            Entry::decode(&snap).unwrap(),
            Entry::Snapshot {
                ep: 9,
                resync: true
            }
        );
        // A version-1 batch of version-1 entries.
        let mut batch = vec![1, b'B'];
        batch.extend_from_slice(&2u32.to_le_bytes());
        for e in [&ops, &dec] {
            batch.extend_from_slice(&(e.len() as u32).to_le_bytes());
            batch.extend_from_slice(e);
        }
        assert_eq!(decode_batch(&batch).unwrap(), vec![want_ops, want_dec]);
        // What this version writes: the endpoint in two bytes, past 255.
        let wide = Entry::Snapshot {
            ep: 1000,
            resync: false,
        }
        .encode();
        assert_eq!(wide, vec![VERSION, b'S', 0xe8, 0x03, 0]);
    }

    #[test]
    fn a_decisions_session_is_an_optional_tail() {
        let with = Entry::Decision {
            ep: 2,
            update: Some(Update::Keep),
            ttl_ms: 10,
            keys: k(&[4]),
            session: Some(0x0102_0304_0506_0708),
        };
        let b = with.encode();
        // What a writer before the tail wrote: the same entry without it binds no session.
        let old = &b[..b.len() - 9];
        assert!(matches!(
            Entry::decode(old),
            Ok(Entry::Decision { session: None, ref keys, .. }) if *keys == k(&[4])
        ));
        let mut zero = old.to_vec();
        zero.push(0);
        assert!(matches!(
            Entry::decode(&zero),
            Ok(Entry::Decision { session: None, .. })
        ));
        let mut bad = old.to_vec();
        bad.push(2);
        assert_eq!(Entry::decode(&bad), Err(CodecError::Tag(2)));
        assert!(matches!(
            Entry::decode(&b[..b.len() - 1]),
            Err(CodecError::Truncated(_))
        ));
    }

    #[test]
    fn batches_round_trip() {
        let a = Entry::Snapshot {
            ep: 1,
            resync: false,
        };
        let b = Entry::Decision {
            ep: 0,
            update: Some(Update::Keep),
            ttl_ms: 5,
            keys: k(&[1, 2, 3]),
            session: Some(9),
        };
        let both = vec![a.clone(), b.clone()];
        assert_eq!(decode_batch(&encode_batch(&both)).unwrap(), both);
        assert_eq!(encode_batch(std::slice::from_ref(&a)), a.encode());
        assert_eq!(decode_batch(&a.encode()).unwrap(), vec![a]);
        let enc = encode_batch(&both);
        for cut in 2..enc.len() {
            assert!(decode_batch(&enc[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn snapshots_round_trip() {
        let s = Snapshot {
            upto: "1733000000000-7".into(),
            taken_ms: 1_733_000_000_123,
            ranks: vec![
                RankSnap {
                    rank: 0,
                    seq: Some(10),
                    keys: k(&[1, 2]),
                },
                RankSnap {
                    rank: 2,
                    seq: None,
                    keys: vec![],
                },
            ],
        };
        assert_eq!(Snapshot::decode(&s.encode()).unwrap(), s);
        assert!(Snapshot::decode(b"KVS0").is_err());
        // A position that is not UTF-8 is refused, not decoded lossily (which could grow it
        // past the 255 bytes encode keeps, so a re-encoded snapshot would differ).
        let mut bad = s.encode();
        bad[4 + 8 + 1] = 0xff;
        assert_eq!(Snapshot::decode(&bad), Err(CodecError::NotUtf8(13)));
    }

    #[test]
    fn stream_ids_order_numerically() {
        let a = StreamId::parse("999-5").unwrap();
        let b = StreamId::parse("1000-0").unwrap();
        assert!(a < b);
        assert_eq!(StreamId::parse("12").unwrap().to_string(), "12-0");
        assert!(StreamId::parse("x-1").is_none());
    }
}
