//! Anthropic Messages requests (`POST /v1/messages`) turned into the chat request vLLM renders
//! for them.
//!
//! vLLM serves the endpoint by converting the request into a chat completions request and
//! rendering that (vllm/entrypoints/anthropic/serving.py, read for behaviour, not copied; the
//! fixtures of `shared/tests/fixtures/chat/anthropic.json` come from that code itself, see
//! `scripts/gen-anthropic-fixtures.py`). This module is that conversion, as vLLM applies it when
//! it serves the model's own chat template (`merge_inline_system`):
//!
//! * `system` (a string, or blocks whose `text` blocks are concatenated) and the text of every
//!   `system` message inside `messages` become one leading system message; text starting with
//!   `x-anthropic-billing-header` (Claude Code's per-request attribution) is dropped;
//! * in a message's blocks: `text` (non-empty) becomes a text part, `image` an `image_url` part
//!   (`data:<media_type>;base64,<data>`, or the source's `url`), `thinking` is concatenated into
//!   `reasoning`, `tool_use` becomes a tool call (`arguments` = Python's `json.dumps` of `input`),
//!   a user's `tool_result` becomes a `tool` message placed before the user message (its image
//!   items a user message of images after it), an assistant's `tool_result` a text part
//!   `Tool result: ...`; `redacted_thinking` and `tool_reference` blocks are skipped;
//! * a single text part becomes the content string; a user message left without content is
//!   dropped;
//! * `tools` become functions (`input_schema` with `"type": "object"` added when absent).
//!
//! `cache_control` breakpoints do not change the prompt: the engine sees the same tokens. They
//! are natural prefix boundaries, so [`breakpoints`] lists them for the gateway's metrics: the
//! text of each marked `text` block, which the gateway finds in the rendered prompt.

use serde_json::{Map, Value};

use super::python::{json_dumps, DumpOptions};
use super::truthy;
use crate::prompt::PromptError;

/// Text Claude Code puts in its system blocks with a per-request hash; vLLM drops it.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Block types vLLM's Anthropic endpoint accepts.
const BLOCK_TYPES: [&str; 7] = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
];

/// Most breakpoints [`breakpoints`] lists per request (Anthropic accepts 4); more are counted as
/// not located.
pub const MAX_BREAKPOINTS: usize = 8;

/// The `cache_control` breakpoints of an Anthropic body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Breakpoints {
    /// The text of each marked non-empty `text` block, `system` blocks first and then the
    /// messages' blocks, in order: where each appears in the rendered prompt is a breakpoint.
    pub texts: Vec<String>,
    /// Marks that cannot be placed by their text: on tools, on blocks other than text, on
    /// empty text, or past [`MAX_BREAKPOINTS`].
    pub elsewhere: u32,
}

/// The breakpoints of a body [`to_chat`] accepted (see [`Breakpoints`]).
pub fn breakpoints(obj: &Map<String, Value>) -> Breakpoints {
    let marked = |v: &Value| v.get("cache_control").is_some_and(|c| !c.is_null());
    let mut bp = Breakpoints::default();
    let mut block = |b: &Value| {
        if !marked(b) {
            return;
        }
        let text = (b.get("type").and_then(Value::as_str) == Some("text"))
            .then(|| b.get("text").and_then(Value::as_str))
            .flatten()
            .filter(|t| !t.is_empty());
        match text {
            Some(t) if bp.texts.len() < MAX_BREAKPOINTS => bp.texts.push(t.to_owned()),
            _ => bp.elsewhere += 1,
        }
    };
    if let Some(Value::Array(blocks)) = obj.get("system") {
        blocks.iter().for_each(&mut block);
    }
    if let Some(Value::Array(messages)) = obj.get("messages") {
        for m in messages {
            if let Some(Value::Array(blocks)) = m.get("content") {
                blocks.iter().for_each(&mut block);
            }
        }
    }
    if let Some(Value::Array(tools)) = obj.get("tools") {
        bp.elsewhere += tools.iter().filter(|t| marked(t)).count() as u32;
    }
    bp
}

