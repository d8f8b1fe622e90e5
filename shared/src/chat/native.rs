//! Native renderers: chat templates kvroute knows by the SHA-256 of their exact source, rendered
//! by plain Rust instead of the Jinja VM, byte for byte what the template renders.
//!
//! A multi-turn follow-up re-renders every old turn (the Qwen3 template is not append-only: where
//! the last user query sits decides how each assistant turn prints its reasoning, so a cached
//! prefix would be wrong after some edits). Rendering is where the filter spent most of its CPU
//! on a follow-up; the native renderer does the same work as a few string copies.
//!
//! Each renderer covers part of what its template accepts and answers `None` for the rest
//! (tool definitions and tool calls, non-string content, `continue_final_message`, any
//! `chat_template_kwargs` but the ones it reads), which then go through the Jinja VM as before.
//! Equality with the Jinja render is tested over generated conversations and over the
//! Python-rendered fixtures (`tests/fixtures/chat/`), which run through [`super::ChatTemplate`]
//! and therefore through this path wherever it applies.

use std::borrow::Cow;

use serde_json::{Map, Value as Json};
use sha2::{Digest, Sha256};

/// A template with a native renderer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Native {
    /// Qwen3's hybrid-thinking template (`Qwen/Qwen3-0.6B` ... `Qwen3-235B-A22B`).
    Qwen3,
}

/// SHA-256 of the Qwen3 template source, as `tokenizer_config.json` carries it.
const QWEN3_SHA256: &str = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5";

/// What a native renderer reads.
pub struct Inputs<'a> {
    /// The request's messages as the client sent them (OpenAI shape). The renderer reads them
    /// as [`super::conversation::build_messages`] prepares them for the template with the
    /// `string` content format (text parts joined by newlines, absent content empty, an
    /// assistant's `reasoning` as `reasoning_content`), and answers `None` for anything else.
    pub messages: &'a [Json],
    /// True when the request has tool definitions (a non-empty list).
    pub tools: bool,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// `chat_template_kwargs` left after the request switches were taken out.
    pub kwargs: &'a Map<String, Json>,
}

impl Native {
    /// The native renderer of the template `source`, if it is one kvroute knows.
    pub fn detect(source: &str) -> Option<Native> {
        let digest = Sha256::digest(source.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        (hex == QWEN3_SHA256).then_some(Native::Qwen3)
    }

    /// The template's output for `inputs`, or `None` when this renderer does not cover them.
    pub fn render(self, inputs: &Inputs<'_>) -> Option<String> {
        match self {
            Native::Qwen3 => qwen3(inputs),
        }
    }
}

/// One message as the Qwen3 renderer reads it.
struct Msg<'a> {
    role: &'a str,
    content: Cow<'a, str>,
    /// An assistant's `reasoning` (the template's `reasoning_content`) when it is a string.
    reasoning: Option<&'a str>,
}

/// The message as the template would see it, or `None` when it holds something the renderer
/// does not cover (or that preparing the conversation refuses: the Jinja path reports it).
fn msg(index: usize, m: &Json) -> Option<Msg<'_>> {
    let o = m.as_object()?;
    let role = o.get("role")?.as_str()?;
    let content = match o.get("content") {
        Some(Json::String(s)) => Cow::Borrowed(s.as_str()),
        other => Cow::Owned(
            super::conversation::text_parts(index, other)
                .ok()?
                .join("\n"),
        ),
    };
    let mut reasoning = None;
    if role == "assistant" {
        match o.get("reasoning") {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => reasoning = Some(s.as_str()),
            Some(_) => return None,
        }
        match o.get("tool_calls") {
            None | Some(Json::Null) => {}
            Some(Json::Array(a)) if a.is_empty() => {}
            Some(_) => return None,
        }
    }
    Some(Msg {
        role,
        content,
        reasoning,
    })
}

/// Python's `str.strip(chars)` family for a single character set of `'\n'`.
fn lstrip_nl(s: &str) -> &str {
    s.trim_start_matches('\n')
}

fn rstrip_nl(s: &str) -> &str {
    s.trim_end_matches('\n')
}

/// `s.split(sep)[-1]` and `s.split(sep)[0]`.
fn last_piece<'a>(s: &'a str, sep: &str) -> &'a str {
    s.rfind(sep).map_or(s, |at| &s[at + sep.len()..])
}

fn first_piece<'a>(s: &'a str, sep: &str) -> &'a str {
    s.find(sep).map_or(s, |at| &s[..at])
}

fn qwen3(inputs: &Inputs<'_>) -> Option<String> {
    if inputs.tools || inputs.continue_final_message {
        return None;
    }
    // `enable_thinking` is the one variable the template reads; any other kwarg could shadow a
    // name the template uses (`namespace`, ...), so it goes through the Jinja VM.
    let enable_thinking = match inputs.kwargs.len() {
        0 => None,
        1 => Some(inputs.kwargs.get("enable_thinking")?),
        _ => return None,
    };
    let msgs: Vec<Msg<'_>> = inputs
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| msg(i, m))
        .collect::<Option<_>>()?;
    let first = msgs.first()?;
    let total: usize = msgs
        .iter()
        .map(|m| m.content.len() + m.reasoning.map_or(0, str::len) + 32)
        .sum();
    let mut out = String::with_capacity(total + 64);
    if first.role == "system" {
        out.push_str("<|im_start|>system\n");
        out.push_str(&first.content);
        out.push_str("<|im_end|>\n");
    }
    // The last user message that is not a tool response wrapped as a user turn.
    let last_query = msgs
        .iter()
        .rposition(|m| {
            m.role == "user"
                && !(m.content.starts_with("<tool_response>")
                    && m.content.ends_with("</tool_response>"))
        })
        .unwrap_or(msgs.len() - 1);
    let n = msgs.len();
    for (i, m) in msgs.iter().enumerate() {
        match m.role {
            "user" => push_turn(&mut out, "user", &m.content),
            "system" if i > 0 => push_turn(&mut out, "system", &m.content),
            "assistant" => {
                let text: &str = &m.content;
                let (content, reasoning) = match m.reasoning {
                    Some(r) => (text, r),
                    None if text.contains("</think>") => (
                        lstrip_nl(last_piece(text, "</think>")),
                        lstrip_nl(last_piece(
                            rstrip_nl(first_piece(text, "</think>")),
                            "<think>",
                        )),
                    ),
                    None => (text, ""),
                };
                out.push_str("<|im_start|>assistant\n");
                if i > last_query && (i + 1 == n || !reasoning.is_empty()) {
                    out.push_str("<think>\n");
                    out.push_str(reasoning.trim_matches('\n'));
                    out.push_str("\n</think>\n\n");
                    out.push_str(lstrip_nl(content));
                } else {
                    out.push_str(content);
                }
                out.push_str("<|im_end|>\n");
            }
            "tool" => {
                if i == 0 || msgs[i - 1].role != "tool" {
                    out.push_str("<|im_start|>user");
                }
                out.push_str("\n<tool_response>\n");
                out.push_str(&m.content);
                out.push_str("\n</tool_response>");
                if i + 1 == n || msgs[i + 1].role != "tool" {
                    out.push_str("<|im_end|>\n");
                }
            }
            // Any other role renders nothing in this template.
            _ => {}
        }
    }
    if inputs.add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
        if enable_thinking == Some(&Json::Bool(false)) {
            out.push_str("<think>\n\n</think>\n\n");
        }
    }
    Some(out)
}

fn push_turn(out: &mut String, role: &str, content: &str) {
    out.push_str("<|im_start|>");
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str("<|im_end|>\n");
}
