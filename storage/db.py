"""The SQLite file: WAL mode, versioned migrations, and the one thread that writes.

Every write runs on the writer thread, in its own transaction, in submission order; the
caller gets a `concurrent.futures.Future` (asyncio code awaits `asyncio.wrap_future(...)`,
so the event loop never blocks on a write). Reads use a second connection behind a lock.
A write that SQLite refuses (disk full, `database is locked`, I/O error) is also counted
here, so no failure goes unseen even where a caller does not wait: readiness and metrics
read `num_write_errors` and `last_write_error_s`. The rest of galley reaches the tables
through the store classes beside this module (`TenantStore`, `ConversationStore`,
`StreamStore`, `BatchStore`, `RegistryStore`), each wrapping one module's functions.
Must not import anything but the standard library and sqlite_utils.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import sqlite_utils

from storage import batch_tables, conversations, registry, streams, tenants

T = TypeVar("T")
Migration = Callable[[sqlite_utils.Database], None]

# Applied in this order, each once, recorded by function name: append, never reorder or rename.
MIGRATIONS: tuple[Migration, ...] = (
    tenants.create_tenant_tables,
    conversations.create_conversation_tables,
    streams.create_stream_tables,
    registry.create_registry_tables,
    batch_tables.create_batch_tables,
    batch_tables.add_batch_job_kind,
    registry.create_shadow_table,
    conversations.add_conversation_activity,
    batch_tables.add_batch_job_retention,
    tenants.add_tenant_ids,
    streams.add_stream_tenant_id,
    conversations.add_message_extra,
    registry.widen_model_kinds,
    streams.create_stream_images,
)


def connect(path: Path) -> sqlite_utils.Database:
    conn = sqlite3.connect(str(path), check_same_thread=False, timeout=10.0)
    db = sqlite_utils.Database(conn)
    db.execute("PRAGMA foreign_keys = ON")
    return db


def migrate(db: sqlite_utils.Database, migrations: Sequence[Migration]) -> list[str]:
    """Applies each migration not yet in `_migrations`, in order; returns their names.

    Each runs in `db.atomic()`; `Database` calls this inside one write transaction, so at
    startup either every pending migration applies or none does.
    """
    names = [m.__name__ for m in migrations]
    assert len(set(names)) == len(names), f"duplicate migration names: {names}"
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
    applied = {row["name"] for row in db.query("SELECT name FROM _migrations")}
    done = []
    for migration in migrations:
        if migration.__name__ in applied:
            continue
        with db.atomic():
            migration(db)
            db.execute("INSERT INTO _migrations (name, applied_at) VALUES (?, ?)",
                       [migration.__name__, datetime.now(UTC).isoformat(timespec="seconds")])
        done.append(migration.__name__)
    return done


class Database:
    """One SQLite file. Invariant: only the writer thread writes, one transaction per `write` job."""

    def __init__(self, path: str | Path, migrations: Sequence[Migration] = MIGRATIONS) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = connect(self.path)
        self._writer.enable_wal()
        self._reader = connect(self.path)
        self._read_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._closed = False
        self.num_write_errors = 0  # writes SQLite refused; domain errors raised by a write do not count
        self.last_write_error_s: float | None = None  # time.monotonic() of the latest
        self._thread = threading.Thread(target=self._run, name="galley-db-writer", daemon=True)
        self._thread.start()
        try:
            self.applied_migrations = self.write(lambda db: migrate(db, migrations)).result()
        except BaseException:
            self.close()
            raise

    def write(self, fn: Callable[[sqlite_utils.Database], T]) -> Future[T]:
        """Runs `fn(db)` on the writer thread inside a transaction; its result or exception comes back."""
        future: Future[T] = Future()
        with self._state_lock:
            if self._closed:
                raise RuntimeError("the database is closed")
            self._jobs.put((fn, future))
        return future

    def read(self, fn: Callable[[sqlite_utils.Database], T]) -> T:
        """Runs `fn(db)` on the read connection (blocking: from asyncio, use asyncio.to_thread)."""
        with self._read_lock:
            return fn(self._reader)

    def close(self) -> None:
        """Runs the writes already submitted, then stops the writer and closes both connections."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._thread.join()
        with self._read_lock:
            self._reader.close()
        self._writer.close()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self._writer.atomic():
                    result = fn(self._writer)
            except Exception as exc:
                if is_storage_error(exc):
                    self.num_write_errors += 1
                    self.last_write_error_s = time.monotonic()
                future.set_exception(exc)
            else:
                future.set_result(result)

    def failed_within(self, seconds: float) -> bool:
        """A write failed in SQLite within the last `seconds`."""
        last = self.last_write_error_s
        return last is not None and time.monotonic() - last < seconds


def is_storage_error(exc: BaseException) -> bool:
    """SQLite itself failed (full, locked, I/O, corrupt), as opposed to a constraint the caller
    turns into a domain error (a duplicate name) or a domain error raised by the write itself."""
    return isinstance(exc, sqlite3.Error) and not isinstance(exc, sqlite3.IntegrityError)