/// The chat request's messages and tools for an Anthropic body (see the module docs).
pub fn to_chat(obj: &Map<String, Value>) -> Result<(Vec<Value>, Option<Vec<Value>>), PromptError> {
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(PromptError::Empty {
                field: "messages",
                expected: "at least one message",
            })
        }
        Some(other) => return Err(wrong("messages", "an array of message objects", other)),
        None => {
            return Err(PromptError::WrongEndpoint {
                field: "messages",
                endpoint: "/v1/messages",
            })
        }
    };
    let mut msgs = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        msgs.push(message(i, m)?);
    }

    let mut out = Vec::with_capacity(msgs.len() + 1);
    let mut system = String::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => system.push_str(s),
        Some(Value::Array(blocks)) => {
            for (j, b) in blocks.iter().enumerate() {
                let b = block(&format!("system[{j}]"), b)?;
                if let Some(t) = b.text().filter(|t| !t.starts_with(BILLING_HEADER)) {
                    system.push_str(t);
                }
            }
        }
        Some(other) => return Err(wrong("system", "a string or an array of blocks", other)),
    }
    for m in msgs.iter().filter(|m| m.role == "system") {
        system.push_str(&m.system_text());
    }
    if !system.is_empty() {
        out.push(text_message("system", system));
    }
    for m in msgs.iter().filter(|m| m.role != "system") {
        convert(m, &mut out)?;
    }
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| tool(i, t))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(other) => return Err(wrong("tools", "an array of tools", other)),
    };
    Ok((out, tools))
}

/// One Anthropic message, validated.
struct Msg<'a> {
    role: &'a str,
    content: Content<'a>,
}

enum Content<'a> {
    Text(&'a str),
    Blocks(Vec<Block<'a>>),
}

/// One content block, validated: its type and the object.
struct Block<'a> {
    kind: &'a str,
    obj: &'a Map<String, Value>,
    field: String,
}

impl<'a> Block<'a> {
    /// A `text` block's non-empty text.
    fn text(&self) -> Option<&'a str> {
        (self.kind == "text")
            .then(|| self.obj.get("text").and_then(Value::as_str))
            .flatten()
            .filter(|t| !t.is_empty())
    }

    fn str_field(&self, name: &str) -> Result<Option<&'a str>, PromptError> {
        match self.obj.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(wrong(format!("{}.{name}", self.field), "a string", other)),
        }
    }
}

impl Msg<'_> {
    /// A system message's text without billing headers (blocks concatenated).
    fn system_text(&self) -> String {
        match &self.content {
            Content::Text(t) if t.starts_with(BILLING_HEADER) => String::new(),
            Content::Text(t) => (*t).to_owned(),
            Content::Blocks(blocks) => blocks
                .iter()
                .filter_map(Block::text)
                .filter(|t| !t.starts_with(BILLING_HEADER))
                .collect(),
        }
    }
}

fn message(i: usize, m: &Value) -> Result<Msg<'_>, PromptError> {
    let field = format!("messages[{i}]");
    let Value::Object(obj) = m else {
        return Err(wrong(field, "an object", m));
    };
    let role = match obj.get("role") {
        Some(Value::String(r)) if ["user", "assistant", "system"].contains(&r.as_str()) => r,
        Some(other) => {
            return Err(wrong(
                format!("{field}.role"),
                "one of user, assistant, system",
                other,
            ))
        }
        None => {
            return Err(missing_in(
                format!("{field}.role"),
                "one of user, assistant, system",
            ))
        }
    };
    let content = match obj.get("content") {
        Some(Value::String(s)) => Content::Text(s),
        Some(Value::Array(blocks)) if blocks.is_empty() => {
            return Err(PromptError::WrongType {
                field: format!("{field}.content"),
                expected: "a string or a non-empty array of blocks",
                found: "an empty array",
            })
        }
        Some(Value::Array(blocks)) => Content::Blocks(
            blocks
                .iter()
                .enumerate()
                .map(|(j, b)| block(&format!("{field}.content[{j}]"), b))
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(wrong(
                format!("{field}.content"),
                "a string or an array of blocks",
                other,
            ))
        }
        None => {
            return Err(missing_in(
                format!("{field}.content"),
                "a string or an array of blocks",
            ))
        }
    };
    Ok(Msg { role, content })
}

