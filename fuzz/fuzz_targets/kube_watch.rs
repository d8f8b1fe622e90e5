//! A Kubernetes API watch stream as the endpoint picker reads it (`--epp-pool`): bytes split into
//! lines across two chunks, each line decoded as a pod event and as an InferencePool event; the
//! pods' readiness, the pool's spec check and the rule's endpoints derived from them.
#![no_main]

use kvroute_inventory::epp::kube::{decode_event, Event, Lines};
use kvroute_inventory::epp::pool::{endpoints_for, InferencePool, Pod};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fuzz_target!(|data: &[u8]| {
    let cut = data.first().map_or(0, |&b| usize::from(b) % (data.len() + 1));
    let mut lines = Lines::default();
    let mut all = Vec::new();
    for chunk in [&data[..cut], &data[cut..]] {
        match lines.push(chunk) {
            Ok(l) => all.extend(l),
            Err(_) => return,
        }
    }
    let mut pods = Vec::new();
    for line in &all {
        assert!(!line.contains(&b'\n'), "a line holds no newline");
        if let Ok(Event::Added(p) | Event::Modified(p) | Event::Deleted(p)) =
            decode_event::<Pod>(line)
        {
            let _ = p.ready_ip();
            pods.push(p);
        }
        if let Ok(Event::Added(p) | Event::Modified(p)) = decode_event::<InferencePool>(line) {
            let _ = p.spec.problem();
        }
    }
    let ready: Vec<&Pod> = pods.iter().filter(|p| p.ready_ip().is_some()).collect();
    for mode in [1, 3] {
        let template = json!({"serviceArguments": {"kvExactMode": mode}});
        let eps = endpoints_for(&template, &[], &ready, &[8000, 8001]);
        let n = eps.as_array().map_or(0, Vec::len);
        assert!(n <= ready.len() * 2, "at most one endpoint per ready pod and port");
    }
});
