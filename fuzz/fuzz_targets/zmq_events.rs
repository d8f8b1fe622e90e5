//! vLLM / SGLang KV-event payloads (msgpack `[ts, [events...], dp_rank]`) as the inventory's ZMQ
//! ingest receives them: decoded with both engines' raw-bytes key rules, then keyed in `engine`
//! mode (with the parity self-check) and in `tokens` mode, as one publisher's keyer would.
//!
//! The input is the payload frame. Besides "no panic": the streaming decoder gives the result of
//! the tree decoder it replaced (`reference`) for every input, errors included, and decoding
//! succeeds for both key rules or for neither (they differ only in which 8 digest bytes a
//! raw-bytes key folds).
#![no_main]

use kvroute_core::hash::{BlockSize, Engine, HashAlgo, HashContract};
use kvroute_fuzz::metrics;
use kvroute_inventory::ingest::decode::{decode_batch, decode_batch_into, BytesKey, EventBatch, Spare};
use kvroute_inventory::ingest::keyer::Keyer;
use kvroute_inventory::ingest::reference;
use kvroute_inventory::rules::KeyMode;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let bs16 = BlockSize::new(16).expect("16 is a block size");
    let layouts = [
        (
            BytesKey::Last8,
            Engine::Vllm,
            HashContract::new(HashAlgo::Sha256Cbor, bs16).with_seed("0"),
        ),
        (
            BytesKey::First8,
            Engine::Sglang,
            HashContract::new(HashAlgo::Sha256Sglang, bs16),
        ),
    ];
    let mut ok = Vec::new();
    // The subscriber's path: a batch and key vectors left over from the message before.
    let (mut reused, mut spare) = (EventBatch::default(), Spare::default());
    for (bytes_key, engine, contract) in layouts {
        let batch = decode_batch(data, bytes_key);
        let again = decode_batch_into(data, bytes_key, &mut reused, &mut spare).map(|()| reused.clone());
        assert_eq!(
            format!("{again:?}"),
            format!("{batch:?}"),
            "decoding into a reused batch differs ({bytes_key:?})"
        );
        // Compared by `Debug`: a NaN `ts` equals itself there, and -0.0 differs from 0.0.
        assert_eq!(
            format!("{batch:?}"),
            format!("{:?}", reference::decode_batch(data, bytes_key)),
            "the streaming decoder and the reference disagree ({bytes_key:?})"
        );
        ok.push(batch.is_ok());
        let Ok(batch) = batch else { continue };
        let mut engine_keyer = Keyer::new(engine, KeyMode::Engine, 16, Some(contract), metrics());
        let mut ops = engine_keyer.batch_ops(&batch);
        spare.recycle(&mut ops);
        let mut tokens_keyer = Keyer::new(engine, KeyMode::Tokens, 16, None, metrics());
        let _ = tokens_keyer.batch_ops(&batch);
        // A second pass reuses the engine-key map (parents and removals found this time).
        let _ = tokens_keyer.batch_ops(&batch);
    }
    assert_eq!(ok[0], ok[1], "decode succeeded for one key rule only");
});
