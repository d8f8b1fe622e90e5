//! OpenAI request bodies parsed into typed requests, and the prompt token ids the engine will see.
//!
//! [`Request::from_json`] accepts the bytes of a `/v1/completions` or `/v1/chat/completions`
//! body and keeps only what routing needs: the model, the prompt (text, token ids or chat
//! messages with tools and template switches) and the extras that change the engine's block
//! hashes or the routing key (`cache_salt`, `add_special_tokens`, `user`, LoRA). Every other
//! field (sampling, streaming, ...) is ignored. Parsing never panics: any input, including
//! non-UTF-8 bytes, deep nesting, huge or negative numbers, yields a [`PromptError`] naming the
//! field and what was expected.
//!
//! [`PromptTokens::from_request`] then produces the ids: token-id prompts as given, text
//! prompts encoded with vLLM's completions default (`add_special_tokens=true`), chat requests
//! rendered with the model's [`ChatTemplate`] and encoded with vLLM's chat default (`false`).
//! [`PromptTokens::prefix_from_request`] does the same under a [`PrefixCap`]: only the first ids
//! (exactly the engine's), with the reason when ids are missing.

use serde_json::{Map, Value};

use crate::bpe::{PrefixCap, Truncation};
use crate::chat::{ChatError, ChatRequest, ChatTemplate};
use crate::tokenize::{TokenizeError, Tokenizer};

/// Why a body could not be parsed or turned into tokens.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PromptError {
    /// Not JSON (or not UTF-8, or nested too deeply).
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    /// JSON, but not an object.
    #[error("request body must be a JSON object, got {0}")]
    NotAnObject(&'static str),
    /// A required field is absent.
    #[error("field `{field}` is missing; expected {expected}")]
    Missing {
        /// The field.
        field: &'static str,
        /// What it must hold.
        expected: &'static str,
    },
    /// A field has the wrong JSON type.
    #[error("field `{field}` must be {expected}, got {found}")]
    WrongType {
        /// The field (with its index path, e.g. `messages[2].role`).
        field: String,
        /// What it must hold.
        expected: &'static str,
        /// The JSON type found.
        found: &'static str,
    },
    /// A token id outside `0..=u32::MAX`, or not an integer.
    #[error("field `{field}`: {value} is not a token id; expected an integer in 0..=4294967295")]
    BadTokenId {
        /// The field with its index path.
        field: String,
        /// The offending number as written.
        value: String,
    },
    /// A list that must not be empty is empty.
    #[error("field `{field}` is empty; expected {expected}")]
    Empty {
        /// The field.
        field: &'static str,
        /// What it must hold.
        expected: &'static str,
    },
    /// Batched completions: each prompt would go to its own engine sequence.
    #[error("prompt arrays with {0} elements are not routed; send one prompt per request")]
    MultiplePrompts(usize),
    /// Both or neither of `prompt` and `messages`.
    #[error("{0}; expected exactly one of `prompt` (/v1/completions) and `messages` (/v1/chat/completions)")]
    PromptOrMessages(&'static str),
    /// The body does not match the endpoint it was sent to.
    #[error("field `{field}` is missing for {endpoint}")]
    WrongEndpoint {
        /// The field the endpoint needs.
        field: &'static str,
        /// The endpoint path.
        endpoint: &'static str,
    },
    /// A chat request, but no chat template is configured for the model.
    #[error("a chat request needs the model's chat template, and none is configured")]
    NoChatTemplate,
    /// Rendering the chat template failed.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// Tokenizing failed.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
}

/// The endpoints kvroute routes: OpenAI's two and Anthropic's Messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`: a `prompt`.
    Completions,
    /// `/v1/chat/completions`: `messages`.
    ChatCompletions,
    /// `/v1/messages` (Anthropic Messages): `messages` and `system`, converted as vLLM converts
    /// them ([`crate::chat::anthropic`]).
    Messages,
}

impl Endpoint {
    /// The URL path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::ChatCompletions => "/v1/chat/completions",
            Self::Messages => "/v1/messages",
        }
    }

    /// The endpoint of a request path (a query or fragment ignored).
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        [Self::Completions, Self::ChatCompletions, Self::Messages]
            .into_iter()
            .find(|e| e.path() == path)
    }
}

/// A `/v1/completions` prompt (exactly one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text the engine tokenizes.
    Text(String),
    /// Token ids the engine uses as given.
    TokenIds(Vec<u32>),
}

