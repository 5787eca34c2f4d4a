"""Tenants and API keys over HTTP: the real app on a real SQLite file, real clients, and `python server.py`."""

from __future__ import annotations

import asyncio
import hashlib
import re
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import httpx2 as httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from api.auth import KEY_PREFIX, TENANT, caller_of, check_priority_access, tenant_of
from api.errors import status_of
from api.services import SERVICES
from engine.model_runner import CacheConfig
from launch import EngineConfig
from scheduling.router import Router
from server import is_loopback
from services.errors import PermissionDeniedError
from services.tenancy import Auth, TenantDirectory, resolve_admin_key
from storage.db import Database
from storage.tenants import Tenant, TenantStore, hash_key
from tests.helpers import DEFAULT_MODELS, make_app, start_models
from tests.process.test_server_process import ROOT, ServerProcess

ADMIN = "gk_admin_test-admin-key-0123456789"


async def whoami(request: web.Request) -> web.Response:
    """A test-only handler: the caller's tenant, after the model check the OpenAI handlers make."""
    if "model" in request.query:
        caller_of(request).check_model(request.query["model"])
    return web.json_response({"tenant": tenant_of(request).name})


def auth_app(db: Database | None, router: Router | None = None, auth_enabled: bool = True) -> web.Application:
    """The app with auth (and a test route that says whose the request is)."""
    app = make_app(router or Router(), db=db, auth_enabled=auth_enabled,
                   admin_key_hash=hash_key(ADMIN) if db is not None else None)
    app.router.add_get("/v1/test/whoami", whoami)
    app.router.add_get("/api/test/whoami", whoami)
    return app


@pytest.fixture
async def api(aiohttp_server, db):
    server = await aiohttp_server(auth_app(db))
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        yield Client(session)


