//! One routing question, whichever front door asked it: the filter's HTTP callout
//! (`POST /v1/route`, [`crate::api`]) or the ext_proc endpoint picker ([`crate::epp`]).
//!
//! Both front doors tokenize through [`tokenize`] (the rule's staged tokenizer and chat template
//! on the blocking pool, one [`TokenizerCache`] so a follow-up turn encodes only its new segments
//! whichever door it came through) and decide through [`answer`] (`Fleet::route` and the wire
//! answer). There is one decision function, so the in-flight estimate, speculative credit and
//! placement memory see one stream of decisions, and a request gets the same endpoint through
//! either door on the same state.

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::bpe::Truncation;
use kvroute_core::hash::BlockKey;
use kvroute_core::prompt::Request;

use crate::fleet::{Fleet, Question, RouteError, Routed, RuleRuntime};
use crate::offload::{Keyed, Offload, TokenizerCache};

pub use kvroute_core::wire::{Explain, ExplainEndpoint, RouteResponse};

/// What a question's prompt comes as.
pub enum Text {
    /// The prompt or messages the filter sent instead of keys.
    Offload(Offload),
    /// A whole request body (completions, chat completions or Anthropic messages), as the
    /// endpoint picker receives it from the proxy, and the API its path names (`None`: told
    /// from the body's fields, chat or completions).
    Body(bytes::Bytes, Option<kvroute_core::prompt::Endpoint>),
}

/// Why a prompt has no keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyingError {
    /// The rule routes on KV blocks but the service cannot tokenize for it: the rule lacks
    /// `kvModel` or a KV contract, or the service runs without `--tokenizer-dir`.
    #[error("tokenization needs the rule's kvModel, a KV contract and --tokenizer-dir")]
    NotConfigured,
    /// The tokenizer of the rule's model could not be loaded.
    #[error("{0}")]
    NoTokenizer(String),
    /// The body is not an OpenAI completions or chat completions request.
    #[error("body: {0}")]
    BadBody(String),
    /// The template or the tokenizer failed on this prompt.
    #[error("{0}")]
    Failed(String),
}

/// The keys of a prompt and what the body said about routing.
pub struct Tokenized {
    pub keyed: Keyed,
    /// `model` of the body.
    pub model: Option<String>,
    /// `user` of the body (the affinity key's first choice, [`kvroute_core::affinity`]).
    pub user: Option<String>,
    /// The body's endpoint (chat or completions), for the affinity key; none when offloaded.
    pub endpoint: Option<kvroute_core::prompt::Endpoint>,
}

/// Tokenizes and hashes `text` for `rule` on the blocking pool (at most
/// `KVROUTE_MAX_PREFIX_TOKENS` tokens). A rule that does not route on KV blocks needs no keys:
/// a body is then only parsed. `count` adds a truncated prompt to
/// `kvroute_offload_prompts_truncated_total` (off for explain questions).
pub async fn tokenize(
    fleet: &Arc<Fleet>,
    tokenizers: &Arc<TokenizerCache>,
    rule: &RuleRuntime,
    text: Text,
    count: bool,
) -> Result<Tokenized, KeyingError> {
    let contract = rule.spec.contract();
    let slug = rule.spec.slug.clone();
    let dir = fleet.tokenizer_dir().map(|d| d.to_path_buf());
    let max = fleet.settings.max_prefix_tokens;
    let cache = tokenizers.clone();
    let res = tokio::task::spawn_blocking(move || {
        let (src, model, user, endpoint) = match text {
            Text::Offload(o) => {
                let model = o.model.clone();
                (Source::Offload(o), model, None, None)
            }
            Text::Body(b, endpoint) => {
                let r = match endpoint {
                    Some(e) => Request::from_json_for(&b, e),
                    None => Request::from_json(&b),
                }
                .map_err(|e| KeyingError::BadBody(e.to_string()))?;
                let (model, user, endpoint) = (r.model.clone(), r.user.clone(), r.endpoint());
                (Source::Body(r), model, user, Some(endpoint))
            }
        };
        let no_keys = Keyed {
            keys: Vec::new(),
            token_count: 0,
            truncated: None,
        };
        let Some(contract) = contract else {
            return Ok(Tokenized {
                keyed: no_keys,
                model,
                user,
                endpoint,
            });
        };
        let (Some(slug), Some(dir)) = (slug, dir) else {
            return Err(KeyingError::NotConfigured);
        };
        let loaded = cache.get(&dir, &slug).map_err(KeyingError::NoTokenizer)?;
        let keyed = match src {
            Source::Body(r) => crate::offload::keys_for_request(&loaded, &contract, &r, max),
            Source::Offload(o) => crate::offload::keys_for(&loaded, &contract, &o, max),
        }
        .map_err(KeyingError::Failed)?;
        Ok(Tokenized {
            keyed,
            model,
            user,
            endpoint,
        })
    })
    .await
    .map_err(|e| KeyingError::Failed(format!("tokenization task: {e}")))?;
    if let (Ok(t), true) = (&res, count) {
        if let Some(why) = t.keyed.truncated {
            fleet
                .metrics
                .offload_truncated
                .with_label_values(&[why.as_str()])
                .inc();
        }
    }
    res
}

