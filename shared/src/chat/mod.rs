//! Chat templates: OpenAI `/v1/chat/completions` messages rendered to the exact prompt text the
//! engine tokenizes.
//!
//! vLLM renders with HuggingFace `apply_chat_template`, i.e. Jinja2 with `trim_blocks`,
//! `lstrip_blocks`, HF's `tojson`/`raise_exception`/`strftime_now`, the tokenizer's special
//! tokens as variables, and the request's `chat_template_kwargs`. [`ChatTemplate`] reproduces
//! that with minijinja: Python string/dict methods come from minijinja-contrib's `pycompat`,
//! values print as Python prints them ([`python`]), and the conversation is prepared as vLLM
//! and HF prepare it ([`conversation`]). The Qwen3 fixtures in `tests/fixtures/chat/` prove
//! byte equality with the Python stack.
//!
//! Invariant: rendering reads no clock and no file; `strftime_now` uses the clock the caller
//! sets with [`ChatTemplate::set_clock`] (none set: templates that call it fail to render).

pub mod anthropic;
pub mod conversation;
pub mod native;
pub mod python;
pub mod strftime;

use std::sync::Arc;

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, UndefinedBehavior, Value};
use serde_json::{Map, Value as Json};

pub use conversation::{ContentFormat, MediaCut};

/// Why a template could not be loaded or a conversation could not be rendered.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ChatError {
    /// `tokenizer_config.json` is not JSON.
    #[error("tokenizer_config.json is not valid JSON: {0}")]
    ConfigJson(String),
    /// The config has no usable `chat_template`.
    #[error("tokenizer_config.json field `chat_template` {0}; expected a string or a list of {{\"name\", \"template\"}} objects")]
    NoTemplate(&'static str),
    /// The template source does not compile.
    #[error("chat template `{name}` does not compile: {reason}")]
    Compile {
        /// Template name (`default`, `tool_use`, ...).
        name: String,
        /// minijinja's message.
        reason: String,
    },
    /// A message is malformed for rendering.
    #[error("messages[{index}]: {reason}")]
    InvalidMessage {
        /// Index in `messages`.
        index: usize,
        /// What was expected.
        reason: String,
    },
    /// A content part the router cannot turn into text (images, audio, ...).
    #[error("messages[{index}].content[{part}] has type `{part_type}`; only text parts (text, input_text, output_text, refusal, thinking) can be routed")]
    UnsupportedContentPart {
        /// Index in `messages`.
        index: usize,
        /// Index in the message's `content`.
        part: usize,
        /// The part's `type`.
        part_type: String,
    },
    /// A tool definition is malformed.
    #[error("tools[{index}]: {reason}")]
    InvalidTool {
        /// Index in `tools`.
        index: usize,
        /// What was expected.
        reason: String,
    },
    /// A `chat_template_kwargs` key vLLM refuses.
    #[error("chat_template_kwargs key `{0}` is not allowed; vLLM rejects chat_template, tokenize and messages there")]
    ReservedKwarg(String),
    /// No messages: HF refuses to render an empty conversation.
    #[error("messages is empty; expected at least one message")]
    EmptyConversation,
    /// Both flags set: HF and vLLM reject the request.
    #[error("continue_final_message and add_generation_prompt are both true; expected at most one of them (set add_generation_prompt to false)")]
    ContinueWithGenerationPrompt,
    /// `continue_final_message` cannot be applied (as HF's checks).
    #[error("continue_final_message: {0}")]
    ContinueFinalMessage(&'static str),
    /// The template failed while rendering (including its own `raise_exception`).
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// A clock for `strftime_now`: Unix seconds, UTC.
pub type Clock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// One chat request as the template needs it: OpenAI-shaped messages and tools (the renderer
/// applies vLLM's preparation) plus the template switches.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// OpenAI messages, each a JSON object with a string `role`.
    pub messages: Vec<Json>,
    /// OpenAI tools (`{"type": "function", "function": {...}}`), `None` when absent.
    pub tools: Option<Vec<Json>>,
    /// vLLM's `documents` (RAG templates), passed through.
    pub documents: Option<Vec<Json>>,
    /// Append the assistant header (vLLM default true).
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open (vLLM default false).
    pub continue_final_message: bool,
    /// vLLM's `chat_template_kwargs`: extra template variables (`enable_thinking`, ...); they
    /// may also override the four fields above, as in vLLM.
    pub chat_template_kwargs: Map<String, Json>,
}

impl ChatRequest {
    /// A request with vLLM's defaults for everything but the messages.
    pub fn new(messages: Vec<Json>) -> Self {
        Self {
            messages,
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            chat_template_kwargs: Map::new(),
        }
    }
}

/// Special tokens HF passes to every template as variables.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The suffix HF appends to the final message to find where it ends after rendering.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Which renderer produced a prompt's text ([`ChatTemplate::render_traced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renderer {
    /// A native renderer ([`native`]: a template kvroute knows by its source).
    Native,
    /// minijinja's VM.
    Jinja,
}

