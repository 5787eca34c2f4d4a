"""storage/conversations.py and storage/streams.py on a real SQLite file, through the writer thread."""

from __future__ import annotations

import sqlite3

import pytest

from storage import conversations, streams, tenants
from storage.conversations import ConversationNotFoundError
from storage.db import MIGRATIONS, Database
from storage.streams import StreamNotFoundError, StreamRecord, StreamStatus
from storage.tenants import Tenant


def write(db: Database, fn):
    return db.write(fn).result(timeout=10)


def new_conversation(db: Database, tenant: str = "default", model: str = "tiny", title: str | None = None):
    return write(db, lambda d: conversations.create_conversation(d, tenant, model, "1", title))


def make_record(stream_id: str = "strm_1", **fields) -> StreamRecord:
    base = dict(id=stream_id, tenant="default", conversation_id=None, kind="chat", model="tiny",
                request={"stream_options": {"include_usage": True}, "temperature": 0.5, "stop": ["\n"]},
                prompt_token_ids=[1, 2, 3], token_ids=[], texts=[])
    return StreamRecord(**{**base, **fields})


# ---- migrations ------------------------------------------------------------------------


def test_a_database_with_only_the_tenant_migration_gets_the_new_tables(tmp_path):
    path = tmp_path / "galley.db"
    old = Database(path, [tenants.create_tenant_tables])
    acme = {k: v for k, v in tenants.to_row(Tenant("acme", weight=2)).items() if k != "id"}  # as that schema had it
    write(old, lambda d: d.table("tenants").insert(acme))
    old.close()

    db = Database(path)
    try:
        assert db.applied_migrations == [m.__name__ for m in MIGRATIONS[1:]]  # every one after the tenants'
        assert db.applied_migrations[:2] == ["create_conversation_tables", "create_stream_tables"]
        assert {"conversations", "messages", "streams"} <= set(db.read(lambda d: d.table_names()))
        assert db.read(lambda d: tenants.get_tenant(d, "acme")).weight == 2.0
        made = new_conversation(db, "acme")
        assert db.read(lambda d: conversations.get_conversation(d, made.id, "acme")) == made
    finally:
        db.close()
    again = Database(path)
    try:
        assert again.applied_migrations == []
    finally:
        again.close()
    assert [m.__name__ for m in MIGRATIONS][:3] == [
        "create_tenant_tables", "create_conversation_tables", "create_stream_tables"]


# ---- conversations ---------------------------------------------------------------------


def test_conversation_round_trip_and_newest_updated_first(db):
    first = new_conversation(db, title="first")
    assert first.id.startswith("conv_") and len(first.id) == len("conv_") + 32
    assert (first.tenant, first.model, first.model_version, first.title) == ("default", "tiny", "1", "first")
    assert first.created_at == first.updated_at and first.created_at.endswith("+00:00")
    second = new_conversation(db)
    assert second.title is None and second.id != first.id
    assert db.read(lambda d: conversations.get_conversation(d, first.id, "default")) == first
    assert db.read(lambda d: conversations.list_conversations(d, "default")) == [second, first]

    write(db, lambda d: conversations.add_message(d, first.id, "user", "hi"))
    listed = db.read(lambda d: conversations.list_conversations(d, "default"))
    assert [c.id for c in listed] == [first.id, second.id]  # a new message makes it the newest
    assert listed[0].updated_at >= first.updated_at and listed[0].created_at == first.created_at
    assert [c.id for c in db.read(lambda d: conversations.list_conversations(d, "default", limit=1))] == [first.id]
    with pytest.raises(ValueError, match="limit"):
        db.read(lambda d: conversations.list_conversations(d, "default", limit=0))


