"""A client that leaves mid-stream is a normal end: no unhandled error, no 500, the request logged
as 499 and its generation counted as cancelled. Every SSE writer and the WebSocket forwarder.

Each test runs twice: with aiohttp cancelling the handler when the connection is lost (as
server.py runs it), and without (the handler runs on and its next write meets the closed
transport: the race a soak test hit 2 times in 543 with cancellation on happens here on every
request)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import pytest
import structlog
from aiohttp import web

from api.services import SERVICES
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.api.test_streams import read_events
from tests.helpers import make_app, metric, start_tiny_engines, wait_until

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(params=[True, False], ids=["cancelling", "running-on"])
async def stack(request, llama_path, db):
    router, workers = await start_tiny_engines(llama_path)
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN))
    runner = web.AppRunner(app, handler_cancellation=request.param, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            client = Client(session)
            yield client, await client.new_key("alice"), app
        await wait_blocks_free(router)
    finally:
        await runner.cleanup()
        for worker in workers:
            worker.stop()


@dataclass
class Logs:
    entries: list[dict]  # ours (structlog)
    caplog: pytest.LogCaptureFixture  # aiohttp's own ("Error handling request")

    def errors(self) -> list[str]:
        ours = [e["event"] for e in self.entries if e.get("log_level") in ("error", "critical")]
        return ours + [r.getMessage() for r in self.caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def logs(caplog):
    with structlog.testing.capture_logs() as entries:
        yield Logs(entries, caplog)


async def request_logged(logs: Logs, path: str, timeout_s: float = 30.0) -> dict:
    """The access-log entry of the (one) request to `path`, once its handler has ended."""
    found = await wait_until(lambda: [e for e in logs.entries if e["event"] == "request" and e.get("path") == path],
                             timeout_s=timeout_s, what=f"the request log of {path}")
    return found[-1]


async def cancelled(client, model: str = "tiny") -> float:
    return await metric(client.session, "galley_requests_total", model=model, status="cancelled")


async def leave_after(client, key: str, path: str, body: dict, events: int) -> None:
    """POST a streamed request, read `events` SSE events, then drop the connection."""
    resp = await client.session.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
    assert resp.status == 200, await resp.text()
    for _ in range(events):
        assert (await resp.content.readuntil(b"\n\n")).strip()
    resp.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "Once upon", **LONG}),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, **LONG}),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "n": 2, **LONG}),  # n > 1: its own writer
    ("/api/v1/generate", {"model": "tiny", "prompt": "Once upon", **LONG}),  # the native writer
], ids=["completions", "chat", "chat-n2", "native"])
async def test_leaving_mid_stream_is_a_quiet_cancel(stack, logs, path, body):
    client, key, _ = stack
    before = await cancelled(client)
    await leave_after(client, key, path, body, events=3)
    entry = await request_logged(logs, path)
    assert entry["status"] == 499, entry
    assert logs.errors() == []
    expected = before + body.get("n", 1)
    async def counted() -> bool:
        return await cancelled(client) >= expected

    await wait_until(counted, what="the generation to be counted as cancelled")


async def test_leaving_a_resumed_stream_is_quiet_and_the_conversation_goes_on(stack, logs):
    client, key, app = stack
    status, conv = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert status == 201
    resp = await client.session.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"model": "tiny", "messages": MESSAGES, "conversation_id": conv["id"],
                                           **LONG, "max_tokens": 200})
    stream_id = resp.headers["X-Stream-Id"]
    await read_events(resp, limit=2)
    resp.close()
    path = f"/api/v1/streams/{stream_id}"
    async with client.session.get(path, headers={"Authorization": f"Bearer {key}"}) as again:
        await read_events(again, limit=3)
        again.close()
    entry = await request_logged(logs, path)
    assert entry["status"] == 499, entry
    assert logs.errors() == []
    async with client.session.get(path, headers={"Authorization": f"Bearer {key}"}) as whole:
        events = await read_events(whole)
    assert events[-1][1] == "[DONE]"  # the conversation's stream went on to its end


async def test_a_websocket_dropped_mid_stream_ends_quietly(stack, logs):
    client, key, app = stack
    ws = await client.session.ws_connect("/ws/chat", headers={"Authorization": f"Bearer {key}"})
    await ws.send_json({"type": "chat", "model": "tiny", "content": "Tell me a story",
                        "params": {"max_tokens": 400, "temperature": 0, "ignore_eos": True,
                                   "galley": {"on_disconnect": "cancel"}}})
    for _ in range(3):
        await asyncio.wait_for(ws.receive_json(), 30)
    ws._response.connection.transport.abort()  # gone without a close frame
    entry = await request_logged(logs, "/ws/chat")
    assert entry["status"] in (101, 499), entry
    assert logs.errors() == []
    await wait_until(lambda: all(live.done for live in app[SERVICES].streams.live.values()),
                     what="the stream to be cancelled")
    await ws.close()
