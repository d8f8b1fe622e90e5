//! The fast byte-level BPE path must give exactly HF tokenizers' ids, on real text and on a
//! generated corpus built to hit the edge cases (whitespace runs, digits, contractions, CJK,
//! emoji, combining marks needing NFC, special tokens inline, control bytes).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;

use common::rng;
use kvroute_core::bpe::FastBpe;

fn tokenizer_dir() -> PathBuf {
    std::env::var_os("KVROUTE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/fixtures/qwen3")
        })
}

fn load() -> (tokenizers::Tokenizer, FastBpe) {
    let path = tokenizer_dir().join("tokenizer.json");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!("tokenizer fixture missing at {}: {e}; run ./scripts/test.sh (it runs scripts/setup.sh)", path.display())
    });
    let hf = tokenizers::Tokenizer::from_bytes(&bytes).unwrap();
    let fast = FastBpe::from_tokenizer_json(&bytes)
        .unwrap()
        .expect("Qwen3's tokenizer.json is a supported shape");
    (hf, fast)
}

/// Deterministic corpus: fragments chosen to stress every alternative of Qwen's split regex.
fn corpus() -> Vec<String> {
    const FRAGMENTS: &[&str] = &[
        "Hello",
        " world",
        "!",
        " It's",
        " we'll",
        " THEY'RE",
        " you'VE",
        "'d",
        "\n",
        "\n\n",
        "\r\n",
        "   ",
        "\t",
        " \n ",
        "12345",
        " 3.14159",
        "0x7fff",
        " 日本語のテキスト",
        "中文分词测试",
        " 한국어",
        " Ελληνικά",
        " русский текст",
        " العربية",
        " हिन्दी",
        " 🚀🔥",
        "👩‍👩‍👧‍👦",
        " e\u{301}",
        "A\u{30a}",
        "\u{1100}\u{1161}",
        " ﬁ",
        " Ｆｕｌｌ",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        " fn main() {",
        "}",
        "    let x = 1;",
        "\u{0}",
        "\u{7}",
        "\u{feff}",
        "\u{a0}",
        "\u{2028}",
        " — ",
        "...",
        "!!!",
        "?!",
        " $",
        "%",
        "&&",
        "||",
        " __init__",
        "camelCaseWord",
        " snake_case_word",
        "https://example.com/a?b=c",
        " @user",
        " #tag",
        " ",
        "  ",
        "a",
        "I",
    ];
    let mut next = rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    for _ in 0..600 {
        let n = 1 + (next() % 40) as usize;
        let s: String = (0..n)
            .map(|_| FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize])
            .collect();
        out.push(s);
    }
    out
}

fn fixture_texts() -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let mut out = Vec::new();
    for name in ["qwen3-chat.json", "qwen3-completions.json"] {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap();
        for case in v["cases"].as_array().unwrap() {
            if let Some(t) = case["expected_text"].as_str() {
                out.push(t.to_owned());
            }
            if let Some(p) = case.pointer("/request/prompt").and_then(|p| p.as_str()) {
                out.push(p.to_owned());
            }
        }
    }
    assert!(
        out.len() >= 30,
        "expected the chat fixtures' texts, found {}",
        out.len()
    );
    out
}

#[test]
fn fast_bpe_matches_hf_tokenizers_exactly() {
    let (hf, fast) = load();
    let texts: Vec<String> = fixture_texts().into_iter().chain(corpus()).collect();
    let mut tokens = 0usize;
    for (i, text) in texts.iter().enumerate() {
        let want = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let got = fast.encode(text);
        assert_eq!(got, want, "text #{i} {text:?}");
        tokens += want.len();
    }
    assert!(tokens > 20_000, "corpus too small: {tokens} tokens");
}