def test_messages_keep_their_order_and_fields(db):
    conv = new_conversation(db)
    user = write(db, lambda d: conversations.add_message(d, conv.id, "user", "Hello 🚀"))
    reply = write(db, lambda d: conversations.add_message(d, conv.id, "assistant", "Hi there", prompt_tokens=7,
                                                          completion_tokens=3, stream_id="strm_abc"))
    assert user.id >= 1 and reply.id > user.id
    assert (user.role, user.content, user.prompt_tokens, user.completion_tokens, user.stream_id) == (
        "user", "Hello 🚀", None, None, None)
    assert db.read(lambda d: conversations.list_messages(d, conv.id)) == [user, reply]
    assert db.read(lambda d: conversations.list_messages(d, "conv_none")) == []
    after = db.read(lambda d: conversations.get_conversation(d, conv.id, "default"))
    assert after.updated_at == reply.created_at


def test_bad_messages_are_refused_and_change_nothing(db):
    conv = new_conversation(db)
    with pytest.raises(ConversationNotFoundError):
        write(db, lambda d: conversations.add_message(d, "conv_ghost", "user", "hi"))
    with pytest.raises(ValueError, match="role"):
        write(db, lambda d: conversations.add_message(d, conv.id, "robot", "hi"))
    with pytest.raises(ValueError, match="prompt_tokens"):
        write(db, lambda d: conversations.add_message(d, conv.id, "assistant", "x", prompt_tokens=-1))
    assert db.read(lambda d: conversations.list_messages(d, conv.id)) == []
    assert db.read(lambda d: conversations.get_conversation(d, conv.id, "default")) == conv
    with pytest.raises(sqlite3.IntegrityError):  # the schema holds even for raw SQL
        write(db, lambda d: d.execute(
            "INSERT INTO messages (conversation_id, role, content, created_at) VALUES ('conv_ghost', 'user', '', '')"))


def test_another_tenants_conversation_is_invisible(db):
    write(db, lambda d: tenants.create_tenant(d, Tenant("acme")))
    mine = new_conversation(db, "acme")
    theirs = new_conversation(db, "default")
    assert db.read(lambda d: conversations.get_conversation(d, mine.id, "default")) is None
    assert db.read(lambda d: conversations.list_conversations(d, "acme")) == [mine]
    assert db.read(lambda d: conversations.list_conversations(d, "default")) == [theirs]
    assert write(db, lambda d: conversations.delete_conversation(d, mine.id, "default")) is False
    assert db.read(lambda d: conversations.get_conversation(d, mine.id, "acme")) == mine
    assert db.read(lambda d: conversations.get_conversation(d, "conv_ghost", "acme")) is None


def test_delete_takes_the_messages_and_a_deleted_tenant_takes_its_conversations(db):
    write(db, lambda d: tenants.create_tenant(d, Tenant("acme")))
    gone = new_conversation(db, "acme")
    kept = new_conversation(db, "acme")
    for conv in (gone, kept):
        write(db, lambda d, c=conv: conversations.add_message(d, c.id, "user", "hi"))
        write(db, lambda d, c=conv: conversations.add_message(d, c.id, "assistant", "hello"))
    assert write(db, lambda d: conversations.delete_conversation(d, gone.id, "acme")) is True
    assert write(db, lambda d: conversations.delete_conversation(d, gone.id, "acme")) is False
    assert db.read(lambda d: conversations.get_conversation(d, gone.id, "acme")) is None
    assert db.read(lambda d: conversations.list_messages(d, gone.id)) == []
    assert len(db.read(lambda d: conversations.list_messages(d, kept.id))) == 2

    write(db, lambda d: tenants.delete_tenant(d, "acme"))
    assert db.read(lambda d: list(d.query("SELECT id FROM conversations"))) == []
    assert db.read(lambda d: list(d.query("SELECT id FROM messages"))) == []
    write(db, lambda d: tenants.create_tenant(d, Tenant("acme")))  # a new tenant of that name starts empty
    assert db.read(lambda d: conversations.list_conversations(d, "acme")) == []


# ---- streams ---------------------------------------------------------------------------