class Client:
    """An aiohttp session that can speak as the admin or with any key."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def call(self, method: str, path: str, key: str | None = None, **kw) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.request(method, path, headers=headers, **kw) as resp:
            return resp.status, await resp.json()

    async def admin(self, method: str, path: str, **kw) -> tuple[int, dict]:
        return await self.call(method, "/admin/api" + path, ADMIN, **kw)

    async def new_key(self, tenant: str, **fields) -> str:
        status, _ = await self.admin("POST", "/tenants", json={"name": tenant, **fields})
        assert status in (201, 409)
        status, body = await self.admin("POST", f"/tenants/{tenant}/keys")
        assert status == 201
        return body["key"]


def assert_error(status: int, body: dict, expected_status: int, type_: str) -> dict:
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    return body["error"]


async def test_v1_and_api_need_a_valid_key_and_the_open_endpoints_stay_open(api):
    key = await api.new_key("acme")
    for path in ("/v1/models", "/v1/test/whoami", "/api/test/whoami"):
        error = assert_error(*await api.call("GET", path), 401, "authentication_error")
        assert error["code"] == "missing_api_key"
    async with api.session.get("/v1/models", headers={"Authorization": "Basic abc"}) as resp:
        assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        assert (await resp.json())["error"]["code"] == "invalid_authorization"
    for bad in ("nope", "gk_00000000_unknown", key[:-1], key + "x", ADMIN):
        assert_error(*await api.call("GET", "/v1/models", bad), 401, "authentication_error")
    assert await api.call("GET", "/v1/test/whoami", key) == (200, {"tenant": "acme"})
    assert await api.call("GET", "/api/test/whoami", key) == (200, {"tenant": "acme"})
    assert (await api.call("GET", "/v1/models", key))[0] == 200
    for path in ("/health", "/ready", "/openapi.json"):
        assert (await api.call("GET", path))[0] == 200
    async with api.session.get("/metrics") as resp:
        assert resp.status == 200


async def test_admin_api_needs_the_admin_key(api):
    key = await api.new_key("acme")
    assert_error(*await api.call("GET", "/admin/api/tenants"), 401, "authentication_error")
    assert_error(*await api.call("GET", "/admin/api/tenants", "wrong"), 401, "authentication_error")
    error = assert_error(*await api.call("GET", "/admin/api/tenants", key), 403, "permission_error")
    assert error["code"] == "admin_key_required"
    assert_error(*await api.call("POST", "/admin/api/tenants/acme/keys", key), 403, "permission_error")
    assert (await api.admin("GET", "/tenants"))[0] == 200


async def test_tenant_crud_round_trip(api):
    status, made = await api.admin("POST", "/tenants", json={
        "name": "acme", "weight": 2.5, "max_priority": "normal", "allowed_models": ["tiny"], "max_tokens": 100})
    assert status == 201
    assert made == {"name": "acme", "weight": 2.5, "max_priority": "normal", "allowed_models": ["tiny"],
                    "max_concurrent": None, "requests_per_minute": None, "tokens_per_minute": None,
                    "max_tokens": 100, "created_at": made["created_at"]}
    error = assert_error(*await api.admin("POST", "/tenants", json={"name": "acme"}), 409, "conflict_error")
    assert "acme" in error["message"]
    status, listed = await api.admin("GET", "/tenants")
    assert status == 200 and [t["name"] for t in listed["data"]] == ["acme", "default"]
    assert await api.admin("GET", "/tenants/acme") == (200, made)

    status, patched = await api.admin("PATCH", "/tenants/acme", json={
        "max_tokens": None, "allowed_models": None, "requests_per_minute": 60})
    assert status == 200
    assert patched == {**made, "max_tokens": None, "allowed_models": None, "requests_per_minute": 60}
    assert await api.admin("GET", "/tenants/acme") == (200, patched)
    assert (await api.admin("PATCH", "/tenants/acme", json={}))[1] == patched

    for body, needle in [
        ({"weight": 0}, "weight"), ({"weight": None}, "weight"), ({"max_priority": "urgent"}, "max_priority"),
        ({"max_concurrent": 0}, "max_concurrent"), ({"tokens_per_minute": -5}, "tokens_per_minute"),
        ({"color": "red"}, "color"), ({"allowed_models": [""]}, "allowed_models"),
    ]:
        error = assert_error(*await api.admin("PATCH", "/tenants/acme", json=body), 400, "invalid_request_error")
        assert needle in error["message"], (body, error)
    for body in ({"name": "has space"}, {"name": ""}, {"name": "x" * 65}, {"name": "ok", "weight": -1}, {}):
        assert_error(*await api.admin("POST", "/tenants", json=body), 400, "invalid_request_error")
    assert_error(*await api.admin("POST", "/tenants", data=b"{nope"), 400, "invalid_request_error")
    assert await api.admin("GET", "/tenants/acme") == (200, patched)  # bad input changed nothing

    assert_error(*await api.admin("PATCH", "/tenants/ghost", json={"weight": 2}), 404, "not_found_error")
    assert_error(*await api.admin("GET", "/tenants/ghost"), 404, "not_found_error")
    assert_error(*await api.admin("DELETE", "/tenants/default"), 409, "conflict_error")
    assert await api.admin("DELETE", "/tenants/acme") == (200, {"name": "acme", "deleted": True})
    assert_error(*await api.admin("DELETE", "/tenants/acme"), 404, "not_found_error")
    assert_error(*await api.admin("GET", "/tenants/acme"), 404, "not_found_error")


async def test_keys_round_trip_and_revocation_is_refused_at_once(api):
    key = await api.new_key("acme")
    other = await api.new_key("acme")
    status, listed = await api.admin("GET", "/tenants/acme/keys")
    assert status == 200
    assert {k["prefix"] for k in listed["data"]} == {key.split("_")[1], other.split("_")[1]}
    assert all(set(k) == {"prefix", "tenant", "created_at", "revoked_at"} for k in listed["data"])
    assert key not in str(listed) and hash_key(key) not in str(listed)

    prefix = key.split("_")[1]
    assert (await api.call("GET", "/v1/models", key))[0] == 200
    status, revoked = await api.admin("DELETE", f"/keys/{prefix}")
    assert status == 200 and revoked["prefix"] == prefix and revoked["revoked_at"]
    assert_error(*await api.call("GET", "/v1/models", key), 401, "authentication_error")
    assert (await api.call("GET", "/v1/models", other))[0] == 200
    status, listed = await api.admin("GET", "/tenants/acme/keys")
    assert {k["prefix"]: k["revoked_at"] is not None for k in listed["data"]} == {
        prefix: True, other.split("_")[1]: False}

    assert_error(*await api.admin("DELETE", "/keys/00000000"), 404, "not_found_error")
    assert_error(*await api.admin("POST", "/tenants/ghost/keys"), 404, "not_found_error")
    assert_error(*await api.admin("GET", "/tenants/ghost/keys"), 404, "not_found_error")

    await api.admin("DELETE", "/tenants/acme")  # deleting a tenant takes its keys with it
    assert_error(*await api.call("GET", "/v1/models", other), 401, "authentication_error")
    await api.admin("POST", "/tenants", json={"name": "acme"})  # a new tenant of that name gets none back
    assert_error(*await api.call("GET", "/v1/models", other), 401, "authentication_error")


async def test_tenant_changes_apply_to_the_next_request(api):
    key = await api.new_key("acme", allowed_models=["a"])
    assert (await api.call("GET", "/v1/test/whoami?model=a", key))[0] == 200
    error = assert_error(*await api.call("GET", "/v1/test/whoami?model=b", key), 403, "permission_error")
    assert error["code"] == "model_not_allowed" and error["param"] == "model"
    await api.admin("PATCH", "/tenants/acme", json={"allowed_models": ["a", "b"]})
    assert (await api.call("GET", "/v1/test/whoami?model=b", key))[0] == 200


async def test_keys_are_never_stored_in_clear(api, db):
    keys = [await api.new_key("acme"), await api.new_key("beta"), await api.new_key("beta")]
    files = sorted(db.path.parent.glob("galley.db*"))
    raw = b"".join(path.read_bytes() for path in files)
    with sqlite3.connect(db.path) as conn:
        dump = "\n".join(conn.iterdump())
        hashes = {row[0] for row in conn.execute("SELECT key_hash FROM api_keys")}
    for key in keys:
        secret = key.split("_", 2)[2]
        assert key.encode() not in raw and secret.encode() not in raw
        assert key not in dump and secret not in dump
        assert hashlib.sha256(key.encode()).hexdigest() in hashes
    assert len(hashes) == 3


async def test_concurrent_admin_writes_all_land(api):
    results = await asyncio.gather(*(api.admin("POST", "/tenants", json={"name": f"t{i}"}) for i in range(20)))
    assert [status for status, _ in results] == [201] * 20
    keys = await asyncio.gather(*(api.admin("POST", f"/tenants/t{i}/keys") for i in range(20)))
    for i, (status, body) in enumerate(keys):
        assert status == 201
        assert await api.call("GET", "/v1/test/whoami", body["key"]) == (200, {"tenant": f"t{i}"})


async def test_a_restart_reloads_tenants_and_keys_from_the_file(aiohttp_server, tmp_path):
    path = tmp_path / "galley.db"
    first = Database(path)
    server = await aiohttp_server(auth_app(first))
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        client = Client(session)
        key = await client.new_key("acme", max_priority="low")
        revoked = await client.new_key("acme")
        await client.admin("DELETE", f"/keys/{revoked.split('_')[1]}")
    await server.close()
    first.close()

    second = Database(path)
    try:
        server = await aiohttp_server(auth_app(second))
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            client = Client(session)
            assert await client.call("GET", "/v1/test/whoami", key) == (200, {"tenant": "acme"})
            assert (await client.call("GET", "/v1/test/whoami", revoked))[0] == 401
            assert (await client.admin("GET", "/tenants/acme"))[1]["max_priority"] == "low"
    finally:
        await server.close()
        second.close()


async def test_auth_off_every_request_is_the_default_tenant(aiohttp_server):
    server = await aiohttp_server(auth_app(None, auth_enabled=False))  # create_app's throwaway DB
    async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
        client = Client(session)
        assert await client.call("GET", "/v1/test/whoami") == (200, {"tenant": "default"})
        assert await client.call("GET", "/v1/test/whoami", "anything") == (200, {"tenant": "default"})
        assert (await client.call("GET", "/v1/models"))[0] == 200
        # no admin key configured: the admin API refuses everyone
        assert_error(*await client.call("GET", "/admin/api/tenants", ADMIN), 401, "authentication_error")


async def test_openapi_lists_the_admin_routes(api):
    status, spec = await api.call("GET", "/openapi.json")
    assert status == 200
    paths = spec["paths"]
    assert {"post", "get"} <= set(paths["/admin/api/tenants"])
    assert {"get", "patch", "delete"} <= set(paths["/admin/api/tenants/{name}"])
    assert {"post", "get"} <= set(paths["/admin/api/tenants/{name}/keys"])
    assert "delete" in paths["/admin/api/keys/{prefix}"]
    create = spec["components"]["schemas"]["TenantCreate"]
    assert create["additionalProperties"] is False
    assert create["properties"]["weight"]["minimum"] == 0.001
    body = paths["/admin/api/tenants"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/TenantCreate")


def caller(tenant: Tenant) -> web.Request:
    """A request from `tenant` (auth off: no key), its tenant as the app's directory has it."""
    app = web.Application()
    app[SERVICES] = SimpleNamespace(auth=Auth(False, TenantDirectory({tenant.name: tenant}), None))  # only auth is read
    request = make_mocked_request("POST", "/v1/chat/completions", app=app)
    request[TENANT], request[KEY_PREFIX], request["request_id"] = tenant, None, "r1"
    return request


