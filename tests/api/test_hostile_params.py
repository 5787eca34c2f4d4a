"""Hostile sampling parameters through the real server (issue 11, item 2).

Every parameter is range-checked at the boundary: a value the engine could choke on is a 400
that names the parameter, never a failed step that takes other tenants' streams with it; values
in range, however extreme, get an answer. Also the two-tenant stack (`open_stack`, `stack`)
that test_hostile_prompts.py (item 5: huge prompts, token ids) and test_hostile_tenant.py use.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduling.router import Router
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import Client, auth_app
from tests.helpers import start_tiny_engines

PROMPT = "The quick brown fox"
GREEDY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


class Stack:
    def __init__(self, session: aiohttp.ClientSession, router: Router, keys: dict[str, str]) -> None:
        self.session = session
        self.router = router
        self.keys = keys

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}", "Content-Type": "application/json"}

    async def post(self, tenant: str, path: str, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.session.post(path, data=data, headers=self.headers(tenant)) as resp:
            return resp.status, await resp.json()

    async def stream_text(self, tenant: str, body: dict) -> str:
        """A streamed completion's text; an error event fails the test."""
        text = ""
        async with self.session.post("/v1/completions", json={**body, "stream": True},
                                     headers=self.headers(tenant)) as resp:
            assert resp.status == 200, await resp.text()
            async for event in sse_events(resp):
                assert "error" not in event, event
                text += event["choices"][0]["text"] if event["choices"] else ""
        return text


async def sse_events(resp: aiohttp.ClientResponse):
    async for line in resp.content:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            yield json.loads(line[6:])


async def open_stack(aiohttp_server, db, path, **engine_kw):
    router, workers = await start_tiny_engines(path, **engine_kw)
    server = await aiohttp_server(auth_app(db, router))
    session = aiohttp.ClientSession(base_url=server.make_url("/"))
    admin = Client(session)
    keys = {tenant: await admin.new_key(tenant) for tenant in ("alice", "mallory")}
    return Stack(session, router, keys), workers


@pytest.fixture
async def stack(aiohttp_server, llama_path, db):
    stack, workers = await open_stack(aiohttp_server, db, llama_path, max_num_seqs=32)
    yield stack
    await stack.session.close()
    await wait_blocks_free(stack.router, timeout_s=30)
    for worker in workers:
        worker.stop()


# ---- item 2: every parameter range-checked at the boundary -----------------------------------

HOSTILE = [  # (body fields, the parameter the 400 must name)
    ({"top_k": 9223372036854775808}, "top_k"),  # overflowed int64 in the sampler: the whole step failed
    ({"top_k": 10**30}, "top_k"),
    ({"max_tokens": 9223372036854775808}, "max_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"stop_token_ids": list(range(5000))}, "stop_token_ids"),  # checked against every sampled token
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop": ["x" * 100_000]}, "stop"),  # matched against the text after every token
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"user": "u" * 100_000}, "user"),
    ({"temperature": 1e400}, "temperature"),  # infinity once parsed
    ({"top_p": float("nan")}, "top_p"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"n": 10**12}, "n"),
    ({"logprobs": 10**9}, "logprobs"),
    ({"prompt": [5, 2**63]}, "prompt"),
]


async def test_hostile_values_are_a_400_naming_the_parameter(stack):
    for fields, param in HOSTILE:
        body = json.dumps({**GREEDY, **fields}).encode()  # NaN and Infinity as Python clients write them
        status, answer = await stack.post("mallory", "/v1/completions", body)
        assert status == 400, (fields, answer)
        assert answer["error"]["param"].split(".")[0] == param, (fields, answer)
        assert answer["error"]["type"] == "invalid_request_error"


async def test_batch_job_params_are_bounded_too(stack):
    """A batch item ran the same sampler: its parameters get the same bounds at submission."""
    for fields, param in [({"top_k": 9223372036854775808}, "params.top_k"),
                          ({"max_tokens": 2**63}, "params.max_tokens"),
                          ({"stop_token_ids": list(range(5000))}, "params.stop_token_ids"),
                          ({"temperature": float("nan")}, "params.temperature")]:
        body = json.dumps({"model": "tiny", "inputs": ["hi"], "params": fields}).encode()
        status, answer = await stack.post("mallory", "/api/v1/batch", body)
        assert status == 400 and answer["error"]["param"] == param, (fields, answer)


