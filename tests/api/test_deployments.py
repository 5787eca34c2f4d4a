"""Model registry, deployments, rollouts and rollback (the operator's, and a failing canary's):
the real app, real engines on tiny models saved as two versions (different seeds), a real SQLite
file, real clients. Also the stack the other registry tests build on (`start_stack`, `make_stack`,
`versions`, `register`). Versions loading and unloading on demand: test_version_loading.py."""

from __future__ import annotations

import asyncio
import json
import math
import time

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.services import SERVICES
from engine.model_runner import CacheConfig
from launch import EngineConfig, start_workers
from scheduling.rollout import DeploymentsConfig
from scheduling.router import Router
from services.deployments.manager import LifecycleConfig
from storage import registry
from storage.registry import ModelVersion
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client, assert_error
from tests.faults import FaultyLoader
from tests.helpers import make_app, wait_until
from tests.models import save_tiny_model

DEPLOYMENTS = "/api/v1/deployments"
KV_GIB = 0.05


@pytest.fixture(scope="session")
def versions(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("versions")
    return {seed: str(save_tiny_model("llama", root / f"seed{seed}", seed=int(seed))) for seed in ("1", "2", "3")}


class Stack:
    def __init__(self, app, router: Router, client: Client, key: str, workers) -> None:
        self.app, self.router, self.client, self.key, self.workers = app, router, client, key, workers

    @property
    def manager(self):
        return self.app[SERVICES].models

    async def complete(self, model: str, user: str | None = None, stream: bool = False,
                       **extra) -> tuple[int, str, dict]:
        """(status, X-Model-Version, body or the streamed text and finish as a dict)."""
        body = {"model": model, "prompt": "The quick brown", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                "stream": stream, **({"user": user} if user else {}), **extra}
        async with self.client.session.post("/v1/completions", json=body,
                                            headers={"Authorization": f"Bearer {self.key}"}) as resp:
            version = resp.headers.get("X-Model-Version", "")
            if not stream or resp.status != 200:
                return resp.status, version, await resp.json()
            text, finish, errors, models = "", None, [], set()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"])
                        continue
                    models.add(chunk["model"])
                    text += chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
            return resp.status, version, {"text": text, "finish": finish, "errors": errors, "models": models}

    async def wait_state(self, ref: str, state: str, timeout_s: float = 30.0) -> None:
        await wait_until(lambda: self.manager.versions[ref].state == state, timeout_s=timeout_s,
                         what=f"{ref} to be {state}")
        # the state's SQLite write is queued on the writer thread: let it land before the test reads the file
        await asyncio.wrap_future(self.manager.store.db.write(lambda db: None))

    def metric(self, name: str, **labels) -> float:
        """The sum of `name`'s samples with these labels, as /metrics exposes them."""
        total = 0.0
        for family in text_string_to_metric_families(generate_latest(self.app[SERVICES].metrics.registry).decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total


async def start_stack(aiohttp_server, db, seed: list[ModelVersion], lifecycle: LifecycleConfig | None = None,
                      deployments: DeploymentsConfig | None = None, kv_cache_gib: float = KV_GIB,
                      stack_class: type[Stack] = Stack) -> tuple[Stack, object]:
    """The real app with a model manager over real device workers, its seed versions loaded, on a
    loopback server; a tenant key for acme. Returns the stack and its test server. The loader breaks
    the versions a test adds to `stack.manager.loader.faulty` (tests/faults.py)."""
    loop = asyncio.get_running_loop()
    router = Router()
    cfg = EngineConfig(max_num_seqs=16, cache=CacheConfig(kv_cache_gib=kv_cache_gib))
    workers = start_workers(cfg, lambda events: loop.call_soon_threadsafe(router.dispatch, events))
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN),
                     loader=FaultyLoader(cfg, 64, workers), lifecycle=lifecycle,
                     deployments=deployments)
    await app[SERVICES].models.start(seed)
    server = await aiohttp_server(app)
    client = Client(aiohttp.ClientSession(base_url=server.make_url("/")))
    return stack_class(app, router, client, await client.new_key("acme"), workers), server


@pytest.fixture
async def make_stack(aiohttp_server, db):
    made: list[Stack] = []

    async def make(seed: list[ModelVersion], lifecycle: LifecycleConfig | None = None,
                   deployments: DeploymentsConfig | None = None) -> Stack:
        stack, _ = await start_stack(aiohttp_server, db, seed, lifecycle, deployments)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        await wait_blocks_free(stack.router)
        await stack.client.session.close()
        for worker in stack.workers:
            worker.stop()