def test_check_model_and_priority_access_read_the_request_tenant():
    request = caller(Tenant("acme", allowed_models=("a",), max_priority="normal"))
    caller_of(request).check_model("a")
    with pytest.raises(PermissionDeniedError, match="acme.*`b`") as raised:
        caller_of(request).check_model("b")
    assert status_of(raised.value) == 403 and raised.value.code == "model_not_allowed"
    check_priority_access(request, "normal")
    check_priority_access(request, "low")
    with pytest.raises(PermissionDeniedError, match="high") as raised:
        check_priority_access(request, "high")
    assert raised.value.code == "priority_not_allowed"
    request = caller(Tenant("open"))
    caller_of(request).check_model("b")
    check_priority_access(request, "high")


def test_admin_key_configured_wins_else_generated_once_then_reused(tmp_path):
    db = Database(tmp_path / "galley.db")
    store = TenantStore(db)
    try:
        assert resolve_admin_key(store, "mine") == (hash_key("mine"), None)
        digest, shown = resolve_admin_key(store, "")
        assert shown is not None and re.fullmatch(r"gk_admin_[A-Za-z0-9_-]{43}", shown)
        assert digest == hash_key(shown)
        assert resolve_admin_key(store, "") == (digest, None)
        assert resolve_admin_key(store, "mine") == (hash_key("mine"), None)
    finally:
        db.close()


