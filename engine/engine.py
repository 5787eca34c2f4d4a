"""One model replica's step loop: schedule -> run -> sample -> update -> events.

Called only from its DeviceWorker thread. The scheduler is passed in (engine/ never imports
scheduling/); it owns who runs, this class owns what a step means for each request.
"""

from __future__ import annotations

import bisect
import sys
import time
from typing import Any, Protocol

import structlog
import torch
from transformers import PreTrainedTokenizerBase

from engine.detokenizer import TextStream
from engine.guided import GuidedDecoding
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.types import (
    BATCH_TOKEN_BOUNDS,
    GENERATION_FAILED,
    EngineStats,
    FinishReason,
    GenerationRequest,
    ScheduledBatch,
    ScheduledSeq,
    Sequence,
    TokenEvent,
    TokenLogprob,
)

log = structlog.get_logger(__name__)


class StepScheduler(Protocol):
    kv: KVCacheManager
    waiting: Any  # a scheduling.queue.WaitingQueue; only depth_by_class() is read here
    num_preemptions: int

    def add(self, seq: Sequence) -> None: ...
    def schedule(self) -> ScheduledBatch: ...
    def finish(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


class RequestState:
    def __init__(self, seq: Sequence, text: TextStream) -> None:
        self.seq = seq
        self.text = text


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: StepScheduler,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        seed: int = 0,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampler = Sampler(runner.device, seed, eos_token_ids)
        self.guided = GuidedDecoding(tokenizer, runner.model.shape.vocab_size, eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.num_steps = 0
        self.num_batched_tokens = 0
        self.num_step_errors = 0  # steps in which something raised (only the requests it hit failed)
        self.batch_token_counts = [0] * (len(BATCH_TOKEN_BOUNDS) + 1)
        self.memory = DeviceMemory(runner)
        self.last_stats = self.stats()

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def refresh_stats(self) -> None:
        """Snapshot the numbers metrics read from other threads (called by the worker thread)."""
        self.last_stats = self.stats()

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_batched_tokens=self.num_batched_tokens,
            num_step_errors=self.num_step_errors,
            waiting_by_class=self.scheduler.waiting.depth_by_class(),
            batch_token_counts=tuple(self.batch_token_counts),
            weights_bytes=self.memory.weights_bytes,
            kv_cache_bytes=self.memory.kv_cache_bytes,
            device_memory_used_bytes=self.memory.used_bytes(),
            device_memory_total_bytes=self.memory.total_bytes,
            prefix_cache_query_tokens=kv.num_query_tokens,
            prefix_cache_hit_tokens=kv.num_hit_tokens,
            prefix_cache_blocks=kv.pool.num_cached_blocks,
        )

    def add_request(self, request: GenerationRequest) -> None:
        seq = Sequence(request)
        if request.params.guided is not None:
            self.guided.add(request.request_id, request.params.guided, request.resume_token_ids)
        text = TextStream.for_params(self.tokenizer, request.params)
        for token_id in request.resume_token_ids:  # already sent before a restart: rebuild the state only
            text.add_token(token_id)
        self.requests[request.request_id] = RequestState(seq, text)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        self.guided.remove(request_id)
        if state is None:
            return False
        self.scheduler.finish(state.seq)
        return True

    def step(self) -> list[TokenEvent]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        self.num_steps += 1
        self.num_batched_tokens += batch.num_tokens
        self.batch_token_counts[bisect.bisect_left(BATCH_TOKEN_BOUNDS, batch.num_tokens)] += 1
        now = time.monotonic()
        for item in batch.seqs:
            if item.seq.first_scheduled_s is None:  # first admission: what it computed so far came from the cache
                item.seq.first_scheduled_s = now
                item.seq.num_cached_tokens = min(item.seq.num_computed_tokens, item.seq.num_prompt_tokens)
        try:
            sample_seqs, logits = self.runner.execute(batch)
        except Exception:
            self.num_step_errors += 1
            if len(batch.seqs) == 1:
                return [self._fail(batch.seqs[0].seq, "forward failed")]
            # one sequence's input can fail the packed forward: find it by running each alone
            log.exception("engine step failed; retrying its sequences one by one", num_seqs=len(batch.seqs))
            return [event for item in batch.seqs for event in self._run_alone(item)]
        return self._sample_and_append(batch, sample_seqs, logits)

    def _run_alone(self, item: ScheduledSeq) -> list[TokenEvent]:
        try:
            sample_seqs, logits = self.runner.execute(ScheduledBatch([item]))
        except Exception:
            return [self._fail(item.seq, "forward failed")]
        return self._sample_and_append(ScheduledBatch([item]), sample_seqs, logits)

    def _sample_and_append(self, batch: ScheduledBatch, sample_seqs: list[Sequence],
                           logits: torch.Tensor) -> list[TokenEvent]:
        """Sample the batch in one go; if that raises, row by row, so only the rows that fail do."""
        try:
            tokens, logprobs = self.sampler.sample(logits, sample_seqs, self.guided.mask(sample_seqs))
        except Exception:
            return self._sample_rows(batch, sample_seqs, logits)
        for item in batch.seqs:
            self._computed(item)
        return [self._append_or_fail(seq, t, lp) for seq, t, lp in zip(sample_seqs, tokens, logprobs)]

    def _computed(self, item: ScheduledSeq) -> None:
        """The step wrote this item's KV: count it, and make its full blocks findable."""
        item.seq.num_computed_tokens += item.num_new_tokens
        self.scheduler.kv.cache_full_blocks(item.seq)

    def _sample_rows(self, batch: ScheduledBatch, sample_seqs: list[Sequence],
                     logits: torch.Tensor) -> list[TokenEvent]:
        self.num_step_errors += 1
        log.exception("batched sampling failed; sampling row by row", num_seqs=len(sample_seqs))
        sampled = [self._sample_row(logits[row : row + 1], seq) for row, seq in enumerate(sample_seqs)]
        failed = {seq.request_id for seq, result in zip(sample_seqs, sampled) if result is None}
        events = [self._fail(item.seq, "sampling failed") for item in batch.seqs if item.seq.request_id in failed]
        for item in batch.seqs:
            if item.seq.request_id not in failed:
                self._computed(item)
        for seq, result in zip(sample_seqs, sampled):
            if result is not None:
                events.append(self._append_or_fail(seq, *result))
        return events

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprob | None] | None:
        try:
            tokens, logprobs = self.sampler.sample(logits, [seq], self.guided.mask([seq]))
        except Exception:
            log.exception("sampling failed", request_id=seq.request_id)
            return None
        return tokens[0], logprobs[0]

    def _append_or_fail(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> TokenEvent:
        try:
            return self._append_token(seq, token_id, logprob)
        except Exception:
            return self._fail(seq, "appending a token failed")

    def _append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> TokenEvent:
        state = self.requests[seq.request_id]
        params = seq.params
        seq.token_ids.append(token_id)
        finish = None
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            finish = FinishReason.STOP
            text = state.text.finish(token_id if params.include_stop_str_in_output else None)
        else:
            text, hit_stop = state.text.add_token(token_id)
            if hit_stop:
                finish = FinishReason.STOP
            elif self.guided.advance(seq, token_id):  # the grammar is complete: nothing may follow
                finish = FinishReason.STOP
                text += state.text.finish()
        if finish is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            finish = FinishReason.LENGTH
            text += state.text.finish()
        if finish is not None:
            self._release(seq)
        return TokenEvent(
            request_id=seq.request_id,
            text=text,
            token_ids=[token_id],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            logprobs=[logprob] if logprob is not None else None,
            finish_reason=finish,
            scheduled_s=seq.first_scheduled_s,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def fail_all(self) -> list[TokenEvent]:
        """End every unfinished request with an error: the worker's answer to a failure outside
        the step's own guards (the scheduler's state may be what broke, so releasing is best effort)."""
        self.num_step_errors += 1
        events = []
        for state in list(self.requests.values()):
            self.requests.pop(state.seq.request_id, None)
            self.guided.remove(state.seq.request_id)
            try:
                self.scheduler.finish(state.seq)
            except Exception:
                log.exception("could not release a failed request", request_id=state.seq.request_id)
            events.append(self._error_event(state.seq))
        return events

    def _fail(self, seq: Sequence, what: str) -> TokenEvent:
        """End one request with an error. The exception goes to the log with the request id; the
        client gets `GENERATION_FAILED` only (exception text can hold paths, shapes, other inputs)."""
        log.error("generation failed", request_id=seq.request_id, what=what, exc_info=sys.exc_info()[0] is not None)
        self._release(seq)
        return self._error_event(seq)

    @staticmethod
    def _error_event(seq: Sequence) -> TokenEvent:
        return TokenEvent(
            request_id=seq.request_id,
            text="",
            token_ids=[],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            finish_reason=FinishReason.ERROR,
            error=GENERATION_FAILED,
            scheduled_s=seq.first_scheduled_s,
            num_preemptions=seq.num_preemptions,
        )

    def _release(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self.guided.remove(seq.request_id)
        self.scheduler.finish(seq)


class DeviceMemory:
    """Memory figures of one replica for the admin page and the device gauges (CUDA only for the latter)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.device = runner.device
        self.weights_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
        self.kv_cache_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                  for k, v in runner.kv_caches)
        self.total_bytes = (torch.cuda.get_device_properties(self.device).total_memory
                            if self.device.type == "cuda" else None)

    def used_bytes(self) -> int | None:
        """torch's allocated bytes on the device (a counter read: no sync); None off CUDA."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
