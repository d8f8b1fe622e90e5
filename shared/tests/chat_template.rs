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
use kvroute_core::chat::native::{self, Native};
use kvroute_core::chat::{ChatRequest, ChatTemplate, ContentFormat};
use kvroute_core::prompt::{Endpoint, Prompt, PromptTokens, Request, RequestBody};
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
        let built = build_messages(messages, q.template.content_format(), None).unwrap();
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

/// Conversations with images, audio or video: the ids routed on are exactly the engine's ids
/// before the first item's placeholder, less the last one. The engine's prompt is rendered as
/// vLLM builds it for a Qwen-VL model (the item's placeholder in front of its message's text) and
/// tokenized whole; text-only conversations are routed whole.
#[test]
fn qwen3_media_requests_are_routed_on_the_ids_before_the_first_item() {
    let q = qwen3();
    let vision_start = q.tokenizer.token_to_id("<|vision_start|>").unwrap();
    let placeholder = "<|vision_start|><|image_pad|><|vision_end|>";
    let media = [
        serde_json::json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}),
        serde_json::json!({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}),
        serde_json::json!({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}),
    ];
    let roles = ["system", "user", "assistant", "user", "user"];
    let mut r = Rng(11);
    let mut cut = 0;
    for case in 0..600 {
        let n = 1 + (r.next() % 6) as usize;
        let messages: Vec<Value> = (0..n)
            .map(|_| {
                let role = *r.pick(&roles);
                let mut parts: Vec<Value> = (0..r.next() % 3)
                    .map(|_| serde_json::json!({"type": "text", "text": text(&mut r)}))
                    .collect();
                if role == "user" && r.next() % 3 == 0 {
                    let at = (r.next() % (parts.len() as u64 + 1)) as usize;
                    parts.insert(at, r.pick(&media).clone());
                }
                serde_json::json!({"role": role, "content": parts})
            })
            .collect();
        let mut chat = ChatRequest::new(messages);
        chat.add_generation_prompt = r.next() % 4 != 0;
        let body = serde_json::json!({"messages": chat.messages, "add_generation_prompt": chat.add_generation_prompt});
        let request = Request::from_json(body.to_string().as_bytes()).unwrap();
        let (routed, truncated) = PromptTokens::prefix_from_request(
            &request,
            &q.tokenizer,
            Some(&q.template),
            kvroute_core::bpe::PrefixCap::tokens(kvroute_core::bpe::MAX_PREFIX_TOKENS),
        )
        .unwrap();
        let engine_text = q.template.render_with_media(&chat, placeholder).unwrap();
        let engine = q.tokenizer.encode(&engine_text, false).unwrap();
        let context = serde_json::to_string(&chat.messages).unwrap();
        match engine.iter().position(|&t| t == vision_start) {
            Some(p) => {
                cut += 1;
                assert_eq!(
                    truncated,
                    Some(kvroute_core::bpe::Truncation::Media),
                    "case {case}: {context}"
                );
                assert_eq!(
                    routed[..],
                    engine[..p.saturating_sub(1)],
                    "case {case}: {context}"
                );
            }
            None => {
                assert_eq!(truncated, None, "case {case}: {context}");
                assert_eq!(routed, engine, "case {case}: {context}");
            }
        }
    }
    assert!(cut > 150, "only {cut} conversations held media");
}