/// What the engine turns into prompt tokens.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestBody {
    /// `/v1/completions`.
    Completion(Prompt),
    /// `/v1/chat/completions`.
    Chat(ChatRequest),
}

/// The routing-relevant part of an OpenAI request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// `model`; vLLM serves LoRA adapters under their own name here. `None` when omitted
    /// (vLLM then uses its only served model).
    pub model: Option<String>,
    /// The prompt or the conversation.
    pub body: RequestBody,
    /// `add_special_tokens` if the client set it (vLLM: true for completions, false for chat).
    pub add_special_tokens: Option<bool>,
    /// `cache_salt`: vLLM and SGLang mix it into the first block's hash.
    pub cache_salt: Option<String>,
    /// `user`, e.g. for per-user affinity rules.
    pub user: Option<String>,
    /// An explicit LoRA adapter (`lora_path` as SGLang names it, or `lora`); vLLM has none
    /// and names the adapter in `model`.
    pub lora: Option<String>,
    /// The endpoint the body was parsed for.
    pub endpoint: Endpoint,
    /// An Anthropic body's `cache_control` breakpoints (empty for other endpoints).
    pub breakpoints: crate::chat::anthropic::Breakpoints,
}

impl Request {
    /// Parses a body, telling the endpoint from its fields (`prompt` or `messages`).
    pub fn from_json(body: &[u8]) -> Result<Self, PromptError> {
        let obj = parse_object(body)?;
        let has_prompt = obj.contains_key("prompt");
        let has_messages = obj.contains_key("messages");
        let endpoint = match (has_prompt, has_messages) {
            (true, false) => Endpoint::Completions,
            (false, true) => Endpoint::ChatCompletions,
            (true, true) => {
                return Err(PromptError::PromptOrMessages(
                    "both `prompt` and `messages` are present",
                ))
            }
            (false, false) => {
                return Err(PromptError::PromptOrMessages(
                    "neither `prompt` nor `messages` is present",
                ))
            }
        };
        Self::from_object(obj, endpoint)
    }

    /// Parses a body sent to a known endpoint.
    pub fn from_json_for(body: &[u8], endpoint: Endpoint) -> Result<Self, PromptError> {
        let obj = parse_object(body)?;
        Self::from_object(obj, endpoint)
    }

    /// The endpoint this request belongs to.
    pub fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    /// Builds the request from the parsed body, taking the messages out of it (no copy of the
    /// conversation).
    fn from_object(mut obj: Map<String, Value>, endpoint: Endpoint) -> Result<Self, PromptError> {
        let body = match endpoint {
            Endpoint::Completions => {
                let prompt = obj.get("prompt").ok_or(PromptError::WrongEndpoint {
                    field: "prompt",
                    endpoint: endpoint.path(),
                })?;
                RequestBody::Completion(parse_prompt(prompt)?)
            }
            Endpoint::ChatCompletions => {
                let messages = obj
                    .get_mut("messages")
                    .ok_or(PromptError::WrongEndpoint {
                        field: "messages",
                        endpoint: endpoint.path(),
                    })?
                    .take();
                let tools = opt_list(&obj, "tools")?;
                RequestBody::Chat(parse_chat(&obj, messages, tools)?)
            }
            Endpoint::Messages => {
                let (messages, tools) = crate::chat::anthropic::to_chat(&obj)?;
                // vLLM's converted request keeps only the template kwargs of the chat switches.
                let mut chat = Map::new();
                if let Some(kwargs) = obj.get("chat_template_kwargs") {
                    chat.insert("chat_template_kwargs".into(), kwargs.clone());
                }
                RequestBody::Chat(parse_chat(&chat, Value::Array(messages), tools)?)
            }
        };
        let obj = &obj;
        if endpoint == Endpoint::Messages {
            // Anthropic's own fields; vLLM's converted request carries only the salt.
            let user = match obj.get("metadata") {
                None | Some(Value::Null) => None,
                Some(Value::Object(meta)) => opt_string(meta, "user_id")?,
                Some(other) => return Err(wrong("metadata", "an object", other)),
            };
            return Ok(Self {
                model: opt_string(obj, "model")?,
                body,
                add_special_tokens: None,
                cache_salt: opt_string(obj, "cache_salt")?,
                user,
                lora: None,
                endpoint,
                breakpoints: crate::chat::anthropic::breakpoints(obj),
            });
        }
        Ok(Self {
            model: opt_string(obj, "model")?,
            body,
            add_special_tokens: opt_bool(obj, "add_special_tokens")?,
            cache_salt: opt_string(obj, "cache_salt")?,
            user: opt_string(obj, "user")?,
            lora: match opt_string(obj, "lora_path")? {
                Some(path) => Some(path),
                None => opt_string(obj, "lora")?,
            },
            endpoint,
            breakpoints: Default::default(),
        })
    }
}

