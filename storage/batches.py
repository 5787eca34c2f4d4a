"""Batch jobs and their items: what is done with the rows of `batch_jobs` and `batch_items`
(the tables, their statuses and row types are in `storage.batch_tables`).

A job belongs to one tenant and holds its inputs as items, one row each, in order; each
item's result is written once, as it completes, so a restart reruns only the items that
had not finished. A job's final status (completed, failed, cancelled) is written once:
later item results and status changes leave a final job as it is, so a cancel always wins
over items still in flight. Deleting a tenant deletes its jobs, deleting a job its items
(ON DELETE CASCADE). A tenant's unfinished jobs and stored input bytes are capped at creation
(`JobQuota`, checked in the creating transaction, so concurrent creations cannot both slip
under a cap), and final jobs are deleted with their items after the retention
(`expire_jobs`). Sync functions over a `sqlite_utils.Database` (writes belong on the writer
thread, `storage.db.Database.write`), and `BatchStore`, through which the rest of galley
reaches them. Must not import anything but the standard library and sqlite_utils.
"""

from __future__ import annotations

import math
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlite_utils

from storage.batch_tables import (
    FINAL,
    UNFINISHED,
    BatchItem,
    BatchJob,
    CallbackStatus,
    ItemStatus,
    JobStatus,
    dumps,
    item_from_row,
    job_from_row,
    sql_list,
)
from storage.tenants import utc_now

if TYPE_CHECKING:
    from storage.db import Database  # the type only: storage.db imports the tables' module for its migrations

ID_PREFIX = "batch_"


@dataclass(frozen=True)
class JobQuota:
    """A tenant's caps at job creation (None: no cap)."""

    max_unfinished_jobs: int | None = None
    max_stored_bytes: int | None = None
    retention_seconds: float = 0.0  # for the retry hint: when the oldest final job expires


class QuotaExceeded(Exception):
    """A new job would exceed a cap of `JobQuota`; nothing was written."""

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ItemResult:
    status: str  # completed | failed
    output: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


# ---- jobs ------------------------------------------------------------------------------


def create_job(db: sqlite_utils.Database, tenant: str, model: str, inputs: list[Any], params: dict,
               callback_url: str | None = None, kind: str = "generate", callback_secret: str | None = None,
               quota: JobQuota = JobQuota()) -> BatchJob:
    """A queued job with one pending item per input, in order; QuotaExceeded (nothing written) over a cap."""
    if not inputs:
        raise ValueError("a batch job needs at least one input")
    rows = [dumps(value) for value in inputs]
    input_bytes = sum(len(row.encode()) for row in rows)
    check_quota(db, tenant, input_bytes, quota)
    job = BatchJob(ID_PREFIX + uuid.uuid4().hex, tenant, model, params, callback_url, JobStatus.QUEUED.value,
                   len(inputs), None, CallbackStatus.PENDING.value if callback_url else None, 0, utc_now(),
                   None, None, kind, callback_secret if callback_url else None, input_bytes)
    db.table("batch_jobs").insert({**job.__dict__, "params": dumps(params)})
    db.table("batch_items").insert_all(
        {"job_id": job.id, "idx": i, "input": row, "status": ItemStatus.PENDING.value} for i, row in enumerate(rows))
    return job


def check_quota(db: sqlite_utils.Database, tenant: str, input_bytes: int, quota: JobQuota) -> None:
    """QuotaExceeded when the tenant has too many unfinished jobs, or stored bytes would pass the cap."""
    row = next(db.query(
        f"SELECT count(*) FILTER (WHERE status IN ({sql_list(UNFINISHED)})) AS unfinished, "
        "coalesce(sum(input_bytes), 0) AS stored, min(finished_at) AS oldest_final FROM batch_jobs WHERE tenant = ?",
        [tenant]))
    if quota.max_unfinished_jobs is not None and row["unfinished"] >= quota.max_unfinished_jobs:
        raise QuotaExceeded("batch_jobs", f"tenant {tenant!r} has {row['unfinished']} unfinished batch jobs, its "
                            f"limit; wait for one to finish or cancel one", 60)
    if quota.max_stored_bytes is not None and row["stored"] + input_bytes > quota.max_stored_bytes:
        raise QuotaExceeded("batch_bytes", f"tenant {tenant!r} stores {row['stored']} bytes of batch inputs; "
                            f"{input_bytes} more would pass its limit of {quota.max_stored_bytes} (finished "
                            "jobs are deleted after the retention)",
                            seconds_until_expiry(row["oldest_final"], quota.retention_seconds))


def seconds_until_expiry(finished_at: str | None, retention_seconds: float) -> int:
    """Whole seconds until a job finished at `finished_at` expires (60 while none has finished)."""
    if finished_at is None:
        return 60
    left = datetime.fromisoformat(finished_at).timestamp() + retention_seconds - time.time()
    return max(1, math.ceil(left))


