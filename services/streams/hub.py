"""Resumable streams: each generation's event log, its followers, and its checkpoints.

A `LiveStream` owns one generation on the event loop: a producer task appends its token
events, any number of followers (the original SSE response, a reconnect with
Last-Event-ID, a WebSocket) read from any index. Emitted tokens and their text deltas are
checkpointed to SQLite every `checkpoint_tokens` tokens or `checkpoint_seconds`, and at the
end, so a finished stream can be replayed after it left memory and an unfinished one can
be resumed after a crash (re-prefill prompt, with its images, + emitted tokens; every sampled request
has a seed from admission, so the tokens regenerated since the last checkpoint are those sent).
When the last follower leaves, the stream continues or is cancelled, by its `on_disconnect` policy.

Nothing is lost silently: no event is sent before the stream's record is stored, a failed
checkpoint stops the generation with a `storage_error` event, and the final event is sent
only once the end (and a conversation's answer) is stored, else a `storage_error` in its place.
Recovery resumes a stream only for its owner as it is now: the same tenant (by id, not just
name), still holding a key, still allowed the model, under its current limits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from engine.types import FinishReason, GenerationRequest, ImageInputs, Priority, SamplingParams, TokenEvent
from scheduling.rollout import parse_model_ref
from scheduling.router import RequestStream, Router
from services.answers.deltas import answer_message
from services.answers.events import ChunkFormat, StreamEvent
from services.answers.reading import scheduled_events, usage
from services.background import BackgroundTasks
from services.errors import SHUTTING_DOWN, ServiceUnavailableError
from services.observability.metrics import Metrics
from services.tenancy import Auth, Tenant, limits_of
from storage.streams import StoredAnswer, StreamRecord, StreamStatus, StreamStore

log = structlog.get_logger(__name__)

STORAGE_ERROR = "the stream could not be stored (storage error), so it would not survive a restart; retry later"


class StorageFailed(Exception):
    """A write of this stream failed; `__cause__` is SQLite's error."""


def raise_if_failed(write: Future | None) -> None:
    if write is not None and write.done() and write.exception() is not None:
        raise StorageFailed from write.exception()


SHUTDOWN_ERROR = ("the server shut down before this stream ended; it resumes when the server is back: "
                  "reconnect with GET /api/v1/streams/{id} and Last-Event-ID")

REPLAY_BATCH = 16  # events a follower catching up sends before letting others run


@dataclass(frozen=True)
class StreamsConfig:
    stream_retention_seconds: float = 3600.0  # finished streams stay replayable this long
    checkpoint_tokens: int = 16
    checkpoint_seconds: float = 0.25
    on_disconnect_conversation: str = "continue"  # continue | cancel
    on_disconnect_plain: str = "cancel"
    memory_seconds: float = 60.0  # finished streams stay in memory this long, then replay from SQLite


class LiveStream:
    """Invariant: `events[i].index == i`; once `done`, no event is appended."""

    def __init__(self, record: StreamRecord, fmt: ChunkFormat, on_disconnect: str) -> None:
        self.record = record
        self.fmt = fmt
        self.on_disconnect = on_disconnect
        self.events: list[StreamEvent] = []
        self.done = False
        self.status: str = StreamStatus.RUNNING  # or "interrupted": left running for a restart to resume
        self.followers = 0
        self.request_stream: RequestStream | None = None
        self.finished_s: float | None = None
        self._changed = asyncio.Event()

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def text_length(self) -> int:
        last = self.events[-1] if self.events else None
        return last.text_offset + len(last.text) if last else 0

    def append(self, event: StreamEvent) -> None:
        assert not self.done and event.index == len(self.events)
        self.events.append(event)
        self._notify()

    def close(self, status: str) -> None:
        self.done, self.status, self.finished_s = True, status, time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = -1) -> AsyncIterator[StreamEvent]:
        """Events with index > `after`, live until the stream is done. A backlog yields to the
        event loop every REPLAY_BATCH events: a socket's send rarely waits, so many followers
        catching up would otherwise each hold the loop for their whole replay."""
        index = after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
                if index % REPLAY_BATCH == 0:
                    await asyncio.sleep(0)
            if self.done:
                return
            await self._changed.wait()


