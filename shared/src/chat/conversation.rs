//! The conversation a chat template sees, built from OpenAI messages the way vLLM and
//! HuggingFace build it before rendering.
//!
//! vLLM (vllm/renderers/chat_utils, read for behaviour, not copied):
//! * each message becomes `{role, content, ...}`; for templates that treat `content` as a
//!   string, text parts are joined with `"\n"` and `content: null` becomes `""`; for templates
//!   that iterate over content parts ("openai" format), content is always a list of
//!   `{"type": "text", "text": ...}` parts;
//! * only `tool_calls` and `reasoning` (copied to `reasoning_content`) survive on assistant
//!   messages (a request's own `reasoning_content` is dropped, as current vLLM drops it; older
//!   vLLM releases read that name instead), `tool_call_id` on tool messages, `name` on any message;
//! * an empty `tool_calls` list is dropped; tool-call `arguments` strings are parsed into
//!   objects (invalid JSON, non-objects, empty or null become `{}`);
//! * tools are dumped from vLLM's pydantic models: `{"type", "function": {"name", "description",
//!   "parameters", extras...}, extras...}` with `null` for a missing description/parameters.
//!
//! HuggingFace (`apply_chat_template`, transformers 5): keys whose value is `null` are dropped
//! and reasoning is aliased as `{"thinking": r, ..., "reasoning_content": r}`.
//!
//! Non-text content (images, audio, video, prompt embeddings) becomes tokens a router cannot
//! reproduce: the engine expands a placeholder into as many tokens as the item needs and folds the
//! item's hash into the blocks it overlaps. What comes before the first such part is plain text,
//! so [`build_messages`] can put a given placeholder where vLLM puts the item's (the caller cuts
//! the rendered prompt there); without one, a non-text part is an error. vLLM's placement: for
//! templates reading `content` as a string, the placeholders of a message's media items go first,
//! each followed by `"\n"`, then its text (a `prompt_embeds` part stays where it is); for
//! templates iterating over parts, each item stays a part in its place.

use serde_json::{Map, Value};

use super::ChatError;

/// How a template reads `message.content`, as vLLM's auto-detection decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// `content` is a string (text parts joined with `"\n"`).
    String,
    /// `content` is a list of `{"type": ..., ...}` parts.
    OpenAi,
}

impl ContentFormat {
    /// vLLM's "auto" detection, approximated on the template source: a `for` loop over an
    /// expression that names `content` means the template iterates over content parts.
    pub fn detect(template: &str) -> Self {
        let mut rest = template;
        while let Some(open) = rest.find("{%") {
            let tag_start = rest.get(open + 2..).unwrap_or("");
            let close = tag_start.find("%}").unwrap_or(tag_start.len());
            let tag = tag_start.get(..close).unwrap_or("");
            rest = tag_start.get(close..).unwrap_or("");
            let tag = tag
                .trim_start_matches(['-', '+'])
                .trim_end_matches(['-', '+'])
                .trim();
            let Some(header) = tag.strip_prefix("for ") else {
                continue;
            };
            let Some((_, iter)) = header.split_once(" in ") else {
                continue;
            };
            // The iterated expression, before any filter or `if` clause.
            let expr = iter.split(['|', ' ']).find(|s| !s.is_empty()).unwrap_or("");
            if expr.contains("content") && !expr.contains("content_") {
                return Self::OpenAi;
            }
        }
        Self::String
    }
}

/// Content part types vLLM reads as text, and the field holding their text.
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// Media part types vLLM accepts, and whether vLLM keeps the part where it is in a
/// string-content message (`prompt_embeds`) instead of moving its placeholder to the front.
const MEDIA_PARTS: [(&str, bool); 10] = [
    ("image_url", false),
    ("input_image", false),
    ("image_pil", false),
    ("image_embeds", false),
    ("audio_url", false),
    ("input_audio", false),
    ("audio_embeds", false),
    ("video_url", false),
    ("video_embeds", false),
    ("prompt_embeds", true),
];

