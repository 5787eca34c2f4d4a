"""A hostile tenant against the real server, beyond the sampling parameters (issue 11's classes):
request bodies that are JSON only to Python's lenient parser (lone surrogates, nesting past any
schema), an Authorization header that is not UTF-8, and a body whose validation cost grew with
every member of a union. Each is a clean 4xx naming what is wrong, never a 500 or a stalled loop,
and another tenant's stream runs on untouched.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from yarl import URL

from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client, auth_app
from tests.api.test_hostile_params import GREEDY, Stack
from tests.helpers import start_tiny_engines
from tests.process.test_server_process import demo_server  # noqa: F401, F811 (a fixture)

CHAT = {"model": "tiny", "max_tokens": 4, "temperature": 0}


@pytest.fixture
async def server(aiohttp_server, llama_path, db):
    router, workers = await start_tiny_engines(llama_path, max_num_seqs=8)
    server = await aiohttp_server(auth_app(db, router))
    server.router, server.workers = router, workers
    yield server
    await wait_blocks_free(router, timeout_s=30)
    for worker in workers:
        worker.stop()


@pytest.fixture
async def stack(server):
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        keys = {tenant: await Client(session).new_key(tenant) for tenant in ("alice", "mallory")}
        yield Stack(session, server.router, keys)


def assert_400(status: int, answer: dict, param: str | None) -> None:
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error", answer
    assert answer["error"]["param"] == param, answer


async def test_bodies_only_pythons_json_accepts_are_a_400_and_spare_the_other_tenant(stack):
    """Lone surrogates (orjson refuses them; the NaN-tolerant fallback did not, and the
    tokenizer then raised: a 500) and nesting past the parsers' depth (RecursionError: a 500)."""
    other = asyncio.create_task(stack.stream_text("alice", GREEDY))
    surrogate = (b'{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"a\\ud800b"}]}',
                 b'{"model":"tiny","max_tokens":4,"temperature":NaN,"messages":[{"role":"user","content":"\\udfff"}]}')
    for body in surrogate:
        status, answer = await stack.post("mallory", "/v1/chat/completions", body)
        assert_400(status, answer, None)
        assert "surrogate" in answer["error"]["message"], answer
    deep = [b'{"model":"tiny","prompt":' + b"[" * 1020 + b"1" + b"]" * 1020 + b"}",  # orjson reads it
            b'{"model":"tiny","prompt":"x","galley":' + b"[" * 3000 + b"]" * 3000 + b"}",  # orjson does not
            b'{"model":"tiny","prompt":"x","top_p":NaN,"galley":' + b"[" * 3000 + b"]" * 3000 + b"}"]
    for body in deep:
        status, answer = await stack.post("mallory", "/v1/completions", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
        assert "nest" in answer["error"]["message"] or "depth" in answer["error"]["message"], answer
    status, answer = await stack.post("mallory", "/v1/chat/completions",
                                      json.dumps({**CHAT, "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 200, answer  # the NaN-free, surrogate-free request still works
    assert await other == await stack.stream_text("alice", GREEDY)


async def raw_get(url: URL, path: str, authorization: bytes) -> tuple[int, bytes]:
    """A GET with header bytes no HTTP client library would send: status and body."""
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {url.host}\r\nConnection: close\r\n".encode()
                 + b"Authorization: Bearer " + authorization + b"\r\n\r\n")
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_an_authorization_header_that_is_not_utf8_is_a_401(server, stack):
    """aiohttp hands undecodable header bytes over as surrogate escapes; hashing the key raised
    UnicodeEncodeError: a 500 on admin routes, and on tenant routes when the key's prefix exists."""
    prefix = stack.keys["mallory"].split("_")[1]
    url = server.make_url("/")
    for path, token in [("/admin/api/tenants", b"\xff\xfe"), ("/v1/models", f"gk_{prefix}_".encode() + b"\xff"),
                        ("/api/v1/deployments", ADMIN.encode() + b"\xed\xa0\x80")]:
        status, body = await raw_get(url, path, token)
        assert status == 401, (path, body)
        assert b"invalid_api_key" in body, (path, body)
    status, _ = await raw_get(url, "/metrics", b"\xff")  # open on a loopback bind; the header must not break it
    assert status == 200


async def test_too_many_embedding_inputs_are_named_at_once_without_stalling_the_loop(stack):
    """`input` was a plain union of four shapes: an oversized list was validated against every
    member, with an error per element (seconds holding the GIL, /health stalled behind it), and
    the 400 named the wrong member (`input.constrained-str`)."""
    stalls: list[float] = []
    done = asyncio.Event()

    async def watch_health() -> None:
        while not done.is_set():
            started = time.monotonic()
            async with stack.session.get("/health") as resp:
                assert resp.status == 200
            stalls.append(time.monotonic() - started)
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch_health())
    body = json.dumps({"model": "minilm", "input": ["ab"] * 1_300_000}).encode()
    status, answer = await stack.post("mallory", "/v1/embeddings", body)
    done.set()
    await watcher
    assert_400(status, answer, "input.list")
    assert "at most 2048" in answer["error"]["message"], answer
    assert max(stalls) < 3.0, max(stalls)  # ~7 s before, on a 2-core machine
    for value, param in [([[1, 2], "a"], "input.lists.1"), (["a", [1]], "input.list.1"),
                         ([1, "a"], "input.ids.1"), ([], "input.list"), ([[]], "input.lists.0")]:
        status, answer = await stack.post("mallory", "/v1/embeddings",
                                          json.dumps({"model": "minilm", "input": value}).encode())
        assert_400(status, answer, param)


async def test_native_generate_refuses_n_it_would_ignore(stack):
    """/api/v1/generate answers one text; it took `n` from the shared sampling fields (the spec
    promised up to 16 choices) and silently returned one."""
    for path, body in [("/api/v1/generate", {"model": "tiny"}), ("/api/v1/models/tiny/generate", {})]:
        status, answer = await stack.post("mallory", path, json.dumps({**body, "prompt": "hi", "n": 2}).encode())
        assert_400(status, answer, "n")


async def test_names_and_ids_are_bounded_on_every_route(stack):
    """`model` and `user` are at most 256 characters on the generation routes; batch jobs,
    conversations, a chat's `conversation_id` and WebSocket stream ids took any length (and
    echoed it back in their 404s)."""
    long = "m" * 300
    for path, body, param in [("/api/v1/batch", {"model": long, "inputs": ["x"]}, "model"),
                              ("/api/v1/conversations", {"model": long}, "model"),
                              ("/v1/chat/completions", {**CHAT, "conversation_id": long,
                                                        "messages": [{"role": "user", "content": "hi"}]},
                               "conversation_id")]:
        status, answer = await stack.post("mallory", path, json.dumps(body).encode())
        assert_400(status, answer, param)
    async with stack.session.ws_connect("/ws/chat", headers=stack.headers("mallory")) as ws:
        for kind in ("resume", "cancel"):
            await ws.send_json({"type": kind, "stream_id": long})
            answer = await ws.receive_json(timeout=30)
            assert answer["code"] == "invalid_message" and "stream_id" in answer["message"], answer


async def finished_stream(stack: Stack, tenant: str, max_tokens: int) -> str:
    async with stack.session.post("/v1/completions", headers=stack.headers(tenant),
                                  json={**GREEDY, "max_tokens": max_tokens, "stream": True}) as resp:
        assert resp.status == 200
        await resp.read()
        return resp.headers["X-Stream-Id"]


async def test_resuming_a_stream_counts_against_requests_per_minute(stack):
    """A replay is work (up to a whole stream, 64 at once per socket, any number of sockets): a
    tenant held to one request a minute replayed one stream half a million times in seconds."""
    key = await Client(stack.session).new_key("slow", requests_per_minute=2)
    stack.keys["slow"] = key
    stream_id = await finished_stream(stack, "slow", 4)  # request 1
    async with stack.session.get(f"/api/v1/streams/{stream_id}", headers=stack.headers("slow")) as resp:
        assert resp.status == 200  # request 2
        await resp.read()
    async with stack.session.get(f"/api/v1/streams/{stream_id}", headers=stack.headers("slow")) as resp:
        assert resp.status == 429 and resp.headers["Retry-After"], await resp.text()
        assert (await resp.json())["error"]["code"] == "requests_per_minute"
    async with stack.session.ws_connect("/ws/chat", headers=stack.headers("slow")) as ws:
        await ws.send_json({"type": "resume", "stream_id": stream_id})
        answer = await ws.receive_json(timeout=30)
        assert answer["type"] == "error" and answer["code"] == "requests_per_minute", answer



async def test_many_followers_catching_up_do_not_stall_the_event_loop(demo_server):  # noqa: F811
    """A follower catching up on a finished stream wrote its whole backlog without yielding (a
    socket's send rarely waits): 20 sockets x 64 resumes of one 400-token stream held a real
    server's loop for half the replay at a time. (A separate process: in-process, the client's own reading
    shares the loop and hides the difference.)"""
    async with aiohttp.ClientSession(base_url=demo_server.url) as session:
        async with session.post("/v1/completions", json={"model": "demo", "prompt": "ROMEO:", "max_tokens": 400,
                                                         "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
            stream_id = resp.headers["X-Stream-Id"]
        stalls: list[float] = []
        done = asyncio.Event()

        async def watch_health() -> None:
            while not done.is_set():
                started = time.monotonic()
                async with session.get("/health") as resp:
                    assert resp.status == 200
                stalls.append(time.monotonic() - started)
                await asyncio.sleep(0.05)

        async def replay_64() -> None:
            async with session.ws_connect("/ws/chat", max_msg_size=0) as ws:
                for _ in range(64):
                    await ws.send_json({"type": "resume", "stream_id": stream_id})
                ended = 0
                while ended < 64:
                    message = await ws.receive_json(timeout=120)
                    ended += message["type"] in ("done", "error")

        watcher = asyncio.create_task(watch_health())
        started = time.monotonic()
        await asyncio.gather(*[replay_64() for _ in range(20)])
        replay_s = time.monotonic() - started
        done.set()
        await watcher
        # Relative to the replay, so a slow host stretches both alike: without the yield one stall
        # held the loop for 0.46-0.63 of the replay (4.6-5.7 s of 7.9-12.2 s; an absolute 5 s bound
        # let two of four such runs pass), with it the largest is 0.16-0.18 (at most ~0.35 with the
        # host at half speed, in the full suite)
        assert max(stalls) < 0.4 * replay_s, (replay_s, sorted(stalls)[-5:])
