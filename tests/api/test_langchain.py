"""LangChain's OpenAI clients against the real app on the tiny random model, offline (a connection
anywhere but loopback fails the test): `ChatOpenAI` answers, streams, returns structured output in
all three `with_structured_output` modes, goes round a tool call and speaks the Responses API
(`use_responses_api`); `OpenAI` completes one prompt and a list of them. A random model says
nothing sensible, so every structured path is constrained (json_schema, a forced tool) or checked
only for well-formed JSON (json_mode)."""

from __future__ import annotations

import json

import pytest

from tests.api.clients import offline, shapes
from tests.api.clients.shapes import ASK, Forecast, WeatherArgs

langchain_openai = pytest.importorskip("langchain_openai", reason="pip install -e '.[test]' installs langchain-openai")
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402


@pytest.fixture
def model_dir(long_context_dir):
    return long_context_dir


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    for target, name, replacement in offline.patches():
        monkeypatch.setattr(target, name, replacement)


def chat_model(served, **kw) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(base_url=str(served.make_url("/v1")), api_key="x", model="tiny",
                                       max_retries=0, **{"temperature": 0, "max_tokens": 8, **kw})


get_weather = tool(args_schema=WeatherArgs)(shapes.get_weather)


async def test_invoke_and_stream_say_the_same(served):
    llm = chat_model(served)
    answer = await llm.ainvoke("Hello there")
    assert answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] <= 8
    assert answer.usage_metadata["input_token_details"]["cache_read"] == 0
    chunks = [chunk async for chunk in chat_model(served, stream_usage=True).astream("Hello there")]
    assert "".join(chunk.content for chunk in chunks) == answer.content
    whole = sum(chunks[1:], chunks[0])
    assert whole.usage_metadata["output_tokens"] == answer.usage_metadata["output_tokens"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_with_structured_output_gives_a_valid_object(served, method):
    llm = chat_model(served, max_tokens=300).with_structured_output(Forecast, method=method, strict=True)
    forecast = await llm.ainvoke(ASK)
    assert isinstance(forecast, Forecast)


async def test_with_structured_output_json_mode_gives_json(served):
    """json_mode only promises an object (the schema is the prompt's business): a dict schema comes back parsed."""
    llm = chat_model(served, max_tokens=200).with_structured_output(method="json_mode", include_raw=True)
    result = await llm.ainvoke(ASK + " Answer in JSON.")
    assert result["parsing_error"] is None and isinstance(result["parsed"], dict)
    assert json.loads(result["raw"].content) == result["parsed"]


@pytest.mark.parametrize("choice", ["get_weather", "any"])
async def test_bind_tools_and_a_tool_round_trip(served, choice):
    """A forced call (named, or `any`: OpenAI's `required`), its result sent back as a ToolMessage,
    and the answer that follows; the same call streamed comes in pieces that add up to it."""
    llm = chat_model(served, max_tokens=300)
    with_tools = llm.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False)
    question = HumanMessage(ASK)
    called = await with_tools.ainvoke([question])
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and called.response_metadata["finish_reason"] == "tool_calls"
    WeatherArgs.model_validate(call["args"])
    result = ToolMessage(await get_weather.ainvoke(call["args"]), tool_call_id=call["id"])
    answer = await llm.bind_tools([get_weather]).ainvoke([question, called, result])
    assert answer.content and not answer.tool_calls

    streamed: AIMessageChunk | None = None
    async for chunk in with_tools.astream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


async def test_the_responses_api_through_chat_openai(served):
    """`use_responses_api=True`: the same greedy text as chat completions, and a forced call's arguments."""
    llm = chat_model(served, use_responses_api=True)
    answer = await llm.ainvoke("Hello there")
    assert answer.text == (await chat_model(served).ainvoke("Hello there")).content
    assert answer.usage_metadata["output_tokens"] <= 8
    called = await chat_model(served, use_responses_api=True, max_tokens=300).bind_tools(
        [get_weather], tool_choice="get_weather").ainvoke(ASK)
    [call] = called.tool_calls
    assert call["name"] == "get_weather"
    WeatherArgs.model_validate(call["args"])


async def test_completions_one_prompt_and_a_list(served):
    llm = langchain_openai.OpenAI(base_url=str(served.make_url("/v1")), api_key="x", model="tiny", max_retries=0,
                                  temperature=0, max_tokens=6)
    prompts = ["The quick brown", "Once upon a", "Hello there"]
    alone = [await llm.ainvoke(prompt) for prompt in prompts]
    together = await llm.agenerate(prompts)  # one request with a list of prompts
    assert [g[0].text for g in together.generations] == alone
    assert together.llm_output["token_usage"]["completion_tokens"] <= 18
    streamed = "".join([chunk async for chunk in llm.astream(prompts[0])])
    assert streamed == alone[0]


async def test_a_tool_round_trip_in_a_stored_conversation_and_a_replayed_call(served):
    """The one answer path through LangChain: a forced call inside a stored conversation (the history
    is the server's: each turn sends only its new messages), and the same call answered again from the
    response cache, ids and all."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(served.make_url("/api/v1/conversations"), json={"model": "tiny"}) as resp:
            conversation_id = (await resp.json())["id"]
    in_conversation = chat_model(served, max_tokens=300, extra_body={"conversation_id": conversation_id})
    called = await in_conversation.bind_tools([get_weather], tool_choice="get_weather",
                                              parallel_tool_calls=False).ainvoke([HumanMessage(ASK)])
    [call] = called.tool_calls
    WeatherArgs.model_validate(call["args"])
    result = ToolMessage(await get_weather.ainvoke(call["args"]), tool_call_id=call["id"])
    answer = await in_conversation.bind_tools([get_weather], tool_choice="none").ainvoke([result])
    assert answer.content and not answer.tool_calls

    forced = chat_model(served, max_tokens=300).bind_tools([get_weather], tool_choice="get_weather",
                                                           parallel_tool_calls=False)
    first, again = await forced.ainvoke(ASK), await forced.ainvoke(ASK)  # the second: a cache hit
    assert again.tool_calls == first.tool_calls and again.tool_calls[0]["id"].startswith("call_")
