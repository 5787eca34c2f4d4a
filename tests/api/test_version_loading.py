"""Model versions loading and unloading on demand, through the real app, real engines on tiny
models (tests/api/test_deployments.py's stack), a real SQLite file and real clients: a version
that fails to load, hot and cold versions under a memory budget, keep_alive, and the work that
loads an unloaded version again (a conversation pinned to it, a batch job's next item)."""

from __future__ import annotations

import asyncio

from services.deployments.manager import LifecycleConfig
from storage.registry import ModelVersion
from tests.api import test_deployments
from tests.api.test_auth import ADMIN, assert_error
from tests.api.test_deployments import DEPLOYMENTS, KV_GIB, not_a_model, register
from tests.helpers import wait_until

make_stack, versions = test_deployments.make_stack, test_deployments.versions  # fixtures shared with rollouts


async def test_a_version_that_fails_to_load_is_reported_and_gets_no_traffic(make_stack, versions, tmp_path):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", str(not_a_model(tmp_path)))
    status, _ = await stack.client.call("POST", DEPLOYMENTS, ADMIN,
                                        json={"model_name": "tiny", "version": "2", "traffic_percent": 50})
    assert status == 201
    await stack.wait_state("tiny@2", "failed")
    assert "not-a-model" in stack.manager.versions["tiny@2"].error
    results = await asyncio.gather(*(stack.complete("tiny", user=f"u{i}") for i in range(20)))
    assert {(status, version) for status, version, _ in results} == {(200, "tiny@1")}
    status, _, body = await stack.complete("tiny@2")
    assert status == 503 and body["error"]["code"] == "model_load_failed"


async def test_hot_cold_with_a_budget_for_one_model(make_stack, versions):
    one_model_gib = KV_GIB + 0.02  # one model's KV cache and weights fit, two do not
    stack = await make_stack([ModelVersion("a", "1", versions["1"]), ModelVersion("b", "1", versions["2"])],
                             lifecycle=LifecycleConfig(memory_budget_gib=one_model_gib))
    assert [vs.state for vs in stack.manager.versions.values()] == ["ready", "unloaded"]  # b starts cold
    results = []
    for model in ["b", "a", "b", "a", "a", "b"]:
        results.append(await stack.complete(model))
    results += await asyncio.gather(*(stack.complete(m) for m in ["a", "b", "a", "b"]))  # both at once
    assert [(s, v) for s, v, _ in results[:6]] == [(200, f"{m}@1") for m in ["b", "a", "b", "a", "a", "b"]]
    assert all(s == 200 for s, _, _ in results), results
    assert stack.metric("galley_model_unloads_total", reason="memory_budget") >= 4
    assert stack.metric("galley_models_loaded") == 1
    assert stack.metric("galley_model_load_seconds_count") >= 5


async def test_keep_alive_unloads_an_idle_model_and_it_loads_again_on_use(make_stack, versions):
    stack = await make_stack([ModelVersion("idle", "1", versions["3"], options={"keep_alive": 0.5}),
                              ModelVersion("hot", "1", versions["1"], options={"pinned": True})],
                             lifecycle=LifecycleConfig(check_interval_seconds=0.1))
    assert (await stack.complete("idle"))[0] == 200
    await stack.wait_state("idle@1", "unloaded", timeout_s=5.0)
    assert stack.manager.versions["hot@1"].state == "ready"  # pinned: never unloaded
    assert stack.metric("galley_model_unloads_total", model="idle", reason="keep_alive") == 1
    status, version, _ = await stack.complete("idle")  # the caller waits while it loads
    assert (status, version) == (200, "idle@1")


async def test_conversations_stay_on_their_pinned_version(make_stack, versions):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", versions["2"])
    client, key = stack.client, stack.key
    status, old = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert status == 201 and old["model_version"] == "1"

    async def chat(conversation_id: str) -> tuple[int, str]:
        async with client.session.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
                "model": "tiny", "conversation_id": conversation_id, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
            body = await resp.json()
            assert resp.status == 200, body
            return resp.headers["X-Model-Version"], body["model"]

    assert await chat(old["id"]) == ("tiny@1", "tiny@1")
    status, body = await client.call("PUT", f"{DEPLOYMENTS}/tiny/traffic", ADMIN, json={"1": 0, "2": 100})
    assert status == 200
    await stack.wait_state("tiny@2", "ready")
    for _ in range(100):  # the switch waits for v2 to be ready
        if stack.router.deployments["tiny"].stable == "2":
            break
        await asyncio.sleep(0.05)
    assert stack.router.deployments["tiny"].traffic == {"2": 100}
    status, new = await client.call("POST", "/api/v1/conversations", key, json={"model": "tiny"})
    assert new["model_version"] == "2"
    assert await chat(old["id"]) == ("tiny@1", "tiny@1")  # the split changed; the conversation did not
    assert await chat(new["id"]) == ("tiny@2", "tiny@2")
    assert (await client.admin("POST", "/models/tiny/versions/1/unload"))[0] == 202
    await stack.wait_state("tiny@1", "unloaded")
    assert await chat(old["id"]) == ("tiny@1", "tiny@1")  # its version loads again for it
    status, body = await client.call("POST", "/v1/chat/completions", key, json={
        "model": "tiny@2", "conversation_id": old["id"], "messages": [{"role": "user", "content": "hi"}]})
    assert_error(status, body, 409, "conflict_error")


async def test_a_batch_job_outlives_its_model_being_unloaded(make_stack, versions):
    """Items route like requests: when the version is unloaded mid-job, the next item loads it again."""
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    headers = {"Authorization": f"Bearer {stack.key}"}
    # 64 items, 8 in flight: unloaded after 4, dozens remain unsubmitted however slow the poll (CI saw a job of
    # 24 finish all its items in the drain of a slow machine)
    body = {"model": "tiny", "inputs": [f"prompt {i}" for i in range(64)], "params": {"max_tokens": 8}}
    async with stack.client.session.post("/api/v1/batch", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        batch_id = (await resp.json())["batch_id"]

    async def summary() -> dict:
        async with stack.client.session.get(f"/api/v1/batch/{batch_id}", headers=headers) as resp:
            return await resp.json()

    async def completed(n: int) -> bool:
        return (await summary())["progress"]["completed"] >= n

    await wait_until(lambda: completed(4), timeout_s=60, what="4 items done")
    assert (await stack.client.admin("POST", "/models/tiny/versions/1/unload"))[0] == 202

    async def ended() -> dict | None:
        done = await summary()
        return done if done["status"] in ("completed", "failed") else None

    done = await wait_until(ended, timeout_s=60, what="the job to end")
    assert done["status"] == "completed" and done["progress"]["completed"] == 64, done
    assert stack.metric("galley_model_unloads_total", model="tiny", reason="admin") == 1
    assert stack.metric("galley_model_load_seconds_count", model="tiny") == 2  # loaded again for the job
    assert stack.manager.versions["tiny@1"].state == "ready"