def expire_jobs(db: sqlite_utils.Database, retention_seconds: float) -> int:
    """Deletes final jobs that finished over `retention_seconds` ago, with their items; returns how many."""
    cutoff = (datetime.now(UTC) - timedelta(seconds=retention_seconds)).isoformat(timespec="milliseconds")
    cursor = db.execute(f"DELETE FROM batch_jobs WHERE status IN ({sql_list(FINAL)}) AND finished_at < ?", [cutoff])
    return cursor.rowcount


def get_job(db: sqlite_utils.Database, job_id: str, tenant: str | None = None) -> BatchJob | None:
    """The job, or None when it does not exist or (with `tenant`) is another tenant's."""
    sql, args = "SELECT * FROM batch_jobs WHERE id = ?", [job_id]
    if tenant is not None:
        sql, args = sql + " AND tenant = ?", [job_id, tenant]
    rows = list(db.query(sql, args))
    return job_from_row(rows[0]) if rows else None


def list_jobs(db: sqlite_utils.Database, tenant: str, limit: int = 100) -> list[BatchJob]:
    """The tenant's jobs, newest first."""
    rows = db.query("SELECT * FROM batch_jobs WHERE tenant = ? ORDER BY created_at DESC, rowid DESC LIMIT ?",
                    [tenant, limit])
    return [job_from_row(row) for row in rows]


def list_unfinished_jobs(db: sqlite_utils.Database) -> list[BatchJob]:
    """Jobs still to run (queued or running), oldest first."""
    rows = db.query(f"SELECT * FROM batch_jobs WHERE status IN ({sql_list(UNFINISHED)}) ORDER BY created_at, rowid")
    return [job_from_row(row) for row in rows]


def list_undelivered_callbacks(db: sqlite_utils.Database) -> list[BatchJob]:
    """Final jobs whose callback has not been delivered nor given up on."""
    rows = db.query(f"SELECT * FROM batch_jobs WHERE status IN ({sql_list(FINAL)}) AND callback_status = ? "
                    "ORDER BY finished_at, rowid", [CallbackStatus.PENDING.value])
    return [job_from_row(row) for row in rows]


def start_job(db: sqlite_utils.Database, job_id: str) -> None:
    """queued -> running (a running or final job stays as it is)."""
    db.execute("UPDATE batch_jobs SET status = ?, started_at = ? WHERE id = ? AND status = ?",
               [JobStatus.RUNNING.value, utc_now(), job_id, JobStatus.QUEUED.value])


def finish_job(db: sqlite_utils.Database, job_id: str, status: str, error: str | None = None) -> bool:
    """Writes a final status once; False when the job was already final (or is gone)."""
    if status not in FINAL:
        raise ValueError(f"a finished job needs a final status {FINAL}, not {status!r}")
    cursor = db.execute(
        "UPDATE batch_jobs SET status = ?, error = ?, finished_at = ? "
        f"WHERE id = ? AND status IN ({sql_list(UNFINISHED)})",
        [status, error, utc_now(), job_id])
    return cursor.rowcount > 0


@dataclass(frozen=True)
class Cancelled:
    job: BatchJob  # as it is now
    changed: bool  # False: it was already final, nothing changed
    num_items: int  # pending items cancelled


def cancel_job(db: sqlite_utils.Database, job_id: str, tenant: str) -> Cancelled | None:
    """Cancels an unfinished job of the tenant and its pending items; None when the tenant has no such job."""
    if get_job(db, job_id, tenant) is None:
        return None
    if not finish_job(db, job_id, JobStatus.CANCELLED.value):
        return Cancelled(get_job(db, job_id, tenant), False, 0)
    cursor = db.execute("UPDATE batch_items SET status = ?, completed_at = ? WHERE job_id = ? AND status = ?",
                        [ItemStatus.CANCELLED.value, utc_now(), job_id, ItemStatus.PENDING.value])
    return Cancelled(get_job(db, job_id, tenant), True, cursor.rowcount)


def set_callback(db: sqlite_utils.Database, job_id: str, status: str, attempts: int) -> None:
    db.execute("UPDATE batch_jobs SET callback_status = ?, callback_attempts = ? WHERE id = ?",
               [CallbackStatus(status).value, attempts, job_id])


# ---- items -----------------------------------------------------------------------------


def item_counts(db: sqlite_utils.Database, job_id: str) -> dict[str, int]:
    """Items by status, every status present (0 when none)."""
    counts = {s.value: 0 for s in ItemStatus}
    for row in db.query("SELECT status, count(*) AS n FROM batch_items WHERE job_id = ? GROUP BY status", [job_id]):
        counts[row["status"]] = row["n"]
    return counts


