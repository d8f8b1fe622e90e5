//! Byte comparison for the Wasm build, eight bytes at a time.
//!
//! On `wasm32-unknown-unknown` there is no libc: `memcmp` and `bcmp` come from Rust's
//! `compiler_builtins`, which compares one byte per loop step (and links them weakly so a program
//! can supply its own). Every slice or string equality in the filter ends there: the segment
//! cache compares each cached message's full text, the key cache each block's token ids, hash
//! maps their keys. Here the comparison reads eight bytes per step (Wasm loads need no alignment)
//! and only the tail byte by byte; the module exports it as `memcmp` and `bcmp`, which replace the
//! builtins. Native builds keep their libc and test the same comparison through [`compare`].

use std::cmp::Ordering;
use std::ffi::c_int;

/// The order of two byte runs as `memcmp` gives it (what the module's `memcmp` and `bcmp` run),
/// then the shorter first.
pub fn compare(a: &[u8], b: &[u8]) -> Ordering {
    let n = a.len().min(b.len());
    // SAFETY: both slices are readable for n bytes.
    let c = unsafe { compare_raw(a.as_ptr(), b.as_ptr(), n) };
    c.cmp(&0).then(a.len().cmp(&b.len()))
}

/// The sign of the first differing byte of `n` bytes at `p` and `q` (as unsigned bytes), 0 when
/// they are equal: eight bytes per step, then the tail byte by byte.
///
/// # Safety
/// `p` and `q` are readable for `n` bytes (the C contract of `memcmp`).
#[inline(always)]
unsafe fn compare_raw(p: *const u8, q: *const u8, n: usize) -> c_int {
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n and both runs are readable for n bytes; read_unaligned has no
        // alignment requirement.
        let (x, y) = unsafe {
            (
                p.add(i).cast::<u64>().read_unaligned(),
                q.add(i).cast::<u64>().read_unaligned(),
            )
        };
        if x != y {
            // As big-endian integers the first byte is the most significant: integer order is
            // byte order.
            return if u64::from_be(x) < u64::from_be(y) {
                -1
            } else {
                1
            };
        }
        i += 8;
    }
    while i < n {
        // SAFETY: i < n.
        let (x, y) = unsafe { (*p.add(i), *q.add(i)) };
        if x != y {
            return c_int::from(x) - c_int::from(y);
        }
        i += 1;
    }
    0
}

#[cfg(target_arch = "wasm32")]
mod exported {
    use std::ffi::c_int;

    /// C's `memcmp`, replacing `compiler_builtins`' byte loop in the module.
    ///
    /// # Safety
    /// `s1` and `s2` are readable for `n` bytes.
    #[no_mangle]
    pub unsafe extern "C" fn memcmp(s1: *const u8, s2: *const u8, n: usize) -> c_int {
        // SAFETY: the caller's contract.
        unsafe { super::compare_raw(s1, s2, n) }
    }

    /// C's `bcmp` (zero iff equal), which LLVM calls for equality-only comparisons.
    ///
    /// # Safety
    /// `s1` and `s2` are readable for `n` bytes.
    #[no_mangle]
    pub unsafe extern "C" fn bcmp(s1: *const u8, s2: *const u8, n: usize) -> c_int {
        // SAFETY: the caller's contract.
        unsafe { super::compare_raw(s1, s2, n) }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The byte loop `compiler_builtins` runs, as the reference.
    fn bytewise(a: &[u8], b: &[u8]) -> Ordering {
        a.iter()
            .zip(b)
            .map(|(x, y)| x.cmp(y))
            .find(|o| o.is_ne())
            .unwrap_or(a.len().cmp(&b.len()))
    }

    #[test]
    fn word_compare_orders_as_the_byte_loop() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..20_000 {
            let n = (next() % 70) as usize;
            let a: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            let mut b = a.clone();
            // Equal, or one byte changed at any place (the word's first, middle, last, the
            // tail), including a change across the sign bit (0x7f / 0x80: bytes are unsigned).
            if n > 0 && next() % 4 != 0 {
                let at = (next() % n as u64) as usize;
                b[at] = match next() % 3 {
                    0 => b[at].wrapping_add(1),
                    1 => b[at] ^ 0x80,
                    _ => next() as u8,
                };
            }
            assert_eq!(compare(&a, &b), bytewise(&a, &b), "{a:?} {b:?}");
            assert_eq!(compare(&b, &a), bytewise(&b, &a), "{b:?} {a:?}");
        }
        assert_eq!(compare(b"abcdefgh1", b"abcdefgh2"), Ordering::Less);
        assert_eq!(compare(&[0x80; 9], &[0x7f; 9]), Ordering::Greater);
        assert_eq!(compare(b"abc", b"abcd"), Ordering::Less);
        assert_eq!(compare(b"", b""), Ordering::Equal);
    }
}
