"""Routes generation requests to a model's replicas and token events back to their streams, and
encoder inputs to an encoder version's handle.

Lives on the event loop: `submit` picks the least loaded replica and hands the request to
its device worker; `dispatch` (called on the loop via `call_soon_threadsafe` with each
step's events) feeds every request's `RequestStream`; `submit_encoder` hands inputs to an
embed/classify version. A model name's versions are all of one kind, generative
(`ServedModel`) or encoder (`ServedEncoder`). TenantLimiter is bounded: past
`max_num_seqs` running plus `max_waiting` queued per replica, `submit` refuses at once,
after the tenant's own limits (`scheduling.limiter`) have let the request through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from engine.prefix_hash import prefix_hashes
from engine.types import EngineStats, FinishReason, GenerationRequest, TokenEvent
from scheduling import affinity, encoders
from scheduling.affinity import PrefixIndex
from scheduling.encoders import OnEncoderFinish, ServedEncoder
from scheduling.limiter import TenantLimiter, TenantLimits, Ticket
from scheduling.rollout import parse_model_ref, pick_version

log = structlog.get_logger(__name__)


class QueueFull(Exception):
    def __init__(self, model: str, limit: int) -> None:
        super().__init__(f"model {model!r} has {limit} requests in flight, its limit")
        self.model = model
        self.limit = limit


class ModelUnavailable(Exception):
    """The version is draining or unloaded: route the request again (`resolve`) and submit there."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model version {model!r} is being unloaded; route the request again")
        self.model = model


class WorkerHandle(Protocol):
    def submit(self, engine_id: str, request: GenerationRequest) -> None: ...
    def is_responsive(self) -> bool: ...
    def abort(self, engine_id: str, request_id: str) -> None: ...
    def stats(self, engine_id: str) -> EngineStats: ...


@dataclass
class Replica:
    worker: WorkerHandle
    engine_id: str
    device: str
    num_in_flight: int = 0
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)  # what it likely holds cached


@dataclass
class ServedModel:
    """A generative model as the API sees it: its tokenizer, limits and replicas."""

    name: str
    tokenizer: Any  # transformers tokenizer: chat template and prompt encoding
    max_model_len: int
    max_in_flight_per_replica: int
    replicas: list[Replica]
    vocab_size: int = 0  # the model's embedding rows: valid token ids are below it, whatever the tokenizer says
    max_token_chars: int = 64  # the longest token's spelling (bounds a prompt's characters before tokenizing)
    version: str = "1"  # conversations pin it
    created: int = 0
    draining: bool = False  # being unloaded: in-flight requests finish, new ones go elsewhere
    block_size: int = 16  # of the replicas' KV caches: prefix routing hashes prompts by block
    shared_prefix_cache: bool = False  # tenants may reuse each other's cached prefixes (a common system prompt)
    tool_parser: str | None = None  # the tool-call format its answers are parsed in; None: from the chat template
    reasoning_parser: str | None = None  # how <think> thoughts are split: qwen3 | deepseek_r1 | none; None: detected
    # what a request that leaves a sampling field (or max_tokens) out gets (`services.sampling`)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    architecture: str = ""  # config.json's, e.g. Qwen3ForCausalLM
    family: str = ""  # config.json's model_type, e.g. qwen3_moe
    backend: str = "native"  # how the engine runs it: native (our fused decoder) | generic (transformers' code)
    adapter: str = ""  # a LoRA adapter: its name on the base's engines (the replicas are the base's); "": none
    base: str = ""  # a LoRA adapter: the ref (name@version) of the base version it runs over
    processor: Any = None  # a vision-language model's (transformers' AutoProcessor): it takes images
    images_refused: str = ""  # a vision-language model served text only: why (its load's image check)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    def cache_salt(self, request: GenerationRequest) -> str:
        """The request's prefix-cache namespace: its tenant's own unless the model shares across
        tenants (a prefix hit shows in timing, so tenants must not probe each other's prompts),
        plus the client's own `cache_salt` (the engine adds a LoRA adapter's name: `engine.types.Sequence`)."""
        return request.cache_salt if self.shared_prefix_cache else f"{request.tenant}\x00{request.cache_salt}"

    def pick_replica(self, request: GenerationRequest) -> Replica:
        """Least loaded, or with several replicas the one likely to hold the prompt's longest
        cached prefix (`scheduling.affinity`), which it then remembers."""
        open_replicas = [r for r in self.replicas if r.num_in_flight < self.max_in_flight_per_replica]
        if len(open_replicas) == 1:
            return open_replicas[0]
        hashes = prefix_hashes(request.prompt_token_ids, self.block_size, request.cache_salt)
        replica = affinity.pick(open_replicas, hashes)
        replica.prefixes.remember(hashes, replica.worker.stats(replica.engine_id).kv_blocks_total)
        return replica