def list_items(db: sqlite_utils.Database, job_id: str, status: str | None = None) -> list[BatchItem]:
    """The job's items in input order, optionally only those with `status`."""
    if status is None:
        rows = db.query("SELECT * FROM batch_items WHERE job_id = ? ORDER BY idx", [job_id])
    else:
        rows = db.query("SELECT * FROM batch_items WHERE job_id = ? AND status = ? ORDER BY idx",
                        [job_id, ItemStatus(status).value])
    return [item_from_row(row) for row in rows]


def finish_item(db: sqlite_utils.Database, job_id: str, idx: int, result: ItemResult) -> bool:
    """Stores a pending item's result; False when the item was no longer pending (cancelled)."""
    if result.status not in (ItemStatus.COMPLETED, ItemStatus.FAILED):
        raise ValueError(f"an item result is completed or failed, not {result.status!r}")
    cursor = db.execute(
        "UPDATE batch_items SET status = ?, output = ?, finish_reason = ?, prompt_tokens = ?, completion_tokens = ?, "
        "error = ?, completed_at = ? WHERE job_id = ? AND idx = ? AND status = ?",
        [result.status, result.output, result.finish_reason, result.prompt_tokens, result.completion_tokens,
         result.error, utc_now(), job_id, idx, ItemStatus.PENDING.value])
    return cursor.rowcount > 0


# ---- the store -------------------------------------------------------------------------


class BatchStore:
    """Batch jobs and items in one database: the only way the rest of galley reaches these tables.

    Reads block (from asyncio, call them through `asyncio.to_thread`); writes run on the
    writer thread and return its `Future`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # jobs

    def create(self, tenant: str, model: str, inputs: list[Any], params: dict, callback_url: str | None = None,
               kind: str = "generate", callback_secret: str | None = None,
               quota: JobQuota = JobQuota()) -> Future[BatchJob]:
        """A queued job with one pending item per input; QuotaExceeded (nothing written) over a cap."""
        return self.db.write(lambda db: create_job(db, tenant, model, inputs, params, callback_url, kind,
                                                   callback_secret, quota))

    def job(self, job_id: str, tenant: str | None = None) -> BatchJob | None:
        return self.db.read(lambda db: get_job(db, job_id, tenant))

    def job_with_counts(self, job_id: str, tenant: str) -> tuple[BatchJob, dict[str, int]] | None:
        """The tenant's job and its items by status; None when it has no such job."""
        def query(db: sqlite_utils.Database) -> tuple[BatchJob, dict[str, int]] | None:
            job = get_job(db, job_id, tenant)
            return None if job is None else (job, item_counts(db, job_id))

        return self.db.read(query)

    def job_with_items(self, job_id: str, tenant: str) -> tuple[BatchJob, list[BatchItem]] | None:
        """The tenant's job and its items in input order; None when it has no such job."""
        def query(db: sqlite_utils.Database) -> tuple[BatchJob, list[BatchItem]] | None:
            job = get_job(db, job_id, tenant)
            return None if job is None else (job, list_items(db, job_id))

        return self.db.read(query)

    def jobs_with_counts(self, tenant: str) -> list[tuple[BatchJob, dict[str, int]]]:
        """The tenant's jobs, newest first, each with its items by status."""
        return self.db.read(lambda db: [(job, item_counts(db, job.id)) for job in list_jobs(db, tenant)])

    def unfinished(self) -> list[BatchJob]:
        return self.db.read(list_unfinished_jobs)

    def undelivered_callbacks(self) -> list[BatchJob]:
        return self.db.read(list_undelivered_callbacks)

    def start(self, job_id: str) -> Future[None]:
        return self.db.write(lambda db: start_job(db, job_id))

    def finish(self, job_id: str, status: str, error: str | None = None) -> Future[bool]:
        return self.db.write(lambda db: finish_job(db, job_id, status, error))

    def cancel(self, job_id: str, tenant: str) -> Future[Cancelled | None]:
        return self.db.write(lambda db: cancel_job(db, job_id, tenant))

    def set_callback(self, job_id: str, status: CallbackStatus, attempts: int) -> Future[None]:
        return self.db.write(lambda db: set_callback(db, job_id, status, attempts))

    def expire(self, retention_seconds: float) -> Future[int]:
        return self.db.write(lambda db: expire_jobs(db, retention_seconds))

    # items

    def items(self, job_id: str, status: str | None = None) -> list[BatchItem]:
        return self.db.read(lambda db: list_items(db, job_id, status))

    def item_counts(self, job_id: str) -> dict[str, int]:
        return self.db.read(lambda db: item_counts(db, job_id))

    def finish_items(self, job_id: str, results: list[tuple[int, ItemResult]]) -> Future[list[bool]]:
        """Stores (idx, result) pairs in one transaction; per item, False when it was no longer pending."""
        done = list(results)
        return self.db.write(lambda db: [finish_item(db, job_id, idx, result) for idx, result in done])
