"""One batch item: planned as a /v1 request is (`services.sampling.sampling_params`: the same
defaults, caps and checks, the same messages), submitted at low priority through the one admission
path uncounted (a refusal is waited out, never a 429), and run to its stored result. Encoder jobs
run in chunks, one batcher submit each; a tensor model's item is one /v2 infer request's `inputs`,
read and checked as that endpoint reads them, so a bad one fails alone with the 400's message."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from prometheus_client import Counter

from engine.types import FinishReason, ImageInputs, SamplingParams
from scheduling.encoders import ServedEncoder
from scheduling.router import RequestStream, Router, Served, ServedModel
from services.admission import Admission
from services.batch.jobs import BatchConfig, JobRun, encoder_result
from services.errors import InvalidRequestError, QueueFullError, RateLimitError, ServiceError, ServiceUnavailableError
from services.inference.encoders import check_tensors, features_request, tabular_predictions, tensor_outputs
from services.inference.images import decode_image, image_bytes
from services.inference.prompts import encode_chat, encode_text
from services.inference.tensors import read_inputs
from services.inference.vision import encode_vision_chat, has_images
from services.observability.metrics import Metrics
from services.sampling import SAMPLING_FIELDS, SamplingOptions, sampling_params
from services.server_state import ServerState
from services.tenancy import limits_of
from storage import batches
from storage.batches import BatchItem, BatchJob, ItemResult, ItemStatus
from storage.tenants import Tenant

log = structlog.get_logger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # as /v1/completions
INFER_KINDS = ("onnx", "torch")  # tensor models whose items are named input tensors


class ItemError(Exception):
    """An input that cannot run (too long for the context, over the caller's cap, rejected by the chat template)."""


def item_options(params: dict[str, Any]) -> SamplingOptions:
    """The job's stored params (api.batch.BatchParams as JSON) as a request's options: a field left
    out (None) takes the model's default, as on /v1."""
    stop = params.get("stop")
    return SamplingOptions(**{name: params.get(name) for name in SAMPLING_FIELDS}, seed=params.get("seed"),
                           stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                           stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                           ignore_eos=bool(params.get("ignore_eos")))


Planned = tuple[list[int], SamplingParams, ImageInputs | None]  # prompt ids, params, a vision prompt's images


async def plan_item(job: BatchJob, model: ServedModel, value: Any, tenant: Tenant) -> Planned:
    """An input's prompt ids, sampling params and images, by the rules of /v1 (a prompt as
    /v1/completions, 16 tokens by default; messages as /v1/chat/completions, `image_url` parts
    included); ItemError with /v1's message when it cannot run."""
    try:
        images = None
        if isinstance(value, str):
            prompt_ids = await encode_text(model, value)
        elif has_images(value):
            prompt_ids, images = await encode_vision_chat(model, value, param="input")
        else:
            prompt_ids = await encode_chat(model, value)
        return prompt_ids, sampling_params(
            item_options(job.params), job.params.get("max_tokens"), len(prompt_ids), model, None,
            cap=tenant.max_tokens, default_max_tokens=DEFAULT_COMPLETION_TOKENS if isinstance(value, str) else None
        ), images
    except InvalidRequestError as exc:
        raise ItemError(exc.message) from exc


class ItemRunner:
    """Runs a job's items; `find_model` routes the job's model again after every wait."""

    def __init__(self, router: Router, admission: Admission, metrics: Metrics,
                 tenants: Callable[[str], Tenant | None], state: ServerState, config: BatchConfig,
                 find_model: Callable[[BatchJob], Awaitable[Served | None]]) -> None:
        self.router = router
        self.admission = admission  # items are admitted as requests are, uncounted: a refusal is waited out
        self.metrics = metrics
        self.tenants = tenants
        self.state = state
        self.config = config
        self.find_model = find_model
        self.item_seconds: dict[str, float] = {}  # per model, moving average of one item's duration
        self.retries_total = Counter("galley_batch_item_retries", "Batch item submits refused and retried later, "
                                     "by reason (queue_full, model_unavailable, or the tenant limit)", ["reason"],
                                     registry=metrics.registry)

    async def prepare(self, job: BatchJob, model: ServedModel, value: Any) -> Planned:
        """An input's prompt ids, sampling params and images (`plan_item`) for the job's tenant as it is now."""
        tenant = self.tenants(job.tenant)
        if tenant is None:
            raise ItemError("the job's tenant was deleted")
        return await plan_item(job, model, value, tenant)

    async def run_item(self, run: JobRun, item: BatchItem) -> ItemResult | None:
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
        self.observe_item(stream.model.name, time.monotonic() - started)
        return ItemResult(ItemStatus.COMPLETED.value, output=text, finish_reason=last.finish_reason.value,
                          prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens)

    async def _submit(self, run: JobRun, item: BatchItem) -> RequestStream | ItemResult | None:
        """Submit the item at low priority, waiting out refusals. The model is resolved again after every
        wait (it may have been unloaded, reloaded or replaced meanwhile: a stale version would take the
        item nowhere). An ItemResult when the item cannot run; None if the job is cancelled or the server
        drains first."""
        prepared: tuple[ServedModel, list[int], SamplingParams, ImageInputs | None] | None = None
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
                    params: SamplingParams, images: ImageInputs | None) -> tuple[RequestStream | None, float]:
        """The admitted stream, or None and how long to wait before trying again."""
        request_id = f"{run.job.id}-{item.idx}-{uuid.uuid4().hex[:8]}"
        try:
            stream = self.admission.generation(model, prompt_ids, params, limits_of(tenant), tenant.weight, "low",
                                               request_id, counted=False, images=images)  # a refusal: no 429
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

    async def encode(self, run: JobRun, model: ServedEncoder, inputs: list[Any]) -> list[ItemResult] | None:
        """One result per input (a text; `{"image"}` for an image classifier, `{"features"}` for a tabular
        model, `{"inputs"}` for an onnx or torch one), waiting out refusals (tenant limits, the batcher's
        bound) as `_submit` does; a version unloaded meanwhile (keep_alive, memory budget, rollout) is
        routed again. An image that does not decode, or tensors that do not read, fail their own item only."""
        if model.kind == "image-classify":
            decoded = await asyncio.to_thread(decode_each, [item["image"] for item in inputs])
        elif model.kind in INFER_KINDS:
            decoded = await asyncio.to_thread(read_each, [item["inputs"] for item in inputs])
        else:
            return await self._encode(run, model, inputs)
        good = [value for value in decoded if not isinstance(value, ItemResult)]
        results = await self._encode(run, model, good) if good else []
        if results is None:
            return None
        done = iter(results)
        return [value if isinstance(value, ItemResult) else next(done) for value in decoded]

    async def _encode(self, run: JobRun, model: ServedEncoder, texts: list[Any]) -> list[ItemResult] | None:
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
                if model.kind == "tabular":  # the rows as one request of the model's input tensor
                    request = features_request(model, [x["features"] for x in texts])
                    [out] = await self.admission.encode(model, [request], limits_of(tenant), low=True, counted=False)
                    return [ItemResult(ItemStatus.COMPLETED.value, output=batches.dumps(value), prompt_tokens=0,
                                       completion_tokens=0) for value in tabular_predictions(model, out)]
                if model.kind in INFER_KINDS:
                    return await self._infer(model, texts, tenant)
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

    async def _infer(self, model: ServedEncoder, requests: list[dict], tenant: Tenant) -> list[ItemResult]:
        """Each request checked against this version's inputs (as /v2's infer checks it: a bad one fails
        alone, with that 400's message), the others in one submit; each result the outputs infer answers."""
        checked = [checked_tensors(model, tensors) for tensors in requests]
        good = [tensors for tensors in checked if not isinstance(tensors, ItemResult)]
        outputs = iter(await self.admission.encode(model, good, limits_of(tenant), low=True, counted=False)
                       if good else [])
        return [tensors if isinstance(tensors, ItemResult) else ItemResult(
            ItemStatus.COMPLETED.value, output=batches.dumps({"outputs": tensor_outputs(model, next(outputs))}),
            prompt_tokens=0, completion_tokens=0) for tensors in checked]

    def observe_item(self, model: str, seconds: float) -> None:
        old = self.item_seconds.get(model)
        self.item_seconds[model] = seconds if old is None else 0.8 * old + 0.2 * seconds


def decode_each(images: list[str]) -> list[Any]:
    """Each image decoded, or the failed result of its item (the 400 a request would have got, as its error)."""
    decoded: list[Any] = []
    for i, data in enumerate(images):
        try:
            decoded.append(decode_image(image_bytes(data, f"inputs.{i}"), f"inputs.{i}"))
        except InvalidRequestError as exc:
            decoded.append(ItemResult(ItemStatus.FAILED.value, error=exc.message))
    return decoded


def read_each(requests: list[list[dict]]) -> list[Any]:
    """Each request's `inputs` as named arrays, or the failed result of its item (infer's 400, as its error)."""
    read: list[Any] = []
    for inputs in requests:
        try:
            read.append(read_inputs({"inputs": inputs}, b""))
        except InvalidRequestError as exc:
            read.append(ItemResult(ItemStatus.FAILED.value, error=exc.message))
    return read


def checked_tensors(model: ServedEncoder, tensors: dict) -> dict | ItemResult:
    """The tensors if they are `model`'s inputs, else the failed result of their item (infer's 400)."""
    try:
        check_tensors(model, tensors)
    except InvalidRequestError as exc:
        return ItemResult(ItemStatus.FAILED.value, error=exc.message)
    return tensors