Served = ServedModel | ServedEncoder  # one loaded version of a model, of either kind


@dataclass
class ModelDeployment:
    """A model name as routing sees it: its traffic split and the versions attached to workers.

    Invariant: `traffic` sums to 100 and holds `stable`; `versions` holds only loaded versions
    (a version in the split but not loaded is cold: the lifecycle manager loads it on demand).
    """

    name: str
    traffic: dict[str, int]
    stable: str
    versions: dict[str, Served] = field(default_factory=dict)
    num_registered: int = 1  # versions in the registry; above 1, responses name the version

    def choose(self, key: str) -> str:
        return pick_version(self.traffic, self.stable, key)

    def routable(self, version: str) -> Served | None:
        served = self.versions.get(version)
        return served if served is not None and not served.draining else None

    @property
    def default(self) -> Served | None:
        """The stable version if it is loaded, else any loaded version."""
        stable = self.routable(self.stable)
        return stable or next((v for v in self.versions.values() if not v.draining), None)

    def label(self, served: Served) -> str:
        """What responses call it: `name`, or `name@version` while several versions exist."""
        return served.name if self.num_registered <= 1 else served.ref


class RequestStream:
    """The asyncio end of one generation; iterate it for its token events."""

    def __init__(self, request: GenerationRequest, model: ServedModel, replica: Replica, ticket: Ticket) -> None:
        self.request = request
        self.model = model
        self.replica = replica
        self.ticket = ticket
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.watchers: list[Callable[[TokenEvent], None]] = []  # see each event as it is queued (shadow traffic)
        self.finished = False
        self.num_tokens_used = len(request.prompt_token_ids) + len(request.resume_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, event: TokenEvent) -> None:
        self.events.put_nowait(event)
        for watcher in self.watchers:
            try:
                watcher(event)
            except Exception:  # a watcher (shadow traffic) never breaks delivery to this or any other stream
                log.exception("stream watcher failed", request_id=self.request_id)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.events.get()
            yield event
            if event.finished:
                return


def seed_sampling(request: GenerationRequest) -> None:
    """Give a sampled request without a seed a random one, at admission. The sampler's noise is a
    function of (seed, position), so the seed stored with the stream makes a replay after a crash
    regenerate exactly the tokens already sent; a fresh seed per request keeps unseeded requests
    random from one request to the next."""
    if request.params.seed is None and not request.params.is_greedy:
        request.params = dataclasses.replace(request.params, seed=random.getrandbits(63))


