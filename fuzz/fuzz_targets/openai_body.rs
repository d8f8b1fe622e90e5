//! OpenAI and Anthropic Messages request bodies through the filter's whole prompt path: prompt
//! extraction (`Request::from_json`, and `Request::from_json_for` `/v1/messages` with vLLM's
//! Anthropic conversion), the Qwen3 chat template (cut before a first media item), the fast
//! exact BPE behind the segment cache, and block hashing for every engine contract (with the
//! filter's prefix key cache).
//!
//! The tokenizer fixture is read from `$KVROUTE_TOKENIZER_DIR` (`source .cache/env.sh`).
//! Besides "no panic", differential checks:
//! * the fast encoder (cold caches, then warm) gives exactly HF `tokenizers`' ids under the same
//!   prefix bounds (a prefix of them when it stopped before a long piece, which HF merges);
//! * the key cache gives exactly the uncached keys, after seeing a prefix of the same tokens;
//! * the native Qwen3 renderer gives exactly the Jinja VM's text (or the VM renders alone).
//!
//! Bodies over [`MAX_BODY`] bytes are skipped, so a slow path shows up as a per-input timeout.
#![no_main]

use std::sync::Arc;

use kvroute_core::chat::ChatTemplate;
use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo, HashContract};
use kvroute_core::bpe::{PrefixCap, Truncation, MAX_PREFIX_TOKENS};
use kvroute_core::prompt::{Endpoint, PromptTokens, Request, RequestBody};
use kvroute_core::tokenize::Tokenizer;
use kvroute_filter::cache::KeyCache;
use kvroute_filter::tokens::PromptEncoder;
use libfuzzer_sys::fuzz_target;

/// Largest body fuzzed, in bytes (keep `MAX_LEN` in scripts/fuzz.sh equal): large enough for
/// pre-tokenizer pieces past the fast BPE's 8 KiB long-piece bound.
const MAX_BODY: usize = 65536;

struct Fixture {
    fast: PromptEncoder,
    hf: Tokenizer,
    template: ChatTemplate,
    /// The same template rendered by the Jinja VM only.
    jinja: ChatTemplate,
}

fn load_fixture() -> Fixture {
    let dir = std::env::var("KVROUTE_TOKENIZER_DIR")
        .expect("KVROUTE_TOKENIZER_DIR is unset: run `source .cache/env.sh` first");
    let read = |name: &str| {
        let path = std::path::Path::new(&dir).join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    };
    let tokenizer_json = read("tokenizer.json");
    let config_json = read("tokenizer_config.json");
    let fast = PromptEncoder::load(&tokenizer_json, Some(&config_json)).expect("filter encoder");
    assert!(fast.is_fast(), "the Qwen3 fixture takes the fast path");
    let hf = Tokenizer::from_bytes(&tokenizer_json).expect("HF tokenizer");
    let mut template = ChatTemplate::new(&config_json).expect("chat template");
    // The filter's clock reads 0 until the host sets it; render with the same instant.
    template.set_clock(Arc::new(|| 0));
    let mut jinja = ChatTemplate::new(&config_json).expect("chat template");
    jinja.set_clock(Arc::new(|| 0));
    jinja.set_native(false);
    Fixture {
        fast,
        hf,
        template,
        jinja,
    }
}

thread_local! {
    // The filter's encoder is single-threaded (a RefCell cache), as libFuzzer's loop is.
    static FIXTURE: Fixture = load_fixture();
}

fn contracts() -> Vec<HashContract> {
    let bs = BlockSize::new(16).expect("16 is a block size");
    vec![
        HashContract::new(HashAlgo::Sha256Cbor, bs).with_seed("0"),
        HashContract::new(HashAlgo::XxhashCbor, bs).with_seed("0"),
        HashContract::new(HashAlgo::Sha256Sglang, bs),
        HashContract::new(HashAlgo::BlockhashTrtllm, bs),
        HashContract::new(HashAlgo::Tokens, bs),
    ]
}

fuzz_target!(
    // Loading the Qwen3 vocabulary twice takes about a second: before the per-input timeout.
    init: FIXTURE.with(|_| ()),
    |data: &[u8]| {
        if data.len() > MAX_BODY {
            return;
        }
        FIXTURE.with(|f| check(f, data));
    }
);

fn check(f: &Fixture, data: &[u8]) {
    if let Ok(request) = Request::from_json(data) {
        check_request(f, &request);
    }
    if let Ok(request) = Request::from_json_for(data, Endpoint::Messages) {
        check_request(f, &request);
    }
}

fn check_request(f: &Fixture, request: &Request) {
    if let RequestBody::Chat(chat) = &request.body {
        assert_eq!(
            f.template.render(chat),
            f.jinja.render(chat),
            "native render differs from the Jinja VM"
        );
    }
    let cap = PrefixCap::tokens(MAX_PREFIX_TOKENS);
    let want = PromptTokens::prefix_from_request(request, &f.hf, Some(&f.template), cap);
    f.fast.clear_caches();
    let cold = f.fast.tokens(request).map(|(ids, s, _)| (ids, s.truncated));
    let warm = f.fast.tokens(request).map(|(ids, _, _)| ids);
    let ids = match (&want, &cold) {
        (Ok((want, _)), Ok((cold, Some(Truncation::LongPiece)))) => {
            assert!(
                want.starts_with(cold),
                "fast encoder stopped before a long piece off HF tokenizers' ids"
            );
            cold.clone()
        }
        (Ok((want, why)), Ok((cold, cold_why))) => {
            assert_eq!(
                cold, want,
                "fast encoder (cold caches) differs from HF tokenizers"
            );
            assert_eq!(cold_why, why, "the fast encoder stops for another reason");
            want.clone()
        }
        (Err(_), Err(_)) => return,
        (want, cold) => {
            panic!("HF and fast encoder disagree on success: HF {want:?}, fast {cold:?}")
        }
    };
    assert_eq!(
        warm.as_ref().ok(),
        Some(&ids),
        "fast encoder (warm caches) differs"
    );

    let extra = ExtraKeys {
        cache_salt: request.cache_salt.clone(),
        ..ExtraKeys::default()
    };
    for contract in contracts() {
        let Ok(keys) = contract.keys(&ids, &extra) else {
            continue;
        };
        let mut cache = KeyCache::default();
        let half = &ids[..ids.len() / 2];
        let (prefix, _) = cache
            .keys(&contract, &extra, half)
            .expect("hasher built once already");
        assert_eq!(
            prefix.as_slice(),
            &keys[..prefix.len()],
            "{} prefix keys",
            contract.algo
        );
        let (cached, _) = cache
            .keys(&contract, &extra, &ids)
            .expect("hasher built once already");
        assert_eq!(cached, keys, "{} keys through the key cache", contract.algo);
    }
}
