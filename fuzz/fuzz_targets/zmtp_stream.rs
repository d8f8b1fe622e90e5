//! The byte stream a ZeroMQ publisher sends the inventory's subscriber (ZMTP 3.0): the greeting
//! (its first 64 bytes), then frames: messages and commands, `READY` properties included.
//!
//! Besides "no panic": every item spans at least one byte and no more than the bytes given, its
//! frames lie inside it and add up to at most the message limit, and parsing the stream as it
//! arrives in two pieces (cut where the input's first byte says) gives the items parsing it whole
//! gives, errors included.
#![no_main]

use kvroute_inventory::ingest::zmtp::{
    check_greeting, check_ready, property, Decoder, Item, Role, ZmtpError, GREETING_LEN,
    MAX_MESSAGE_BYTES,
};
use libfuzzer_sys::fuzz_target;

/// The items of `stream` (as byte vectors) up to the first error or the incomplete tail, the bytes
/// arriving in two pieces cut at `cut`.
fn items(stream: &[u8], cut: usize) -> (Vec<Vec<Vec<u8>>>, Option<String>) {
    let mut dec = Decoder::default();
    let (mut start, mut end, mut out) = (0usize, cut.min(stream.len()), Vec::new());
    loop {
        match dec.parse(&stream[start..end]) {
            Ok(Some((item, n))) => {
                assert!(n > 0 && start + n <= end, "an item of {n} bytes at {start}..{end}");
                let b = &stream[start..start + n];
                match item {
                    Item::Message => {
                        let mut total = 0u64;
                        let mut frames = Vec::new();
                        for r in dec.frames() {
                            assert!(r.start <= r.end && r.end <= n, "frame {r:?} outside {n}");
                            total += (r.end - r.start) as u64;
                            frames.push(b[r.clone()].to_vec());
                        }
                        assert!(total <= MAX_MESSAGE_BYTES);
                        out.push(frames);
                    }
                    Item::Command { name, data } => {
                        assert!(name.end <= data.start && data.end <= n);
                        for role in [Role::Sub, Role::Dealer] {
                            let _ = check_ready(&b[name.clone()], &b[data.clone()], role);
                        }
                        let _ = property(&b[data.clone()], "Socket-Type");
                        out.push(vec![b[name].to_vec(), b[data].to_vec()]);
                    }
                }
                start += n;
            }
            Ok(None) if end < stream.len() => end = stream.len(),
            Ok(None) => return (out, None),
            Err(e) => return (out, Some(describe(&e))),
        }
    }
}

fn describe(e: &ZmtpError) -> String {
    e.to_string()
}

fuzz_target!(|data: &[u8]| {
    let (greeting, rest) = data.split_at(data.len().min(GREETING_LEN));
    if let Ok(g) = <&[u8; GREETING_LEN]>::try_from(greeting) {
        let _ = check_greeting(g);
    }
    let cut = usize::from(data.first().copied().unwrap_or(0)) * rest.len() / 256;
    let whole = items(rest, rest.len());
    assert_eq!(items(rest, cut), whole, "parsed in two pieces (cut at {cut})");
});
