"""The conversations API over HTTP: the real app, the real engine on a tiny model, a real SQLite file."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from engine.model_runner import CacheConfig
from launch import EngineConfig
from scheduling.router import Router
from storage import conversations
from tests.api.test_auth import Client, assert_error, auth_app
from tests.helpers import start_models

PATH = "/api/v1/conversations"
FIELDS = {"id", "object", "tenant", "model", "model_version", "title", "created_at", "updated_at"}


@pytest.fixture
async def router(llama_path):
    loop = asyncio.get_running_loop()
    served = Router()
    cfg = EngineConfig(devices=("cpu",), max_num_seqs=4, cache=CacheConfig(kv_cache_gib=0.05))
    workers = await loop.run_in_executor(None, start_models, [("tiny", str(llama_path))], cfg, 8, served,
                                         lambda events: loop.call_soon_threadsafe(served.dispatch, events))
    yield served
    for worker in workers:
        worker.stop()


async def open_client(aiohttp_server, db, router, auth_enabled=True):
    server = await aiohttp_server(auth_app(db, router, auth_enabled=auth_enabled))
    return aiohttp.ClientSession(base_url=server.make_url("/"))


@pytest.fixture
async def api(aiohttp_server, db, router):
    async with await open_client(aiohttp_server, db, router) as session:
        yield Client(session)


async def test_create_list_get_delete_round_trip(api, db, router):
    router.models["tiny"].version = "7"
    key = await api.new_key("acme")
    status, made = await api.call("POST", PATH, key, json={"model": "tiny", "title": "Greetings"})
    assert status == 201, made
    assert set(made) == FIELDS
    assert made["id"].startswith("conv_") and made["object"] == "conversation"
    assert (made["tenant"], made["model"], made["model_version"], made["title"]) == ("acme", "tiny", "7", "Greetings")
    assert made["created_at"] == made["updated_at"]
    status, untitled = await api.call("POST", PATH, key, json={"model": "tiny"})
    assert status == 201 and untitled["title"] is None

    assert await api.call("GET", PATH, key) == (200, {"object": "list", "data": [untitled, made]})
    assert await api.call("GET", f"{PATH}/{made['id']}", key) == (200, {**made, "messages": []})

    write = db.write(lambda d: [conversations.add_message(d, made["id"], "user", "Hello 🚀"),
                                conversations.add_message(d, made["id"], "assistant", "Hi", prompt_tokens=9,
                                                          completion_tokens=2, stream_id="strm_1")])
    user, reply = write.result(timeout=10)
    status, detail = await api.call("GET", f"{PATH}/{made['id']}", key)
    assert status == 200
    assert detail["messages"] == [
        {"role": "user", "content": "Hello 🚀", "prompt_tokens": None, "completion_tokens": None,
         "stream_id": None, "created_at": user.created_at},
        {"role": "assistant", "content": "Hi", "prompt_tokens": 9, "completion_tokens": 2,
         "stream_id": "strm_1", "created_at": reply.created_at},
    ]
    assert detail["updated_at"] == reply.created_at
    assert [c["id"] for c in (await api.call("GET", PATH, key))[1]["data"]] == [made["id"], untitled["id"]]

    assert await api.call("DELETE", f"{PATH}/{made['id']}", key) == (200, {"id": made["id"], "deleted": True})
    error = assert_error(*await api.call("GET", f"{PATH}/{made['id']}", key), 404, "not_found_error")
    assert error["code"] == "conversation_not_found"
    assert_error(*await api.call("DELETE", f"{PATH}/{made['id']}", key), 404, "not_found_error")
    assert await api.call("GET", PATH, key) == (200, {"object": "list", "data": [untitled]})
    assert db.read(lambda d: conversations.list_messages(d, made["id"])) == []


async def test_another_tenants_conversation_is_a_404_like_a_missing_one(api):
    acme, beta = await api.new_key("acme"), await api.new_key("beta")
    status, made = await api.call("POST", PATH, acme, json={"model": "tiny"})
    assert status == 201
    path = f"{PATH}/{made['id']}"
    missing = f"{PATH}/conv_{'0' * 32}"
    for method in ("GET", "DELETE"):
        theirs = assert_error(*await api.call(method, path, beta), 404, "not_found_error")
        absent = assert_error(*await api.call(method, missing, beta), 404, "not_found_error")
        assert theirs == {**absent, "message": theirs["message"]}
        assert theirs["message"] == absent["message"].replace(f"conv_{'0' * 32}", made["id"])
    assert await api.call("GET", PATH, beta) == (200, {"object": "list", "data": []})
    assert await api.call("GET", path, acme) == (200, {**made, "messages": []})  # beta's DELETE changed nothing

    await api.admin("DELETE", "/tenants/acme")  # a deleted tenant's conversations go with it
    again = await api.new_key("acme")
    assert await api.call("GET", PATH, again) == (200, {"object": "list", "data": []})
    assert_error(*await api.call("GET", path, again), 404, "not_found_error")


async def test_unknown_or_forbidden_model(api):
    key = await api.new_key("acme", allowed_models=["other"])
    error = assert_error(*await api.call("POST", PATH, key, json={"model": "ghost"}), 404, "invalid_request_error")
    assert error["code"] == "model_not_found" and error["param"] == "model" and "ghost" in error["message"]
    error = assert_error(*await api.call("POST", PATH, key, json={"model": "tiny"}), 403, "permission_error")
    assert error["code"] == "model_not_allowed"
    assert await api.call("GET", PATH, key) == (200, {"object": "list", "data": []})


async def test_bad_bodies_and_missing_keys(api):
    key = await api.new_key("acme")
    for body, needle in [
        ({}, "model"), ({"model": ""}, "model"), ({"model": 5}, "model"), ({"model": None}, "model"),
        ({"model": "tiny", "color": "red"}, "color"), ({"model": "tiny", "title": 3}, "title"),
        ({"model": "tiny", "title": "x" * 257}, "title"),
    ]:
        error = assert_error(*await api.call("POST", PATH, key, json=body), 400, "invalid_request_error")
        assert needle in error["message"], (body, error)
    assert_error(*await api.call("POST", PATH, key, data=b"{nope"), 400, "invalid_request_error")
    assert_error(*await api.call("POST", PATH, key, json=["tiny"]), 400, "invalid_request_error")
    for method, path in (("POST", PATH), ("GET", PATH), ("GET", f"{PATH}/conv_x"), ("DELETE", f"{PATH}/conv_x")):
        assert_error(*await api.call(method, path, json={"model": "tiny"}), 401, "authentication_error")
    assert await api.call("GET", PATH, key) == (200, {"object": "list", "data": []})


async def test_without_auth_conversations_are_the_default_tenants(aiohttp_server, db, router):
    async with await open_client(aiohttp_server, db, router, auth_enabled=False) as session:
        client = Client(session)
        status, made = await client.call("POST", PATH, json={"model": "tiny", "title": None})
        assert status == 201 and made["tenant"] == "default" and made["title"] is None
        assert (await client.call("GET", f"{PATH}/{made['id']}"))[0] == 200


async def test_openapi_lists_the_conversation_routes(api):
    status, spec = await api.call("GET", "/openapi.json")
    assert status == 200
    assert {"post", "get"} <= set(spec["paths"][PATH])
    assert {"get", "delete"} <= set(spec["paths"][PATH + "/{conversation_id}"])
    schemas = spec["components"]["schemas"]
    assert schemas["ConversationCreate"]["additionalProperties"] is False
    assert schemas["ConversationCreate"]["required"] == ["model"]
    assert FIELDS | {"messages"} <= set(schemas["ConversationDetail"]["properties"])
    body = spec["paths"][PATH]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ConversationCreate")
