"""The batch API under /api/v1/batch: submit a job of many inputs, follow it, read its results, cancel it.

Every handler is scoped to the caller's tenant: another tenant's job answers 404 exactly as
a missing one does. Creating a job counts as one of the tenant's requests, and the tenant's
unfinished jobs and stored input bytes are capped (429 with Retry-After). The work itself
happens in `services.batch.runner.BatchRunner`; these handlers validate, store and read.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from aiohttp import web
from pydantic import BaseModel, Field, field_validator

from api.auth import tenant_of
from api.errors import json_response
from api.openai.schemas import (
    MAX_CONTEXT_TOKENS,
    MAX_NAME_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    ChatMessage,
    Stop,
    StopTokenIds,
    Strict,
    Usage,
)
from api.quotas import count_creation
from api.routes import Route
from api.validation import parse_body
from scheduling.encoders import ServedEncoder
from services.batch.runner import BatchRunner, job_summary
from services.batch.webhooks import CallbackRefused
from services.deployments.manager import resolve_model
from services.errors import InvalidRequestError, NotFoundError, rate_limited
from storage import batches, registry
from storage.batches import BatchItem, BatchJob, QuotaExceeded

BATCH = web.AppKey("batch_runner", BatchRunner)
MAX_INPUTS = 100_000  # the schema's bound; [batch] max_inputs is the configured one


# ---- schemas ---------------------------------------------------------------------------


class BatchParams(Strict):
    """Sampling parameters applied to every input, as in /v1/completions."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS, description="Default: 16 for prompts, the "
                                   "rest of the context for chat messages.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Below 1e-5: greedy (as 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="-1 or 0 disables; above the vocabulary: the "
                              "whole vocabulary.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Stop = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = Field(None, description=f"At most {MAX_STOP_TOKEN_IDS}, each below the "
                                                "model's vocabulary size.")


BatchInput = Annotated[str, Field(min_length=1)] | Annotated[list[ChatMessage], Field(min_length=1)]


class BatchCreate(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    inputs: list[BatchInput] = Field(min_length=1, max_length=MAX_INPUTS,
                                     description="Prompts (strings) or chat conversations (lists of messages); "
                                     "texts (strings) for embed and classify models.")
    params: BatchParams | None = Field(None, description="Generative models only.")
    callback_url: str | None = Field(None, max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^/?#]",
                                     description="http(s) URL that gets the job summary by POST when it ends, "
                                     "signed with `callback_secret` (header X-Galley-Signature: t=<unix>,v1=<hex "
                                     "HMAC-SHA256 of \"<t>.<body>\">). Only public addresses are called (unless "
                                     "the server's allow-list says otherwise); redirects are not followed.")

    @field_validator("callback_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            parsed = urlparse(value)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError("must be an http:// or https:// URL with a host")
        return value


JobStatus = Literal["queued", "running", "completed", "failed", "cancelled"]


class BatchCreated(BaseModel):
    batch_id: str
    object: Literal["batch"] = "batch"
    status: JobStatus
    model: str
    kind: Literal["generate", "embed", "classify"]
    num_inputs: int
    estimated_time: float = Field(description="Rough seconds until the job completes.")
    callback_secret: str | None = Field(description="The key that signs this job's callback; shown only here "
                                        "(null without a callback_url).")


class BatchProgress(BaseModel):
    total: int
    pending: int
    completed: int
    failed: int
    cancelled: int


class BatchCallback(BaseModel):
    url: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int


class BatchOut(BaseModel):
    batch_id: str
    object: Literal["batch"] = "batch"
    model: str
    kind: Literal["generate", "embed", "classify"]
    status: JobStatus
    progress: BatchProgress
    error: str | None
    callback: BatchCallback | None
    created_at: str
    started_at: str | None
    finished_at: str | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchOut] = Field(description="Newest first, at most 100.")


class BatchItemOut(BaseModel):
    index: int
    status: Literal["pending", "completed", "failed", "cancelled"]
    output: str | None = Field(description="Generative models: the generated text.")
    finish_reason: str | None
    usage: Usage | None
    error: str | None
    embedding: list[float] | None = Field(None, description="Embed models: the input's embedding.")
    prediction: str | None = Field(None, description="Classify models: the top label ...")
    confidence: float | None = Field(None, description="... its score ...")
    scores: dict[str, float] | None = Field(None, description="... and every label's score.")


class BatchResults(BaseModel):
    batch_id: str
    object: Literal["batch.results"] = "batch.results"
    status: JobStatus
    results: list[BatchItemOut] = Field(description="One per input, in input order.")


def item_json(job: BatchJob, item: BatchItem) -> dict[str, Any]:
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


# ---- handlers --------------------------------------------------------------------------


def check_params(request: web.Request, params: BatchParams, vocab_size: int) -> None:
    cap = tenant_of(request).max_tokens
    if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {params.max_tokens}, over this API key's cap of {cap}",
                                  param="params.max_tokens")
    if params.stop_token_ids and any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", param="params.stop_token_ids")