/// The prompt token ids of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptTokens;

/// Text to token ids, as the engine's tokenizer computes them.
pub trait TextEncoder {
    /// Encodes `text`; `add_special_tokens` applies the tokenizer's post-processor.
    fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError>;

    /// The first `cap.max_tokens` ids of [`TextEncoder::encode_text`] (fewer when the encoder
    /// stops before a piece longer than `cap.max_piece_bytes`), and why ids are missing. The
    /// default encodes everything and cuts, so it bounds the ids but not the work; an encoder
    /// that can stop early (the fast BPE) overrides it.
    fn encode_text_prefix(
        &self,
        text: &str,
        add_special_tokens: bool,
        cap: PrefixCap,
    ) -> Result<(Vec<u32>, Option<Truncation>), TokenizeError> {
        let mut ids = self.encode_text(text, add_special_tokens)?;
        let cut = ids.len() > cap.max_tokens;
        ids.truncate(cap.max_tokens);
        Ok((ids, cut.then_some(Truncation::MaxTokens)))
    }
}

impl TextEncoder for Tokenizer {
    fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode(text, add_special_tokens)
    }
}

impl PromptTokens {
    /// The token ids the engine computes for `request`: token-id prompts as given; text encoded
    /// with `add_special_tokens` (default true); chat rendered with `template` and encoded with
    /// `add_special_tokens` (default false). A chat request without a template is an error.
    pub fn from_request<E: TextEncoder + ?Sized>(
        request: &Request,
        tokenizer: &E,
        template: Option<&ChatTemplate>,
    ) -> Result<Vec<u32>, PromptError> {
        match &request.body {
            RequestBody::Completion(Prompt::TokenIds(ids)) => Ok(ids.clone()),
            RequestBody::Completion(Prompt::Text(text)) => {
                Ok(tokenizer.encode_text(text, request.add_special_tokens.unwrap_or(true))?)
            }
            RequestBody::Chat(chat) => {
                let template = template.ok_or(PromptError::NoChatTemplate)?;
                let text = template.render(chat)?;
                Ok(tokenizer.encode_text(&text, request.add_special_tokens.unwrap_or(false))?)
            }
        }
    }

    /// [`PromptTokens::from_request`] under `cap`: the first ids only (token-id prompts are cut
    /// too), and why ids are missing (`None`: they are all there).
    pub fn prefix_from_request<E: TextEncoder + ?Sized>(
        request: &Request,
        tokenizer: &E,
        template: Option<&ChatTemplate>,
        cap: PrefixCap,
    ) -> Result<(Vec<u32>, Option<Truncation>), PromptError> {
        match &request.body {
            RequestBody::Completion(Prompt::TokenIds(ids)) => {
                let n = ids.len().min(cap.max_tokens);
                let cut = (n < ids.len()).then_some(Truncation::MaxTokens);
                Ok((ids.get(..n).unwrap_or(&[]).to_vec(), cut))
            }
            RequestBody::Completion(Prompt::Text(text)) => Ok(tokenizer.encode_text_prefix(
                text,
                request.add_special_tokens.unwrap_or(true),
                cap,
            )?),
            RequestBody::Chat(chat) => {
                let template = template.ok_or(PromptError::NoChatTemplate)?;
                let rendered = template.render_prefix(chat)?;
                let (mut ids, truncated) = tokenizer.encode_text_prefix(
                    &rendered.text,
                    request.add_special_tokens.unwrap_or(false),
                    cap,
                )?;
                let truncated = match rendered.media {
                    Some(_) => stop_before_media(&mut ids, truncated),
                    None => truncated,
                };
                Ok((ids, truncated))
            }
        }
    }
}

/// The ids of a chat prompt's text before its first media item, as routed: a bound that already
/// cut them stays the reason; otherwise the last id goes (the placeholder that follows in the
/// engine's prompt may join its piece) and the reason is [`Truncation::Media`].
pub fn stop_before_media(ids: &mut Vec<u32>, truncated: Option<Truncation>) -> Option<Truncation> {
    if truncated.is_some() {
        return truncated;
    }
    ids.pop();
    Some(Truncation::Media)
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, PromptError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(other) => Err(PromptError::NotAnObject(json_type(&other))),
        Err(e) => Err(PromptError::Json(e.to_string())),
    }
}

