"""One answer path (issue 33, scope 1): tool calls, thoughts and structured output are read out of
the text in one place (`services.answers.deltas`), so the answers that carry them are resumable
(Last-Event-ID, and from SQLite once they leave memory), cached and replayed like any other, and
n > 1 choices read each choice the same way. Real app, real engine, real SQLite, real clients."""

from __future__ import annotations

import json

import openai
import pytest

from api.services import SERVICES
from tests.api.test_reasoning import ANSWER, THOUGHTS, thinking_path  # noqa: F401 (a fixture)
from tests.api.test_reasoning import ASK as THINK_ASK
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


# ---- tools and thoughts in stored conversations, over HTTP and /ws/chat -----------------------------


async def new_conversation(client, key: str) -> str:
    status, made = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert status == 201, made
    return made["id"]


async def stored_messages(client, key: str, conversation_id: str) -> list[dict]:
    status, found = await client.call("GET", f"/api/v1/conversations/{conversation_id}", key)
    assert status == 200, found
    return found["messages"]


async def test_tools_in_a_stored_conversation_over_http(stack):
    """A turn with tools stores the answer's calls; the next turn sends the tool's result, and the
    conversation renders its history as a stateless request with the same messages would."""
    _, client, _, key = stack
    conversation_id = await new_conversation(client, key)
    status, answer = await client.call("POST", "/v1/chat/completions", key,
                                       json={**TOOL_BODY, "conversation_id": conversation_id})
    assert status == 200, answer  # it was a 400: tools could not be used in a stored conversation
    message = answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and message["tool_calls"]
    stored = await stored_messages(client, key, conversation_id)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["tool_calls"] == message["tool_calls"] and stored[1]["content"] == (message["content"] or "")
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": '{"celsius": 21}'}
    follow = {"model": "tiny", "messages": [result], "tools": TOOLS, "tool_choice": "none", "temperature": 0,
              "max_tokens": 8, "galley": {"cache": False}}
    status, turn = await client.call("POST", "/v1/chat/completions", key,
                                     json={**follow, "conversation_id": conversation_id})
    assert status == 200, turn
    history = ASK + [{"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]}, result]
    status, stateless = await client.call("POST", "/v1/chat/completions", key, json={**follow, "messages": history})
    assert turn["usage"]["prompt_tokens"] == stateless["usage"]["prompt_tokens"]
    assert turn["choices"][0]["message"] == stateless["choices"][0]["message"]
    stored = await stored_messages(client, key, conversation_id)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["tool_call_id"] == result["tool_call_id"]


async def test_tools_in_a_stored_conversation_over_the_websocket(stack):
    _, client, _, key = stack
    params = {k: v for k, v in TOOL_BODY.items() if k not in ("model", "messages")}
    async with client.session.ws_connect("/ws/chat", headers=auth(key)) as ws:
        await ws.send_json({"type": "chat", "model": "tiny", "content": ASK[0]["content"], "params": params})
        started = await ws.receive_json(timeout=30)
        assert started["type"] == "start", started
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(await ws.receive_json(timeout=30))
    assert messages[-1]["type"] == "done" and messages[-1]["finish_reason"] == "tool_calls", messages[-1]
    calls: dict[int, dict] = {}
    for m in messages[:-1]:
        for part in m.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"id": part.get("id"), "name": None, "arguments": ""})
            call["name"] = part["function"].get("name") or call["name"]
            call["arguments"] += part["function"]["arguments"]
    stored = await stored_messages(client, key, started["conversation_id"])
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in stored[1]["tool_calls"]] == [
        (c["id"], c["name"], c["arguments"]) for c in calls.values()]


async def test_thoughts_in_a_stored_conversation_over_http_and_the_websocket(aiohttp_server, thinking_path,  # noqa: F811
                                                                            db):
    async with auth_stack(aiohttp_server, thinking_path, db) as (_, client, _, key):
        conversation_id = await new_conversation(client, key)
        body = {"model": "tiny", "messages": THINK_ASK, "temperature": 0, "max_tokens": 40,
                "conversation_id": conversation_id}
        status, answer = await client.call("POST", "/v1/chat/completions", key, json=body)
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (THOUGHTS, ANSWER)  # split in a conversation
        stored = await stored_messages(client, key, conversation_id)
        assert (stored[1]["reasoning_content"], stored[1]["content"]) == (THOUGHTS, ANSWER)
        async with client.session.ws_connect("/ws/chat", headers=auth(key)) as ws:
            await ws.send_json({"type": "chat", "model": "tiny", "content": THINK_ASK[0]["content"],
                                "params": {"temperature": 0, "max_tokens": 40}})
            assert (await ws.receive_json(timeout=30))["type"] == "start"
            messages = []
            while not messages or messages[-1]["type"] not in ("done", "error"):
                messages.append(await ws.receive_json(timeout=30))
        tokens = [m for m in messages if m["type"] == "token"]
        assert "".join(m.get("reasoning", "") for m in tokens) == THOUGHTS
        assert "".join(m["text"] for m in tokens) == ANSWER
