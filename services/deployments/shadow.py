"""Shadow traffic: a share of a deployment's requests mirrored to another version of the same
model, whose outputs are logged beside the served ones and never returned.

Generations: `ShadowMirror.mirror` runs right after a request was submitted to its model's
stable version: `percent`% of requests (by a hash of the generation id) get a copy (new id,
`low` priority, tenant `galley-shadow`, so the caller's quotas and fair share are untouched)
admitted to the shadow version through `Admission.generation`, uncounted. A task waits for
both and logs one `shadow` line (hashes and lengths of both outputs; the texts only with
`log_prompts`). The served request's text comes from a watcher on its `RequestStream`, which
sees each event as the router queues it for the reader.

Embeddings and classifications: `mirror_inputs` runs once the served version answered (by a
hash of the request id); the same inputs go to the shadow version's batcher outside tenant
admission, and the `shadow` line compares the outputs: the largest difference and the lowest
cosine similarity of the vectors, or how many top labels agree (`match`: vectors within
`EMBED_MATCH_TOL`, or every top label the same).

Both count `galley_shadow_requests_total{outcome}`: `match`, `mismatch`, `error` (the shadow
failed), `dropped` (not ready, queue full, not scheduled in time, or the served request did
not complete, which aborts the copy). Copies never pass through the request metrics and never
feed canary health (see `SHADOW_PREFIX`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter

from engine.types import GenerationRequest, TokenEvent
from scheduling import encoders
from scheduling.encoders import EncoderBusy, ServedEncoder
from scheduling.limiter import TenantLimits
from scheduling.rollout import NUM_BUCKETS, bucket
from scheduling.router import RequestStream, Served, ServedModel
from services.admission import Admission
from services.background import BackgroundTasks
from services.deployments.manager import SHADOW_PREFIX, ModelManager
from services.errors import ConflictError, InvalidRequestError, RateLimitError, ServiceUnavailableError
from services.observability.metrics import STATUS
from services.observability.telemetry import SUCCESS
from storage.registry import RegistryStore, Shadow

log = structlog.get_logger(__name__)

SHADOW_TENANT = "galley-shadow"
SHADOW_LIMITS = TenantLimits(SHADOW_TENANT)  # no tenant limits: only the queue bound can refuse a copy
MAX_PRIMARY_WAIT_S = 3600.0  # a served request nobody reads (never through the API) is given up after this
EMBED_MATCH_TOL = 1e-4  # embeddings this close are the same output (batch composition moves the last digits)


class PrimaryOutput:
    """The served request's text as its reader gets it, and how it ended (a `RequestStream` watcher:
    a reader that leaves or times out aborts the stream, which ends it `cancelled`)."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_event(self, event: TokenEvent) -> None:
        self.text += event.text
        self.num_tokens = event.num_output_tokens
        if event.finished and not self.ended.done():
            self.ended.set_result(STATUS[event.finish_reason])


