//! A bounded msgpack cursor over one payload: reads one value's head (marker, number, string
//! bytes, container length) at a time, without building a value tree or copying strings.
//!
//! It accepts exactly what `rmpv::decode::read_value` accepts and fails where and how it fails,
//! so that the streaming decoder ([`super::decode`]) keeps the tree decoder's results
//! ([`super::reference`]) for every input:
//! * the same depth budget ([`MAX_DEPTH`]), spent the same way: one unit per value, one more per
//!   container and per string or binary (two for a string, whose bytes are read as binary), so a
//!   container's children are read with two units less;
//! * the same error, with rmpv's message: the marker byte missing, a fixed-size field missing,
//!   a string, binary or extension body shorter than its length prefix (`Expected N bytes, read
//!   M bytes`), the depth budget spent;
//! * `0xc1` (reserved) reads as nil; strings need not be UTF-8 (callers check where it matters);
//!   bytes after the first value are not read.
//!
//! Bounds: nothing is allocated here; a length prefix only ever selects bytes that are present;
//! every element read consumes at least one byte or fails, so the work is linear in the input.
//! [`Rd::skip`] recurses once per container level, at most [`MAX_DEPTH`] / 2 levels.

use std::fmt;

/// rmpv's default depth budget (`rmpv::decode::MAX_DEPTH`).
pub const MAX_DEPTH: u16 = 1024;

/// Why a payload is not msgpack; `Display` is rmpv's message for the same failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// No byte left for a marker.
    Marker,
    /// No bytes left for a fixed-size number or length.
    Data,
    /// A string, binary or extension body of `len` bytes with only `read` present.
    Short { len: usize, read: usize },
    /// Nested deeper than the budget.
    Depth,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Marker => {
                f.write_str("I/O error while reading marker byte: failed to fill whole buffer")
            }
            Error::Data => {
                f.write_str("I/O error while reading non-marker bytes: failed to fill whole buffer")
            }
            Error::Short { len, read } => write!(
                f,
                "I/O error while reading non-marker bytes: Expected {len} bytes, read {read} bytes"
            ),
            Error::Depth => f.write_str("depth limit exceeded"),
        }
    }
}

/// One value's head: scalars whole, strings and binaries as borrowed bytes, containers as their
/// element count (the elements follow, each to be read at two units of depth less).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    /// An integer >= 0, whatever its encoding.
    Pos(u64),
    /// An integer < 0.
    Neg(i64),
    F32(f32),
    F64(f64),
    /// String bytes, not checked for UTF-8.
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(u32),
    /// Pairs: `2 * n` values follow.
    Map(u32),
}

/// A cursor over one payload.
pub struct Rd<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn spend(depth: u16) -> Result<u16, Error> {
    depth.checked_sub(1).ok_or(Error::Depth)
}

fn int(n: i64) -> Head<'static> {
    if n < 0 {
        Head::Neg(n)
    } else {
        Head::Pos(n as u64)
    }
}

impl<'a> Rd<'a> {
    pub fn new(buf: &'a [u8]) -> Rd<'a> {
        Rd { buf, pos: 0 }
    }

    /// Bytes not yet read (an upper bound on the elements still to come).
    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    #[inline]
    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let end = self.pos.checked_add(N).ok_or(Error::Data)?;
        let arr: [u8; N] = self
            .buf
            .get(self.pos..end)
            .and_then(|s| s.try_into().ok())
            .ok_or(Error::Data)?;
        self.pos = end;
        Ok(arr)
    }