def not_a_model(tmp_path):
    """A folder that registers (it has a config.json) but does not load."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


async def register(stack: Stack, name: str, version: str, source: str, **options) -> dict:
    status, body = await stack.client.admin("POST", "/models", json={"name": name, "version": version,
                                                                      "source": source, "options": options})
    assert status == 201, body
    return body


async def test_registry_and_deployment_api_with_admin_key(make_stack, versions, db):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    client, key = stack.client, stack.key
    made = await register(stack, "tiny", "2", versions["2"])
    assert (made["state"], made["kind"], made["devices"]) == ("unloaded", "generate", [])
    assert_error(*await client.admin("POST", "/models", json={"name": "tiny", "version": "2", "source": "x"}),
                 409, "conflict_error")
    for bad in ({"name": "a@b", "source": "x"}, {"name": "a", "source": "x", "options": {"color": 1}},
                {"name": "a", "source": "x", "kind": "paint"}, {"name": "a"}):
        assert_error(*await client.admin("POST", "/models", json=bad), 400, "invalid_request_error")
    assert_error(*await client.call("POST", "/admin/api/models", key, json={"name": "a", "source": "x"}),
                 403, "permission_error")

    deploy = {"model_name": "tiny", "version": "2", "traffic_percent": 10}
    assert_error(*await client.call("POST", DEPLOYMENTS, key, json=deploy), 403, "permission_error")
    assert_error(*await client.call("POST", DEPLOYMENTS, None, json=deploy), 401, "authentication_error")
    status, body = await client.call("POST", DEPLOYMENTS, ADMIN, json=deploy)
    assert status == 201, body
    assert body["traffic"] == {"1": 90, "2": 10} and body["stable_version"] == "1"
    assert body["events"][0]["kind"] == "deploy" and body["events"][0]["traffic_after"] == {"1": 90, "2": 10}
    await stack.wait_state("tiny@2", "ready")  # the canary loads in the background

    for bad in ({"1": 50, "2": 40}, {"1": 50, "2": "50"}, {"1": 101, "2": -1}, {}):
        assert_error(*await client.call("PUT", f"{DEPLOYMENTS}/tiny/traffic", ADMIN, json=bad),
                     400, "invalid_request_error")
    assert_error(*await client.call("PUT", f"{DEPLOYMENTS}/tiny/traffic", ADMIN, json={"1": 50, "9": 50}),
                 404, "invalid_request_error")
    assert_error(*await client.call("PUT", f"{DEPLOYMENTS}/ghost/traffic", ADMIN, json={"1": 100}),
                 404, "invalid_request_error")
    status, body = await client.call("PUT", f"{DEPLOYMENTS}/tiny/traffic", ADMIN, json={"1": 30, "2": 70})
    assert status == 200 and body["traffic"] == {"1": 30, "2": 70} and body["stable_version"] == "1"

    status, listed = await client.call("GET", DEPLOYMENTS, key)  # reads: any tenant key
    assert status == 200 and [d["model_name"] for d in listed["data"]] == ["tiny"]
    assert set(listed["data"][0]["versions"]) == {"1", "2"}

    status, body = await client.call("POST", f"{DEPLOYMENTS}/tiny/rollback", ADMIN)
    assert status == 200 and body["traffic"] == {"1": 100} and body["events"][0]["kind"] == "rollback"
    assert_error(*await client.call("POST", f"{DEPLOYMENTS}/tiny/rollback", ADMIN), 409, "conflict_error")

    assert (await client.admin("POST", "/models/tiny/versions/2/unload"))[0] == 202
    await stack.wait_state("tiny@2", "unloaded")
    assert (await client.admin("POST", "/models/tiny/versions/2/load"))[0] == 202
    await stack.wait_state("tiny@2", "ready")
    assert_error(*await client.admin("POST", "/models/tiny/versions/9/load"), 404, "invalid_request_error")
    status, models = await client.admin("GET", "/models")
    assert status == 200 and [(m["version"], m["state"]) for m in models["data"]] == [("1", "ready"), ("2", "ready")]
    stored = db.read(lambda d: [(v.ref, v.state) for v in registry.list_versions(d)])
    assert stored == [("tiny@1", "ready"), ("tiny@2", "ready")]
    assert [e.kind for e in db.read(lambda d: registry.list_events(d, "tiny"))] == [
        "rollback", "traffic", "deploy", "deploy"]


async def test_rollout_under_load_keeps_every_request_and_the_split(make_stack, versions):
    # latency never triggers an automatic rollback here: on a busy machine the canary's p99 can pass
    # 3x stable's by chance, and the split under test would end mid-run
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])],
                             deployments=DeploymentsConfig(max_p99_ratio=math.inf))
    await register(stack, "tiny", "2", versions["2"])
    failures: list = []
    served: dict[str, int] = {}
    stop = asyncio.Event()

    async def streaming_client(i: int) -> None:
        n = 0
        while not stop.is_set():
            status, version, body = await stack.complete("tiny", user=f"loop{i}-{n}", stream=True)
            n += 1
            if status != 200 or body["errors"] or body["finish"] != "length":
                failures.append((status, body))
            served[version] = served.get(version, 0) + 1

    async def observed_split(num_users: int = 300) -> dict[str, float]:
        sem = asyncio.Semaphore(16)

        async def one(user: str) -> str:
            async with sem:
                status, version, body = await stack.complete("tiny", user=user, max_tokens=1)
                assert status == 200, body
                assert body["model"] == version  # two versions registered: the model field names the version
                return version

        got = await asyncio.gather(*(one(f"user{u}") for u in range(num_users)))
        return {v: got.count(v) / num_users for v in set(got)}

    loops = [asyncio.create_task(streaming_client(i)) for i in range(4)]
    try:
        await asyncio.sleep(0.5)
        for percent in (10, 50):
            status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN, json={
                "model_name": "tiny", "version": "2", "traffic_percent": percent})
            assert status == 201, body
            await stack.wait_state("tiny@2", "ready")
            split = await observed_split()
            assert abs(split.get("tiny@2", 0) - percent / 100) <= 0.06, split
            sticky = [{(await stack.complete("tiny", user=f"user{u}", max_tokens=1))[1] for _ in range(3)}
                      for u in range(8)]
            assert all(len(seen) == 1 for seen in sticky), sticky  # one user, one version
        status, body = await stack.client.call("POST", f"{DEPLOYMENTS}/tiny/rollback", ADMIN)
        assert status == 200 and body["traffic"] == {"1": 100}
        assert set(await observed_split(60)) == {"tiny@1"}
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    assert failures == []
    assert served.get("tiny@1", 0) > 0 and served.get("tiny@2", 0) > 0, served
    assert stack.manager.versions["tiny@2"].state == "ready"  # rolled back, still loaded


async def test_faulty_canary_rolls_back_automatically_and_stable_clients_see_no_errors(make_stack, versions, db):
    cfg = DeploymentsConfig(window_seconds=30.0, max_error_rate=0.2, min_requests=5)
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])], deployments=cfg)
    stack.manager.loader.faulty.add("tiny@2")
    await register(stack, "tiny", "2", versions["2"])
    status, _ = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                        json={"model_name": "tiny", "version": "2", "traffic_percent": 30})
    assert status == 201
    await stack.wait_state("tiny@2", "ready")  # the fault spares the warm-up: it loads, then fails at runtime
    started = time.monotonic()
    results = []
    for batch in range(10):
        results += await asyncio.gather(*(stack.complete("tiny", user=f"b{batch}u{i}", stream=bool(i % 2))
                                          for i in range(8)))
        if stack.router.deployments["tiny"].traffic == {"1": 100}:
            break
    rolled_back_s = time.monotonic() - started
    assert stack.router.deployments["tiny"].traffic == {"1": 100}
    assert rolled_back_s < cfg.window_seconds
    stable = [(s, b) for s, v, b in results if v == "tiny@1"]
    canary = [(s, b) for s, v, b in results if v == "tiny@2"]
    assert stable and all(s == 200 and not (isinstance(b, dict) and b.get("errors")) for s, b in stable)
    assert canary and all(s == 500 or b.get("errors") for s, b in canary)
    after = await asyncio.gather(*(stack.complete("tiny", user=f"after{i}") for i in range(16)))
    assert {(s, v) for s, v, _ in after} == {(200, "tiny@1")}

    event = db.read(lambda d: registry.list_events(d, "tiny"))[0]
    assert event.kind == "auto_rollback" and event.traffic_after == {"1": 100} and "error rate" in event.reason
    assert stack.metric("galley_rollbacks_total", model="tiny", trigger="auto") == 1
    assert stack.manager.versions["tiny@2"].state == "ready"  # kept loaded for inspection
    status, _, body = await stack.complete("tiny@2")  # out of the split: tenants may not name it any more
    assert status == 403 and body["error"]["code"] == "version_not_allowed"


def test_health_windows_count_errors_through_trims_and_judge_canaries():
    from scheduling.rollout import HealthWindow, rollback_reason

    window = HealthWindow()
    for i in range(10):
        window.record(float(i), ok=i % 2 == 0, latency_s=0.1)
    assert window.num_requests == 10 and window.error_rate == 0.5
    window.trim(now_s=9.0, window_s=4.5)  # keeps 5..9: ok at 6 and 8
    assert window.num_requests == 5 and window.num_errors == 3 and window.error_rate == 0.6
    window.trim(now_s=100.0, window_s=1.0)
    assert window.num_requests == 0 and window.num_errors == 0 and window.error_rate == 0.0

    cfg = DeploymentsConfig(max_error_rate=0.2, max_p99_ratio=3.0, min_requests=5)
    stable, failing, slow, young = HealthWindow(), HealthWindow(), HealthWindow(), HealthWindow()
    for i in range(20):
        stable.record(i, True, 0.1)
        failing.record(i, i % 3 != 0, 0.1)
        slow.record(i, True, 0.5)
    for i in range(4):
        young.record(i, False, 0.1)
    assert "error rate" in rollback_reason(failing, stable, cfg)
    assert "p99 latency" in rollback_reason(slow, stable, cfg)
    assert rollback_reason(slow, stable, cfg, latency=False) is None  # the cheap judgement: errors only
    assert "error rate" in rollback_reason(failing, stable, cfg, latency=False)
    assert rollback_reason(young, stable, cfg) is None  # not judged before min_requests
    assert rollback_reason(stable, stable, cfg) is None