/// One content part as vLLM reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part<'a> {
    Text(&'a str),
    /// A media item: `part` is its index in `content`, `inline` true for `prompt_embeds`.
    Media {
        part: usize,
        part_type: &'a str,
        inline: bool,
    },
}

/// Where the first non-text content part of a conversation is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaCut {
    /// Index in `messages`.
    pub message: usize,
    /// Index in that message's `content`.
    pub part: usize,
    /// The part's `type` (`image_url`, `input_audio`, ...).
    pub part_type: String,
}

/// The part's `type` when it is one vLLM accepts as media.
pub fn media_type(part: &Value) -> Option<&str> {
    let kind = part.get("type")?.as_str()?;
    MEDIA_PARTS.iter().any(|(t, _)| *t == kind).then_some(kind)
}

/// The first media part of `messages`, if any. Malformed messages are left to
/// [`build_messages`] to report.
pub fn first_media(messages: &[Value]) -> Option<MediaCut> {
    messages.iter().enumerate().find_map(|(message, m)| {
        let parts = m.get("content")?.as_array()?;
        parts.iter().enumerate().find_map(|(part, p)| {
            media_type(p).map(|kind| MediaCut {
                message,
                part,
                part_type: kind.to_owned(),
            })
        })
    })
}

/// Builds the template's `messages` from validated OpenAI messages (objects with a string `role`).
/// `media`: the text standing for each media item, placed where vLLM places the item's
/// placeholder; `None` makes a media part an error.
pub fn build_messages(
    messages: &[Value],
    format: ContentFormat,
    media: Option<&str>,
) -> Result<Vec<Value>, ChatError> {
    let mut out = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        let Some(message) = message.as_object() else {
            return Err(ChatError::InvalidMessage {
                index,
                reason: "a message must be a JSON object".into(),
            });
        };
        let Some(role) = message.get("role").and_then(Value::as_str) else {
            return Err(ChatError::InvalidMessage {
                index,
                reason: "`role` must be a string".into(),
            });
        };
        let parts = content_parts(index, message.get("content"))?;
        let media = match media {
            Some(m) => m,
            None => {
                if let Some(err) = parts.iter().find_map(|p| media_error(index, p)) {
                    return Err(err);
                }
                ""
            }
        };
        let mut conv = Map::new();
        conv.insert("role".into(), Value::from(role));
        let content = match format {
            // vLLM keeps tool results as one string even for "openai" templates.
            ContentFormat::OpenAi if role != "tool" => Value::Array(
                parts
                    .iter()
                    .map(|p| match p {
                        Part::Text(t) => text_part((*t).to_owned()),
                        Part::Media { .. } => text_part(media.to_owned()),
                    })
                    .collect(),
            ),
            _ => Value::from(string_content(&parts, media)),
        };
        conv.insert("content".into(), content);
        if role == "assistant" {
            if let Some(calls) = message.get("tool_calls").filter(|v| !v.is_null()) {
                conv.insert("tool_calls".into(), tool_calls(index, calls)?);
            }
            if let Some(reasoning) = message.get("reasoning").filter(|v| !v.is_null()) {
                conv.insert("reasoning".into(), reasoning.clone());
                conv.insert("reasoning_content".into(), reasoning.clone());
            }
        } else if role == "tool" {
            if let Some(id) = message.get("tool_call_id") {
                conv.insert("tool_call_id".into(), id.clone());
            }
        }
        if let Some(name) = message.get("name").filter(|v| v.is_string()) {
            conv.insert("name".into(), name.clone());
        }
        if matches!(conv.get("tool_calls"), Some(Value::Array(calls)) if calls.is_empty()) {
            conv.remove("tool_calls");
        }
        out.push(hf_normalize(conv));
    }
    Ok(out)
}

