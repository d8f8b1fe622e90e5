//! The service's module layering, checked from its own source: which top-level module (a folder
//! under `src/` or a file directly in it) may name which through `crate::` paths, and that no
//! import circle spans more than one of them. docs/architecture.md draws the same table.
//!
//! Unit tests (`#[cfg(test)] mod tests`) are left out: they may reach anywhere.

#![allow(clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module and the modules it may use. Everything not listed may use nothing of the crate.
const ALLOWED: &[(&str, &[&str])] = &[
    ("sync", &[]),
    ("settings", &[]),
    ("metrics", &[]),
    ("index", &[]),
    ("preflight", &["ingest"]),
    ("rules", &["index", "settings"]),
    ("score", &["index", "rules", "settings", "sync"]),
    ("offload", &["sync"]),
    (
        "fleet",
        &[
            "index", "metrics", "offload", "rules", "score", "settings", "sync",
        ],
    ),
    (
        "ingest",
        &["fleet", "index", "metrics", "rules", "settings", "sync"],
    ),
    ("health", &["fleet", "index", "score", "settings"]),
    (
        "replica",
        &[
            "fleet", "index", "metrics", "rules", "score", "settings", "sync",
        ],
    ),
    ("question", &["fleet", "offload"]),
    ("canary", &["fleet", "index", "ingest", "offload"]),
    ("api", &["fleet", "index", "offload", "question", "rules"]),
    ("epp", &["fleet", "metrics", "offload", "question", "rules"]),
    ("listener", &["metrics", "settings"]),
    ("tls", &["listener"]),
    ("cli", &["settings"]),
    (
        "server",
        &[
            "api", "canary", "epp", "fleet", "health", "ingest", "listener", "metrics", "replica",
            "rules", "settings", "tls",
        ],
    ),
    ("lib", &[]),
    ("main", &["cli", "server", "settings", "preflight", "rules"]),
];

/// The top-level module of a source file: its folder under `src/`, or its file stem.
fn unit_of(rel: &Path) -> String {
    let first = rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned());
    let first = first.unwrap_or_default();
    first.strip_suffix(".rs").unwrap_or(&first).to_owned()
}

/// The modules a file names through `crate::` in code (not comments), outside its unit tests.
fn used(src: &str) -> BTreeSet<String> {
    let code = match src.find("#[cfg(test)]\nmod tests") {
        Some(i) => &src[..i],
        None => src,
    };
    let code: String = code
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let code = code.as_str();
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // `kvroute_core::...` and other crates' paths end in `_crate::` only by accident.
        let before = rest[..i].chars().next_back();
        if !name.is_empty() && !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            out.insert(name);
        }
        rest = after;
    }
    out
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(&root).expect("under src");
            let unit = unit_of(rel);
            let src = std::fs::read_to_string(&path).expect("source is readable");
            let deps = g.entry(unit.clone()).or_default();
            deps.extend(used(&src).into_iter().filter(|d| *d != unit));
        }
    }
    g
}

#[test]
fn every_module_uses_only_the_layers_below_it() {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(m, deps)| (*m, deps.iter().copied().collect()))
        .collect();
    let mut problems = Vec::new();
    for (unit, deps) in graph() {
        let Some(ok) = allowed.get(unit.as_str()) else {
            problems.push(format!("module {unit} is not in the layer table: add it"));
            continue;
        };
        for d in deps {
            if !ok.contains(d.as_str()) {
                problems.push(format!("{unit} uses crate::{d} (allowed: {ok:?})"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "layering broken:\n{}",
        problems.join("\n")
    );
}

#[test]
fn no_import_circle_spans_two_modules() {
    let g = graph();
    // Depth-first search for a back edge; reports the circle it closes.
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_owned());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_owned());
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    for n in g.keys() {
        if let Some(c) = visit(n, &g, &mut Vec::new(), &mut done) {
            panic!("import circle: {}", c.join(" -> "));
        }
    }
}

#[test]
fn the_checker_sees_crate_paths() {
    let u = used("use crate::fleet::Fleet;\n/// see [`crate::replica`]\nlet x = kvroute_core::x; crate::api::router(s);\n#[cfg(test)]\nmod tests { use crate::server; }");
    assert_eq!(u, ["api", "fleet"].iter().map(|s| s.to_string()).collect());
}
