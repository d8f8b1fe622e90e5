//! OpenAI `usage` in upstream responses, for the cache hit/miss token stats.
//!
//! Two shapes exist: `usage.prompt_tokens_details.cached_tokens` (OpenAI, vLLM) and
//! `usage.prompt_cache_hit_tokens` / `prompt_cache_miss_tokens` (DeepSeek-style). Missing fields
//! count as 0; a miss count absent in the first shape is `prompt_tokens - cached_tokens`.
//! Streaming responses carry usage in the final SSE chunk (`stream_options.include_usage`), so
//! SSE bodies are searched from the last `data:` line backwards.

use serde_json::Value;

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

/// Usage of a complete response body: JSON, or SSE (`data: {...}` lines, last usage wins).
pub fn parse(body: &[u8], sse: bool) -> Option<Usage> {
    if !sse {
        if let Ok(v) = serde_json::from_slice::<Value>(body) {
            return v.get("usage").and_then(from_usage);
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
    fn tail_is_bounded() {
        let mut t = Tail::default();
        for _ in 0..10 {
            t.push(&vec![b'x'; MAX_TRACKED_BYTES / 4]);
        }
        t.push(br#"{"usage":{"prompt_tokens":1}}"#);
        assert_eq!(t.bytes().len(), MAX_TRACKED_BYTES);
    }
}
