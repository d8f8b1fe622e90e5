//! The replication log payloads and endpoint snapshots a replica reads from Redis.
//!
//! Besides "no panic": whatever decodes re-encodes to bytes that decode to the same value
//! (the writer and every tailer agree on what an entry means).
#![no_main]

use kvroute_inventory::replica::codec::{decode_batch, encode_batch, Entry, Snapshot, StreamId};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = decode_batch(data) {
        let again = decode_batch(&encode_batch(&entries));
        assert_eq!(again.as_ref(), Ok(&entries), "log payload round trip");
        for e in &entries {
            assert_eq!(
                Entry::decode(&e.encode()).as_ref(),
                Ok(e),
                "entry round trip"
            );
        }
    }
    if let Ok(snap) = Snapshot::decode(data) {
        let again = Snapshot::decode(&snap.encode());
        assert_eq!(again.as_ref(), Ok(&snap), "snapshot round trip");
    }
    if let Ok(s) = std::str::from_utf8(data) {
        if let Some(id) = StreamId::parse(s) {
            assert_eq!(
                StreamId::parse(&id.to_string()),
                Some(id),
                "stream id round trip"
            );
        }
    }
});
