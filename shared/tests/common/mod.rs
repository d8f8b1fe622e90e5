//! What the core's integration suites share: the cached Qwen3 fixture and a deterministic
//! pseudo-random source for bounded mutation runs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::path::PathBuf;

/// The Qwen3 tokenizer fixture: `$KVROUTE_TOKENIZER_DIR` or `<repo>/.cache/fixtures/qwen3`
/// (scripts/setup.sh). Missing means failure: the suites never skip.
pub fn qwen3_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file(),
        "tokenizer fixture missing: run ./scripts/test.sh (it runs scripts/setup.sh); looked in {}",
        dir.display()
    );
    dir
}

/// xorshift64 from `seed`: the same sequence on every run.
pub fn rng(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}