@dataclass
class Router:
    deployments: dict[str, ModelDeployment] = field(default_factory=dict)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    admission: TenantLimiter = field(default_factory=TenantLimiter)
    queue_timeout_s: float = 600.0  # a request not scheduled by then gets 503
    # called with each finished request (canary health, idle clocks), and each finished encoder submit
    finish_listeners: list[Callable[[RequestStream, TokenEvent], None]] = field(default_factory=list)
    encoder_finish_listeners: list[OnEncoderFinish] = field(default_factory=list)

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    @property
    def models(self) -> dict[str, Served]:
        """Each model name's default served version (a fresh dict: change deployments, not this)."""
        return {name: d.default for name, d in self.deployments.items() if d.default is not None}

    def served_models(self) -> list[ServedModel]:
        """Every loaded version of every generative model."""
        return [s for d in self.deployments.values() for s in d.versions.values() if isinstance(s, ServedModel)]

    def served_encoders(self) -> list[ServedEncoder]:
        """Every loaded version of every embed or classify model."""
        return [s for d in self.deployments.values() for s in d.versions.values() if isinstance(s, ServedEncoder)]

    def add_model(self, model: Served) -> None:
        """Attach a loaded version; a new name gets a deployment sending it all traffic."""
        deployment = self.deployments.setdefault(model.name, ModelDeployment(model.name, {model.version: 100},
                                                                             model.version))
        deployment.versions[model.version] = model

    def remove_model(self, model: Served) -> None:
        deployment = self.deployments.get(model.name)
        if deployment is not None and deployment.versions.get(model.version) is model:
            del deployment.versions[model.version]

    def find(self, ref: str) -> Served | None:
        """A loaded, routable version by `name` (its default) or `name@version`."""
        name, version = parse_model_ref(ref)
        deployment = self.deployments.get(name)
        if deployment is None:
            return None
        return deployment.default if version is None else deployment.routable(version)

    def label(self, model: Served) -> str:
        deployment = self.deployments.get(model.name)
        return deployment.label(model) if deployment is not None else model.name

    def submit(self, model: ServedModel, request: GenerationRequest,
               limits: TenantLimits | None = None) -> RequestStream:
        """Admit (tenant limits, then the model's queue bound) and hand to the least loaded replica.

        Raises `ModelUnavailable`, `scheduling.limiter.Rejected` or `QueueFull`, having changed nothing.
        A draining version is refused: its engines are about to be detached, so a request handed to
        them would never be answered.
        """
        if model.draining:
            raise ModelUnavailable(model.ref)
        if min(r.num_in_flight for r in model.replicas) >= model.max_in_flight_per_replica:
            raise QueueFull(model.name, model.max_in_flight_per_replica * len(model.replicas))
        estimate = len(request.prompt_token_ids) + request.params.max_tokens
        ticket = self.admission.admit(limits or TenantLimits(request.tenant), estimate)
        seed_sampling(request)
        request.cache_salt = model.cache_salt(request)
        request.adapter = model.adapter
        replica = model.pick_replica(request)
        stream = RequestStream(request, model, replica, ticket)
        self.streams[request.request_id] = stream
        replica.num_in_flight += 1
        replica.worker.submit(replica.engine_id, request)
        return stream

    def submit_encoder(self, model: ServedEncoder, items: list[Any], low: bool = False) -> asyncio.Future:
        """Hand inputs to an encoder version (`EncoderBusy` over its bound); its outcome reaches
        `encoder_finish_listeners`."""
        return encoders.submit(model, items, self._encoder_finished, low)

    def _encoder_finished(self, model: ServedEncoder, ok: bool, latency_s: float) -> None:
        for listener in self.encoder_finish_listeners:
            listener(model, ok, latency_s)

    def abort(self, stream: RequestStream, error: str | None = None, error_code: str | None = None) -> None:
        """Cancel a request nobody wants any more; its blocks free before the next step.

        Whoever still iterates the stream gets a final `abort` event (an `error` one with `error`
        and `error_code`)."""
        if self._close(stream):
            stream.replica.worker.abort(stream.replica.engine_id, stream.request_id)
            num_prompt = len(stream.request.prompt_token_ids)
            stream.put(TokenEvent(
                request_id=stream.request_id, text="", token_ids=[], num_prompt_tokens=num_prompt,
                num_output_tokens=stream.num_tokens_used - num_prompt,
                finish_reason=FinishReason.ABORT if error is None else FinishReason.ERROR, error=error,
                error_code=error_code,
            ))

    def fail_all(self, error: str, error_code: str) -> None:
        """At the end of a drain: every request still in flight ends with an `error` event (its
        reader gives its client a final error with `error_code`) and frees its blocks."""
        for stream in list(self.streams.values()):
            self.abort(stream, error, error_code)

    def dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self.streams.get(event.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream.num_tokens_used = event.num_prompt_tokens + event.num_output_tokens
            stream.put(event)
            if event.finished:
                self._close(stream)
                for listener in self.finish_listeners:
                    listener(stream, event)

    def _close(self, stream: RequestStream) -> bool:
        if stream.finished:
            return False
        stream.finished = True
        self.streams.pop(stream.request_id, None)
        stream.replica.num_in_flight -= 1
        self.admission.release(stream.ticket, stream.num_tokens_used)
        return True