/// A string-content message as vLLM joins it: media placeholders first, then the text parts
/// (and inline placeholders) joined with `"\n"`.
fn string_content(parts: &[Part<'_>], media: &str) -> String {
    let front = parts
        .iter()
        .filter(|p| matches!(p, Part::Media { inline: false, .. }))
        .count();
    let texts: Vec<&str> = parts
        .iter()
        .filter_map(|p| match p {
            Part::Text(t) => Some(*t),
            Part::Media { inline: true, .. } => Some(media),
            Part::Media { .. } => None,
        })
        .collect();
    let text = texts.join("\n");
    let mut all: Vec<&str> = std::iter::repeat_n(media, front).collect();
    if !text.is_empty() {
        all.push(&text);
    }
    all.join("\n")
}

/// The error for a media part where no stand-in can be placed; `None` for a text part.
fn media_error(index: usize, part: &Part<'_>) -> Option<ChatError> {
    match part {
        Part::Media {
            part, part_type, ..
        } => Some(ChatError::UnsupportedContentPart {
            index,
            part: *part,
            part_type: (*part_type).to_owned(),
        }),
        Part::Text(_) => None,
    }
}

fn text_part(text: String) -> Value {
    let mut part = Map::new();
    part.insert("type".into(), Value::from("text"));
    part.insert("text".into(), Value::from(text));
    Value::Object(part)
}

/// The texts of a message's content: none for `null`, one for a string, one per text part; a
/// media part is an error.
pub(crate) fn text_parts(index: usize, content: Option<&Value>) -> Result<Vec<&str>, ChatError> {
    let parts = content_parts(index, content)?;
    if let Some(err) = parts.iter().find_map(|p| media_error(index, p)) {
        return Err(err);
    }
    Ok(parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Text(t) => Some(t),
            Part::Media { .. } => None,
        })
        .collect())
}

/// A message's content parts: none for `null`, one text for a string, one per text or media
/// part (text parts whose text is null are skipped, as vLLM skips them).
pub(crate) fn content_parts(
    index: usize,
    content: Option<&Value>,
) -> Result<Vec<Part<'_>>, ChatError> {
    match content {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![Part::Text(s.as_str())]),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (part_index, part) in parts.iter().enumerate() {
                match part {
                    Value::String(s) => texts.push(Part::Text(s.as_str())),
                    Value::Object(obj) => {
                        let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
                        if let Some((part_type, inline)) =
                            MEDIA_PARTS.iter().find(|(t, _)| *t == kind)
                        {
                            texts.push(Part::Media {
                                part: part_index,
                                part_type,
                                inline: *inline,
                            });
                            continue;
                        }
                        let Some((_, field)) = TEXT_PARTS.iter().find(|(t, _)| *t == kind) else {
                            return Err(ChatError::UnsupportedContentPart {
                                index,
                                part: part_index,
                                part_type: if kind.is_empty() {
                                    "<missing>".into()
                                } else {
                                    kind.into()
                                },
                            });
                        };
                        // vLLM skips a text part whose text is null or absent.
                        match obj.get(*field) {
                            None | Some(Value::Null) => {}
                            Some(Value::String(s)) => texts.push(Part::Text(s.as_str())),
                            Some(_) => {
                                return Err(ChatError::InvalidMessage {
                                    index,
                                    reason: format!(
                                        "content[{part_index}].{field} must be a string"
                                    ),
                                })
                            }
                        }
                    }
                    _ => {
                        return Err(ChatError::InvalidMessage {
                            index,
                            reason: format!("content[{part_index}] must be an object or a string"),
                        })
                    }
                }
            }
            Ok(texts)
        }
        Some(_) => Err(ChatError::InvalidMessage {
            index,
            reason: "`content` must be a string, an array of content parts or null".into(),
        }),
    }
}

