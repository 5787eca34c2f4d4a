"""Resumable streams and conversations: real app, real engine, real SQLite file, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from transformers import AutoTokenizer

from api.services import SERVICES
from services.streams.hub import StreamsConfig
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.helpers import make_app, start_tiny_engines

MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@contextlib.asynccontextmanager
async def auth_stack(aiohttp_server, path, db):
    """The real app with auth on, the tiny model on real workers, an admin client and a tenant key;
    finished streams leave memory at once (replays come from SQLite)."""
    router, workers = await start_tiny_engines(path)
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN),
                     streams=StreamsConfig(memory_seconds=0.0))
    server = await aiohttp_server(app)
    try:
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            client = Client(session)
            yield server, client, app, await client.new_key("alice")
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
async def stack(aiohttp_server, llama_path, db):
    async with auth_stack(aiohttp_server, llama_path, db) as parts:
        yield parts


async def read_events(resp: aiohttp.ClientResponse, limit: int | None = None) -> list[tuple[int | None, dict | str]]:
    """(id, data) for each SSE event (id None without an `id:` line), stopping after `limit` chunks;
    any other line than `id:`, `data:` and the blank line between events fails the test."""
    events, event_id = [], None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
            events.append((event_id, data if data == "[DONE]" else json.loads(data)))
            event_id = None
            if limit is not None and len(events) >= limit:
                break
        else:
            assert line == "", line
    return events


def text_of(events, kind: str = "chat") -> str:
    out = ""
    for _, data in events:
        if isinstance(data, dict) and data.get("choices"):
            choice = data["choices"][0]
            out += (choice["delta"].get("content") or "") if kind == "chat" else choice["text"]
    return out


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def reference_text(session, key: str, body: dict) -> str:
    plain = {k: v for k, v in body.items() if k not in ("conversation_id", "stream", "galley")}
    async with session.post("/v1/chat/completions", json=plain, headers=auth(key)) as resp:
        return (await resp.json())["choices"][0]["message"]["content"]


async def new_conversation(client: Client, key: str) -> str:
    status, conv = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert status == 201
    return conv["id"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
async def test_dropped_sse_resumes_with_last_event_id_without_gap_or_duplicate(stack, sampling):
    server, client, _, key = stack
    session = client.session
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 60, "ignore_eos": True, "stream": True,
            "conversation_id": await new_conversation(client, key), **sampling}
    resp = await session.post("/v1/chat/completions", json=body, headers=auth(key))
    stream_id = resp.headers["X-Stream-Id"]
    first = await read_events(resp, limit=10)
    resp.close()  # the phone goes into a tunnel
    assert all(data["id"] == stream_id for _, data in first)
    assert all(i is None for i, _ in first)  # /v1 streams are plain OpenAI SSE: `data:` lines only
    # the resume point is the count of chunks received; the resume endpoint numbers the rest after it
    async with session.get(f"/api/v1/streams/{stream_id}", headers={**auth(key), "Last-Event-ID": "10"}) as r:
        rest = await read_events(r)
    assert rest[-1] == (None, "[DONE]")
    assert [i for i, _ in rest[:-1]] == list(range(11, 11 + len(rest) - 1))
    assert text_of(first) + text_of(rest) == await reference_text(session, key, body)
    async with session.get(f"/api/v1/streams/{stream_id}", headers=auth(key)) as r:  # from the start
        whole = await read_events(r)
    assert [data for _, data in whole] == [data for _, data in first + rest]  # the same chunks, numbered 1, 2, ...
    assert [i for i, _ in whole[:-1]] == list(range(1, len(whole)))


async def test_plain_completion_resumes_when_asked_to_continue_and_replays_from_sqlite(stack):
    server, client, app, key = stack
    session = client.session
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "stream": True, "galley": {"on_disconnect": "continue"}}
    resp = await session.post("/v1/completions", json=body, headers=auth(key))
    stream_id = resp.headers["X-Stream-Id"]
    first = await read_events(resp, limit=5)
    resp.close()
    async with session.get(f"/api/v1/streams/{stream_id}?after={len(first)}", headers=auth(key)) as r:
        rest = await read_events(r)
    whole = text_of(first, "completion") + text_of(rest, "completion")
    plain = {k: v for k, v in body.items() if k not in ("stream", "galley")}
    async with session.post("/v1/completions", json=plain, headers=auth(key)) as r:
        assert whole == (await r.json())["choices"][0]["text"]
    await app[SERVICES].streams.sweep()  # memory_seconds=0: the finished stream now replays from SQLite
    assert stream_id not in app[SERVICES].streams.live
    async with session.get(f"/api/v1/streams/{stream_id}", headers=auth(key)) as r:
        replay = await read_events(r)
    assert text_of(replay, "completion") == whole
    assert replay[-1][1] == "[DONE]" and replay[-2][1]["choices"][0]["finish_reason"] == "length"


async def test_conversation_stream_continues_after_the_client_left_and_is_stored(stack):
    _, client, _, key = stack
    conv = await new_conversation(client, key)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 50, "ignore_eos": True, "temperature": 0,
            "stream": True, "conversation_id": conv}
    resp = await client.session.post("/v1/chat/completions", json=body, headers=auth(key))
    await read_events(resp, limit=3)
    resp.close()
    expected = await reference_text(client.session, key, body)
    for _ in range(100):
        status, got = await client.call("GET", f"/api/v1/conversations/{conv}", key)
        if len(got["messages"]) == 2:
            break
        await asyncio.sleep(0.05)
    assert [m["role"] for m in got["messages"]] == ["user", "assistant"]
    assert got["messages"][1]["content"] == expected
    assert got["messages"][1]["completion_tokens"] == 50


async def test_second_turn_sees_the_first_turns_history(stack, llama_path):
    _, client, _, key = stack
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    conv = await new_conversation(client, key)
    turn = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "conversation_id": conv}
    status, first = await client.call("POST", "/v1/chat/completions", key, json={**turn, "messages": MESSAGES})
    assert status == 200
    answer = first["choices"][0]["message"]["content"]
    second_msg = [{"role": "user", "content": "And then?"}]
    status, second = await client.call("POST", "/v1/chat/completions", key, json={**turn, "messages": second_msg})
    history = MESSAGES + [{"role": "assistant", "content": answer}] + second_msg
    rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert second["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    status, got = await client.call("GET", f"/api/v1/conversations/{conv}", key)
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]
    assert got["model_version"] == "1"


async def test_another_tenant_gets_404_for_stream_and_conversation(stack):
    _, client, _, key = stack
    conv = await new_conversation(client, key)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": True, "conversation_id": conv}
    resp = await client.session.post("/v1/chat/completions", json=body, headers=auth(key))
    stream_id = resp.headers["X-Stream-Id"]
    await read_events(resp)
    bob = await client.new_key("bob")
    status, _ = await client.call("GET", f"/api/v1/streams/{stream_id}", bob)
    assert status == 404
    status, _ = await client.call("GET", f"/api/v1/conversations/{conv}", bob)
    assert status == 404
    status, _ = await client.call("POST", "/v1/chat/completions", bob, json={**body, "stream": False})
    assert status == 404
