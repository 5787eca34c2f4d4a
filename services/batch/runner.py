"""Runs batch jobs on the event loop: items at low priority, a few at a time, results stored as they complete.

Owns one task per job that is running or waiting for a job slot (`max_running_jobs`). A job
keeps at most `max_in_flight_per_job` items submitted to its model, each a `GenerationRequest`
of the job's tenant in the `low` priority class, so interactive requests overtake queued
batch items and a big job never floods the queue. Items pass the one admission path
(`services.admission`) uncounted: a refusal (the model's queue bound, the tenant's
limits, a version being unloaded) is no 429 to anyone, but a wait counted in
`galley_batch_item_retries`, after which the item is retried, its model resolved again, never
failed. An admitted item without a first token by `first_token_timeout_seconds` fails.

Each result is written to SQLite as it arrives, so after a restart `recover()` reruns only the
unfinished items. When a job ends, its callback URL gets the job summary by a signed POST
(`services.batch.webhooks`: public addresses only unless allow-listed, no redirects), retried
with exponential backoff. Finished jobs expire after `retention_seconds`. While the server
drains, no new item starts (in-flight ones finish and are stored). Must not block the loop:
store reads (`storage.batches.BatchStore`) run in a thread, writes on the DB writer thread.

One job's items are planned and run by `services.batch.items` (by /v1's rules), its callback sent by
`services.batch.callbacks`; how jobs are shown is `services.batch.jobs`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import structlog
from prometheus_client import Counter

from scheduling.encoders import ServedEncoder
from scheduling.router import Router, Served, ServedModel
from services.admission import Admission
from services.background import BackgroundTasks
from services.batch.callbacks import Callbacks
from services.batch.items import DEFAULT_COMPLETION_TOKENS, ItemRunner
from services.batch.jobs import (
    BatchConfig,
    Created,
    JobRun,
    batch_not_found,
    check_inputs,
    check_params,
    item_view,
    job_summary,
)
from services.batch.webhooks import CallbackRefused, WebhookClient, new_secret
from services.deployments.manager import ModelManager
from services.errors import InvalidRequestError, rate_limited
from services.observability.metrics import Metrics
from services.server_state import ServerState
from services.tenancy import Caller, limits_of
from storage.batches import BatchItem, BatchJob, BatchStore, ItemResult, ItemStatus, JobStatus, QuotaExceeded
from storage.tenants import Tenant

log = structlog.get_logger(__name__)

BATCH_KINDS = ("generate", "embed", "classify", "image-classify", "tabular", "onnx", "torch")
T = TypeVar("T")

DEFAULT_SECONDS_PER_TOKEN = 0.02  # for estimated_time until a model has finished items


class BatchRunner:
    def __init__(self, router: Router, admission: Admission, models: ModelManager, store: BatchStore,
                 metrics: Metrics, tenants: Callable[[str], Tenant | None], state: ServerState,
                 webhooks: WebhookClient, config: BatchConfig | None = None) -> None:
        self.router = router
        self.admission = admission
        self.models = models  # routes a job's model ref to a version, loading it if cold
        self.store = store
        self.metrics = metrics
        self.tenants = tenants
        self.state = state
        self.config = config = config or BatchConfig()
        self.runs: dict[str, JobRun] = {}
        self.items = ItemRunner(router, admission, metrics, tenants, state, config, self.find_model)
        self._slots: asyncio.Semaphore | None = None
        self._background = BackgroundTasks()
        self.webhooks = webhooks  # built for config's allow-list and timeout (api.webhooks.webhook_client)
        self.callbacks = Callbacks(store, webhooks, config, self.summary)
        self.jobs_total = Counter("galley_batch_jobs", "Batch jobs by status reached (queued: submitted)",
                                  ["status"], registry=metrics.registry)
        self.items_total = Counter("galley_batch_items", "Batch items finished, by status", ["status"],
                                   registry=metrics.registry)

    # ---- what the API asks -----------------------------------------------------------------

    async def create(self, caller: Caller, ref: str, inputs: list[Any], params: dict[str, Any],
                     params_given: bool, callback_url: str | None) -> Created:
        """Check, count and store a job of the caller's, in this order: its size and callback URL,
        then one of the tenant's requests (before a cold model loads or inputs are stored), then its
        model (routed by this request; a cold version loads now) and the inputs and params for that
        model's kind. `params` are every sampling field (the defaults where not given); `inputs`
        are prompts (str) or chat messages ([{"role", "content"}]), or an encoder's (`check_inputs`)."""
        if len(inputs) > self.config.max_inputs:
            raise InvalidRequestError(f"{len(inputs)} inputs; at most {self.config.max_inputs} per job",
                                      param="inputs")
        if callback_url is not None:
            try:
                self.webhooks.policy.check_url(callback_url)
            except CallbackRefused as exc:
                raise InvalidRequestError(f"callback_url {exc}", param="callback_url") from exc
        self.admission.count_request(limits_of(caller.tenant))
        model = await self.models.route(caller, ref, kinds=BATCH_KINDS)
        if isinstance(model, ServedEncoder):
            kind = model.kind
            if params_given:
                raise InvalidRequestError(f"params apply to generative models; `{model.name}` is a `{kind}` model",
                                          param="params")
        else:
            kind = "generate"
            check_params(caller.tenant, params, model.vocab_size)
        check_inputs(model, kind, inputs)
        estimate = self.estimate_seconds(model, len(inputs), params.get("max_tokens"))
        try:
            job = await self.submit(caller.tenant.name, ref, inputs, params, callback_url, kind)
        except QuotaExceeded as exc:
            raise rate_limited(exc) from exc
        return Created(job, estimate)

    async def jobs(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's jobs, newest first, as GET /api/v1/batch lists them."""
        return [job_summary(job, counts) for job, counts in await self._read(self.store.jobs_with_counts, tenant)]

    async def job(self, job_id: str, tenant: str) -> dict[str, Any]:
        """The tenant's job; NotFoundError for another tenant's exactly as for a missing one."""
        summary = await self.summary(job_id, tenant)
        if summary is None:
            raise batch_not_found(job_id)
        return summary

    async def results(self, job_id: str, tenant: str) -> dict[str, Any]:
        """The tenant's job's results, one per input in input order."""
        found = await self._read(self.store.job_with_items, job_id, tenant)
        if found is None:
            raise batch_not_found(job_id)
        job, items = found
        return {"batch_id": job.id, "object": "batch.results", "status": job.status,
                "results": [item_view(job, item) for item in items]}

    async def cancel_job(self, job_id: str, tenant: str) -> dict[str, Any]:
        """Cancel the tenant's job (idempotent) and show it."""
        if await self.cancel(job_id, tenant) is None:
            raise batch_not_found(job_id)
        return await self.job(job_id, tenant)

    # ---- lifecycle -----------------------------------------------------------------------

    async def submit(self, tenant: str, model: str, inputs: list[Any], params: dict,
                     callback_url: str | None, kind: str = "generate") -> BatchJob:
        """Store and start a job (its `callback_secret` is new); `batches.QuotaExceeded` over a tenant's caps."""
        secret = new_secret() if callback_url else None
        job = await self._write(self.store.create(tenant, model, inputs, params, callback_url, kind, secret,
                                                  self.config.quota))
        self.jobs_total.labels(JobStatus.QUEUED.value).inc()
        self._start(job)
        log.info("batch job queued", batch_id=job.id, model=model, tenant=tenant, num_items=job.num_items)
        return job

    async def recover(self) -> int:
        """Continue the jobs a stop left unfinished, and their undelivered callbacks; returns how many jobs."""
        unfinished = await self._read(self.store.unfinished)
        for job in unfinished:
            self._start(job)
        for job in await self._read(self.store.undelivered_callbacks):
            self._background.spawn(self.callbacks.deliver(job.id))
        if unfinished:
            log.info("resumed batch jobs after restart", count=len(unfinished))
        return len(unfinished)

    async def cancel(self, job_id: str, tenant: str) -> BatchJob | None:
        """Cancel the tenant's job: pending items are cancelled, items in flight aborted. None if not theirs."""
        outcome = await self._write(self.store.cancel(job_id, tenant))
        if outcome is None:
            return None
        if outcome.changed:
            self.jobs_total.labels(JobStatus.CANCELLED.value).inc()
            self.items_total.labels(ItemStatus.CANCELLED.value).inc(outcome.num_items)
            run = self.runs.get(job_id)
            if run is not None:
                run.cancelled = True
                for stream in list(run.streams):
                    self.router.abort(stream)
            log.info("batch job cancelled", batch_id=job_id, items_cancelled=outcome.num_items)
            self._background.spawn(self.callbacks.deliver(job_id))
        return outcome.job

    async def close(self) -> None:
        await self._background.cancel_all()
        await self.webhooks.close()

    def start_expiry(self) -> None:
        """Delete finished jobs (inputs and results too) once they are `retention_seconds` old, in the background."""
        self._background.spawn(self._expire_forever())

    async def expire(self) -> int:
        retention_s = self.config.retention_seconds
        expired = await self._write(self.store.expire(retention_s))
        if expired:
            log.info("batch jobs expired", count=expired, retention_s=retention_s)
        return expired

    async def _expire_forever(self) -> None:
        interval_s = min(max(self.config.retention_seconds / 10, 0.05), 600.0)
        while True:
            try:
                await self.expire()
            except Exception:
                log.exception("batch job expiry failed")
            await asyncio.sleep(interval_s)

    def estimate_seconds(self, model: ServedModel | ServedEncoder, num_items: int, max_tokens: int | None) -> float:
        """Rough: this job's items plus those ahead of it on the model, in waves of max_in_flight_per_job."""
        per_item = self.items.item_seconds.get(model.name)
        if per_item is None:
            per_item = (max_tokens or DEFAULT_COMPLETION_TOKENS) * DEFAULT_SECONDS_PER_TOKEN
        ahead = sum(run.remaining for run in self.runs.values() if run.job.model == model.name)
        waves = math.ceil((ahead + num_items) / self.config.max_in_flight_per_job)
        return round(waves * per_item, 1)

    # ---- running a job ---------------------------------------------------------------------

    def _start(self, job: BatchJob) -> None:
        run = JobRun(job, remaining=job.num_items)
        self.runs[job.id] = run
        self._background.spawn(self._run(run))

    async def _run(self, run: JobRun) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_running_jobs)
        try:
            async with self._slots:
                if not run.cancelled:
                    await self._execute(run)
        finally:
            self.runs.pop(run.job.id, None)

    async def _execute(self, run: JobRun) -> None:
        job = run.job
        model = await self.find_model(job)
        if model is None:
            await self._finish(job, JobStatus.FAILED, f"the model {job.model!r} is not served")
            return
        items = await self._read(self.store.items, job.id, ItemStatus.PENDING)
        run.remaining = len(items)
        await self._write(self.store.start(job.id))
        if isinstance(model, ServedEncoder):
            await self._encode_all(run, model, items)
        else:
            todo = iter(items)
            num_workers = min(self.config.max_in_flight_per_job, len(items))
            await asyncio.gather(*(self._work(run, todo) for _ in range(num_workers)))
        if run.cancelled or self.state.draining:
            return  # a cancel has written the final state; a drain leaves the job to resume after restart
        counts = await self._read(self.store.item_counts, job.id)
        if counts[ItemStatus.COMPLETED] == 0:
            await self._finish(job, JobStatus.FAILED, "every item failed")
        else:
            await self._finish(job, JobStatus.COMPLETED)

    async def find_model(self, job: BatchJob) -> Served | None:
        """The job's model version for `name` or `name@version`, of any kind (routed by the job id,
        so a job's items stay on one version while the split is unchanged)."""
        try:
            return await self.models.resolve(job.model, job.id)
        except Exception as exc:
            log.warning("batch job's model unavailable", batch_id=job.id, model=job.model, error=str(exc))
            return None

    async def _work(self, run: JobRun, todo: Iterator[BatchItem]) -> None:
        """One slot of the job's in-flight window: run items one after another."""
        for item in todo:
            if run.cancelled or self.state.draining:
                return
            try:
                result = await self.items.run_item(run, item)
            except Exception as exc:  # a bug must fail this item, not stall the job
                log.exception("batch item failed", batch_id=run.job.id, index=item.idx)
                result = ItemResult(ItemStatus.FAILED.value, error=f"internal error: {type(exc).__name__}")
            if result is None:
                continue  # aborted: the job was cancelled
            [stored] = await self._write(self.store.finish_items(run.job.id, [(item.idx, result)]))
            run.remaining -= 1
            if stored:
                self.items_total.labels(result.status).inc()

    async def _encode_all(self, run: JobRun, model: ServedEncoder, items: list[BatchItem]) -> None:
        """Encoder jobs: items in chunks of max_in_flight_per_job, one batcher submit each, one at a time."""
        size = self.config.max_in_flight_per_job
        for start in range(0, len(items), size):
            chunk = items[start:start + size]
            started = time.monotonic()
            results = await self.items.encode(run, model, [item.input for item in chunk])
            if results is None:
                return  # cancelled or draining
            self.items.observe_item(model.name, time.monotonic() - started)
            stored = await self._write(self.store.finish_items(
                run.job.id, [(item.idx, result) for item, result in zip(chunk, results)]))
            run.remaining -= len(chunk)
            for result, was_stored in zip(results, stored):
                if was_stored:
                    self.items_total.labels(result.status).inc()

    async def _finish(self, job: BatchJob, status: JobStatus, error: str | None = None) -> None:
        if await self._write(self.store.finish(job.id, status.value, error)):
            self.jobs_total.labels(status.value).inc()
            log.info("batch job finished", batch_id=job.id, status=status.value, error=error)
            self._background.spawn(self.callbacks.deliver(job.id))

    # ---- callbacks -------------------------------------------------------------------------

    async def summary(self, job_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        found = await self._read(self.store.job_with_counts, job_id, tenant)
        return None if found is None else job_summary(*found)

    # ---- plumbing --------------------------------------------------------------------------

    @staticmethod
    async def _write(future: Future[T]) -> T:
        """A store write's result, awaited on the loop (the write runs on the DB writer thread)."""
        return await asyncio.wrap_future(future)

    @staticmethod
    async def _read(read: Callable[..., T], *args: Any) -> T:
        """A store read, run in a thread (SQLite reads block)."""
        return await asyncio.to_thread(read, *args)

