//! TensorRT-LLM `POST /kv_cache_events` drain bodies as the inventory's poller receives them:
//! parsed as JSON, and when an array, keyed by one endpoint's keyer in `engine` mode
//! (`blockhash_trtllm` re-hash) and `tokens` mode, with block sizes 1, 4 and 32.
#![no_main]

use kvroute_core::hash::Engine;
use kvroute_fuzz::metrics;
use kvroute_inventory::ingest::keyer::Keyer;
use kvroute_inventory::rules::KeyMode;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    // What the poller does: `r.json::<Value>()`, then only an array is keyed.
    let Ok(Value::Array(events)) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    for block_size in [1, 4, 32] {
        for mode in [KeyMode::Engine, KeyMode::Tokens] {
            let mut keyer = Keyer::new(Engine::Trtllm, mode, block_size, None, metrics());
            let _ = keyer.trtllm_ops(&events);
            // The next drain sees the map the first one built.
            let _ = keyer.trtllm_ops(&events);
        }
    }
});