def test_stream_round_trip_gives_back_lists_and_dicts(db):
    record = make_record(conversation_id="conv_x")
    stored = write(db, lambda d: streams.insert_stream(d, record))
    assert stored.created_at and stored.updated_at == stored.created_at
    assert stored == StreamRecord(**{**record.__dict__, "created_at": stored.created_at,
                                     "updated_at": stored.created_at})
    loaded = db.read(lambda d: streams.get_stream(d, "strm_1"))
    assert loaded == stored
    assert isinstance(loaded.request, dict) and isinstance(loaded.prompt_token_ids, list)
    assert loaded.request == {"stream_options": {"include_usage": True}, "temperature": 0.5, "stop": ["\n"]}
    assert db.read(lambda d: streams.get_stream(d, "strm_none")) is None

    write(db, lambda d: streams.checkpoint_stream(d, "strm_1", [5, 6], ["Hel", "lo 🚀"]))
    write(db, lambda d: streams.checkpoint_stream(d, "strm_1", [5, 6, 7], ["Hel", "lo 🚀", ""]))
    loaded = db.read(lambda d: streams.get_stream(d, "strm_1"))
    assert (loaded.token_ids, loaded.texts, loaded.status) == ([5, 6, 7], ["Hel", "lo 🚀", ""], "running")
    assert loaded.updated_at >= stored.updated_at and loaded.created_at == stored.created_at

    write(db, lambda d: streams.finish_stream(d, "strm_1", [5, 6, 7, 8], ["Hel", "lo 🚀", "", "!"],
                                              "finished", "stop"))
    final = db.read(lambda d: streams.get_stream(d, "strm_1"))
    assert (final.token_ids, final.texts, final.status, final.finish_reason) == (
        [5, 6, 7, 8], ["Hel", "lo 🚀", "", "!"], "finished", "stop")
    # the first final state is kept: a late checkpoint or a second finish changes nothing
    write(db, lambda d: streams.checkpoint_stream(d, "strm_1", [], []))
    write(db, lambda d: streams.finish_stream(d, "strm_1", [], [], "failed", None))
    assert db.read(lambda d: streams.get_stream(d, "strm_1")) == final


def test_stream_inputs_are_checked(db):
    with pytest.raises(ValueError, match="status"):
        make_record(status="paused")
    with pytest.raises(ValueError, match="kind"):
        make_record(kind="embedding")
    with pytest.raises(ValueError, match="one text per token"):
        make_record(token_ids=[1, 2], texts=["a"])
    assert make_record(status=StreamStatus.CANCELLED).status == "cancelled"
    write(db, lambda d: streams.insert_stream(d, make_record()))
    with pytest.raises(sqlite3.IntegrityError):  # ids are unique
        write(db, lambda d: streams.insert_stream(d, make_record()))
    with pytest.raises(ValueError, match="status"):
        write(db, lambda d: streams.finish_stream(d, "strm_1", [], [], "done", None))
    with pytest.raises(ValueError, match="running"):
        write(db, lambda d: streams.finish_stream(d, "strm_1", [], [], "running", None))
    with pytest.raises(ValueError, match="one text per token"):
        write(db, lambda d: streams.checkpoint_stream(d, "strm_1", [1], []))
    with pytest.raises(StreamNotFoundError):
        write(db, lambda d: streams.checkpoint_stream(d, "strm_ghost", [1], ["a"]))
    with pytest.raises(StreamNotFoundError):
        write(db, lambda d: streams.finish_stream(d, "strm_ghost", [1], ["a"], "failed", None))
    with pytest.raises(ValueError, match="status"):
        db.read(lambda d: streams.list_streams(d, "paused"))
    with pytest.raises(ValueError, match="timezone"):
        write(db, lambda d: streams.delete_streams_finished_before(d, "2030-01-01T00:00:00"))
    assert db.read(lambda d: streams.get_stream(d, "strm_1")).token_ids == []


def test_list_streams_by_status_oldest_first(db):
    for i, created in enumerate(["2024-01-01T00:00:03.000+00:00", "2024-01-01T00:00:01.000+00:00",
                                 "2024-01-01T00:00:02.000+00:00"]):
        write(db, lambda d, i=i, c=created: streams.insert_stream(d, make_record(f"strm_{i}", created_at=c)))
    write(db, lambda d: streams.finish_stream(d, "strm_2", [], [], "cancelled", None))
    running = db.read(lambda d: streams.list_streams(d, "running"))
    assert [r.id for r in running] == ["strm_1", "strm_0"]
    assert [r.id for r in db.read(lambda d: streams.list_streams(d, StreamStatus.CANCELLED))] == ["strm_2"]
    assert db.read(lambda d: streams.list_streams(d, "failed")) == []