fn block<'a>(field: &str, b: &'a Value) -> Result<Block<'a>, PromptError> {
    let Value::Object(obj) = b else {
        return Err(wrong(field.to_owned(), "a block object", b));
    };
    let kind = match obj.get("type") {
        Some(Value::String(t)) if BLOCK_TYPES.contains(&t.as_str()) => t.as_str(),
        Some(other) => {
            return Err(wrong(
                format!("{field}.type"),
                "one of text, image, tool_use, tool_result, tool_reference, thinking, redacted_thinking",
                other,
            ))
        }
        None => return Err(missing_in(format!("{field}.type"), "a block type")),
    };
    let b = Block {
        kind,
        obj,
        field: field.to_owned(),
    };
    for name in ["text", "id", "tool_use_id", "name", "thinking"] {
        b.str_field(name)?;
    }
    Ok(b)
}

/// Appends the chat messages of one non-system Anthropic message.
fn convert(m: &Msg<'_>, out: &mut Vec<Value>) -> Result<(), PromptError> {
    let blocks = match &m.content {
        Content::Text(t) => {
            out.push(text_message(m.role, (*t).to_owned()));
            return Ok(());
        }
        Content::Blocks(b) => b,
    };
    let mut parts: Vec<Value> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut reasoning: Option<String> = None;
    for b in blocks {
        match b.kind {
            "text" => {
                if let Some(t) = b.text() {
                    parts.push(text_part(t.to_owned()));
                }
            }
            "image" => {
                if let Some(source) = b.obj.get("source").filter(|s| truthy(s)) {
                    parts.push(image_part(&image_url(&b.field, source)?));
                }
            }
            "thinking" => {
                if let Some(t) = b.str_field("thinking")? {
                    reasoning.get_or_insert_with(String::new).push_str(t);
                }
            }
            "tool_use" => calls.push(tool_call(b)?),
            "tool_result" if m.role == "user" => user_tool_result(b, out)?,
            "tool_result" => {
                let text = match b.obj.get("content").filter(|c| truthy(c)) {
                    None => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    // Python's str() of a list of dicts: not reproduced.
                    Some(other) => {
                        return Err(wrong(
                            format!("{}.content", b.field),
                            "a string (an assistant's tool_result with blocks is not routed)",
                            other,
                        ))
                    }
                };
                parts.push(text_part(format!("Tool result: {text}")));
            }
            // redacted_thinking, tool_reference
            _ => {}
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), Value::from(m.role));
    if let Some(r) = reasoning {
        msg.insert("reasoning".into(), Value::from(r));
    }
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    match parts.len() {
        0 => {}
        1 if parts[0].get("type").and_then(Value::as_str) == Some("text") => {
            let text = parts[0].get("text").cloned().unwrap_or(Value::Null);
            msg.insert("content".into(), text);
        }
        _ => {
            msg.insert("content".into(), Value::Array(parts));
        }
    }
    // A user message left without content is dropped.
    if m.role != "user" || msg.contains_key("content") {
        out.push(Value::Object(msg));
    }
    Ok(())
}

