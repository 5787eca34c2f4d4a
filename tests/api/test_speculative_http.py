"""Speculative decoding through the real server: a streamed completion from a server with n-gram
drafts (or a draft model) on is chunk for chunk the one a server without them sends, and the drafts show in
/metrics and on the admin stats. The real app and engine on a tiny model, a real client."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from engine.speculative import SpeculativeConfig
from storage.tenants import hash_key
from tests.api.test_api import wait_blocks_free
from tests.api.test_auth import ADMIN, Client
from tests.engine.test_speculative import repeating_prompts
from tests.helpers import make_app, metric, start_tiny_engines

NGRAM = SpeculativeConfig(method="ngram", prompt_lookup_min=1)
DRAFT_MODEL = SpeculativeConfig(method="draft_model", quantization="int4")  # the tiny model's own weights, int4


@asynccontextmanager
async def served(aiohttp_server, path, db, speculative: SpeculativeConfig):
    router, workers = await start_tiny_engines(path, speculative=speculative)
    server = await aiohttp_server(make_app(router, db=db, auth_enabled=True, admin_key_hash=hash_key(ADMIN)))
    try:
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            client = Client(session)
            yield client, await client.new_key("alice")
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


async def stream_texts(client: Client, key: str, prompt: list[int], **extra) -> list[str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache"}
    texts = []
    async with client.session.post("/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    return texts


@pytest.mark.parametrize("drafts", [NGRAM, DRAFT_MODEL], ids=["ngram", "draft_model"])
async def test_drafts_change_nothing_on_the_wire_and_are_counted(aiohttp_server, llama_path, db, drafts):
    prompts = repeating_prompts(2, seed=11)
    answers = {}
    for name, config in (("plain", SpeculativeConfig()), ("drafts", drafts)):
        async with served(aiohttp_server, llama_path, db, config) as (client, key):
            answers[name] = [await stream_texts(client, key, p) for p in prompts]
            drafted = await metric(client.session, "galley_spec_decode_num_draft_tokens_total", model="tiny")
            accepted = await metric(client.session, "galley_spec_decode_num_accepted_tokens_total", model="tiny")
            _, stats = await client.admin("GET", "/stats")
            [replica] = stats["models"][0]["replicas"]
        if name == "plain":
            assert drafted == 0 and replica["spec_decode_acceptance_rate"] is None
    assert answers["drafts"] == answers["plain"] and all(answers["plain"])  # the same chunks, drafts or not
    assert 0 < accepted <= drafted
    assert replica["spec_decode_acceptance_rate"] == accepted / drafted


async def test_a_request_can_opt_out_of_drafts(aiohttp_server, llama_path, db):
    [prompt] = repeating_prompts(1, seed=12)
    async with served(aiohttp_server, llama_path, db, NGRAM) as (client, key):
        opted_out = await stream_texts(client, key, prompt, galley={"speculative": False})
        assert await metric(client.session, "galley_spec_decode_num_draft_tokens_total", model="tiny") == 0
        drafted = await stream_texts(client, key, prompt)
        assert await metric(client.session, "galley_spec_decode_num_draft_tokens_total", model="tiny") > 0
    assert opted_out == drafted and "".join(drafted)
