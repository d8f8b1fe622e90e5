//! Process-wide settings read from the environment once at start, and the descriptor type every
//! kvroute setting is written with.
//!
//! The core crate never reads the environment itself (it also runs inside a Wasm VM):
//! [`Settings::from_env`] takes a lookup function, so the service passes
//! `|name| std::env::var(name).ok()`, the filter passes its plugin configuration, and tests
//! pass a map. Every invalid variable is reported at once, each naming the variable, the value
//! and what is allowed.
//!
//! Each variable is written once, as a [`Setting`] in [`VARS`]: its name, the values it takes,
//! its default and its help text. Parsing, [`Settings::default`], the inventory's `--help` and the
//! settings table of `docs/inventory.md` all derive from these descriptors (the service adds its
//! own to the same table).
//!
//! "Unset" means the variable is absent: an empty value is a value (for the seed it is the empty
//! seed, as vLLM's `os.getenv("PYTHONHASHSEED") is None` test treats it; elsewhere an error).

use std::fmt;

use crate::rule::{quoted, write_list, FieldError};

/// What values a setting takes, and what it is when unset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// A decimal integer in `min..=max`.
    Int { min: u64, max: u64, default: u64 },
    /// A decimal number in `min..=max`.
    Number { min: f64, max: f64, default: f64 },
    /// One of `words`; unset means `default`, or when `None` leaves the choice to the reader.
    Word {
        words: &'static [&'static str],
        default: Option<&'static str>,
    },
    /// Text checked by its reader: `allowed` says what it accepts, `default` what unset means.
    Text {
        allowed: &'static str,
        default: &'static str,
    },
}

/// One environment variable, written once: everything else (parsing, defaults, `--help`, the
/// docs table) derives from it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Setting {
    pub name: &'static str,
    pub kind: Kind,
    /// What the setting does (one line; Markdown backticks allowed).
    pub help: &'static str,
}

impl Setting {
    /// An [`Kind::Int`] setting.
    pub const fn int(
        name: &'static str,
        (min, max): (u64, u64),
        default: u64,
        help: &'static str,
    ) -> Setting {
        Setting {
            name,
            kind: Kind::Int { min, max, default },
            help,
        }
    }

    /// A [`Kind::Word`] setting.
    pub const fn word(
        name: &'static str,
        words: &'static [&'static str],
        default: Option<&'static str>,
        help: &'static str,
    ) -> Setting {
        Setting {
            name,
            kind: Kind::Word { words, default },
            help,
        }
    }

    /// A [`Kind::Text`] setting.
    pub const fn text(
        name: &'static str,
        allowed: &'static str,
        default: &'static str,
        help: &'static str,
    ) -> Setting {
        Setting {
            name,
            kind: Kind::Text { allowed, default },
            help,
        }
    }

    /// What is accepted, as error messages and docs show it (`0-4096`, `on, off (or unset)`).
    pub fn allowed(&self) -> String {
        match self.kind {
            Kind::Int { min, max, .. } => format!("{min}-{max}"),
            Kind::Number { min, max, .. } => format!("a number {min}-{max}"),
            Kind::Word { words, default } => {
                let list = words.join(", ");
                match default {
                    Some(_) => list,
                    None => format!("{list} (or unset)"),
                }
            }
            Kind::Text { allowed, .. } => allowed.to_owned(),
        }
    }

    /// The value an unset variable stands for, as docs and `--help` show it.
    pub fn default_text(&self) -> String {
        match self.kind {
            Kind::Int { default, .. } => default.to_string(),
            Kind::Number { default, .. } => format!("{default:?}"),
            Kind::Word { default, .. } => default.unwrap_or("unset").to_owned(),
            Kind::Text { default, .. } => default.to_owned(),
        }
    }

    /// The default of an [`Kind::Int`] setting (0 for any other kind).
    pub const fn default_int(&self) -> u64 {
        match self.kind {
            Kind::Int { default, .. } => default,
            _ => 0,
        }
    }

    /// Records that `raw` is not allowed.
    pub fn reject(&self, raw: &str, errs: &mut Vec<FieldError>) {
        errs.push(FieldError::new(self.name, quoted(raw), self.allowed()));
    }

    /// An [`Kind::Int`] value: decimal digits only (no sign, no spaces, so "+16" and " 16" are
    /// errors) within its range. The default when unset or rejected.
    pub fn parse_int(&self, raw: Option<&str>, errs: &mut Vec<FieldError>) -> u64 {
        let (min, max, default) = match self.kind {
            Kind::Int { min, max, default } => (min, max, default),
            _ => (0, u64::MAX, 0),
        };
        let Some(s) = raw else { return default };
        let parsed = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse::<u64>().ok().filter(|v| (min..=max).contains(v))
        } else {
            None
        };
        parsed.unwrap_or_else(|| {
            self.reject(s, errs);
            default
        })
    }

    /// A [`Kind::Number`] value within its range; the default when unset or rejected.
    pub fn parse_number(&self, raw: Option<&str>, errs: &mut Vec<FieldError>) -> f64 {
        let (min, max, default) = match self.kind {
            Kind::Number { min, max, default } => (min, max, default),
            _ => (f64::MIN, f64::MAX, 0.0),
        };
        let Some(s) = raw else { return default };
        match s.parse::<f64>() {
            Ok(f) if f.is_finite() && (min..=max).contains(&f) => f,
            _ => {
                self.reject(s, errs);
                default
            }
        }
    }

    /// A [`Kind::Word`] value: the entry of `values` at the position of the word given (or of the
    /// default word when unset); `None` when unset without a default, or rejected without one.
    pub fn parse_word<T: Copy>(
        &self,
        raw: Option<&str>,
        values: &[T],
        errs: &mut Vec<FieldError>,
    ) -> Option<T> {
        let (words, default) = match self.kind {
            Kind::Word { words, default } => (words, default),
            _ => (&[][..], None),
        };
        let at = |w: &str| {
            words
                .iter()
                .position(|x| *x == w)
                .and_then(|i| values.get(i).copied())
        };
        let fallback = default.and_then(at);
        match raw {
            None => fallback,
            Some(s) => at(s).or_else(|| {
                self.reject(s, errs);
                fallback
            }),
        }
    }
}