def replayed(record: StreamRecord) -> list[StreamEvent]:
    """Events rebuilt from a stored record (usage and finish on the last one when finished)."""
    events, offset, num_prompt = [], 0, len(record.prompt_token_ids)
    for index, text in enumerate(record.texts):
        events.append(StreamEvent(index, text, offset, num_prompt_tokens=num_prompt, num_output_tokens=index + 1))
        offset += len(text)
    if events and record.status != StreamStatus.RUNNING:
        events[-1].finish_reason = record.finish_reason
        prompt, completion = len(record.prompt_token_ids), len(record.token_ids)
        events[-1].usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
    return events


def params_to_json(params: SamplingParams) -> dict:
    return {**params.__dict__, "stop": list(params.stop), "stop_token_ids": sorted(params.stop_token_ids),
            "guided": list(params.guided) if params.guided is not None else None}


def params_from_json(data: dict) -> SamplingParams:
    return SamplingParams(**{**data, "stop": tuple(data["stop"]), "stop_token_ids": tuple(data["stop_token_ids"])})


@dataclass
class StreamHub:
    router: Router
    store: StreamStore
    metrics: Metrics
    config: StreamsConfig = StreamsConfig()
    auth: Auth | None = None  # the tenant directory: owners' ids, and their state at recovery
    live: dict[str, LiveStream] = field(default_factory=dict)
    _background: BackgroundTasks = field(default_factory=BackgroundTasks)

    def tenant(self, name: str) -> Tenant | None:
        return self.auth.directory.tenants.get(name) if self.auth is not None else None

    def start(self, request_stream: RequestStream, fmt: ChunkFormat, *, kind: str, conversation_id: str | None,
              on_disconnect: str, resumed: StreamRecord | None = None) -> LiveStream:
        """Register a submitted generation and start recording it."""
        gen = request_stream.request
        owner = self.tenant(gen.tenant)
        record = resumed or StreamRecord(
            id=fmt.id, tenant=gen.tenant, conversation_id=conversation_id, kind=kind, model=fmt.model,
            request={"format": fmt.to_dict(), "params": params_to_json(gen.params), "on_disconnect": on_disconnect,
                     "priority": gen.priority.name.lower(),
                     **({"images": list(gen.images.digests)} if gen.images is not None else {})},
            prompt_token_ids=list(gen.prompt_token_ids), token_ids=[], texts=[],
            tenant_id=owner.id if owner is not None else None,
        )
        live = LiveStream(record, fmt, on_disconnect)
        live.request_stream = request_stream
        inserted = None
        if resumed is not None:
            for event in replayed(resumed):
                live.append(event)
        else:
            inserted = self.store.insert(record, gen.images.to_bytes() if gen.images is not None else None)
        self.live[live.id] = live
        self._background.spawn(self._produce(live, request_stream, inserted))
        return live

    def attach(self, live: LiveStream) -> None:
        live.followers += 1

    def detach(self, live: LiveStream) -> None:
        """A follower left; with nobody left and the cancel policy, the generation stops."""
        live.followers -= 1
        if live.followers == 0 and not live.done and live.on_disconnect == "cancel":
            if live.request_stream is not None:
                self.router.abort(live.request_stream)

    def cancel(self, live: LiveStream) -> None:
        """Abort the generation; its followers (on any socket or response) then see it end as cancelled."""
        if not live.done and live.request_stream is not None:
            self.router.abort(live.request_stream)

    def tokenizer(self, live: LiveStream) -> Any:
        """The tokenizer of the model that generates `live` (logprob texts), None once it is unloaded."""
        served = self.router.find(live.fmt.model)
        return served.tokenizer if served is not None else None

    async def _produce(self, live: LiveStream, rs: RequestStream, inserted: Future | None) -> None:
        token_ids = list(live.record.token_ids)
        texts = list(live.record.texts)
        checkpointed, checkpoint_s = len(texts), time.monotonic()
        status, finish, last, stored = StreamStatus.FAILED, None, None, True
        write = None  # the latest checkpoint, checked before each event is sent
        events = scheduled_events(self.router, self.metrics, rs)
        try:
            if inserted is not None:
                await self._stored(inserted)  # nothing is sent of a stream that is not stored
            async for event in events:
                token_ids.extend(event.token_ids)
                texts.extend([event.text] if event.token_ids else [])
                raise_if_failed(write)
                if event.finished:  # sent once the end is stored (below)
                    status = {FinishReason.ABORT: StreamStatus.CANCELLED, FinishReason.ERROR: StreamStatus.FAILED}.get(
                        event.finish_reason, StreamStatus.FINISHED)
                    finish, last = event.finish_reason.value, event
                    break
                self._append(live, event)
                if (len(texts) - checkpointed >= self.config.checkpoint_tokens
                        or time.monotonic() - checkpoint_s >= self.config.checkpoint_seconds):
                    write = self._checkpoint(live.id, token_ids, texts)
                    checkpointed, checkpoint_s = len(texts), time.monotonic()
        except StorageFailed as exc:
            log.error("stream storage failed: generation stopped", stream_id=live.id, error=repr(exc.__cause__))
            self.router.abort(rs)
            live.append(StreamEvent(len(live.events), "", live.text_length, finish_reason="error",
                                    error_status=503, error_code="storage_error", error=STORAGE_ERROR))
            stored = inserted is None or not inserted.exception()
        except ServiceUnavailableError as exc:  # not scheduled in time (`scheduled_events` aborted it)
            live.append(StreamEvent(len(live.events), "", live.text_length, finish_reason="error", error_status=503,
                                    error_code=exc.code, error=exc.message))
        except Exception:
            log.exception("stream producer failed", stream_id=live.id)
            if not live.events or live.events[-1].finish_reason is None:
                live.append(StreamEvent(len(live.events), "", live.text_length, finish_reason="error",
                                        error="internal error while streaming"))
        except asyncio.CancelledError:  # server shutting down: leave it running, to resume on restart
            self._checkpoint(live.id, token_ids, texts)
            live.append(StreamEvent(len(live.events), "", live.text_length, finish_reason="error", error_status=503,
                                    error_code=SHUTTING_DOWN, error=SHUTDOWN_ERROR))
            live.close("interrupted")  # its followers send that error and end; SQLite still says running
            raise
        await self._end(live, token_ids, texts, status, finish, last, stored)

    async def _end(self, live: LiveStream, token_ids: list[int], texts: list[str], status: str,
                   finish: str | None, last: TokenEvent | None, stored: bool) -> None:
        """Store the end, then let followers see it: a next turn reads this answer, and a client
        never gets a normal end for an answer that was not stored."""
        try:
            if stored:
                await self._stored(self._finish(live, token_ids, texts, status, finish))
        except StorageFailed as exc:
            log.error("could not store the end of a stream", stream_id=live.id, error=repr(exc.__cause__))
            if last is not None:
                status, last = StreamStatus.FAILED, None
                live.append(StreamEvent(len(live.events), "", live.text_length, finish_reason="error",
                                        error_status=503, error_code="storage_error", error=STORAGE_ERROR))
        if last is not None:
            self._append(live, last)
        live.close(status)

    @staticmethod
    async def _stored(write: Future) -> None:
        try:
            await asyncio.wrap_future(write)
        except Exception as exc:
            raise StorageFailed from exc

    def _checkpoint(self, stream_id: str, token_ids: list[int], texts: list[str]) -> Future:
        return self.store.checkpoint(stream_id, token_ids, texts)

    def _append(self, live: LiveStream, event: TokenEvent) -> None:
        live.append(StreamEvent(
            index=len(live.events), text=event.text, text_offset=live.text_length, logprobs=event.logprobs,
            finish_reason=event.finish_reason.value if event.finish_reason else None,
            usage=usage(event) if event.finished else None,
            error=event.error, error_code="generation_failed" if event.error else None,
            has_token=bool(event.token_ids), num_prompt_tokens=event.num_prompt_tokens,
            num_output_tokens=event.num_output_tokens,
        ))

    def _finish(self, live: LiveStream, token_ids: list[int], texts: list[str], status: str,
                finish: str | None) -> Future:
        record = live.record
        answer = None  # a conversation deleted while the answer was generated gets none; the record still finishes
        if record.conversation_id and status == StreamStatus.FINISHED:
            content, extra = answer_message("".join(texts), live.fmt)  # as its followers were shown it
            answer = StoredAnswer(record.conversation_id, len(record.prompt_token_ids), content, extra)
        return self.store.finish(record.id, token_ids, texts, status, finish, answer)

    async def find(self, stream_id: str, tenant: str) -> LiveStream | None:
        """The stream, live or rebuilt from SQLite; None if unknown, expired or another tenant's."""
        live = self.live.get(stream_id)
        if live is None:
            record = await asyncio.to_thread(self.store.get, stream_id)
            if record is None or record.status == StreamStatus.RUNNING:
                return None  # running but not live: recovery has not picked it up (yet)
            live = LiveStream(record, ChunkFormat.from_dict(record.request["format"]),
                              record.request.get("on_disconnect", "cancel"))
            for event in replayed(record):
                live.append(event)
            live.close(record.status)
        return live if self.owns(tenant, live.record) else None

    def owns(self, tenant: str, record: StreamRecord) -> bool:
        """`tenant` (a name) is the record's owner: same name, and the same tenant, not a later one
        created under that name (records from before tenant ids go by name)."""
        if record.tenant != tenant:
            return False
        current = self.tenant(tenant)
        return record.tenant_id is None or (current is not None and current.id == record.tenant_id)

    def resume_request(self, record: StreamRecord, owner: Tenant | None, images: bytes | None = None):
        """The generation that continues `record` (with its prompt's stored `images`), under its owner's
        current weight and priority cap."""
        priority = record.request.get("priority", "normal")
        if owner is not None and not owner.allows_priority(priority):
            priority = owner.max_priority
        return GenerationRequest(
            record.id.split("-", 1)[-1], list(record.prompt_token_ids), params_from_json(record.request["params"]),
            tenant=record.tenant, priority=Priority[priority.upper()], weight=owner.weight if owner else 1.0,
            resume_token_ids=list(record.token_ids), images=images and ImageInputs.from_bytes(images))

    def not_resumable(self, record: StreamRecord, images: bytes | None = None) -> tuple[str, str] | None:
        """(final status, why) when `record` must not resume: model gone, its prompt's `images` not stored, or
        its owner no longer who started it (deleted, name re-created), holding no key, or denied the model."""
        if self.router.find(record.model) is None:
            return StreamStatus.FAILED, "model gone"
        if record.request.get("images") and images is None:  # the image tokens would run without their images
            return StreamStatus.FAILED, "its prompt's images were not stored with it"
        if self.auth is None:
            return None
        owner = self.tenant(record.tenant)
        if owner is None or not self.owns(record.tenant, record):
            return StreamStatus.CANCELLED, "its tenant was deleted"
        if self.auth.enabled and all(entry[1] != owner.name for entry in self.auth.directory.keys.values()):
            return StreamStatus.CANCELLED, "its tenant's keys are revoked"
        if not owner.allows_model(parse_model_ref(record.model)[0]):
            return StreamStatus.CANCELLED, "its tenant may no longer use the model"
        return None

    async def _give_up(self, record: StreamRecord, status: str, reason: str) -> None:
        log.warning("not resuming stream", stream_id=record.id, model=record.model, tenant=record.tenant,
                    reason=reason)
        try:
            await self._stored(self.store.finish(record.id, record.token_ids, record.texts, status, None))
        except StorageFailed as exc:  # it stays running: the next start judges it again
            log.error("could not store a stream's end", stream_id=record.id, error=repr(exc.__cause__))

    async def recover(self) -> int:
        """Resume the streams a crash left running, for their owners as they are now; returns how many."""
        records = await asyncio.to_thread(self.store.with_status, StreamStatus.RUNNING)
        resumed = 0
        for record in records:
            images = await asyncio.to_thread(self.store.images, record.id) if record.request.get("images") else None
            refused = self.not_resumable(record, images)
            if refused is not None:
                await self._give_up(record, *refused)
                continue
            owner = self.tenant(record.tenant)
            try:
                request = self.resume_request(record, owner, images)
                rs = self.router.submit(self.router.find(record.model), request, owner and limits_of(owner))
            except Exception as exc:  # e.g. the queue is full: it stays running for the next start
                log.warning("cannot resume stream now", stream_id=record.id, error=str(exc))
                continue
            self.start(rs, ChunkFormat.from_dict(record.request["format"]), kind=record.kind,
                       conversation_id=record.conversation_id, on_disconnect="continue", resumed=record)
            resumed += 1
        if resumed:
            log.info("resumed streams after restart", count=resumed)
        return resumed

    async def sweep(self) -> None:
        """Drop finished streams from memory after a while, and from SQLite after the retention."""
        now = time.monotonic()
        for stream_id, live in list(self.live.items()):
            if live.done and live.followers == 0 and now - live.finished_s >= self.config.memory_seconds:
                del self.live[stream_id]
        cutoff = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - self.config.stream_retention_seconds))
        await asyncio.wrap_future(self.store.delete_finished_before(cutoff))

    async def run_sweeper(self, interval_s: float = 30.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("stream sweep failed")

    async def close(self) -> None:
        await self._background.cancel_all()

