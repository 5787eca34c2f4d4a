"""Hostile prompts through the real server (issue 11, item 5).

A prompt too long for the context is refused before it is tokenized, and long ones are tokenized
off the event loop. Token ids are checked against the model's embedding rows, not the
tokenizer's length. A huge embedding input is cut before it is tokenized on the device worker.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import torch

from scheduling.router import Router
from tests.api import test_hostile_params
from tests.api.test_auth import auth_app
from tests.api.test_hostile_params import GREEDY, open_stack
from tests.models import build_tokenizer, model_for

stack = test_hostile_params.stack  # fixture: the two-tenant stack (alice, mallory) on the tiny model


# ---- item 5: huge prompts -----------------------------------------------------------------------


class LoopLag:
    """The longest the event loop went without running a 10 ms ticker (a blocked loop shows here)."""

    def __init__(self) -> None:
        self.max_s = 0.0

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.01)
            self.max_s = max(self.max_s, time.perf_counter() - started - 0.01)


async def measure_lag(*requests) -> tuple[float, list]:
    lag = LoopLag()
    ticker = asyncio.ensure_future(lag.run())
    try:
        results = await asyncio.gather(*requests)
    finally:
        ticker.cancel()
    return lag.max_s, results


async def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_tokenizing(stack):
    tiny = stack.router.find("tiny")
    limit = tiny.max_model_len * max(len(token) for token in tiny.tokenizer.get_vocab())
    body = {"model": "tiny", "max_tokens": 4}
    big = "The quick brown fox jumps. " * (3_500_000 // 27)  # ~3.5 MB: seconds to tokenize
    lag, answers = await measure_lag(
        stack.post("mallory", "/v1/completions", {**body, "prompt": big}),
        stack.post("mallory", "/api/v1/generate", {**body, "prompt": big}),
        stack.post("mallory", "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": big}]}),
    )
    for (status, answer), param in zip(answers, ["prompt", "prompt", "messages"]):
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert answer["error"]["param"] == param and f"at most {limit} characters" in answer["error"]["message"]
    assert lag < 0.5, f"the event loop was blocked for {lag:.2f}s"
    status, answer = await stack.post("mallory", "/v1/completions", {**body, "prompt": "a" * (5 * 1024 * 1024)})
    assert status == 413 and answer["error"]["code"] == "request_too_large"  # over the generation routes' limit


@pytest.fixture(scope="module")
def long_context_path(tmp_path_factory):
    """The tiny Llama with a 100k-token context: long prompts are legal and take seconds to tokenize."""
    out = tmp_path_factory.mktemp("long-context")
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model_for("llama", len(tokenizer), max_position_embeddings=100_000).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def test_long_prompts_are_tokenized_off_the_event_loop(aiohttp_server, db, long_context_path):
    from engine.model_runner import CacheConfig

    stack, workers = await open_stack(aiohttp_server, db, long_context_path, cache=CacheConfig(kv_cache_gib=0.1))
    try:
        tiny = stack.router.find("tiny")
        assert tiny.max_model_len == 100_000
        max_token_chars = max(len(token) for token in tiny.tokenizer.get_vocab())
        long = "The quick brown fox 中文 " * (tiny.max_model_len * max_token_chars // 25)  # ~1.2M chars
        lag, [(status, answer)] = await measure_lag(
            stack.post("mallory", "/v1/completions", {"model": "tiny", "prompt": long, "max_tokens": 4}))
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer  # ~300k tokens
        assert "tokens" in answer["error"]["message"]  # counted after tokenizing, which took ~1 s
        assert lag < 0.5, f"the event loop was blocked for {lag:.2f}s"
    finally:
        await stack.session.close()
        for worker in workers:
            worker.stop()


# ---- found by reading: token ids past the embedding ----------------------------------------------


@pytest.fixture(scope="module")
def short_embedding_path(tmp_path_factory):
    """A tokenizer of 400 tokens on a model with 392 embedding rows: ids 392..399 (e.g. '中', 397)
    are the tokenizer's but not the model's."""
    out = tmp_path_factory.mktemp("short-embedding")
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model_for("llama", len(tokenizer) - 8).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


async def test_token_ids_past_the_embedding_are_refused(aiohttp_server, db, short_embedding_path):
    stack, workers = await open_stack(aiohttp_server, db, short_embedding_path)
    try:
        assert stack.router.find("tiny").vocab_size == 392
        body = {"model": "tiny", "max_tokens": 4}
        cases = [("/v1/completions", {**body, "prompt": [5, 397]}, "prompt"),
                 ("/v1/completions", {**body, "prompt": "中"}, "prompt"),  # the tokenizer's own output
                 ("/api/v1/generate", {**body, "prompt": "中"}, "prompt"),
                 ("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "中"}]}, "messages"),
                 ("/v1/completions", {**body, "prompt": "hi", "stop_token_ids": [395]}, "stop_token_ids")]
        for path, request, param in cases:
            status, answer = await stack.post("mallory", path, request)
            assert status == 400 and answer["error"]["param"] == param, (path, request, answer)
        assert await stack.stream_text("alice", GREEDY)  # the engine is fine
    finally:
        await stack.session.close()
        for worker in workers:
            worker.stop()


# ---- item 5, encoders: a huge input must not hold the device worker -------------------------------


async def test_a_huge_embedding_input_is_cut_before_tokenizing(aiohttp_server):
    """Embeddings truncate to the model's length, but the whole input used to be tokenized first, on
    the device's worker thread: 6 MB took ~7 s there, every stream on that device stalled."""
    from launch import unload_encoder
    from storage.registry import ModelVersion
    from tests.api.test_encoders import MINILM
    from tests.helpers import load_encoder_alone

    minilm = load_encoder_alone(ModelVersion("minilm", "1", MINILM, "embed", {}))
    try:
        router = Router()
        router.add_model(minilm)
        server = await aiohttp_server(auth_app(None, router, auth_enabled=False))
        huge = "the quick brown fox jumps over the lazy dog " * (6_000_000 // 44)
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:

            async def embed(text: str) -> tuple[list[float], float]:
                started = time.monotonic()
                async with session.post("/v1/embeddings", json={"model": "minilm", "input": text}) as resp:
                    assert resp.status == 200, await resp.text()
                    return (await resp.json())["data"][0]["embedding"], time.monotonic() - started

            vector, took_s = await embed(huge)
            assert vector == (await embed(huge[:20_000]))[0]  # 256 tokens: the same start, the same vector
            assert took_s < 3.0, f"a 6 MB input took {took_s:.1f}s"
    finally:
        await asyncio.get_running_loop().run_in_executor(None, unload_encoder, minilm)
