"""The store classes of storage/ (streams, batches, registry) on a real SQLite file: what each
method reads and writes, exactly (the tenant and conversation stores are tested beside their
tables in test_tenants.py and test_conversations_storage.py)."""

from __future__ import annotations

import pytest

from storage import conversations
from storage import registry as registry_module
from storage.batches import BatchStore, CallbackStatus, ItemResult, ItemStatus, JobStatus
from storage.registry import Deployment, ModelVersion, RegistryStore, Shadow, VersionExistsError
from storage.streams import StoredAnswer, StreamRecord, StreamStatus, StreamStore


def done(future):
    return future.result(timeout=10)


def record(stream_id: str, conversation_id: str | None = None) -> StreamRecord:
    return StreamRecord(stream_id, "default", conversation_id, "chat", "tiny", {"format": {}}, [1, 2, 3], [], [])


# ---- streams ---------------------------------------------------------------------------


def test_a_stream_finishes_with_its_conversations_answer_in_one_write(db):
    store = StreamStore(db)
    conversation = done(db.write(lambda d: conversations.create_conversation(d, "default", "tiny", "1")))
    stored = done(store.insert(record("strm_a", conversation.id)))
    assert store.get("strm_a") == stored and store.with_status(StreamStatus.RUNNING) == [stored]
    done(store.checkpoint("strm_a", [7], ["He"]))
    assert store.get("strm_a").texts == ["He"]
    done(store.finish("strm_a", [7, 8], ["He", "llo"], StreamStatus.FINISHED, "stop", StoredAnswer(conversation.id, 3)))
    final = store.get("strm_a")
    assert (final.status, final.token_ids, final.finish_reason) == ("finished", [7, 8], "stop")
    [answer] = db.read(lambda d: conversations.list_messages(d, conversation.id))
    assert (answer.role, answer.content, answer.prompt_tokens, answer.completion_tokens, answer.stream_id) == (
        "assistant", "Hello", 3, 2, "strm_a")
    assert store.with_status(StreamStatus.RUNNING) == []
    assert done(store.delete_finished_before("2999-01-01T00:00:00+00:00")) == 1 and store.get("strm_a") is None


def test_a_stream_whose_conversation_is_gone_still_finishes(db):
    store = StreamStore(db)
    done(store.insert(record("strm_b", "conv_gone")))
    done(store.finish("strm_b", [7], ["x"], StreamStatus.CANCELLED, None, StoredAnswer("conv_gone", 3)))
    assert store.get("strm_b").status == "cancelled"


# ---- batches ---------------------------------------------------------------------------


def test_a_batch_job_through_the_store(db):
    store = BatchStore(db)
    job = done(store.create("default", "tiny", ["a", "b", "c"], {"max_tokens": 4}, "https://x.example/cb"))
    assert store.unfinished() == [job] and store.job(job.id, "other") is None
    done(store.start(job.id))
    assert [i.idx for i in store.items(job.id, ItemStatus.PENDING)] == [0, 1, 2]
    stored = done(store.finish_items(job.id, [(0, ItemResult(ItemStatus.COMPLETED, "A")),
                                              (1, ItemResult(ItemStatus.FAILED, error="no"))]))
    assert stored == [True, True]
    assert store.item_counts(job.id) == {"pending": 1, "completed": 1, "failed": 1, "cancelled": 0}
    cancelled = done(store.cancel(job.id, "default"))
    assert cancelled.changed and cancelled.num_items == 1 and cancelled.job.status == JobStatus.CANCELLED
    assert not done(store.finish(job.id, JobStatus.COMPLETED))  # a final status is written once
    found, counts = store.job_with_counts(job.id, "default")
    assert found.status == "cancelled" and counts["cancelled"] == 1
    assert [i.status for i in store.job_with_items(job.id, "default")[1]] == ["completed", "failed", "cancelled"]
    assert store.jobs_with_counts("default") == [(found, counts)] and store.jobs_with_counts("other") == []
    assert store.undelivered_callbacks() == [found]
    done(store.set_callback(job.id, CallbackStatus.DELIVERED, 1))
    assert store.job(job.id).callback_status == "delivered" and store.undelivered_callbacks() == []
    assert done(store.expire(-1)) == 1 and store.job(job.id) is None


# ---- registry --------------------------------------------------------------------------


def test_the_registry_restores_registers_and_shadows(db):
    store = RegistryStore(db)
    seed = ModelVersion("tiny", "1", "/models/tiny")
    versions, deployments = done(store.restore([seed], "config"))
    assert [v.ref for v in versions] == ["tiny@1"] and deployments[0].traffic == {"1": 100}
    assert [(e.kind, e.reason) for e in store.events("tiny")] == [("deploy", "config")]
    done(store.set_state("tiny", "1", "ready"))
    versions, _ = done(store.restore([seed], "config"))  # a restart: registered once, unloaded again
    assert [(v.ref, v.state) for v in versions] == [("tiny@1", "unloaded")] and len(store.events()) == 1
    assert done(store.register(ModelVersion("tiny", "2", "/models/tiny2"))) is None
    with pytest.raises(VersionExistsError):
        done(store.register(ModelVersion("tiny", "2", "/models/tiny2")))
    first = done(store.register(ModelVersion("other", "1", "/models/o"), deploy_reason="first version"))
    assert first.traffic == {"1": 100} and store.events("other")[0].reason == "first version"
    saved = done(store.save_deployment(Deployment("tiny", {"1": 50, "2": 50}, "1"), "traffic"))
    assert saved.traffic == {"1": 50, "2": 50} and store.events("tiny", 1)[0].kind == "traffic"
    shadow = done(store.set_shadow(Shadow("tiny", "2", 10)))
    assert store.shadows() == [shadow]
    done(store.clear_shadow("tiny"))
    assert store.shadows() == []


def test_a_registry_from_before_the_tensor_kinds_keeps_its_versions_and_takes_the_new_kinds(tmp_path):
    """`widen_model_kinds` rebuilds `model_versions` with the new CHECK: a database written before it (its
    kind check allowing generate, embed, classify only) keeps every row and then takes onnx and tabular."""
    import sqlite3

    from storage.db import MIGRATIONS, Database

    path = tmp_path / "old.db"
    before = MIGRATIONS[: MIGRATIONS.index(registry_module.widen_model_kinds)]
    old = Database(path, migrations=before)
    RegistryStore(old).register(ModelVersion("chat", "1", "/m", "generate", {"pinned": True}), "first").result()
    with pytest.raises(sqlite3.IntegrityError):
        RegistryStore(old).register(ModelVersion("iris", "1", "/iris.json", "tabular")).result()
    old.close()
    new = Database(path)
    store = RegistryStore(new)
    store.register(ModelVersion("iris", "1", "/iris.json", "tabular"), "first").result()
    versions, deployments = store.restore([], "test").result()
    assert {(v.name, v.kind, v.options.get("pinned")) for v in versions} == {("chat", "generate", True),
                                                                           ("iris", "tabular", None)}
    assert {d.model_name for d in deployments} == {"chat", "iris"}
    new.close()
