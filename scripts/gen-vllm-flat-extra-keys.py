#!/usr/bin/env python3
"""Golden vectors of vLLM's flat extra-keys layout (before 0.31), from the engine's own code.

Run with the interpreter of the vLLM CPU engine (scripts/setup-vllm.sh installs vLLM 0.28.0):

    PYTHONHASHSEED=0 .cache/vllm-venv/bin/python scripts/gen-vllm-flat-extra-keys.py \
        shared/tests/vectors/vllm-0.28.0-flat-extra-keys.json

(vLLM logs to standard output, so the vectors go to the file named.)

Each case hashes the token ids range(40) (block 16: two full blocks) with vLLM's
hash_block_tokens and sha256_cbor, passing the extra keys exactly as vLLM 0.28's
generate_block_hash_extra_keys builds them: the LoRA adapter's name on every block, then the
cache salt on block 0 only. The key is the digest's last 8 bytes, as vLLM publishes it.
"""

import json
import os
import sys

import vllm
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as kcu


def keys(tokens, block, lora_name, salt):
    kcu.init_none_hash(sha256_cbor)
    parent = None
    out = []
    for i in range(len(tokens) // block):
        extra = ([lora_name] if lora_name else []) + ([salt] if salt and i == 0 else [])
        h = kcu.hash_block_tokens(
            sha256_cbor, parent, tokens[i * block:(i + 1) * block], tuple(extra) or None
        )
        parent = h
        out.append(int.from_bytes(bytes(h)[-8:], "big"))
    return out


def main():
    if os.environ.get("PYTHONHASHSEED") != "0":
        sys.exit("run with PYTHONHASHSEED=0")
    if len(sys.argv) != 2:
        sys.exit("usage: gen-vllm-flat-extra-keys.py OUT.json")
    tokens = list(range(40))
    cases = []
    for name, lora, salt in [
        ("none", None, None),
        ("salt", None, "tenant-a"),
        ("lora", "sql-lora", None),
        ("lora_and_salt", "sql-lora", "tenant-a"),
    ]:
        cases.append({
            "case": name,
            "lora_name": lora,
            "cache_salt": salt,
            "tokens": tokens,
            "keys": keys(tokens, 16, lora, salt),
        })
    doc = {
        "generator": "scripts/gen-vllm-flat-extra-keys.py",
        "vllm_version": vllm.__version__,
        "algo": "sha256_cbor",
        "PYTHONHASHSEED": "0",
        "block_size": 16,
        "extra_layout": "flat",
        "cases": cases,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