async def test_a_top_k_past_int64_spares_the_other_tenants_stream(stack):
    """The issue's repro: before, the overflow failed the step and every stream in it."""
    alone = await stack.stream_text("alice", GREEDY)
    streaming = asyncio.ensure_future(stack.stream_text("alice", GREEDY))
    for _ in range(4):
        sampled = {**GREEDY, "max_tokens": 16, "temperature": 1.0}
        status, answer = await stack.post("mallory", "/v1/completions", {**sampled, "top_k": 9223372036854775808})
        assert status == 400 and answer["error"]["param"] == "top_k"
        status, _ = await stack.post("mallory", "/v1/completions", {**sampled, "top_k": 10**6})
        assert status == 200  # the schema's bound; the sampler clamps it to the vocabulary
    assert await asyncio.wait_for(streaming, 60) == alone


# in range, but at the edges of float32 and bfloat16 (both share float32's exponent range): subnormal,
# tiny, huge (issue 32: a repetition_penalty of 1e-300 was 0 in float32, the logits inf, the sampled id
# past the vocabulary, and the request a 500)
EDGES_IN_RANGE = [
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 5e-324}, {"repetition_penalty": 2.2e-308},
    {"repetition_penalty": 1.4e-45}, {"repetition_penalty": 1e-30}, {"repetition_penalty": 1e300},
    {"repetition_penalty": 3.5e38}, {"repetition_penalty": 1e-300, "temperature": 1e-5},
    {"repetition_penalty": 1e-300, "temperature": 2.0, "top_p": 5e-324},
    {"temperature": 1e-5, "top_k": 1_000_000}, {"temperature": 1.0000001e-5, "min_p": 5e-324},
    {"min_p": 1.0, "temperature": 2.0}, {"top_p": 1.4e-45}, {"frequency_penalty": -2.0, "presence_penalty": 2.0},
    {"frequency_penalty": 5e-324, "presence_penalty": -5e-324},
    {"logit_bias": {"5": 100.0, "6": 100.0, "7": -100.0}, "temperature": 1e-5},
    {"logit_bias": {"5": 5e-324}, "repetition_penalty": 1e300},
]


async def test_edge_values_in_range_get_an_answer_not_a_500(stack):
    alone = await stack.stream_text("alice", GREEDY)
    for fields in EDGES_IN_RANGE:
        for path in ENDPOINTS:
            body = {"model": "tiny", "max_tokens": 8, **fields}
            body.update({"messages": [{"role": "user", "content": PROMPT}]} if "chat" in path else {"prompt": PROMPT})
            status, answer = await stack.post("mallory", path, body)
            assert status == 200, (path, fields, answer)
            tokens = answer["usage"]["completion_tokens"]
            assert 1 <= tokens <= 8, (path, fields, answer)
    assert await stack.stream_text("alice", GREEDY) == alone


async def test_tiny_temperature_is_greedy_over_http(stack):
    greedy = await stack.post("alice", "/v1/completions", {**GREEDY, "galley": {"cache": False}})
    tiny = await stack.post("alice", "/v1/completions", {**GREEDY, "temperature": 1e-46, "galley": {"cache": False}})
    assert tiny[0] == 200 and tiny[1]["choices"][0]["text"] == greedy[1]["choices"][0]["text"]


# ---- the property: random parameters never hurt a neighbour --------------------------------------

HUGE_INTS = [2**63, 2**63 - 1, 2**64, -(2**63) - 1, 10**30, 9223372036854775808]
ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from(HUGE_INTS))
F32_MAX, BF16_MAX, F16_MAX = 3.4028234663852886e38, 3.3895313892515355e38, 65504.0
EDGE_FLOATS = [  # subnormal, tiny, huge and boundary floats of float64, float32, bfloat16 and float16
    0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1e-300, 1.401298464324817e-45, 1.1754943508222875e-38, 1e-46,
    1e-30, 9.99e-6, 1e-5, 1.0000001e-5, 1e-3, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, 100.0, 100.0001, F16_MAX,
    65520.0, BF16_MAX, F32_MAX, 3.5e38, 1e300, 1.7976931348623157e308]