# ---- the real engine and the openai SDK -------------------------------------------------


async def test_openai_sdk_with_a_tenant_key(aiohttp_server, llama_path, db):
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(devices=("cpu",), max_num_seqs=4, cache=CacheConfig(kv_cache_gib=0.05))
    workers = await loop.run_in_executor(None, start_models, [("tiny", str(llama_path))], cfg, 8, router,
                                         lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    try:
        server = await aiohttp_server(auth_app(db, router))
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            client = Client(session)
            key = await client.new_key("acme")
            sdk = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)
            assert [m.id for m in (await sdk.models.list()).data] == ["tiny"]
            out = await sdk.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0,
                                               extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 3
            stranger = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await stranger.models.list()
            await client.admin("DELETE", f"/keys/{key.split('_')[1]}")
            with pytest.raises(openai.AuthenticationError):
                await sdk.completions.create(model="tiny", prompt="hi", max_tokens=3)
    finally:
        for worker in workers:
            worker.stop()


# ---- python server.py --------------------------------------------------------------------


def test_server_refuses_a_public_host_without_auth(tmp_path):
    proc = subprocess.run([sys.executable, "server.py", "--host", "0.0.0.0", "--data-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "0.0.0.0" in proc.stderr and "--auth" in proc.stderr
    assert not (tmp_path / "galley.db").exists()
    assert all(map(is_loopback, ("127.0.0.1", "127.9.9.9", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "", "192.168.1.10", "example.com", "localhost.evil")))


def test_admin_key_is_shown_once_and_keys_survive_a_restart(tmp_path, monkeypatch):
    monkeypatch.delenv("GALLEY_ADMIN_KEY", raising=False)
    pattern = re.compile(r"admin key \(shown once\): (gk_admin_\S+)")
    server = ServerProcess("--auth", data_dir=tmp_path)
    try:
        server.wait_ready()
        shown = [m.group(1) for line in server.output if (m := pattern.search(line))]
        assert len(shown) == 1
        admin = {"Authorization": f"Bearer {shown[0]}"}
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
        assert httpx.post(server.url + "/admin/api/tenants", json={"name": "acme"}, timeout=10).status_code == 401
        assert httpx.post(server.url + "/admin/api/tenants", json={"name": "acme"}, headers=admin,
                          timeout=10).status_code == 201
        key = httpx.post(server.url + "/admin/api/tenants/acme/keys", headers=admin, timeout=10).json()["key"]
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert sorted(m.id for m in sdk.models.list().data) == DEFAULT_MODELS
    finally:
        assert server.stop() == 0
    log = "".join(server.output)
    assert log.count(shown[0]) == 1 and key not in log  # secrets appear only where shown once

    again = ServerProcess("--auth", data_dir=tmp_path)
    try:
        again.wait_ready()
        assert not any("admin key" in line for line in again.output)
        listed = httpx.get(again.url + "/admin/api/tenants", headers=admin, timeout=10)
        assert listed.status_code == 200 and "acme" in {t["name"] for t in listed.json()["data"]}
        sdk = openai.OpenAI(base_url=again.url + "/v1", api_key=key, max_retries=0)
        assert sorted(m.id for m in sdk.models.list().data) == DEFAULT_MODELS
    finally:
        assert again.stop() == 0