/// The JSON type name used in error messages.
pub(crate) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a float",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(field: impl Into<String>, expected: &'static str, found: &Value) -> PromptError {
    PromptError::WrongType {
        field: field.into(),
        expected,
        found: json_type(found),
    }
}

/// An optional string field; `null` counts as absent.
fn opt_string(
    obj: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, PromptError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(wrong(field, "a string", other)),
    }
}

/// An optional boolean field; `null` counts as absent.
fn opt_bool(obj: &Map<String, Value>, field: &'static str) -> Result<Option<bool>, PromptError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(wrong(field, "a boolean", other)),
    }
}

const PROMPT_EXPECTED: &str =
    "a string, an array of one string, an array of token ids or an array of one token-id array";

/// vLLM's `prompt` forms, restricted to exactly one prompt.
fn parse_prompt(prompt: &Value) -> Result<Prompt, PromptError> {
    match prompt {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => match items.first() {
            None => Err(PromptError::Empty {
                field: "prompt",
                expected: PROMPT_EXPECTED,
            }),
            Some(Value::Number(_)) => Ok(Prompt::TokenIds(token_ids("prompt", items)?)),
            Some(Value::String(_)) | Some(Value::Array(_)) if items.len() > 1 => {
                Err(PromptError::MultiplePrompts(items.len()))
            }
            Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
            Some(Value::Array(ids)) if ids.is_empty() => Err(PromptError::Empty {
                field: "prompt",
                expected: "a non-empty token-id array",
            }),
            Some(Value::Array(ids)) => Ok(Prompt::TokenIds(token_ids("prompt[0]", ids)?)),
            Some(other) => Err(wrong("prompt[0]", PROMPT_EXPECTED, other)),
        },
        other => Err(wrong("prompt", PROMPT_EXPECTED, other)),
    }
}

fn token_ids(field: &str, items: &[Value]) -> Result<Vec<u32>, PromptError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::Number(n) => n
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| PromptError::BadTokenId {
                    field: format!("{field}[{i}]"),
                    value: n.to_string(),
                }),
            other => Err(wrong(format!("{field}[{i}]"), "an integer token id", other)),
        })
        .collect()
}

/// An optional array field.
fn opt_list(
    obj: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<Vec<Value>>, PromptError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => Ok(Some(items.clone())),
        Some(other) => Err(wrong(field, "an array", other)),
    }
}

