"""The real app, the real engine on a tiny model, real clients (openai SDK, aiohttp): what
well-formed requests get (streams, n > 1, logprobs, stop strings and seeds, two workers, metrics,
/openapi.json, health), and the helpers other HTTP tests import (`start_server`, `client`,
`wait_blocks_free`, `scrape`). Wrong requests and a full server: test_api_errors.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import AutoTokenizer

from api.openai import objects
from scheduling.router import Router
from tests.engine.test_reference import hf_greedy, prompts
from tests.helpers import make_app, metric, start_tiny_engines, wait_until


async def wait_blocks_free(router: Router, timeout_s: float = 5.0) -> None:
    """Every KV block of every replica is back in its pool (polled: the worker frees them)."""
    def leaked() -> list[tuple[str, int]]:
        return [(r.device, kv.num_blocks - kv.num_free_blocks) for m in router.served_models() for r in m.replicas
                if (kv := r.worker.engines[r.engine_id].scheduler.kv).num_free_blocks != kv.num_blocks]

    await wait_until(lambda: not leaked(), timeout_s=timeout_s, what="every KV block back in its pool")


async def start_server(aiohttp_server, path, devices=("cpu",), max_num_seqs=32, max_waiting=64, **engine_kw):
    router, workers = await start_tiny_engines(path, max_num_seqs, max_waiting, devices=devices, **engine_kw)
    server = await aiohttp_server(make_app(router))  # TestServer cancels handlers on disconnect
    return server, router, workers


@pytest.fixture
async def served(aiohttp_server, llama_path):
    """(server, router): this file's (and test_api_errors.py's); conftest's `served` is the server alone."""
    server, router, workers = await start_server(aiohttp_server, llama_path)
    yield server, router
    await wait_blocks_free(router)
    for worker in workers:
        worker.stop()


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)


async def test_openai_sdk_lists_models_and_streams_chat(served):
    server, _ = served
    sdk = client(server)
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    messages = [{"role": "user", "content": "Hello there"}]
    stream = await sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = await sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    ChatCompletion.model_validate(whole.model_dump())
    assert whole.choices[0].message.content == streamed
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


async def test_sixteen_concurrent_streams_match_hf(served, llama_path):
    server, _ = served
    sdk = client(server)
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    batch = prompts(16, len(tokenizer), lengths=[5, 30, 12, 21, 8, 3, 17, 26])

    async def one(prompt):
        text = ""
        async for chunk in await sdk.completions.create(
            model="tiny", prompt=prompt, max_tokens=14, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        ):
            # openai's Completion type has no null finish_reason, which streamed chunks carry
            objects.Completion.model_validate(chunk.model_dump())
            assert chunk.object == "text_completion"
            text += chunk.choices[0].text
        return text

    texts = await asyncio.gather(*(one(p) for p in batch))
    expected = [tokenizer.decode(hf_greedy(llama_path, p, 14), skip_special_tokens=True) for p in batch]
    assert texts == expected


