//! Qwen3 chat templates and completions against the reference Python stack.
//!
//! `tests/fixtures/chat/*.json` were written by `scripts/gen-chat-fixtures.py` from
//! transformers' `apply_chat_template` (rendered text) and HF `tokenizers` (ids) on the real
//! Qwen3 tokenizer. Each case's OpenAI request goes through [`Request::from_json`],
//! [`ChatTemplate::render`] and [`Tokenizer::encode`]; text and ids must match byte for byte.
//! The tokenizer comes from `$KVROUTE_TOKENIZER_DIR` or `<repo>/.cache/fixtures/qwen3`
//! (scripts/setup.sh); when it is missing the tests fail, they never skip.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::qwen3_dir;
use kvroute_core::chat::conversation::{build_messages, build_tools};
use kvroute_core::chat::{ChatRequest, ChatTemplate, ContentFormat};
use kvroute_core::prompt::{Prompt, PromptTokens, Request, RequestBody};
use kvroute_core::tokenize::Tokenizer;
use serde_json::Value;

struct Qwen3 {
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

fn qwen3() -> &'static Qwen3 {
    static QWEN3: OnceLock<Qwen3> = OnceLock::new();
    QWEN3.get_or_init(|| {
        let dir = qwen3_dir();
        let tokenizer =
            Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
        let template =
            ChatTemplate::new(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
        Qwen3 {
            tokenizer,
            template,
        }
    })
}

fn fixture(name: &str) -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

/// Where two strings first differ, for a readable failure.
fn first_difference(got: &str, want: &str) -> String {
    let at = got
        .chars()
        .zip(want.chars())
        .take_while(|(a, b)| a == b)
        .count();
    let got: String = got.chars().skip(at.saturating_sub(20)).take(60).collect();
    let want: String = want.chars().skip(at.saturating_sub(20)).take(60).collect();
    format!("at char {at}: got {got:?}, want {want:?}")
}

fn chat_of(request: &Request) -> &ChatRequest {
    match &request.body {
        RequestBody::Chat(chat) => chat,
        RequestBody::Completion(_) => panic!("chat request expected"),
    }
}

#[test]
fn qwen3_chat_fixtures_match_reference_text_and_ids() {
    let q = qwen3();
    let cases = fixture("qwen3-chat.json");
    assert!(
        cases.len() >= 24,
        "expected at least 24 chat fixtures, found {}",
        cases.len()
    );
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let body = serde_json::to_vec(&case["request"]).unwrap();
        let request = match Request::from_json(&body) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{name}: parse: {e}"));
                continue;
            }
        };
        let want_text = case["expected_text"].as_str().unwrap();
        let want_ids: Vec<u32> = serde_json::from_value(case["expected_ids"].clone()).unwrap();
        match q.template.render(chat_of(&request)) {
            Ok(text) if text == want_text => {}
            Ok(text) => failures.push(format!(
                "{name}: text {}",
                first_difference(&text, want_text)
            )),
            Err(e) => failures.push(format!("{name}: render: {e}")),
        }
        match PromptTokens::from_request(&request, &q.tokenizer, Some(&q.template)) {
            Ok(ids) if ids == want_ids => {}
            Ok(ids) => failures.push(format!(
                "{name}: ids differ ({} vs {} tokens)",
                ids.len(),
                want_ids.len()
            )),
            Err(e) => failures.push(format!("{name}: tokens: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} chat fixtures differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The conversation and tools handed to the template equal what the generator handed to
/// transformers, key order included (it shows in `tojson`).
#[test]
fn qwen3_conversation_preparation_matches_reference() {
    let q = qwen3();
    for case in fixture("qwen3-chat.json") {
        let name = case["name"].as_str().unwrap();
        let messages = case["request"]["messages"].as_array().unwrap();
        let built = build_messages(messages, q.template.content_format()).unwrap();
        // The fixture records vLLM's conversation; HF's null-dropping and reasoning aliasing
        // come after it, so compare on messages without reasoning.
        let want = case["conversation"].as_array().unwrap();
        for (got, want) in built.iter().zip(want) {
            if want.get("reasoning").is_none() {
                assert_eq!(
                    serde_json::to_string(got).unwrap(),
                    serde_json::to_string(want).unwrap(),
                    "{name}"
                );
            }
        }
        assert_eq!(built.len(), want.len(), "{name}");
        if let Some(tools) = case["request"]["tools"].as_array() {
            let got = build_tools(tools).unwrap();
            assert_eq!(
                serde_json::to_string(&got).unwrap(),
                serde_json::to_string(&case["tools"]).unwrap(),
                "{name}"
            );
        }
    }
}

#[test]
fn qwen3_completion_fixtures_match_reference_ids() {
    let q = qwen3();
    let cases = fixture("qwen3-completions.json");
    assert!(
        cases.len() >= 8,
        "expected completion fixtures, found {}",
        cases.len()
    );
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["expected_ids"].clone()).unwrap();
        let want_plain: Vec<u32> =
            serde_json::from_value(case["expected_ids_without_special_tokens"].clone()).unwrap();
        let request = Request::from_json(&serde_json::to_vec(&case["request"]).unwrap()).unwrap();
        assert_eq!(
            PromptTokens::from_request(&request, &q.tokenizer, None).unwrap(),
            want,
            "{name}"
        );
        let RequestBody::Completion(Prompt::Text(text)) = &request.body else {
            panic!("{name}: text prompt expected")
        };
        assert_eq!(
            q.tokenizer.encode(text, false).unwrap(),
            want_plain,
            "{name}"
        );
        // The one-element array form is the same prompt.
        let wrapped = serde_json::json!({"model": "m", "prompt": [text]});
        let request = Request::from_json(&serde_json::to_vec(&wrapped).unwrap()).unwrap();
        assert_eq!(
            PromptTokens::from_request(&request, &q.tokenizer, None).unwrap(),
            want,
            "{name} as [text]"
        );
    }
}

#[test]
fn qwen3_token_id_prompts_pass_through_and_chat_needs_a_template() {
    let q = qwen3();
    let request = Request::from_json(br#"{"model": "m", "prompt": [[151644, 872, 198]]}"#).unwrap();
    assert_eq!(
        PromptTokens::from_request(&request, &q.tokenizer, None).unwrap(),
        vec![151644, 872, 198]
    );
    let chat =
        Request::from_json(br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#)
            .unwrap();
    assert!(PromptTokens::from_request(&chat, &q.tokenizer, None).is_err());
    // Qwen3's special tokens are single ids; its tokenizer adds no BOS for completions.
    assert_eq!(q.tokenizer.token_to_id("<|im_start|>"), Some(151644));
    assert_eq!(
        q.tokenizer.encode("<|im_start|>", true).unwrap(),
        vec![151644]
    );
}

#[test]
fn qwen3_images_are_not_routed() {
    let q = qwen3();
    let body = br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}"#;
    let request = Request::from_json(body).unwrap();
    let err = PromptTokens::from_request(&request, &q.tokenizer, Some(&q.template)).unwrap_err();
    assert!(err.to_string().contains("image_url"), "{err}");
}

/// Other models' templates (Llama 3, Gemma 3 with "openai" content, DeepSeek V3) and a
/// kitchen-sink template of the Jinja2/Python features HF templates use: rendered text (or the
/// template's own `raise_exception` message) equals HF's. Needs no tokenizer: text only.
#[test]
fn other_templates_match_reference_text() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/templates.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let clock = doc["clock_unix_seconds"].as_i64().unwrap();
    let mut failures = Vec::new();
    let mut count = 0;
    for group in doc["templates"].as_array().unwrap() {
        let name = group["template"].as_str().unwrap();
        let mut template =
            ChatTemplate::new(&serde_json::to_vec(&group["tokenizer_config"]).unwrap()).unwrap();
        template.set_clock(std::sync::Arc::new(move || clock));
        let want_format = match group["content_format"].as_str().unwrap() {
            "openai" => ContentFormat::OpenAi,
            _ => ContentFormat::String,
        };
        assert_eq!(
            template.content_format(),
            want_format,
            "{name}: vLLM's content format"
        );
        for case in group["cases"].as_array().unwrap() {
            count += 1;
            let label = format!("{name}/{}", case["name"].as_str().unwrap());
            let request =
                Request::from_json(&serde_json::to_vec(&case["request"]).unwrap()).unwrap();
            let rendered = template.render(chat_of(&request));
            match (
                rendered,
                case["expected_text"].as_str(),
                case["expected_error"].as_str(),
            ) {
                (Ok(text), Some(want), _) if text == want => {}
                (Ok(text), Some(want), _) => {
                    failures.push(format!("{label}: {}", first_difference(&text, want)))
                }
                (Err(e), _, Some(want)) if e.to_string().contains(want) => {}
                (Err(e), _, _) => failures.push(format!("{label}: unexpected error {e}")),
                (Ok(text), None, _) => {
                    failures.push(format!("{label}: rendered {text:?}, expected an error"))
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} template cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
