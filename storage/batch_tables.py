"""The batch tables, `batch_jobs` and `batch_items`: the statuses a job, an item and a job's
callback can have, the rows as dataclasses (`BatchJob`, `BatchItem`) and reading them back, and
the migrations that create and extend the tables (recorded by function name in `storage.db`'s
MIGRATIONS: never rename them). What is done with the rows is in `storage.batches`. Must not
import anything but the standard library and sqlite_utils.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import sqlite_utils


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ItemStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CallbackStatus(StrEnum):
    PENDING = "pending"  # not delivered yet (the job may still run)
    DELIVERED = "delivered"
    FAILED = "failed"  # every attempt failed


UNFINISHED = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
FINAL = (JobStatus.COMPLETED.value, JobStatus.FAILED.value, JobStatus.CANCELLED.value)


@dataclass(frozen=True)
class BatchJob:
    """Invariant: status in JobStatus; callback_status None exactly when callback_url is None."""

    id: str
    tenant: str
    model: str
    params: dict  # JSON-able sampling parameters, opaque to storage
    callback_url: str | None
    status: str
    num_items: int
    error: str | None
    callback_status: str | None
    callback_attempts: int
    created_at: str
    started_at: str | None
    finished_at: str | None
    kind: str = "generate"  # the model's: generate | embed | classify
    callback_secret: str | None = None  # signs the callback; shown to the tenant once, at creation
    input_bytes: int = 0  # the inputs as stored (JSON), counted against the tenant's stored bytes

    @property
    def is_final(self) -> bool:
        return self.status in FINAL


@dataclass(frozen=True)
class BatchItem:
    """One input and, once it has run, its result. Invariant: status in ItemStatus."""

    job_id: str
    idx: int
    input: Any  # JSON: a prompt string or a list of chat messages
    status: str
    output: str | None  # generate: the text; embed/classify: JSON (the vector, the prediction)
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None
    completed_at: str | None


# ---- schema ----------------------------------------------------------------------------


def sql_list(values) -> str:
    return ", ".join(f"'{v}'" for v in values)


def create_batch_tables(db: sqlite_utils.Database) -> None:
    """Migration: batch jobs (by tenant, by status) and their items."""
    db.execute(f"""
        CREATE TABLE batch_jobs (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
            model TEXT NOT NULL,
            params TEXT NOT NULL,  -- JSON object
            callback_url TEXT,
            status TEXT NOT NULL CHECK (status IN ({sql_list(JobStatus)})),
            num_items INTEGER NOT NULL CHECK (num_items >= 1),
            error TEXT,
            callback_status TEXT CHECK (callback_status IS NULL OR callback_status IN ({sql_list(CallbackStatus)})),
            callback_attempts INTEGER NOT NULL DEFAULT 0,
            created_at TEXT NOT NULL,
            started_at TEXT,
            finished_at TEXT
        )""")
    db.execute("CREATE INDEX batch_jobs_tenant ON batch_jobs(tenant, created_at)")
    db.execute("CREATE INDEX batch_jobs_status ON batch_jobs(status)")
    db.execute(f"""
        CREATE TABLE batch_items (
            job_id TEXT NOT NULL REFERENCES batch_jobs(id) ON DELETE CASCADE,
            idx INTEGER NOT NULL,
            input TEXT NOT NULL,  -- JSON
            status TEXT NOT NULL CHECK (status IN ({sql_list(ItemStatus)})),
            output TEXT,
            finish_reason TEXT,
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            error TEXT,
            completed_at TEXT,
            PRIMARY KEY (job_id, idx)
        )""")


def add_batch_job_kind(db: sqlite_utils.Database) -> None:
    """Migration: the kind of a job's model (generate, embed, classify)."""
    db.execute("ALTER TABLE batch_jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'generate'")


def add_batch_job_retention(db: sqlite_utils.Database) -> None:
    """Migration: the callback's signing secret and each job's stored input bytes (existing jobs counted)."""
    db.execute("ALTER TABLE batch_jobs ADD COLUMN callback_secret TEXT")
    db.execute("ALTER TABLE batch_jobs ADD COLUMN input_bytes INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE batch_jobs SET input_bytes = (SELECT coalesce(sum(length(CAST(input AS BLOB))), 0) "
               "FROM batch_items WHERE job_id = batch_jobs.id)")
    db.execute("CREATE INDEX batch_jobs_finished ON batch_jobs(finished_at)")


# ---- rows as stored --------------------------------------------------------------------


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def job_from_row(row: Mapping[str, Any]) -> BatchJob:
    return BatchJob(**{**row, "params": json.loads(row["params"])})


def item_from_row(row: Mapping[str, Any]) -> BatchItem:
    return BatchItem(**{**row, "input": json.loads(row["input"])})
