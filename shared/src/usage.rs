//! OpenAI `usage` in upstream responses, for the cache hit/miss token stats.
//!
//! Three shapes exist: `usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM),
//! `usage.prompt_cache_hit_tokens` / `prompt_cache_miss_tokens` (DeepSeek-style), and Anthropic
//! Messages' `input_tokens` (the uncached tokens), `cache_read_input_tokens` (hits) and
//! `cache_creation_input_tokens` (written to the cache: misses too), as vLLM's `/v1/messages`
//! reports them. Missing fields count as 0; a miss count absent in the first shape is
//! `prompt_tokens - cached_tokens`. Streaming responses carry usage in the final SSE chunk
//! (`stream_options.include_usage`; Anthropic's `message_delta` event), so SSE bodies are
//! searched from the last `data:` line backwards.
//!
//! A response's usage is judged against what the route answer predicted ([`Prediction::judge`])
//! and becomes one endpoint's outcome ([`outcome_of`]) and one tenant's tokens ([`Account`]):
//! the filter sums them into its reports, the endpoint picker records them directly.

use serde_json::Value;

use std::collections::BTreeMap;

use crate::wire::{EndpointOutcomes, TenantUsage, MAX_TENANT_NAME, OTHER_TENANT};

/// Most response bytes kept for usage parsing; past it only the tail is kept (usage is at the end).
pub const MAX_TRACKED_BYTES: usize = 256 * 1024;

/// Prompt cache tokens reported by one response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub hit_tokens: u64,
    pub miss_tokens: u64,
}

fn field(v: &Value, name: &str) -> Option<u64> {
    v.get(name).and_then(Value::as_u64)
}

/// Usage from a `usage` object.
pub fn from_usage(u: &Value) -> Option<Usage> {
    if !u.is_object() {
        return None;
    }
    if u.get("prompt_tokens").is_none() {
        if let Some(uncached) = field(u, "input_tokens") {
            return Some(Usage {
                hit_tokens: field(u, "cache_read_input_tokens").unwrap_or(0),
                miss_tokens: uncached
                    .saturating_add(field(u, "cache_creation_input_tokens").unwrap_or(0)),
            });
        }
    }
    let hit = u
        .get("prompt_tokens_details")
        .and_then(|d| field(d, "cached_tokens"))
        .or_else(|| field(u, "prompt_cache_hit_tokens"))
        .unwrap_or(0);
    let miss = field(u, "prompt_cache_miss_tokens")
        .or_else(|| field(u, "prompt_tokens").map(|p| p.saturating_sub(hit)))
        .unwrap_or(0);
    Some(Usage {
        hit_tokens: hit,
        miss_tokens: miss,
    })
}

/// A JSON response as [`parse`] reads it: only `usage` is built; the rest of the body (the
/// choices, a long completion) is checked and skipped without building values.
#[derive(serde::Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<Value>,
}

/// Usage of a complete response body: JSON, or SSE (`data: {...}` lines, last usage wins).
pub fn parse(body: &[u8], sse: bool) -> Option<Usage> {
    if !sse {
        // A struct also deserializes from an array (its fields in order): only an object counts.
        let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        match serde_json::from_slice::<UsageOnly>(body) {
            Ok(v) if object => return v.usage.as_ref().and_then(from_usage),
            Ok(_) => return None,
            Err(_) => {}
        }
    }
    // SSE (or JSON that did not parse as a whole, e.g. a kept tail): scan data lines backwards.
    let text = String::from_utf8_lossy(body);
    text.lines()
        .rev()
        .filter_map(|l| l.trim_start().strip_prefix("data:"))
        .map(str::trim)
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").and_then(from_usage))
}

/// What the route answer predicted the engine would reuse: the chosen endpoint's matched blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prediction {
    pub blocks: u32,
    pub block_size: u32,
    /// The endpoint whose blocks were counted (the prefill endpoint in P/D mode).
    pub endpoint: std::net::SocketAddr,
}

/// A prediction against the engine's reported reuse, in whole blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// The engine reused exactly the predicted blocks.
    Exact,
    /// The engine reused more than predicted (an endpoint holds blocks the inventory lacks).
    Under,
    /// The engine reused less than predicted (the inventory credits blocks the engine lacks:
    /// a missed eviction, or a mismatched leg of the hash contract).
    Over,
}

