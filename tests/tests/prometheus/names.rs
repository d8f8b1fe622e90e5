//! Metric names in PromQL, in text expositions, in the code and in the shipped rules and dashboard.

use std::collections::BTreeSet;
use std::path::PathBuf;

use kvroute_tests::harness;
use serde_json::Value;

pub fn deploy_dir() -> PathBuf {
    harness::repo_root().join("deploy")
}

const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];
/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
const KEYWORDS: &[&str] = &["bool", "and", "or", "unless", "offset", "inf", "nan"];

/// The metric names a PromQL expression selects: identifiers outside strings, label matchers
/// (`{...}`) and ranges (`[...]`) that are not functions, aggregations, keywords or label lists.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut skip_list = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    i += 1;
                }
                i += 1;
            }
            '(' if skip_list => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                skip_list = false;
            }
            c if c.is_ascii_digit() || c == '.' || c == '$' => {
                // A number, a duration (offset 5m) or a dashboard variable.
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '.' | '_' | '$'))
                {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = chars[i..].iter().find(|c| !c.is_whitespace());
                let lower = word.to_ascii_lowercase();
                if LABEL_LISTS.contains(&lower.as_str()) {
                    skip_list = true;
                } else if next != Some(&'(')
                    && !AGGREGATIONS.contains(&lower.as_str())
                    && !KEYWORDS.contains(&lower.as_str())
                {
                    names.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// One sample line of an exposition: name and labels.
pub fn parse_sample(line: &str) -> Option<(String, Vec<(String, String)>)> {
    let end = line.find(['{', ' '])?;
    let name = line[..end].to_owned();
    let mut labels = Vec::new();
    if line[end..].starts_with('{') {
        let body: Vec<char> = line[end + 1..].chars().collect();
        let mut i = 0;
        while i < body.len() && body[i] != '}' {
            let start = i;
            while i < body.len() && body[i] != '=' {
                i += 1;
            }
            let key: String = body[start..i].iter().collect();
            i += 2; // `="`
            let mut value = String::new();
            while i < body.len() && body[i] != '"' {
                if body[i] == '\\' {
                    i += 1;
                }
                value.extend(body.get(i));
                i += 1;
            }
            i += 1; // closing quote
            if body.get(i) == Some(&',') {
                i += 1;
            }
            labels.push((key.trim().to_owned(), value));
        }
    }
    Some((name, labels))
}

/// Every `kvroute_*` sample of an exposition, as (name, labels).
pub fn kvroute_samples(text: &str) -> Vec<(String, Vec<(String, String)>)> {
    text.lines()
        .filter(|l| l.starts_with("kvroute_"))
        .filter_map(parse_sample)
        .collect()
}

/// Metric names the code defines as string literals (`"kvroute_..."`).
pub fn code_names() -> BTreeSet<String> {
    let root = harness::repo_root();
    let mut names = BTreeSet::new();
    for f in ["inventory-svc/src/metrics.rs", "filter/src/stats.rs"] {
        let text = std::fs::read_to_string(root.join(f)).unwrap();
        for piece in text.split('"').skip(1).step_by(2) {
            if piece.starts_with("kvroute_")
                && piece.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                names.insert(piece.to_owned());
            }
        }
    }
    names
}

/// The rule files of deploy/prometheus (not its tests).
pub fn rule_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join("prometheus"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

/// Every rule of the shipped files, as YAML mappings.
pub fn rules() -> Vec<serde_yaml::Value> {
    let mut out = Vec::new();
    for f in rule_files() {
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        for g in doc["groups"].as_sequence().unwrap() {
            out.extend(g["rules"].as_sequence().unwrap().iter().cloned());
        }
    }
    out
}

pub fn recorded_names() -> BTreeSet<String> {
    rules()
        .iter()
        .filter_map(|r| r["record"].as_str().map(str::to_owned))
        .collect()
}

/// Every `expr` in the dashboard (panel targets, at any depth).
pub fn dashboard_exprs() -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x) {
                        ("expr", Value::String(s)) => out.push(s.clone()),
                        _ => walk(x, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(deploy_dir().join("grafana/kvroute.json")).unwrap();
    let dash: Value = serde_json::from_str(&text).expect("kvroute.json is not valid JSON");
    let mut out = Vec::new();
    walk(&dash, &mut out);
    out
}

#[test]
pub fn metric_names_are_extracted_from_promql() {
    let got = metric_names(
        r#"sum by (job, instance) (rate(kvroute_a_total{reason!="x y"}[5m])) / on (job) group_left (tier)
           max without (le) (kvroute:b:rate5m offset 5m) > 0.05 and bool histogram_quantile(0.99,
           rate(c_bucket[$__rate_interval])) unless vllm:prefix_cache_hits_total"#,
    );
    let want: BTreeSet<String> = [
        "kvroute_a_total",
        "kvroute:b:rate5m",
        "c_bucket",
        "vllm:prefix_cache_hits_total",
    ]
    .map(str::to_owned)
    .into();
    assert_eq!(got, want);
}