async def test_stop_string_and_seed_over_http(served):
    server, _ = served
    sdk = client(server)
    base = dict(model="tiny", prompt="The quick brown", max_tokens=20, temperature=0,
                extra_body={"ignore_eos": True})
    full = (await sdk.completions.create(**base)).choices[0].text
    stop = full[5:8]
    cut = await sdk.completions.create(**base, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    seeded = dict(base, temperature=1.0, seed=7)
    a = (await sdk.completions.create(**seeded)).choices[0].text
    b = (await sdk.completions.create(**seeded)).choices[0].text
    assert a == b


async def test_n_choices(served):
    server, _ = served
    sdk = client(server)
    base = dict(model="tiny", prompt="The quick brown", max_tokens=6, extra_body={"ignore_eos": True})
    greedy = (await sdk.completions.create(**base, temperature=0)).choices[0].text
    two = await sdk.completions.create(**base, temperature=0, n=2, logprobs=1)
    assert [c.index for c in two.choices] == [0, 1] and {c.text for c in two.choices} == {greedy}
    assert all(len(c.logprobs.tokens) == 6 for c in two.choices)
    assert two.usage.completion_tokens == 12 and two.usage.prompt_tokens == two.usage.total_tokens - 12
    seeded = dict(base, temperature=1.0, seed=11, n=3)
    first, again = await sdk.completions.create(**seeded), await sdk.completions.create(**seeded)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeds 11, 12, 13: repeatable
    assert len({c.text for c in first.choices}) > 1  # and different from each other
    chat = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                             max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    assert chat.choices[0].message.content == chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="n"):
        await sdk.completions.create(**base, n=17)

    streamed = await sdk.completions.create(**seeded, stream=True, stream_options={"include_usage": True})
    texts = ["", "", ""]
    finishes = {}
    chunks = [chunk async for chunk in streamed]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == [c.text for c in first.choices]  # streamed choices equal the collected ones
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 18
    chat_stream = await sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                    max_tokens=4, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
    replies = {0: "", 1: ""}
    roles = []
    async for chunk in chat_stream:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.append(choice.index)
        replies[choice.index] += choice.delta.content or ""
    assert roles == [0, 1] and replies[0] == replies[1] == chat.choices[0].message.content

    _, router = served
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:  # leaving aborts every choice
        cancelled = await metric(session, "galley_requests_total", status="cancelled")
        long = {"model": "tiny", "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 3}
        async with session.post("/v1/completions", json=long) as resp:
            await resp.content.readline()
        await wait_blocks_free(router)
        assert await metric(session, "galley_requests_total", status="cancelled") == cancelled + 3


async def test_logprobs_shapes(served):
    server, _ = served
    sdk = client(server)
    chat = await sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)
    comp = await sdk.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def test_metrics_count_what_happened(served):
    server, _ = served
    sdk = client(server)
    for max_tokens in (3, 5):
        await sdk.completions.create(model="tiny", prompt="hi", max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})
    async with aiohttp.ClientSession() as session:
        text = await (await session.get(server.make_url("/metrics"))).text()
    m = scrape(text)
    model = (("model", "tiny"), ("version", "1"))
    replica = (("model", "tiny"), ("replica", "cpu#0"), ("version", "1"))
    assert m[("galley_requests_total", (("model", "tiny"), ("status", "length"), ("version", "1")))] == 2
    assert m[("galley_generation_tokens_total", (*model[:1], ("tenant", "default"), *model[1:]))] == 8
    assert m[("galley_admitted_total", (("model", "tiny"), ("priority", "normal"), ("tenant", "default")))] == 2
    assert m[("galley_time_to_first_token_seconds_count", model)] == 2
    assert m[("galley_inter_token_latency_seconds_count", model)] == 6
    assert m[("galley_kv_blocks_total", replica)] > 0
    assert m[("galley_engine_steps_total", replica)] >= 5


async def test_two_workers_share_the_load_and_match_hf(aiohttp_server, llama_path):
    server, router, workers = await start_server(aiohttp_server, llama_path, devices=("cpu", "cpu"))
    try:
        sdk = client(server)
        tokenizer = AutoTokenizer.from_pretrained(llama_path)
        batch = prompts(6, len(tokenizer))
        results = await asyncio.gather(*(sdk.completions.create(
            model="tiny", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}) for p in batch))
        expected = [tokenizer.decode(hf_greedy(llama_path, p, 8), skip_special_tokens=True) for p in batch]
        assert [r.choices[0].text for r in results] == expected
        steps = [r.worker.engines[r.engine_id].num_steps for r in router.models["tiny"].replicas]
        assert all(s > 0 for s in steps), steps
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


async def test_openapi_spec_matches_the_schemas(served):
    server, _ = served
    async with aiohttp.ClientSession() as session:
        spec = await (await session.get(server.make_url("/openapi.json"))).json()
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions", "/health", "/ready"} <= set(spec["paths"])
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    temperature = chat["properties"]["temperature"]["anyOf"]
    assert {"type": "number", "minimum": 0.0, "maximum": 2.0} in temperature and {"type": "null"} in temperature
    assert chat["additionalProperties"] is False
    ref = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert ref["schema"]["$ref"].endswith("/ChatCompletionRequest")
    json.dumps(spec)


async def test_health_and_ready(served):
    server, _ = served
    async with aiohttp.ClientSession() as session:
        assert (await session.get(server.make_url("/health"))).status == 200
        ready = await session.get(server.make_url("/ready"))
        assert ready.status == 200 and (await ready.json())["status"] == "ok"


async def test_multibyte_text_streams_whole_characters(aiohttp_server, tmp_path):
    from tests.models import save_scripted_model

    text = "Hi 🚀 and 中文 ok"
    ids = save_scripted_model(tmp_path / "scripted", text)
    server, router, workers = await start_server(aiohttp_server, tmp_path / "scripted")
    try:
        deltas = []
        async for chunk in await client(server).completions.create(
            model="tiny", prompt=ids[:1], max_tokens=len(ids) - 1, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        ):
            deltas.append(chunk.choices[0].text)
        assert "".join(deltas) == text[1:]
        assert any("🚀" in d for d in deltas)  # the 4-byte character arrives whole, in one delta
        assert all("\ufffd" not in d for d in deltas)
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()
