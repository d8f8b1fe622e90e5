//! Endpoint cache capacity from an engine's `/metrics`: vLLM's `vllm:cache_config_info` info
//! gauge carries `num_gpu_blocks` as a label (one series per engine core; data-parallel ranks
//! each hold their own cache, so the series are summed).

/// The series whose `num_gpu_blocks` label is read.
const INFO_SERIES: &str = "vllm:cache_config_info";

/// Total `num_gpu_blocks` over every `vllm:cache_config_info` series; `None` if absent.
pub fn parse_num_gpu_blocks(text: &str) -> Option<u64> {
    let mut total: Option<u64> = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(INFO_SERIES) else {
            continue;
        };
        if !rest.starts_with('{') {
            continue;
        }
        let Some(v) = rest.split("num_gpu_blocks=\"").nth(1) else {
            continue;
        };
        let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse::<u64>() {
            total = Some(total.unwrap_or(0).saturating_add(n));
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_cache_config_info() {
        let t = "# HELP vllm:cache_config_info x\n# TYPE vllm:cache_config_info gauge\n\
                 vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"256\",prefix_caching_hash_algo=\"sha256_cbor\"} 1.0\n";
        assert_eq!(parse_num_gpu_blocks(t), Some(256));
        let two = format!("{t}{}", t.replace("engine=\"0\"", "engine=\"1\""));
        assert_eq!(parse_num_gpu_blocks(&two), Some(512));
        assert_eq!(parse_num_gpu_blocks("vllm:num_requests_running 1\n"), None);
        assert_eq!(
            parse_num_gpu_blocks("vllm:cache_config_info{num_gpu_blocks=\"None\"} 1\n"),
            None
        );
    }
}
