//! `GET /openapi.json` against the checked-in `docs/openapi.json`, an OpenAPI validator and the
//! router: the served document equals the file byte for byte, validates as OpenAPI 3, and lists
//! exactly the routes (path and methods) `src/api/mod.rs` builds the router from.
//!
//! Regenerate the file: `KVROUTE_WRITE_OPENAPI=1 cargo test -p kvroute-inventory --test openapi`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

const METHODS: &[&str] = &[
    "get", "post", "put", "delete", "patch", "head", "options", "trace",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn checked_in() -> PathBuf {
    repo().join("docs/openapi.json")
}

/// `(path, method)` of every `.route(PATH, method(handler)...)` call in the router's source.
fn router_routes() -> BTreeSet<(String, String)> {
    let src = std::fs::read_to_string(repo().join("inventory-svc/src/api/mod.rs")).unwrap();
    let body = &src[src.find("pub fn router(").expect("router fn")..];
    let body = &body[..body.find("\n}\n").expect("end of router fn")];
    let mut out = BTreeSet::new();
    for (at, _) in body.match_indices(".route(") {
        let rest = &body[at + ".route(".len()..];
        // The call's text up to its closing parenthesis (paths hold no parentheses).
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map(|(i, _)| i)
            .expect("closing parenthesis of .route(");
        let call = &rest[..end];
        let q0 = call.find('"').expect("path literal");
        let q1 = q0 + 1 + call[q0 + 1..].find('"').expect("end of path literal");
        let path = &call[q0 + 1..q1];
        let handlers = &call[q1 + 1..];
        let mut found = 0;
        for m in METHODS {
            for (i, _) in handlers.match_indices(&format!("{m}(")) {
                let before = handlers[..i].chars().last();
                // `get(h)`, `routing::get(h)` and chained `get(h).post(h)`, not `forget(`.
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                out.insert((path.to_string(), m.to_string()));
                found += 1;
            }
        }
        assert!(found > 0, "route {path}: no method router in {call:?}");
    }
    assert!(out.len() >= 10, "parsed too few routes: {out:?}");
    out
}

fn document_routes(doc: &Value) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths object") {
        for m in METHODS {
            if item.get(*m).is_some() {
                out.insert((path.clone(), m.to_string()));
            }
        }
    }
    out
}

fn validator() -> PathBuf {
    let cache = std::env::var_os("KVROUTE_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache"));
    let v = cache.join("openapi-validator-venv/bin/openapi-spec-validator");
    assert!(
        v.is_file(),
        "{} missing: run ./scripts/setup.sh (it installs openapi-spec-validator into .cache/openapi-validator-venv)",
        v.display()
    );
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_document_is_checked_in_valid_and_lists_every_route() {
    let mut svc = Service::start("openapi", &json!([]), &[]);
    // Unauthenticated.
    let r = svc.call(Method::GET, "/openapi.json", None).await;
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        r.headers()["content-type"].to_str().unwrap(),
        "application/json"
    );
    let served = r.text().await.unwrap();
    svc.terminate();

    // (1) The checked-in file is the served document.
    if std::env::var_os("KVROUTE_WRITE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(checked_in(), &served).unwrap();
    }
    let file = std::fs::read_to_string(checked_in()).unwrap_or_default();
    assert!(
        file == served,
        "docs/openapi.json differs from GET /openapi.json; regenerate it with \
         KVROUTE_WRITE_OPENAPI=1 cargo test -p kvroute-inventory --test openapi"
    );

    // (2) It validates as OpenAPI 3.
    let out = Command::new(validator())
        .arg(checked_in())
        .output()
        .unwrap();
    assert_success(&out, "openapi-spec-validator rejected docs/openapi.json");

    // (3) Exactly the router's routes and methods.
    let doc: Value = serde_json::from_str(&served).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let want = router_routes();
    let got = document_routes(&doc);
    assert_eq!(
        got.difference(&want).collect::<Vec<_>>(),
        Vec::<&(String, String)>::new(),
        "in the document, not in the router"
    );
    assert_eq!(
        want.difference(&got).collect::<Vec<_>>(),
        Vec::<&(String, String)>::new(),
        "in the router, not in the document"
    );

    // Security: bearer on the writes and the tenants, optional bearer on the filter's posts, none
    // on the other reads.
    let schemes = &doc["components"]["securitySchemes"];
    for s in ["management_token", "route_token"] {
        assert_eq!(schemes[s]["type"], "http", "{s}");
        assert_eq!(schemes[s]["scheme"], "bearer", "{s}");
    }
    let security = |path: &str, m: &str| doc["paths"][path][m]["security"].clone();
    for path in ["/v1/route", "/v1/rules/{id}/outcomes"] {
        assert_eq!(
            security(path, "post"),
            json!([{}, {"route_token": []}]),
            "{path}"
        );
    }
    assert_eq!(
        security("/netlox/v1/config/loadbalancer", "post"),
        json!([{"management_token": []}])
    );
    assert_eq!(
        security(
            "/netlox/v1/config/loadbalancer/externalipaddress/{ip}/port/{port}/protocol/{proto}",
            "delete"
        ),
        json!([{"management_token": []}])
    );
    // The tenants are named: their list needs the management token too.
    assert_eq!(
        security("/v1/rules/{id}/tenants", "get"),
        json!([{"management_token": []}])
    );
    for (path, m) in &want {
        let op = &doc["paths"][path][m];
        if !(path == "/v1/route"
            || path == "/v1/rules/{id}/outcomes"
            || path == "/v1/rules/{id}/tenants"
            || path.starts_with("/netlox/v1/config/loadbalancer") && m != "get")
        {
            assert!(op.get("security").is_none(), "{m} {path} is open");
        }
        // Every 4xx/5xx answer with a JSON body is the ApiError body.
        for (status, resp) in op["responses"].as_object().unwrap() {
            if status.starts_with('4') || status.starts_with('5') {
                if let Some(schema) = resp["content"]["application/json"]["schema"].as_object() {
                    assert_eq!(
                        schema["$ref"], "#/components/schemas/ErrorBody",
                        "{m} {path} {status}"
                    );
                }
            }
        }
    }
    // The rule body is kvroute-core's rule model.
    assert_eq!(
        doc["paths"]["/netlox/v1/config/loadbalancer"]["post"]["requestBody"]["content"]
            ["application/json"]["schema"]["$ref"],
        "#/components/schemas/RawRule"
    );
}

