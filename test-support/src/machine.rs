//! What a benchmark report states about where it ran: the date and the CPU.

/// Today's date (UTC), as `date -u +%F` prints it; empty if `date` cannot run.
pub fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The CPU's model name from /proc/cpuinfo and the core count, e.g. `AMD EPYC 7B13, 2 cores`.
pub fn machine() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cores} cores")
}