@dataclass
class ShadowRun:
    text: str = ""
    num_tokens: int = 0
    status: str = "dropped"  # stop | length | cancelled | error | timeout | dropped


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ShadowMirror:
    """Invariant: `shadows` holds what SQLite holds (one per model at most, percent 1-100)."""

    def __init__(self, manager: ModelManager, admission: Admission, store: RegistryStore,
                 metrics_registry: CollectorRegistry) -> None:
        self.manager = manager
        self.router = manager.router
        self.admission = admission
        self.store = store
        self.shadows: dict[str, Shadow] = {}
        self.requests = Counter("galley_shadow_requests", "Requests mirrored to a shadow version, by outcome",
                                ["model", "version", "outcome"], registry=metrics_registry)
        self._background = BackgroundTasks()

    async def restore(self) -> None:
        self.shadows = {s.model_name: s for s in await asyncio.to_thread(self.store.shadows)}

    async def set(self, model_name: str, version: str | None, percent: int) -> None:
        """Mirror `percent`% of the stable version's requests to `version`, which starts loading;
        0 stops mirroring. Checks everything before changing anything."""
        deployment, _ = self.manager.deployment(model_name)  # 404 for an unknown model
        if percent == 0:
            await asyncio.wrap_future(self.store.clear_shadow(model_name))
            self.shadows.pop(model_name, None)
            log.info("shadow cleared", model=model_name)
            return
        if version is None:
            raise InvalidRequestError("version: required unless percent is 0", param="version")
        vs = self.manager.get(model_name, version)  # 404 for an unknown version (of the same kind: names keep one)
        if version == deployment.stable:
            raise ConflictError(f"`{vs.ref}` is the stable version: it cannot shadow itself", param="version",
                                code="shadow_is_stable")
        wanted = Shadow(model_name, version, percent)
        self.shadows[model_name] = await asyncio.wrap_future(self.store.set_shadow(wanted))
        if vs.state != "ready":
            self.manager.load_in_background(vs)
        log.info("shadow set", model=model_name, version=version, percent=percent)

    # ---- mirroring ----------------------------------------------------------------------

    def mirror(self, primary: RequestStream, log_prompts: bool) -> None:
        """Maybe copy `primary` to its model's shadow version; never raises, never waits."""
        try:
            shadow = self._selected(primary.model, primary.request_id)
            if shadow is not None:
                self._submit_copy(primary, shadow, log_prompts)
        except Exception:
            log.exception("shadow copy failed", model=primary.model.name)

    def mirror_inputs(self, primary: ServedEncoder, request_id: str, items: list, outputs: list,
                      log_prompts: bool) -> None:
        """Maybe send an answered encoder request's inputs to its model's shadow version, to compare
        with `outputs` (the served version's, `.values` each); never raises, never waits."""
        try:
            shadow = self._selected(primary, request_id)
            if shadow is None:
                return
            target = self.router.deployments[shadow.model_name].routable(shadow.version)
            reason = self._unfit_inputs(items, target, shadow)
            if reason is None:
                try:
                    future = encoders.submit(target, items, lambda model, ok, s: self.manager.touch(model), low=True)
                except EncoderBusy as exc:
                    reason = f"refused: {exc}"
                else:
                    self._background.spawn(self._compare_inputs(primary, target, request_id, items,
                                                                [out.values for out in outputs], future, log_prompts))
                    return
            self.requests.labels(shadow.model_name, shadow.version, "dropped").inc()
            log.debug("shadow copy dropped", model=shadow.model_name, version=shadow.version, reason=reason)
        except Exception:
            log.exception("shadow copy failed", model=primary.name)

    def _selected(self, model: Served, request_id: str) -> Shadow | None:
        shadow = self.shadows.get(model.name)
        deployment = self.router.deployments.get(model.name)
        if shadow is None or deployment is None or model.version != deployment.stable:
            return None  # only the stable version is mirrored
        if shadow.version == model.version:
            return None  # the shadow became the stable version (a later deploy): nothing to compare
        if bucket(SHADOW_PREFIX + request_id) >= shadow.percent * NUM_BUCKETS // 100:
            return None
        return shadow

    def _submit_copy(self, primary: RequestStream, shadow: Shadow, log_prompts: bool) -> None:
        target = self.router.deployments[shadow.model_name].routable(shadow.version)
        reason = self._unfit(primary.request, target, shadow)
        if reason is None:
            try:
                stream = self.admission.generation(
                    target, list(primary.request.prompt_token_ids), primary.request.params, SHADOW_LIMITS, 1.0, "low",
                    SHADOW_PREFIX + uuid.uuid4().hex, counted=False, images=primary.request.images)
            except (RateLimitError, ServiceUnavailableError) as exc:  # a refused copy is dropped, no client error
                reason = f"refused: {exc.__cause__ or exc}"
        if reason is not None:
            self.requests.labels(shadow.model_name, shadow.version, "dropped").inc()
            log.debug("shadow copy dropped", model=shadow.model_name, version=shadow.version, reason=reason)
            return
        output = PrimaryOutput()
        primary.watchers.append(output.on_event)
        self._background.spawn(self._compare(primary, output, stream, log_prompts))

    def _unfit(self, request: GenerationRequest, target: ServedModel | None, shadow: Shadow) -> str | None:
        """Why the copy cannot run on the shadow version now, or None."""
        if target is None:
            self._load(shadow)
            return "not ready"
        if len(request.prompt_token_ids) + request.params.max_tokens > target.max_model_len:
            return "over the shadow version's context"
        if target.vocab_size and any(t >= target.vocab_size for t in request.prompt_token_ids):
            return "prompt token ids outside the shadow version's vocabulary"
        if request.images is not None and target.processor is None:
            return "the prompt has images and the shadow version takes none"
        return None

    def _unfit_inputs(self, items: list, target: Served | None, shadow: Shadow) -> str | None:
        if not isinstance(target, ServedEncoder):
            self._load(shadow)
            return "not ready"
        for item in items:
            if isinstance(item, list) and (len(item) > target.max_seq_len
                                           or any(t >= target.vocab_size for t in item)):
                return "token ids outside the shadow version's vocabulary or context"
        return None

    def _load(self, shadow: Shadow) -> None:
        """A shadow version that went cold loads again in the background (a failed one stays failed)."""
        vs = self.manager.versions.get(f"{shadow.model_name}@{shadow.version}")
        if vs is not None and vs.state == "unloaded":
            self.manager.load_in_background(vs)

    # ---- comparing ----------------------------------------------------------------------

    async def _compare(self, primary: RequestStream, output: PrimaryOutput, stream: RequestStream,
                       log_prompts: bool) -> None:
        run = asyncio.ensure_future(self._run(stream))
        try:
            async with asyncio.timeout(MAX_PRIMARY_WAIT_S):  # not wait_for: see metrics.observe
                primary_status = await asyncio.shield(output.ended)
        except TimeoutError:
            primary_status = "unread"
        finally:
            if output.on_event in primary.watchers:
                primary.watchers.remove(output.on_event)
        if primary_status not in SUCCESS:
            self.router.abort(stream)  # nothing to compare with: stop spending compute on it
        result = await run
        outcome = self._outcome(primary_status, output, result)
        model, version = primary.model.name, stream.model.version
        self.requests.labels(model, version, outcome).inc()
        if outcome == "dropped":
            log.debug("shadow copy dropped", model=model, version=version, primary_status=primary_status,
                      shadow_status=result.status)
            return
        fields: dict[str, Any] = {
            "primary_chars": len(output.text), "primary_sha256": digest(output.text),
            "shadow_chars": len(result.text), "shadow_sha256": digest(result.text),
        }
        if log_prompts:
            fields |= {"prompt": primary.model.tokenizer.decode(primary.request.prompt_token_ids),
                       "primary_output": output.text, "shadow_output": result.text}
        log.info("shadow", model=model, primary_version=primary.model.version, shadow_version=version,
                 outcome=outcome, generation_id=primary.request_id, shadow_generation_id=stream.request_id,
                 primary_status=primary_status, shadow_status=result.status, primary_tokens=output.num_tokens,
                 shadow_tokens=result.num_tokens, **fields)

    async def _compare_inputs(self, primary: ServedEncoder, target: ServedEncoder, request_id: str, items: list,
                              served: list[list[float]], future: asyncio.Future, log_prompts: bool) -> None:
        model, version = primary.name, target.version
        try:
            async with asyncio.timeout(self.router.queue_timeout_s):
                shadowed = [out.values for out in await future]
        except TimeoutError:
            self.requests.labels(model, version, "dropped").inc()
            return
        except Exception as exc:
            self.requests.labels(model, version, "error").inc()
            log.info("shadow", model=model, primary_version=primary.version, shadow_version=version,
                     outcome="error", request_id=request_id, error=str(exc))
            return
        outcome, fields = compare_outputs(primary.kind, served, shadowed)
        self.requests.labels(model, version, outcome).inc()
        if log_prompts:
            fields |= {"inputs": items, "primary_output": served, "shadow_output": shadowed}
        log.info("shadow", model=model, primary_version=primary.version, shadow_version=version, outcome=outcome,
                 request_id=request_id, kind=primary.kind, num_inputs=len(items), **fields)

    @staticmethod
    def _outcome(primary_status: str, output: PrimaryOutput, result: ShadowRun) -> str:
        if primary_status not in SUCCESS or result.status in ("cancelled", "timeout", "dropped"):
            return "dropped"
        if result.status not in SUCCESS:
            return "error"
        return "match" if result.text == output.text else "mismatch"

    async def _run(self, stream: RequestStream) -> ShadowRun:
        """The copy to its end; not scheduled within the queue timeout, it is aborted."""
        result, events = ShadowRun(), aiter(stream)
        try:
            async with asyncio.timeout(self.router.queue_timeout_s):  # not wait_for: see metrics.observe
                event = await anext(events)
            while True:
                result.text += event.text
                result.num_tokens = event.num_output_tokens
                if event.finished:
                    result.status = STATUS[event.finish_reason]
                    return result
                event = await anext(events)
        except TimeoutError:
            result.status = "timeout"
            return result
        finally:
            if not stream.finished:  # timed out, or the server is shutting down
                self.router.abort(stream)

    # ---- plumbing -----------------------------------------------------------------------

    async def close(self) -> None:
        await self._background.cancel_all()


def compare_outputs(kind: str, served: list[list[float]], shadowed: list[list[float]]) -> tuple[str, dict]:
    """An encoder request's outcome (`match` or `mismatch`) and the fields of its `shadow` line."""
    if kind == "embed":
        diff = max((abs(a - b) for u, v in zip(served, shadowed) for a, b in zip(u, v)), default=0.0)
        similarity = min((cosine(u, v) for u, v in zip(served, shadowed)), default=1.0)
        return ("match" if diff <= EMBED_MATCH_TOL else "mismatch"), {
            "max_abs_diff": round(diff, 6), "min_cosine": round(similarity, 6)}
    agree = sum(u.index(max(u)) == v.index(max(v)) for u, v in zip(served, shadowed))
    return ("match" if agree == len(served) else "mismatch"), {"top_label_agreement": f"{agree}/{len(served)}"}


def cosine(u: list[float], v: list[float]) -> float:
    norm = math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))
    return sum(a * b for a, b in zip(u, v)) / norm if norm else 1.0
