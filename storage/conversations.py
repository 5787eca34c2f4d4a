"""Conversations and their messages: tables `conversations`, `messages`.

A conversation belongs to one tenant and is pinned to one model version; its messages are
kept in insertion order. Every lookup by id also takes the tenant, so one tenant can never
read or delete another's conversation. Deleting a conversation deletes its messages, and
deleting a tenant deletes its conversations (foreign keys, ON DELETE CASCADE). Sync
functions over a `sqlite_utils.Database` (writes belong on the writer thread,
`storage.db.Database.write`), and `ConversationStore`, through which the rest of galley
reaches them. Must not import anything but the standard library and sqlite_utils.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlite_utils

if TYPE_CHECKING:
    from storage.db import Database  # storage.db imports this module for its migrations

from storage.tenants import utc_now

ROLES = ("system", "developer", "user", "assistant", "tool")
ID_PREFIX = "conv_"


class ConversationNotFoundError(LookupError):
    pass


@dataclass(frozen=True)
class Conversation:
    id: str
    tenant: str
    model: str
    model_version: str
    title: str | None
    created_at: str
    updated_at: str


@dataclass(frozen=True)
class Message:
    """One turn. Invariant: role in ROLES; token counts None or >= 0."""

    id: int
    conversation_id: str
    role: str
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    stream_id: str | None
    created_at: str
    extra: dict[str, Any] | None = None  # OpenAI's other message fields: tool_calls, tool_call_id, name, reasoning

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("prompt_tokens", "completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")


# ---- schema ----------------------------------------------------------------------------


def create_conversation_tables(db: sqlite_utils.Database) -> None:
    """Migration: conversations (by tenant) and their messages."""
    roles = ", ".join(f"'{role}'" for role in ROLES)
    db.execute("""
        CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
            model TEXT NOT NULL,
            model_version TEXT NOT NULL,
            title TEXT,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL
        )""")
    db.execute("CREATE INDEX conversations_tenant ON conversations(tenant, updated_at)")
    db.execute(f"""
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ({roles})),
            content TEXT NOT NULL,
            prompt_tokens INTEGER CHECK (prompt_tokens IS NULL OR prompt_tokens >= 0),
            completion_tokens INTEGER CHECK (completion_tokens IS NULL OR completion_tokens >= 0),
            stream_id TEXT,
            created_at TEXT NOT NULL
        )""")
    db.execute("CREATE INDEX messages_conversation ON messages(conversation_id, id)")


def add_conversation_activity(db: sqlite_utils.Database) -> None:
    """Migration: a strictly increasing activity number orders conversations by last update
    (millisecond timestamps tie, and then the order was arbitrary)."""
    db.execute("ALTER TABLE conversations ADD COLUMN activity INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE conversations SET activity = rowid")
    db.execute("CREATE INDEX conversations_activity ON conversations(tenant, activity)")
    db.execute("CREATE INDEX conversations_latest ON conversations(activity)")  # MAX(activity) without a scan


def add_message_extra(db: sqlite_utils.Database) -> None:
    """Migration: a message's other fields (an assistant's tool calls and thoughts, a tool result's
    call id), as JSON, so that tools and reasoning work in stored conversations."""
    db.execute("ALTER TABLE messages ADD COLUMN extra TEXT")


NEXT_ACTIVITY = "(SELECT COALESCE(MAX(activity), 0) + 1 FROM conversations)"


def conversation_from_row(row: Mapping[str, Any]) -> Conversation:
    return Conversation(**{k: v for k, v in row.items() if k != "activity"})


def message_from_row(row: Mapping[str, Any]) -> Message:
    extra = row.get("extra")
    return Message(**{**row, "extra": json.loads(extra) if extra else None})


# ---- conversations ---------------------------------------------------------------------


def create_conversation(db: sqlite_utils.Database, tenant: str, model: str, model_version: str,
                        title: str | None = None) -> Conversation:
    now = utc_now()
    conversation = Conversation(ID_PREFIX + uuid.uuid4().hex, tenant, model, model_version, title, now, now)
    row = dataclasses.asdict(conversation)
    db.execute(f"INSERT INTO conversations ({', '.join(row)}, activity) VALUES ({', '.join('?' * len(row))}, "
               f"{NEXT_ACTIVITY})", list(row.values()))
    return conversation


def get_conversation(db: sqlite_utils.Database, conversation_id: str, tenant: str) -> Conversation | None:
    """The conversation, or None when it does not exist or is another tenant's."""
    rows = list(db.query("SELECT * FROM conversations WHERE id = ? AND tenant = ?", [conversation_id, tenant]))
    return conversation_from_row(rows[0]) if rows else None


