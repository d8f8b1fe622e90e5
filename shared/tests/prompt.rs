//! Request parsing and prompt tokens never panic, whatever the body.
//!
//! Hand-written hostile bodies plus a bounded, deterministic mutation run over valid bodies go
//! through [`Request::from_json`] and, when they parse, through [`PromptTokens::from_request`]
//! with the real Qwen3 tokenizer and template (the same fixture as `chat_template.rs`: missing
//! means failure, run ./scripts/test.sh).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{qwen3_dir, rng};
use kvroute_core::chat::ChatTemplate;
use kvroute_core::prompt::{Endpoint, Prompt, PromptError, PromptTokens, Request, RequestBody};
use kvroute_core::tokenize::Tokenizer;

fn qwen3() -> (Tokenizer, ChatTemplate) {
    let dir = qwen3_dir();
    let tokenizer =
        Tokenizer::from_bytes(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let template =
        ChatTemplate::new(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    (tokenizer, template)
}

/// Parse and, if it parses, tokenize: the only acceptable outcomes are Ok and Err.
fn exercise(
    body: &[u8],
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
) -> Result<Vec<u32>, PromptError> {
    let request = Request::from_json(body)?;
    PromptTokens::from_request(&request, tokenizer, Some(template))
}

const VALID: [&str; 4] = [
    r#"{"model": "Qwen/Qwen3-0.6B", "prompt": "Hello, world"}"#,
    r#"{"model": "m", "prompt": [[1, 2, 3]]}"#,
    r#"{"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": [1, 2.5]}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "chat_template_kwargs": {"enable_thinking": false}, "cache_salt": "salt"}"#,
    r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}],
        "add_generation_prompt": false, "continue_final_message": true}"#,
];

#[test]
fn hostile_bodies_are_errors_not_panics() {
    let (tokenizer, template) = qwen3();
    let deep = "[".repeat(100_000);
    let deep_obj = format!(
        "{{\"prompt\": {}1{}}}",
        "[".repeat(5_000),
        "]".repeat(5_000)
    );
    let hostile: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"\xff\xfe\x00garbage".to_vec(),
        b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"\"prompt\"".to_vec(),
        b"{\"prompt\": null}".to_vec(),
        b"{\"prompt\": {}}".to_vec(),
        b"{\"prompt\": [null]}".to_vec(),
        b"{\"prompt\": [true]}".to_vec(),
        b"{\"prompt\": [1e999]}".to_vec(),
        b"{\"prompt\": [-9223372036854775809]}".to_vec(),
        b"{\"prompt\": [18446744073709551616]}".to_vec(),
        b"{\"prompt\": [[1, -2]]}".to_vec(),
        b"{\"prompt\": [[[1]]]}".to_vec(),
        b"{\"prompt\": [{}]}".to_vec(),
        b"{\"prompt\": \"x\", \"model\": [\"m\"]}".to_vec(),
        b"{\"prompt\": \"x\", \"add_special_tokens\": \"yes\"}".to_vec(),
        b"{\"prompt\": \"x\", \"cache_salt\": 5}".to_vec(),
        b"{\"messages\": null}".to_vec(),
        b"{\"messages\": {}}".to_vec(),
        b"{\"messages\": [[]]}".to_vec(),
        b"{\"messages\": [{\"role\": 1}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": [1, 2]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": 5}]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"no_type\": 1}]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": [1]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": [{\"function\": 1}]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": {\"a\": 1}}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": [{\"function\": {\"name\": [1], \"arguments\": \"{\\\"a\\\": NaN}\"}}]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [1]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {}}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": []}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": {\"messages\": 1}}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": {\"tools\": 5, \"add_generation_prompt\": \"yes\"}}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"continue_final_message\": true}".to_vec(),
        b"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}], \"add_generation_prompt\": false, \"continue_final_message\": true}".to_vec(),
        b"{\"messages\": [{\"role\": \"\\u0000\", \"content\": \"\\ud800\"}]}".to_vec(),
        deep.into_bytes(),
        deep_obj.into_bytes(),
    ];
    for body in &hostile {
        // Reaching the next line without a panic is the assertion; Ok is fine for a few
        // (e.g. unknown roles render as nothing in Qwen3's template).
        let _ = exercise(body, &tokenizer, &template);
    }
    // A sample of the messages a caller sees.
    let err = Request::from_json(b"\xff").unwrap_err();
    assert!(matches!(err, PromptError::Json(_)), "{err}");
    let err = Request::from_json(b"{\"prompt\": [[1, -2]]}").unwrap_err();
    assert_eq!(
        err.to_string(),
        "field `prompt[0][1]`: -2 is not a token id; expected an integer in 0..=4294967295"
    );
    let err = exercise(
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"continue_final_message\": true}",
        &tokenizer,
        &template,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("continue_final_message and add_generation_prompt"),
        "{err}"
    );
}

/// Deterministic mutations (byte flips, truncations, splices of JSON tokens) of valid bodies,
/// bounded in count and time.
#[test]
fn mutated_bodies_never_panic() {
    let (tokenizer, template) = qwen3();
    let pieces: [&[u8]; 12] = [
        b"null",
        b"[",
        b"]",
        b"{",
        b"}",
        b"\"",
        b"-1",
        b"1e400",
        b"\\u0000",
        b",",
        b"\xf0\x9f",
        b"[[[]]]",
    ];
    let mut next = rng(0x9e37_79b9_7f4a_7c15);
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut ok, mut err) = (0u32, 0u32);
    for round in 0..3_000u32 {
        if Instant::now() > deadline {
            break;
        }
        let mut body = VALID[round as usize % VALID.len()].as_bytes().to_vec();
        for _ in 0..=(next() % 3) {
            let len = body.len().max(1) as u64;
            let at = (next() % len) as usize;
            match next() % 4 {
                0 => {
                    if let Some(b) = body.get_mut(at) {
                        *b ^= 1 << (next() % 8);
                    }
                }
                1 => body.truncate(at),
                2 => {
                    let piece = pieces[(next() % pieces.len() as u64) as usize];
                    body.splice(at..at, piece.iter().copied());
                }
                _ => {
                    let end = (at + (next() % 8) as usize).min(body.len());
                    body.drain(at..end);
                }
            }
        }
        match exercise(&body, &tokenizer, &template) {
            Ok(_) => ok += 1,
            Err(_) => err += 1,
        }
    }
    assert!(
        ok > 0 && err > 0,
        "mutations should produce both outcomes (ok {ok}, err {err})"
    );
}

#[test]
fn valid_bodies_tokenize() {
    let (tokenizer, template) = qwen3();
    for body in VALID {
        let ids = exercise(body.as_bytes(), &tokenizer, &template).unwrap();
        assert!(!ids.is_empty(), "{body}");
    }
    let request = Request::from_json_for(VALID[0].as_bytes(), Endpoint::Completions).unwrap();
    assert_eq!(
        request.body,
        RequestBody::Completion(Prompt::Text("Hello, world".into()))
    );
    let chat = Request::from_json(VALID[2].as_bytes()).unwrap();
    assert_eq!(chat.cache_salt.as_deref(), Some("salt"));
}