/// What [`ChatTemplate::render_prefix`] rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The prompt text, or its part before the first media item.
    pub text: String,
    pub renderer: Renderer,
    /// Where the first media item is, when the text stops before it.
    pub media: Option<MediaCut>,
}

/// Stands for a media item while rendering: private-use code points no template emits on its
/// own. A client's text containing it only shortens its own routed prefix.
const MEDIA_STAND_IN: &str = "\u{e000}kvroute:media\u{e001}";

/// A compiled chat template with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template names in config order; `default`/`tool_use` are looked up by name.
    names: Vec<String>,
    /// Source per name (HF checks `continue_final_message`'s field against it).
    sources: Vec<String>,
    special_tokens: Map<String, Json>,
    /// Detected per template; `format_override` wins when set.
    formats: Vec<ContentFormat>,
    format_override: Option<ContentFormat>,
    /// Per template: its native renderer, when kvroute knows the source ([`native`]).
    natives: Vec<Option<native::Native>>,
    /// False: every render goes through the Jinja VM (tests compare the two).
    native_enabled: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .field("special_tokens", &self.special_tokens)
            .field("formats", &self.formats)
            .field("format_override", &self.format_override)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads `chat_template` (a string, or a list of `{"name", "template"}`), and `bos_token`,
    /// `eos_token` and the other special tokens (strings or `{"content": ...}`) from the bytes of
    /// a `tokenizer_config.json`.
    pub fn new(config_json: &[u8]) -> Result<Self, ChatError> {
        let config: Json = serde_json::from_slice(config_json)
            .map_err(|e| ChatError::ConfigJson(e.to_string()))?;
        let Some(config) = config.as_object() else {
            return Err(ChatError::ConfigJson(
                "the top level is not an object".into(),
            ));
        };
        let templates = match config.get("chat_template") {
            None | Some(Json::Null) => return Err(ChatError::NoTemplate("is missing")),
            Some(Json::String(s)) => vec![("default".to_owned(), s.clone())],
            Some(Json::Array(items)) => {
                let mut templates = Vec::with_capacity(items.len());
                for item in items {
                    let name = item.get("name").and_then(Json::as_str);
                    let template = item.get("template").and_then(Json::as_str);
                    match (name, template) {
                        (Some(n), Some(t)) => templates.push((n.to_owned(), t.to_owned())),
                        _ => {
                            return Err(ChatError::NoTemplate(
                                "has a list entry without string `name` and `template`",
                            ))
                        }
                    }
                }
                if templates.is_empty() {
                    return Err(ChatError::NoTemplate("is an empty list"));
                }
                templates
            }
            Some(_) => return Err(ChatError::NoTemplate("has the wrong type")),
        };
        let mut special_tokens = Map::new();
        for key in SPECIAL_TOKEN_KEYS {
            let token = match config.get(key) {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Object(obj)) => {
                    obj.get("content").and_then(Json::as_str).map(str::to_owned)
                }
                _ => None,
            };
            if let Some(token) = token {
                special_tokens.insert(key.to_owned(), Json::String(token));
            }
        }
        // Named extras (Gemma 3's `boi_token`, ...) are template variables in HF too.
        if let Some(Json::Object(extra)) = config.get("extra_special_tokens") {
            for (key, value) in extra {
                let token = match value {
                    Json::String(s) => Some(s.clone()),
                    Json::Object(obj) => {
                        obj.get("content").and_then(Json::as_str).map(str::to_owned)
                    }
                    _ => None,
                };
                if let Some(token) = token {
                    special_tokens.insert(key.clone(), Json::String(token));
                }
            }
        }
        Self::from_templates(templates, special_tokens)
    }

    /// Builds from template sources (`(name, source)`, first is the fallback) and special tokens
    /// (`{"bos_token": "<s>", ...}`), e.g. for a `chat_template.jinja` file or a server override.
    pub fn from_templates(
        templates: Vec<(String, String)>,
        special_tokens: Map<String, Json>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            let mut s = String::new();
            python::py_str(&mut s, value);
            out.write_str(&s).map_err(minijinja::Error::from)
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |value: Value| {
            let mut s = String::new();
            python::py_str(&mut s, &value);
            s
        });
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function(
            "strftime_now",
            |_format: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "strftime_now needs a clock: call ChatTemplate::set_clock",
                ))
            },
        );
        let mut names = Vec::with_capacity(templates.len());
        let mut sources = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            let prepared = replace_generation_tags(&source);
            env.add_template_owned(name.clone(), prepared)
                .map_err(|e| ChatError::Compile {
                    name: name.clone(),
                    reason: e.to_string(),
                })?;
            names.push(name);
            sources.push(source);
        }
        let formats = sources.iter().map(|s| ContentFormat::detect(s)).collect();
        let natives = sources.iter().map(|s| native::Native::detect(s)).collect();
        Ok(Self {
            env,
            names,
            sources,
            special_tokens,
            formats,
            format_override: None,
            natives,
            native_enabled: true,
        })
    }

    /// Sets the clock `strftime_now` reads (the filter passes the host's time).
    pub fn set_clock(&mut self, clock: Clock) {
        self.env.add_function(
            "strftime_now",
            move |format: String| -> Result<String, minijinja::Error> {
                strftime::format(&format, clock())
                    .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e))
            },
        );
    }

    /// Turns the native renderers off (`false`) or back on: off, every conversation is rendered
    /// by the Jinja VM (the output is the same; tests compare the two).
    pub fn set_native(&mut self, enabled: bool) {
        self.native_enabled = enabled;
    }

    /// The native renderer the default template uses, if any ([`native`]).
    pub fn native(&self) -> Option<native::Native> {
        self.natives.get(self.pick(false)).copied().flatten()
    }

    /// Overrides the detected content format (vLLM's `--chat-template-content-format`).
    pub fn set_content_format(&mut self, format: ContentFormat) {
        self.format_override = Some(format);
    }

    /// The content format used for the default template (the override if set).
    pub fn content_format(&self) -> ContentFormat {
        self.format_of(self.pick(false))
    }

    fn format_of(&self, index: usize) -> ContentFormat {
        self.format_override
            .or_else(|| self.formats.get(index).copied())
            .unwrap_or(ContentFormat::String)
    }

    /// The special-token variables the template sees (`bos_token`, `eos_token`, ...).
    pub fn special_tokens(&self) -> &Map<String, Json> {
        &self.special_tokens
    }

    /// HF's choice: `tool_use` when tools are given and it exists, else `default`, else the first.
    fn pick(&self, has_tools: bool) -> usize {
        let find = |name: &str| self.names.iter().position(|n| n == name);
        has_tools
            .then(|| find("tool_use"))
            .flatten()
            .or_else(|| find("default"))
            .unwrap_or(0)
    }

    /// Renders a conversation to the prompt text the engine tokenizes.
    pub fn render(&self, request: &ChatRequest) -> Result<String, ChatError> {
        self.render_traced(request).map(|(text, _)| text)
    }

    /// [`render`](Self::render), and which renderer produced the text.
    pub fn render_traced(&self, request: &ChatRequest) -> Result<(String, Renderer), ChatError> {
        self.render_inner(request, None)
    }

    /// The part of the prompt a router can reproduce: the whole rendered prompt, or, when a
    /// message holds a media part (image, audio, video, prompt embeddings), the text the engine's
    /// prompt has before the first item's placeholder. The media items are replaced by a
    /// stand-in placed where vLLM places their placeholders, and the rendering is cut at the
    /// first stand-in.
    pub fn render_prefix(&self, request: &ChatRequest) -> Result<Rendered, ChatError> {
        let Some(cut) = conversation::first_media(&request.messages) else {
            let (text, renderer) = self.render_inner(request, None)?;
            return Ok(Rendered {
                text,
                renderer,
                media: None,
            });
        };
        let (mut text, renderer) = self.render_inner(request, Some(MEDIA_STAND_IN))?;
        // A template that drops the item leaves nothing to cut at: no prefix can be known.
        let at = text
            .find(MEDIA_STAND_IN)
            .ok_or_else(|| ChatError::UnsupportedContentPart {
                index: cut.message,
                part: cut.part,
                part_type: cut.part_type.clone(),
            })?;
        text.truncate(at);
        Ok(Rendered {
            text,
            renderer,
            media: Some(cut),
        })
    }

    /// The whole prompt with `placeholder` standing for each media item, placed as vLLM places a
    /// model's placeholder before its processor expands it (the engine simulator's view).
    pub fn render_with_media(
        &self,
        request: &ChatRequest,
        placeholder: &str,
    ) -> Result<String, ChatError> {
        self.render_inner(request, Some(placeholder))
            .map(|(text, _)| text)
    }

    fn render_inner(
        &self,
        request: &ChatRequest,
        media: Option<&str>,
    ) -> Result<(String, Renderer), ChatError> {
        let mut kwargs = request.chat_template_kwargs.clone();
        for reserved in ["chat_template", "tokenize", "messages"] {
            if kwargs.contains_key(reserved) {
                return Err(ChatError::ReservedKwarg(reserved.to_owned()));
            }
        }
        // vLLM lets chat_template_kwargs override the request's own switches.
        let add_generation_prompt = kwargs
            .remove("add_generation_prompt")
            .map_or(request.add_generation_prompt, |v| truthy(&v));
        let continue_final_message = kwargs
            .remove("continue_final_message")
            .map_or(request.continue_final_message, |v| truthy(&v));
        let tools = match kwargs.remove("tools") {
            Some(Json::Array(tools)) => Some(tools),
            Some(_) => None,
            None => request.tools.clone(),
        };
        let documents = match kwargs.remove("documents") {
            Some(Json::Array(docs)) => Some(docs),
            Some(_) => None,
            None => request.documents.clone(),
        };
        if continue_final_message && add_generation_prompt {
            return Err(ChatError::ContinueWithGenerationPrompt);
        }
        if request.messages.is_empty() {
            return Err(ChatError::EmptyConversation);
        }
        let index = self.pick(tools.is_some());
        let name = self
            .names
            .get(index)
            .map(String::as_str)
            .unwrap_or("default");
        let source = self.sources.get(index).map(String::as_str).unwrap_or("");

        // A template kvroute renders natively skips preparing the conversation for the VM.
        if let Some(n) = self.natives.get(index).copied().flatten().filter(|_| {
            self.native_enabled && media.is_none() && self.format_of(index) == ContentFormat::String
        }) {
            let inputs = native::Inputs {
                messages: &request.messages,
                tools: tools.as_ref().is_some_and(|t| !t.is_empty()),
                add_generation_prompt,
                continue_final_message,
                kwargs: &kwargs,
            };
            if let Some(text) = n.render(&inputs) {
                return Ok((text, Renderer::Native));
            }
        }
        let mut messages =
            conversation::build_messages(&request.messages, self.format_of(index), media)?;
        let tools = tools
            .as_deref()
            .map(conversation::build_tools)
            .transpose()?;
        let final_text = if continue_final_message {
            Some(tag_final_message(&mut messages, source)?)
        } else {
            None
        };

        let mut ctx = self.special_tokens.clone();
        for (k, v) in kwargs {
            ctx.insert(k, v);
        }
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert("tools".into(), tools.map_or(Json::Null, Json::Array));
        ctx.insert(
            "documents".into(),
            documents.map_or(Json::Null, Json::Array),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );

        let template = self
            .env
            .get_template(name)
            .map_err(|e| ChatError::Render(e.to_string()))?;
        let rendered = template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| ChatError::Render(render_message(&e)))?;
        match final_text {
            Some(final_text) => cut_at_tag(rendered, &final_text).map(|t| (t, Renderer::Jinja)),
            None => Ok((rendered, Renderer::Jinja)),
        }
    }
}

