//! The few canonical-CBOR items vLLM's block hash input needs, written straight into a buffer.
//!
//! vLLM serialises `(parent_digest, tuple(token_ids), extra_keys)` with `cbor2.dumps(..., canonical=True)`:
//! shortest-form integer heads, definite lengths, tuples as arrays. Encoding by hand avoids a
//! general CBOR dependency on the hot path and lets the hasher reuse one buffer per request.

/// Appends a CBOR head (major type + argument) in shortest form.
pub(crate) fn head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        out.push(m | arg as u8);
    } else if arg <= u64::from(u8::MAX) {
        out.push(m | 24);
        out.push(arg as u8);
    } else if arg <= u64::from(u16::MAX) {
        out.push(m | 25);
        out.extend_from_slice(&(arg as u16).to_be_bytes());
    } else if arg <= u64::from(u32::MAX) {
        out.push(m | 26);
        out.extend_from_slice(&(arg as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&arg.to_be_bytes());
    }
}

pub(crate) fn array(out: &mut Vec<u8>, len: usize) {
    head(out, 4, len as u64);
}

pub(crate) fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    head(out, 2, b.len() as u64);
    out.extend_from_slice(b);
}

pub(crate) fn text(out: &mut Vec<u8>, s: &str) {
    head(out, 3, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

pub(crate) fn uint(out: &mut Vec<u8>, v: u64) {
    head(out, 0, v);
}

pub(crate) fn null(out: &mut Vec<u8>) {
    out.push(0xf6);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortest_form_heads() {
        let cases: [(u64, &[u8]); 7] = [
            (0, &[0x00]),
            (23, &[0x17]),
            (24, &[0x18, 24]),
            (255, &[0x18, 0xff]),
            (256, &[0x19, 0x01, 0x00]),
            (65536, &[0x1a, 0, 1, 0, 0]),
            (1 << 32, &[0x1b, 0, 0, 0, 1, 0, 0, 0, 0]),
        ];
        for (v, want) in cases {
            let mut out = Vec::new();
            uint(&mut out, v);
            assert_eq!(out, want, "{v}");
        }
    }

    #[test]
    fn seed_string_is_a_text_item() {
        let mut out = Vec::new();
        text(&mut out, "0");
        assert_eq!(out, [0x61, 0x30]);
    }
}