#[test]
fn long_document_matches_and_repeats_identically() {
    let (hf, fast) = load();
    let doc: String = corpus().concat();
    let want = hf.encode(doc.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(fast.encode(&doc), want);
    // Second pass is served from the piece cache and must not change a single id.
    assert_eq!(fast.encode(&doc), want);
}

/// The largest char boundary of `s` at or before `at`.
fn floor_char_boundary(s: &str, at: usize) -> usize {
    (0..=at.min(s.len()))
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

/// xorshift64 over a fixed seed.
/// Long single pieces (one run of letters is one pre-token): random letters of several
/// scripts, one repeated letter, repeated syllables, digit runs, whitespace and punctuation runs.
#[test]
fn long_words_match_hf_tokenizers() {
    let (hf, fast) = load();
    let mut next = rng(0x9e37_79b9_7f4a_7c15);
    let mut pick = |alphabet: &[char], n: usize| -> String {
        (0..n)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect()
    };
    let latin: Vec<char> = ('a'..='z').chain('A'..='Z').collect();
    let mixed: Vec<char> = "aeioustrnkéüßжщяλωمرحبا中文字日本語한국어ก"
        .chars()
        .collect();
    let mut words = vec![
        "a".repeat(20_000),
        "ab".repeat(10_000),
        "xyz".repeat(7_000),
        "é".repeat(5_000),
        "中".repeat(5_000),
        "1234567890".repeat(2_000),
        " ".repeat(10_000),
        "=".repeat(10_000),
        "\n".repeat(5_000),
    ];
    for n in [1_000, 10_000, 30_000] {
        words.push(pick(&latin, n));
        words.push(pick(&mixed, n / 3));
    }
    for (i, w) in words.iter().enumerate() {
        let want = hf.encode(w.as_str(), false).unwrap().get_ids().to_vec();
        fast.clear_cache();
        assert_eq!(fast.encode(w), want, "word #{i} ({} bytes)", w.len());
        // With a prefix in front and a normal sentence after it.
        let text = format!("Say: {w}, then stop.");
        let want = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(fast.encode(&text), want, "text around word #{i}");
    }
}

/// Under a cap the ids are exactly the first ids of HF's encode, cut only between pieces; a
/// 1M-character word and 1 MB of prose both stay within it, and the reason is reported.
#[test]
fn prefix_cap_keeps_the_first_ids_exact() {
    use kvroute_core::bpe::{PrefixCap, Truncation, MAX_PIECE_BYTES};
    let (hf, fast) = load();
    let text: String = corpus().concat();
    let want = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    for n in [
        0,
        1,
        7,
        100,
        1000,
        4096,
        want.len() - 1,
        want.len(),
        want.len() + 5,
    ] {
        fast.clear_cache();
        let (ids, why) = fast.encode_prefix(&text, PrefixCap::tokens(n));
        assert_eq!(ids[..], want[..n.min(want.len())], "cap {n}");
        assert_eq!(
            why,
            (n < want.len()).then_some(Truncation::MaxTokens),
            "cap {n}"
        );
    }

    // 1 MB of prose: exactly the cap's count of HF's first ids.
    let mut prose = String::new();
    while prose.len() < 1 << 20 {
        prose.push_str(&text);
    }
    prose.truncate(floor_char_boundary(&prose, 1 << 20));
    let (ids, why) = fast.encode_prefix(&prose, PrefixCap::tokens(16_384));
    assert_eq!(ids.len(), 16_384);
    assert_eq!(why, Some(Truncation::MaxTokens));
    let head = &prose[..floor_char_boundary(&prose, 200_000)];
    let want = hf.encode(head, false).unwrap().get_ids().to_vec();
    assert_eq!(ids[..], want[..16_384]);

    // A 1M-character word: the ids before it, and the word is not merged.
    let word = format!("Summarise <|im_start|> this: {}", "a".repeat(1_000_000));
    let (ids, why) = fast.encode_prefix(&word, PrefixCap::tokens(16_384));
    let want = hf
        .encode("Summarise <|im_start|> this:", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids, want);
    assert_eq!(why, Some(Truncation::LongPiece));
    // A word just within the bound is merged (and matches HF); one byte more is not.
    let at = format!("x {}", "b".repeat(MAX_PIECE_BYTES - 1));
    let want = hf.encode(at.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(
        fast.encode_prefix(&at, PrefixCap::tokens(16_384)),
        (want, None)
    );
    let over = format!("x {}", "b".repeat(MAX_PIECE_BYTES));
    assert_eq!(
        fast.encode_prefix(&over, PrefixCap::tokens(16_384)),
        (
            vec![hf.token_to_id("x").unwrap()],
            Some(Truncation::LongPiece)
        )
    );
}