/// Python truthiness of a JSON value.
pub(crate) fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// minijinja's error text with its detail (the `raise_exception` message lives there).
fn render_message(e: &minijinja::Error) -> String {
    match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.to_string(),
    }
}

/// HF's `continue_final_message`: append a tag to the final message's text and remember the
/// text, so the rendered prompt can be cut right after it.
fn tag_final_message(messages: &mut [Json], source: &str) -> Result<String, ChatError> {
    let Some(last) = messages.last_mut().and_then(Json::as_object_mut) else {
        return Err(ChatError::ContinueFinalMessage("the conversation is empty"));
    };
    if !source.contains("content") {
        return Err(ChatError::ContinueFinalMessage(
            "the chat template does not read `content`",
        ));
    }
    match last.get_mut("content") {
        Some(Json::String(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(text)
        }
        Some(Json::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Json::String(text)) = part.get_mut("text") {
                    let original = text.clone();
                    text.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(ChatError::ContinueFinalMessage(
                "the final message has no text to continue",
            ))
        }
        _ => Err(ChatError::ContinueFinalMessage(
            "the final message has no content to continue",
        )),
    }
}

/// Cuts the rendered prompt at the tag, as HF does (trimming trailing space the template ate).
fn cut_at_tag(rendered: String, final_text: &str) -> Result<String, ChatError> {
    let tag = CONTINUE_TAG.trim_end_matches(python::is_py_space);
    let stripped = final_text.trim_matches(python::is_py_space);
    if !rendered.contains(stripped) || !rendered.contains(tag) {
        return Err(ChatError::ContinueFinalMessage(
            "the final message does not appear in the rendered chat",
        ));
    }
    let Some(loc) = rendered.rfind(tag) else {
        return Err(ChatError::ContinueFinalMessage(
            "the final message does not appear in the rendered chat",
        ));
    };
    let head = rendered.get(..loc).unwrap_or("");
    if rendered
        .get(loc..)
        .is_some_and(|rest| rest.starts_with(CONTINUE_TAG))
    {
        Ok(head.to_owned())
    } else {
        Ok(head.trim_end_matches(python::is_py_space).to_owned())
    }
}

/// HF's `tojson`: Python `json.dumps` with `ensure_ascii=False` and its keyword arguments.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let options = python::DumpOptions::from_kwargs(&kwargs)?;
    python::json_dumps(&value, &options).map(Value::from)
}

