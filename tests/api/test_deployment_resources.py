"""`POST /api/v1/deployments` with `resources` (issue 36, the seed's deployment body): replicas honoured
on a server with two CPU device workers, and every amount the server cannot give refused with a 400
naming it, changing nothing. Real app, real engines, real SQLite."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from api.services import SERVICES
from engine.model_runner import CacheConfig
from launch import EngineConfig, start_workers
from scheduling.router import Router
from storage import registry
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client, assert_error
from tests.api.test_deployments import DEPLOYMENTS, Stack, register, versions  # noqa: F401 (fixture)
from tests.faults import FaultyLoader
from tests.helpers import make_app


@pytest.fixture
async def two_workers(aiohttp_server, db, versions):  # noqa: F811
    """`tiny` v1 (stable, on both workers: the default) and v2 registered; [engine] devices = cpu, cpu."""
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(devices=("cpu", "cpu"), max_num_seqs=8, cache=CacheConfig(kv_cache_gib=0.02))
    workers = start_workers(cfg, lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN),
                   loader=FaultyLoader(cfg, 16, workers))
    await app[SERVICES].models.start([ModelVersion("tiny", "1", versions["1"])])
    server = await aiohttp_server(app)
    client = Client(aiohttp.ClientSession(base_url=server.make_url("/")))
    stack = Stack(app, router, client, await client.new_key("acme"), workers)
    await register(stack, "tiny", "2", versions["2"])
    yield stack
    await wait_blocks_free(router)
    await client.session.close()
    for worker in workers:
        worker.stop()


async def test_replicas_are_honoured_and_kept_with_the_version(two_workers, db):
    stack = two_workers
    assert len(stack.manager.versions["tiny@1"].devices) == 2  # no resources: every device worker
    status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN, json={
        "model_name": "tiny", "version": "2", "traffic_percent": 10,
        "resources": {"replicas": 1, "requests": {"cpu": "500m", "memory": "64Mi"}, "limits": {"cpu": 1,
                                                                                              "nvidia.com/gpu": 0}}})
    assert status == 201, body
    assert body["traffic"] == {"1": 90, "2": 10} and body["versions"]["2"]["options"] == {"replicas": 1}
    await stack.wait_state("tiny@2", "ready")
    assert len(stack.manager.versions["tiny@2"].devices) == 1
    assert db.read(lambda d: registry.get_version(d, "tiny", "2")).options == {"replicas": 1}  # survives a restart

    # loaded on one replica: changing it needs an unload first, and the split stays as it was
    status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN, json={
        "model_name": "tiny", "version": "2", "traffic_percent": 50, "resources": {"replicas": 2}})
    assert_error(status, body, 409, "conflict_error")
    assert "unload" in body["error"]["message"]
    assert stack.router.deployments["tiny"].traffic == {"1": 90, "2": 10}
    assert (await stack.client.admin("POST", "/models/tiny/versions/2/unload"))[0] == 202
    await stack.wait_state("tiny@2", "unloaded")
    status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN, json={
        "model_name": "tiny", "version": "2", "traffic_percent": 50, "resources": {"replicas": 2}})
    assert status == 201, body
    await stack.wait_state("tiny@2", "ready")
    assert len(stack.router.deployments["tiny"].versions["2"].replicas) == 2
    assert stack.router.deployments["tiny"].traffic == {"1": 50, "2": 50}
    answers = [await stack.complete("tiny", user=f"user{i}") for i in range(16)]
    assert {status for status, _, _ in answers} == {200}
    assert {version for _, version, _ in answers} == {"tiny@1", "tiny@2"}


@pytest.mark.parametrize("resources, param, why", [
    ({"replicas": 3}, "resources.replicas", "has 2"),
    ({"gpu": 1}, "resources.gpu", "not a GPU"),
    ({"limits": {"nvidia.com/gpu": 1}}, "resources.gpu", "not a GPU"),
    ({"cpu": "64"}, "resources.cpu", "cores"),
    ({"requests": {"memory": "1Ki"}}, "resources.memory", "needs about"),
    ({"memory": "lots"}, "resources.memory", "not a quantity"),
    ({"limits": {"cpu": "2 cores"}}, "resources.limits.cpu", "not a quantity"),
])
async def test_what_the_server_cannot_give_is_refused_naming_it_and_changes_nothing(two_workers, db, resources,
                                                                                     param, why):
    stack = two_workers
    status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN, json={
        "model_name": "tiny", "version": "2", "traffic_percent": 10, "resources": resources})
    assert_error(status, body, 400, "invalid_request_error")
    assert body["error"]["param"] == param and why in body["error"]["message"], body
    assert stack.router.deployments["tiny"].traffic == {"1": 100}
    assert stack.manager.versions["tiny@2"].state == "unloaded"
    assert db.read(lambda d: registry.get_version(d, "tiny", "2")).options == {}
