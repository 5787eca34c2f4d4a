"""What a batch job is to the rest of galley: its configuration (`[batch]`), a job this process is
running, and how jobs and their items are shown (POST, GET and the callback's body)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from scheduling.encoders import ServedEncoder
from scheduling.router import RequestStream, Served
from services.errors import InvalidRequestError, NotFoundError
from services.inference.encoders import features_request, prediction
from storage import batches
from storage.batches import BatchItem, BatchJob, ItemResult, ItemStatus
from storage.tenants import Tenant


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


@dataclass
class JobRun:
    """A job this process is running. Invariant: `streams` holds exactly its items in flight."""

    job: BatchJob
    remaining: int = 0  # items not yet finished, for estimates
    cancelled: bool = False
    streams: set[RequestStream] = field(default_factory=set)


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


TENSORS = "{\"inputs\": [{\"name\", \"datatype\", \"shape\", \"data\"}, ...]} (a /v2 infer request's inputs)"
# a kind's inputs: the key each object input has (None: texts), and how a 400 says so
INPUT_SHAPES = {"embed": (None, "texts (strings)"), "classify": (None, "texts (strings)"),
                "image-classify": ("image", "{\"image\": base64}"), "tabular": ("features", "{\"features\": [...]}"),
                "onnx": ("inputs", TENSORS), "torch": ("inputs", TENSORS)}


def check_inputs(model: Served, kind: str, inputs: list[Any]) -> None:
    """400 unless every input is of the shape the model's kind takes (a tabular row also of its width). What
    only running can tell (a prompt too long, an image that does not decode, tensors of the wrong name,
    shape or datatype) fails its own item instead."""
    if kind == "generate":
        if not all(isinstance(value, str | list) for value in inputs):
            raise InvalidRequestError("inputs of a `generate` model are prompts (strings) or chats (lists of "
                                      "messages)", param="inputs")
        return
    key, said = INPUT_SHAPES[kind]
    if not all(isinstance(value, str) if key is None else isinstance(value, dict) and key in value
               for value in inputs):
        raise InvalidRequestError(f"inputs of a `{kind}` model are {said}", param="inputs")
    if kind == "tabular":
        features_request(model, [value["features"] for value in inputs])  # each of the model's width


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