/// A user's `tool_result`: a tool message (texts joined with `"\n"`), then a user message with
/// its images, then a tool message with its tool references.
fn user_tool_result(b: &Block<'_>, out: &mut Vec<Value>) -> Result<(), PromptError> {
    let id = b.str_field("tool_use_id")?.unwrap_or("");
    let mut texts: Vec<&str> = Vec::new();
    let mut images: Vec<Value> = Vec::new();
    let mut refs: Vec<Value> = Vec::new();
    match b.obj.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => texts.push(s),
        Some(Value::Array(items)) => {
            for (k, item) in items.iter().enumerate() {
                let Some(item) = item.as_object() else {
                    continue;
                };
                let field = format!("{}.content[{k}]", b.field);
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => match item.get("text") {
                        None => texts.push(""),
                        Some(Value::String(s)) => texts.push(s),
                        Some(other) => {
                            return Err(wrong(format!("{field}.text"), "a string", other))
                        }
                    },
                    Some("image") => {
                        let source = item
                            .get("source")
                            .cloned()
                            .unwrap_or(Value::Object(Map::new()));
                        let url = image_url(&field, &source)?;
                        if !url.is_empty() {
                            images.push(image_part(&url));
                        }
                    }
                    Some("tool_reference") => {
                        let name = ["tool_name", "name"]
                            .iter()
                            .filter_map(|k| item.get(*k).and_then(Value::as_str))
                            .find(|n| !n.is_empty());
                        if let Some(name) = name {
                            let mut r = Map::new();
                            r.insert("type".into(), Value::from("tool_reference"));
                            r.insert("name".into(), Value::from(name));
                            refs.push(Value::Object(r));
                        }
                    }
                    _ => {}
                }
            }
        }
        Some(other) => {
            return Err(wrong(
                format!("{}.content", b.field),
                "a string or an array of items",
                other,
            ))
        }
    }
    let tool = |content: Value| {
        let mut t = Map::new();
        t.insert("role".into(), Value::from("tool"));
        t.insert("tool_call_id".into(), Value::from(id));
        t.insert("content".into(), content);
        Value::Object(t)
    };
    out.push(tool(Value::from(texts.join("\n"))));
    if !images.is_empty() {
        let mut u = Map::new();
        u.insert("role".into(), Value::from("user"));
        u.insert("content".into(), Value::Array(images));
        out.push(Value::Object(u));
    }
    if !refs.is_empty() {
        out.push(tool(Value::Array(refs)));
    }
    Ok(())
}

/// A `tool_use` block as an OpenAI tool call.
fn tool_call(b: &Block<'_>) -> Result<Value, PromptError> {
    let input = match b.obj.get("input") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::Object(o)) => Value::Object(o.clone()),
        Some(other) => return Err(wrong(format!("{}.input", b.field), "an object", other)),
    };
    let options = DumpOptions {
        ensure_ascii: true,
        ..DumpOptions::default()
    };
    let arguments =
        json_dumps(&minijinja::Value::from_serialize(&input), &options).map_err(|_| {
            PromptError::WrongType {
                field: format!("{}.input", b.field),
                expected: "an object Python's json.dumps can write",
                found: "a value it cannot",
            }
        })?;
    // vLLM names a call without an id after the clock; the id is not rendered by templates
    // that kvroute has seen, and a fixed one keeps the keys deterministic.
    let id = b
        .str_field("id")?
        .filter(|s| !s.is_empty())
        .unwrap_or("call_0");
    let mut function = Map::new();
    function.insert(
        "name".into(),
        Value::from(b.str_field("name")?.unwrap_or("")),
    );
    function.insert("arguments".into(), Value::from(arguments));
    let mut call = Map::new();
    call.insert("id".into(), Value::from(id));
    call.insert("type".into(), Value::from("function"));
    call.insert("function".into(), Value::Object(function));
    Ok(Value::Object(call))
}

/// An Anthropic tool as an OpenAI function.
fn tool(i: usize, t: &Value) -> Result<Value, PromptError> {
    let field = format!("tools[{i}]");
    let Value::Object(obj) = t else {
        return Err(wrong(field, "a tool object", t));
    };
    let name = match obj.get("name") {
        Some(Value::String(n)) => n.clone(),
        Some(other) => return Err(wrong(format!("{field}.name"), "a string", other)),
        None => return Err(missing_in(format!("{field}.name"), "a string")),
    };
    let mut schema = match obj.get("input_schema") {
        Some(Value::Object(s)) => s.clone(),
        Some(other) => return Err(wrong(format!("{field}.input_schema"), "an object", other)),
        None => return Err(missing_in(format!("{field}.input_schema"), "an object")),
    };
    if !schema.contains_key("type") {
        schema.insert("type".into(), Value::from("object"));
    }
    let mut function = Map::new();
    function.insert("name".into(), Value::from(name));
    match obj.get("description") {
        None | Some(Value::Null) => {}
        Some(Value::String(d)) => {
            function.insert("description".into(), Value::from(d.clone()));
        }
        Some(other) => return Err(wrong(format!("{field}.description"), "a string", other)),
    }
    function.insert("parameters".into(), Value::Object(schema));
    let mut out = Map::new();
    out.insert("type".into(), Value::from("function"));
    out.insert("function".into(), Value::Object(function));
    Ok(Value::Object(out))
}

