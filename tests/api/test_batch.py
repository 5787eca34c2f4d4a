"""Batch jobs over HTTP: the real app with API keys, the real engine on a tiny model, a real SQLite file,
and a real loopback HTTP server as the callback receiver."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from engine.model_runner import CacheConfig
from launch import EngineConfig, unload_encoder
from scheduling.router import Router
from services.batch.runner import BatchConfig
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.api.test_encoders import router_with, start_test_encoders
from tests.encoder_models import save_tiny_classifier
from tests.helpers import make_app, metric, start_models, wait_until

PROMPTS = [f"Item {i}: the quick brown fox" if i % 3 else f"To be, or not {i}" for i in range(50)]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


async def start_stack(aiohttp_server, path, db, batch: BatchConfig, max_num_seqs: int = 8, max_waiting: int = 64):
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(max_num_seqs=max_num_seqs, cache=CacheConfig(kv_cache_gib=0.05))
    workers = await loop.run_in_executor(None, start_models, [("tiny", str(path))], cfg, max_waiting, router,
                                         lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN), batch=batch)
    return await aiohttp_server(app), router, workers


@pytest.fixture
async def make_stack(aiohttp_server, llama_path, db):
    """Builds the stack with the given batch config; yields (client, router, alice's key)."""
    made = []

    async def make(batch: BatchConfig | None = None, **engine_kw):
        server, router, workers = await start_stack(aiohttp_server, llama_path, db, batch or BatchConfig(),
                                                    **engine_kw)
        session = aiohttp.ClientSession(base_url=server.make_url("/"))
        made.append((session, router, workers))
        client = Client(session)
        return client, router, await client.new_key("alice")

    yield make
    for session, router, workers in made:
        await session.close()
        await wait_blocks_free(router)
        for worker in workers:
            worker.stop()


async def wait_for(client: Client, key: str, batch_id: str, statuses=("completed", "failed", "cancelled"),
                   timeout_s: float = 120.0, until=None) -> dict:
    async def reached() -> dict | None:
        status, job = await client.call("GET", f"/api/v1/batch/{batch_id}", key)
        assert status == 200, job
        return job if job["status"] in statuses and (until is None or until(job)) else None

    return await wait_until(reached, timeout_s=timeout_s, what=f"batch {batch_id} to reach {statuses}")


async def greedy_completion(client: Client, key: str, prompt: str, params: dict = GREEDY) -> dict:
    status, body = await client.call("POST", "/v1/completions", key, json={"model": "tiny", "prompt": prompt,
                                                                           **params})
    assert status == 200, body
    return body




async def test_a_batch_of_50_prompts_completes_with_the_greedy_answers(make_stack):
    client, router, key = await make_stack()
    status, created = await client.call("POST", "/api/v1/batch", key,
                                        json={"model": "tiny", "inputs": PROMPTS, "params": GREEDY})
    assert status == 200, created
    assert created["status"] == "queued" and created["num_inputs"] == 50 and created["estimated_time"] > 0
    job = await wait_for(client, key, created["batch_id"])
    assert job["status"] == "completed" and job["error"] is None and job["callback"] is None
    assert job["progress"] == {"total": 50, "pending": 0, "completed": 50, "failed": 0, "cancelled": 0}
    assert job["created_at"] <= job["started_at"] <= job["finished_at"]

    status, results = await client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", key)
    assert status == 200 and results["status"] == "completed"
    assert [r["index"] for r in results["results"]] == list(range(50))
    references = await asyncio.gather(*(greedy_completion(client, key, p) for p in PROMPTS))
    for result, reference in zip(results["results"], references):
        assert result["status"] == "completed" and result["error"] is None
        assert result["output"] == reference["choices"][0]["text"]
        assert result["finish_reason"] == "length"
        counts = {k: reference["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert result["usage"] == counts  # a batch item keeps no cached_tokens
    assert await metric(client.session, "galley_batch_jobs_total", {"status": "completed"}) == 1
    assert await metric(client.session, "galley_batch_items_total", {"status": "completed"}) == 50
    assert await metric(client.session, "galley_admitted_total", {"tenant": "alice", "priority": "low"}) == 50


async def test_chat_inputs_and_a_too_long_input_fail_alone(make_stack):
    client, _, key = await make_stack()
    chat = [{"role": "user", "content": "Hello there"}]
    too_long = "word " * 600  # past the tiny model's 512 positions
    status, created = await client.call("POST", "/api/v1/batch", key, json={
        "model": "tiny", "inputs": [chat, too_long, "The quick brown"], "params": {**GREEDY, "max_tokens": 6}})
    assert status == 200, created
    job = await wait_for(client, key, created["batch_id"])
    assert job["status"] == "completed" and job["progress"]["failed"] == 1 and job["progress"]["completed"] == 2
    _, results = await client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", key)
    first, second, third = results["results"]
    status, reference = await client.call("POST", "/v1/chat/completions", key, json={
        "model": "tiny", "messages": chat, "temperature": 0, "max_tokens": 6, "ignore_eos": True})
    assert first["output"] == reference["choices"][0]["message"]["content"]
    assert second["status"] == "failed" and "maximum context length" in second["error"]
    assert second["output"] is None and second["usage"] is None
    reference = await greedy_completion(client, key, "The quick brown", {**GREEDY, "max_tokens": 6})
    assert third["output"] == reference["choices"][0]["text"]


async def test_callback_is_posted_again_after_a_failed_attempt(make_stack, aiohttp_server):
    received: list[dict] = []

    async def receive(request: web.Request) -> web.Response:
        received.append({"body": await request.json(), "batch_id": request.headers.get("X-Galley-Batch-Id")})
        return web.Response(status=500 if len(received) == 1 else 204)

    receiver = web.Application()
    receiver.router.add_post("/hook", receive)
    hook = await aiohttp_server(receiver)
    client, _, key = await make_stack(BatchConfig(callback_backoff_seconds=0.05, callback_allow_hosts=("127.0.0.1",)))
    status, created = await client.call("POST", "/api/v1/batch", key, json={
        "model": "tiny", "inputs": PROMPTS[:5], "params": GREEDY, "callback_url": str(hook.make_url("/hook"))})
    assert status == 200, created
    job = await wait_for(client, key, created["batch_id"], until=lambda j: j["callback"]["status"] != "pending")
    assert job["callback"] == {"url": str(hook.make_url("/hook")), "status": "delivered", "attempts": 2}
    assert len(received) == 2
    for delivery in received:
        assert delivery["batch_id"] == created["batch_id"]
        assert delivery["body"]["status"] == "completed"
        assert delivery["body"]["progress"] == {"total": 5, "pending": 0, "completed": 5, "failed": 0, "cancelled": 0}


async def test_an_unreachable_callback_gives_up_after_its_attempts(make_stack):
    client, _, key = await make_stack(BatchConfig(callback_backoff_seconds=0.01, callback_max_attempts=3,
                                                  callback_allow_hosts=("127.0.0.1",)))
    status, created = await client.call("POST", "/api/v1/batch", key, json={
        "model": "tiny", "inputs": PROMPTS[:2], "params": GREEDY, "callback_url": "http://127.0.0.1:9/nothing"})
    assert status == 200, created
    job = await wait_for(client, key, created["batch_id"], until=lambda j: j["callback"]["status"] != "pending")
    assert job["status"] == "completed" and job["callback"]["status"] == "failed"
    assert job["callback"]["attempts"] == 3


async def test_jobs_belong_to_their_tenant(make_stack):
    client, _, alice = await make_stack()
    bob = await client.new_key("bob")
    _, created = await client.call("POST", "/api/v1/batch", alice,
                                   json={"model": "tiny", "inputs": PROMPTS[:3], "params": GREEDY})
    batch_id = created["batch_id"]
    for method, path in [("GET", ""), ("GET", "/results"), ("DELETE", "")]:
        status, body = await client.call(method, f"/api/v1/batch/{batch_id}{path}", bob)
        assert status == 404 and body["error"]["code"] == "batch_not_found", (method, path, body)
    status, listed = await client.call("GET", "/api/v1/batch", bob)
    assert status == 200 and listed["data"] == []
    _, listed = await client.call("GET", "/api/v1/batch", alice)
    assert [j["batch_id"] for j in listed["data"]] == [batch_id]
    status, _ = await client.call("GET", f"/api/v1/batch/{batch_id}", None)
    assert status == 401
    await wait_for(client, alice, batch_id)


async def test_bad_requests_are_refused_and_change_nothing(make_stack):
    client, _, key = await make_stack(BatchConfig(max_inputs=10))
    cases = [
        ({"model": "tiny", "inputs": []}, 400, "inputs"),
        ({"model": "tiny", "inputs": ["a"] * 11}, 400, "inputs"),
        ({"model": "tiny", "inputs": ["a"], "callback_url": "ftp://127.0.0.1/x"}, 400, "callback_url"),
        ({"model": "tiny", "inputs": ["a"], "callback_url": "not a url"}, 400, "callback_url"),
        ({"model": "tiny", "inputs": ["a"], "params": {"temperature": 5}}, 400, "params.temperature"),
        ({"model": "tiny", "inputs": ["a"], "params": {"stop_token_ids": [10**6]}}, 400, "params.stop_token_ids"),
        ({"model": "tiny", "inputs": ["a"], "params": {"n": 2}}, 400, "params.n"),
        ({"model": "nope", "inputs": ["a"]}, 404, "model"),
    ]
    for body, expected, param in cases:
        status, error = await client.call("POST", "/api/v1/batch", key, json=body)
        assert status == expected and error["error"]["param"] == param, (body, error)
    _, listed = await client.call("GET", "/api/v1/batch", key)
    assert listed["data"] == []


async def test_cancel_stops_the_job_and_frees_its_blocks(make_stack):
    client, router, key = await make_stack(BatchConfig(max_in_flight_per_job=4))
    long = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
    _, created = await client.call("POST", "/api/v1/batch", key,
                                   json={"model": "tiny", "inputs": PROMPTS[:30], "params": long})
    batch_id = created["batch_id"]
    await wait_for(client, key, batch_id, statuses=("running",))
    status, job = await client.call("DELETE", f"/api/v1/batch/{batch_id}", key)
    assert status == 200 and job["status"] == "cancelled"
    assert job["progress"]["cancelled"] >= 26 and job["progress"]["pending"] <= 4
    await wait_blocks_free(router)
    assert router.num_in_flight == 0
    _, again = await client.call("DELETE", f"/api/v1/batch/{batch_id}", key)  # idempotent
    assert again["status"] == "cancelled"
    _, results = await client.call("GET", f"/api/v1/batch/{batch_id}/results", key)
    assert {r["status"] for r in results["results"]} <= {"cancelled", "completed"}
    assert await metric(client.session, "galley_batch_jobs_total", {"status": "cancelled"}) == 1


async def test_items_refused_by_a_full_queue_are_retried_not_failed(make_stack):
    # 2 running + 1 waiting per replica: a window of 8 items keeps hitting QueueFull
    client, _, key = await make_stack(BatchConfig(max_in_flight_per_job=8, retry_seconds=0.02),
                                      max_num_seqs=2, max_waiting=1)
    _, created = await client.call("POST", "/api/v1/batch", key,
                                   json={"model": "tiny", "inputs": PROMPTS[:12], "params": GREEDY})
    job = await wait_for(client, key, created["batch_id"])
    assert job["progress"]["completed"] == 12
    assert await metric(client.session, "galley_rejected_total", {"reason": "queue_full"}) == 0  # not counted as 429s


async def test_an_interactive_request_overtakes_queued_batch_items(make_stack):
    # 2 sequences run at once; the job keeps 8 in flight, so 6 batch items wait in the engine's queue
    client, _, key = await make_stack(BatchConfig(max_in_flight_per_job=8), max_num_seqs=2, max_waiting=16)
    params = {"temperature": 0, "max_tokens": 100, "ignore_eos": True}
    _, created = await client.call("POST", "/api/v1/batch", key,
                                   json={"model": "tiny", "inputs": PROMPTS[:12], "params": params})
    batch_id = created["batch_id"]
    before = await wait_for(client, key, batch_id, statuses=("running",),
                            until=lambda j: j["progress"]["completed"] >= 2)
    reference = await greedy_completion(client, key, "Interactive", {**GREEDY, "max_tokens": 4})
    _, after = await client.call("GET", f"/api/v1/batch/{batch_id}", key)
    # FIFO would put it behind the 6 queued items (>= 6 completions); as normal priority it preempts a
    # running batch item at once and is done before the other running one can finish twice over
    assert after["progress"]["completed"] - before["progress"]["completed"] <= 2, (before, after)
    assert reference["usage"]["completion_tokens"] == 4
    status, _ = await client.call("DELETE", f"/api/v1/batch/{batch_id}", key)
    assert status == 200


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    served = start_test_encoders(save_tiny_classifier(tmp_path_factory.mktemp("classifier")))
    yield served
    for encoder in served.values():
        unload_encoder(encoder)


async def test_embed_and_classify_jobs_equal_the_direct_endpoints(aiohttp_server, db, encoders):
    app = make_app(router_with(encoders), db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN),
                     batch=BatchConfig(max_in_flight_per_job=8))
    server = await aiohttp_server(app)
    texts = [f"sentence {i}: the quick brown fox" for i in range(20)]
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        client = Client(session)
        key = await client.new_key("alice")
        status, created = await client.call("POST", "/api/v1/batch", key, json={"model": "minilm", "inputs": texts})
        assert status == 200 and created["kind"] == "embed", created
        job = await wait_for(client, key, created["batch_id"])
        assert job["status"] == "completed" and job["progress"]["completed"] == 20
        _, results = await client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", key)
        _, direct = await client.call("POST", "/v1/embeddings", key, json={"model": "minilm", "input": texts})
        for result, reference in zip(results["results"], direct["data"]):
            assert result["output"] is None and len(result["embedding"]) == 384
            assert max(abs(a - b) for a, b in zip(result["embedding"], reference["embedding"])) < 1e-5
            assert result["usage"]["prompt_tokens"] > 0

        status, created = await client.call("POST", "/api/v1/batch", key, json={"model": "clf", "inputs": texts[:5]})
        assert status == 200 and created["kind"] == "classify", created
        await wait_for(client, key, created["batch_id"])
        _, results = await client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", key)
        _, direct = await client.call("POST", "/api/v1/predict", key, json={"model": "clf", "inputs": texts[:5]})
        assert [r["prediction"] for r in results["results"]] == direct["prediction"]
        for result, scores in zip(results["results"], direct["scores"]):
            assert result["scores"].keys() == scores.keys()
            assert all(abs(result["scores"][label] - scores[label]) < 1e-5 for label in scores)

        for body, param in [({"model": "minilm", "inputs": ["a"], "params": {"max_tokens": 3}}, "params"),
                            ({"model": "minilm", "inputs": [[{"role": "user", "content": "hi"}]]}, "inputs")]:
            status, error = await client.call("POST", "/api/v1/batch", key, json=body)
            assert status == 400 and error["error"]["param"] == param, error