def list_conversations(db: sqlite_utils.Database, tenant: str, limit: int = 100) -> list[Conversation]:
    """The tenant's conversations, most recently updated first."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    rows = db.query("SELECT * FROM conversations WHERE tenant = ? ORDER BY activity DESC LIMIT ?",
                    [tenant, limit])
    return [conversation_from_row(row) for row in rows]


def find_conversation(db: sqlite_utils.Database, conversation_id: str) -> Conversation | None:
    """Any tenant's conversation by id: for the admin API only (tenant-facing code uses get_conversation)."""
    rows = list(db.query("SELECT * FROM conversations WHERE id = ?", [conversation_id]))
    return conversation_from_row(rows[0]) if rows else None


def list_all_conversations(db: sqlite_utils.Database, limit: int = 100,
                           tenant: str | None = None) -> list[tuple[Conversation, int]]:
    """Conversations across tenants (or one tenant's) with their message counts, most recent first: admin API."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    where, params = ("WHERE c.tenant = ?", [tenant]) if tenant else ("", [])
    rows = db.query(f"""
        SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS num_messages
        FROM conversations c {where} ORDER BY c.activity DESC LIMIT ?""", [*params, limit])
    out = []
    for row in rows:
        count = row.pop("num_messages")
        out.append((conversation_from_row(row), count))
    return out


def delete_conversation(db: sqlite_utils.Database, conversation_id: str, tenant: str) -> bool:
    """Deletes the conversation and its messages; False when it is not there (or another tenant's)."""
    cursor = db.execute("DELETE FROM conversations WHERE id = ? AND tenant = ?", [conversation_id, tenant])
    return cursor.rowcount > 0


# ---- messages --------------------------------------------------------------------------


def add_message(db: sqlite_utils.Database, conversation_id: str, role: str, content: str,
                prompt_tokens: int | None = None, completion_tokens: int | None = None,
                stream_id: str | None = None, extra: dict[str, Any] | None = None) -> Message:
    """Appends a message and bumps the conversation's updated_at; ConversationNotFoundError if there is none."""
    now = utc_now()
    message = Message(0, conversation_id, role, content, prompt_tokens, completion_tokens, stream_id, now,
                      extra or None)
    cursor = db.execute(f"UPDATE conversations SET updated_at = ?, activity = {NEXT_ACTIVITY} WHERE id = ?",
                        [now, conversation_id])
    if cursor.rowcount == 0:
        raise ConversationNotFoundError(conversation_id)
    row = dataclasses.asdict(message)
    del row["id"]
    row["extra"] = json.dumps(message.extra) if message.extra else None
    table = db.table("messages").insert(row)
    return dataclasses.replace(message, id=table.last_rowid)


def list_messages(db: sqlite_utils.Database, conversation_id: str) -> list[Message]:
    """The conversation's messages in the order they were added."""
    rows = db.query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", [conversation_id])
    return [message_from_row(row) for row in rows]


def get_with_messages(db: sqlite_utils.Database, conversation_id: str,
                      tenant: str | None) -> tuple[Conversation, list[Message]] | None:
    """The conversation and its messages; None when it does not exist or is another tenant's.
    `tenant` None: any tenant's, for the admin API only."""
    found = (find_conversation(db, conversation_id) if tenant is None
             else get_conversation(db, conversation_id, tenant))
    return None if found is None else (found, list_messages(db, conversation_id))


# ---- the store -------------------------------------------------------------------------


class ConversationStore:
    """Conversations and messages in one database: the only way the rest of galley reaches these tables.

    Reads block (from asyncio, call them through `asyncio.to_thread`); writes run on the
    writer thread and return its `Future`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, tenant: str, model: str, model_version: str, title: str | None = None) -> Future[Conversation]:
        return self.db.write(lambda db: create_conversation(db, tenant, model, model_version, title))

    def of_tenant(self, tenant: str, limit: int = 100) -> list[Conversation]:
        """The tenant's conversations, most recently updated first."""
        return self.db.read(lambda db: list_conversations(db, tenant, limit))

    def across_tenants(self, limit: int = 100, tenant: str | None = None) -> list[tuple[Conversation, int]]:
        """Every tenant's conversations (or one's) with their message counts, most recent first: admin API."""
        return self.db.read(lambda db: list_all_conversations(db, limit, tenant))

    def with_messages(self, conversation_id: str, *, tenant: str | None) -> tuple[Conversation, list[Message]] | None:
        """The one read of a conversation and its messages (`tenant` None: any tenant's, admin API only)."""
        return self.db.read(lambda db: get_with_messages(db, conversation_id, tenant))

    def delete(self, conversation_id: str, tenant: str) -> Future[bool]:
        return self.db.write(lambda db: delete_conversation(db, conversation_id, tenant))

    def add_messages(self, conversation_id: str, messages: Sequence[tuple[str, str, dict[str, Any] | None]]
                     ) -> Future[list[Message]]:
        """Appends (role, content, extra) messages in one transaction; ConversationNotFoundError if it is gone."""
        turn = list(messages)  # a copy: the writer thread reads it later
        return self.db.write(lambda db: [add_message(db, conversation_id, role, content, extra=extra)
                                         for role, content, extra in turn])
