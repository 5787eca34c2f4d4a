"""The response cache on /v1/completions and /v1/chat/completions: the real app with auth on, the
real engine on a tiny model, the real openai SDK."""

from __future__ import annotations

import openai
import pytest

from api.services import SERVICES
from tests.api.test_streams import auth_stack
from tests.helpers import metric

PROMPT = {"model": "tiny", "prompt": "cache me if you can", "max_tokens": 6, "extra_body": {"ignore_eos": True}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 6,
        "extra_body": {"ignore_eos": True}}


@pytest.fixture
async def stack(aiohttp_server, llama_path, db):
    async with auth_stack(aiohttp_server, llama_path, db) as (server, client, app, key):
        yield server, client, key


def sdk(server, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


async def ran(client) -> float:
    """Generations that ran to their length (every request here asks for ignore_eos)."""
    return await metric(client.session, "galley_requests_total", status="length")


async def complete(api: openai.AsyncOpenAI, **extra) -> tuple[str | None, object]:
    raw = await api.completions.with_raw_response.create(**{**PROMPT, **extra})
    return raw.headers.get("X-Cache"), raw.parse()


async def stream_chat(api: openai.AsyncOpenAI, **extra) -> tuple[str | None, list]:
    raw = await api.chat.completions.with_raw_response.create(**{**CHAT, "stream": True, **extra})
    return raw.headers.get("X-Cache"), [chunk async for chunk in raw.parse()]


async def test_a_greedy_completion_is_answered_from_the_cache_the_second_time(stack):
    server, client, key = stack
    api = sdk(server, key)
    first_status, first = await complete(api, temperature=0)
    hits, runs = await metric(client.session, "galley_response_cache_hits_total"), await ran(client)
    second_status, second = await complete(api, temperature=0)
    assert (first_status, second_status) == ("miss", "hit")
    assert second.choices[0].text == first.choices[0].text and second.choices[0].finish_reason == "length"
    assert second.usage == first.usage and second.id != first.id and second.model == first.model
    assert await metric(client.session, "galley_response_cache_hits_total") == hits + 1
    assert await ran(client) == runs  # the engine did not run it

    streamed = await api.completions.with_raw_response.create(**PROMPT, temperature=0, stream=True,
                                                              stream_options={"include_usage": True})
    chunks = [chunk async for chunk in streamed.parse()]
    assert streamed.headers["X-Cache"] == "hit"  # streamed and not: one generation, one entry
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage == first.usage and not chunks[-1].choices

    for bypass in ({"extra_headers": {"Cache-Control": "no-cache"}},
                   {"extra_body": {**PROMPT["extra_body"], "galley": {"cache": False}}}):
        status, again = await complete(api, temperature=0, **bypass)
        assert status is None and again.choices[0].text == first.choices[0].text
    assert await ran(client) == runs + 2
    status, _ = await complete(api, temperature=0, max_tokens=5)
    assert status == "miss"  # max_tokens is part of the key


async def test_a_seeded_chat_stream_replays_the_same_text_from_the_cache(stack):
    server, client, key = stack
    api = sdk(server, key)
    seeded = {"temperature": 1.0, "seed": 7, "stream_options": {"include_usage": True}}
    first_status, first = await stream_chat(api, **seeded)
    runs = await ran(client)
    second_status, second = await stream_chat(api, **seeded)
    assert (first_status, second_status) == ("miss", "hit") and await ran(client) == runs

    def text(chunks) -> str:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert text(second) == text(first) != ""
    assert second[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in second if c.choices][-1] == "length"
    assert second[-1].usage == first[-1].usage and first[-1].usage.completion_tokens == 6
    assert {c.object for c in second} == {"chat.completion.chunk"} and len({c.id for c in second}) == 1
    assert second[0].id != first[0].id
    raw = await api.chat.completions.with_raw_response.create(**CHAT, temperature=1.0, seed=7)
    assert raw.headers["X-Cache"] == "hit" and raw.parse().choices[0].message.content == text(first)
    status, _ = await stream_chat(api, **{**seeded, "seed": 8})
    assert status == "miss"


async def test_sampling_without_a_seed_logprobs_and_conversations_are_never_cached(stack):
    server, client, key = stack
    api = sdk(server, key)
    hits, misses, runs = (await metric(client.session, "galley_response_cache_hits_total"),
                          await metric(client.session, "galley_response_cache_misses_total"), await ran(client))
    for _ in range(2):
        status, _ = await complete(api, temperature=0.8)
        assert status is None
        status, _ = await complete(api, temperature=0, logprobs=2)
        assert status is None
        raw = await api.chat.completions.with_raw_response.create(**CHAT, temperature=0, logprobs=True)
        assert "X-Cache" not in raw.headers
    status, conversation = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert status == 201
    for _ in range(2):
        body = {**CHAT["extra_body"], "conversation_id": conversation["id"]}
        raw = await api.chat.completions.with_raw_response.create(**{**CHAT, "extra_body": body}, temperature=0)
        assert "X-Cache" not in raw.headers
    assert await ran(client) == runs + 8
    assert await metric(client.session, "galley_response_cache_hits_total") == hits
    assert await metric(client.session, "galley_response_cache_misses_total") == misses


async def test_another_tenant_never_gets_a_cached_answer(stack):
    server, client, key = stack
    alice, bob = sdk(server, key), sdk(server, await client.new_key("bob"))
    assert (await complete(alice, temperature=0))[0] == "miss"
    assert (await complete(bob, temperature=0))[0] == "miss"
    assert (await complete(bob, temperature=0))[0] == "hit"
    assert (await complete(alice, temperature=0))[0] == "hit"


async def test_shared_across_tenants_lets_one_tenants_answer_serve_another(aiohttp_server, llama_path, db):
    from services.cache.response_cache import ResponseCacheConfig

    async with auth_stack(aiohttp_server, llama_path, db) as (server, client, app, key):
        app[SERVICES].cache.config = ResponseCacheConfig(shared_across_tenants=True)  # as [response_cache] sets it
        alice, bob = sdk(server, key), sdk(server, await client.new_key("bob"))
        miss, first = await complete(alice, temperature=0)
        hit, second = await complete(bob, temperature=0)
        assert (miss, hit) == ("miss", "hit") and second.choices[0].text == first.choices[0].text
        walled = sdk(server, await client.new_key("walled", allowed_models=["other"]))
        with pytest.raises(openai.PermissionDeniedError):  # access to the model is checked before the cache
            await complete(walled, temperature=0)
