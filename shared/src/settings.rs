//! Process-wide settings read from the environment once at start.
//!
//! The core crate never reads the environment itself (it also runs inside a Wasm VM):
//! [`Settings::from_env`] takes a lookup function, so the service passes
//! `|name| std::env::var(name).ok()`, the filter passes its plugin configuration, and tests
//! pass a map. Every invalid variable is reported at once, each naming the variable, the value
//! and what is allowed.
//!
//! | variable | default | allowed |
//! |---|---|---|
//! | `LLB_KV_MIN_MATCH_TOKENS` | 16 | 0-4096 |
//! | `LLB_KV_NONE_HASH_SEED` | unset | any string, the engine's `PYTHONHASHSEED` |
//! | `LOXILB_KV_SPILL_RELIEF` | unset | `on`, `off` |
//! | `LOXILB_KV_COLDSTART_SEED_N` | 16 | 0-4294967295 |
//! | `LOXILB_KV_COLDSTART_MIN_BLOCKS` | 16 | 0-4294967295 |
//!
//! "Unset" means the variable is absent: an empty value is a value (for the seed it is the empty
//! seed, as vLLM's `os.getenv("PYTHONHASHSEED") is None` test treats it; elsewhere an error).

use std::fmt;

use crate::rule::{quoted, write_list, Collector, FieldError};

/// Minimum matched prefix, in tokens, before a KV match overrides the fallback algorithm.
pub const MIN_MATCH_TOKENS_VAR: &str = "LLB_KV_MIN_MATCH_TOKENS";
/// The engines' `PYTHONHASHSEED`, which seeds vLLM's NONE_HASH.
pub const NONE_HASH_SEED_VAR: &str = "LLB_KV_NONE_HASH_SEED";
/// Whether spilling load off a hot prefix holder is forced on or off.
pub const SPILL_RELIEF_VAR: &str = "LOXILB_KV_SPILL_RELIEF";
/// Cold-start seeding: how many requests to seed.
pub const COLDSTART_SEED_N_VAR: &str = "LOXILB_KV_COLDSTART_SEED_N";
/// Cold-start: blocks an inventory must hold before it counts as warm.
pub const COLDSTART_MIN_BLOCKS_VAR: &str = "LOXILB_KV_COLDSTART_MIN_BLOCKS";

/// Every variable [`Settings::from_env`] reads, in the order errors are reported.
pub const VARS: [&str; 5] = [
    MIN_MATCH_TOKENS_VAR,
    NONE_HASH_SEED_VAR,
    SPILL_RELIEF_VAR,
    COLDSTART_SEED_N_VAR,
    COLDSTART_MIN_BLOCKS_VAR,
];

/// `LLB_KV_MIN_MATCH_TOKENS` when unset.
pub const DEFAULT_MIN_MATCH_TOKENS: u32 = 16;
/// Largest `LLB_KV_MIN_MATCH_TOKENS`.
pub const MAX_MIN_MATCH_TOKENS: u32 = 4096;
/// `LOXILB_KV_COLDSTART_SEED_N` when unset.
pub const DEFAULT_COLDSTART_SEED_N: u32 = 16;
/// `LOXILB_KV_COLDSTART_MIN_BLOCKS` when unset.
pub const DEFAULT_COLDSTART_MIN_BLOCKS: u32 = 16;

/// `LOXILB_KV_SPILL_RELIEF`: three states, because "unset" leaves the choice to the scorer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SpillRelief {
    /// Variable absent: the scorer's default.
    #[default]
    Unset,
    /// `on`.
    On,
    /// `off`.
    Off,
}

/// Every reason the process environment was rejected. Never empty.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct SettingsErrors(pub Vec<FieldError>);

impl fmt::Display for SettingsErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_list(f, "invalid environment", &self.0)
    }
}

/// Validated process-wide settings. [`Settings::default`] is the all-unset environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    min_match_tokens: u32,
    none_hash_seed: Option<String>,
    spill_relief: SpillRelief,
    coldstart_seed_n: u32,
    coldstart_min_blocks: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            min_match_tokens: DEFAULT_MIN_MATCH_TOKENS,
            none_hash_seed: None,
            spill_relief: SpillRelief::Unset,
            coldstart_seed_n: DEFAULT_COLDSTART_SEED_N,
            coldstart_min_blocks: DEFAULT_COLDSTART_MIN_BLOCKS,
        }
    }
}