def test_retention_deletes_only_old_final_streams(db):
    old = "2024-01-01T00:00:00.000+00:00"
    for stream_id, status in [("strm_run", "running"), ("strm_done", "finished"), ("strm_cancel", "cancelled"),
                              ("strm_fail", "failed")]:
        write(db, lambda d, s=stream_id, st=status: streams.insert_stream(
            d, make_record(s, status=st, created_at=old, updated_at=old)))
    write(db, lambda d: streams.insert_stream(d, make_record("strm_new")))
    write(db, lambda d: streams.finish_stream(d, "strm_new", [1], ["a"], "finished", "length"))

    assert write(db, lambda d: streams.delete_streams_finished_before(d, "2023-12-31T23:59:59Z")) == 0
    # the same instant written another way (another offset, Z) compares as time, not as text
    assert write(db, lambda d: streams.delete_streams_finished_before(d, "2024-01-01T01:00:00+01:00")) == 0
    assert write(db, lambda d: streams.delete_streams_finished_before(d, "2024-01-01T00:00:00.001Z")) == 3
    left = {r["id"] for r in db.read(lambda d: list(d.query("SELECT id FROM streams")))}
    assert left == {"strm_run", "strm_new"}
    assert write(db, lambda d: streams.delete_streams_finished_before(d, "2999-01-01T00:00:00+00:00")) == 1
    assert [r.id for r in db.read(lambda d: streams.list_streams(d, "running"))] == ["strm_run"]


def test_updates_within_one_clock_tick_still_order_newest_first(db, monkeypatch):
    """Timestamps tie (milliseconds, or a clock that stands still): order by a strictly
    increasing key, not by the timestamp (this failed once in a fresh CI run)."""
    monkeypatch.setattr(conversations, "utc_now", lambda: "2026-01-01T00:00:00.000+00:00")
    first, second, third = (new_conversation(db, title=t) for t in ("1", "2", "3"))
    assert [c.id for c in db.read(lambda d: conversations.list_conversations(d, "default"))] == [
        third.id, second.id, first.id]
    write(db, lambda d: conversations.add_message(d, first.id, "user", "hi"))
    write(db, lambda d: conversations.add_message(d, second.id, "user", "hi"))
    assert [c.id for c in db.read(lambda d: conversations.list_conversations(d, "default"))] == [
        second.id, first.id, third.id]
    assert [c.id for c, _ in db.read(lambda d: conversations.list_all_conversations(d))] == [
        second.id, first.id, third.id]


# ---- the store -------------------------------------------------------------------------


def test_the_store_reads_a_conversation_with_its_messages_only_for_its_tenant(db):
    store = conversations.ConversationStore(db)
    write(db, lambda d: tenants.create_tenant(d, Tenant("other")))
    made = store.create("default", "tiny", "1", "t").result(timeout=10)
    calls = {"tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    added = store.add_messages(made.id, [("user", "Hi", None), ("assistant", "Hello", calls)]).result(timeout=10)
    assert [(m.role, m.content, m.extra) for m in added] == [("user", "Hi", None), ("assistant", "Hello", calls)]
    found, messages = store.with_messages(made.id, tenant="default")
    assert found == store.of_tenant("default")[0] and messages == added
    assert store.with_messages(made.id, tenant="other") is None  # another tenant's: as if missing
    assert store.with_messages(made.id, tenant=None) == (found, added)  # the admin API's read: any tenant's
    assert store.across_tenants(tenant="default") == [(found, 2)]
    with pytest.raises(ConversationNotFoundError):
        store.add_messages("conv_missing", [("user", "x", None)]).result(timeout=10)
    assert not store.delete(made.id, "other").result(timeout=10)
    assert store.delete(made.id, "default").result(timeout=10)
    assert store.with_messages(made.id, tenant=None) is None
