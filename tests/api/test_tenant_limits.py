"""Tenant limits, priority and fair share through the real server with API keys and the real engine."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import Client, auth_app
from tests.helpers import start_tiny_engines


@pytest.fixture
async def stack(aiohttp_server, llama_path, db):
    router, workers = await start_tiny_engines(llama_path)
    server = await aiohttp_server(auth_app(db, router))
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        yield server, Client(session), router
    await wait_blocks_free(router)
    for worker in workers:
        worker.stop()


def sdk(server, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


async def test_model_and_priority_permissions(stack):
    server, client, _ = stack
    key = await client.new_key("limited", allowed_models=["other"], max_priority="normal")
    assert (await sdk(server, key).models.list()).data == []
    with pytest.raises(openai.PermissionDeniedError, match="tiny"):
        await sdk(server, key).completions.create(model="tiny", prompt="hi", max_tokens=2)
    await client.admin("PATCH", "/tenants/limited", json={"allowed_models": ["tiny"]})
    with pytest.raises(openai.PermissionDeniedError, match="priority"):
        await sdk(server, key).completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                  extra_body={"priority": "high"})
    out = await sdk(server, key).completions.create(model="tiny", prompt="hi", max_tokens=2,
                                                    extra_body={"priority": "low", "ignore_eos": True})
    assert out.usage.completion_tokens == 2


async def test_max_tokens_cap(stack):
    server, client, _ = stack
    key = await client.new_key("capped", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="cap of 5"):
        await sdk(server, key).completions.create(model="tiny", prompt="hi", max_tokens=10)
    chat = await sdk(server, key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


async def test_defaults_fit_the_tenant_a_request_that_says_nothing_is_served(stack):
    """A tenant capped at `low` and at 5 tokens need not say so: the default priority is its
    ceiling and the default max_tokens (16 for completions, 128 native) its cap."""
    server, client, _ = stack
    key = await client.new_key("modest", max_priority="low", max_tokens=5)
    out = await sdk(server, key).completions.create(model="tiny", prompt="hi", extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    chat = await sdk(server, key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5
    status, body = await client.call("POST", "/api/v1/generate", key,
                                     json={"model": "tiny", "prompt": "hi", "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 5, body
    with pytest.raises(openai.PermissionDeniedError, match="priority"):  # asking above the ceiling still fails
        await sdk(server, key).completions.create(model="tiny", prompt="hi", extra_body={"priority": "normal"})


async def test_tokens_per_minute_gives_429_then_recovers(stack):
    server, client, _ = stack
    key = await client.new_key("metered", tokens_per_minute=120)  # refills 2 tokens a second
    client_sdk = sdk(server, key)
    ok = 0
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(20):
            await client_sdk.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=17,
                                                extra_body={"ignore_eos": True})
            ok += 1
    assert ok == 6  # 6 x (3 + 17) = 120
    body = exc.value.body
    assert body["code"] == "tokens_per_minute" and "tokens_per_minute" in body["message"]
    retry_after = int(exc.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 10
    await asyncio.sleep(retry_after)
    out = await client_sdk.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=17,
                                              extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 17


async def test_cache_hits_count_against_requests_per_minute(stack):
    """An answer from the response cache is still a request: a tenant over its rate gets the same 429."""
    server, client, _ = stack
    key = await client.new_key("cached", requests_per_minute=2)
    client_sdk = sdk(server, key)
    ask = dict(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    first = await client_sdk.completions.with_raw_response.create(**ask)
    second = await client_sdk.completions.with_raw_response.create(**ask)
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("miss", "hit")
    assert second.parse().choices[0].text == first.parse().choices[0].text
    with pytest.raises(openai.RateLimitError) as exc:
        await client_sdk.completions.create(**ask)
    assert exc.value.body["code"] == "requests_per_minute" and int(exc.value.response.headers["Retry-After"]) >= 1
    native = await client.new_key("cached-native", requests_per_minute=2)  # the native API's cache likewise
    statuses = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {native}"}) as session:
        for _ in range(3):
            async with session.post(server.make_url("/api/v1/generate"),
                                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}) as resp:
                statuses.append((resp.status, resp.headers.get("X-Cache")))
    assert statuses[:2] == [(200, "miss"), (200, "hit")] and statuses[2][0] == 429


async def test_max_concurrent(stack):
    server, client, _ = stack
    key = await client.new_key("single", max_concurrent=1)
    client_sdk = sdk(server, key)
    stream = await client_sdk.completions.create(model="tiny", prompt="hi", max_tokens=300, stream=True,
                                                 extra_body={"ignore_eos": True})
    await anext(aiter(stream))
    with pytest.raises(openai.RateLimitError, match="max_concurrent"):
        await client_sdk.completions.create(model="tiny", prompt="hi", max_tokens=2)
    await stream.close()


async def test_under_served_tenant_is_not_stuck_behind_a_backlog(stack):
    """A opens 24 streams on 8 slots, then B opens 4: B starts long before A's backlog drains."""
    server, client, _ = stack
    a, b = sdk(server, await client.new_key("A")), sdk(server, await client.new_key("B"))
    finished_a: list[float] = []
    first_b: list[float] = []

    async def stream(client_sdk, log: list[float], first_only: bool):
        response = await client_sdk.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=150,
                                                       stream=True, extra_body={"ignore_eos": True})
        async for _ in response:
            if first_only:
                log.append(time.monotonic())
                first_only = False
        if log is finished_a:
            log.append(time.monotonic())

    tasks = [asyncio.create_task(stream(a, finished_a, False)) for _ in range(24)]
    await asyncio.sleep(0.2)
    tasks += [asyncio.create_task(stream(b, first_b, True)) for _ in range(4)]
    await asyncio.gather(*tasks)
    assert len(first_b) == 4
    # under FIFO B would wait until 16 of A's streams had finished; fair share lets it in within a quantum
    assert sum(t < max(first_b) for t in finished_a) <= 8