/// One judged response: the verdict and both sides in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judged {
    pub verdict: Verdict,
    pub predicted_tokens: u64,
    pub realised_tokens: u64,
    /// Whole blocks predicted (capped as [`Prediction::judge`] says) and reused.
    pub predicted_blocks: u64,
    pub realised_blocks: u64,
    /// The prompt's tokens (`usage`: cached plus computed).
    pub prompt_tokens: u64,
}

impl Prediction {
    /// Judges the engine's `usage`. Engines reuse whole blocks and always compute the prompt's
    /// last token (vLLM and SGLang cap a cache hit at `prompt_tokens - 1`), so the prediction
    /// is capped at the full blocks before the last token, and the engine's cached tokens are
    /// counted in whole blocks.
    pub fn judge(&self, u: &Usage) -> Option<Judged> {
        judge_blocks(u64::from(self.blocks), self.block_size, u)
    }
}

/// [`Prediction::judge`] of `blocks` predicted blocks of `block_size` tokens, wherever they were
/// predicted (the benchmark's strategies judge theirs with it too).
pub fn judge_blocks(blocks: u64, block_size: u32, u: &Usage) -> Option<Judged> {
    let bs = u64::from(block_size);
    if bs == 0 {
        return None;
    }
    let prompt = u.hit_tokens.saturating_add(u.miss_tokens);
    let predicted = blocks.min(prompt.saturating_sub(1) / bs);
    let realised = u.hit_tokens / bs;
    let verdict = match realised.cmp(&predicted) {
        std::cmp::Ordering::Equal => Verdict::Exact,
        std::cmp::Ordering::Greater => Verdict::Under,
        std::cmp::Ordering::Less => Verdict::Over,
    };
    Some(Judged {
        verdict,
        predicted_tokens: predicted * bs,
        realised_tokens: u.hit_tokens,
        predicted_blocks: predicted,
        realised_blocks: realised,
        prompt_tokens: prompt,
    })
}

/// Keeps the response bytes needed for [`parse`], bounded by [`MAX_TRACKED_BYTES`].
#[derive(Clone, Debug, Default)]
pub struct Tail {
    buf: Vec<u8>,
}

impl Tail {
    /// Appends a chunk, dropping the oldest bytes past the bound.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
        if self.buf.len() > MAX_TRACKED_BYTES {
            let cut = self.buf.len() - MAX_TRACKED_BYTES;
            self.buf.drain(..cut);
        }
    }

    /// The bytes kept.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }
}

/// Predictions of at least this many blocks qualify for the divergence check (one block can be
/// lost to the prompt's last token or a partial block and says little).
pub const QUALIFYING_BLOCKS: u64 = 2;

/// One judged response of `endpoint` as a sum of one (reports add these up).
pub fn outcome_of(endpoint: &str, j: &Judged) -> EndpointOutcomes {
    let qualifying = j.predicted_blocks >= QUALIFYING_BLOCKS;
    EndpointOutcomes {
        endpoint: endpoint.to_owned(),
        judged: 1,
        exact: u64::from(j.verdict == Verdict::Exact),
        under: u64::from(j.verdict == Verdict::Under),
        over: u64::from(j.verdict == Verdict::Over),
        qualifying: u64::from(qualifying),
        missed: u64::from(qualifying && j.realised_blocks == 0),
        predicted_blocks: j.predicted_blocks,
        realised_blocks: j.realised_blocks,
        prompt_tokens: j.prompt_tokens,
        cached_tokens: j.realised_tokens,
    }
}

/// Who a routed request's tokens are accounted to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    /// The tenant part of the affinity key.
    pub tenant: String,
    pub model: Option<String>,
}

impl Account {
    /// The account of a request with this affinity key and model; names past
    /// [`MAX_TENANT_NAME`] bytes are cut at a character boundary.
    pub fn new(affinity_key: &str, model: Option<&str>) -> Account {
        Account {
            tenant: cut(crate::affinity::tenant_of(affinity_key)).to_owned(),
            model: model.map(|m| cut(m).to_owned()),
        }
    }

    /// One response of this account with usage `u`: its prompt tokens and the cached ones.
    pub fn response(&self, u: &Usage) -> TenantUsage {
        TenantUsage {
            tenant: self.tenant.clone(),
            model: self.model.clone(),
            requests: 1,
            prompt_tokens: u.hit_tokens.saturating_add(u.miss_tokens),
            cached_tokens: u.hit_tokens,
        }
    }
}