/// vLLM's tool-call post-processing: `arguments` become an object the template can walk.
fn tool_calls(index: usize, calls: &Value) -> Result<Value, ChatError> {
    let Some(calls) = calls.as_array() else {
        // vLLM leaves a non-list untouched; templates then see it as is.
        return Ok(calls.clone());
    };
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let Some(call) = call.as_object() else {
            return Err(ChatError::InvalidMessage {
                index,
                reason: "tool_calls entries must be objects".into(),
            });
        };
        let kind_ok = call
            .get("type")
            .is_none_or(|t| t.as_str() == Some("function"));
        let Some(function) = call
            .get("function")
            .and_then(Value::as_object)
            .filter(|_| kind_ok)
        else {
            return Err(ChatError::InvalidMessage {
                index,
                reason: "tool_calls entries must have type \"function\" and a `function` object"
                    .into(),
            });
        };
        let arguments = match function.get("arguments") {
            Some(Value::Object(obj)) => Value::Object(obj.clone()),
            Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(obj)) => Value::Object(obj),
                _ => Value::Object(Map::new()),
            },
            _ => Value::Object(Map::new()),
        };
        let mut function = function.clone();
        function.insert("arguments".into(), arguments);
        let mut call = call.clone();
        call.insert("function".into(), Value::Object(function));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

/// HF's normalisation: drop `null` keys, alias the reasoning under every name templates read.
fn hf_normalize(message: Map<String, Value>) -> Value {
    let message: Map<String, Value> = message.into_iter().filter(|(_, v)| !v.is_null()).collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| message.get(*k))
        .cloned();
    let Some(reasoning) = reasoning else {
        return Value::Object(message);
    };
    // Python's {"thinking": r, **message, "reasoning_content": r}: "thinking" keeps the first slot.
    let mut out = Map::new();
    out.insert("thinking".into(), reasoning.clone());
    for (k, v) in message {
        out.insert(k, v);
    }
    out.insert("reasoning_content".into(), reasoning);
    Value::Object(out)
}

