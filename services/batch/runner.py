"""Runs batch jobs on the event loop: items at low priority, a few at a time, results stored as they complete.

Owns one task per job that is running or waiting for a job slot (`max_running_jobs`). A job
keeps at most `max_in_flight_per_job` items submitted to its model, each a `GenerationRequest`
of the job's tenant in the `low` priority class, so interactive requests overtake queued
batch items and a big job never floods the queue. Items pass the one admission path
(`services.inference.admission`) uncounted: a refusal (the model's queue bound, the tenant's
limits, a version being unloaded) is no 429 to anyone, but a wait counted in
`galley_batch_item_retries`, after which the item is retried, its model resolved again, never
failed. An admitted item without a first token by `first_token_timeout_seconds` fails.

Each result is written to SQLite as it arrives, so after a restart `recover()` reruns only the
unfinished items. When a job ends, its callback URL gets the job summary by a signed POST
(`services.batch.webhooks`: public addresses only unless allow-listed, no redirects), retried
with exponential backoff. Finished jobs expire after `retention_seconds`. While the server
drains, no new item starts (in-flight ones finish and are stored). Must not block the loop:
store reads (`storage.batches.BatchStore`) run in a thread, writes on the DB writer thread.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from prometheus_client import Counter

from engine.types import FinishReason, SamplingParams
from scheduling.encoders import ServedEncoder
from scheduling.router import RequestStream, Router, Served, ServedModel
from services.background import BackgroundTasks
from services.batch.webhooks import CallbackRefused, WebhookClient, new_secret
from services.deployments.manager import ModelManager
from services.errors import (
    InvalidRequestError,
    NotFoundError,
    QueueFullError,
    RateLimitError,
    ServiceError,
    ServiceUnavailableError,
    rate_limited,
)
from services.inference.admission import Admission
from services.inference.encoders import prediction
from services.inference.params import SAMPLING_FIELDS, SamplingOptions, model_defaults, with_defaults
from services.inference.prompts import encode_chat, encode_text
from services.observability.metrics import Metrics
from services.server_state import ServerState
from services.tenancy import Caller, limits_of
from storage import batches, registry
from storage.batches import (
    BatchItem,
    BatchJob,
    BatchStore,
    CallbackStatus,
    ItemResult,
    ItemStatus,
    JobStatus,
    QuotaExceeded,
)
from storage.tenants import Tenant

log = structlog.get_logger(__name__)
T = TypeVar("T")

DEFAULT_COMPLETION_TOKENS = 16  # as /v1/completions
DEFAULT_SECONDS_PER_TOKEN = 0.02  # for estimated_time until a model has finished items


@dataclass(frozen=True)
class BatchConfig:
    max_in_flight_per_job: int = 8  # items of one job submitted to the model at once
    max_running_jobs: int = 4  # jobs running at once; later ones wait, queued
    max_inputs: int = 10000  # inputs per job
    retry_seconds: float = 1.0  # wait before resubmitting an item the model's queue refused
    first_token_timeout_seconds: float = 600.0  # an item admitted but without a first token by then fails
    callback_max_attempts: int = 5
    callback_backoff_seconds: float = 1.0  # waits 1, 2, 4, ... seconds between callback attempts
    callback_timeout_seconds: float = 10.0
    callback_allow_hosts: tuple[str, ...] = ()  # non-public callback hosts allowed: names, addresses, CIDR ranges
    max_queued_jobs_per_tenant: int = 16  # unfinished (queued or running) jobs per tenant
    max_stored_bytes_per_tenant: int = 256 * 1024 * 1024  # inputs of a tenant's jobs kept, until they expire
    retention_seconds: float = 7 * 24 * 3600.0  # finished jobs, their inputs and results are deleted after this

    def __post_init__(self) -> None:
        object.__setattr__(self, "callback_allow_hosts", tuple(self.callback_allow_hosts))  # a TOML list
        for name in ("max_in_flight_per_job", "max_running_jobs", "max_inputs", "callback_max_attempts",
                     "max_queued_jobs_per_tenant", "max_stored_bytes_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("first_token_timeout_seconds", "retention_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def quota(self) -> batches.JobQuota:
        return batches.JobQuota(self.max_queued_jobs_per_tenant, self.max_stored_bytes_per_tenant,
                                self.retention_seconds)


class ItemError(Exception):
    """An input that cannot run (too long for the context, rejected by the chat template)."""


@dataclass
class JobRun:
    """A job this process is running. Invariant: `streams` holds exactly its items in flight."""

    job: BatchJob
    remaining: int = 0  # items not yet finished, for estimates
    cancelled: bool = False
    streams: set[RequestStream] = field(default_factory=set)


def sampling_params(params: dict[str, Any], max_tokens: int, model: ServedModel) -> SamplingParams:
    """The job's stored params (api.batch.BatchParams as JSON) for one item; a field left out (None)
    takes the model's default, as on /v1."""
    stop = params.get("stop")
    options = SamplingOptions(**{name: params.get(name) for name in SAMPLING_FIELDS}, seed=params.get("seed"),
                              stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                              stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                              ignore_eos=bool(params.get("ignore_eos")))
    return SamplingParams(max_tokens=max_tokens, **with_defaults(options, model_defaults(model)))