/// HF's `{% generation %}...{% endgeneration %}` marks assistant spans for training masks and
/// renders its body unchanged; minijinja has no such tag, so it becomes `{% if true %}` with the
/// same whitespace-control markers (same output, same trimming).
fn replace_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag_and_after) = rest.split_at(start);
        out.push_str(before);
        let Some(end) = tag_and_after.find("%}") else {
            out.push_str(tag_and_after);
            return out;
        };
        let tag = tag_and_after.get(..end + 2).unwrap_or(tag_and_after);
        let inner = tag.get(2..tag.len() - 2).unwrap_or("");
        let (lead, body) = inner
            .strip_prefix(['-', '+'])
            .map_or(("", inner), |b| (&inner[..1], b));
        let (body, trail) = body
            .strip_suffix(['-', '+'])
            .map_or((body, ""), |b| (b, &body[b.len()..]));
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(tag),
        }
        rest = tag_and_after.get(end + 2..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use serde_json::json;

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::from_templates(vec![("default".into(), src.into())], Map::new()).unwrap()
    }

    fn render(t: &ChatTemplate, messages: Json) -> Result<String, ChatError> {
        let Json::Array(messages) = messages else {
            panic!("messages must be an array")
        };
        t.render(&ChatRequest::new(messages))
    }

    #[test]
    fn prints_python_values() {
        let t = template("{{ none }}|{{ true }}|{{ messages[0] }}|{{ 1.0 }}|{{ messages[0] | string }}|{{ undefined_var }}|");
        let out = render(&t, json!([{"role": "user", "content": "it's"}])).unwrap();
        assert_eq!(
            out,
            r#"None|True|{'role': 'user', 'content': "it's"}|1.0|{'role': 'user', 'content': "it's"}||"#
        );
    }

    #[test]
    fn tojson_like_hf() {
        let t = template("{{ messages | tojson }}\n{{ messages[0] | tojson(indent=2) }}");
        let out = render(&t, json!([{"role": "user", "content": "é"}])).unwrap();
        assert_eq!(out, "[{\"role\": \"user\", \"content\": \"é\"}]\n{\n  \"role\": \"user\",\n  \"content\": \"é\"\n}");
    }

    #[test]
    fn raise_exception_fails_with_message() {
        let t = template("{{ raise_exception('Only user and assistant roles are supported!') }}");
        let err = render(&t, json!([{"role": "user", "content": "x"}])).unwrap_err();
        assert!(
            err.to_string()
                .contains("Only user and assistant roles are supported!"),
            "{err}"
        );
    }

    #[test]
    fn strftime_now_needs_a_clock() {
        let mut t = template("{{ strftime_now('%d %b %Y') }}");
        let one = json!([{"role": "user", "content": "x"}]);
        assert!(render(&t, one.clone()).is_err());
        t.set_clock(Arc::new(|| 1_721_743_509));
        assert_eq!(render(&t, one).unwrap(), "23 Jul 2024");
        assert_eq!(
            render(&t, json!([])).unwrap_err(),
            ChatError::EmptyConversation
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let t = template("{%- for m in messages %}{% generation %}{{ m.content }}{% endgeneration -%}\n{% endfor %}");
        assert_eq!(render(&t, json!([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])).unwrap(), "ab");
    }

    #[test]
    fn named_templates_pick_tool_use_with_tools() {
        let config = json!({"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}], "bos_token": {"content": "<s>"}});
        let t = ChatTemplate::new(config.to_string().as_bytes()).unwrap();
        assert_eq!(t.special_tokens().get("bos_token"), Some(&json!("<s>")));
        let mut req = ChatRequest::new(vec![json!({"role": "user", "content": "x"})]);
        assert_eq!(t.render(&req).unwrap(), "D");
        req.tools = Some(vec![json!({"type": "function", "function": {"name": "f"}})]);
        assert_eq!(t.render(&req).unwrap(), "T");
    }

    #[test]
    fn kwargs_override_and_reserved() {
        let t = template("{{ add_generation_prompt }} {{ enable_thinking }}");
        let mut req = ChatRequest::new(vec![json!({"role": "user", "content": "x"})]);
        req.chat_template_kwargs
            .insert("enable_thinking".into(), json!(false));
        req.chat_template_kwargs
            .insert("add_generation_prompt".into(), json!(false));
        assert_eq!(t.render(&req).unwrap(), "False False");
        req.chat_template_kwargs
            .insert("tokenize".into(), json!(true));
        assert_eq!(
            t.render(&req).unwrap_err(),
            ChatError::ReservedKwarg("tokenize".into())
        );
    }

    #[test]
    fn continue_final_message_cuts_after_the_text() {
        let t = template("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}");
        let mut req = ChatRequest::new(vec![json!({"role": "assistant", "content": "Once upon "})]);
        req.add_generation_prompt = false;
        req.continue_final_message = true;
        // The template trims, so HF strips the trailing space too.
        assert_eq!(t.render(&req).unwrap(), "<assistant>Once upon");
        req.add_generation_prompt = true;
        assert_eq!(
            t.render(&req).unwrap_err(),
            ChatError::ContinueWithGenerationPrompt
        );
    }

    #[test]
    fn template_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<crate::tokenize::Tokenizer>();
    }

    #[test]
    fn config_errors_name_the_field() {
        assert!(matches!(
            ChatTemplate::new(b"{}"),
            Err(ChatError::NoTemplate(_))
        ));
        assert!(matches!(
            ChatTemplate::new(b"\xff"),
            Err(ChatError::ConfigJson(_))
        ));
        let err = ChatTemplate::new(br#"{"chat_template": "{% if %}"}"#).unwrap_err();
        assert!(matches!(err, ChatError::Compile { .. }), "{err}");
    }
}