/// vLLM's `tool.model_dump()` for each OpenAI tool: declared fields first (null when absent),
/// extra fields after them in request order.
pub fn build_tools(tools: &[Value]) -> Result<Vec<Value>, ChatError> {
    tools
        .iter()
        .enumerate()
        .map(|(index, tool)| {
            let bad = |reason: &str| ChatError::InvalidTool {
                index,
                reason: reason.into(),
            };
            let tool = tool
                .as_object()
                .ok_or_else(|| bad("a tool must be a JSON object"))?;
            let kind = match tool.get("type") {
                None => "function",
                Some(Value::String(s)) if s == "function" => "function",
                Some(_) => return Err(bad("`type` must be \"function\"")),
            };
            let function = tool
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("`function` must be an object"))?;
            let name = function
                .get("name")
                .filter(|v| v.is_string())
                .ok_or_else(|| bad("`function.name` must be a string"))?;
            let description = function.get("description").cloned().unwrap_or(Value::Null);
            if !(description.is_null() || description.is_string()) {
                return Err(bad("`function.description` must be a string or null"));
            }
            let parameters = function.get("parameters").cloned().unwrap_or(Value::Null);
            if !(parameters.is_null() || parameters.is_object()) {
                return Err(bad("`function.parameters` must be an object or null"));
            }
            let mut dumped_fn = Map::new();
            dumped_fn.insert("name".into(), name.clone());
            dumped_fn.insert("description".into(), description);
            dumped_fn.insert("parameters".into(), parameters);
            for (k, v) in function {
                if !dumped_fn.contains_key(k) {
                    dumped_fn.insert(k.clone(), v.clone());
                }
            }
            let mut dumped = Map::new();
            dumped.insert("type".into(), Value::from(kind));
            dumped.insert("function".into(), Value::Object(dumped_fn));
            for (k, v) in tool {
                if !dumped.contains_key(k) {
                    dumped.insert(k.clone(), v.clone());
                }
            }
            Ok(Value::Object(dumped))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_content_format() {
        assert_eq!(
            ContentFormat::detect("{% for message in messages %}{{ message.content }}{% endfor %}"),
            ContentFormat::String
        );
        assert_eq!(
            ContentFormat::detect("{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            ContentFormat::detect(
                "{%- for c in message.content | selectattr('type') %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
    }

    #[test]
    fn joins_text_parts_and_nulls() {
        let messages = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": null}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [], "extra": 1}),
        ];
        let out = build_messages(&messages, ContentFormat::String, None).unwrap();
        assert_eq!(
            out,
            vec![
                json!({"role": "user", "content": "a\nb"}),
                json!({"role": "assistant", "content": ""})
            ]
        );
        let out = build_messages(&messages, ContentFormat::OpenAi, None).unwrap();
        assert_eq!(
            out[0],
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
        );
        assert_eq!(out[1], json!({"role": "assistant", "content": []}));
    }

    #[test]
    fn media_stand_ins_go_where_vllm_puts_placeholders() {
        let img = json!({"type": "image_url", "image_url": {"url": "x"}});
        let emb = json!({"type": "prompt_embeds", "prompt_embeds": "AA=="});
        let messages = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, img, {"type": "text", "text": "b"}, img]}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, emb, {"type": "text", "text": "b"}]}),
            json!({"role": "user", "content": [img]}),
            json!({"role": "tool", "content": [{"type": "text", "text": "t"}, img]}),
        ];
        let out = build_messages(&messages, ContentFormat::String, Some("<I>")).unwrap();
        let contents: Vec<&Value> = out.iter().map(|m| &m["content"]).collect();
        assert_eq!(
            contents,
            [
                &json!("<I>\n<I>\na\nb"),
                &json!("a\n<I>\nb"),
                &json!("<I>"),
                &json!("<I>\nt")
            ]
        );
        let out = build_messages(&messages, ContentFormat::OpenAi, Some("<I>")).unwrap();
        assert_eq!(
            out[0]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "<I>"}, {"type": "text", "text": "b"}, {"type": "text", "text": "<I>"}])
        );
        assert_eq!(out[3]["content"], json!("<I>\nt"));
        assert_eq!(
            first_media(&messages),
            Some(MediaCut {
                message: 0,
                part: 1,
                part_type: "image_url".into()
            })
        );
        assert_eq!(
            first_media(&messages[1..2]).unwrap().part_type,
            "prompt_embeds"
        );
        assert_eq!(
            first_media(&[json!({"role": "user", "content": "x"})]),
            None
        );
    }

    #[test]
    fn rejects_images() {
        let messages = vec![
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        ];
        let err = build_messages(&messages, ContentFormat::String, None).unwrap_err();
        assert!(err.to_string().contains("image_url"), "{err}");
    }

    #[test]
    fn parses_tool_call_arguments_and_aliases_reasoning() {
        let messages = vec![
            json!({"role": "assistant", "content": "x", "reasoning": "r", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}},
                {"id": "2", "function": {"name": "g", "arguments": "[1]"}}
            ]}),
        ];
        let out = build_messages(&messages, ContentFormat::String, None).unwrap();
        let text = serde_json::to_string(&out[0]).unwrap();
        assert_eq!(
            text,
            r#"{"thinking":"r","role":"assistant","content":"x","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":{"b":1,"a":2}}},{"id":"2","function":{"name":"g","arguments":{}}}],"reasoning":"r","reasoning_content":"r"}"#
        );
    }

    #[test]
    fn dumps_tools_like_vllm() {
        let tools = vec![json!({"function": {"strict": true, "name": "f"}, "x": 1})];
        let out = build_tools(&tools).unwrap();
        assert_eq!(
            serde_json::to_string(&out[0]).unwrap(),
            r#"{"type":"function","function":{"name":"f","description":null,"parameters":null,"strict":true},"x":1}"#
        );
        assert!(build_tools(&[json!({"type": "custom", "function": {"name": "f"}})]).is_err());
        assert!(build_tools(&[json!({"function": {}})]).is_err());
    }
}