/// vLLM's URL for an image source: the `url` of a URL source, else a base64 data URI.
fn image_url(field: &str, source: &Value) -> Result<String, PromptError> {
    let Value::Object(s) = source else {
        return Err(wrong(format!("{field}.source"), "an object", source));
    };
    let get = |k: &str, default: &str| match s.get(k) {
        None => default.to_owned(),
        Some(Value::String(v)) => v.clone(),
        // Python's f-string of None.
        Some(Value::Null) => "None".to_owned(),
        Some(other) => other.to_string(),
    };
    if s.get("type").and_then(Value::as_str) == Some("url") {
        return Ok(get("url", ""));
    }
    Ok(format!(
        "data:{};base64,{}",
        get("media_type", "image/jpeg"),
        get("data", "")
    ))
}

fn text_message(role: &str, content: String) -> Value {
    let mut m = Map::new();
    m.insert("role".into(), Value::from(role));
    m.insert("content".into(), Value::from(content));
    Value::Object(m)
}

fn text_part(text: String) -> Value {
    let mut p = Map::new();
    p.insert("type".into(), Value::from("text"));
    p.insert("text".into(), Value::from(text));
    Value::Object(p)
}

fn image_part(url: &str) -> Value {
    let mut inner = Map::new();
    inner.insert("url".into(), Value::from(url));
    let mut p = Map::new();
    p.insert("type".into(), Value::from("image_url"));
    p.insert("image_url".into(), Value::Object(inner));
    Value::Object(p)
}

fn wrong(field: impl Into<String>, expected: &'static str, found: &Value) -> PromptError {
    PromptError::WrongType {
        field: field.into(),
        expected,
        found: crate::prompt::json_type(found),
    }
}

fn missing_in(field: String, expected: &'static str) -> PromptError {
    PromptError::WrongType {
        field,
        expected,
        found: "nothing",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::prompt::{Endpoint, Request};

    /// Marked text blocks are listed in prompt order (system, then messages); marks on tools,
    /// other blocks and empty text, and marks past the bound, are counted apart; other
    /// endpoints list none.
    #[test]
    fn breakpoints_list_marked_text_blocks_in_order() {
        let cc = serde_json::json!({"type": "ephemeral"});
        let mut messages: Vec<Value> = vec![
            serde_json::json!({"role": "user", "content": [
                {"type": "text", "text": "turn one", "cache_control": cc},
                {"type": "text", "text": "unmarked"},
                {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}, "cache_control": cc},
            ]}),
            serde_json::json!({"role": "assistant", "content": "a string is never marked"}),
            serde_json::json!({"role": "user", "content": [
                {"type": "text", "text": "turn two", "cache_control": cc},
                {"type": "text", "text": "null mark", "cache_control": null},
            ]}),
        ];
        let body = serde_json::json!({
            "model": "m", "max_tokens": 1,
            "system": [{"type": "text", "text": "the system", "cache_control": cc}],
            "tools": [{"name": "t", "input_schema": {}, "cache_control": cc}],
            "messages": messages.clone(),
        });
        let r = Request::from_json_for(body.to_string().as_bytes(), Endpoint::Messages).unwrap();
        assert_eq!(
            r.breakpoints,
            Breakpoints {
                texts: vec!["the system".into(), "turn one".into(), "turn two".into()],
                elsewhere: 2,
            }
        );
        // Past the bound.
        for i in 0..MAX_BREAKPOINTS {
            messages.push(serde_json::json!({"role": "user", "content": [
                {"type": "text", "text": format!("more {i}"), "cache_control": cc}]}));
        }
        let obj = serde_json::json!({"messages": messages});
        let bp = breakpoints(obj.as_object().unwrap());
        assert_eq!((bp.texts.len(), bp.elsewhere), (MAX_BREAKPOINTS, 3));
        let chat = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": cc}]}]});
        let r = Request::from_json(chat.to_string().as_bytes()).unwrap();
        assert_eq!(r.breakpoints, Breakpoints::default());
    }
}
