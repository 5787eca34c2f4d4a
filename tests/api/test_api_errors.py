"""What the API answers when a request is wrong or the server is full, through the real app and
engine on the tiny model: OpenAI-shaped 400s and 404s that name the field at fault, malformed and
oversized bodies, 429 with Retry-After at the queue bound (only 200s and 429s under overload, the
health check still up), 503 on a queue timeout, and a client that leaves aborting its request and
freeing its KV blocks."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.api import test_api
from tests.api.test_api import scrape, start_server, wait_blocks_free

served = test_api.served  # fixture: the server and its router (conftest's `served` is the server alone)


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "tiny", "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10_000}, 400, "maximum context length is 512"),
        ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
        ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "nope", "prompt": "x"}, 404, "nope"),
        ({"prompt": "x"}, 400, "model"),
    ],
)
async def test_bad_input_gets_openai_shaped_error(served, body, status, needle):
    server, _ = served
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url("/v1/completions"), json=body) as resp:
            data = await resp.json()
    assert resp.status == status
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert needle in data["error"]["message"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 0}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, "tools"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ("/v1/responses", {"model": "tiny", "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_a_check_across_fields_names_the_field_at_fault(served, path, body, param):
    """As OpenAI's 400s do, so a client can point at the field; not `null` because the check looks at two."""
    server, _ = served
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url(path), json=body) as resp:
            data = await resp.json()
    assert resp.status == 400, data
    assert data["error"]["param"] == param and data["error"]["type"] == "invalid_request_error", data


async def test_long_prompt_error_names_the_numbers(served):
    server, _ = served
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server.make_url("/v1/completions"),
                                  json={"model": "tiny", "prompt": [3 + i % 300 for i in range(597)]})
        error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "context_length_exceeded"
    assert "512" in error["message"] and "597" in error["message"]


async def test_malformed_and_oversized_bodies(served):
    server, _ = served
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server.make_url("/v1/chat/completions"), data=b"{not json")
        assert resp.status == 400 and "JSON" in (await resp.json())["error"]["message"]
        resp = await session.post(server.make_url("/v1/chat/completions"), data=b"[1]")
        assert resp.status == 400
        resp = await session.post(server.make_url("/v1/completions"), data=b"x" * (9 * 1024 * 1024))
        assert resp.status == 413 and "error" in await resp.json()
        resp = await session.get(server.make_url("/v1/nothing"))
        assert resp.status == 404 and "error" in await resp.json()


async def test_client_disconnect_aborts_and_frees_blocks(served):
    server, router = served
    body = {"model": "tiny", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server.make_url("/v1/completions"), json=body)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= 5:
                break
        resp.close()
    await wait_blocks_free(router)
    assert router.num_in_flight == 0


async def test_a_client_giving_up_on_a_json_answer_aborts_it(aiohttp_server, long_context_dir):
    """3,500 tokens take seconds even on a fast host (400 once finished inside the client's 0.3 s)."""
    server, router, workers = await start_server(aiohttp_server, long_context_dir)
    body = {"model": "tiny", "prompt": "go", "max_tokens": 3500, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(server.make_url("/v1/completions"), json=body)
        await wait_blocks_free(router)
        assert router.num_in_flight == 0
        async with aiohttp.ClientSession() as session:
            async with session.get(server.make_url("/metrics")) as resp:
                counted = scrape(await resp.text())
        ended = {dict(labels)["status"]: n for (name, labels), n in counted.items() if name == "galley_requests_total"}
        assert ended == {"cancelled": 1.0}  # aborted, not run to its 3,500 tokens
    finally:
        for worker in workers:
            worker.stop()


async def test_queue_bound_answers_429_with_retry_after(aiohttp_server, llama_path):
    server, router, workers = await start_server(aiohttp_server, llama_path, max_num_seqs=1, max_waiting=0)
    body = {"model": "tiny", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            first = await session.post(server.make_url("/v1/completions"), json=body)
            assert first.status == 200
            second = await session.post(server.make_url("/v1/completions"), json=body)
            assert second.status == 429
            assert second.headers["Retry-After"] == "1"
            assert (await second.json())["error"]["code"] == "queue_full"
            first.close()
            text = await (await session.get(server.make_url("/metrics"))).text()
            assert scrape(text)[("galley_rejected_total", (("model", "tiny"), ("reason", "queue_full")))] == 1
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


async def test_overload_gives_only_200s_and_429s_and_health_stays_up(aiohttp_server, llama_path):
    server, router, workers = await start_server(aiohttp_server, llama_path, max_num_seqs=4, max_waiting=8)
    # long enough that no admitted request finishes before all 40 have arrived
    body = {"model": "tiny", "prompt": "go", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    try:
        async with aiohttp.ClientSession() as session:
            async def one():
                async with session.post(server.make_url("/v1/completions"), json=body) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()

            async def health():
                async with session.get(server.make_url("/health")) as resp:
                    return resp.status

            results, health_status = await asyncio.gather(asyncio.gather(*(one() for _ in range(40))), health())
        statuses = sorted(status for status, _, _ in results)
        assert set(statuses) == {200, 429}
        assert statuses.count(200) == 12  # 4 running + 8 waiting
        for status, retry_after, data in results:
            if status == 429:
                assert retry_after == "1" and data["error"]["code"] == "queue_full"
            else:
                assert data["usage"]["completion_tokens"] == 200 and data["choices"][0]["finish_reason"] == "length"
        assert health_status == 200
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


async def test_queue_timeout_gives_503_and_frees_the_slot(aiohttp_server, llama_path):
    server, router, workers = await start_server(aiohttp_server, llama_path, max_num_seqs=1)
    router.queue_timeout_s = 0.3
    long = {"model": "tiny", "prompt": "go", "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            first = await session.post(server.make_url("/v1/completions"), json=long)
            await first.content.readline()
            second = await session.post(server.make_url("/v1/completions"), json={**long, "stream": False})
            data = await second.json()
            assert second.status == 503 and data["error"]["code"] == "queue_timeout"
            assert "queue_timeout_seconds" in data["error"]["message"]
            first.close()
        await wait_blocks_free(router)
        assert router.num_in_flight == 0
    finally:
        for worker in workers:
            worker.stop()