/// `LLB_KV_MIN_MATCH_TOKENS`: minimum matched prefix before a KV match overrides the fallback.
pub const MIN_MATCH_TOKENS: Setting = Setting::int(
    "LLB_KV_MIN_MATCH_TOKENS",
    (0, 4096),
    16,
    "prompts with fewer tokens skip KV scoring (`miss_short_prompt`)",
);
/// `LLB_KV_NONE_HASH_SEED`: the engines' `PYTHONHASHSEED`, which seeds vLLM's NONE_HASH.
pub const NONE_HASH_SEED: Setting = Setting::text(
    "LLB_KV_NONE_HASH_SEED",
    "any string (empty is the empty seed)",
    "unset",
    "the engines' `PYTHONHASHSEED` (vLLM NONE_HASH seed); part of the `engine` key-mode contract",
);
/// `LOXILB_KV_SPILL_RELIEF`: whether spilling load off a hot prefix holder is forced on or off.
pub const SPILL_RELIEF: Setting = Setting::word(
    "LOXILB_KV_SPILL_RELIEF",
    &["on", "off"],
    None,
    "a winner at its load cap spills to the under-cap endpoint with the most overlap; \
     unset = on for kvExactMode 3, off for 1",
);
/// `LOXILB_KV_COLDSTART_SEED_N`: every Nth hit seeds a cold endpoint.
pub const COLDSTART_SEED_N: Setting = Setting::int(
    "LOXILB_KV_COLDSTART_SEED_N",
    (0, u32::MAX as u64),
    16,
    "every Nth hit goes to the lowest-index cold endpoint; 0 disables",
);
/// `LOXILB_KV_COLDSTART_MIN_BLOCKS`: blocks an endpoint must hold before it counts as warm.
pub const COLDSTART_MIN_BLOCKS: Setting = Setting::int(
    "LOXILB_KV_COLDSTART_MIN_BLOCKS",
    (0, u32::MAX as u64),
    16,
    "an endpoint holding fewer blocks is cold; 0 disables seeding",
);

/// The seed variable's name (rule validation and the CLI name it in messages).
pub const NONE_HASH_SEED_VAR: &str = NONE_HASH_SEED.name;

/// Every variable [`Settings::from_env`] reads, in the order it reads them and reports errors.
pub const VARS: [Setting; 5] = [
    MIN_MATCH_TOKENS,
    NONE_HASH_SEED,
    SPILL_RELIEF,
    COLDSTART_SEED_N,
    COLDSTART_MIN_BLOCKS,
];

