#!/usr/bin/env python3
"""Generate kvroute-core's Anthropic Messages fixtures from vLLM's own conversion code.

vLLM serves `POST /v1/messages` by converting the Anthropic request into a chat completions request
(`AnthropicServingMessages._convert_anthropic_to_openai_request`, vllm/entrypoints/anthropic/
serving.py) and then rendering that like any chat request. This script runs that conversion from
the installed vLLM itself, with `merge_inline_system=True` (what vLLM uses when it serves the
model's own chat template, i.e. without `--chat-template`), and records for each case:
  * the converted `messages` and the tools as vLLM dumps them for the template (`model_dump()`);
  * for text-only cases, the rendered prompt and its ids, through the same reference steps as
    scripts/gen-chat-fixtures.py (its conversation preparation, HF `apply_chat_template`, HF
    `tokenizers`).

Run it with the vLLM that scripts/setup-vllm.sh installs (it has transformers and tokenizers):
    ./scripts/setup-vllm.sh
    .cache/vllm-venv/bin/python scripts/gen-anthropic-fixtures.py [--tokenizer-dir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
NO_TYPE = {"name": "lookup", "input_schema": {"properties": {"q": {"type": "string"}}}}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def cases() -> list[dict]:
    """Anthropic request bodies covering each conversion rule (model and max_tokens added)."""
    system_blocks = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=ab12"},
        {"type": "text", "text": "You are a coding agent. ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Answer briefly."},
    ]
    out = [
        ("system_string", {"system": "You are helpful.", "messages": [{"role": "user", "content": "Hi there"}]}),
        ("no_system", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]}),
        ("system_blocks_billing_header_and_cache_control", {"system": system_blocks, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug.", "cache_control": {"type": "ephemeral"}}]}]}),
        ("user_text_blocks", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "First part."}, {"type": "text", "text": ""}, {"type": "text", "text": "Second part."}]}]}),
        ("thinking_and_text", {"system": "Think first.", "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Add them.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "4"}]},
            {"role": "user", "content": "And 3+3?"}]}),
        ("thinking_only", {"messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "s"}]},
            {"role": "user", "content": "Continue"}]}),
        ("tool_use_and_result", {"system": "Use tools.", "tools": [WEATHER, NO_TYPE], "tool_choice": {"type": "any"}, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "units": "c"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 degrees, sunny"}]},
            {"role": "assistant", "content": "It is 18 degrees and sunny."},
            {"role": "user", "content": "Thanks"}]}),
        ("tool_result_blocks_and_text", {"tools": [WEATHER], "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_02", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_02", "content": [
                    {"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]},
                {"type": "text", "text": "Summarize it."}]}]}),
        ("tool_result_with_image", {"messages": [
            {"role": "user", "content": "Screenshot?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_03", "name": "shot", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_03", "content": [
                    {"type": "text", "text": "taken"}, {"type": "image", "source": PNG}]}]}]}),
        ("assistant_tool_result_string", {"messages": [
            {"role": "user", "content": "Run it"},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "done"}]},
            {"role": "user", "content": "ok"}]}),
        ("inline_system_merged", {"system": "Top. ", "messages": [
            {"role": "user", "content": "One"},
            {"role": "system", "content": "Inline."},
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: z"}, {"type": "text", "text": " Blocks."}]},
            {"role": "user", "content": "Two"}]}),
        ("images_base64_and_url", {"messages": [{"role": "user", "content": [
            {"type": "image", "source": PNG},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
            {"type": "text", "text": "Compare these."}]}]}),
        ("salt_kwargs_stream", {"system": "Be terse.", "cache_salt": "tenant-salt-0123456789", "stream": True,
                                "chat_template_kwargs": {"enable_thinking": False},
                                "messages": [{"role": "user", "content": "Hello"}]}),
    ]
    return [{"name": n, "request": {"model": "Qwen/Qwen3-0.6B", "max_tokens": 64, **body}} for n, body in out]


def load_chat_fixture_module():
    spec = importlib.util.spec_from_file_location("gen_chat_fixtures", REPO / "scripts/gen-chat-fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_dir = os.environ.get("KVROUTE_TOKENIZER_DIR") or str(REPO / ".cache/fixtures/qwen3")
    parser.add_argument("--tokenizer-dir", default=default_dir)
    parser.add_argument("--out", default=str(REPO / "shared/tests/fixtures/chat/anthropic.json"))
    args = parser.parse_args()

    import tokenizers
    import transformers
    import vllm
    from transformers import AutoTokenizer
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    chat = load_chat_fixture_module()
    tok_dir = Path(args.tokenizer_dir)
    tok_json = tok_dir / "tokenizer.json"
    if not tok_json.is_file():
        print(f"tokenizer fixture missing in {tok_dir}: run ./scripts/setup.sh", file=sys.stderr)
        return 1
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    raw = tokenizers.Tokenizer.from_file(str(tok_json))

    out = []
    for case in cases():
        body = case["request"]
        req = AnthropicServingMessages._convert_anthropic_to_openai_request(
            AnthropicMessagesRequest.model_validate(copy.deepcopy(body)), merge_inline_system=True
        )
        messages = [dict(m) for m in req.messages]
        tools = None if req.tools is None else [t.model_dump() for t in req.tools]
        entry = {**case, "messages": messages, "tools": tools}
        try:
            conversation = chat.to_vllm_conversation(messages)
        except ValueError:
            conversation = None  # media: the rendering is covered by the media tests
        if conversation is not None:
            kwargs = dict(req.chat_template_kwargs or {})
            text = hf.apply_chat_template(
                copy.deepcopy(conversation),
                tools=copy.deepcopy(tools),
                add_generation_prompt=req.add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
            entry["expected_text"] = text
            entry["expected_ids"] = raw.encode(text, add_special_tokens=False).ids
        out.append(entry)

    doc = {
        "generator": "scripts/gen-anthropic-fixtures.py",
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "tokenizer_json_sha256": hashlib.sha256(tok_json.read_bytes()).hexdigest(),
        "merge_inline_system": True,
        "cases": out,
    }
    Path(args.out).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(out)} Anthropic cases to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
