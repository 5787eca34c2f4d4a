"""Shadow traffic: the real app with auth on, real engines on tiny models saved as versions
(different seeds give different outputs, the same weights the same), real SQLite, real clients."""

from __future__ import annotations

import asyncio
import hashlib

from structlog.testing import capture_logs

from storage import registry
from storage.registry import ModelVersion
from tests.api import test_deployments
from tests.api.test_auth import ADMIN, assert_error
from tests.api.test_deployments import DEPLOYMENTS, Stack, not_a_model, register
from tests.helpers import wait_until

make_stack, versions = test_deployments.make_stack, test_deployments.versions  # fixtures shared with rollouts
UNCACHED = {"galley": {"cache": False}}  # greedy answers would come from the response cache, never mirrored

SHADOW = f"{DEPLOYMENTS}/tiny/shadow"


async def set_shadow(stack: Stack, body: dict) -> dict:
    status, answer = await stack.client.call("PUT", SHADOW, ADMIN, json=body)
    assert status == 200, answer
    return answer


async def wait_count(stack: Stack, outcome: str, version: str, count: int, timeout_s: float = 30.0) -> None:
    await wait_until(lambda: stack.metric("galley_shadow_requests_total", outcome=outcome, version=version) >= count,
                     timeout_s=timeout_s, what=f"{count} {outcome} shadows of {version}")


def shadow_lines(logs: list[dict]) -> list[dict]:
    return [line for line in logs if line["event"] == "shadow"]


async def test_shadow_copies_are_compared_logged_and_counted_never_returned(make_stack, versions, db):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", versions["2"])
    await register(stack, "tiny", "3", versions["1"])  # v1's weights: its outputs match
    answer = await set_shadow(stack, {"version": "2", "percent": 100})
    assert answer["shadow"] == {"version": "2", "percent": 100} and answer["traffic"] == {"1": 100}
    await stack.wait_state("tiny@2", "ready")  # set: it loads in the background
    with capture_logs() as logs:
        texts = []
        for i in range(4):
            status, version, body = await stack.complete("tiny", user=f"u{i}", stream=i % 2 == 1, **UNCACHED)
            assert (status, version) == (200, "tiny@1")
            texts.append(body["text"] if "text" in body else body["choices"][0]["text"])
        await wait_count(stack, "mismatch", "2", 4)
    lines = shadow_lines(logs)
    assert len(lines) == 4 and {line["outcome"] for line in lines} == {"mismatch"}
    assert {(line["primary_version"], line["shadow_version"]) for line in lines} == {("1", "2")}
    assert sorted(line["primary_sha256"] for line in lines) == sorted(
        hashlib.sha256(text.encode()).hexdigest()[:16] for text in texts)
    assert all(line["primary_tokens"] == line["shadow_tokens"] == 3 for line in lines)
    assert not any("primary_output" in line or "prompt" in line for line in lines)  # log_prompts is off
    assert stack.manager.health.get("tiny@2") is None  # copies judge no canary
    assert stack.metric("galley_requests_total", version="2") == 0  # nor count as v2's requests
    assert stack.metric("galley_admitted_total", tenant="galley-shadow") == 0

    await set_shadow(stack, {"version": "3", "percent": 100})
    await stack.wait_state("tiny@3", "ready")
    for i in range(2):
        assert (await stack.complete("tiny", user=f"m{i}", **UNCACHED))[:2] == (200, "tiny@1")
    await wait_count(stack, "match", "3", 2)

    stored = db.read(registry.list_shadows)
    assert [(s.model_name, s.version, s.percent) for s in stored] == [("tiny", "3", 100)]
    answer = await set_shadow(stack, {"percent": 0})
    assert answer["shadow"] is None and db.read(registry.list_shadows) == []
    before = stack.metric("galley_shadow_requests_total")
    for i in range(3):
        assert (await stack.complete("tiny", user=f"z{i}", **UNCACHED))[:2] == (200, "tiny@1")
    # a marker instead of a sleep: copies are counted in the order their requests came, so once the
    # marker's copy is counted, any copy of the three above would have been too
    await set_shadow(stack, {"version": "3", "percent": 100})
    assert (await stack.complete("tiny", user="marker", **UNCACHED))[:2] == (200, "tiny@1")
    await wait_count(stack, "match", "3", 3)
    assert stack.metric("galley_shadow_requests_total") == before + 1


async def test_a_shadow_version_that_cannot_run_drops_its_copies(make_stack, versions, tmp_path):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", str(not_a_model(tmp_path)))
    await set_shadow(stack, {"version": "2", "percent": 100})
    await stack.wait_state("tiny@2", "failed")
    for i in range(3):
        assert (await stack.complete("tiny", user=f"d{i}", **UNCACHED))[:2] == (200, "tiny@1")
    assert stack.metric("galley_shadow_requests_total", outcome="dropped", version="2") == 3


async def test_shadow_percent_selects_a_share_of_requests(make_stack, versions):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", versions["1"])
    await set_shadow(stack, {"version": "2", "percent": 30})
    await stack.wait_state("tiny@2", "ready")
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with sem:
            assert (await stack.complete("tiny", user=f"p{i}", max_tokens=1, **UNCACHED))[:2] == (200, "tiny@1")

    await asyncio.gather(*(one(i) for i in range(200)))
    await wait_until(lambda: not stack.manager.router.num_in_flight, what="the copies to finish")
    mirrored = stack.metric("galley_shadow_requests_total", version="2")
    assert 35 <= mirrored <= 85, mirrored  # 30% of 200, within about 4 standard deviations


async def test_bad_shadow_settings_are_refused_and_change_nothing(make_stack, versions, db):
    stack = await make_stack([ModelVersion("tiny", "1", versions["1"])])
    await register(stack, "tiny", "2", versions["2"])
    client = stack.client
    cases = [
        (SHADOW, {"version": "9", "percent": 10}, 404, "model_not_found"),
        (f"{DEPLOYMENTS}/nope/shadow", {"version": "2", "percent": 10}, 404, "model_not_found"),
        (f"{DEPLOYMENTS}/nope/shadow", {"percent": 0}, 404, "model_not_found"),
        (SHADOW, {"version": "1", "percent": 10}, 409, "shadow_is_stable"),
        (SHADOW, {"version": "2", "percent": 101}, 400, None),
        (SHADOW, {"version": "2", "percent": -1}, 400, None),
        (SHADOW, {"version": "2", "percent": "10"}, 400, None),
        (SHADOW, {"version": "2"}, 400, None),
        (SHADOW, {"percent": 10}, 400, None),
        (SHADOW, {"version": "2", "percent": 10, "color": "red"}, 400, None),
    ]
    for path, body, status, code in cases:
        type_ = "conflict_error" if status == 409 else "invalid_request_error"
        error = assert_error(*await client.call("PUT", path, ADMIN, json=body), status, type_)
        assert code is None or error["code"] == code, error
    assert_error(*await client.call("PUT", SHADOW, stack.key, json={"version": "2", "percent": 10}),
                 403, "permission_error")
    status, listed = await client.call("GET", DEPLOYMENTS, ADMIN)  # (a tenant key's listing has no shadow)
    assert status == 200 and listed["data"][0]["shadow"] is None
    assert db.read(registry.list_shadows) == []
    assert stack.manager.versions["tiny@2"].state == "unloaded"  # nothing started loading
