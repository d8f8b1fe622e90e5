#!/usr/bin/env python3
"""Writes the seed corpora fuzz/corpus/<target>/ from the repository's golden vectors and test
fixtures (shared/tests/vectors, shared/tests/fixtures) plus a few hand-built inputs.

Run from anywhere: python3 fuzz/make-corpus.py. Rewrites every seed file; files libFuzzer added
by hand-kept runs are left alone.
"""
import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "corpus"
VEC = ROOT / "shared" / "tests" / "vectors"
FIX = ROOT / "shared" / "tests" / "fixtures"


def write(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


def load(p):
    return json.loads(p.read_text())


# --- zmq_events: msgpack payload frames ---------------------------------------------------------
vllm = load(VEC / "vllm-0.33.0.json")
ev = vllm["events"]
write("zmq_events", "vllm-int-keys", bytes.fromhex(ev["int_keys_default"]["batch_payload_hex"]))
write("zmq_events", "vllm-bytes-keys", bytes.fromhex(ev["bytes_keys"]["batch_payload_hex"]))
write("zmq_events", "vllm-legacy-0.23", bytes.fromhex(vllm["legacy_events_0_23"]["batch_payload_hex"]))
mh = ev["minimal_handbuilt"]
write("zmq_events", "vllm-rank-none", bytes.fromhex(mh["payload_hex_data_parallel_rank_None"]))
write("zmq_events", "vllm-rank-3", bytes.fromhex(mh["payload_hex_data_parallel_rank_3"]))
sglang = load(VEC / "sglang-0.5.23.json")
for b in sglang["event_batches"]:
    write("zmq_events", "sglang-" + b["label"], bytes.fromhex(b["payload_hex"]))
write("zmq_events", "sglang-wire-capture", bytes.fromhex(sglang["zmq_wire_capture"]["frames"][2]))


# --- zmtp_stream: a publisher's ZMTP 3.0 stream (greeting, READY, messages) ------------------------


def zframe(flags, body):
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmessage(frames):
    return b"".join(zframe(1 if i + 1 < len(frames) else 0, f) for i, f in enumerate(frames))


def zgreeting(major=3, minor=1, mech=b"NULL"):
    return b"\xff" + b"\x00" * 7 + b"\x01\x7f" + bytes([major, minor]) + mech.ljust(20, b"\x00") + b"\x00" * 32


def zready(socket_type):
    props = bytes([11]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return zframe(4, bytes([5]) + b"READY" + props)


payload = bytes.fromhex(ev["int_keys_default"]["batch_payload_hex"])
stream = zgreeting() + zready(b"PUB") + zmessage([b"", struct.pack(">Q", 7), payload])
write("zmtp_stream", "vllm-pub", stream)
write("zmtp_stream", "xpub-ping-long", zgreeting() + zready(b"XPUB")
      + zframe(4, bytes([4]) + b"PING" + b"\x00\x0a" + b"ctx")
      + zmessage([b"kv", struct.pack(">Q", 8), payload * 4]))
write("zmtp_stream", "zmtp-2", zgreeting(2, 0))
write("zmtp_stream", "curve", zgreeting(mech=b"CURVE") + zready(b"PUB"))
write("zmtp_stream", "error", zgreeting() + zframe(4, bytes([5]) + b"ERROR" + bytes([6]) + b"denied"))

# --- trtllm_drain: /kv_cache_events bodies ------------------------------------------------------
def toks(a, b):
    return [{"token_id": t, "token_extra_id": 0} for t in range(a, b)]


write("trtllm_drain", "stored-removed", json.dumps([
    {"event_id": 1, "data": {"type": "stored", "parent_hash": None, "blocks": [
        {"block_hash": 111, "tokens": toks(0, 4), "cache_level": 0, "priority": 35},
        {"block_hash": 222, "tokens": toks(4, 8), "cache_level": 0, "priority": 35},
        {"block_hash": 333, "tokens": toks(8, 10), "cache_level": 0, "priority": 35}]}, "window_size": 32},
    {"event_id": 2, "data": {"type": "removed", "block_hashes": [222]}, "window_size": 32},
]))
write("trtllm_drain", "created-updated-child", json.dumps([
    {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [128, 0]}},
    {"event_id": 1, "data": {"type": "stored", "parent_hash": 111, "blocks": [
        {"block_hash": 444, "tokens": list(range(4)), "cache_level": 1, "lora_id": 7}]}},
    {"event_id": 2, "data": {"type": "updated", "block_hash": 444,
                             "cache_level": {"old_value": 1, "new_value": 0}}},
]))
write("trtllm_drain", "empty", "[]")


# --- replica_codec: log entries, batches, snapshots ---------------------------------------------
def keys(ks):
    return struct.pack("<I", len(ks)) + b"".join(struct.pack("<Q", k) for k in ks)


ops = (b"\x01O\x02\x00" + struct.pack("<QI", 41, 3)
       + b"s" + keys([1, 2, 3]) + b"r" + keys([2]) + b"c")
ops_noseq = b"\x01O\x00\x01" + struct.pack("<QI", 2**64 - 1, 1) + b"s" + keys([9])
decision = b"\x01D\x01\x01" + struct.pack("<I", 5000) + keys([7, 8])
snap_marker = b"\x01S\x03\x01"
write("replica_codec", "ops", ops)
write("replica_codec", "ops-no-seq", ops_noseq)
write("replica_codec", "decision", decision)
write("replica_codec", "snapshot-marker", snap_marker)
batch = b"\x01B" + struct.pack("<I", 3) + b"".join(
    struct.pack("<I", len(e)) + e for e in (ops, decision, snap_marker))
write("replica_codec", "batch", batch)
upto = b"1700000000000-3"
snapshot = (b"KVS1" + struct.pack("<Q", 1700000000123) + bytes([len(upto)]) + upto + b"\x02"
            + b"\x00" + struct.pack("<Q", 10) + keys([1, 2])
            + b"\x01" + struct.pack("<Q", 2**64 - 1) + keys([]))
write("replica_codec", "snapshot", snapshot)
write("replica_codec", "stream-id", "1700000000000-12")

# --- rule_json: the rule fixtures ---------------------------------------------------------------
for p in sorted((FIX / "rules").glob("*.json")):
    write("rule_json", p.stem, p.read_bytes())

# --- openai_body: completions and chat requests -------------------------------------------------
for fixture, prefix in (("qwen3-chat.json", "chat-"), ("qwen3-completions.json", "completion-")):
    for case in load(FIX / "chat" / fixture)["cases"]:
        body = json.dumps(case["request"], ensure_ascii=False).encode()
        if len(body) <= 2048:
            write("openai_body", prefix + case["name"], body)
for case in load(FIX / "chat" / "anthropic.json")["cases"]:
    body = json.dumps(case["request"], ensure_ascii=False).encode()
    if len(body) <= 2048:
        write("openai_body", "anthropic-" + case["name"], body)
write("openai_body", "media", json.dumps({"messages": [
    {"role": "system", "content": "You describe pictures."},
    {"role": "user", "content": [{"type": "text", "text": "what is it"},
                                 {"type": "image_url", "image_url": {"url": "data:,x"}},
                                 {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}))
write("openai_body", "token-ids", json.dumps({"model": "m", "prompt": [[1, 2, 3] * 12],
                                               "cache_salt": "s"}))
write("openai_body", "kwargs", json.dumps({
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}))

# --- route_question: the route question, JSON and binary -------------------------------------
def binary_question(head, keys):
    h = json.dumps(head, separators=(",", ":")).encode()
    return b"KVR1" + struct.pack("<I", len(h)) + h + b"".join(struct.pack("<Q", k) for k in keys)


write("route_question", "json", '{"rule":"10.0.0.1:8080","model":"m","keys":[1,-2,18446744073709551615],'
      '"token_count":48,"affinity_key":"user:a|chat|completions"}')
write("route_question", "json-offload", '{"rule":"1","messages":[{"role":"user","content":"hi"}]}')
write("route_question", "binary", binary_question({"rule": "1", "keys": [], "token_count": 32}, [7, 2**64 - 1]))
write("route_question", "binary-explain", binary_question({"rule": "10.0.0.1:8080", "explain": True}, [1, 2, 3]))
write("route_question", "binary-ragged", binary_question({"rule": "1"}, [5])[:-3])

# --- filter_answer: route answers and contracts -------------------------------------------------
write("filter_answer", "route", '{"rule_id":1,"endpoint":"127.0.0.1:9","matched_blocks":3,'
      '"tier":"tier15","reason":"hit","decode_endpoint":null}')
write("filter_answer", "route-pd", '{"endpoint":"[::1]:8000","tier":"gpu","decode_endpoint":"10.0.0.2:8001"}')
write("filter_answer", "contract", '{"rule_id":1,"name":"x","vip":"v","engine":"vllm","algo":"sha256_cbor",'
      '"seed":"0","block_size":16,"key_mode":"engine","model":"m","kv_exact_mode":3,"kv_enabled":true}')
write("filter_answer", "contract-tokens", '{"rule_id":2,"engine":"trtllm","algo":null,"block_size":32,'
      '"key_mode":"tokens","kv_enabled":true}')

# --- filter_config: plugin configurations -------------------------------------------------------
write("filter_config", "envoy-yaml", json.dumps({
    "rule": "10.0.0.1:8080", "inventory_cluster": "kvroute_inventory",
    "inventory_authority": "kvroute-inventory", "timeout_ms": 25, "max_body_bytes": 4194304,
    "pin_header": "x-kvroute-pin", "tokenize": "filter", "tokenizer": "inventory"}))
write("filter_config", "all-fields", json.dumps({
    "rule": "r", "tokenize": "service", "tokenizer": "none", "model": "m", "refresh_ms": 1000,
    "pin_mode": "filter_state", "segment_cache_bytes": 1048576, "segment_cache_entries": 64,
    "piece_cache_bytes": 65536, "piece_cache_entries": 1024, "key_cache_bytes": 1048576,
    "key_cache_entries": 4096}))
write("filter_config", "invalid", '{"timeout_ms":0,"max_body_bytes":1,"pin_header":"X Pin","rule":""}')
write("filter_config", "empty", "")


# --- kube_watch: Kubernetes API watch streams (pods, InferencePools) ----------------------------
def pod_event(kind, name, ip, ready, labels):
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return json.dumps({"type": kind, "object": {"kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": "101", "labels": labels},
        "status": status}})


write("kube_watch", "pods", "\n".join([
    pod_event("ADDED", "a", "10.1.0.1", True, {"app": "vllm", "llm-d.ai/role": "prefill"}),
    pod_event("MODIFIED", "b", "fd00::2", True, {"app": "vllm", "llm-d.ai/role": "decode"}),
    pod_event("DELETED", "c", "", False, {}),
    json.dumps({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "120"}}}),
]) + "\n")
write("kube_watch", "pool", json.dumps({"type": "ADDED", "object": {
    "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
    "metadata": {"name": "vllm", "namespace": "llm", "resourceVersion": "7"},
    "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
             "endpointPickerRef": {"name": "kvroute-epp", "port": {"number": 9002}}}}}) + "\n")
write("kube_watch", "expired", json.dumps({"type": "ERROR", "object": {"kind": "Status",
    "code": 410, "reason": "Expired", "message": "too old resource version"}}) + "\n")
