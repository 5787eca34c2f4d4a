"""Stream records: table `streams`, what a generation has emitted so far, to resume or replay it;
table `stream_images`, a running stream's prompt images (opaque bytes), so it can resume after a
restart; they are deleted when it finishes (a replay needs only the texts).

The stream hub inserts a record when a generation starts, checkpoints the emitted tokens
and their text deltas as it goes, and finishes it once; a retention job deletes old final
records. Lists and the request are JSON text columns, read back as lists and dicts. A
record's final state is written once: checkpoints and finishes after that change nothing.
Sync functions over a `sqlite_utils.Database` (writes belong on the writer thread,
`storage.db.Database.write`), and `StreamStore`, through which the rest of galley reaches
them. Must not import anything but the standard library and sqlite_utils.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import sqlite_utils

from storage.conversations import ConversationNotFoundError, add_message
from storage.tenants import utc_now

if TYPE_CHECKING:
    from storage.db import Database  # storage.db imports this module for its migrations

KINDS = ("chat", "completion")
JSON_COLUMNS = ("request", "prompt_token_ids", "token_ids", "texts")


class StreamStatus(StrEnum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


STATUSES = tuple(s.value for s in StreamStatus)
FINAL_STATUSES = tuple(s for s in STATUSES if s != StreamStatus.RUNNING)


class StreamNotFoundError(LookupError):
    pass


def check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")


def check_texts(token_ids: list[int], texts: list[str]) -> None:
    if len(token_ids) != len(texts):
        raise ValueError(f"one text per token: {len(token_ids)} token ids but {len(texts)} texts")


@dataclass(frozen=True)
class StreamRecord:
    """Invariant: status in STATUSES, kind in KINDS, one text delta per emitted token."""

    id: str  # "strm_" + uuid4 hex, made by the caller
    tenant: str
    conversation_id: str | None
    kind: str  # "chat" | "completion"
    model: str
    request: dict  # JSON-able: chunk format and sampling params, opaque to storage
    prompt_token_ids: list[int]
    token_ids: list[int]  # emitted so far
    texts: list[str]  # per emitted token, the text delta that was sent for it
    status: str = StreamStatus.RUNNING.value
    finish_reason: str | None = None
    created_at: str = ""  # ISO 8601 UTC; filled by insert_stream when empty
    updated_at: str = ""
    tenant_id: str | None = None  # the owner's stable id (None: stored before tenants had ids)

    def __post_init__(self) -> None:
        check_status(self.status)
        object.__setattr__(self, "status", str(self.status))  # a StreamStatus becomes its plain value
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        check_texts(self.token_ids, self.texts)


# ---- schema ----------------------------------------------------------------------------


def create_stream_tables(db: sqlite_utils.Database) -> None:
    """Migration: streams, indexed by status (running ones at startup, final ones for retention)."""
    statuses = ", ".join(f"'{s}'" for s in STATUSES)
    kinds = ", ".join(f"'{k}'" for k in KINDS)
    db.execute(f"""
        CREATE TABLE streams (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            conversation_id TEXT,
            kind TEXT NOT NULL CHECK (kind IN ({kinds})),
            model TEXT NOT NULL,
            request TEXT NOT NULL,           -- JSON object
            prompt_token_ids TEXT NOT NULL,  -- JSON list of ints
            token_ids TEXT NOT NULL,         -- JSON list of ints
            texts TEXT NOT NULL,             -- JSON list of strings, one per token id
            status TEXT NOT NULL CHECK (status IN ({statuses})),
            finish_reason TEXT,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""")
    db.execute("CREATE INDEX streams_status ON streams(status, updated_at)")


def add_stream_tenant_id(db: sqlite_utils.Database) -> None:
    """Migration: the owning tenant's stable id beside its name."""
    db.execute("ALTER TABLE streams ADD COLUMN tenant_id TEXT")


def create_stream_images(db: sqlite_utils.Database) -> None:
    """Migration: a running stream's prompt images, one blob per stream."""
    db.execute("CREATE TABLE stream_images (stream_id TEXT PRIMARY KEY, images BLOB NOT NULL)")


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def to_row(record: StreamRecord) -> dict[str, Any]:
    row = dataclasses.asdict(record)
    for name in JSON_COLUMNS:
        row[name] = dumps(row[name])
    return row


def from_row(row: Mapping[str, Any]) -> StreamRecord:
    return StreamRecord(**{**row, **{name: json.loads(row[name]) for name in JSON_COLUMNS}})


def to_utc_text(iso_time: str) -> str:
    """`iso_time` in the stored format (UTC, milliseconds), so text comparison is time order."""
    moment = datetime.fromisoformat(iso_time)
    if moment.tzinfo is None:
        raise ValueError(f"time needs a timezone (e.g. +00:00 or Z), got {iso_time!r}")
    return moment.astimezone(UTC).isoformat(timespec="milliseconds")


# ---- streams ---------------------------------------------------------------------------


def insert_stream(db: sqlite_utils.Database, record: StreamRecord, images: bytes | None = None) -> StreamRecord:
    """Stores a new record (created_at/updated_at default to now), with its prompt's images if any,
    and returns it as stored."""
    created_at = record.created_at or utc_now()
    stored = dataclasses.replace(record, created_at=created_at, updated_at=record.updated_at or created_at)
    db.table("streams").insert(to_row(stored))
    if images is not None:
        db.execute("INSERT INTO stream_images (stream_id, images) VALUES (?, ?)", [record.id, images])
    return stored


def checkpoint_stream(db: sqlite_utils.Database, stream_id: str, token_ids: list[int], texts: list[str]) -> None:
    """Replaces the emitted tokens and texts of a running stream; a final one stays as it was."""
    check_texts(token_ids, texts)
    cursor = db.execute(
        "UPDATE streams SET token_ids = ?, texts = ?, updated_at = ? WHERE id = ? AND status = ?",
        [dumps(token_ids), dumps(texts), utc_now(), stream_id, StreamStatus.RUNNING.value])
    if cursor.rowcount == 0:
        require_stream(db, stream_id)


def finish_stream(db: sqlite_utils.Database, stream_id: str, token_ids: list[int], texts: list[str],
                  status: str, finish_reason: str | None) -> None:
    """Writes a running stream's final tokens, texts and status; the first final state is kept."""
    check_status(status)
    if status == StreamStatus.RUNNING:
        raise ValueError("a finished stream needs a final status, not 'running'")
    check_texts(token_ids, texts)
    cursor = db.execute(
        "UPDATE streams SET token_ids = ?, texts = ?, status = ?, finish_reason = ?, updated_at = ? "
        "WHERE id = ? AND status = ?",
        [dumps(token_ids), dumps(texts), str(status), finish_reason, utc_now(), stream_id,
         StreamStatus.RUNNING.value])
    if cursor.rowcount == 0:
        require_stream(db, stream_id)
    db.execute("DELETE FROM stream_images WHERE stream_id = ?", [stream_id])


def stream_images(db: sqlite_utils.Database, stream_id: str) -> bytes | None:
    rows = list(db.query("SELECT images FROM stream_images WHERE stream_id = ?", [stream_id]))
    return rows[0]["images"] if rows else None


def require_stream(db: sqlite_utils.Database, stream_id: str) -> None:
    if not list(db.query("SELECT 1 FROM streams WHERE id = ?", [stream_id])):
        raise StreamNotFoundError(stream_id)


def get_stream(db: sqlite_utils.Database, stream_id: str) -> StreamRecord | None:
    rows = list(db.query("SELECT * FROM streams WHERE id = ?", [stream_id]))
    return from_row(rows[0]) if rows else None


def list_streams(db: sqlite_utils.Database, status: str) -> list[StreamRecord]:
    """Every record with this status, oldest first."""
    check_status(status)
    rows = db.query("SELECT * FROM streams WHERE status = ? ORDER BY created_at, rowid", [str(status)])
    return [from_row(row) for row in rows]


def delete_streams_finished_before(db: sqlite_utils.Database, iso_time: str) -> int:
    """Retention: deletes final (not running) records last updated before `iso_time`; returns how many."""
    placeholders = ", ".join("?" for _ in FINAL_STATUSES)
    cursor = db.execute(f"DELETE FROM streams WHERE status IN ({placeholders}) AND updated_at < ?",
                        [*FINAL_STATUSES, to_utc_text(iso_time)])
    db.execute("DELETE FROM stream_images WHERE stream_id NOT IN (SELECT id FROM streams)")
    return cursor.rowcount


# ---- the store -------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredAnswer:
    """The assistant message a conversation's stream stores with its end, in the same transaction:
    its text is the stream's, its completion tokens the stream's tokens."""

    conversation_id: str
    prompt_tokens: int
    content: str | None = None  # the answer read from the text (its thoughts and calls apart); None: the text
    extra: dict[str, Any] | None = None  # its tool calls and thoughts (`storage.conversations.Message.extra`)


class StreamStore:
    """Stream records in one database: the only way the rest of galley reaches the `streams` table.

    Reads block (from asyncio, call them through `asyncio.to_thread`); writes run on the
    writer thread and return its `Future`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def insert(self, record: StreamRecord, images: bytes | None = None) -> Future[StreamRecord]:
        return self.db.write(lambda db: insert_stream(db, record, images))

    def checkpoint(self, stream_id: str, token_ids: list[int], texts: list[str]) -> Future[None]:
        ids, txt = list(token_ids), list(texts)  # copies: the writer thread reads them later
        return self.db.write(lambda db: checkpoint_stream(db, stream_id, ids, txt))

    def finish(self, stream_id: str, token_ids: list[int], texts: list[str], status: str,
               finish_reason: str | None, answer: StoredAnswer | None = None) -> Future[None]:
        """The stream's final state, and with `answer` the conversation's assistant message (a
        conversation deleted meanwhile gets none; the stream still finishes)."""
        ids, txt = list(token_ids), list(texts)

        def persist(db: sqlite_utils.Database) -> None:
            finish_stream(db, stream_id, ids, txt, status, finish_reason)
            if answer is not None:
                try:
                    content = "".join(txt) if answer.content is None else answer.content
                    add_message(db, answer.conversation_id, "assistant", content, prompt_tokens=answer.prompt_tokens,
                                completion_tokens=len(ids), stream_id=stream_id, extra=answer.extra)
                except ConversationNotFoundError:
                    pass

        return self.db.write(persist)

    def get(self, stream_id: str) -> StreamRecord | None:
        return self.db.read(lambda db: get_stream(db, stream_id))

    def images(self, stream_id: str) -> bytes | None:
        """A running stream's prompt images as inserted; None once it finished, or without any."""
        return self.db.read(lambda db: stream_images(db, stream_id))

    def with_status(self, status: str) -> list[StreamRecord]:
        """Every record with this status, oldest first."""
        return self.db.read(lambda db: list_streams(db, status))

    def delete_finished_before(self, iso_time: str) -> Future[int]:
        """Retention: deletes final records last updated before `iso_time`; returns how many."""
        return self.db.write(lambda db: delete_streams_finished_before(db, iso_time))
