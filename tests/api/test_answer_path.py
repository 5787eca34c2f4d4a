"""One answer path (issue 33, scope 1): tool calls, thoughts and structured output are read out of
the text in one place (`services.inference.deltas`), so the answers that carry them are resumable
(Last-Event-ID, and from SQLite once they leave memory), cached and replayed like any other, and
n > 1 choices read each choice the same way. Real app, real engine, real SQLite, real clients."""

from __future__ import annotations

import json

import openai
import pytest

from api.services import SERVICES
from tests.api.test_streams import auth, auth_stack, read_events
from tests.api.test_structured_output import ASK, SCHEMAS, TOOLS

TOOL_BODY = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
             "max_tokens": 400}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "word": {"type": "string", "maxLength": 12}},
         "required": ["ok", "word"], "additionalProperties": False}
JSON_BODY = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 200, "response_format": {
    "type": "json_schema", "json_schema": {"name": "flags", "schema": FLAGS, "strict": True}}}


@pytest.fixture
async def stack(aiohttp_server, long_context_dir, db):
    async with auth_stack(aiohttp_server, long_context_dir, db) as parts:
        yield parts


def calls_of(events) -> list[dict]:
    """A streamed choice's tool calls put together from their deltas."""
    calls: dict[int, dict] = {}
    for _, data in events:
        if isinstance(data, dict) and data.get("choices"):
            for part in data["choices"][0]["delta"].get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"id": part.get("id"), "name": None, "arguments": ""})
                call["name"] = part["function"].get("name") or call["name"]
                call["arguments"] += part["function"].get("arguments", "")
    return list(calls.values())


def content_of(events) -> str:
    return "".join(data["choices"][0]["delta"].get("content") or "" for _, data in events
                   if isinstance(data, dict) and data.get("choices"))


async def resumed(stack, body: dict, after: int) -> tuple[list, list, str]:
    """Stream `body`, drop the connection after `after` chunks, resume with Last-Event-ID: (the
    chunks before, the chunks after, the stream id)."""
    _, client, _, key = stack
    stream_body = {**body, "stream": True, "galley": {"on_disconnect": "continue", "cache": False}}
    resp = await client.session.post("/v1/chat/completions", json=stream_body, headers=auth(key))
    assert resp.status == 200, await resp.text()
    stream_id = resp.headers["X-Stream-Id"]  # tools and structured output are resumable now
    first = await read_events(resp, limit=after)
    resp.close()
    async with client.session.get(f"/api/v1/streams/{stream_id}",
                                  headers={**auth(key), "Last-Event-ID": str(after)}) as r:
        rest = await read_events(r)
    return first, rest, stream_id


async def replayed_from_sqlite(stack, stream_id: str) -> list:
    _, client, app, key = stack
    await app[SERVICES].streams.sweep()  # memory_seconds=0: the finished stream replays from SQLite
    assert stream_id not in app[SERVICES].streams.live
    async with client.session.get(f"/api/v1/streams/{stream_id}", headers=auth(key)) as r:
        return await read_events(r)


async def collected(stack, body: dict) -> dict:
    _, client, _, key = stack
    async with client.session.post("/v1/chat/completions", json={**body, "galley": {"cache": False}},
                                   headers=auth(key)) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]


async def test_a_tool_call_answer_resumes_equal_to_the_uninterrupted_one(stack):
    first, rest, stream_id = await resumed(stack, TOOL_BODY, after=3)
    whole = await replayed_from_sqlite(stack, stream_id)
    assert [data for _, data in whole] == [data for _, data in first + rest]  # no gap, no duplicate, same ids
    calls = calls_of(first + rest)
    assert calls and rest[-2][1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["id"] for c in calls] == [c["id"] for c in calls_of(whole)]
    choice = await collected(stack, TOOL_BODY)
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    for call in calls:
        assert set(json.loads(call["arguments"])) <= set(SCHEMAS[call["name"]]["properties"])


async def test_a_structured_answer_resumes_equal_to_the_uninterrupted_one(stack):
    first, rest, stream_id = await resumed(stack, JSON_BODY, after=4)
    whole = await replayed_from_sqlite(stack, stream_id)
    assert [data for _, data in whole] == [data for _, data in first + rest]
    text = content_of(first + rest)
    assert text == (await collected(stack, JSON_BODY))["message"]["content"]
    assert set(json.loads(text)) == {"ok", "word"}


async def test_a_tool_call_answer_from_the_cache_equals_the_first(stack):
    server, _, _, key = stack
    sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)
    first = await sdk.chat.completions.create(**TOOL_BODY)
    again = await sdk.chat.completions.create(**TOOL_BODY)  # a hit
    assert again.choices[0].message.tool_calls == first.choices[0].message.tool_calls  # ids included
    assert again.choices[0].finish_reason == first.choices[0].finish_reason == "tool_calls"
    streamed = [chunk async for chunk in await sdk.chat.completions.create(**TOOL_BODY, stream=True)]
    pieces = [p for c in streamed if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert [(p.id, p.function.name, p.function.arguments) for p in pieces] == [
        (c.id, c.function.name, c.function.arguments) for c in first.choices[0].message.tool_calls]
    await sdk.close()


async def test_n_choices_with_tools_each_read_their_own_calls(stack):
    server, _, _, key = stack
    sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)
    body = {**TOOL_BODY, "temperature": 1.0, "seed": 5, "n": 3}
    answer = await sdk.chat.completions.create(**body)
    assert [c.finish_reason for c in answer.choices] == ["tool_calls"] * 3
    ids = [call.id for c in answer.choices for call in c.message.tool_calls]
    assert len(set(ids)) == len(ids)  # every choice names its own calls
    streamed: dict[int, list] = {}
    async for chunk in await sdk.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).extend(choice.delta.tool_calls or [])
    for index, choice in enumerate(answer.choices):  # seeded: the same calls, put together from deltas
        names = [p.function.name for p in streamed[index] if p.function.name]
        arguments = "".join(p.function.arguments or "" for p in streamed[index])
        assert names == [c.function.name for c in choice.message.tool_calls]
        assert arguments == "".join(c.function.arguments for c in choice.message.tool_calls)
    await sdk.close()