def encoder_result(model: ServedEncoder, output: Any) -> ItemResult:
    """An embedding (the vector) or a classification (prediction, confidence, scores) as a stored result."""
    value = output.values if model.kind == "embed" else prediction(model, output.values)
    return ItemResult(ItemStatus.COMPLETED.value, output=batches.dumps(value), prompt_tokens=output.num_tokens,
                      completion_tokens=0)


def item_view(job: BatchJob, item: BatchItem) -> dict[str, Any]:
    """One stored result as GET /api/v1/batch/{id}/results shows it (encoders: the decoded vector or prediction)."""
    usage = None
    if item.prompt_tokens is not None:
        usage = {"prompt_tokens": item.prompt_tokens, "completion_tokens": item.completion_tokens,
                 "total_tokens": item.prompt_tokens + item.completion_tokens}
    out = {"index": item.idx, "status": item.status, "output": item.output, "finish_reason": item.finish_reason,
           "usage": usage, "error": item.error}
    if job.kind != "generate" and item.output is not None:
        value = json.loads(item.output)
        out["output"] = None
        out.update({"embedding": value} if job.kind == "embed" else value)
    return out


def batch_not_found(job_id: str) -> NotFoundError:
    return NotFoundError(f"No batch job `{job_id}`.", param="batch_id", code="batch_not_found")


