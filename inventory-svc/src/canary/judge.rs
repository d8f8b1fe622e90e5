//! Judging one canary run: what each probe's events and answer say, and which leg is wrong.
//!
//! Pure: the run ([`super::run`]) hands over what kvroute computed for each probe, what the
//! engine answered and the `BlockStored` events the endpoint's ingestion tapped meanwhile.
//!
//! TensorRT-LLM: the inventory keys each stored block from its tokens (`v1_block_key` over the
//! rule's block size), so the engine's own `block_hash` matters for removals only. Its keys are
//! compared when they are kvroute's for the same tokens; when they are not, the probe is judged
//! on its tokens and its tokens per block ([`Finding::TokensOnly`]) and the verdict says that
//! keys were not compared. The salted probe is not sent to TensorRT-LLM (see [`SALT_NOT_JUDGED`]).

use kvroute_core::hash::{BlockKey, Engine, HashContract};

use crate::fleet::{Leg, ParityReport, Probe};
use crate::ingest::decode::Stored;
use crate::ingest::parity::{place, Placed};

/// What kvroute computed for one probe.
#[derive(Clone, Debug)]
pub struct Expected {
    pub probe: Probe,
    pub tokens: Vec<u32>,
    pub keys: Vec<BlockKey>,
    /// The salted probe: its keys without the salt (an engine ignoring the salt publishes these).
    pub unsalted: Option<Vec<BlockKey>>,
    /// The salted probe on vLLM: its keys under the other extra-keys layout, and that layout's
    /// `kvVllmExtraKeys` name.
    pub other_layout: Option<(Vec<BlockKey>, &'static str)>,
}

/// What the engine answered (`usage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// What one probe's events said.
#[derive(Clone, Debug, PartialEq)]
pub enum Finding {
    /// An event of the prompt carried its tokens and keys.
    Match,
    /// Token `position` differs. `placed`: an event of the prompt said so; otherwise the chain
    /// start sharing the most leading tokens did, and the engine counted other tokens.
    Tokens {
        position: usize,
        ours: u32,
        engine: u32,
        placed: bool,
        /// kvroute's text around the position, and the engine's ids there decoded by kvroute's
        /// tokenizer.
        ours_text: String,
        engine_text: String,
    },
    /// The engine counted `engine` prompt tokens, kvroute `ours`, and no event says where.
    Count {
        ours: usize,
        engine: u64,
    },
    /// Tokens agree, keys differ.
    Keys {
        report: ParityReport,
        /// The event names a LoRA adapter.
        lora: bool,
        /// The engine's first key is the prompt's unsalted one.
        salt_ignored: bool,
        /// The engine's first key is the prompt's under this `kvVllmExtraKeys` layout.
        layout: Option<&'static str>,
    },
    /// TensorRT-LLM: tokens and tokens per block agree, the engine's keys are not kvroute's for
    /// the same tokens and were not compared (the inventory re-keys the blocks from their tokens).
    TokensOnly,
    NoEvent,
}

/// Why the salted probe is not sent to TensorRT-LLM: nothing kvroute routes on could show it.
pub const SALT_NOT_JUDGED: &str = "TensorRT-LLM's events do not carry the salt and the inventory keys each block from its tokens alone, so salted requests are never predicted to hit and no event shows the salt's place in the keys";

/// Tokens shown either side of a differing position.
const CONTEXT: usize = 8;

/// The finding for `exp` among `events` (arrival order). `tokens_mode`: the rule re-hashes
/// token ids (`kvKeyMode: tokens`), so the engine's keys are not the rule's and only tokens
/// are compared. `decode` turns ids into text for the report.
pub fn find(
    engine: Engine,
    contract: &HashContract,
    tokens_mode: bool,
    exp: &Expected,
    answer: &Answer,
    events: &[Stored],
    decode: &dyn Fn(&[u32]) -> String,
) -> Finding {
    let around = |ids: &[u32], at: usize| {
        let lo = at.saturating_sub(CONTEXT);
        let hi = (at + CONTEXT).min(ids.len());
        decode(ids.get(lo..hi).unwrap_or(&[]))
    };
    let tokens_finding = |position: usize, theirs: &[u32], offset: usize, placed: bool| {
        let at = position - offset;
        Finding::Tokens {
            position,
            ours: exp.tokens.get(position).copied().unwrap_or(0),
            engine: theirs.get(at).copied().unwrap_or(0),
            placed,
            ours_text: around(&exp.tokens, position),
            engine_text: around(theirs, at),
        }
    };
    let bs = contract.block_size.get();
    // The unplaced chain start sharing the most leading tokens with the prompt.
    let mut closest: Option<(usize, &Stored)> = None;
    for s in events {
        match place(engine, contract, &exp.tokens, &exp.keys, s) {
            Some(Placed::Match { .. }) => return Finding::Match,
            Some(Placed::TokenMismatch { position, .. }) => {
                let offset = match s.parent {
                    None => 0,
                    Some(p) => exp.keys.iter().position(|k| k.0 == p).map_or(0, |i| i + 1) * bs,
                };
                return tokens_finding(position, &s.token_ids, offset, true);
            }
            Some(Placed::KeyMismatch { report, .. }) => {
                if tokens_mode {
                    return Finding::Match;
                }
                // Same tokens, same block size: the inventory's keys for them are kvroute's
                // whatever the engine's block_hash is.
                if engine == Engine::Trtllm && report.suggested_block_size.is_none() && !s.has_lora
                {
                    return Finding::TokensOnly;
                }
                let first = |keys: &[BlockKey]| {
                    s.parent.is_none()
                        && keys
                            .first()
                            .is_some_and(|k| s.block_hashes.first() == Some(&k.0))
                };
                return Finding::Keys {
                    report,
                    lora: s.has_lora,
                    salt_ignored: exp.unsalted.as_deref().is_some_and(first),
                    layout: exp
                        .other_layout
                        .as_ref()
                        .filter(|(keys, _)| first(keys))
                        .map(|(_, name)| *name),
                };
            }
            None if s.parent.is_none() => {
                let shared = exp
                    .tokens
                    .iter()
                    .zip(&s.token_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                if shared > 0 && closest.is_none_or(|(c, _)| shared > c) {
                    closest = Some((shared, s));
                }
            }
            None => {}
        }
    }
    match answer.prompt_tokens {
        Some(n) if n != exp.tokens.len() as u64 => match closest {
            Some((shared, s)) => tokens_finding(shared, &s.token_ids, 0, false),
            None => Finding::Count {
                ours: exp.tokens.len(),
                engine: n,
            },
        },
        _ => Finding::NoEvent,
    }
}

/// Tokens of the repeated chat the engine should reuse when the inventory holds `matched`
/// blocks of it: an engine computes at least the prompt's last token, so a prompt that ends on
/// a block boundary recomputes its last block.
pub fn predicted_tokens(matched: u32, prompt_tokens: usize, block_size: usize) -> u64 {
    let reusable = prompt_tokens.saturating_sub(1) / block_size.max(1);
    (matched as usize).min(reusable) as u64 * block_size as u64
}

/// The repeated chat: what the inventory predicted it to reuse, what the engine reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reuse {
    pub predicted: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached: Option<u64>,
    /// Between the chat and its repeat the chat's blocks left the engine's cache: the index lost
    /// its first block (an eviction or a reset published), or the engine stored that block again.
    pub evicted: bool,
}

/// The verdict of a run from its findings (`None`: the probe was not sent) and the repeated
/// chat's reuse; the message says what was seen and what to change.
pub fn verdict(
    engine: Engine,
    findings: &[(Probe, Option<&Finding>)],
    repeat: Option<Reuse>,
) -> (Leg, String) {
    let get = |p: Probe| findings.iter().find(|(q, _)| *q == p).and_then(|(_, f)| *f);
    let (completion, chat) = (get(Probe::Completion), get(Probe::Chat));
    let tokens_differ =
        |f: Option<&Finding>| matches!(f, Some(Finding::Tokens { .. } | Finding::Count { .. }));
    let describe = |p: Probe, f: &Finding| {
        match f {
        Finding::Tokens {
            position,
            ours,
            engine,
            placed,
            ours_text,
            engine_text,
        } => format!(
            "{} canary: token {position} differs (kvroute {ours} in {ours_text:?}, engine {engine}, which kvroute's tokenizer reads as {engine_text:?}){}",
            p.as_str(),
            if *placed { "" } else { ", judged from the engine's chain start closest to the prompt" }
        ),
        Finding::Count { ours, engine } => format!(
            "{} canary: the engine counted {engine} prompt tokens, kvroute {ours}",
            p.as_str()
        ),
        _ => String::new(),
    }
    };
    if tokens_differ(completion) {
        let f = completion
            .map(|f| describe(Probe::Completion, f))
            .unwrap_or_default();
        return (
            Leg::Tokenizer,
            format!(
                "{f}: the rule's tokenizer (kvModel's staged tokenizer.json) is not the engine's"
            ),
        );
    }
    if tokens_differ(chat) {
        let f = chat.map(|f| describe(Probe::Chat, f)).unwrap_or_default();
        let why = match completion {
            Some(Finding::Match) => "the completion canary's tokens agree, so the chat template (tokenizer_config.json's chat_template) is not the engine's",
            _ => "the chat template or the tokenizer is not the engine's (the completion canary was not judged)",
        };
        return (Leg::ChatTemplate, format!("{f}: {why}"));
    }
    for p in [Probe::Completion, Probe::Chat] {
        if let Some(Finding::Keys { report, lora, .. }) = get(p) {
            let leg = if *lora {
                Leg::Lora
            } else if report.suggested_block_size.is_some() {
                Leg::BlockSize
            } else if report.suggested_seed.is_some() {
                Leg::Seed
            } else if report.suggested_algo.is_some() {
                Leg::Algorithm
            } else {
                Leg::Hash
            };
            let msg = match leg {
                Leg::Lora => format!(
                    "{} canary: tokens agree but the engine served the rule's model through a LoRA adapter, whose keys mix in the adapter's name and path, which events do not carry: route the adapter with kvKeyMode tokens",
                    p.as_str()
                ),
                _ => format!("{} canary: tokens agree, keys differ: {}", p.as_str(), report.message),
            };
            return (leg, msg);
        }
    }
    if let Some(Finding::Keys {
        salt_ignored,
        layout,
        ..
    }) = get(Probe::Salted)
    {
        let how = match (salt_ignored, layout) {
            (true, _) => "the engine ignores cache_salt (its keys are the unsalted ones): an engine without cache_salt support shares cache across salts; salted requests are never predicted to hit".to_owned(),
            (false, Some(l)) => format!("the engine writes its extra keys in the other layout: they match with kvVllmExtraKeys \"{l}\" (flat: vLLM before 0.31; tagged: 0.31 and later)"),
            (false, None) => "the engine mixes cache_salt into its keys differently from kvroute".to_owned(),
        };
        return (
            Leg::CacheSalt,
            format!(
                "salted canary: tokens agree and unsalted keys match, salted keys differ: {how}"
            ),
        );
    }
    // Reusing none of it is a broken chain; reusing part of it is an eviction in between (a
    // full cache under load), which the healthy message reports.
    if let Some(Reuse {
        predicted,
        cached: Some(0),
        evicted: false,
    }) = repeat
    {
        if predicted > 0 {
            return (
                Leg::NoReuse,
                format!("chat_repeat canary: the inventory predicted {predicted} cached tokens, the engine reused none: it does not reuse what its events say it stored (prefix caching off for these requests, or its cache reset in between)"),
            );
        }
    }
    let agrees = |f: Option<&Finding>| matches!(f, Some(Finding::Match | Finding::TokensOnly));
    let judged = agrees(completion) || agrees(chat);
    if !judged {
        return (
            Leg::NoEvents,
            "no BlockStored of the canary's prompts arrived within KVROUTE_CANARY_TIMEOUT_MS: check that the engine publishes KV events with token ids, has prefix caching on, and that the subscriber is connected".into(),
        );
    }
    let reuse = match repeat {
        Some(Reuse {
            predicted: p,
            cached: Some(c),
            evicted,
        }) => format!(
            ", the engine reused {c} of {p} predicted tokens{}",
            if evicted {
                " (its blocks were evicted between the chat and its repeat)"
            } else {
                ""
            }
        ),
        Some(Reuse { cached: None, .. }) => {
            ", the engine does not report cached_tokens (vLLM: --enable-prompt-tokens-details)"
                .into()
        }
        None => String::new(),
    };
    if engine != Engine::Trtllm {
        return (
            Leg::Healthy,
            format!("tokens and keys agree with the rule's contract{reuse}"),
        );
    }
    // TensorRT-LLM: say which legs this run checked, and why the others were not.
    let keys = [completion, chat]
        .iter()
        .any(|f| matches!(f, Some(Finding::Match)));
    let mut checked = Vec::new();
    for (f, leg) in [(completion, "tokenizer"), (chat, "chat template")] {
        if agrees(f) {
            checked.push(leg);
        }
    }
    checked.push("block size");
    if keys {
        checked.push("keys");
    }
    if matches!(
        repeat,
        Some(Reuse {
            cached: Some(_),
            ..
        })
    ) {
        checked.push("reuse");
    }
    let mut not = Vec::new();
    if !keys {
        not.push("keys (the engine's block_hash is not kvroute's v1_block_key of the same tokens; the inventory keys each block from its tokens, so routing does not need it)".to_owned());
    }
    if get(Probe::Salted).is_none() {
        not.push(format!(
            "cache_salt (salted canary not sent: {SALT_NOT_JUDGED})"
        ));
    }
    let agreed = if keys {
        "tokens, tokens per block and keys agree with the rule's contract"
    } else {
        "tokens and tokens per block agree with the rule's contract"
    };
    (
        Leg::Healthy,
        format!(
            "{agreed}{reuse}; checked: {}; not checked: {}",
            checked.join(", "),
            not.join("; ")
        ),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::ingest::decode::Medium;
    use kvroute_core::hash::{BlockSize, ExtraKeys, HashAlgo};

    fn contract(seed: &str, bs: u32) -> HashContract {
        HashContract::new(HashAlgo::Sha256Cbor, BlockSize::new(bs).unwrap()).with_seed(seed)
    }

    fn stored(c: &HashContract, tokens: &[u32], salt: Option<&str>) -> Stored {
        let extra = ExtraKeys {
            cache_salt: salt.map(str::to_owned),
            ..ExtraKeys::default()
        };
        let keys = c.keys(tokens, &extra).unwrap();
        let bs = c.block_size.get();
        Stored {
            block_hashes: keys.iter().map(|k| k.0).collect(),
            parent: None,
            token_ids: tokens[..keys.len() * bs].to_vec(),
            block_size: Some(bs as u32),
            medium: Medium::Gpu,
            has_lora: false,
            has_extra_keys: salt.is_some(),
            cache_salt: salt.map(str::to_owned),
            group: None,
            kind: None,
        }
    }

    fn expected(c: &HashContract, probe: Probe, tokens: Vec<u32>) -> Expected {
        let keys = c.keys(&tokens, &ExtraKeys::default()).unwrap();
        Expected {
            probe,
            tokens,
            keys,
            unsalted: None,
            other_layout: None,
        }
    }

    fn decode(ids: &[u32]) -> String {
        format!("{ids:?}")
    }

    fn answer(n: usize) -> Answer {
        Answer {
            prompt_tokens: Some(n as u64),
            cached_tokens: None,
        }
    }

    const E: Engine = Engine::Vllm;

    #[test]
    fn each_leg_is_found_and_named() {
        let ours = contract("0", 16);
        let tokens: Vec<u32> = (100..170).collect();
        let exp = expected(&ours, Probe::Completion, tokens.clone());
        let a = answer(tokens.len());
        let f = |events: &[Stored]| find(E, &ours, false, &exp, &a, events, &decode);
        // The engine's own events under the same contract: a match.
        assert_eq!(f(&[stored(&ours, &tokens, None)]), Finding::Match);
        // Another seed, another block size: keys differ with tokens agreeing, and the leg named.
        for (engine_side, leg) in [
            (
                contract(kvroute_core::hash::DEFAULT_NONE_HASH_SEED, 16),
                Leg::Seed,
            ),
            (contract("0", 32), Leg::BlockSize),
        ] {
            let got = f(&[stored(&engine_side, &tokens, None)]);
            assert!(matches!(got, Finding::Keys { .. }), "{got:?}");
            let (l, msg) = verdict(E, &[(Probe::Completion, Some(&got))], None);
            assert_eq!(l, leg, "{msg}");
        }
        // A token swapped at position 40: placed, the position and both ids named.
        let mut theirs = tokens.clone();
        theirs[40] = 7;
        let got = f(&[stored(&ours, &theirs, None)]);
        match &got {
            Finding::Tokens {
                position,
                ours: o,
                engine,
                placed,
                ..
            } => assert_eq!((*position, *o, *engine, *placed), (40, 140, 7, true)),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            verdict(
                E,
                &[
                    (Probe::Completion, Some(&got)),
                    (Probe::Chat, Some(&Finding::Match))
                ],
                None
            )
            .0,
            Leg::Tokenizer
        );
        // The chat's tokens differ while the completion's agree: the chat template.
        assert_eq!(
            verdict(
                E,
                &[
                    (Probe::Completion, Some(&Finding::Match)),
                    (Probe::Chat, Some(&got))
                ],
                None
            )
            .0,
            Leg::ChatTemplate
        );
        // A LoRA adapter on the engine side.
        let mut lora = stored(&contract("7", 16), &tokens, None);
        lora.has_lora = true;
        let got = f(&[lora]);
        assert_eq!(verdict(E, &[(Probe::Chat, Some(&got))], None).0, Leg::Lora);
    }

    #[test]
    fn a_difference_in_the_first_tokens_is_judged_from_the_closest_chain_start() {
        let ours = contract("0", 16);
        let tokens: Vec<u32> = (100..170).collect();
        let exp = expected(&ours, Probe::Completion, tokens.clone());
        let mut theirs = tokens.clone();
        theirs[2] = 9;
        theirs.push(1);
        let other_traffic = stored(&ours, &(500..540).collect::<Vec<_>>(), None);
        let events = [other_traffic, stored(&ours, &theirs, None)];
        // The engine counted one token more: the closest chain start says where.
        let got = find(E, &ours, false, &exp, &answer(71), &events, &decode);
        match got {
            Finding::Tokens {
                position, placed, ..
            } => assert_eq!((position, placed), (2, false)),
            other => panic!("{other:?}"),
        }
        // Same count and no placeable event: nothing to say.
        assert_eq!(
            find(E, &ours, false, &exp, &answer(70), &events, &decode),
            Finding::NoEvent
        );
        assert_eq!(
            verdict(E, &[(Probe::Completion, Some(&Finding::NoEvent))], None).0,
            Leg::NoEvents
        );
    }

    #[test]
    fn a_salt_the_engine_ignores_is_named() {
        let c = contract("0", 16);
        let tokens: Vec<u32> = (100..170).collect();
        let salted = c
            .keys(
                &tokens,
                &ExtraKeys {
                    cache_salt: Some("s".into()),
                    ..ExtraKeys::default()
                },
            )
            .unwrap();
        let salt = ExtraKeys {
            cache_salt: Some("s".into()),
            ..ExtraKeys::default()
        };
        let flat = HashContract {
            extra_layout: kvroute_core::hash::ExtraKeysLayout::Flat,
            ..c.clone()
        };
        let exp = Expected {
            probe: Probe::Salted,
            tokens: tokens.clone(),
            keys: salted,
            unsalted: Some(c.keys(&tokens, &ExtraKeys::default()).unwrap()),
            other_layout: Some((flat.keys(&tokens, &salt).unwrap(), "flat")),
        };
        let a = answer(tokens.len());
        let f = |s: Stored| find(E, &c, false, &exp, &a, &[s], &decode);
        assert_eq!(f(stored(&c, &tokens, Some("s"))), Finding::Match);
        let ignored = f(stored(&c, &tokens, None));
        assert!(
            matches!(
                ignored,
                Finding::Keys {
                    salt_ignored: true,
                    ..
                }
            ),
            "{ignored:?}"
        );
        let all = [
            (Probe::Completion, Some(&Finding::Match)),
            (Probe::Chat, Some(&Finding::Match)),
            (Probe::Salted, Some(&ignored)),
        ];
        let full = Reuse {
            predicted: 48,
            cached: Some(48),
            evicted: false,
        };
        let (leg, msg) = verdict(E, &all, Some(full));
        assert_eq!(leg, Leg::CacheSalt);
        assert!(msg.contains("ignores cache_salt"), "{msg}");
        // Salted keys of another salt: mixed in differently.
        let other = f(stored(&c, &tokens, Some("t")));
        assert!(
            matches!(
                other,
                Finding::Keys {
                    salt_ignored: false,
                    layout: None,
                    ..
                }
            ),
            "{other:?}"
        );
        // vLLM before 0.31: the same salt, flat.
        let old = f(stored(&flat, &tokens, Some("s")));
        assert!(
            matches!(
                old,
                Finding::Keys {
                    layout: Some("flat"),
                    ..
                }
            ),
            "{old:?}"
        );
        let (leg, msg) = verdict(E, &[(Probe::Salted, Some(&old))], None);
        assert_eq!(leg, Leg::CacheSalt);
        assert!(msg.contains("kvVllmExtraKeys \"flat\""), "{msg}");
    }

    /// TensorRT-LLM: keys compared when the engine's are kvroute's, tokens and tokens per block
    /// judged when they are not, and the verdict names the legs it checked.
    #[test]
    fn trtllm_is_judged_on_keys_when_comparable_and_on_tokens_per_block_otherwise() {
        let ours = HashContract::new(HashAlgo::BlockhashTrtllm, BlockSize::new(16).unwrap());
        let tokens: Vec<u32> = (100..170).collect();
        let exp = expected(&ours, Probe::Chat, tokens.clone());
        let a = answer(tokens.len());
        let f = |s: Stored| find(Engine::Trtllm, &ours, false, &exp, &a, &[s], &decode);
        // Both probes' events alike (the same engine hashed both).
        const FULL_REUSE: Reuse = Reuse {
            predicted: 48,
            cached: Some(48),
            evicted: false,
        };
        fn findings(f: &Finding) -> [(Probe, Option<&Finding>); 3] {
            [
                (Probe::Completion, Some(f)),
                (Probe::Chat, Some(f)),
                (Probe::Salted, None),
            ]
        }
        // The engine's block_hash is v1_block_key: keys compared.
        let v1 = stored(&ours, &tokens, None);
        assert_eq!(f(v1.clone()), Finding::Match);
        let (leg, msg) = verdict(Engine::Trtllm, &findings(&Finding::Match), Some(FULL_REUSE));
        assert_eq!(leg, Leg::Healthy, "{msg}");
        assert!(
            msg.contains("checked: tokenizer, chat template, block size, keys, reuse;"),
            "{msg}"
        );
        assert!(msg.contains("salted canary not sent"), "{msg}");
        // Another block_hash for the same tokens: judged on tokens and tokens per block.
        let mut other = v1.clone();
        other.block_hashes.iter_mut().for_each(|h| *h ^= 0x5555);
        assert_eq!(f(other.clone()), Finding::TokensOnly);
        let (leg, msg) = verdict(
            Engine::Trtllm,
            &findings(&Finding::TokensOnly),
            Some(FULL_REUSE),
        );
        assert_eq!(leg, Leg::Healthy, "{msg}");
        assert!(
            msg.contains("checked: tokenizer, chat template, block size, reuse;"),
            "{msg}"
        );
        assert!(msg.contains("not checked: keys"), "{msg}");
        // Blocks of 32 tokens: the block size, read from the tokens whatever the hashes.
        let mut big = stored(
            &HashContract::new(HashAlgo::BlockhashTrtllm, BlockSize::new(32).unwrap()),
            &tokens,
            None,
        );
        big.block_hashes.iter_mut().for_each(|h| *h ^= 0x5555);
        let got = f(big);
        let (leg, msg) = verdict(Engine::Trtllm, &findings(&got), None);
        assert_eq!(leg, Leg::BlockSize, "{msg}");
        assert!(msg.contains("kvBlockSize should be 32"), "{msg}");
        // A token of another vocabulary is still a token difference.
        let mut theirs = tokens.clone();
        theirs[20] = 7;
        let mut swapped = stored(&ours, &theirs, None);
        swapped.block_hashes.iter_mut().for_each(|h| *h ^= 0x5555);
        assert!(matches!(f(swapped), Finding::Tokens { position: 20, .. }));
        // vLLM's healthy message is unchanged by the TensorRT-LLM wording.
        assert_eq!(
            verdict(E, &findings(&Finding::Match), None).1,
            "tokens and keys agree with the rule's contract"
        );
    }

    #[test]
    fn reuse_below_the_prediction_fails_and_agreement_is_healthy() {
        let ok = [
            (Probe::Completion, Some(&Finding::Match)),
            (Probe::Chat, Some(&Finding::Match)),
        ];
        let reuse = |predicted, cached, evicted| {
            Some(Reuse {
                predicted,
                cached,
                evicted,
            })
        };
        assert_eq!(verdict(E, &ok, reuse(64, Some(0), false)).0, Leg::NoReuse);
        // Every block evicted in between (seen in the index or in a second store): healthy.
        let (leg, msg) = verdict(E, &ok, reuse(64, Some(0), true));
        assert_eq!(leg, Leg::Healthy, "{msg}");
        assert!(msg.contains("0 of 64") && msg.contains("evicted"), "{msg}");
        // Part of it evicted in between: healthy, and said.
        let (leg, msg) = verdict(E, &ok, reuse(64, Some(16), false));
        assert_eq!(leg, Leg::Healthy);
        assert!(msg.contains("16 of 64"), "{msg}");
        let (leg, msg) = verdict(E, &ok, reuse(64, Some(64), false));
        assert_eq!(leg, Leg::Healthy, "{msg}");
        assert!(msg.contains("64 of 64"), "{msg}");
        assert_eq!(verdict(E, &ok, reuse(64, None, false)).0, Leg::Healthy);
        // Tokens mode: keys are not compared.
        let c = contract("0", 16);
        let tokens: Vec<u32> = (100..170).collect();
        let exp = expected(&c, Probe::Chat, tokens.clone());
        let other = stored(&contract("9", 16), &tokens, None);
        assert_eq!(
            find(E, &c, true, &exp, &answer(70), &[other], &decode),
            Finding::Match
        );
        // The last block of a prompt ending on a boundary is recomputed.
        assert_eq!(predicted_tokens(4, 64, 16), 48);
        assert_eq!(predicted_tokens(4, 70, 16), 64);
        assert_eq!(predicted_tokens(2, 70, 16), 32);
        for l in Leg::ALL {
            assert_eq!(serde_json::to_value(l).unwrap(), l.as_str());
        }
    }
}
