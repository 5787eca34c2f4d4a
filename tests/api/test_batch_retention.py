"""What a tenant creates counts and expires: creating batch jobs and conversations takes from the tenant's
requests_per_minute, a tenant's unfinished jobs and stored input bytes are capped (429 with Retry-After),
and finished jobs are deleted with their inputs and results after the retention. Real app and engine,
real SQLite, real HTTP clients."""

from __future__ import annotations

from services.batch.runner import BatchConfig
from tests.api import test_batch
from tests.api.test_batch import GREEDY, wait_for
from tests.helpers import wait_until

make_stack = test_batch.make_stack  # the fixture: (client, router, a tenant key) for a BatchConfig
LONG = {"temperature": 0, "max_tokens": 450, "ignore_eos": True}


async def post(client, key: str, path: str, body: dict) -> tuple[int, dict, str | None]:
    async with client.session.post(path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.json(), resp.headers.get("Retry-After")


def job(inputs: list[str], params: dict = GREEDY) -> dict:
    return {"model": "tiny", "inputs": inputs, "params": params}


async def test_creating_batch_jobs_counts_against_requests_per_minute(make_stack):
    client, _, _ = await make_stack(BatchConfig())
    key = await client.new_key("slow", requests_per_minute=1)
    status, first, _ = await post(client, key, "/api/v1/batch", job(["The quick brown"]))
    assert status == 200, first
    status, body, retry_after = await post(client, key, "/api/v1/batch", job(["The quick brown"]))
    assert status == 429 and body["error"]["code"] == "requests_per_minute", body
    assert retry_after is not None and int(retry_after) >= 1
    _, listed = await client.call("GET", "/api/v1/batch", key)
    assert [j["batch_id"] for j in listed["data"]] == [first["batch_id"]]
    assert (await client.call("DELETE", f"/api/v1/batch/{first['batch_id']}", key))[0] == 200


async def test_creating_conversations_counts_against_requests_per_minute(make_stack):
    client, _, _ = await make_stack(BatchConfig())
    key = await client.new_key("chatty", requests_per_minute=2)
    status, made, _ = await post(client, key, "/api/v1/conversations", {"model": "tiny"})
    assert status == 201, made
    status, _, _ = await post(client, key, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1})
    assert status == 200  # the same bucket: 2 requests, one of them a creation
    status, body, retry_after = await post(client, key, "/api/v1/conversations", {"model": "tiny"})
    assert status == 429 and body["error"]["code"] == "requests_per_minute" and retry_after, body
    _, listed = await client.call("GET", "/api/v1/conversations", key)
    assert [c["id"] for c in listed["data"]] == [made["id"]]


async def test_a_tenants_unfinished_jobs_are_capped(make_stack):
    client, _, alice = await make_stack(BatchConfig(max_queued_jobs_per_tenant=2, max_running_jobs=1))
    made = []
    for _ in range(2):
        status, created, _ = await post(client, alice, "/api/v1/batch", job(["The quick brown"], LONG))
        assert status == 200, created
        made.append(created["batch_id"])
    status, body, retry_after = await post(client, alice, "/api/v1/batch", job(["The quick brown"]))
    assert status == 429 and body["error"]["code"] == "batch_jobs" and retry_after, body
    bob = await client.new_key("bob")
    assert (await post(client, bob, "/api/v1/batch", job(["a"])))[0] == 200  # per tenant
    assert (await client.call("DELETE", f"/api/v1/batch/{made[0]}", alice))[0] == 200
    status, created, _ = await post(client, alice, "/api/v1/batch", job(["The quick brown"]))
    assert status == 200, created  # a finished (cancelled) job no longer counts
    for batch_id in (made[1], created["batch_id"]):
        await client.call("DELETE", f"/api/v1/batch/{batch_id}", alice)


async def test_finished_jobs_expire_with_their_inputs_and_free_the_stored_bytes(make_stack, db):
    client, _, key = await make_stack(BatchConfig(retention_seconds=1.5, max_stored_bytes_per_tenant=1000))
    big = ["x" * 600]  # 602 bytes as stored
    status, first, _ = await post(client, key, "/api/v1/batch", job(big))
    assert status == 200, first
    batch_id = first["batch_id"]
    await wait_for(client, key, batch_id)
    status, body, retry_after = await post(client, key, "/api/v1/batch", job(big))
    assert status == 429 and body["error"]["code"] == "batch_bytes", body
    assert 1 <= int(retry_after) <= 2  # when the finished job expires
    assert (await post(client, key, "/api/v1/batch", job(["a" * 300])))[0] == 200  # still under the cap

    async def expired() -> bool:
        return (await client.call("GET", f"/api/v1/batch/{batch_id}", key))[0] == 404

    await wait_until(expired, what="the finished job to expire")
    assert (await client.call("GET", f"/api/v1/batch/{batch_id}/results", key))[0] == 404
    rows = db.read(lambda conn: conn.execute("SELECT count(*) FROM batch_items WHERE job_id = ?",
                                             [batch_id]).fetchone()[0])
    assert rows == 0
    status, again, _ = await post(client, key, "/api/v1/batch", job(big))
    assert status == 200, again  # its bytes were freed
