"""A finished job's callback: its summary POSTed, signed, to the job's URL (`services.batch.webhooks`:
public addresses only unless allow-listed, no redirects), retried with exponential backoff, each
attempt's outcome stored."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from services.batch.jobs import BatchConfig
from services.batch.webhooks import CallbackRefused, WebhookClient
from storage.batches import BatchJob, BatchStore, CallbackStatus

log = structlog.get_logger(__name__)


class Callbacks:
    def __init__(self, store: BatchStore, webhooks: WebhookClient, config: BatchConfig,
                 summary: Callable[[str], Awaitable[dict[str, Any] | None]]) -> None:
        self.store = store
        self.webhooks = webhooks
        self.config = config
        self.summary = summary

    async def deliver(self, job_id: str) -> None:
        """POST the summary of a finished job to its callback URL until it answers 2xx or attempts run out."""
        job = await asyncio.to_thread(self.store.job, job_id)
        if job is None or job.callback_url is None or job.callback_status != CallbackStatus.PENDING:
            return
        body = json.dumps(await self.summary(job_id), separators=(",", ":")).encode()
        attempts = job.callback_attempts
        while attempts < self.config.callback_max_attempts:
            if attempts:
                await asyncio.sleep(self.config.callback_backoff_seconds * 2 ** (attempts - 1))
            attempts += 1
            if await self._post(job, body, attempts):
                await asyncio.wrap_future(self.store.set_callback(job_id, CallbackStatus.DELIVERED, attempts))
                return
            await asyncio.wrap_future(self.store.set_callback(job_id, CallbackStatus.PENDING, attempts))
        await asyncio.wrap_future(self.store.set_callback(job_id, CallbackStatus.FAILED, attempts))
        log.warning("batch callback failed", batch_id=job_id, attempts=attempts)

    async def _post(self, job: BatchJob, body: bytes, attempt: int) -> bool:
        """One signed attempt; only a 2xx answer is a delivery (a redirect is not followed)."""
        try:
            status = await self.webhooks.post(job.callback_url, body, job.callback_secret,
                                              {"X-Galley-Batch-Id": job.id})
        except CallbackRefused as exc:
            log.warning("batch callback refused by the address policy", batch_id=job.id, error=str(exc))
            return False
        except (OSError, TimeoutError) as exc:  # CallbackUnreachable is an OSError
            log.warning("batch callback failed to connect", batch_id=job.id, attempt=attempt, error=str(exc))
            return False
        if 200 <= status < 300:
            log.info("batch callback delivered", batch_id=job.id, attempt=attempt)
            return True
        log.warning("batch callback refused", batch_id=job.id, attempt=attempt, status=status)
        return False