impl Settings {
    /// Reads every variable through `lookup` (`None` = unset) and validates them all.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsErrors> {
        let mut c = Collector::default();
        let u32_allowed = format!("0-{}", u32::MAX);
        let min_match_tokens = uint(
            &mut c,
            MIN_MATCH_TOKENS_VAR,
            lookup(MIN_MATCH_TOKENS_VAR),
            DEFAULT_MIN_MATCH_TOKENS,
            MAX_MIN_MATCH_TOKENS,
            &format!("0-{MAX_MIN_MATCH_TOKENS}"),
        );
        let none_hash_seed = lookup(NONE_HASH_SEED_VAR);
        let spill_relief = match lookup(SPILL_RELIEF_VAR).as_deref() {
            None => Some(SpillRelief::Unset),
            Some("on") => Some(SpillRelief::On),
            Some("off") => Some(SpillRelief::Off),
            Some(v) => {
                c.push(SPILL_RELIEF_VAR, quoted(v), "on, off (or unset)");
                None
            }
        };
        let coldstart_seed_n = uint(
            &mut c,
            COLDSTART_SEED_N_VAR,
            lookup(COLDSTART_SEED_N_VAR),
            DEFAULT_COLDSTART_SEED_N,
            u32::MAX,
            &u32_allowed,
        );
        let coldstart_min_blocks = uint(
            &mut c,
            COLDSTART_MIN_BLOCKS_VAR,
            lookup(COLDSTART_MIN_BLOCKS_VAR),
            DEFAULT_COLDSTART_MIN_BLOCKS,
            u32::MAX,
            &u32_allowed,
        );
        match (
            min_match_tokens,
            spill_relief,
            coldstart_seed_n,
            coldstart_min_blocks,
        ) {
            (
                Some(min_match_tokens),
                Some(spill_relief),
                Some(coldstart_seed_n),
                Some(coldstart_min_blocks),
            ) if c.0.is_empty() => Ok(Settings {
                min_match_tokens,
                none_hash_seed,
                spill_relief,
                coldstart_seed_n,
                coldstart_min_blocks,
            }),
            _ => Err(SettingsErrors(c.0)),
        }
    }

    /// `LLB_KV_MIN_MATCH_TOKENS`.
    pub fn min_match_tokens(&self) -> u32 {
        self.min_match_tokens
    }

    /// `LLB_KV_NONE_HASH_SEED`: the engines' `PYTHONHASHSEED`, `None` when unset.
    pub fn none_hash_seed(&self) -> Option<&str> {
        self.none_hash_seed.as_deref()
    }

    /// `LOXILB_KV_SPILL_RELIEF`.
    pub fn spill_relief(&self) -> SpillRelief {
        self.spill_relief
    }

    /// `LOXILB_KV_COLDSTART_SEED_N`.
    pub fn coldstart_seed_n(&self) -> u32 {
        self.coldstart_seed_n
    }

    /// `LOXILB_KV_COLDSTART_MIN_BLOCKS`.
    pub fn coldstart_min_blocks(&self) -> u32 {
        self.coldstart_min_blocks
    }

    /// The same settings with a NONE_HASH seed (for callers that build settings in code).
    pub fn with_none_hash_seed(mut self, seed: impl Into<String>) -> Self {
        self.none_hash_seed = Some(seed.into());
        self
    }
}

/// A decimal integer in `0..=max`: digits only (no sign, no spaces), so "+16" and " 16" are errors.
fn uint(
    c: &mut Collector,
    var: &str,
    raw: Option<String>,
    default: u32,
    max: u32,
    allowed: &str,
) -> Option<u32> {
    let Some(s) = raw else { return Some(default) };
    let parsed = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        s.parse::<u32>().ok().filter(|v| *v <= max)
    } else {
        None
    };
    if parsed.is_none() {
        c.push(var, quoted(&s), allowed);
    }
    parsed
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn unset_environment_is_the_default() {
        assert_eq!(Settings::from_env(env(&[])).unwrap(), Settings::default());
        let s = Settings::default();
        assert_eq!(
            (
                s.min_match_tokens(),
                s.none_hash_seed(),
                s.spill_relief(),
                s.coldstart_seed_n(),
                s.coldstart_min_blocks()
            ),
            (16, None, SpillRelief::Unset, 16, 16)
        );
    }

    #[test]
    fn lookup_sees_only_known_names() {
        let asked = std::cell::RefCell::new(Vec::new());
        let _ = Settings::from_env(|name| {
            asked.borrow_mut().push(name.to_owned());
            None
        });
        assert_eq!(asked.into_inner(), VARS.map(str::to_owned));
    }

    #[test]
    fn empty_seed_is_a_seed() {
        let s = Settings::from_env(env(&[(NONE_HASH_SEED_VAR, "")])).unwrap();
        assert_eq!(s.none_hash_seed(), Some(""));
    }
}
