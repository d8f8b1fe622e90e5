//! Every golden vector from the engines, natively and inside the built filter `.wasm`.
//!
//! A key mismatch here means a silent 0% hit rate in production, so each failure names the case,
//! the block index and both keys.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvroute_core::hash::trtllm;
use kvroute_tests::golden::{self, Case};

fn check(case: &Case, got: &[u64]) -> Result<(), String> {
    if got.len() != case.want.len() {
        return Err(format!(
            "{}: {} keys, want {}",
            case.name,
            got.len(),
            case.want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(&case.want).enumerate() {
        if g != w {
            return Err(format!(
                "{}: block {i}: got {g:#018x}, want {w:#018x}",
                case.name
            ));
        }
    }
    Ok(())
}

#[test]
fn every_vector_matches_natively() {
    let cases = golden::all_cases().expect("load vectors");
    assert!(
        cases.len() >= 39,
        "only {} golden cases loaded",
        cases.len()
    );
    check_all(&cases, "", |case| {
        case.contract
            .keys(&case.tokens, &case.extra)
            .expect(&case.name)
            .iter()
            .map(|k| k.0)
            .collect()
    });
}

#[test]
fn every_vector_matches_inside_the_wasm_module() {
    let cases = golden::all_cases().expect("load vectors");
    let mut module =
        kvroute_tests::wasm::FilterModule::load().expect("load the built filter .wasm");
    check_all(&cases, " in wasm", |case| {
        let resp = module.test_keys(&case.wasm_request()).expect(&case.name);
        let keys = resp["keys"]
            .as_array()
            .unwrap_or_else(|| panic!("{}: wasm answered {resp}", case.name));
        keys.iter()
            .map(|k| golden::key_bits(k).expect("key"))
            .collect()
    });
}

/// [`check`]s every case against the keys `keys_of` computes for it; one assertion listing every
/// failing case (`place` says where the keys were computed).
fn check_all(cases: &[Case], place: &str, mut keys_of: impl FnMut(&Case) -> Vec<u64>) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| check(case, &keys_of(case)).err())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed{place}:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn trtllm_partial_tail_and_salt_id_match() {
    let d: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden::vectors_dir().join("trtllm-v1_block_key.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        trtllm::cache_salt_id("abc"),
        d["cache_salt_id_check"]["abc"].as_u64().unwrap()
    );
    let v = &d["vectors"]["range64"];
    assert_eq!(
        trtllm::cache_salt_id("tenant-a"),
        v["v1_block_key_cache_salt_tenant-a"]["cache_salt_id"]
            .as_u64()
            .unwrap()
    );
    // The engine publishes partial blocks too; the inventory re-hashes each from its parent.
    let tokens: Vec<u32> = (0..64).collect();
    for b in v["trtllm_router_style_prompt_minus_last_token_with_partial_tail"]
        .as_array()
        .unwrap()
    {
        let lo = b["tokens"][0].as_u64().unwrap() as usize;
        let hi = b["tokens"][1].as_u64().unwrap() as usize;
        let parent = b["parent_hash"].as_u64().unwrap_or(0);
        assert_eq!(
            trtllm::block_key(parent, &tokens[lo..hi], None, None),
            b["block_hash_u64"].as_u64().unwrap()
        );
    }
}

#[test]
fn vllm_none_hash_matches() {
    use kvroute_core::hash::{HashAlgo, NoneHash};
    let d: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(golden::vectors_dir().join("vllm-0.33.0.json")).unwrap(),
    )
    .unwrap();
    for hv in d["hash_vectors"].as_array().unwrap() {
        let algo = HashAlgo::parse(hv["algo"].as_str().unwrap()).unwrap();
        let nh = NoneHash::new(algo, hv["PYTHONHASHSEED"].as_str()).unwrap();
        assert_eq!(
            hex::encode(nh.as_bytes()),
            hv["none_hash_hex"].as_str().unwrap(),
            "{algo}"
        );
    }
    assert!(
        NoneHash::new(HashAlgo::XxhashCbor, None).is_err(),
        "unseeded xxhash must be a configuration error"
    );
}