fn cut(s: &str) -> &str {
    let mut end = s.len().min(MAX_TENANT_NAME);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Tenants' sums, bounded: at most `max` entries, the last place kept for [`OTHER_TENANT`], which
/// sums every tenant the book cannot hold. The tenants it holds keep exact sums and the totals
/// lose nothing. The filter sums a report's tenants in one (`MAX_OUTCOME_TENANTS`), the service
/// a rule's (`KVROUTE_TENANTS_MAX`).
#[derive(Debug, Default)]
pub struct TenantBook {
    /// Keyed by tenant and model; the values' own names are left empty.
    by: BTreeMap<(String, Option<String>), TenantUsage>,
}

impl TenantBook {
    /// Adds `t`'s sums, its model kept only when `with_model`; false when it went to
    /// [`OTHER_TENANT`] because the book already held `max` tenants.
    pub fn add(&mut self, mut t: TenantUsage, with_model: bool, max: usize) -> bool {
        let model = t.model.take().filter(|_| with_model);
        let key = (std::mem::take(&mut t.tenant), model);
        let held = self.by.contains_key(&key) || self.by.len() + 1 < max;
        let key = match held {
            true => key,
            false => (OTHER_TENANT.to_owned(), None),
        };
        self.by.entry(key).or_default().add(&t);
        held
    }

    /// Every tenant, most prompt tokens first.
    pub fn list(&self) -> Vec<TenantUsage> {
        let mut v: Vec<TenantUsage> = self
            .by
            .iter()
            .map(|((tenant, model), sum)| TenantUsage {
                tenant: tenant.clone(),
                model: model.clone(),
                ..sum.clone()
            })
            .collect();
        // Stable: ties keep the tenants' (and models') order.
        v.sort_by_key(|t| std::cmp::Reverse(t.prompt_tokens));
        v
    }

    /// [`TenantBook::list`], emptying the book.
    pub fn take(&mut self) -> Vec<TenantUsage> {
        let v = self.list();
        self.by.clear();
        v
    }

    pub fn len(&self) -> usize {
        self.by.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn both_shapes_and_missing_fields() {
        let j = br#"{"id":"x","usage":{"prompt_tokens":100,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        assert_eq!(
            parse(j, false),
            Some(Usage {
                hit_tokens: 64,
                miss_tokens: 36
            })
        );
        let d = br#"{"usage":{"prompt_cache_hit_tokens":5,"prompt_cache_miss_tokens":7}}"#;
        assert_eq!(
            parse(d, false),
            Some(Usage {
                hit_tokens: 5,
                miss_tokens: 7
            })
        );
        assert_eq!(parse(br#"{"usage":{}}"#, false), Some(Usage::default()));
        assert_eq!(
            parse(
                br#"{"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}"#,
                false
            ),
            Some(Usage {
                hit_tokens: 0,
                miss_tokens: 9
            })
        );
        assert_eq!(parse(br#"{"choices":[]}"#, false), None);
        assert_eq!(parse(b"\xff\xfe", false), None);
        // Usage after a long completion, and a `usage` key inside the choices that is not it.
        let long = format!(
            r#"{{"choices":[{{"message":{{"content":"{}","usage":{{"prompt_tokens":1}}}}}}],"usage":{{"prompt_tokens":50,"prompt_tokens_details":{{"cached_tokens":32}}}}}}"#,
            "word ".repeat(20_000)
        );
        assert_eq!(
            parse(long.as_bytes(), false),
            Some(Usage {
                hit_tokens: 32,
                miss_tokens: 18
            })
        );
        assert_eq!(parse(br#"{"usage":null}"#, false), None);
        assert_eq!(parse(br#"[{"usage":{"prompt_tokens":3}}]"#, false), None);
    }

    /// vLLM's `/v1/messages` usage: `input_tokens` excludes the cache reads and creations.
    #[test]
    fn anthropic_usage_whole_and_streamed() {
        let j = br#"{"type":"message","usage":{"input_tokens":36,"output_tokens":5,"cache_read_input_tokens":64}}"#;
        assert_eq!(
            parse(j, false),
            Some(Usage {
                hit_tokens: 64,
                miss_tokens: 36
            })
        );
        let j =
            br#"{"usage":{"input_tokens":10,"output_tokens":1,"cache_creation_input_tokens":6}}"#;
        assert_eq!(
            parse(j, false),
            Some(Usage {
                hit_tokens: 0,
                miss_tokens: 16
            })
        );
        let s = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":100,\"output_tokens\":0}}}\n\n\
                  event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n\
                  event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":36,\"output_tokens\":8,\"cache_read_input_tokens\":64}}\n\n\
                  event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        assert_eq!(
            parse(s, true),
            Some(Usage {
                hit_tokens: 64,
                miss_tokens: 36
            })
        );
    }

    #[test]
    fn final_sse_chunk() {
        let s = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
                  data: {\"choices\":[],\"usage\":{\"prompt_tokens\":32,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
                  data: [DONE]\n\n";
        assert_eq!(
            parse(s, true),
            Some(Usage {
                hit_tokens: 16,
                miss_tokens: 16
            })
        );
        assert_eq!(parse(b"data: [DONE]\n\n", true), None);
    }

    #[test]
    fn predictions_are_judged_in_whole_blocks_before_the_last_token() {
        let u = |hit, miss| Usage {
            hit_tokens: hit,
            miss_tokens: miss,
        };
        let endpoint = std::net::SocketAddr::from(([127, 0, 0, 1], 8001));
        let p = |blocks| Prediction {
            blocks,
            block_size: 16,
            endpoint,
        };
        for (pred, usage, verdict, predicted) in [
            (p(4), u(64, 36), Verdict::Exact, 64),
            // 64 tokens all matched: the engine computes the last token, so its last block.
            (p(4), u(48, 16), Verdict::Exact, 48),
            (p(4), u(32, 68), Verdict::Over, 64),
            (p(0), u(16, 84), Verdict::Under, 0),
            // A partial block of cached tokens (an engine that reports tokens) counts whole.
            (p(2), u(40, 60), Verdict::Exact, 32),
            (p(0), u(0, 0), Verdict::Exact, 0),
        ] {
            let j = pred.judge(&usage).unwrap();
            assert_eq!(
                (j.verdict, j.predicted_tokens, j.realised_tokens),
                (verdict, predicted, usage.hit_tokens),
                "{pred:?} {usage:?}"
            );
            assert_eq!(
                (j.predicted_blocks, j.realised_blocks),
                (predicted / 16, usage.hit_tokens / 16)
            );
        }
        assert_eq!(
            Prediction {
                blocks: 1,
                block_size: 0,
                endpoint,
            }
            .judge(&u(1, 1)),
            None
        );
    }

    #[test]
    fn tail_is_bounded() {
        let mut t = Tail::default();
        for _ in 0..10 {
            t.push(&vec![b'x'; MAX_TRACKED_BYTES / 4]);
        }
        t.push(br#"{"usage":{"prompt_tokens":1}}"#);
        assert_eq!(t.bytes().len(), MAX_TRACKED_BYTES);
    }

    fn usage(tenant: &str, model: Option<&str>, prompt: u64, cached: u64) -> TenantUsage {
        TenantUsage {
            tenant: tenant.into(),
            model: model.map(str::to_owned),
            requests: 1,
            prompt_tokens: prompt,
            cached_tokens: cached,
        }
    }

    #[test]
    fn sums_per_tenant_with_or_without_the_model_and_folds_past_the_bound() {
        let mut b = TenantBook::default();
        assert!(b.add(usage("user:a", Some("m1"), 100, 60), false, 3));
        assert!(b.add(usage("user:a", Some("m2"), 50, 10), false, 3));
        assert!(b.add(usage("user:b", None, 500, 0), false, 3));
        // Full (two tenants and the place kept for "(other)"): a new tenant is folded.
        assert!(!b.add(usage("user:c", None, 7, 7), false, 3));
        assert!(!b.add(usage("user:d", None, 3, 0), false, 3));
        assert!(
            b.add(usage("user:a", None, 1, 1), false, 3),
            "a held tenant still adds"
        );
        let l = b.list();
        let names: Vec<&str> = l.iter().map(|t| t.tenant.as_str()).collect();
        assert_eq!(names, ["user:b", "user:a", OTHER_TENANT]);
        assert_eq!(
            (l[1].requests, l[1].prompt_tokens, l[1].cached_tokens),
            (3, 151, 71)
        );
        assert_eq!((l[2].requests, l[2].prompt_tokens), (2, 10));
        let mut by_model = TenantBook::default();
        by_model.add(usage("user:a", Some("m1"), 100, 60), true, 10);
        by_model.add(usage("user:a", Some("m2"), 50, 10), true, 10);
        assert_eq!(by_model.len(), 2);
    }
}
