"""WebSocket chat at /ws/chat: the real app and engine on a tiny model, auth on, aiohttp's ws client."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from api.services import SERVICES
from scheduling.router import Router
from tests.api.test_auth import Client
from tests.api.test_streams import auth_stack
from tests.helpers import make_app

GREEDY = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture
async def stack(aiohttp_server, llama_path, db):
    async with auth_stack(aiohttp_server, llama_path, db) as (_, client, app, key):
        yield client, key, app


def connect(client: Client, key: str):
    return client.session.ws_connect("/ws/chat", headers={"Authorization": f"Bearer {key}"})


async def receive(ws: aiohttp.ClientWebSocketResponse) -> dict:
    return await asyncio.wait_for(ws.receive_json(), 30)


async def until_end(ws: aiohttp.ClientWebSocketResponse, stream_ids: set[str]) -> dict[str, list[dict]]:
    """Every message per stream id until each of `stream_ids` has its `done` (or `error`)."""
    got: dict[str, list[dict]] = {s: [] for s in stream_ids}
    open_ids = set(stream_ids)
    while open_ids:
        message = await receive(ws)
        got[message["stream_id"]].append(message)
        if message["type"] in ("done", "error"):
            open_ids.discard(message["stream_id"])
    return got


def text_of(messages: list[dict]) -> str:
    return "".join(m["text"] for m in messages if m["type"] == "token")


async def reference_text(client: Client, key: str, content: str, params: dict) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **params}
    status, answer = await client.call("POST", "/v1/chat/completions", key, json=body)
    assert status == 200
    return answer["choices"][0]["message"]["content"]


async def start(ws: aiohttp.ClientWebSocketResponse, content: str, params: dict, **fields) -> dict:
    await ws.send_json({"type": "chat", "model": "tiny", "content": content, "params": params, **fields})
    started = await receive(ws)
    assert started["type"] == "start", started
    return started


async def test_chat_streams_tokens_then_done_equal_to_the_greedy_answer(stack):
    client, key, _ = stack
    async with connect(client, key) as ws:
        started = await start(ws, "Tell me a story", GREEDY)
        messages = (await until_end(ws, {started["stream_id"]}))[started["stream_id"]]
    tokens, done = messages[:-1], messages[-1]
    assert {m["type"] for m in tokens} == {"token"} and all(m["text"] for m in tokens)
    indexes = [m["index"] for m in tokens]
    assert indexes == sorted(set(indexes)) and indexes[0] >= 0
    assert done == {"type": "done", "stream_id": started["stream_id"], "finish_reason": "length",
                    "usage": {"prompt_tokens": done["usage"]["prompt_tokens"], "completion_tokens": 40,
                              "total_tokens": done["usage"]["prompt_tokens"] + 40,
                              "prompt_tokens_details": {"cached_tokens": 0}}}
    assert text_of(tokens) == await reference_text(client, key, "Tell me a story", GREEDY)


async def test_chat_is_a_stored_conversation_and_a_second_turn_continues_it(stack):
    client, key, _ = stack
    async with connect(client, key) as ws:
        first = await start(ws, "Tell me a story", GREEDY)
        answer = text_of((await until_end(ws, {first["stream_id"]}))[first["stream_id"]])
        conv = first["conversation_id"]
        assert conv.startswith("conv_")
        status, got = await client.call("GET", f"/api/v1/conversations/{conv}", key)
        assert status == 200 and got["model_version"] == "1"
        assert [(m["role"], m["content"]) for m in got["messages"]] == [("user", "Tell me a story"),
                                                                       ("assistant", answer)]
        assert got["messages"][1]["stream_id"] == first["stream_id"]
        second = await start(ws, "And then?", {**GREEDY, "max_tokens": 5}, conversation_id=conv)
        assert second["conversation_id"] == conv
        await until_end(ws, {second["stream_id"]})
    status, got = await client.call("GET", f"/api/v1/conversations/{conv}", key)
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]
    status, listed = await client.call("GET", "/api/v1/conversations", key)
    assert [c["id"] for c in listed["data"]] == [conv]


async def test_two_concurrent_chats_on_one_socket(stack):
    client, key, _ = stack
    prompts = {"Tell me a story": {**GREEDY, "max_tokens": 300}, "Sing a song": {**GREEDY, "max_tokens": 20}}
    async with connect(client, key) as ws:
        for content, params in prompts.items():
            await ws.send_json({"type": "chat", "model": "tiny", "content": content, "params": params})
        order, got = [], {}
        while [m["type"] for m in order].count("done") < 2:
            message = await receive(ws)
            order.append(message)
            got.setdefault(message["stream_id"], []).append(message)
    starts = [m["stream_id"] for m in order if m["type"] == "start"]  # in the order the chats were sent
    assert len(set(starts)) == 2
    first_done = order.index(got[starts[0]][-1])
    assert any(m["type"] == "token" and m["stream_id"] == starts[1] for m in order[:first_done])  # interleaved
    for stream_id, (content, params) in zip(starts, prompts.items()):
        assert got[stream_id][-1]["type"] == "done"
        assert text_of(got[stream_id]) == await reference_text(client, key, content, params)


async def test_dropped_socket_resumes_without_gap_or_duplicate(stack):
    client, key, _ = stack
    params = {**GREEDY, "max_tokens": 60}
    async with connect(client, key) as ws:
        started = await start(ws, "Tell me a story", params)
        first = [await receive(ws) for _ in range(10)]
    assert all(m["type"] == "token" for m in first)  # the socket is gone; the conversation's stream goes on
    last_index = first[-1]["index"]
    async with connect(client, key) as ws:
        await ws.send_json({"type": "resume", "stream_id": started["stream_id"], "after": last_index})
        assert await receive(ws) == {"type": "start", "stream_id": started["stream_id"],
                                     "conversation_id": started["conversation_id"]}
        rest = (await until_end(ws, {started["stream_id"]}))[started["stream_id"]]
    assert rest[-1]["type"] == "done" and rest[-1]["usage"]["completion_tokens"] == 60
    indexes = [m["index"] for m in first + rest[:-1]]
    assert indexes == sorted(set(indexes)) and rest[0]["index"] > last_index
    assert text_of(first) + text_of(rest) == await reference_text(client, key, "Tell me a story", params)


async def test_closing_the_socket_cancels_a_stream_that_asked_for_it(stack):
    client, key, app = stack
    params = {**GREEDY, "max_tokens": 400, "galley": {"on_disconnect": "cancel"}}
    async with connect(client, key) as ws:
        started = await start(ws, "Tell me a story", params)
        await receive(ws)
    live = app[SERVICES].streams.live[started["stream_id"]]
    for _ in range(200):
        if live.done:
            break
        await asyncio.sleep(0.01)
    assert live.status == "cancelled" and live.followers == 0
    async with connect(client, key) as ws:
        await ws.send_json({"type": "resume", "stream_id": started["stream_id"], "after": 10_000})
        assert (await receive(ws))["type"] == "start"
        done = await receive(ws)
    assert (done["type"], done["finish_reason"]) == ("done", "cancelled")
    assert done["usage"]["completion_tokens"] < 400


async def test_cancel_ends_the_stream_with_cancelled(stack):
    client, key, _ = stack
    async with connect(client, key) as ws:
        started = await start(ws, "Tell me a story", {**GREEDY, "max_tokens": 400})
        for _ in range(3):
            assert (await receive(ws))["type"] == "token"
        await ws.send_json({"type": "cancel", "stream_id": started["stream_id"]})
        rest = (await until_end(ws, {started["stream_id"]}))[started["stream_id"]]
        assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "cancelled"
        assert rest[-1]["usage"]["completion_tokens"] < 400
        await ws.send_json({"type": "cancel", "stream_id": started["stream_id"]})  # already over: nothing to do
        await ws.send_json({"type": "cancel", "stream_id": "chatcmpl-nope"})
        assert await receive(ws) == {"type": "error", "code": "stream_not_found", "stream_id": "chatcmpl-nope",
                                     "param": "stream_id",
                                     "message": "no stream 'chatcmpl-nope' (unknown, expired, or not yours)"}
    status, got = await client.call("GET", f"/api/v1/conversations/{started['conversation_id']}", key)
    assert [m["role"] for m in got["messages"]] == ["user"]  # a cancelled answer is not stored


async def test_token_query_parameter_authenticates_and_a_bad_or_missing_key_is_refused(stack):
    client, key, _ = stack
    async with client.session.ws_connect(f"/ws/chat?token={key}") as ws:
        await ws.send_json({"type": "resume", "stream_id": "chatcmpl-nope", "after": -1})
        assert (await receive(ws))["code"] == "stream_not_found"
    for url, headers in [("/ws/chat", {}), ("/ws/chat?token=gk_00000000_unknown", {}), ("/ws/chat?token=", {}),
                         (f"/ws/chat?token={key}", {"Authorization": "Bearer wrong"})]:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.session.ws_connect(url, headers=headers)
        assert refused.value.status == 401
    async with client.session.get(f"/v1/models?token={key}") as resp:
        assert resp.status == 401  # only /ws/ paths take the key from the query


async def test_another_tenant_cannot_resume_or_cancel(stack):
    client, key, app = stack
    bob = await client.new_key("bob")
    async with connect(client, key) as ws:
        started = await start(ws, "Tell me a story", {**GREEDY, "max_tokens": 5})
        original = (await until_end(ws, {started["stream_id"]}))[started["stream_id"]]
    stream_id = started["stream_id"]
    async with connect(client, bob) as ws:
        for message in ({"type": "resume", "stream_id": stream_id, "after": -1},
                        {"type": "cancel", "stream_id": stream_id}):
            await ws.send_json(message)
            error = await receive(ws)
            assert (error["type"], error["code"], error["stream_id"]) == ("error", "stream_not_found", stream_id)
        await ws.send_json({"type": "chat", "model": "tiny", "content": "hi", "params": GREEDY,
                            "conversation_id": started["conversation_id"]})
        assert (await receive(ws))["code"] == "conversation_not_found"
    await app[SERVICES].streams.sweep()  # memory_seconds=0: alice's finished stream now replays from SQLite
    assert stream_id not in app[SERVICES].streams.live
    async with connect(client, key) as ws:
        await ws.send_json({"type": "resume", "stream_id": stream_id, "after": 1})
        assert (await receive(ws))["type"] == "start"
        replay = (await until_end(ws, {stream_id}))[stream_id]
    del original[-1]["usage"]["prompt_tokens_details"]  # a stored stream does not keep its cached-token count
    assert replay == [m for m in original if m["type"] == "done" or m["index"] > 1]


async def test_bad_messages_get_errors_and_the_socket_stays_usable(stack):
    client, key, _ = stack
    limited = await client.new_key("limited", max_concurrent=1, max_priority="normal")
    cases = [
        ("not json", "invalid_message"),
        ({"type": "dance"}, "invalid_message"),
        ({"type": "chat", "model": "tiny"}, "invalid_message"),
        ({"type": "chat", "model": "tiny", "content": "hi", "messages": []}, "invalid_message"),
        ({"type": "resume"}, "invalid_message"),
        ({"type": "chat", "model": "tiny", "content": "hi", "params": {"temperature": 9}}, "invalid_request_error"),
        ({"type": "chat", "model": "tiny", "content": "hi", "params": {"model": "x"}}, "invalid_request_error"),
        ({"type": "chat", "model": "tiny", "messages": [{"role": "robot"}]}, "invalid_request_error"),
        ({"type": "chat", "model": "nope", "content": "hi"}, "model_not_found"),
        ({"type": "chat", "model": "tiny", "content": "hi", "params": {"priority": "high"}}, "priority_not_allowed"),
        ({"type": "resume", "stream_id": "chatcmpl-nope", "after": 3}, "stream_not_found"),
    ]
    async with connect(client, limited) as ws:
        for message, code in cases:
            await (ws.send_str(message) if isinstance(message, str) else ws.send_json(message))
            error = await receive(ws)
            assert (error["type"], error["code"]) == ("error", code), (message, error)
            assert error["message"]
        await ws.send_bytes(b"{}")
        assert (await receive(ws))["code"] == "invalid_message"
        long = await start(ws, "Tell me a story", {**GREEDY, "max_tokens": 400})
        await ws.send_json({"type": "chat", "model": "tiny", "content": "hi", "params": GREEDY})
        over = await receive(ws)
        while over["type"] == "token":
            over = await receive(ws)
        assert (over["type"], over["code"]) == ("error", "concurrency") and "stream_id" not in over
        await ws.send_json({"type": "cancel", "stream_id": long["stream_id"]})
        await until_end(ws, {long["stream_id"]})
        again = await start(ws, "Sing a song", {**GREEDY, "max_tokens": 3})
        assert (await until_end(ws, {again["stream_id"]}))[again["stream_id"]][-1]["type"] == "done"
    status, listed = await client.call("GET", "/api/v1/conversations", limited)
    assert len(listed["data"]) == 2  # the refused chat left no empty conversation behind


async def test_shutdown_closes_open_sockets_with_going_away(aiohttp_server, db):
    server = await aiohttp_server(make_app(Router(), db=db))  # auth off: the default tenant
    async with aiohttp.ClientSession() as session, session.ws_connect(server.make_url("/ws/chat")) as ws:
        await server.close()
        closed = await asyncio.wait_for(ws.receive(), 10)
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == aiohttp.WSCloseCode.GOING_AWAY
