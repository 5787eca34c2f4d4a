"""storage/: the writer thread, migrations, tenants and hashed keys on a real SQLite file."""

from __future__ import annotations

import re
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage import tenants
from storage.db import MIGRATIONS, Database
from storage.tenants import ApiKey, Tenant, hash_key


def write(db: Database, fn):
    return db.write(fn).result(timeout=10)


def test_first_open_creates_the_folder_wal_and_the_default_tenant(tmp_path):
    db = Database(tmp_path / "new" / "galley.db")
    try:
        assert db.applied_migrations == [m.__name__ for m in MIGRATIONS]
        assert db.read(lambda d: d.journal_mode) == "wal"
        assert [t.name for t in db.read(tenants.list_tenants)] == ["default"]
    finally:
        db.close()
    again = Database(tmp_path / "new" / "galley.db")
    try:
        assert again.applied_migrations == []
        applied = again.read(lambda d: list(d.query("SELECT name FROM _migrations")))
        assert sorted(r["name"] for r in applied) == sorted(m.__name__ for m in MIGRATIONS)
    finally:
        again.close()


def test_migrations_run_in_order_once_and_a_failed_one_changes_nothing(tmp_path):
    path = tmp_path / "galley.db"
    order: list[str] = []

    def add_a(d):
        order.append("a")
        d.execute("CREATE TABLE a (x INTEGER)")

    def add_b(d):
        order.append("b")
        d.execute("CREATE TABLE b (x INTEGER)")

    def broken(d):
        d.execute("CREATE TABLE c (x INTEGER)")
        raise RuntimeError("boom")

    Database(path, [*MIGRATIONS, add_a]).close()
    with pytest.raises(RuntimeError, match="boom"):
        Database(path, [*MIGRATIONS, add_a, add_b, broken])
    db = Database(path, [*MIGRATIONS, add_a, add_b])
    try:
        assert order == ["a", "b", "b"]  # b rolled back with broken (one transaction), then applied alone
        assert db.applied_migrations == ["add_b"]
        assert "c" not in db.read(lambda d: d.table_names())
    finally:
        db.close()


def test_every_write_runs_on_the_one_writer_thread_in_its_own_transaction(db):
    threads: set[str] = set()

    def insert(i: int):
        def fn(d):
            threads.add(threading.current_thread().name)
            return tenants.create_tenant(d, Tenant(f"t{i}"))
        return db.write(fn).result(timeout=10)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(insert, range(40)))
    assert threads == {"galley-db-writer"}
    assert len(db.read(tenants.list_tenants)) == 41

    def half_then_fail(d):
        tenants.create_tenant(d, Tenant("half"))
        raise ValueError("no")

    with pytest.raises(ValueError):
        write(db, half_then_fail)
    assert db.read(lambda d: tenants.get_tenant(d, "half")) is None
    assert write(db, lambda d: tenants.create_tenant(d, Tenant("after"))).name == "after"


def test_close_runs_pending_writes_then_refuses_new_ones(tmp_path):
    db = Database(tmp_path / "galley.db")
    futures = [db.write(lambda d, i=i: tenants.create_tenant(d, Tenant(f"t{i}"))) for i in range(30)]
    db.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        db.write(lambda d: None)
    db.close()  # idempotent
    reopened = Database(tmp_path / "galley.db")
    try:
        assert len(reopened.read(tenants.list_tenants)) == 31
    finally:
        reopened.close()


def test_tenant_validation_and_access_questions():
    with pytest.raises(ValueError, match="weight"):
        Tenant("a", weight=0)
    with pytest.raises(ValueError, match="max_priority"):
        Tenant("a", max_priority="urgent")
    with pytest.raises(ValueError, match="max_tokens"):
        Tenant("a", max_tokens=0)
    assert Tenant("a").allows_model("anything")
    limited = Tenant("a", allowed_models=["x", "y"], max_priority="normal")
    assert limited.allowed_models == ("x", "y")
    assert limited.allows_model("x") and not limited.allows_model("z")
    assert [limited.allows_priority(p) for p in ("high", "normal", "low")] == [False, True, True]
    assert all(Tenant("b").allows_priority(p) for p in ("high", "normal", "low"))
    assert [Tenant("c", max_priority="low").allows_priority(p) for p in ("high", "normal", "low")] == [
        False, False, True]
    with pytest.raises(ValueError):
        limited.allows_priority("urgent")