async def create_batch(request: web.Request) -> web.Response:
    body = await parse_body(request, BatchCreate)
    runner = request.app[BATCH]
    if len(body.inputs) > runner.config.max_inputs:
        raise InvalidRequestError(f"{len(body.inputs)} inputs; at most {runner.config.max_inputs} per job",
                                  param="inputs")
    if body.callback_url is not None:
        try:
            runner.webhooks.policy.check_url(body.callback_url)
        except CallbackRefused as exc:
            raise InvalidRequestError(f"callback_url {exc}", param="callback_url") from exc
    count_creation(request)
    model = await resolve_model(request, body.model, kinds=registry.KINDS)  # a cold model loads now
    params = body.params or BatchParams()
    if isinstance(model, ServedEncoder):
        kind = model.kind
        if body.params is not None:
            raise InvalidRequestError(f"params apply to generative models; `{model.name}` is a `{kind}` model",
                                      param="params")
        if not all(isinstance(value, str) for value in body.inputs):
            raise InvalidRequestError(f"inputs of a `{kind}` model are texts (strings)", param="inputs")
        inputs = list(body.inputs)
    else:
        kind = "generate"
        check_params(request, params, model.vocab_size)
        inputs = [value if isinstance(value, str) else [{"role": "system" if m.role == "developer" else m.role,
                                                         "content": m.text()} for m in value]
                  for value in body.inputs]
    estimate = runner.estimate_seconds(model, len(inputs), params.max_tokens)
    try:
        job = await runner.submit(tenant_of(request).name, body.model, inputs, params.model_dump(),
                                  body.callback_url, kind)
    except QuotaExceeded as exc:
        raise rate_limited(exc) from exc
    return json_response({"batch_id": job.id, "object": "batch", "status": job.status, "model": job.model,
                          "kind": job.kind, "num_inputs": job.num_items, "estimated_time": estimate,
                          "callback_secret": job.callback_secret})


async def get_batch(request: web.Request) -> web.Response:
    job_id = request.match_info["batch_id"]
    summary = await request.app[BATCH].summary(job_id, tenant_of(request).name)
    if summary is None:
        raise batch_not_found(job_id)
    return json_response(summary)


async def list_batches(request: web.Request) -> web.Response:
    tenant = tenant_of(request).name

    def query(db):
        return [job_summary(job, batches.item_counts(db, job.id)) for job in batches.list_jobs(db, tenant)]

    return json_response({"object": "list", "data": await asyncio.to_thread(request.app[BATCH].db.read, query)})


async def batch_results(request: web.Request) -> web.Response:
    job_id = request.match_info["batch_id"]
    tenant = tenant_of(request).name

    def query(db):
        job = batches.get_job(db, job_id, tenant)
        return None if job is None else (job, batches.list_items(db, job_id))

    found = await asyncio.to_thread(request.app[BATCH].db.read, query)
    if found is None:
        raise batch_not_found(job_id)
    job, items = found
    return json_response({"batch_id": job.id, "object": "batch.results", "status": job.status,
                          "results": [item_json(job, item) for item in items]})


async def cancel_batch(request: web.Request) -> web.Response:
    job_id = request.match_info["batch_id"]
    runner = request.app[BATCH]
    tenant = tenant_of(request).name
    if await runner.cancel(job_id, tenant) is None:
        raise batch_not_found(job_id)
    return json_response(await runner.summary(job_id, tenant))


def setup(app: web.Application, runner: BatchRunner) -> None:
    """Register the runner; finished jobs expire while the app runs; its tasks stop (and its
    callback client closes) at cleanup."""
    app[BATCH] = runner

    async def lifecycle(app: web.Application):
        app[BATCH].start_expiry()
        yield
        await app[BATCH].close()

    app.cleanup_ctx.append(lifecycle)


BATCHES_PATH = "/api/v1/batch"
BATCH_PATH = BATCHES_PATH + "/{batch_id}"

ROUTES = [
    Route("POST", BATCHES_PATH, create_batch, "Submit a batch job: every input runs at low priority",
          request=BatchCreate, response=BatchCreated),
    Route("GET", BATCHES_PATH, list_batches, "List your batch jobs, newest first", response=BatchList),
    Route("GET", BATCH_PATH, get_batch, "A batch job's status and progress", response=BatchOut),
    Route("GET", BATCH_PATH + "/results", batch_results, "A batch job's results, one per input, in order",
          response=BatchResults),
    Route("DELETE", BATCH_PATH, cancel_batch, "Cancel a batch job (pending items are cancelled, running ones "
          "aborted)", response=BatchOut),
]
