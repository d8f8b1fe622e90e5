//! What several fuzz targets share.

use std::sync::{Arc, OnceLock};

use kvroute_inventory::metrics::Metrics;

/// One metrics registry for the whole fuzzing process (a keyer counts into it; creating a
/// registry per input would dominate each run).
pub fn metrics() -> Arc<Metrics> {
    static M: OnceLock<Arc<Metrics>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Metrics::new().expect("metrics registry")))
        .clone()
}