/// Anthropic Messages bodies: converted to the chat request vLLM 0.28's own conversion code
/// produced (messages, and tools as vLLM dumps them), rendered to the same ids; a body with
/// images is routed on the ids before the first one.
#[test]
fn anthropic_messages_match_vllms_conversion_and_ids() {
    let q = qwen3();
    let cases = fixture("anthropic.json");
    assert!(
        cases.len() >= 12,
        "expected Anthropic fixtures, found {}",
        cases.len()
    );
    let mut rendered = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let body = serde_json::to_vec(&case["request"]).unwrap();
        let request = Request::from_json_for(&body, Endpoint::Messages).unwrap();
        assert_eq!(request.endpoint(), Endpoint::Messages);
        let chat = chat_of(&request);
        let want: Vec<Value> = serde_json::from_value(case["messages"].clone()).unwrap();
        assert_eq!(chat.messages, want, "{name}: messages");
        let tools = chat.tools.as_deref().map(build_tools).transpose().unwrap();
        let want_tools: Option<Vec<Value>> = serde_json::from_value(case["tools"].clone()).unwrap();
        assert_eq!(tools, want_tools, "{name}: tools");
        assert_eq!(
            request.cache_salt.as_deref(),
            case["request"]["cache_salt"].as_str(),
            "{name}"
        );
        match case.get("expected_ids") {
            Some(ids) => {
                let ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
                let got =
                    PromptTokens::from_request(&request, &q.tokenizer, Some(&q.template)).unwrap();
                assert_eq!(got, ids, "{name}: ids");
                rendered += 1;
            }
            None => {
                let (_, truncated) = PromptTokens::prefix_from_request(
                    &request,
                    &q.tokenizer,
                    Some(&q.template),
                    kvroute_core::bpe::PrefixCap::tokens(kvroute_core::bpe::MAX_PREFIX_TOKENS),
                )
                .unwrap();
                assert_eq!(
                    truncated,
                    Some(kvroute_core::bpe::Truncation::Media),
                    "{name}"
                );
            }
        }
    }
    assert!(rendered >= 10, "only {rendered} cases rendered");
}

/// Malformed Anthropic bodies are errors naming the field, never panics.
#[test]
fn anthropic_messages_errors_name_the_field() {
    let cases = [
        (r#"{"model": "m", "messages": []}"#, "messages"),
        (r#"{"model": "m"}"#, "messages"),
        (
            r#"{"model": "m", "messages": [{"role": "tool", "content": "x"}]}"#,
            "messages[0].role",
        ),
        (
            r#"{"model": "m", "messages": [{"role": "user", "content": []}]}"#,
            "messages[0].content",
        ),
        (
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}"#,
            "messages[0].content[0].type",
        ),
        (
            r#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}"#,
            "messages[0].content[0].text",
        ),
        (
            r#"{"model": "m", "system": 5, "messages": [{"role": "user", "content": "x"}]}"#,
            "system",
        ),
        (
            r#"{"model": "m", "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}"#,
            "tools[0].input_schema",
        ),
        (
            r#"{"model": "m", "metadata": {"user_id": 7}, "messages": [{"role": "user", "content": "x"}]}"#,
            "user_id",
        ),
    ];
    for (body, field) in cases {
        let err = Request::from_json_for(body.as_bytes(), Endpoint::Messages).unwrap_err();
        assert!(err.to_string().contains(field), "{body}: {err}");
    }
    let ok = Request::from_json_for(
        br#"{"model": "m", "metadata": {"user_id": "u-1"}, "messages": [{"role": "user", "content": "x"}]}"#,
        Endpoint::Messages,
    )
    .unwrap();
    assert_eq!(ok.user.as_deref(), Some("u-1"));
}

/// A part type vLLM does not know is still an error: no prefix is guessed.
#[test]
fn qwen3_unknown_content_parts_are_not_routed() {
    let q = qwen3();
    let body = br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "hologram", "hologram": {}}]}]}"#;
    let request = Request::from_json(body).unwrap();
    let err = PromptTokens::from_request(&request, &q.tokenizer, Some(&q.template)).unwrap_err();
    assert!(err.to_string().contains("hologram"), "{err}");
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

/// The Qwen3 template, rendered by the Jinja VM only.
fn qwen3_jinja() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        let dir = qwen3_dir();
        let mut t =
            ChatTemplate::new(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
        t.set_native(false);
        t
    })
}