/// Checks each `(schema name, instance)` against the served document's component schemas with
/// the validator venv's OpenAPI 3.1 schema validator.
fn check_instances(dir: &std::path::Path, doc: &str, pairs: &[(&str, Value)]) {
    let doc_file = dir.join("openapi.json");
    std::fs::write(&doc_file, doc).unwrap();
    let file = dir.join("instances.json");
    std::fs::write(&file, serde_json::to_string(pairs).unwrap()).unwrap();
    let python = validator().with_file_name("python");
    let script = r##"
import json, sys
from openapi_schema_validator import OAS31Validator
doc = json.load(open(sys.argv[1]))
bad = []
for name, inst in json.load(open(sys.argv[2])):
    schema = {"$ref": "#/components/schemas/" + name, "components": doc["components"]}
    errs = [f"{list(e.absolute_path)}: {e.message}" for e in OAS31Validator(schema).iter_errors(inst)]
    if errs:
        bad.append(f"{name}: {errs[:3]} in {json.dumps(inst)[:300]}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
"##;
    let out = Command::new(python)
        .args(["-c", script])
        .arg(&doc_file)
        .arg(&file)
        .output()
        .unwrap();
    assert_success(&out, "answers that do not match their schemas");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_answers_match_their_schemas() {
    let eps = [("127.0.0.1".to_string(), 1), ("127.0.0.2".to_string(), 1)];
    let installed = rule(
        18080,
        "vllm",
        5557,
        &eps,
        json!({"kvModel": "Qwen/Qwen3-0.6B"}),
    );
    let mut svc = Service::start("openapi-live", &json!([installed.clone()]), &[]);
    let mut pairs: Vec<(&str, Value)> = vec![("RawRule", installed)];

    let contracts = svc.get_json("/v1/rules").await;
    let id = contracts["rules"][0]["rule_id"].as_u64().unwrap();
    pairs.push(("RuleContracts", contracts));
    pairs.push((
        "RuleContract",
        svc.get_json(&format!("/v1/rules/{id}/contract")).await,
    ));
    pairs.push((
        "RuleList",
        svc.get_json("/netlox/v1/config/loadbalancer/all").await,
    ));
    pairs.push(("Health", svc.get_json("/healthz").await));
    pairs.push((
        "InventoryPage",
        svc.get_json(&format!(
            "/netlox/v1/config/ai/kv/inventory?service_id={id}&ep_idx=0"
        ))
        .await,
    ));

    let ask = json!({"rule": id.to_string(), "keys": [1, -2, u64::MAX], "token_count": 48, "affinity_key": "t"});
    let (status, answer) = svc.post("/v1/route", &ask.to_string(), None).await;
    assert_eq!(status, 200, "{answer}");
    pairs.push(("RouteRequest", ask));
    pairs.push(("RouteResponse", answer));

    let added = rule(18081, "sglang", 5600, &eps, json!({}));
    let lb = "/netlox/v1/config/loadbalancer";
    let (status, body) = svc.post(lb, &added.to_string(), Some(TOKEN)).await;
    assert_eq!(status, 200, "{body}");
    pairs.push(("RuleAdded", body));
    let gone = format!("{lb}/externalipaddress/10.0.0.1/port/18081/protocol/tcp");
    let r = svc.call(Method::DELETE, &gone, Some(TOKEN)).await;
    assert_eq!(r.status().as_u16(), 200);
    pairs.push(("RuleDeleted", r.json().await.unwrap()));

    // Error answers: unknown rule, invalid rule (with problems), no token.
    let (status, body) = svc.get("/v1/rules/nope/contract").await;
    assert_eq!(status, 404);
    pairs.push(("ErrorBody", serde_json::from_str(&body).unwrap()));
    let bad = json!({"serviceArguments": {"externalIP": "x", "port": 0}});
    let (status, body) = svc.post(lb, &bad.to_string(), Some(TOKEN)).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["problems"].is_array(), "{body}");
    pairs.push(("ErrorBody", body));
    let (status, body) = svc.post(lb, &bad.to_string(), None).await;
    assert_eq!(status, 401);
    pairs.push(("ErrorBody", body));

    let (status, doc) = svc.get("/openapi.json").await;
    assert_eq!(status, 200);
    let dir = svc.dir.clone();
    svc.terminate();
    check_instances(&dir, &doc, &pairs);
}

/// Asserts that a checker exited 0; otherwise fails with `what` and everything it printed.
#[track_caller]
fn assert_success(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
