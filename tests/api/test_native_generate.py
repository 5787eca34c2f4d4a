"""Native generation over HTTP (POST /api/v1/generate, /api/v1/models/{name}/generate): the real
app and engine on a tiny Llama, read with a real aiohttp client as SSE and as JSON."""

from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.api.test_api import start_server, wait_blocks_free
from tests.engine.test_reference import hf_greedy


@pytest.fixture
async def served(aiohttp_server, llama_path):
    server, router, workers = await start_server(aiohttp_server, llama_path)
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        yield session, router
    await wait_blocks_free(router)
    for worker in workers:
        worker.stop()


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict]:
    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: "):]))
    return events


async def metric_sum(http: aiohttp.ClientSession, name: str) -> float:
    async with http.get("/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def generations(http: aiohttp.ClientSession) -> float:
    return await metric_sum(http, "galley_requests_total")


async def test_streamed_tokens_then_done_equal_the_json_answer_and_hf(served, llama_path):
    http, _ = served
    body = {"prompt": "The quick brown", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    async with http.post("/api/v1/models/tiny/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Model-Version"] == "tiny@1"
        events = await sse_events(resp)
    *tokens, done = events
    assert tokens and all(set(e) == {"token"} for e in tokens)
    assert done["type"] == "done" and done["finish_reason"] == "length" and done["model_version"] == "1"
    assert done["usage"]["completion_tokens"] == 10
    async with http.post("/api/v1/generate", json={**body, "model": "tiny"}) as resp:
        answer = await resp.json()
    assert resp.status == 200
    assert answer["text"] == "".join(e["token"] for e in tokens)
    assert answer["usage"] == done["usage"] and answer["model_version"] == "1" and answer["model"] == "tiny"
    async with http.post("/api/v1/generate", json={**body, "model": "tiny@1", "galley": {"cache": False}}) as resp:
        pinned = await resp.json()
    assert resp.status == 200 and pinned["text"] == answer["text"]  # name@version goes through routing
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    expected = hf_greedy(llama_path, tokenizer.encode("The quick brown"), 10)
    assert answer["text"] == tokenizer.decode(expected, skip_special_tokens=True)


async def test_greedy_answers_come_from_the_cache_unless_bypassed(served):
    http, _ = served
    body = {"model": "tiny", "prompt": "cache this", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    answers = []
    for extra, headers in (({}, {}), ({}, {}), ({"galley": {"cache": False}}, {}), ({}, {"Cache-Control": "no-cache"}),
                           ({"seed": 3, "temperature": 1.0}, {}), ({"seed": 3, "temperature": 1.0}, {})):
        before = await generations(http)
        async with http.post("/api/v1/generate", json={**body, **extra}, headers=headers) as resp:
            answers.append(((await resp.json())["text"], await generations(http) - before))
    assert [ran for _, ran in answers] == [1, 0, 1, 1, 1, 0]
    assert len({text for text, _ in answers[:4]}) == 1 and answers[4][0] == answers[5][0]
    assert await metric_sum(http, "galley_response_cache_hits_total") == 2
    before = await generations(http)
    for _ in range(2):
        async with http.post("/api/v1/generate", json={**body, "temperature": 1.0}) as resp:
            assert resp.status == 200
    assert await generations(http) == before + 2  # unseeded sampling is never cached


async def test_generate_errors(served):
    http, _ = served
    cases = [
        ({"prompt": "x"}, "/api/v1/generate", 400, "model"),
        ({"model": "nope", "prompt": "x"}, "/api/v1/generate", 404, "nope"),
        ({"model": "other", "prompt": "x"}, "/api/v1/models/tiny/generate", 400, "model: Extra inputs"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10_000}, "/api/v1/generate", 400, "maximum context length"),
        ({"model": "tiny", "prompt": [10**6]}, "/api/v1/generate", 400, "token ids"),
        ({"model": "tiny", "prompt": "x", "temperature": 5}, "/api/v1/generate", 400, "temperature"),
    ]
    for body, path, status, needle in cases:
        async with http.post(path, json=body) as resp:
            error = await resp.json()
        assert resp.status == status, (body, error)
        assert needle in error["error"]["message"]