/// The Python-rendered fixtures go through the native renderer wherever it applies (most of
/// them), and the Jinja VM renders every one of them the same.
#[test]
fn qwen3_native_renderer_covers_the_fixtures_it_can_and_matches_the_vm() {
    let q = qwen3();
    assert_eq!(q.template.native(), Some(Native::Qwen3));
    let mut native = 0;
    let cases = fixture("qwen3-chat.json");
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let request = Request::from_json(&serde_json::to_vec(&case["request"]).unwrap()).unwrap();
        let chat = chat_of(&request);
        let fast = q.template.render(chat);
        assert_eq!(fast, qwen3_jinja().render(chat), "{name}");
        let mut kwargs = chat.chat_template_kwargs.clone();
        kwargs.remove("add_generation_prompt");
        let inputs = native::Inputs {
            messages: &chat.messages,
            tools: chat.tools.as_ref().is_some_and(|t| !t.is_empty()),
            add_generation_prompt: chat.add_generation_prompt,
            continue_final_message: chat.continue_final_message,
            kwargs: &kwargs,
        };
        if let Some(text) = Native::Qwen3.render(&inputs) {
            assert_eq!(Ok(text), fast, "{name}");
            native += 1;
        }
    }
    assert!(
        native * 2 >= cases.len(),
        "the native renderer covered only {native} of {} fixtures",
        cases.len()
    );
}

/// A deterministic pseudo-random source (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[(self.next() % items.len() as u64) as usize]
    }
}

/// Text pieces that exercise every branch of the template: think tags, tool-response wrappers,
/// leading and trailing newlines, multi-byte characters.
const PIECES: &[&str] = &[
    "",
    "hello",
    "\n",
    "\n\n",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
    " plan: ",
    "日本語 ✓",
    "<|im_end|>",
    "a\nb",
];

fn text(r: &mut Rng) -> String {
    (0..r.next() % 6).map(|_| *r.pick(PIECES)).collect()
}

/// Generated conversations render the same natively and in the Jinja VM: roles in any order
/// (system first or later, tool runs, an unknown role), assistant turns with and without
/// reasoning (as a field or as think tags), every generation-prompt and `enable_thinking` switch.
#[test]
fn qwen3_native_renderer_matches_the_vm_on_generated_conversations() {
    let mut r = Rng(7);
    let roles = ["system", "user", "assistant", "tool", "developer"];
    let mut native = 0;
    const CASES: usize = 4000;
    for case in 0..CASES {
        let n = 1 + (r.next() % 8) as usize;
        let messages: Vec<Value> = (0..n)
            .map(|_| {
                let role = *r.pick(&roles);
                let mut m = serde_json::json!({"role": role});
                // Content as a string, as text parts, null or absent.
                match r.next() % 8 {
                    0 => {
                        let parts: Vec<Value> = (0..r.next() % 3)
                            .map(|_| serde_json::json!({"type": "text", "text": text(&mut r)}))
                            .collect();
                        m["content"] = Value::Array(parts);
                    }
                    1 => m["content"] = Value::Null,
                    2 => {}
                    _ => m["content"] = Value::String(text(&mut r)),
                }
                // vLLM reads an assistant's `reasoning`; a client's `reasoning_content` is
                // dropped; an empty tool-call list is no tool call.
                match r.next() % 6 {
                    0 => m["reasoning"] = Value::String(text(&mut r)),
                    1 => m["reasoning"] = Value::Null,
                    2 => m["reasoning_content"] = Value::String(text(&mut r)),
                    3 => m["tool_calls"] = Value::Array(Vec::new()),
                    _ => {}
                }
                m
            })
            .collect();
        let mut chat = ChatRequest::new(messages);
        chat.add_generation_prompt = r.next() % 4 != 0;
        match r.next() % 4 {
            0 => {
                chat.chat_template_kwargs
                    .insert("enable_thinking".into(), Value::Bool(false));
            }
            1 => {
                chat.chat_template_kwargs
                    .insert("enable_thinking".into(), Value::Bool(true));
            }
            2 if r.next() % 8 == 0 => {
                chat.chat_template_kwargs
                    .insert("enable_thinking".into(), Value::Null);
            }
            _ => {}
        }
        let want = qwen3_jinja().render(&chat);
        let got = qwen3().template.render(&chat);
        assert_eq!(
            got,
            want,
            "case {case}: {}",
            serde_json::to_string(&chat.messages).unwrap()
        );
        let inputs = native::Inputs {
            messages: &chat.messages,
            tools: false,
            add_generation_prompt: chat.add_generation_prompt,
            continue_final_message: false,
            kwargs: &chat.chat_template_kwargs,
        };
        if Native::Qwen3.render(&inputs).is_some() {
            native += 1;
        }
    }
    assert_eq!(
        native, CASES,
        "every generated conversation is in the native domain"
    );
}
