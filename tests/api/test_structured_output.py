"""Structured output and tool calling through the real openai SDK against the real app on the tiny
random model: `parse()` with a pydantic model, `response_format` both kinds, vLLM's `guided_*`,
tools `auto` / `required` / named, streamed calls (their deltas put together equal the collected
call), history with calls and results, and 400s in OpenAI's error shape for what cannot be done."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, Field

from tests.api.test_api import client, start_server, wait_blocks_free
from tests.helpers import long_context_copy

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "units": {"enum": ["metric", "imperial"]},
}, "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
# a template that renders tools and teaches Mistral's syntax: detected, and followed by forced calls
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m.get('tool_calls') %}[TOOL_CALLS]{{ m['tool_calls'] | tojson }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


class Forecast(BaseModel):
    city: str = Field(max_length=10)
    celsius: int = Field(ge=-40, le=50)
    sky: Literal["sunny", "cloudy", "rain"]
    hours: list[int] = Field(max_length=3)


@pytest.fixture
def model_dir(long_context_dir):
    return long_context_dir


def strict_answer(answer) -> ChatCompletion:
    return ChatCompletion.model_validate_json(answer.model_dump_json(), strict=True)


def arguments_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


async def test_parse_with_a_pydantic_model(sdk):
    for parse in (sdk.chat.completions.parse, sdk.beta.chat.completions.parse):
        answer = await parse(model="tiny", messages=ASK, response_format=Forecast, temperature=0, max_tokens=300)
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(answer.choices[0].message.parsed, Forecast)


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_json_schema_and_json_object(sdk, seed):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number", "minimum": 0,
                                                                              "maximum": 9, "multipleOf": 0.5}},
              "required": ["ok", "n"], "additionalProperties": False}
    answer = await sdk.chat.completions.create(
        model="tiny", messages=ASK, temperature=1.0, seed=seed, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "flags", "schema": schema, "strict": True}})
    strict_answer(answer)
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    anything = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=60,
                                                 response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


async def test_vllm_guided_fields_and_streamed_structured_output(sdk):
    choice = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=20,
                                               extra_body={"guided_choice": ["sunny", "rainy"]})
    assert choice.choices[0].message.content in ("sunny", "rainy")
    regex = await sdk.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=20,
                                              extra_body={"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
    assert len(regex.choices[0].message.content) == 5 and regex.choices[0].message.content[2] == ":"
    completion = await sdk.completions.create(model="tiny", prompt="Weather:", temperature=0, max_tokens=20,
                                              extra_body={"guided_regex": "(hot|cold)!"})
    assert completion.choices[0].text in ("hot!", "cold!")
    stream = await sdk.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), WEATHER)


@pytest.mark.parametrize(("body", "named"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?=a)b"}}}}, "look-around"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}],
      "tool_choice": "required"}, "not"),
    ({"extra_body": {"guided_regex": "a(b"}}, "unclosed group"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "cannot be combined with tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in `tools`"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, "give one of"),
])
async def test_what_cannot_be_enforced_is_a_400_naming_it(sdk, body, named):
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, **body)
    error = info.value.body
    assert info.value.status_code == 400 and named in error["message"], error
    assert set(error) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
async def test_forced_tool_calls_validate(sdk, choice):
    answer = await sdk.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=400, parallel_tool_calls=False)
    strict_answer(answer)
    [result] = answer.choices
    assert result.finish_reason == "tool_calls" and result.message.content is None
    [(name, arguments)] = arguments_of(result.message)
    assert name == "search" or (choice == "required" and name in SCHEMAS)
    jsonschema.validate(arguments, SCHEMAS[name])
    assert result.message.tool_calls[0].id.startswith("call_")


async def test_streamed_tool_calls_assemble_to_the_collected_call(sdk):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=1500)
    collected = (await sdk.chat.completions.create(**kw)).choices[0]
    expected = [(c.id, c.function.name, c.function.arguments) for c in collected.message.tool_calls]
    for name, arguments in arguments_of(collected.message):
        jsonschema.validate(arguments, SCHEMAS[name])
    for cache in (False, True):  # generated live; replayed from the response cache (the same calls, ids too)
        stream = await sdk.chat.completions.create(stream=True, extra_body={"galley": {"cache": cache}}, **kw)
        chunks = [chunk async for chunk in stream]
        calls: dict[int, dict] = {}
        for chunk in chunks:
            ChatCompletionChunk.model_validate_json(chunk.model_dump_json(), strict=True)
            for part in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                call = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
                call["arguments"] += part.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        got = [(c["id"], c["name"], c["arguments"]) for c in calls.values()]
        if cache:
            assert got == expected
        else:  # a new generation: its own ids, the same calls, streamed in pieces
            assert [g[1:] for g in got] == [e[1:] for e in expected] and all(g[0].startswith("call_") for g in got)
            assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > len(calls)


async def test_auto_none_n_and_a_history_with_calls_and_results(sdk):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    auto = await sdk.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0,
                                             max_tokens=12)
    strict_answer(auto)
    none = await sdk.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                             temperature=0, max_tokens=12)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    both = await sdk.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, n=2, temperature=1.0,
                                             seed=3, max_tokens=1500, tool_choice="required")
    assert [c.finish_reason for c in both.choices] == ["tool_calls", "tool_calls"]
    for result in both.choices:
        for name, arguments in arguments_of(result.message):
            jsonschema.validate(arguments, SCHEMAS[name])


async def test_a_template_with_tools_is_detected_and_followed(aiohttp_server, llama_path, tmp_path):
    path = long_context_copy(llama_path, tmp_path / "mistral-like", MISTRAL_TEMPLATE)
    server, router, workers = await start_server(aiohttp_server, path)
    try:
        async with client(server) as sdk:
            answer = await sdk.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=300,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            [(name, arguments)] = arguments_of(answer.choices[0].message)
            assert name == "get_weather"
            jsonschema.validate(arguments, WEATHER)
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()
