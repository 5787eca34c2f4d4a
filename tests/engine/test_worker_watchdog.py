"""The device worker survives failures outside the engine's own guards, and readiness sees a
stuck one (issue 11, found by reading).

The worker hands events to the server through its `emit` callback; here that callback is the
server's own (events onto the loop, into the router) with a switch that makes it raise once (as
a closed loop does) or block (as a stuck consumer would). Everything else is the real stack: the
worker thread, the engine, the app and an HTTP client.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from engine.model_runner import CacheConfig
from launch import EngineConfig
from scheduling.router import Router
from tests.helpers import make_app, metric, start_models, wait_until

SECRET = "/srv/secret/path"  # must never reach a client


class SwitchedEmit:
    def __init__(self, loop: asyncio.AbstractEventLoop, router: Router) -> None:
        self.loop = loop
        self.router = router
        self.fail_next = threading.Event()
        self.hold = threading.Event()  # set: emit blocks until `release`
        self.release = threading.Event()

    def __call__(self, events) -> None:
        if self.fail_next.is_set():
            self.fail_next.clear()
            raise RuntimeError(f"emit failed, see {SECRET}")
        if self.hold.is_set():
            self.release.wait(60)
        self.loop.call_soon_threadsafe(self.router.dispatch, events)


@pytest.fixture
async def stack(aiohttp_server, llama_path):
    loop = asyncio.get_running_loop()
    router = Router()
    emit = SwitchedEmit(loop, router)
    cfg = EngineConfig(max_num_seqs=8, cache=CacheConfig(kv_cache_gib=0.05), worker_stall_seconds=0.5)
    workers = await loop.run_in_executor(None, start_models, [("tiny", str(llama_path))], cfg, 64, router, emit)
    server = await aiohttp_server(make_app(router))
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        yield session, emit, workers[0]
    emit.release.set()
    for worker in workers:
        worker.stop()


BODY = {"model": "tiny", "prompt": "The quick brown fox", "temperature": 0, "ignore_eos": True, "stream": True}


async def stream_events(session: aiohttp.ClientSession, max_tokens: int, on_first=None) -> list[dict]:
    events = []
    async with session.post("/v1/completions", json={**BODY, "max_tokens": max_tokens}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[6:]))
                if len(events) == 1 and on_first is not None:
                    on_first()
    return events


async def ready(session: aiohttp.ClientSession) -> tuple[int, dict]:
    async with session.get("/ready") as resp:
        return resp.status, await resp.json()


async def wait_ready(session: aiohttp.ClientSession, status: int, timeout_s: float = 20.0) -> dict:
    async def answered() -> dict | None:
        got, body = await ready(session)
        return body if got == status else None

    return await wait_until(answered, timeout_s=timeout_s, what=f"/ready to answer {status}")


async def test_a_failure_in_the_worker_loop_fails_that_engines_requests_and_the_worker_lives_on(stack):
    session, emit, worker = stack
    events = await asyncio.wait_for(stream_events(session, 200, on_first=emit.fail_next.set), 30)
    error = events[-1]["error"]
    assert error["code"] == "generation_failed" and SECRET not in json.dumps(events)
    assert len(events) < 200
    assert (await ready(session))[0] == 200
    assert await metric(session, "galley_engine_step_errors_total", model="tiny") >= 1
    after = await asyncio.wait_for(stream_events(session, 8), 30)  # the worker still steps
    assert after[-1]["choices"][0]["finish_reason"] == "length"
    assert worker.is_responsive()


async def test_ready_says_503_while_a_worker_is_stuck(stack):
    session, emit, worker = stack
    assert await ready(session) == (200, {"status": "ok"})
    emit.hold.set()
    streaming = asyncio.ensure_future(stream_events(session, 8))
    assert await wait_ready(session, 503) == {"status": "stalled"}
    assert not worker.is_responsive()
    emit.release.set()
    emit.hold.clear()
    await wait_ready(session, 200)
    events = await asyncio.wait_for(streaming, 30)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
