"""Embed and classify models in the registry lifecycle: seeded from config, versions and traffic splits,
rollback, automatic rollback of a failing canary, hot/cold under a memory budget, keep_alive, and
/v1/models listing registered models. The real app, real device workers and encoders on tiny
random BERTs saved as versions (different seeds), a real SQLite file, real clients."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import openai
import pytest

from launch import checkpoint_bytes
from scheduling.rollout import DeploymentsConfig
from services.deployments.loading import GIB, LifecycleConfig
from storage import registry
from storage.registry import ModelVersion
from tests.api.test_auth import ADMIN, assert_error
from tests.api.test_deployments import DEPLOYMENTS, Stack, start_stack
from tests.encoder_models import save_tiny_classifier, save_tiny_embedder


@pytest.fixture(scope="session")
def encoder_versions(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoder_versions")
    paths = {f"emb{seed}": save_tiny_embedder(root / f"emb{seed}", seed=seed) for seed in (1, 2)}
    paths["clf"] = save_tiny_classifier(root / "clf", seed=3)
    return {name: str(path) for name, path in paths.items()}


class EncoderStack(Stack):
    async def embed(self, model: str, user: str | None = None, text: str = "a cat on a mat") -> tuple[int, str, dict]:
        """(status, X-Model-Version, body) of /v1/embeddings."""
        body = {"model": model, "input": text, **({"user": user} if user else {})}
        async with self.client.session.post("/v1/embeddings", json=body,
                                            headers={"Authorization": f"Bearer {self.key}"}) as resp:
            return resp.status, resp.headers.get("X-Model-Version", ""), await resp.json()

    async def predict(self, model: str) -> tuple[int, str, dict]:
        async with self.client.session.post("/api/v1/predict", json={"model": model, "input": "what a day"},
                                            headers={"Authorization": f"Bearer {self.key}"}) as resp:
            return resp.status, resp.headers.get("X-Model-Version", ""), await resp.json()

    async def register(self, name: str, version: str, source: str, kind: str = "embed", **options) -> tuple[int, dict]:
        return await self.client.admin("POST", "/models", json={"name": name, "version": version, "source": source,
                                                                 "kind": kind, "options": options})


@pytest.fixture
async def make_stack(aiohttp_server, db):
    made: list[tuple[EncoderStack, object]] = []

    async def make(seed: list[ModelVersion], lifecycle: LifecycleConfig | None = None,
                   deployments: DeploymentsConfig | None = None) -> EncoderStack:
        stack, server = await start_stack(aiohttp_server, db, seed, lifecycle, deployments, kv_cache_gib=0.05,
                                          stack_class=EncoderStack)
        made.append((stack, server))
        return stack

    yield make
    for stack, server in made:
        await stack.client.session.close()
        await server.close()  # stops the encoders the manager loaded, before their workers
        for worker in stack.workers:
            worker.stop()


async def test_config_encoders_are_registry_versions_and_bad_registrations_change_nothing(make_stack,
                                                                                            encoder_versions, db,
                                                                                            tmp_path):
    stack = await make_stack([ModelVersion("emb", "1", encoder_versions["emb1"], "embed", {"max_batch": 8}),
                              ModelVersion("clf", "1", encoder_versions["clf"], "classify")])
    assert {ref: vs.state for ref, vs in stack.manager.versions.items()} == {"emb@1": "ready", "clf@1": "ready"}
    stored = db.read(lambda d: {(v.ref, v.kind, v.state) for v in registry.list_versions(d)})
    assert stored == {("emb@1", "embed", "ready"), ("clf@1", "classify", "ready")}
    assert stack.router.deployments["emb"].traffic == {"1": 100}
    status, models = await stack.client.admin("GET", "/models")
    emb = next(m for m in models["data"] if m["name"] == "emb")
    assert (emb["kind"], emb["state"], emb["devices"]) == ("embed", "ready", ["cpu#0"])
    assert emb["options"] == {"max_batch": 8} and emb["mem_bytes"] > 0

    status, version, body = await stack.embed("emb")
    assert (status, version, body["model"]) == (200, "emb@1", "emb") and len(body["data"][0]["embedding"]) == 32
    status, version, body = await stack.predict("clf")
    assert (status, version, body["model_version"]) == (200, "clf@1", "1")

    assert_error(*await stack.register("emb", "2", encoder_versions["clf"], kind="classify"), 409, "conflict_error")
    assert_error(*await stack.register("emb", "2", encoder_versions["emb2"], max_batch=0), 400,
                 "invalid_request_error")
    status, _, body = await stack.embed("clf")  # a classifier on /v1/embeddings: no embed model of that name
    assert_error(status, body, 404, "invalid_request_error")
    status, _, body = await stack.predict("emb")
    assert assert_error(status, body, 404, "invalid_request_error")["code"] == "wrong_model_kind"
    async with stack.client.session.post("/v1/completions", json={"model": "emb", "prompt": "hi"},
                                         headers={"Authorization": f"Bearer {stack.key}"}) as resp:
        assert_error(resp.status, await resp.json(), 404, "invalid_request_error")
    assert set(stack.manager.versions) == {"emb@1", "clf@1"}

    status, _ = await stack.register("emb", "3", "/nowhere/at/all")
    assert status == 400  # refused at once (tests/process/test_model_registration.py)
    broken = tmp_path / "nowhere"  # found, so it registers, but it does not load
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    status, made = await stack.register("emb", "3", str(broken))
    assert status == 201 and made["kind"] == "embed"
    status, _ = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                        json={"model_name": "emb", "version": "3", "traffic_percent": 50})
    assert status == 201
    await stack.wait_state("emb@3", "failed")
    assert "nowhere" in stack.manager.versions["emb@3"].error
    results = await asyncio.gather(*(stack.embed("emb", user=f"u{i}") for i in range(12)))
    assert {(s, v) for s, v, _ in results} == {(200, "emb@1")}  # a failed version gets no traffic
    status, _, body = await stack.embed("emb@3")
    assert status == 503 and body["error"]["code"] == "model_load_failed"


async def test_encoder_canary_split_is_sticky_per_user_and_rolls_back(make_stack, encoder_versions):
    # latency never triggers an automatic rollback here: on a busy machine the canary's p99 can pass
    # 3x stable's by chance, and the split under test would end mid-run
    no_latency_rollback = DeploymentsConfig(max_p99_ratio=math.inf)
    stack = await make_stack([ModelVersion("emb", "1", encoder_versions["emb1"], "embed")],
                             deployments=no_latency_rollback)
    assert (await stack.register("emb", "2", encoder_versions["emb2"]))[0] == 201
    status, body = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                           json={"model_name": "emb", "version": "2", "traffic_percent": 30})
    assert status == 201 and body["traffic"] == {"1": 70, "2": 30}
    await stack.wait_state("emb@2", "ready")

    sem = asyncio.Semaphore(16)

    async def one(user: str) -> tuple[str, list[float]]:
        async with sem:
            status, version, body = await stack.embed("emb", user=user)
            assert status == 200, body
            assert body["model"] == version  # two versions registered: the model field names the version
            return version, body["data"][0]["embedding"]

    got = await asyncio.gather(*(one(f"user{u}") for u in range(200)))
    assert stack.router.deployments["emb"].traffic == {"1": 70, "2": 30}  # no rollback meanwhile
    share = sum(v == "emb@2" for v, _ in got) / len(got)
    assert abs(share - 0.3) <= 0.08, share
    by_version = {v: e for v, e in got}
    assert by_version["emb@1"] != by_version["emb@2"]  # really different weights
    for u in range(8):
        assert len({(await stack.embed("emb", user=f"user{u}"))[1] for _ in range(3)}) == 1
    by_user = {f"user{u}": v for u, (v, _) in enumerate(got)}
    for user in list(by_user)[:12]:  # the native endpoint takes `user` too: the same version as /v1/embeddings
        async with stack.client.session.post("/api/v1/embed", json={"model": "emb", "inputs": ["x"], "user": user},
                                             headers={"Authorization": f"Bearer {stack.key}"}) as resp:
            assert resp.status == 200 and resp.headers["X-Model-Version"] == by_user[user]
    status, version, body = await stack.embed("emb@2")
    assert (status, version) == (200, "emb@2") and body["data"][0]["embedding"] == by_version["emb@2"]
    async with stack.client.session.post("/api/v1/embed", json={"model": "emb@1", "inputs": ["a cat on a mat"]},
                                         headers={"Authorization": f"Bearer {stack.key}"}) as resp:
        native = await resp.json()
        assert resp.headers["X-Model-Version"] == "emb@1" and native["model_version"] == "1"
        assert native["embeddings"][0] == by_version["emb@1"]

    status, body = await stack.client.call("POST", f"{DEPLOYMENTS}/emb/rollback", ADMIN)
    assert status == 200 and body["traffic"] == {"1": 100}
    after = await asyncio.gather(*(stack.embed("emb", user=f"user{u}") for u in range(40)))
    assert {(s, v) for s, v, _ in after} == {(200, "emb@1")}
    assert stack.manager.versions["emb@2"].state == "ready"  # rolled back, still loaded


async def test_failing_encoder_canary_rolls_back_automatically(make_stack, encoder_versions, db):
    cfg = DeploymentsConfig(window_seconds=30.0, max_error_rate=0.2, min_requests=5)
    stack = await make_stack([ModelVersion("emb", "1", encoder_versions["emb1"], "embed")], deployments=cfg)
    stack.manager.loader.faulty.add("emb@2")
    assert (await stack.register("emb", "2", encoder_versions["emb2"]))[0] == 201
    status, _ = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                        json={"model_name": "emb", "version": "2", "traffic_percent": 30})
    assert status == 201
    await stack.wait_state("emb@2", "ready")  # the fault spares the warm-up: it loads, then fails at runtime
    results = []
    for batch in range(10):
        results += await asyncio.gather(*(stack.embed("emb", user=f"b{batch}u{i}", text=f"text {batch} {i}")
                                          for i in range(8)))
        if stack.router.deployments["emb"].traffic == {"1": 100}:
            break
    assert stack.router.deployments["emb"].traffic == {"1": 100}
    stable = [s for s, v, _ in results if v == "emb@1"]
    canary = [s for s, v, _ in results if v == "emb@2"]
    assert stable and set(stable) == {200}
    assert canary and set(canary) == {500}
    after = await asyncio.gather(*(stack.embed("emb", user=f"after{i}") for i in range(16)))
    assert {(s, v) for s, v, _ in after} == {(200, "emb@1")}
    event = db.read(lambda d: registry.list_events(d, "emb"))[0]
    assert event.kind == "auto_rollback" and "error rate" in event.reason
    assert stack.metric("galley_rollbacks_total", model="emb", trigger="auto") == 1
    assert stack.manager.versions["emb@2"].state == "ready"  # kept loaded for inspection


async def test_hot_cold_with_a_budget_for_one_encoder(make_stack, encoder_versions):
    sizes = [checkpoint_bytes(Path(encoder_versions[n])) for n in ("emb1", "clf")]
    budget_gib = 1.5 * max(sizes) / GIB  # one fits, two do not
    stack = await make_stack([ModelVersion("emb", "1", encoder_versions["emb1"], "embed"),
                              ModelVersion("clf", "1", encoder_versions["clf"], "classify")],
                             lifecycle=LifecycleConfig(memory_budget_gib=budget_gib))
    assert [vs.state for vs in stack.manager.versions.values()] == ["ready", "unloaded"]  # clf starts cold
    results = []
    for kind in ["clf", "emb", "clf", "emb", "emb", "clf"]:
        results.append(await (stack.predict("clf") if kind == "clf" else stack.embed("emb")))
    assert [(s, v) for s, v, _ in results] == [(200, f"{k}@1") for k in ["clf", "emb", "clf", "emb", "emb", "clf"]]
    both = await asyncio.gather(*(stack.predict("clf") if i % 2 else stack.embed("emb", text=f"t{i}")
                                  for i in range(12)))  # both at once: each waits out the other's drain
    assert all(s == 200 for s, _, _ in both), both
    assert stack.metric("galley_model_unloads_total", reason="memory_budget") >= 4
    assert stack.metric("galley_models_loaded") == 1
    loaded = [vs for vs in stack.manager.versions.values() if vs.served is not None]
    assert len(loaded) == 1 and 0 < loaded[0].mem_bytes <= budget_gib * GIB


async def test_keep_alive_unloads_an_idle_encoder_and_it_loads_again_on_use(make_stack, encoder_versions):
    stack = await make_stack([ModelVersion("idle", "1", encoder_versions["emb1"], "embed", {"keep_alive": 0.5}),
                              ModelVersion("hot", "1", encoder_versions["clf"], "classify", {"pinned": True})],
                             lifecycle=LifecycleConfig(check_interval_seconds=0.1))
    assert (await stack.embed("idle"))[0] == 200
    await stack.wait_state("idle@1", "unloaded", timeout_s=5.0)
    assert stack.manager.versions["hot@1"].state == "ready"  # pinned: never unloaded
    assert stack.metric("galley_model_unloads_total", model="idle", reason="keep_alive") == 1
    assert stack.router.served_encoders() == [stack.manager.versions["hot@1"].served]
    status, version, _ = await stack.embed("idle")  # the caller waits while it loads
    assert (status, version) == (200, "idle@1")


async def test_v1_models_lists_every_registered_model_loaded_or_not(make_stack, encoder_versions, llama_path):
    stack = await make_stack([ModelVersion("tiny", "1", str(llama_path)),
                              ModelVersion("emb", "1", encoder_versions["emb1"], "embed")])
    assert (await stack.register("cold", "1", encoder_versions["clf"], kind="classify"))[0] == 201
    sdk = openai.AsyncOpenAI(base_url=str(stack.client.session._base_url) + "v1", api_key=stack.key, max_retries=0)
    listed = await sdk.models.list()
    cards = {m.id: m.model_dump() for m in listed.data}
    assert set(cards) == {"tiny", "emb", "cold"} and all(m.object == "model" for m in listed.data)
    assert (cards["cold"]["kind"], cards["cold"]["ready"], cards["cold"]["max_model_len"]) == ("classify", False, None)
    assert cards["cold"]["created"] > time.time() - 600
    assert (cards["emb"]["kind"], cards["emb"]["ready"], cards["emb"]["max_model_len"]) == ("embed", True, 128)
    assert (cards["tiny"]["kind"], cards["tiny"]["ready"]) == ("generate", True)
    status, _, body = await stack.predict("cold")  # the first request loads it
    assert status == 200 and body["model_version"] == "1"
    cards = {m.id: m.model_dump() for m in (await sdk.models.list()).data}
    assert cards["cold"]["ready"] is True and cards["cold"]["max_model_len"] == 128
    limited = await stack.client.new_key("narrow", allowed_models=["cold"])
    narrow = openai.AsyncOpenAI(base_url=str(stack.client.session._base_url) + "v1", api_key=limited, max_retries=0)
    assert [m.id for m in (await narrow.models.list()).data] == ["cold"]


async def test_unloading_drains_the_inputs_in_flight_and_later_requests_load_it_again(make_stack, encoder_versions):
    stack = await make_stack([ModelVersion("emb", "1", encoder_versions["emb1"], "embed", {"max_batch": 4})])
    served = stack.manager.versions["emb@1"].served

    async def many(i: int) -> tuple[int, str, dict]:
        body = {"model": "emb", "input": [f"text {i} {j} " * (1 + j % 7) for j in range(16)]}
        async with stack.client.session.post("/v1/embeddings", json=body,
                                             headers={"Authorization": f"Bearer {stack.key}"}) as resp:
            return resp.status, resp.headers.get("X-Model-Version", ""), await resp.json()

    requests = [asyncio.create_task(many(i)) for i in range(12)]  # 192 inputs: under the 256 that may wait
    while served.num_in_flight == 0:
        await asyncio.sleep(0.001)
    assert (await stack.client.admin("POST", "/models/emb/versions/1/unload"))[0] == 202
    results = await asyncio.gather(*requests)
    assert [s for s, _, _ in results] == [200] * 12, [b for s, _, b in results if s != 200]
    assert all(len(body["data"]) == 16 for _, _, body in results)
    assert served.num_in_flight == 0 and served.draining
    for _ in range(200):  # the unload finishes after the drain; requests that came during it load a new one
        if stack.metric("galley_model_unloads_total", model="emb", reason="admin") == 1:
            break
        await asyncio.sleep(0.02)
    assert stack.metric("galley_model_unloads_total", model="emb", reason="admin") == 1
    assert stack.manager.versions["emb@1"].served is not served
    status, version, _ = await stack.embed("emb")
    assert (status, version) == (200, "emb@1")


async def test_encoder_shadow_compares_vectors_and_labels_never_returns_them(make_stack, encoder_versions):
    from structlog.testing import capture_logs

    from tests.api.test_shadow import shadow_lines, wait_count

    stack = await make_stack([ModelVersion("emb", "1", encoder_versions["emb1"], "embed"),
                              ModelVersion("clf", "1", encoder_versions["clf"], "classify")])
    assert (await stack.register("emb", "2", encoder_versions["emb2"]))[0] == 201  # other weights
    assert (await stack.register("emb", "3", encoder_versions["emb1"]))[0] == 201  # v1's weights
    assert (await stack.register("clf", "2", encoder_versions["clf"], kind="classify"))[0] == 201
    for name, version in (("emb", "2"), ("clf", "2")):
        status, body = await stack.client.call("PUT", f"{DEPLOYMENTS}/{name}/shadow", ADMIN,
                                               json={"version": version, "percent": 100})
        assert status == 200 and body["shadow"] == {"version": version, "percent": 100}, body
        await stack.wait_state(f"{name}@{version}", "ready")

    with capture_logs() as logs:
        for i in range(3):
            status, version, body = await stack.embed("emb", user=f"s{i}", text=f"shadowed text {i}")
            assert (status, version) == (200, "emb@1")
        await wait_count(stack, "mismatch", "2", 3)
        assert (await stack.predict("clf"))[:2] == (200, "clf@1")
        await wait_count(stack, "match", "2", 1)  # clf@2: the same classifier, the same top label
    lines = shadow_lines(logs)
    emb_lines = [line for line in lines if line["model"] == "emb"]
    assert len(emb_lines) == 3 and all(line["shadow_version"] == "2" and line["kind"] == "embed" for line in emb_lines)
    assert all(line["max_abs_diff"] > 1e-3 and line["min_cosine"] < 0.999 for line in emb_lines)
    assert not any("inputs" in line or "primary_output" in line for line in emb_lines)  # log_prompts is off
    clf_line = next(line for line in lines if line["model"] == "clf")
    assert clf_line["top_label_agreement"] == "1/1" and clf_line["outcome"] == "match"
    assert stack.manager.health.get("emb@2") is None  # copies judge no canary

    status, _ = await stack.client.call("PUT", f"{DEPLOYMENTS}/emb/shadow", ADMIN,
                                        json={"version": "3", "percent": 100})
    assert status == 200
    await stack.wait_state("emb@3", "ready")
    assert (await stack.embed("emb", user="same", text="the same weights"))[:2] == (200, "emb@1")
    await wait_count(stack, "match", "3", 1)
