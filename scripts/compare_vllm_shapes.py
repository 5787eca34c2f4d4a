"""The JSON shape of galley's OpenAI answers next to vLLM's for the same requests: which fields each
sends, with which types (null included), streamed and not. Values are not compared (two engines, two
samplers); shapes are, because that is what a client's parser sees.

    python scripts/compare_vllm_shapes.py --galley http://127.0.0.1:8000 --vllm http://127.0.0.1:8001 --model demo

Start both on the same model folder first (vLLM as docs/testing.md says, with
--enable-prompt-tokens-details --enable-auto-tool-choice --tool-call-parser hermes to compare those
paths too). Prints, per request, the paths only one side sends and the paths whose types differ.
Loopback only; a few dozen small requests."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import httpx

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Hello there"}]
GREEDY = {"max_tokens": 6, "temperature": 0}


def requests(model: str) -> dict[str, tuple[str, str, dict | None]]:
    """name -> (method, path, body); a body with `stream` is read as SSE."""
    chat = {"model": model, "messages": MESSAGES, **GREEDY}
    text = {"model": model, "prompt": "The quick brown", **GREEDY}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    return {
        "models": ("GET", "/v1/models", None),
        "chat": ("POST", "/v1/chat/completions", chat),
        "chat logprobs": ("POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        "chat n=2": ("POST", "/v1/chat/completions", {**chat, "n": 2}),
        "chat stream": ("POST", "/v1/chat/completions", {**chat, "stream": True}),
        "chat stream usage+logprobs": ("POST", "/v1/chat/completions", {
            **chat, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}),
        "chat stream continuous usage": ("POST", "/v1/chat/completions", {
            **chat, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        "chat tools required": ("POST", "/v1/chat/completions", {
            **chat, "max_tokens": 60, "tools": TOOLS, "tool_choice": "required"}),
        "chat tools named": ("POST", "/v1/chat/completions", {
            **chat, "max_tokens": 60, "tools": TOOLS, "tool_choice": forced}),
        "chat tools named stream": ("POST", "/v1/chat/completions", {
            **chat, "max_tokens": 60, "tools": TOOLS, "tool_choice": forced, "stream": True}),
        "chat tools auto": ("POST", "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "auto"}),
        "chat json_schema": ("POST", "/v1/chat/completions", {**chat, "max_tokens": 20, "response_format": {
            "type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}}),
        "completion": ("POST", "/v1/completions", text),
        "completion logprobs": ("POST", "/v1/completions", {**text, "logprobs": 2}),
        "completion echo": ("POST", "/v1/completions", {**text, "echo": True}),
        "completion list": ("POST", "/v1/completions", {**text, "prompt": ["a", "b"]}),
        "completion stream usage+logprobs": ("POST", "/v1/completions", {
            **text, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 2}),
        "error 400": ("POST", "/v1/chat/completions", {**chat, "max_tokens": -1}),
        "error 404 model": ("POST", "/v1/chat/completions", {**chat, "model": "nope"}),
        "tokenize prompt": ("POST", "/tokenize", {"model": model, "prompt": "The quick brown"}),
        "tokenize messages": ("POST", "/tokenize", {"model": model, "messages": MESSAGES}),
        "detokenize": ("POST", "/detokenize", {"model": model, "tokens": [5, 6, 7]}),
        "responses": ("POST", "/v1/responses", {"model": model, "input": "Hello there", "max_output_tokens": 16,
                                                "temperature": 0}),
    }


def shape(value: Any, path: str, out: dict[str, set[str]]) -> None:
    """Every path in `value` with the JSON types seen there (list items share the path `[]`)."""
    if isinstance(value, dict):
        out[path].add("object")
        for key, item in value.items():
            shape(item, f"{path}.{key}", out)
    elif isinstance(value, list):
        out[path].add("array")
        for item in value:
            shape(item, f"{path}[]", out)
    else:
        out[path].add({bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}[type(value)])


def fetch(client: httpx.Client, base: str, method: str, path: str, body: dict | None) -> tuple[int, dict]:
    """(status, path -> types) of an answer, or of all of a stream's chunks together (`$` one chunk)."""
    out: dict[str, set[str]] = defaultdict(set)
    if body and body.get("stream"):
        with client.stream(method, base + path, json=body) as response:
            lines = [line for line in response.iter_lines() if line]
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                shape(json.loads(line[6:]), "$", out)
            elif line != "data: [DONE]" and not line.startswith("event: "):
                out[f"<line {line[:20]!r}>"].add("str")
        return response.status_code, out
    response = client.request(method, base + path, json=body)
    shape(response.json(), "$", out)
    return response.status_code, out


def compare(name: str, ours: tuple[int, dict], theirs: tuple[int, dict]) -> list[str]:
    (status_a, a), (status_b, b) = ours, theirs
    lines = [f"  status: galley {status_a}, vLLM {status_b}"] if status_a != status_b else []
    ignore = ("$.choices[].message.tool_calls[].function.arguments", )  # a JSON text either way
    for path in sorted(set(a) | set(b)):
        if path in ignore:
            continue
        if path not in b:
            lines.append(f"  only galley: {path} {sorted(a[path])}")
        elif path not in a:
            lines.append(f"  only vLLM:   {path} {sorted(b[path])}")
        elif a[path] != b[path]:
            lines.append(f"  types:       {path} galley {sorted(a[path])} vLLM {sorted(b[path])}")
    return [f"{name}:"] + (lines or ["  same shape"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--galley", required=True)
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--model", default="demo")
    args = parser.parse_args()
    with httpx.Client(timeout=120) as client:
        for name, (method, path, body) in requests(args.model).items():
            ours, theirs = (fetch(client, base.rstrip("/"), method, path, body) for base in (args.galley, args.vllm))
            print("\n".join(compare(name, ours, theirs)), flush=True)


if __name__ == "__main__":
    main()