edges = st.sampled_from(EDGE_FLOATS)
floats = st.one_of(st.floats(), edges, edges.map(lambda x: -x))
texts = st.one_of(st.text(max_size=8), st.just("x" * 5000))
HOSTILE_VALUES = {
    "temperature": floats | ints, "top_p": floats, "top_k": ints, "min_p": floats, "max_tokens": ints,
    "seed": ints, "frequency_penalty": floats, "presence_penalty": floats, "repetition_penalty": floats,
    "stop": texts | st.lists(texts, max_size=8), "stop_token_ids": st.lists(ints, max_size=400),
    "n": st.integers(-1, 20), "logprobs": ints | st.booleans(), "top_logprobs": ints, "ignore_eos": st.booleans(),
    "prompt": st.lists(ints, max_size=6), "user": texts,
    "logit_bias": st.dictionaries(st.integers(-1, 10**6).map(str), floats, max_size=3),
}
ids = st.integers(0, 399)  # the tiny model's vocabulary


def in_range(low: float, high: float, *, open_low: bool = False):
    """Floats in [low, high] (or (low, high]): uniform, and the edge values that fall inside."""
    inside = [x for x in EDGE_FLOATS + [-x for x in EDGE_FLOATS] if (low < x if open_low else low <= x) and x <= high]
    return st.floats(low, high, exclude_min=open_low) | st.sampled_from(inside)


VALID_VALUES = {  # in range, edges included, so that many examples run next to the neighbour
    "temperature": in_range(0, 2), "top_p": in_range(0, 1, open_low=True),
    "top_k": st.integers(-1, 10**6), "min_p": in_range(0, 1), "max_tokens": st.integers(1, 64),
    "seed": st.integers(0, 2**63 - 1), "frequency_penalty": in_range(-2, 2), "presence_penalty": in_range(-2, 2),
    "repetition_penalty": in_range(0, 1.7976931348623157e308, open_low=True),
    "logit_bias": st.dictionaries(ids.map(str), in_range(-100, 100), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "stop_token_ids": st.lists(ids, max_size=256), "n": st.integers(1, 3), "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 20), "ignore_eos": st.booleans(), "prompt": st.lists(ids, min_size=1, max_size=6),
    "user": st.text(max_size=8),
}
params = st.lists(st.sampled_from(sorted(VALID_VALUES)), max_size=4, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({key: VALID_VALUES[key] | HOSTILE_VALUES[key] for key in keys}))
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/api/v1/generate"]


async def hostile_request(stack: Stack, path: str, params: dict, neighbour: asyncio.Future) -> None:
    """Send `params` as mallory, streamed; while the neighbour runs read the answer, then leave."""
    body = {"model": "tiny", "stream": True, "max_tokens": 8, **params}
    if path == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": str(body.pop("prompt", "hi"))}])
    else:
        body.setdefault("prompt", "hi")
    async with stack.session.post(path, data=json.dumps(body).encode(), headers=stack.headers("mallory")) as resp:
        if resp.status != 200:
            answer = await resp.json()
            assert resp.status == 400, (params, answer)
            param = answer["error"]["param"]
            context = answer["error"]["code"] == "context_length_exceeded" and "max_tokens" in params
            assert param is not None and (param.split(".")[0] in body or context), (params, answer)
            return
        async for event in sse_events(resp):
            assert "error" not in event and event.get("type") != "error", (params, event)
            if neighbour.done():
                return  # leaving aborts the rest


async def test_random_parameters_never_hurt_another_tenants_stream(stack):
    alone = await stack.stream_text("alice", GREEDY)
    loop = asyncio.get_running_loop()

    async def one_example(path: str, params: dict) -> None:
        neighbour = asyncio.ensure_future(stack.stream_text("alice", GREEDY))
        await hostile_request(stack, path, params, neighbour)
        assert await asyncio.wait_for(neighbour, 60) == alone

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(ENDPOINTS), params=params)
    @example(path="/v1/completions", params={"top_k": 9223372036854775808})  # the repro
    @example(path="/v1/chat/completions", params={"top_k": 2**64, "temperature": 1e-46, "stop_token_ids": [-1] * 999})
    @example(path="/v1/chat/completions", params={"top_logprobs": 0})  # a check across two fields names one
    @example(path="/v1/completions", params={"repetition_penalty": 1e-300})  # issue 32: a 500
    @example(path="/api/v1/generate", params={"repetition_penalty": 5e-324, "temperature": 2.0})
    def prop(path: str, params: dict) -> None:  # hypothesis is synchronous: it drives the loop from a thread
        asyncio.run_coroutine_threadsafe(one_example(path, params), loop).result(120)

    await asyncio.to_thread(prop)