def test_tenant_crud_round_trip(db):
    made = write(db, lambda d: tenants.create_tenant(
        d, Tenant("acme", weight=2, max_priority="normal", allowed_models=("demo",), tokens_per_minute=1000)))
    assert db.read(lambda d: tenants.get_tenant(d, "acme")) == made
    with pytest.raises(tenants.TenantExistsError):
        write(db, lambda d: tenants.create_tenant(d, Tenant("acme")))
    updated = write(db, lambda d: tenants.update_tenant(
        d, "acme", {"tokens_per_minute": None, "allowed_models": None, "max_tokens": 64}))
    assert (updated.tokens_per_minute, updated.allowed_models, updated.max_tokens) == (None, None, 64)
    assert updated.weight == 2.0 and updated.created_at == made.created_at
    assert db.read(lambda d: tenants.get_tenant(d, "acme")) == updated
    with pytest.raises(ValueError, match="weight"):
        write(db, lambda d: tenants.update_tenant(d, "acme", {"weight": -1}))
    with pytest.raises(ValueError, match="name"):
        write(db, lambda d: tenants.update_tenant(d, "acme", {"name": "other"}))
    with pytest.raises(tenants.TenantNotFoundError):
        write(db, lambda d: tenants.update_tenant(d, "ghost", {"weight": 3}))
    assert [t.name for t in db.read(tenants.list_tenants)] == ["acme", "default"]
    write(db, lambda d: tenants.delete_tenant(d, "acme"))
    assert db.read(lambda d: tenants.get_tenant(d, "acme")) is None
    with pytest.raises(tenants.TenantNotFoundError):
        write(db, lambda d: tenants.delete_tenant(d, "acme"))
    with pytest.raises(ValueError, match="default"):
        write(db, lambda d: tenants.delete_tenant(d, "default"))


def test_keys_are_hashed_revocable_and_go_with_their_tenant(db):
    write(db, lambda d: tenants.create_tenant(d, Tenant("acme")))
    plaintext, key = write(db, lambda d: tenants.create_key(d, "acme"))
    assert re.fullmatch(r"gk_[0-9a-f]{8}_[A-Za-z0-9_-]{43}", plaintext)
    assert tenants.key_prefix(plaintext) == key.prefix and key.tenant == "acme" and key.revoked_at is None
    assert db.read(lambda d: tenants.find_tenant_by_key_hash(d, hash_key(plaintext))).name == "acme"
    stored = db.read(lambda d: list(d.query("SELECT * FROM api_keys")))
    assert stored == [{**key.__dict__, "key_hash": hash_key(plaintext)}]
    assert db.read(tenants.active_keys) == [(key, hash_key(plaintext))]

    revoked = write(db, lambda d: tenants.revoke_key(d, key.prefix))
    assert revoked.revoked_at is not None
    assert write(db, lambda d: tenants.revoke_key(d, key.prefix)) == revoked  # first revocation time kept
    assert db.read(lambda d: tenants.find_tenant_by_key_hash(d, hash_key(plaintext))) is None
    assert db.read(tenants.active_keys) == []
    assert db.read(lambda d: tenants.list_keys(d, "acme")) == [revoked]
    with pytest.raises(tenants.KeyNotFoundError):
        write(db, lambda d: tenants.revoke_key(d, "00000000"))
    with pytest.raises(tenants.TenantNotFoundError):
        write(db, lambda d: tenants.create_key(d, "ghost"))

    write(db, lambda d: tenants.create_key(d, "acme"))
    write(db, lambda d: tenants.delete_tenant(d, "acme"))
    assert db.read(lambda d: list(d.query("SELECT * FROM api_keys"))) == []


def test_key_prefix_parses_only_our_shape():
    assert tenants.key_prefix("gk_0123abcd_secret_with_underscores") == "0123abcd"
    for other in ("", "sk-abc", "gk_", "gk_0123abcd", "gk_0123abcd_", "xx_0123abcd_secret"):
        assert tenants.key_prefix(other) is None


def test_settings_keep_the_first_value_unless_overwritten(db):
    assert db.read(lambda d: tenants.get_setting(d, "x")) is None
    assert write(db, lambda d: tenants.set_setting(d, "x", "1", overwrite=False)) == "1"
    assert write(db, lambda d: tenants.set_setting(d, "x", "2", overwrite=False)) == "1"
    assert write(db, lambda d: tenants.set_setting(d, "x", "3")) == "3"


def test_constraints_hold_even_for_raw_sql(db):
    with pytest.raises(sqlite3.IntegrityError):
        write(db, lambda d: d.execute("UPDATE tenants SET weight = 0 WHERE name = 'default'"))
    with pytest.raises(sqlite3.IntegrityError):  # foreign key: a key needs its tenant
        write(db, lambda d: d.table("api_keys").insert(
            {**ApiKey("abcdabcd", "ghost", tenants.utc_now()).__dict__, "key_hash": "h"}))


def test_the_store_wraps_tenants_keys_and_settings(db):
    store = tenants.TenantStore(db)
    saved = store.create(Tenant("acme", max_concurrent=2)).result(timeout=10)
    assert store.get("acme") == saved and [t.name for t in store.tenants()] == ["acme", "default"]
    assert store.update("acme", {"max_concurrent": None}).result(timeout=10).max_concurrent is None
    plaintext, key = store.create_key("acme").result(timeout=10)
    assert store.keys_of("acme") == [key] and store.keys_of("nobody") is None
    assert store.active_keys() == [(key, hash_key(plaintext))]
    assert store.revoke_key(key.prefix).result(timeout=10).revoked_at is not None
    assert store.active_keys() == []
    assert store.set_setting("s", "1", overwrite=False).result(timeout=10) == "1"
    assert store.set_setting("s", "2", overwrite=False).result(timeout=10) == "1" and store.setting("s") == "1"
    store.delete("acme").result(timeout=10)
    assert store.get("acme") is None
