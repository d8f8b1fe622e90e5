//! The simulator's event encoder against the engines' own bytes: for the same events it writes
//! exactly the payload vLLM 0.33 and SGLang 0.5.23 wrote (golden vectors in shared/tests/vectors),
//! and the keys it publishes are kvroute-core's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvroute_core::hash::{BlockKey, BlockSize, ExtraKeys, HashAlgo, HashContract};
use kvroute_engine_sim::events::{encode_batch, KvEvent, Layout, WireOptions};
use serde_json::Value;

fn vectors(name: &str) -> Value {
    let p = format!(
        "{}/../../shared/tests/vectors/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))).unwrap()
}

fn ts_of(payload: &[u8]) -> f64 {
    assert_eq!(&payload[..2], &[0x93, 0xcb]);
    f64::from_bits(u64::from_be_bytes(payload[2..10].try_into().unwrap()))
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().or_else(|| x.as_i64().map(|i| i as u64)).unwrap())
        .collect()
}

/// Engine-neutral events from the golden's decoded form.
fn events_of(decoded: &Value, block_size: u32) -> Vec<KvEvent> {
    decoded
        .as_array()
        .unwrap()
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "BlockStored" => KvEvent::Stored {
                keys: u64s(&e["block_hashes"]).into_iter().map(BlockKey).collect(),
                parent: e["parent_block_hash"]
                    .as_u64()
                    .or_else(|| e["parent_block_hash"].as_i64().map(|i| i as u64))
                    .map(BlockKey),
                token_ids: u64s(&e["token_ids"])
                    .into_iter()
                    .map(|t| t as u32)
                    .collect(),
                block_size,
                salt: e["cache_salt"].as_str().map(str::to_string),
                media: Vec::new(),
            },
            "BlockRemoved" => KvEvent::Removed {
                keys: u64s(&e["block_hashes"]).into_iter().map(BlockKey).collect(),
            },
            "AllBlocksCleared" => KvEvent::Cleared,
            other => panic!("unexpected event {other}"),
        })
        .collect()
}

#[test]
fn vllm_batches_are_byte_identical_to_vllm_0_33() {
    let v = vectors("vllm-0.33.0.json");
    let golden = &v["events"]["int_keys_default"];
    let frames = golden["pub_frames_hex"].as_array().unwrap();
    let opts = WireOptions::gpu(Layout::Vllm);
    // Batch 0: BlockStored(2 blocks) + BlockRemoved + AllBlocksCleared; batch 1: AllBlocksCleared.
    let tokens: Vec<u32> = (0..32).collect();
    let c = HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(16).unwrap()).with_seed("0");
    let keys = c.keys(&tokens, &ExtraKeys::default()).unwrap();
    let batches = [
        vec![
            KvEvent::Stored {
                keys: keys.clone(),
                parent: None,
                token_ids: tokens.clone(),
                block_size: 16,
                salt: None,
                media: Vec::new(),
            },
            KvEvent::Removed {
                keys: vec![keys[0]],
            },
            KvEvent::Cleared,
        ],
        vec![KvEvent::Cleared],
    ];
    assert_eq!(frames.len(), batches.len());
    for (frame, events) in frames.iter().zip(&batches) {
        let want = hex::decode(frame[2].as_str().unwrap()).unwrap();
        let got = encode_batch(&opts, ts_of(&want), events, Some(0));
        assert_eq!(
            hex::encode(&got),
            hex::encode(&want),
            "the simulator's payload equals vLLM's for the same events"
        );
    }
    assert_eq!(
        hex::encode(encode_batch(
            &opts,
            ts_of(&hex::decode(golden["batch_payload_hex"].as_str().unwrap()).unwrap()),
            &batches[0],
            Some(0)
        )),
        golden["batch_payload_hex"].as_str().unwrap()
    );
}

#[test]
fn sglang_batches_are_byte_identical_to_sglang_0_5_23() {
    let v = vectors("sglang-0.5.23.json");
    let opts = WireOptions::gpu(Layout::Sglang);
    let c = HashContract::new(HashAlgo::Sha256Sglang, BlockSize::new(16).unwrap());
    let mut checked = 0;
    for batch in v["event_batches"].as_array().unwrap() {
        let events = events_of(&batch["decoded_generic"][1], 16);
        for e in &events {
            if let KvEvent::Stored {
                keys,
                parent: None,
                token_ids,
                salt,
                ..
            } = e
            {
                let extra = ExtraKeys {
                    cache_salt: salt.clone(),
                    ..Default::default()
                };
                if salt.is_none() {
                    assert_eq!(
                        &c.keys(token_ids, &extra).unwrap(),
                        keys,
                        "SGLang keys are kvroute-core's"
                    );
                }
            }
        }
        let want = hex::decode(batch["payload_hex"].as_str().unwrap()).unwrap();
        let rank = batch["decoded_generic"][2].as_u64().map(|r| r as u32);
        let got = encode_batch(&opts, ts_of(&want), &events, rank);
        assert_eq!(
            hex::encode(&got),
            hex::encode(&want),
            "batch {}",
            batch["label"]
        );
        checked += 1;
    }
    assert!(checked >= 5, "checked {checked} SGLang batches");
    // The captured PUB frame (rank 1, topic kv-events) too.
    let cap = &v["zmq_wire_capture"];
    let want = hex::decode(cap["frames"][2].as_str().unwrap()).unwrap();
    let events = events_of(&cap["decoded_payload"][1], 16);
    assert_eq!(
        hex::encode(encode_batch(&opts, ts_of(&want), &events, Some(1))),
        hex::encode(&want)
    );
}

#[test]
fn vllm_base_layout_matches_the_handbuilt_minimal_batch() {
    // vLLM 0.24-0.30: eight BlockStored fields. The hand-built vector has medium nil on the store
    // and "GPU" on the removal, so compare the store part under a nil-medium encoder.
    let v = vectors("vllm-0.33.0.json");
    let hexs = v["events"]["minimal_handbuilt"]["payload_hex_data_parallel_rank_3"]
        .as_str()
        .unwrap();
    let want = hex::decode(hexs).unwrap();
    let opts = WireOptions {
        layout: Layout::VllmBase,
        medium: None,
        sliding_window: None,
        lora_name: None,
    };
    let store = KvEvent::Stored {
        keys: vec![BlockKey(1), BlockKey(2)],
        parent: None,
        token_ids: vec![],
        block_size: 16,
        salt: None,
        media: Vec::new(),
    };
    let got = encode_batch(&opts, ts_of(&want), std::slice::from_ref(&store), Some(3));
    // Same header and the same store bytes: [0x93, f64, array(3)] then the map.
    let store_bytes = &got[11..got.len() - 1];
    assert_eq!(&want[..10], &got[..10]);
    assert_eq!(want[10], 0x93);
    assert_eq!(&want[11..11 + store_bytes.len()], store_bytes);
}
