//! The fast byte-level BPE path must give exactly HF tokenizers' ids, on real text and on a
//! generated corpus built to hit the edge cases (whitespace runs, digits, contractions, CJK,
//! emoji, combining marks needing NFC, special tokens inline, control bytes).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

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
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
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
