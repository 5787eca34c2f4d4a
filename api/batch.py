"""The batch API under /api/v1/batch: submit a job of many inputs, follow it, read its results, cancel it.

Every handler is scoped to the caller's tenant: another tenant's job answers 404 exactly as
a missing one does. Creating a job counts as one of the tenant's requests, and the tenant's
unfinished jobs and stored input bytes are capped (429 with Retry-After). The work itself
happens in `services.batch.runner.BatchRunner`; these handlers parse, make one call and render.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlparse

from aiohttp import web
from pydantic import BaseModel, Field, field_validator

from api.auth import caller_of, tenant_of
from api.errors import json_response
from api.native.schemas import FeaturesIn, ImageIn
from api.oip import InferTensor
from api.openai.fields import (
    MAX_CONTEXT_TOKENS,
    MAX_NAME_CHARS,
    MAX_STOP_TOKEN_IDS,
    MinP,
    Penalty,
    RepetitionPenalty,
    Stop,
    StopTokenIds,
    Strict,
    Temperature,
    TopK,
    TopP,
    sampling_field,
)
from api.openai.messages import ChatMessage
from api.openai.objects import Usage
from api.routes import Route
from api.services import services
from api.validation import parse_body

MAX_INPUTS = 100_000  # the schema's bound; [batch] max_inputs is the configured one


# ---- schemas ---------------------------------------------------------------------------


class BatchParams(Strict):
    """Sampling parameters applied to every input, as in /v1/completions."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS, description="Default: 16 for prompts, the "
                                   "rest of the context for chat messages.")
    temperature: Temperature | None = sampling_field("temperature")
    top_p: TopP | None = sampling_field("top_p")
    top_k: TopK | None = sampling_field("top_k")
    min_p: MinP | None = sampling_field("min_p")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Stop = None
    frequency_penalty: Penalty | None = sampling_field("frequency_penalty")
    presence_penalty: Penalty | None = sampling_field("presence_penalty")
    repetition_penalty: RepetitionPenalty | None = sampling_field("repetition_penalty")
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = Field(None, description=f"At most {MAX_STOP_TOKEN_IDS}, each below the "
                                                "model's vocabulary size.")


class TensorsIn(Strict):
    """One /v2/models/{name}/infer request's inputs, for an onnx or torch model (JSON `data`: no binary part)."""

    inputs: list[InferTensor] = Field(min_length=1)


BatchInput = (Annotated[str, Field(min_length=1)] | Annotated[list[ChatMessage], Field(min_length=1)] | ImageIn
              | FeaturesIn | TensorsIn)
Kind = Literal["generate", "embed", "classify", "image-classify", "tabular", "onnx", "torch"]


class BatchCreate(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    inputs: list[BatchInput] = Field(min_length=1, max_length=MAX_INPUTS,
                                     description="Prompts (strings) or chat conversations (lists of messages); "
                                     "texts (strings) for embed and classify models; `{\"image\"}` (base64) for "
                                     "an image classifier, `{\"features\": [...]}` for a tabular model, "
                                     "`{\"inputs\": [{\"name\", \"datatype\", \"shape\", \"data\"}]}` (as "
                                     "/v2/models/{name}/infer) for an onnx or torch model.")
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
    kind: Kind
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
    kind: Kind
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
    prediction: str | float | None = Field(None, description="Classify models: the top label (a tabular "
                                           "regressor's: its value) ...")
    confidence: float | None = Field(None, description="... its score ...")
    scores: dict[str, float] | None = Field(None, description="... and every label's score.")
    outputs: list[InferTensor] | None = Field(None, description="onnx and torch models: the output tensors, as "
                                              "/v2/models/{name}/infer answers them in JSON.")


class BatchResults(BaseModel):
    batch_id: str
    object: Literal["batch.results"] = "batch.results"
    status: JobStatus
    results: list[BatchItemOut] = Field(description="One per input, in input order.")


# ---- handlers --------------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    body = await parse_body(request, BatchCreate)
    inputs = [value if isinstance(value, str) else value.model_dump() if isinstance(value, ImageIn | FeaturesIn)
              else value.model_dump(exclude_unset=True) if isinstance(value, TensorsIn)  # as infer reads them
              else [{"role": "system" if m.role == "developer" else m.role, "content": m.for_template()["content"]}
                    for m in value]  # a message with images keeps its parts (text and image_url)
              for value in body.inputs]
    created = await services(request).batch.create(caller_of(request), body.model, inputs,
                                              (body.params or BatchParams()).model_dump(),
                                              body.params is not None, body.callback_url)
    return json_response(created.view())


async def get_batch(request: web.Request) -> web.Response:
    return json_response(await services(request).batch.job(request.match_info["batch_id"], tenant_of(request).name))


async def list_batches(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": await services(request).batch.jobs(tenant_of(request).name)})


async def batch_results(request: web.Request) -> web.Response:
    return json_response(await services(request).batch.results(request.match_info["batch_id"], tenant_of(request).name))


async def cancel_batch(request: web.Request) -> web.Response:
    job_id = request.match_info["batch_id"]
    return json_response(await services(request).batch.cancel_job(job_id, tenant_of(request).name))


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
