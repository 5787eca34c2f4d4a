"""Prefix caching through the server: tenants kept apart, a conversation's next turn reusing its
history, prefix-aware routing across replicas, and the hit counters in /metrics and the admin
stats. The real app and engine on a tiny model, real clients."""

from __future__ import annotations

import aiohttp
import pytest

from scheduling.affinity import AFFINITY_SLACK, PrefixIndex, pick
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.api.test_streams import auth_stack
from tests.engine.test_reference import prompts
from tests.helpers import make_app, metric, start_tiny_engines

GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
HITS = "galley_prefix_cache_hits_total"
QUERIES = "galley_prefix_cache_queries_total"


async def complete(client: Client, key: str, prompt: list[int], **fields) -> None:
    """A greedy completion the engine must run (not answered from the response cache)."""
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache"}
    body = {"model": "tiny", "prompt": prompt, **GREEDY, **fields}
    async with client.session.post("/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


async def test_tenants_never_hit_each_others_prefixes(aiohttp_server, llama_path, db):
    async with auth_stack(aiohttp_server, llama_path, db) as (_, client, _, alice):
        bob = await client.new_key("bob")
        [prompt] = prompts(1, 300, lengths=[40], seed=21)
        await complete(client, alice, prompt)
        assert await metric(client.session, HITS) == 0
        await complete(client, bob, prompt)  # the same prompt from another tenant: computed again
        assert await metric(client.session, HITS) == 0
        await complete(client, alice, prompt)  # alice's own prefix: two full blocks found
        assert await metric(client.session, HITS, model="tiny", version="1") == 32
        assert await metric(client.session, QUERIES) == 3 * 40
        await complete(client, alice, prompt, cache_salt="private")  # vLLM's cache_salt: a namespace of its own
        assert await metric(client.session, HITS) == 32
        status, stats = await client.admin("GET", "/stats")
        [replica] = stats["models"][0]["replicas"]
        assert replica["prefix_cache_hit_tokens"] == 32
        assert replica["prefix_cache_hit_rate"] == pytest.approx(32 / 160)
        assert await metric(client.session, "galley_prefix_cache_blocks") > 0


async def test_a_conversations_next_turn_reuses_its_history(aiohttp_server, llama_path, db):
    async with auth_stack(aiohttp_server, llama_path, db) as (_, client, _, key):
        async with client.session.ws_connect("/ws/chat", headers={"Authorization": f"Bearer {key}"}) as ws:
            conversation = None
            for turn, content in enumerate(["Tell me a long story about a fox and a dog " * 3, "And then?"]):
                fields = {"conversation_id": conversation} if conversation else {}
                await ws.send_json({"type": "chat", "model": "tiny", "content": content,
                                    "params": {**GREEDY, "max_tokens": 8}, **fields})
                while (message := await ws.receive_json(timeout=30))["type"] not in ("done", "error"):
                    conversation = message.get("conversation_id", conversation)
                assert message["type"] == "done", message
                if turn == 0:
                    first_prompt = message["usage"]["prompt_tokens"]
                    assert await metric(client.session, HITS) == 0
        # the second turn's prompt starts with the first turn's: its full blocks come from the cache
        assert await metric(client.session, HITS) >= (first_prompt - 1) // 16 * 16 > 0


async def test_a_conversation_sticks_to_the_replica_holding_its_prefix(aiohttp_server, llama_path, db):
    router, workers = await start_tiny_engines(llama_path, devices=("cpu", "cpu"))
    app = make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN))
    server = await aiohttp_server(app)
    try:
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            client = Client(session)
            key = await client.new_key("alice")
            first, second = router.models["tiny"].replicas
            [history] = prompts(1, 300, lengths=[48], seed=22)
            first.num_in_flight += 1  # as if busy: the first turn goes to the other replica
            await complete(client, key, history)
            first.num_in_flight -= 1
            hits = lambda replica: replica.worker.stats(replica.engine_id).prefix_cache_hit_tokens  # noqa: E731
            # both idle now: least-loaded would pick `first`, the prefix picks `second`
            await complete(client, key, history + prompts(1, 300, lengths=[9], seed=23)[0])
            assert (hits(first), hits(second)) == (0, 48)
            await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


class Replica:
    def __init__(self, num_in_flight: int) -> None:
        self.num_in_flight = num_in_flight
        self.prefixes = PrefixIndex(capacity=4)


def test_affinity_prefers_the_longest_prefix_unless_that_replica_is_overloaded():
    a, b = Replica(0), Replica(0)
    b.prefixes.remember([b"1", b"2"])
    a.prefixes.remember([b"1"])
    assert pick([a, b], [b"1", b"2", b"3"]) is b
    assert pick([a, b], [b"9"]) is a  # no known prefix: least loaded (first on a tie)
    b.num_in_flight = AFFINITY_SLACK + 1
    assert pick([a, b], [b"1", b"2"]) is a


def test_prefix_index_forgets_least_recently_routed_blocks():
    index = PrefixIndex(capacity=3)
    index.remember([b"1", b"2"])
    index.remember([b"3"])
    index.remember([b"1"])  # routed again: most recent
    index.remember([b"4"])
    assert len(index) == 3 and index.matched([b"1"]) == 1 and index.matched([b"2"]) == 0