/// A prompt to key, parsed.
enum Source {
    Body(Request),
    Offload(Offload),
}

/// A routing question after tokenization.
pub struct Ask<'a> {
    pub keys: &'a [BlockKey],
    pub token_count: u32,
    pub affinity_key: Option<&'a str>,
    pub model: Option<&'a str>,
    /// The conversation id, for the session tier.
    pub session: Option<&'a str>,
    /// Decide without committing anything (see `POST /v1/route`'s `explain`).
    pub explain: bool,
    /// When set, only the endpoints whose flag is true may be chosen (the proxy's candidate
    /// subset), indexed like the rule's endpoints.
    pub only: Option<&'a [bool]>,
    /// How many fallbacks the answer lists (0: none are ranked, as for `POST /v1/route`).
    pub fallbacks: usize,
    /// Why the keys stop before the prompt's end, when they do.
    pub truncated: Option<Truncation>,
}

/// A decision as both front doors render it.
pub struct Answer {
    pub response: RouteResponse,
    /// Up to [`Ask::fallbacks`] other eligible healthy endpoints, best first (most matched
    /// blocks, then least load): where a proxy retries when the chosen endpoint cannot be reached.
    pub fallbacks: Vec<String>,
}

/// Decides `ask` for `rule` at `now` with [`Fleet::route`] (committing unless `ask.explain`)
/// and renders the answer both front doors send.
pub fn answer(
    fleet: &Fleet,
    rule: &Arc<RuleRuntime>,
    ask: &Ask<'_>,
    now: Instant,
) -> Result<Answer, RouteError> {
    let q = Question {
        keys: ask.keys,
        token_count: ask.token_count,
        affinity_key: ask.affinity_key,
        model: ask.model,
        session: ask.session,
        explain: ask.explain,
        only: ask.only,
    };
    let Routed {
        decision: d,
        ep,
        views,
        recall,
        session,
    } = fleet.route(rule, &q, now)?;
    if let (Some(why), false) = (ask.truncated, ask.explain) {
        fleet
            .metrics
            .route_truncated
            .with_label_values(&[why.as_str(), d.reason.as_str()])
            .inc();
    }
    let addr = |i: usize| rule.addr(i).to_owned();
    let explain = ask.explain.then(|| Explain {
        keys: u32::try_from(ask.keys.len()).unwrap_or(u32::MAX),
        token_count: ask.token_count,
        endpoints: views
            .iter()
            .enumerate()
            .map(|(i, e)| ExplainEndpoint {
                idx: i,
                endpoint: addr(i),
                healthy: e.healthy,
                matched_blocks: e.matched,
                lower_blocks: (e.lower.cpu, e.lower.storage),
                blocks: e.blocks,
                load: e.load,
            })
            .collect(),
        recall: recall.map(|r| (r.ep, r.depth)),
        session,
    });
    let mut others: Vec<usize> = Vec::new();
    if ask.fallbacks > 0 {
        others.extend(
            (0..views.len()).filter(|&i| i != ep && Some(i) != d.decode && views[i].healthy),
        );
        let rank = |&i: &usize| (std::cmp::Reverse(views[i].matched), views[i].load, i);
        if others.len() > ask.fallbacks {
            others.select_nth_unstable_by_key(ask.fallbacks - 1, rank);
            others.truncate(ask.fallbacks);
        }
        others.sort_by_key(rank);
    }
    Ok(Answer {
        response: RouteResponse {
            rule_id: rule.id,
            endpoint: addr(ep),
            matched_blocks: d.matched,
            tier: d.tier,
            reason: d.reason,
            decode_endpoint: d.decode.map(addr),
            explain,
        },
        fallbacks: others.into_iter().map(addr).collect(),
    })
}
