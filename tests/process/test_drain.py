"""SIGTERM on a real `python server.py`: while it drains, new work is refused (503 + Retry-After,
HTTP and WebSocket, generations and encoders) and idle sockets close; after `drain_seconds`
what is left is interrupted (each client gets a final error), checkpointed, and the process
exits 0 at once; a restart resumes the interrupted conversation to its end."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from tests.helpers import metric, wait_until
from tests.process.test_server_process import ServerProcess

DRAIN_S = 4.0
QUEUED = 24  # x 480 tokens, one at a time: far longer than DRAIN_S (the demo model decodes ~300 tok/s here)
LONG = {"max_tokens": 480, "temperature": 0, "ignore_eos": True}


async def sse_data(resp: aiohttp.ClientResponse) -> list:
    """Every `data:` payload of an SSE response, parsed (`[DONE]` kept as the string)."""
    out = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


async def stream_to_end(session: aiohttp.ClientSession, i: int) -> tuple[int, dict | str]:
    """(status, the last SSE payload or the error body) of one long plain completion."""
    async with session.post("/v1/completions", json={"model": "demo", "prompt": f"KING {i}:", "stream": True,
                                                     **LONG}) as resp:
        if resp.status != 200:
            return resp.status, (await resp.json())["error"]
        return resp.status, (await sse_data(resp))[-1]


async def admitted(session: aiohttp.ClientSession, count: int) -> bool:
    return await metric(session, "galley_admitted_total", model="demo") >= count


async def refused_while_draining(session: aiohttp.ClientSession, path: str, body: dict) -> None:
    async with session.post(path, json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 503, (path, error)
        assert error["code"] == "server_draining" and int(resp.headers["Retry-After"]) >= 1, (path, error)


async def ws_message(ws: aiohttp.ClientWebSocketResponse, timeout_s: float = 60.0) -> aiohttp.WSMessage:
    return await asyncio.wait_for(ws.receive(), timeout_s)


async def wait_for(check, timeout_s: float = 30.0) -> None:
    await wait_until(check, timeout_s=timeout_s, every_s=0.1)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "galley.toml"
    path.write_text(f"[server]\ndrain_seconds = {DRAIN_S}\n")
    return str(path)


async def test_drain_refuses_new_work_then_interrupts_what_is_left_and_a_restart_resumes_it(tmp_path, config):
    server = ServerProcess("--config", config, "--max-num-seqs", "1", data_dir=tmp_path)
    try:
        server.wait_ready()
        async with aiohttp.ClientSession(base_url=server.url) as session:
            # in flight at SIGTERM: more plain streams than the drain has time for (one sequence runs
            # at a time) and a WebSocket conversation queued behind them; plus an idle socket
            plain = [asyncio.ensure_future(stream_to_end(session, i)) for i in range(QUEUED)]
            await wait_for(lambda: admitted(session, QUEUED))
            idle = await session.ws_connect("/ws/chat")
            busy = await session.ws_connect("/ws/chat")
            await busy.send_json({"type": "chat", "model": "demo", "content": "Good morrow",
                                  "params": {**LONG, "max_tokens": 60}})
            started = (await ws_message(busy)).json()
            assert started["type"] == "start", started
            await wait_for(lambda: admitted(session, QUEUED + 1))

            server.proc.send_signal(signal.SIGTERM)
            sigterm_s = time.monotonic()

            async def not_ready() -> bool:
                async with session.get("/ready") as resp:
                    return resp.status == 503
            await wait_for(not_ready)
            for path, body in [
                ("/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2}),
                ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                          "stream": True}),
                ("/api/v1/generate", {"model": "demo", "prompt": "hi", "max_tokens": 2}),
                ("/v1/embeddings", {"model": "minilm", "input": "hi"}),
                ("/api/v1/conversations", {"model": "demo"}),
            ]:
                await refused_while_draining(session, path, body)
            await busy.send_json({"type": "chat", "model": "demo", "content": "hi", "params": {"max_tokens": 2}})
            refused = (await ws_message(busy)).json()
            assert (refused["type"], refused["code"]) == ("error", "server_draining"), refused
            closed = await ws_message(idle, 10)  # the idle socket was closed at drain start, not at its end
            assert (closed.type, closed.data) == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.GOING_AWAY)
            assert time.monotonic() - sigterm_s < DRAIN_S

            # the drain deadline: both get a final error, the busy socket closes, the process exits 0 at once
            ending = [(await ws_message(busy, 30)).json()]
            while ending[-1]["type"] == "token":
                ending.append((await ws_message(busy, 30)).json())
            assert ending[-1]["type"] == "error" and ending[-1]["code"] == "server_shutting_down", ending[-1]
            assert (await ws_message(busy, 10)).type == aiohttp.WSMsgType.CLOSE
            ends = await asyncio.wait_for(asyncio.gather(*plain), 30)
            interrupted = [(status, last) for status, last in ends if last != "[DONE]"]
            assert len(interrupted) >= QUEUED // 2, ends  # the drain ends them, it does not wait for them all
            for status, last in interrupted:
                # a stream that had begun ends with an error event; one still queued with a plain 503
                error = last["error"] if status == 200 else last
                assert status in (200, 503) and error["code"] == "server_shutting_down", (status, last)
            assert server.proc.wait(timeout=30) == 0
            assert time.monotonic() - sigterm_s < DRAIN_S + 10, "the drain was not bounded"
    finally:
        server.stop()

    again = ServerProcess("--config", config, data_dir=tmp_path)  # the same data dir
    try:
        again.wait_ready()
        async with aiohttp.ClientSession(base_url=again.url) as session:
            async with session.get(f"/api/v1/streams/{started['stream_id']}") as resp:
                assert resp.status == 200
                events = await asyncio.wait_for(sse_data(resp), 120)
            assert events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
            async with session.get(f"/api/v1/conversations/{started['conversation_id']}") as resp:
                messages = (await resp.json())["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"] == text
    finally:
        assert again.stop() == 0