    #[inline]
    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.fixed::<1>()?[0])
    }

    #[inline]
    fn u16(&mut self) -> Result<u16, Error> {
        Ok(u16::from_be_bytes(self.fixed()?))
    }

    #[inline]
    fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(self.fixed()?))
    }

    /// `len` body bytes, at the depth rmpv's `read_bin_data` is called with.
    #[inline]
    fn body(&mut self, len: usize, depth: u16) -> Result<&'a [u8], Error> {
        spend(depth)?;
        let rest = self.buf.get(self.pos..).unwrap_or(&[]);
        match rest.get(..len) {
            Some(b) => {
                self.pos += len;
                Ok(b)
            }
            None => Err(Error::Short {
                len,
                read: rest.len(),
            }),
        }
    }

    /// A string body: rmpv's `read_str_data` spends one unit, then reads it as binary.
    #[inline]
    fn str_body(&mut self, len: usize, depth: u16) -> Result<Head<'a>, Error> {
        let depth = spend(depth)?;
        Ok(Head::Str(self.body(len, depth)?))
    }

    #[inline]
    fn bin_body(&mut self, len: usize, depth: u16) -> Result<Head<'a>, Error> {
        Ok(Head::Bin(self.body(len, depth)?))
    }

    fn ext_body(&mut self, len: usize, depth: u16) -> Result<Head<'a>, Error> {
        let depth = spend(depth)?;
        self.u8()?;
        self.body(len, depth)?;
        Ok(Head::Ext)
    }

    #[inline]
    fn container(n: u32, depth: u16, map: bool) -> Result<Head<'a>, Error> {
        spend(depth)?;
        Ok(if map { Head::Map(n) } else { Head::Array(n) })
    }

    /// The next value when it is a non-negative integer (a positive fixint or uint 8-64), read;
    /// `None`, with nothing read, for anything else or too few bytes. [`Rd::head`] reads such a
    /// value the same way (a scalar spends no depth that could run out): the key arrays' fast
    /// path.
    #[inline]
    pub fn uint(&mut self) -> Option<u64> {
        fn be<const N: usize>(b: &[u8]) -> Option<[u8; N]> {
            b.get(1..=N).and_then(|s| s.try_into().ok())
        }
        let rest = self.buf.get(self.pos..)?;
        let (len, v) = match *rest.first()? {
            m @ 0x00..=0x7f => (1, u64::from(m)),
            0xcc => (2, u64::from(u8::from_be_bytes(be(rest)?))),
            0xcd => (3, u64::from(u16::from_be_bytes(be(rest)?))),
            0xce => (5, u64::from(u32::from_be_bytes(be(rest)?))),
            0xcf => (9, u64::from_be_bytes(be(rest)?)),
            _ => return None,
        };
        self.pos += len;
        Some(v)
    }

    /// Reads up to `n` values in a row that are integers below 2^32 (a positive fixint or a
    /// uint 8, 16 or 32) into `out`, as [`Rd::uint`] reads each, and returns how many it read.
    /// It stops before the first other value and where fewer than 5 bytes are left (those go
    /// through [`Rd::head`], one at a time). Token ids: one bounds check and one branch on the
    /// width per id, no `Option` and no 64-bit detour; the predicted width lets the next id's
    /// read start before this one's is decoded. (Computing the width without a branch was
    /// slower: it chains every id's read on the previous one's.)
    #[inline]
    pub fn u32_run(&mut self, n: usize, out: &mut Vec<u32>) -> usize {
        let mut pos = self.pos;
        let mut read = 0;
        while read < n {
            // The head and the widest body this path reads.
            let Some(&[m, a, b, c, d]) = self.buf.get(pos..pos + 5) else {
                break;
            };
            let (len, v) = match m {
                0x00..=0x7f => (1, u32::from(m)),
                0xcc => (2, u32::from(a)),
                0xcd => (3, u32::from(u16::from_be_bytes([a, b]))),
                0xce => (5, u32::from_be_bytes([a, b, c, d])),
                _ => break,
            };
            out.push(v);
            pos += len;
            read += 1;
        }
        self.pos = pos;
        read
    }

    /// Reads the head of the next value with `depth` units of budget left.
    #[inline]
    pub fn head(&mut self, depth: u16) -> Result<Head<'a>, Error> {
        let d = spend(depth)?;
        let m = *self.buf.get(self.pos).ok_or(Error::Marker)?;
        self.pos += 1;
        Ok(match m {
            0x00..=0x7f => Head::Pos(u64::from(m)),
            0x80..=0x8f => Self::container(u32::from(m & 0x0f), d, true)?,
            0x90..=0x9f => Self::container(u32::from(m & 0x0f), d, false)?,
            0xa0..=0xbf => self.str_body(usize::from(m & 0x1f), d)?,
            0xc0 | 0xc1 => Head::Nil,
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.u8()?;
                self.bin_body(usize::from(n), d)?
            }
            0xc5 => {
                let n = self.u16()?;
                self.bin_body(usize::from(n), d)?
            }
            0xc6 => {
                let n = self.u32()?;
                self.bin_body(n as usize, d)?
            }
            0xc7 => {
                let n = self.u8()?;
                self.ext_body(usize::from(n), d)?
            }
            0xc8 => {
                let n = self.u16()?;
                self.ext_body(usize::from(n), d)?
            }
            0xc9 => {
                let n = self.u32()?;
                self.ext_body(n as usize, d)?
            }
            0xca => Head::F32(f32::from_be_bytes(self.fixed()?)),
            0xcb => Head::F64(f64::from_be_bytes(self.fixed()?)),
            0xcc => Head::Pos(u64::from(self.u8()?)),
            0xcd => Head::Pos(u64::from(self.u16()?)),
            0xce => Head::Pos(u64::from(self.u32()?)),
            0xcf => Head::Pos(u64::from_be_bytes(self.fixed()?)),
            0xd0 => int(i64::from(i8::from_be_bytes(self.fixed()?))),
            0xd1 => int(i64::from(i16::from_be_bytes(self.fixed()?))),
            0xd2 => int(i64::from(i32::from_be_bytes(self.fixed()?))),
            0xd3 => int(i64::from_be_bytes(self.fixed()?)),
            0xd4 => self.ext_body(1, d)?,
            0xd5 => self.ext_body(2, d)?,
            0xd6 => self.ext_body(4, d)?,
            0xd7 => self.ext_body(8, d)?,
            0xd8 => self.ext_body(16, d)?,
            0xd9 => {
                let n = self.u8()?;
                self.str_body(usize::from(n), d)?
            }
            0xda => {
                let n = self.u16()?;
                self.str_body(usize::from(n), d)?
            }
            0xdb => {
                let n = self.u32()?;
                self.str_body(n as usize, d)?
            }
            0xdc => {
                let n = self.u16()?;
                Self::container(u32::from(n), d, false)?
            }
            0xdd => {
                let n = self.u32()?;
                Self::container(n, d, false)?
            }
            0xde => {
                let n = self.u16()?;
                Self::container(u32::from(n), d, true)?
            }
            0xdf => {
                let n = self.u32()?;
                Self::container(n, d, true)?
            }
            0xe0..=0xff => Head::Neg(i64::from(m as i8)),
        })
    }

    /// Reads (and checks) whatever follows `head`, read at `depth`: a container's elements.
    pub fn finish(&mut self, head: Head<'a>, depth: u16) -> Result<(), Error> {
        let n = match head {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => 2 * u64::from(n),
            _ => return Ok(()),
        };
        // `head` spent two units on a container, so `depth >= 2` here.
        let child = depth.saturating_sub(2);
        for _ in 0..n {
            self.skip(child)?;
        }
        Ok(())
    }

    /// Reads (and checks) one whole value.
    pub fn skip(&mut self, depth: u16) -> Result<(), Error> {
        let h = self.head(depth)?;
        self.finish(h, depth)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn uint_reads_what_head_reads_and_nothing_else() {
        let mut cases: Vec<Vec<u8>> = Vec::new();
        for v in [
            0u64,
            1,
            0x7f,
            0x80,
            0xff,
            0x100,
            0xffff,
            0x1_0000,
            u64::from(u32::MAX),
        ]
        .into_iter()
        .chain([1 << 32, u64::MAX])
        {
            let mut b = Vec::new();
            rmpv::encode::write_value(&mut b, &rmpv::Value::from(v)).unwrap();
            cases.push(b);
        }
        // Every width spelled out, even where a shorter one would do.
        cases.extend([
            vec![0xcc, 5],
            vec![0xcd, 0, 5],
            vec![0xce, 0, 0, 0, 5],
            vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 5],
        ]);
        for b in &cases {
            let mut fast = Rd::new(b);
            let mut slow = Rd::new(b);
            let Head::Pos(want) = slow.head(1).unwrap() else {
                panic!("{b:?} is not an unsigned integer")
            };
            assert_eq!((fast.uint(), fast.pos), (Some(want), slow.pos), "{b:?}");
            // Cut short: nothing read, and head reports the error.
            for cut in 0..b.len() {
                let mut short = Rd::new(&b[..cut]);
                assert_eq!((short.uint(), short.pos), (None, 0), "{b:?} cut at {cut}");
                assert!(short.head(1).is_err());
            }
        }
        // Anything else: nothing read.
        for b in [
            &[0xc0][..],
            &[0xd0, 0xff],
            &[0xa1, b'a'],
            &[0x91, 1],
            &[0xcb; 9],
        ] {
            let mut rd = Rd::new(b);
            assert_eq!((rd.uint(), rd.pos), (None, 0), "{b:?}");
        }
    }

    /// Reads `bytes` as `u32_run` then `uint` alternately, as the token decoder does, and as
    /// `uint` alone: the same values, positions and stopping point.
    fn run_then_uint(bytes: &[u8], n: usize) {
        let mut slow = Rd::new(bytes);
        let mut want = Vec::new();
        while want.len() < n {
            match slow.uint() {
                Some(v) => want.push(v),
                None => break,
            }
        }
        let mut fast = Rd::new(bytes);
        let mut got = Vec::new();
        let mut ids = Vec::new();
        while got.len() < n {
            let before = fast.pos;
            let k = fast.u32_run(n - got.len(), &mut ids);
            got.extend(ids.drain(..).map(u64::from));
            assert!(k > 0 || fast.pos == before);
            if got.len() == n {
                break;
            }
            match fast.uint() {
                Some(v) => got.push(v),
                None => break,
            }
        }
        assert_eq!(got, want, "{bytes:02x?}");
        assert_eq!(fast.pos, slow.pos, "{bytes:02x?}");
    }

    #[test]
    fn u32_run_reads_what_uint_reads() {
        // Every width, spelled shortest and longest, the edges of each, and values a run stops
        // at (uint 64 even when small, negatives, a float, a string, nil).
        let values: Vec<Vec<u8>> = vec![
            vec![0x00],
            vec![0x03],
            vec![0x7f],
            vec![0xcc, 0x80],
            vec![0xcc, 0xff],
            vec![0xcc, 0x05],
            vec![0xcd, 0x01, 0x00],
            vec![0xcd, 0xff, 0xff],
            vec![0xcd, 0x00, 0x07],
            vec![0xce, 0x00, 0x01, 0x00, 0x00],
            vec![0xce, 0xff, 0xff, 0xff, 0xff],
            vec![0xce, 0x00, 0x00, 0x00, 0x09],
            vec![0xcf, 0, 0, 0, 0, 0, 0, 0, 5],
            vec![0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
            vec![0xff],
            vec![0xd0, 0x80],
            vec![0xcb, 0, 0, 0, 0, 0, 0, 0, 0],
            vec![0xa1, b'a'],
            vec![0xc0],
        ];
        // Every pair and triple in a row, read whole and cut at every byte (a run stops 5 bytes
        // before the end; the rest is read one by one).
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for i in 0..values.len() {
            for j in 0..values.len() {
                for k in [0, 3, 7, 12, 13] {
                    let b = [values[i].clone(), values[j].clone(), values[k].clone()].concat();
                    for cut in 0..=b.len() {
                        run_then_uint(&b[..cut], 3);
                        run_then_uint(&b[..cut], 1);
                    }
                }
            }
        }
        // Long random runs of ids below 2^32 in mixed widths, with an occasional other value.
        for _ in 0..200 {
            let mut b = Vec::new();
            for _ in 0..64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                b.extend_from_slice(&values[(seed % values.len() as u64) as usize]);
            }
            run_then_uint(&b, 64);
            run_then_uint(&b, 10);
        }
    }

    /// rmpv's verdict and ours on one value, compared by message.
    fn same(bytes: &[u8]) {
        let mut rd = bytes;
        let theirs = rmpv::decode::read_value(&mut rd).map(|_| bytes.len() - rd.len());
        let mut ours = Rd::new(bytes);
        let mine = ours.skip(MAX_DEPTH).map(|()| ours.pos);
        assert_eq!(
            mine.map_err(|e| e.to_string()),
            theirs.map_err(|e| e.to_string()),
            "{bytes:02x?}"
        );
    }

    #[test]
    fn every_marker_and_its_truncations_match_rmpv() {
        for m in 0..=255u8 {
            let mut v = vec![m];
            v.extend([0u8, 0, 0, 2, 0xa1, 0x61, 0x01, 0x02, 0x03, 0x04, 0x05]);
            v.extend([0u8; 20]);
            for cut in 0..=v.len() {
                same(&v[..cut]);
            }
        }
    }

    #[test]
    fn the_depth_budget_is_rmpvs() {
        // rmpv's recursion, unoptimised, needs more than a test thread's stack.
        let t = std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn(depth_budget);
        t.unwrap().join().unwrap();
    }

    fn depth_budget() {
        for depth in 500..520 {
            for leaf in [
                &[0x01u8][..],
                &[0xa1, 0x61],
                &[0xc4, 0x01, 0x00],
                &[0xd4, 0, 0],
                &[0x90],
            ] {
                let mut v = vec![0x91u8; depth];
                v.extend_from_slice(leaf);
                same(&v);
                let mut v = [0x81u8, 0x01].repeat(depth);
                v.extend_from_slice(leaf);
                same(&v);
            }
        }
    }
}