/// `LOXILB_KV_SPILL_RELIEF`: three states, because "unset" leaves the choice to the scorer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SpillRelief {
    /// Variable absent: the scorer's default (on for one pool, off for prefill/decode).
    #[default]
    Unset,
    /// `on`.
    On,
    /// `off`.
    Off,
}

impl SpillRelief {
    /// Whether relief applies to a rule, given what unset means for it.
    pub fn applies(self, when_unset: bool) -> bool {
        match self {
            SpillRelief::On => true,
            SpillRelief::Off => false,
            SpillRelief::Unset => when_unset,
        }
    }
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
        Settings::read(|_| None, &mut Vec::new())
    }
}

/// An integer setting whose range fits `u32`.
fn int_u32(s: &Setting, raw: Option<&str>, errs: &mut Vec<FieldError>) -> u32 {
    u32::try_from(s.parse_int(raw, errs)).unwrap_or(u32::MAX)
}

impl Settings {
    /// Reads every variable through `lookup` (`None` = unset) and validates them all.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<Settings, SettingsErrors> {
        let mut errs = Vec::new();
        let s = Settings::read(lookup, &mut errs);
        if errs.is_empty() {
            Ok(s)
        } else {
            Err(SettingsErrors(errs))
        }
    }

    /// Every variable, each rejected one recorded in `errs` and left at its default.
    fn read(lookup: impl Fn(&str) -> Option<String>, errs: &mut Vec<FieldError>) -> Settings {
        let min_match_tokens = int_u32(
            &MIN_MATCH_TOKENS,
            lookup(MIN_MATCH_TOKENS.name).as_deref(),
            errs,
        );
        let none_hash_seed = lookup(NONE_HASH_SEED.name);
        let spill_relief = SPILL_RELIEF
            .parse_word(
                lookup(SPILL_RELIEF.name).as_deref(),
                &[SpillRelief::On, SpillRelief::Off],
                errs,
            )
            .unwrap_or(SpillRelief::Unset);
        let coldstart_seed_n = int_u32(
            &COLDSTART_SEED_N,
            lookup(COLDSTART_SEED_N.name).as_deref(),
            errs,
        );
        let coldstart_min_blocks = int_u32(
            &COLDSTART_MIN_BLOCKS,
            lookup(COLDSTART_MIN_BLOCKS.name).as_deref(),
            errs,
        );
        Settings {
            min_match_tokens,
            none_hash_seed,
            spill_relief,
            coldstart_seed_n,
            coldstart_min_blocks,
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

    /// The same settings with `LLB_KV_MIN_MATCH_TOKENS` (for callers that build settings in code).
    pub fn with_min_match_tokens(mut self, tokens: u32) -> Self {
        self.min_match_tokens = tokens;
        self
    }

    /// The same settings with `LOXILB_KV_SPILL_RELIEF` (for callers that build settings in code).
    pub fn with_spill_relief(mut self, relief: SpillRelief) -> Self {
        self.spill_relief = relief;
        self
    }

    /// The same settings with `LOXILB_KV_COLDSTART_SEED_N` and `_MIN_BLOCKS` (for callers that
    /// build settings in code).
    pub fn with_coldstart(mut self, seed_n: u32, min_blocks: u32) -> Self {
        self.coldstart_seed_n = seed_n;
        self.coldstart_min_blocks = min_blocks;
        self
    }
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
        assert_eq!(asked.into_inner(), VARS.map(|v| v.name.to_owned()));
    }

    #[test]
    fn descriptors_render_their_rules() {
        assert_eq!(MIN_MATCH_TOKENS.allowed(), "0-4096");
        assert_eq!(SPILL_RELIEF.allowed(), "on, off (or unset)");
        assert_eq!(SPILL_RELIEF.default_text(), "unset");
        assert_eq!(COLDSTART_SEED_N.default_text(), "16");
        let mut errs = Vec::new();
        assert_eq!(COLDSTART_SEED_N.parse_int(Some(" 3"), &mut errs), 16);
        assert_eq!(
            errs[0].to_string(),
            "LOXILB_KV_COLDSTART_SEED_N: got \" 3\", allowed: 0-4294967295"
        );
    }

    #[test]
    fn empty_seed_is_a_seed() {
        let s = Settings::from_env(env(&[(NONE_HASH_SEED_VAR, "")])).unwrap();
        assert_eq!(s.none_hash_seed(), Some(""));
    }
}
