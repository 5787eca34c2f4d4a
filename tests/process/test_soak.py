"""What a loopback soak of a real `python server.py` found: when the drain's time runs out, the
requests it interrupts that are not resumable streams (non-streamed completions, chats and native
generations, queued or half done; native and n > 1 streams) got a 500 `generation_failed` as if
the engine had failed. Shutting down is no server error: each client gets 503
`server_shutting_down` with Retry-After (or that code in its stream's final error event), and the
access log has no 500."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from tests.process.test_drain import admitted, wait_for
from tests.process.test_server_process import ServerProcess

DRAIN_S = 1.0
LONG = {"model": "demo", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Good morrow"}]
PLAIN = [  # non-streamed: interrupted, the client gets a plain HTTP error
    ("/v1/completions", {**LONG, "prompt": "KING:"}),
    ("/v1/chat/completions", {**LONG, "messages": CHAT}),
    ("/v1/chat/completions", {**LONG, "messages": CHAT, "n": 2}),
    ("/api/v1/generate", {**LONG, "prompt": "KING:"}),
]
STREAMED = [  # not resumable: interrupted, a final error event (or a plain error before the first token)
    ("/api/v1/generate", {**LONG, "prompt": "QUEEN:", "stream": True}),
    ("/v1/chat/completions", {**LONG, "messages": CHAT, "n": 2, "stream": True}),
]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "galley.toml"
    path.write_text(f"[server]\ndrain_seconds = {DRAIN_S}\n")
    return str(path)


async def outcome(session: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, str | None, dict]:
    """(status, Retry-After, the error the client was left with)."""
    async with session.post(path, json=body) as resp:
        if not body.get("stream") or resp.status != 200:
            return resp.status, resp.headers.get("Retry-After"), (await resp.json()).get("error", {})
        last = {}
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                last = json.loads(line[6:])
        return resp.status, None, last.get("error", {})


async def test_requests_the_drain_interrupts_get_503_server_shutting_down_not_500(tmp_path, config):
    # one sequence at a time: on a quiet 2-core machine two at a time finished 3 of the 6 within the drain
    server = ServerProcess("--config", config, "--max-num-seqs", "1", data_dir=tmp_path)
    try:
        server.wait_ready()
        async with aiohttp.ClientSession(base_url=server.url) as session:
            calls = PLAIN + STREAMED
            pending = [asyncio.ensure_future(outcome(session, path, body)) for path, body in calls]
            await wait_for(lambda: admitted(session, len(calls) + 2))  # n = 2 twice: two more
            server.proc.send_signal(signal.SIGTERM)
            sigterm_s = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*pending), 60)
            interrupted = 0
            for (path, body), (status, retry_after, error) in zip(calls, ends, strict=True):
                if status == 200 and not error:
                    continue  # a fast machine may finish one within the drain: that is what it is for
                interrupted += 1
                assert error.get("code") == "server_shutting_down", (path, body, status, error)
                if status != 200:  # ended before its first event: a plain 503 to retry
                    assert status == 503 and int(retry_after) >= 1, (path, status, retry_after)
            assert interrupted >= len(calls) - 2, ends
            assert server.proc.wait(timeout=30) == 0
            assert time.monotonic() - sigterm_s < DRAIN_S + 10
    finally:
        server.stop()
    log = [json.loads(line) for line in server.output if line.startswith("{")]
    assert [e for e in log if e.get("status") == 500 or e.get("event") == "unhandled error"] == []
