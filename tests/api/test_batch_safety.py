"""Generations nobody waits on or that nothing answers: a batch item whose model is unloaded while it waits
out a refusal, an item that never gets a first token, a request handed to an engine the worker no longer
has, a draining version, and a chat generation whose conversation write fails. Real app, real engines on
tiny models, real SQLite, real clients."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from api.services import SERVICES
from engine.model_runner import CacheConfig
from engine.types import FinishReason, GenerationRequest, SamplingParams
from launch import EngineConfig, EngineLoader, start_workers
from scheduling.router import ModelUnavailable, Router
from services.batch.runner import BatchConfig
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.api import test_batch, test_deployments
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.api.test_deployments import Stack
from tests.helpers import make_app, start_tiny_engines, wait_until

make_batch_stack = test_batch.make_stack  # fixture: (client, router, key) for a BatchConfig
versions = test_deployments.versions  # fixture: tiny model folders by seed
LONG = {"temperature": 0, "max_tokens": 450, "ignore_eos": True}


@pytest.fixture
async def lifecycle_stack(aiohttp_server, db, versions):
    """The real app with a model manager (versions load and unload) over a real worker, tiny@1 loaded,
    a batch runner that waits 2 s before retrying a refused item; tenant acme."""
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(max_num_seqs=16, cache=CacheConfig(kv_cache_gib=0.05))
    workers = start_workers(cfg, lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN),
                     loader=EngineLoader(cfg, 64, workers), batch=BatchConfig(retry_seconds=2.0))
    await app[SERVICES].models.start([ModelVersion("tiny", "1", versions["1"])])
    server = await aiohttp_server(app)
    client = Client(aiohttp.ClientSession(base_url=server.make_url("/")))
    stack = Stack(app, router, client, await client.new_key("acme"), workers)
    yield stack
    await wait_blocks_free(router)
    await client.session.close()
    for worker in workers:
        worker.stop()


async def poll(check, timeout_s: float = 60.0, what: str = "condition"):
    return await wait_until(check, timeout_s=timeout_s, what=what)


async def test_an_item_waiting_out_a_refusal_follows_its_model_through_an_unload(lifecycle_stack):
    stack = lifecycle_stack
    client, key = stack.client, stack.key
    assert (await client.admin("PATCH", "/tenants/acme", json={"max_concurrent": 1}))[0] == 200
    headers = {"Authorization": f"Bearer {key}"}
    # acme's one slot is taken by a long stream, so the job's item is refused and waits (2 s)
    interactive = await client.session.post("/v1/completions", headers=headers, json={
        "model": "tiny", "prompt": "Hold the slot", "stream": True, **LONG})
    assert interactive.status == 200
    await interactive.content.readline()
    status, created = await client.call("POST", "/api/v1/batch", key, json={
        "model": "tiny", "inputs": ["The quick brown"], "params": {"temperature": 0, "max_tokens": 4}})
    assert status == 200, created
    await poll(lambda: asyncio.sleep(0, stack.metric("galley_batch_item_retries_total", reason="concurrency")),
               what="the item's refusal")
    # meanwhile the version is unloaded: the stream's client leaves, the drain ends, the engine is detached
    assert (await client.admin("POST", "/models/tiny/versions/1/unload"))[0] == 202
    interactive.close()
    await stack.wait_state("tiny@1", "unloaded")

    async def finished():
        _, job = await client.call("GET", f"/api/v1/batch/{created['batch_id']}", key)
        return job if job["status"] in ("completed", "failed") else None

    job = await poll(finished, what="the job to finish")
    assert job["status"] == "completed" and job["progress"]["completed"] == 1, job
    assert stack.metric("galley_model_load_seconds_count", model="tiny") == 2  # loaded again for the item
    assert stack.router.num_in_flight == 0


async def test_an_item_without_a_first_token_in_time_fails_instead_of_waiting_forever(make_batch_stack):
    client, router, key = await make_batch_stack(BatchConfig(first_token_timeout_seconds=0.2), max_num_seqs=1)
    headers = {"Authorization": f"Bearer {key}"}
    # the one running sequence is an interactive stream (~1 s of decoding); the low-priority item queues behind it
    async with client.session.post("/v1/completions", headers=headers, json={
            "model": "tiny", "prompt": "Busy", "stream": True, **LONG}) as interactive:
        await interactive.content.readline()
        status, created = await client.call("POST", "/api/v1/batch", key, json={
            "model": "tiny", "inputs": ["The quick brown"], "params": {"temperature": 0, "max_tokens": 4}})
        assert status == 200, created
        job = await test_batch.wait_for(client, key, created["batch_id"], timeout_s=60)
        text = await interactive.text()
    assert '"finish_reason":"length"' in text.replace(" ", "")  # the interactive stream was never disturbed
    assert job["status"] == "failed" and job["progress"]["failed"] == 1, job
    _, results = await client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", key)
    assert "first token" in results["results"][0]["error"]
    await wait_blocks_free(router)
    assert router.num_in_flight == 0


async def test_a_draining_version_refuses_new_requests(llama_path):
    router, workers = await start_tiny_engines(llama_path)
    try:
        model = router.find("tiny")
        model.draining = True
        request = GenerationRequest("late", [1, 2, 3], SamplingParams(max_tokens=2))
        with pytest.raises(ModelUnavailable):
            router.submit(model, request)
        assert router.num_in_flight == 0 and model.num_in_flight == 0
    finally:
        for worker in workers:
            worker.stop()


async def test_a_request_the_worker_cannot_add_ends_with_an_error_event(llama_path):
    loop = asyncio.get_running_loop()
    router, workers = await start_tiny_engines(llama_path)
    received: asyncio.Queue = asyncio.Queue()
    worker = workers[0]
    worker.emit = lambda events: loop.call_soon_threadsafe(lambda: [received.put_nowait(e) for e in events])
    try:
        worker.submit("not-attached", GenerationRequest("orphan", [1, 2, 3], SamplingParams(max_tokens=2)))
        event = await asyncio.wait_for(received.get(), 30)
        assert event.request_id == "orphan" and event.finish_reason == FinishReason.ERROR and event.error
    finally:
        for worker in workers:
            worker.stop()


async def test_a_chat_whose_conversation_write_fails_does_not_leave_its_generation_running(make_batch_stack, db):
    client, router, key = await make_batch_stack(BatchConfig())
    status, conversation = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert status == 201, conversation
    replica = router.find("tiny").replicas[0]
    before = replica.worker.stats(replica.engine_id).num_batched_tokens
    # a real SQLite failure (as a full disk or a locked file would give) on the message insert
    await asyncio.wrap_future(db.write(lambda conn: conn.execute(
        "CREATE TRIGGER refuse_messages BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'disk full'); END")))
    status, body = await client.call("POST", "/v1/chat/completions", key, json={
        "model": "tiny", "conversation_id": conversation["id"], "messages": [{"role": "user", "content": "Hi"}],
        **LONG})
    assert status == 500 and body["error"]["message"] == "internal server error", body
    assert "disk full" not in json.dumps(body)
    await poll(lambda: asyncio.sleep(0, router.num_in_flight == 0), what="the generation to end")
    await wait_blocks_free(router)
    computed = replica.worker.stats(replica.engine_id).num_batched_tokens - before
    assert computed < LONG["max_tokens"] // 2, f"{computed} tokens computed for a request nobody waits on"
