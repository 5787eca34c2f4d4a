"""Tool calling below HTTP: the output parsers (streamed == collected, for every format), format
detection, prompts for templates that know no tools, and forced calls through the real engine
(a tiny random model's call always names an allowed function and its arguments validate)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from engine.types import SamplingParams
from services.answers.tool_parser import ToolCallParser, assemble, parse_all
from services.inference.tools import ToolUse, detect_format, forced_grammar, hermes_messages
from tests.engine.test_guided import run_requests, text_of

PARSED = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}\n'
               '</tool_call>\n<tool_call>\n{"name": "f2", "arguments": {}}\n</tool_call>',
     "Sure.", [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("f2", "{}")]),
    ("hermes", "Just text with a < sign and <tool no call", "Just text with a < sign and <tool no call", []),
    ("hermes", '<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call>', None, [("late", '{"x": 1}')]),
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"x": "ab', None, [("cut", '{"x": "ab')]),
    ("llama3_json", '{"name": "w", "parameters": {"city": "Paris"}}; {"name": "g", "parameters": {"q": "x;y"}}',
     None, [("w", '{"city": "Paris"}'), ("g", '{"q": "x;y"}')]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ("llama3_json", "Hello {there}", "Hello {there}", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "b"}}, {"name": "g", "arguments": 1}]',
     "Let me check.", [("f", '{"a": "b"}'), ("g", "1")]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b": [2]}', None,
     [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
    ("mistral", "no calls [TOOL here", "no calls [TOOL here", []),
]


def calls_of(parsed) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), PARSED)
def test_streamed_pieces_assemble_to_the_collected_answer(fmt, text, content, calls):
    whole = parse_all(fmt, text)
    assert (whole.content, calls_of(whole)) == (content, calls)
    assert len({c["id"] for c in whole.tool_calls}) == len(calls)
    for seed in range(6):
        rng, parser, deltas, i = random.Random(seed), ToolCallParser(fmt), [], 0
        while i < len(text):
            size = rng.randint(1, 5)
            deltas.append(parser.feed(text[i:i + size]))
            i += size
        deltas.append(parser.finish())
        streamed = assemble(deltas)
        assert (streamed.content, calls_of(streamed)) == (content, calls)


def test_formats_are_detected_from_the_chat_template():
    assert detect_format("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert detect_format("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]") == "mistral"
    assert detect_format('<|start_header_id|>ipython<|end_header_id|> {"name": ..., "parameters": ...}') \
        == "llama3_json"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert detect_format(None) == "hermes"


def test_a_template_without_tools_gets_them_as_hermes_text():
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    out = hermes_messages(messages, tools)
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "units": {"enum": ["metric", "imperial"]},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
}, "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20},
                                           "filters": {"type": "object", "properties": {
                                               "site": {"type": "string", "maxLength": 10}},
                                               "additionalProperties": False}},
          "required": ["query"], "additionalProperties": False}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}})


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "search"])
def test_forced_calls_from_a_tiny_random_model_validate(llama_path, fmt, choice):
    from tests.helpers import make_engine

    use = ToolUse(TOOLS, choice, parallel=choice == "required")
    params = SamplingParams(max_tokens=1500, temperature=0.0, guided=forced_grammar(use, fmt))
    engine = make_engine(llama_path)
    prompts = [[5, 6, 7], list(range(20, 45)), [9]]
    results = run_requests(engine, [(p, params) for p in prompts])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for tokens, finish in results.values():
        parsed = parse_all(fmt, text_of(engine, tokens))
        assert finish == "stop" and parsed.tool_calls and parsed.content is None, text_of(engine, tokens)
        for call in parsed.tool_calls:
            name = call["function"]["name"]
            assert name == choice or (choice == "required" and name in schemas)
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_a_configured_tool_parser_overrides_detection(llama_path):
    from transformers import AutoTokenizer

    from services.deployments.options import check_options
    from services.inference.tools import prompt_with_tools

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_with_tools(tokenizer, messages, ToolUse(TOOLS)).format == "hermes"  # ChatML: nothing to detect
    assert prompt_with_tools(tokenizer, messages, ToolUse(TOOLS), "llama3_json").format == "llama3_json"
    assert prompt_with_tools(tokenizer, messages, ToolUse(TOOLS, "none"), "mistral").format is None
    assert check_options({"tool_parser": "mistral"}) == {"tool_parser": "mistral"}
    with pytest.raises(ValueError, match="tool_parser"):
        check_options({"tool_parser": "qwen"})
