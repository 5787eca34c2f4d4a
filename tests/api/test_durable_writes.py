"""A write SQLite refuses is never lost silently: the real app over real engines and a real
SQLite file, real HTTP clients. The database is made to refuse writes the way a full disk or a
lock would reach the server: SQLite itself fails the statement (a trigger naming a missing table
makes it an OperationalError, the class of `disk full` and `database is locked`)."""

from __future__ import annotations

import contextlib
import sqlite3

import aiohttp
import pytest

from services.streams.hub import StreamsConfig
from tests.api.test_api import wait_blocks_free
from tests.api.test_streams import read_events, text_of
from tests.helpers import make_app, metric, start_tiny_engines

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
BODY = {"model": "tiny", "messages": MESSAGES, "max_tokens": 48, "ignore_eos": True, "temperature": 0,
        "stream": True}


@pytest.fixture
async def server(aiohttp_server, llama_path, db):
    router, workers = await start_tiny_engines(llama_path)
    app = make_app(router, db=db, streams=StreamsConfig(checkpoint_tokens=4, checkpoint_seconds=3600.0))
    server = await aiohttp_server(app)
    try:
        async with aiohttp.ClientSession(base_url=server.make_url("/")) as session:
            yield session
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()


@contextlib.contextmanager
def refusing(db, table: str, when: str, condition: str | None = None) -> None:
    """While inside, SQLite fails every `when` (INSERT/UPDATE) on `table`; with a `condition`, only
    the rows matching it (the trigger then aborts the statement: an IntegrityError)."""
    conn = sqlite3.connect(db.path)
    body = ("INSERT INTO disk_is_full VALUES (1)" if condition is None else
            "SELECT RAISE(ABORT, 'database or disk is full')")
    conn.execute(f"CREATE TRIGGER refuse BEFORE {when} ON {table} WHEN {condition or 1} BEGIN {body}; END")
    conn.commit()
    try:
        yield
    finally:
        conn.execute("DROP TRIGGER refuse")
        conn.commit()
        conn.close()


def error_of(events) -> dict | None:
    return next((data["error"] for _, data in events if isinstance(data, dict) and "error" in data), None)


async def ready_status(session) -> tuple[int, str]:
    async with session.get("/ready") as resp:
        return resp.status, (await resp.json())["status"]


async def test_a_failed_checkpoint_ends_the_stream_with_an_error_and_readiness_says_so(server, db):
    assert await ready_status(server) == (200, "ok")
    with refusing(db, "streams", "UPDATE"):  # checkpoints and the end fail; the stream's record is stored
        async with server.post("/v1/chat/completions", json=BODY) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    assert events[-1][1] != "[DONE]"
    error = error_of(events)
    assert error is not None and error["code"] == "storage_error", events[-3:]
    chunks = sum(isinstance(data, dict) for _, data in events[1:])  # after the role: tokens, then the error
    assert 4 <= chunks < BODY["max_tokens"]  # stopped at the failed checkpoint
    assert await ready_status(server) == (503, "storage_failing")
    assert await metric(server, "galley_storage_write_errors_total") >= 1


async def test_a_stream_that_cannot_be_stored_is_refused_before_its_first_token(server, db):
    with refusing(db, "streams", "INSERT"):
        async with server.post("/v1/chat/completions", json=BODY) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "storage_error"
    assert await ready_status(server) == (503, "storage_failing")


async def test_an_answer_that_cannot_be_stored_never_ends_normally(server, db):
    async with server.post("/api/v1/conversations", json={"model": "tiny"}) as resp:
        conversation = (await resp.json())["id"]
    with refusing(db, "messages", "INSERT", "NEW.role = 'assistant'"):
        async with server.post("/v1/chat/completions", json={**BODY, "conversation_id": conversation}) as resp:
            assert resp.status == 200
            events = await read_events(resp)
    # every token came, but the end did not: the client knows its answer is not in the conversation
    assert events[-1][1] != "[DONE]" and error_of(events)["code"] == "storage_error"
    assert not any(data["choices"][0]["finish_reason"] for _, data in events if isinstance(data, dict)
                   and data.get("choices"))
    async with server.get(f"/api/v1/conversations/{conversation}") as resp:
        assert [m["role"] for m in (await resp.json())["messages"]] == ["user"]

    async with server.post("/v1/chat/completions", json={**BODY, "conversation_id": conversation}) as resp:
        events = await read_events(resp)  # the disk is back: the next turn is stored as usual
    assert events[-1][1] == "[DONE]" and error_of(events) is None
    async with server.get(f"/api/v1/conversations/{conversation}") as resp:
        messages = (await resp.json())["messages"]
    assert [m["role"] for m in messages] == ["user", "user", "assistant"]
    assert messages[-1]["content"] == text_of(events)
