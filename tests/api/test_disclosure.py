"""What a tenant may see and do beyond its own requests: deployment details, versions outside the
traffic split, /metrics. The real app over real device workers and SQLite, real HTTP clients."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import aiohttp
import pytest

from scheduling.router import Router
from services.observability.telemetry import ObservabilityConfig
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.api import test_deployments
from tests.api.test_auth import ADMIN, Client, assert_error
from tests.api.test_deployments import DEPLOYMENTS, register
from tests.helpers import make_app

make_stack, versions = test_deployments.make_stack, test_deployments.versions  # fixtures shared with rollouts

INTERNAL_FIELDS = {"source", "options", "error", "devices", "mem_bytes", "num_in_flight", "idle_seconds",
                   "events", "health", "shadow", "previous_stable_version"}


def keys_in(value) -> set[str]:
    """Every key of every object nested in `value`."""
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys_in(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys_in(v)}
    return set()


async def test_a_tenant_sees_only_its_models_deployments_without_internals(make_stack, versions, tmp_path):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"]), ModelVersion("secret", "1", versions["2"])])
    broken = tmp_path / "no-weights"  # a config (so it registers) but no weights: its load error names the path
    broken.mkdir()
    shutil.copy(Path(versions["1"]) / "config.json", broken / "config.json")
    await register(stack, "tiny", "2", str(broken))
    await register(stack, "tiny", "3", versions["3"])  # registered, no traffic: not the tenant's business
    status, _ = await stack.client.call("PUT", f"{DEPLOYMENTS}/tiny/traffic", ADMIN, json={"1": 50, "2": 50})
    assert status == 200
    await stack.wait_state("tiny@2", "failed")
    key = await stack.client.new_key("narrow", allowed_models=["tiny"])

    status, listed = await stack.client.call("GET", DEPLOYMENTS, key)
    assert status == 200, listed
    assert [d["model_name"] for d in listed["data"]] == ["tiny"]  # not `secret`: it may not use it
    tiny = listed["data"][0]
    assert tiny["traffic"] == {"1": 50, "2": 50} and tiny["stable_version"] == "1"
    assert set(tiny["versions"]) == {"1", "2"}  # version 3 takes no traffic
    assert tiny["versions"]["2"]["state"] == "failed"
    assert not keys_in(listed) & INTERNAL_FIELDS, keys_in(listed) & INTERNAL_FIELDS
    assert str(tmp_path) not in json.dumps(listed) and versions["1"] not in json.dumps(listed)

    # a failed load is reported to the tenant without the loader's error text (paths)
    status, _, body = await stack.complete("tiny@2")
    assert status == 503 and body["error"]["code"] == "model_load_failed"
    assert str(tmp_path) not in json.dumps(body)

    status, full = await stack.client.call("GET", DEPLOYMENTS, ADMIN)  # the admin key sees everything
    assert status == 200, full
    assert [d["model_name"] for d in full["data"]] == ["secret", "tiny"]
    tiny = full["data"][1]
    assert set(tiny["versions"]) == {"1", "2", "3"}
    assert tiny["versions"]["2"]["source"] == str(broken) and str(broken) in tiny["versions"]["2"]["error"]
    assert tiny["events"] and "health" in tiny


async def test_versions_outside_the_split_are_not_loadable_by_tenants(make_stack, versions):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", versions["2"])
    for _ in range(2):  # alternating requests used to load and unload versions at a tenant's whim
        status, _, body = await stack.complete("tiny@2")
        assert status == 403 and body["error"]["code"] == "version_not_allowed", body
        assert (await stack.complete("tiny@1"))[:2] == (200, "tiny@1")  # the stable version, named: fine
    assert stack.manager.versions["tiny@2"].state == "unloaded"  # nothing was loaded for the refused requests

    # the admin may grant a tenant explicit versions: `name@version` among its allowed models
    granted = await stack.client.new_key("tester", allowed_models=["tiny", "tiny@2"])
    async with stack.client.session.post("/v1/completions", headers={"Authorization": f"Bearer {granted}"}, json={
            "model": "tiny@2", "prompt": "hi", "max_tokens": 2, "temperature": 0}) as resp:
        assert resp.status == 200 and resp.headers["X-Model-Version"] == "tiny@2"

    # a version the split sends traffic to may be named by anyone
    status, _ = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                        json={"model_name": "tiny", "version": "2", "traffic_percent": 10})
    assert status == 201
    assert (await stack.complete("tiny@2"))[:2] == (200, "tiny@2")


@pytest.fixture
async def metrics_app(aiohttp_server, db):
    """The app as `--auth --host 0.0.0.0` builds it (served here on loopback: the bind only sets the policy)."""
    made = []

    async def make(bind_host: str, auth_enabled: bool = True, metrics_token: str = "") -> Client:
        app = make_app(Router(), db=db, auth_enabled=auth_enabled, admin_key_hash=hash_key(ADMIN),
                         observability=ObservabilityConfig(metrics_token=metrics_token), bind_host=bind_host)
        server = await aiohttp_server(app)
        client = Client(aiohttp.ClientSession(base_url=server.make_url("/")))
        made.append(client)
        return client

    yield make
    for client in made:
        await client.session.close()


async def scrape(client: Client, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with client.session.get("/metrics", headers=headers) as resp:
        body = await resp.text()
        if resp.status == 200:
            assert "galley_requests" in body
        else:
            assert_error(resp.status, json.loads(body), 401, "authentication_error")
        return resp.status


async def test_metrics_need_a_token_beyond_loopback_with_auth(metrics_app):
    client = await metrics_app("0.0.0.0", metrics_token="scrape-token-1")
    tenant_key = await client.new_key("acme")
    assert await scrape(client, None) == 401
    assert await scrape(client, tenant_key) == 401  # labels name every tenant: not for tenants
    assert await scrape(client, "scrape-token-2") == 401
    assert await scrape(client, "scrape-token-1") == 200
    assert await scrape(client, ADMIN) == 200

    no_token = await metrics_app("::", metrics_token="")  # no token configured: the admin key only
    assert await scrape(no_token, None) == 401
    assert await scrape(no_token, "") == 401
    assert await scrape(no_token, ADMIN) == 200

    for host, auth in (("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.0.0.1", False)):
        assert await scrape(await metrics_app(host, auth_enabled=auth), None) == 200  # loopback: open