fn parse_chat(
    obj: &Map<String, Value>,
    messages: Value,
    tools: Option<Vec<Value>>,
) -> Result<ChatRequest, PromptError> {
    let Value::Array(messages) = messages else {
        return Err(wrong("messages", "an array of message objects", &messages));
    };
    if messages.is_empty() {
        return Err(PromptError::Empty {
            field: "messages",
            expected: "at least one message",
        });
    }
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(m) = message else {
            return Err(wrong(format!("messages[{i}]"), "an object", message));
        };
        match m.get("role") {
            Some(Value::String(_)) => {}
            None => {
                return Err(PromptError::WrongType {
                    field: format!("messages[{i}].role"),
                    expected: "a string",
                    found: "nothing",
                })
            }
            Some(other) => return Err(wrong(format!("messages[{i}].role"), "a string", other)),
        }
        match m.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(other) => {
                return Err(wrong(
                    format!("messages[{i}].content"),
                    "a string, an array of content parts or null",
                    other,
                ))
            }
        }
    }
    let chat_template_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(kwargs)) => kwargs.clone(),
        Some(other) => return Err(wrong("chat_template_kwargs", "an object", other)),
    };
    Ok(ChatRequest {
        messages,
        tools,
        documents: opt_list(obj, "documents")?,
        add_generation_prompt: opt_bool(obj, "add_generation_prompt")?.unwrap_or(true),
        continue_final_message: opt_bool(obj, "continue_final_message")?.unwrap_or(false),
        chat_template_kwargs,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn prompt(json: &str) -> Result<Prompt, PromptError> {
        match Request::from_json(json.as_bytes())?.body {
            RequestBody::Completion(p) => Ok(p),
            RequestBody::Chat(_) => panic!("not a completion"),
        }
    }

    #[test]
    fn completion_prompt_forms() {
        assert_eq!(
            prompt(r#"{"model": "m", "prompt": "hi"}"#).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            prompt(r#"{"prompt": ["hi"]}"#).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            prompt(r#"{"prompt": [1, 2, 4294967295]}"#).unwrap(),
            Prompt::TokenIds(vec![1, 2, u32::MAX])
        );
        assert_eq!(
            prompt(r#"{"prompt": [[7, 8]]}"#).unwrap(),
            Prompt::TokenIds(vec![7, 8])
        );
        assert_eq!(
            prompt(r#"{"prompt": ["a", "b", "c"]}"#).unwrap_err(),
            PromptError::MultiplePrompts(3)
        );
        assert_eq!(
            prompt(r#"{"prompt": ["a", "b"]}"#).unwrap_err().to_string(),
            "prompt arrays with 2 elements are not routed; send one prompt per request"
        );
        assert_eq!(
            prompt(r#"{"prompt": [[1], [2]]}"#).unwrap_err(),
            PromptError::MultiplePrompts(2)
        );
        assert!(matches!(
            prompt(r#"{"prompt": [-1]}"#),
            Err(PromptError::BadTokenId { .. })
        ));
        assert!(matches!(
            prompt(r#"{"prompt": [4294967296]}"#),
            Err(PromptError::BadTokenId { .. })
        ));
        assert!(matches!(
            prompt(r#"{"prompt": [1.5]}"#),
            Err(PromptError::BadTokenId { .. })
        ));
        assert!(matches!(
            prompt(r#"{"prompt": [1, "a"]}"#),
            Err(PromptError::WrongType { .. })
        ));
        assert!(matches!(
            prompt(r#"{"prompt": []}"#),
            Err(PromptError::Empty { .. })
        ));
        assert!(matches!(
            prompt(r#"{"prompt": [[]]}"#),
            Err(PromptError::Empty { .. })
        ));
        assert!(matches!(
            prompt(r#"{"prompt": 5}"#),
            Err(PromptError::WrongType { .. })
        ));
    }

    #[test]
    fn chat_fields_and_extras() {
        let body = br#"{"model": "qwen-lora", "messages": [{"role": "user", "content": "hi"}], "tools": [],
            "chat_template_kwargs": {"enable_thinking": false}, "add_generation_prompt": false,
            "continue_final_message": true, "cache_salt": "s", "user": "u", "lora_path": "l", "add_special_tokens": true,
            "temperature": 0.2, "stream": true}"#;
        let req = Request::from_json(body).unwrap();
        assert_eq!(req.model.as_deref(), Some("qwen-lora"));
        assert_eq!(req.cache_salt.as_deref(), Some("s"));
        assert_eq!(req.user.as_deref(), Some("u"));
        assert_eq!(req.lora.as_deref(), Some("l"));
        assert_eq!(req.add_special_tokens, Some(true));
        assert_eq!(req.endpoint(), Endpoint::ChatCompletions);
        let RequestBody::Chat(chat) = req.body else {
            panic!("chat expected")
        };
        assert!(!chat.add_generation_prompt);
        assert!(chat.continue_final_message);
        assert_eq!(chat.tools, Some(vec![]));
        assert_eq!(
            chat.chat_template_kwargs.get("enable_thinking"),
            Some(&Value::Bool(false))
        );
    }

    #[test]
    fn endpoint_mismatch_and_ambiguity() {
        assert!(matches!(
            Request::from_json_for(br#"{"prompt": "x"}"#, Endpoint::ChatCompletions),
            Err(PromptError::WrongEndpoint {
                field: "messages",
                ..
            })
        ));
        assert!(matches!(
            Request::from_json(br#"{"prompt": "x", "messages": []}"#),
            Err(PromptError::PromptOrMessages(_))
        ));
        assert!(matches!(
            Request::from_json(br#"{"model": "x"}"#),
            Err(PromptError::PromptOrMessages(_))
        ));
    }

    #[test]
    fn errors_name_fields() {
        let err =
            Request::from_json(br#"{"messages": [{"role": "user", "content": 5}]}"#).unwrap_err();
        assert_eq!(err.to_string(), "field `messages[0].content` must be a string, an array of content parts or null, got an integer");
        let err = Request::from_json(br#"{"messages": [{"content": "x"}]}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "field `messages[0].role` must be a string, got nothing"
        );
        let err = Request::from_json(br#"{"prompt": "x", "model": 3}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "field `model` must be a string, got an integer"
        );
    }
}