def check_params(tenant: Tenant, params: dict[str, Any], vocab_size: int) -> None:
    """A generative job's params against the caller's max_tokens cap and the model's vocabulary."""
    cap, max_tokens, stop_ids = tenant.max_tokens, params.get("max_tokens"), params.get("stop_token_ids")
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, over this API key's cap of {cap}",
                                  param="params.max_tokens")
    if stop_ids and any(not 0 <= t < vocab_size for t in stop_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", param="params.stop_token_ids")


@dataclass(frozen=True)
class Created:
    """A stored job as POST /api/v1/batch answers it."""

    job: BatchJob
    estimated_time: float

    def view(self) -> dict[str, Any]:
        job = self.job
        return {"batch_id": job.id, "object": "batch", "status": job.status, "model": job.model, "kind": job.kind,
                "num_inputs": job.num_items, "estimated_time": self.estimated_time,
                "callback_secret": job.callback_secret}


def job_summary(job: BatchJob, counts: dict[str, int]) -> dict[str, Any]:
    """The job as GET /api/v1/batch/{id} and the callback show it."""
    callback = None
    if job.callback_url is not None:
        callback = {"url": job.callback_url, "status": job.callback_status, "attempts": job.callback_attempts}
    return {
        "batch_id": job.id, "object": "batch", "model": job.model, "kind": job.kind, "status": job.status,
        "progress": {"total": job.num_items, **counts}, "error": job.error, "callback": callback,
        "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
    }


class BatchRunner:
    def __init__(self, router: Router, admission: Admission, models: ModelManager, store: BatchStore,
                 metrics: Metrics, tenants: Callable[[str], Tenant | None], state: ServerState,
                 webhooks: WebhookClient, config: BatchConfig = BatchConfig()) -> None:
        self.router = router
        self.admission = admission  # items are admitted as requests are, uncounted: a refusal is waited out
        self.models = models  # routes a job's model ref to a version, loading it if cold
        self.store = store
        self.metrics = metrics
        self.tenants = tenants
        self.state = state
        self.config = config
        self.runs: dict[str, JobRun] = {}
        self.item_seconds: dict[str, float] = {}  # per model, moving average of one item's duration
        self._slots: asyncio.Semaphore | None = None
        self._background = BackgroundTasks()
        self.webhooks = webhooks  # built for config's allow-list and timeout (api.webhooks.webhook_client)
        self.jobs_total = Counter("galley_batch_jobs", "Batch jobs by status reached (queued: submitted)",
                                  ["status"], registry=metrics.registry)
        self.items_total = Counter("galley_batch_items", "Batch items finished, by status", ["status"],
                                   registry=metrics.registry)
        self.retries_total = Counter("galley_batch_item_retries", "Batch item submits refused and retried later, "
                                     "by reason (queue_full, model_unavailable, or the tenant limit)", ["reason"],
                                     registry=metrics.registry)

    # ---- what the API asks -----------------------------------------------------------------

    async def create(self, caller: Caller, ref: str, inputs: list[Any], params: dict[str, Any],
                     params_given: bool, callback_url: str | None) -> Created:
        """Check, count and store a job of the caller's, in this order: its size and callback URL,
        then one of the tenant's requests (before a cold model loads or inputs are stored), then its
        model (routed by this request; a cold version loads now) and the inputs and params for that
        model's kind. `params` are every sampling field (the defaults where not given); `inputs`
        are prompts (str) or chat messages ([{"role", "content"}])."""
        if len(inputs) > self.config.max_inputs:
            raise InvalidRequestError(f"{len(inputs)} inputs; at most {self.config.max_inputs} per job",
                                      param="inputs")
        if callback_url is not None:
            try:
                self.webhooks.policy.check_url(callback_url)
            except CallbackRefused as exc:
                raise InvalidRequestError(f"callback_url {exc}", param="callback_url") from exc
        self.admission.count_request(limits_of(caller.tenant))
        model = await self.models.route(caller, ref, kinds=registry.KINDS)
        if isinstance(model, ServedEncoder):
            kind = model.kind
            if params_given:
                raise InvalidRequestError(f"params apply to generative models; `{model.name}` is a `{kind}` model",
                                          param="params")
            if not all(isinstance(value, str) for value in inputs):
                raise InvalidRequestError(f"inputs of a `{kind}` model are texts (strings)", param="inputs")
        else:
            kind = "generate"
            check_params(caller.tenant, params, model.vocab_size)
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
            self._background.spawn(self._deliver(job.id))
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
            self._background.spawn(self._deliver(job_id))
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
        per_item = self.item_seconds.get(model.name)
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
                result = await self._run_item(run, item)
            except Exception as exc:  # a bug must fail this item, not stall the job
                log.exception("batch item failed", batch_id=run.job.id, index=item.idx)
                result = ItemResult(ItemStatus.FAILED.value, error=f"internal error: {type(exc).__name__}")
            if result is None:
                continue  # aborted: the job was cancelled
            [stored] = await self._write(self.store.finish_items(run.job.id, [(item.idx, result)]))
            run.remaining -= 1
            if stored:
                self.items_total.labels(result.status).inc()

    async def prepare(self, job: BatchJob, model: ServedModel, value: Any) -> tuple[list[int], SamplingParams]:
        """An input's prompt ids and sampling params; ItemError when it cannot run. Tokenized as
        the generation routes do (`services.inference.prompts`: bounded first, long inputs off the event loop)."""
        try:
            prompt_ids = await (encode_text(model, value) if isinstance(value, str) else encode_chat(model, value))
        except InvalidRequestError as exc:
            raise ItemError(exc.message) from exc
        room = model.max_model_len - len(prompt_ids)
        max_tokens = job.params.get("max_tokens") or (
            DEFAULT_COMPLETION_TOKENS if isinstance(value, str) else min(room, model_defaults(model)["max_tokens"]))
        if room <= 0 or max_tokens > room:
            raise ItemError(f"This model's maximum context length is {model.max_model_len} tokens, but this input "
                            f"needs {len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt and "
                            f"{max_tokens} for the completion).")
        tenant = self.tenants(job.tenant)
        if tenant is not None and tenant.max_tokens is not None:
            max_tokens = min(max_tokens, tenant.max_tokens)
        return prompt_ids, sampling_params(job.params, max_tokens, model)

    async def _run_item(self, run: JobRun, item: BatchItem) -> ItemResult | None:
        """The item's result; None when it was aborted (cancel) or never started (cancel, drain)."""
        started = time.monotonic()
        submitted = await self._submit(run, item)
        if not isinstance(submitted, RequestStream):
            return submitted
        stream = submitted
        timeout_s = self.config.first_token_timeout_seconds
        text, last = "", None
        try:
            async for event in self.metrics.observe(stream, timeout_s):
                text, last = text + event.text, event
        except TimeoutError:
            return ItemResult(ItemStatus.FAILED.value, error=f"no first token within {timeout_s:g}s "
                              "(first_token_timeout_seconds): the model is overloaded")
        finally:
            run.streams.discard(stream)
            if not stream.finished:  # timed out, or our task was cancelled (server shutdown)
                self.router.abort(stream)
        if last.finish_reason == FinishReason.ABORT:
            return None
        if last.error or last.finish_reason == FinishReason.ERROR:
            return ItemResult(ItemStatus.FAILED.value, error=last.error or "generation failed")
        self._observe_item(stream.model.name, time.monotonic() - started)
        return ItemResult(ItemStatus.COMPLETED.value, output=text, finish_reason=last.finish_reason.value,
                          prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens)

    async def _submit(self, run: JobRun, item: BatchItem) -> RequestStream | ItemResult | None:
        """Submit the item at low priority, waiting out refusals. The model is resolved again after every
        wait (it may have been unloaded, reloaded or replaced meanwhile: a stale version would take the
        item nowhere). An ItemResult when the item cannot run; None if the job is cancelled or the server
        drains first."""
        prepared: tuple[ServedModel, list[int], SamplingParams] | None = None
        while not (run.cancelled or self.state.draining):
            tenant = self.tenants(run.job.tenant)
            if tenant is None:  # deleted with its jobs
                run.cancelled = True
                return None
            model = await self.find_model(run.job)
            if not isinstance(model, ServedModel):
                return ItemResult(ItemStatus.FAILED.value, error=f"the model {run.job.model!r} is not served")
            if prepared is None or prepared[0] is not model:  # another version may tokenize differently
                try:
                    prepared = (model, *await self.prepare(run.job, model, item.input))
                except ItemError as exc:
                    return ItemResult(ItemStatus.FAILED.value, error=str(exc))
            stream, delay_s = self._try_submit(run, item, tenant, *prepared)
            if stream is not None:
                return stream
            await asyncio.sleep(delay_s)
        return None

    def _try_submit(self, run: JobRun, item: BatchItem, tenant: Tenant, model: ServedModel, prompt_ids: list[int],
                    params: SamplingParams) -> tuple[RequestStream | None, float]:
        """The admitted stream, or None and how long to wait before trying again."""
        request_id = f"{run.job.id}-{item.idx}-{uuid.uuid4().hex[:8]}"
        try:
            stream = self.admission.generation(model, prompt_ids, params, limits_of(tenant), tenant.weight, "low",
                                               request_id, counted=False)  # a refusal here is no 429 to anyone
        except QueueFullError:
            reason, delay_s = "queue_full", 0.0
        except ServiceUnavailableError:  # the version is unloading
            reason, delay_s = "model_unavailable", 0.0
        except RateLimitError as exc:  # a tenant limit
            reason, delay_s = exc.code, exc.retry_after_s
        else:
            self.metrics.admitted.labels(model.name, tenant.name, "low").inc()
            run.streams.add(stream)
            return stream, 0.0
        self.retries_total.labels(reason).inc()
        return None, max(self.config.retry_seconds, delay_s)

    async def _encode_all(self, run: JobRun, model: ServedEncoder, items: list[BatchItem]) -> None:
        """Encoder jobs: items in chunks of max_in_flight_per_job, one batcher submit each, one at a time."""
        size = self.config.max_in_flight_per_job
        for start in range(0, len(items), size):
            chunk = items[start:start + size]
            started = time.monotonic()
            results = await self._encode(run, model, [item.input for item in chunk])
            if results is None:
                return  # cancelled or draining
            self._observe_item(model.name, time.monotonic() - started)
            stored = await self._write(self.store.finish_items(
                run.job.id, [(item.idx, result) for item, result in zip(chunk, results)]))
            run.remaining -= len(chunk)
            for result, was_stored in zip(results, stored):
                if was_stored:
                    self.items_total.labels(result.status).inc()

    async def _encode(self, run: JobRun, model: ServedEncoder, texts: list[str]) -> list[ItemResult] | None:
        """One result per text, waiting out refusals (tenant limits, the batcher's bound) as `_submit` does;
        a version unloaded meanwhile (keep_alive, memory budget, rollout) is routed again."""
        while not (run.cancelled or self.state.draining):
            tenant = self.tenants(run.job.tenant)
            if tenant is None:
                run.cancelled = True
                return None
            if model.draining:
                found = await self.find_model(run.job)
                if not isinstance(found, ServedEncoder):
                    error = f"the model {run.job.model!r} is not served"
                    return [ItemResult(ItemStatus.FAILED.value, error=error)] * len(texts)
                model = found
            try:  # the low class, as generations
                outputs = await self.admission.encode(model, texts, limits_of(tenant), low=True, counted=False)
            except QueueFullError:  # the batcher's bound
                await asyncio.sleep(self.config.retry_seconds)
                continue
            except RateLimitError as exc:  # a tenant limit
                await asyncio.sleep(max(self.config.retry_seconds, exc.retry_after_s))
                continue
            except ServiceError as exc:  # the model failed
                log.error("batch encoder items failed", batch_id=run.job.id, exc_info=exc.__cause__ or exc)
                return [ItemResult(ItemStatus.FAILED.value, error=f"the {model.kind} model failed (internal error)")
                        ] * len(texts)  # no exception text out
            return [encoder_result(model, out) for out in outputs]
        return None

    def _observe_item(self, model: str, seconds: float) -> None:
        old = self.item_seconds.get(model)
        self.item_seconds[model] = seconds if old is None else 0.8 * old + 0.2 * seconds

    async def _finish(self, job: BatchJob, status: JobStatus, error: str | None = None) -> None:
        if await self._write(self.store.finish(job.id, status.value, error)):
            self.jobs_total.labels(status.value).inc()
            log.info("batch job finished", batch_id=job.id, status=status.value, error=error)
            self._background.spawn(self._deliver(job.id))

    # ---- callbacks -------------------------------------------------------------------------

    async def summary(self, job_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        found = await self._read(self.store.job_with_counts, job_id, tenant)
        return None if found is None else job_summary(*found)

    async def _deliver(self, job_id: str) -> None:
        """POST the summary of a finished job to its callback URL until it answers 2xx or attempts run out."""
        job = await self._read(self.store.job, job_id)
        if job is None or job.callback_url is None or job.callback_status != CallbackStatus.PENDING:
            return
        body = json.dumps(await self.summary(job_id), separators=(",", ":")).encode()
        attempts = job.callback_attempts
        while attempts < self.config.callback_max_attempts:
            if attempts:
                await asyncio.sleep(self.config.callback_backoff_seconds * 2 ** (attempts - 1))
            attempts += 1
            if await self._post(job, body, attempts):
                await self._write(self.store.set_callback(job_id, CallbackStatus.DELIVERED, attempts))
                return
            await self._write(self.store.set_callback(job_id, CallbackStatus.PENDING, attempts))
        await self._write(self.store.set_callback(job_id, CallbackStatus.FAILED, attempts))
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

    # ---- plumbing --------------------------------------------------------------------------

    @staticmethod
    async def _write(future: Future[T]) -> T:
        """A store write's result, awaited on the loop (the write runs on the DB writer thread)."""
        return await asyncio.wrap_future(future)

    @staticmethod
    async def _read(read: Callable[..., T], *args: Any) -> T:
        """A store read, run in a thread (SQLite reads block)."""
        return await asyncio.to_thread(read, *args)

