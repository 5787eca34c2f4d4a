"""One model replica's step loop: schedule -> run -> sample -> update -> events (-> drafts).

Called only from its DeviceWorker thread. The scheduler is passed in (engine/ never imports
scheduling/); it owns who runs, this class owns what a step means for each request.
"""

from __future__ import annotations

import bisect
import sys
import time
from typing import Any, NamedTuple, Protocol

import structlog
import torch
from transformers import PreTrainedTokenizerBase

from engine.detokenizer import TextStream
from engine.device_memory import DeviceMemory
from engine.guided import GuidedDecoding
from engine.kv_cache import KVCacheManager
from engine.lora import PeftAdapter
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.speculative import NgramProposer, Proposer, SpeculativeConfig
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
    def charge_accepted(self, seq: Sequence, num_tokens: int) -> None: ...
    def finish(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


class Sampled(NamedTuple):
    """One scheduled item's samples: one per logits row."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


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
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,  # drafts other than n-gram (a draft model: `engine.draft_model`)
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampler = Sampler(runner.device, seed, eos_token_ids)
        self.guided = GuidedDecoding(tokenizer, runner.model.shape.vocab_size, eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.speculative = speculative or SpeculativeConfig()
        self.proposer = proposer or (NgramProposer(self.speculative, max_model_len)
                                     if self.speculative.method == "ngram" else None)
        self.proposing: list[ScheduledSeq] = []  # sampled in the last step: drafted at the start of the next
        self.num_draft_tokens = 0  # speculative drafts verified
        self.num_accepted_tokens = 0  # of those, the ones the model agreed with
        self.num_steps = 0
        self.num_batched_tokens = 0
        self.num_step_errors = 0  # steps in which something raised (only the requests it hit failed)
        self.batch_token_counts = [0] * (len(BATCH_TOKEN_BOUNDS) + 1)
        self.memory = DeviceMemory(runner, self.proposer)
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
            num_graph_steps=self.runner.graphs.replays if self.runner.graphs is not None else 0,
            waiting_by_class=self.scheduler.waiting.depth_by_class(),
            batch_token_counts=tuple(self.batch_token_counts),
            weights_bytes=self.memory.weights_bytes + sum(self.memory.adapter_bytes.values()),
            kv_cache_bytes=self.memory.kv_cache_bytes,
            device_memory_used_bytes=self.memory.used_bytes(),
            device_memory_total_bytes=self.memory.total_bytes,
            prefix_cache_query_tokens=kv.num_query_tokens,
            prefix_cache_hit_tokens=kv.num_hit_tokens,
            prefix_cache_blocks=kv.pool.num_cached_blocks,
            spec_num_draft_tokens=self.num_draft_tokens,
            spec_num_accepted_tokens=self.num_accepted_tokens,
        )

    def add_adapter(self, name: str, adapter: PeftAdapter) -> None:
        """Serve a LoRA adapter over this engine's weights to requests that name it (`GenerationRequest.adapter`)."""
        loaded = self.runner.add_adapter(name, adapter)
        self.memory.adapter_bytes[name] = loaded.num_bytes
        log.info("adapter loaded", adapter=name, modules=len(loaded.weights), bytes=loaded.num_bytes)

    def remove_adapter(self, name: str) -> list[TokenEvent]:
        """Drop an adapter; requests still naming it (there should be none: its version drained) end with an error."""
        events = [self._fail(state.seq, "its adapter was unloaded") for state in list(self.requests.values())
                  if state.seq.adapter == name]
        self.runner.remove_adapter(name)
        self.memory.adapter_bytes.pop(name, None)
        return events

    def add_request(self, request: GenerationRequest) -> None:
        if request.adapter and request.adapter not in self.runner.adapters:
            raise KeyError(f"adapter {request.adapter!r} is not loaded on this engine")
        seq = Sequence(request)
        spans_of = getattr(self.runner.model, "bidirectional_spans", None)  # a vision-language model's
        if request.images is not None and spans_of is not None:  # where its prompt's tokens see each other both ways
            seq.bidirectional_spans = spans_of(seq.token_ids[:seq.num_prompt_tokens])
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
        self._propose()
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
            sampled, logits = self.runner.execute(batch)
        except Exception:
            self.num_step_errors += 1
            if len(batch.seqs) == 1:
                return [self._fail(batch.seqs[0].seq, "forward failed")]
            # one sequence's input can fail the packed forward: find it by running each alone
            log.exception("engine step failed; retrying its sequences one by one", num_seqs=len(batch.seqs))
            return self._run_each_alone(batch)
        return self._sample_and_append(batch, sampled, logits)

    def _run_each_alone(self, batch: ScheduledBatch) -> list[TokenEvent]:
        """In batch order, so a sequence reading blocks another computes this step runs after it;
        if that one failed, its blocks hold nothing and the reader goes back to the queue."""
        events: list[TokenEvent] = []
        lost: set[int] = set()
        for item in batch.seqs:
            if any(id(source) in lost for source in item.reads_from):
                self.scheduler.requeue(item.seq)
                lost.add(id(item.seq))
                continue
            try:
                sampled, logits = self.runner.execute(ScheduledBatch([item]))
            except Exception:
                events.append(self._fail(item.seq, "forward failed"))
                lost.add(id(item.seq))
                continue
            events.extend(self._sample_and_append(ScheduledBatch([item]), sampled, logits))
        return events

    def _sample_and_append(self, batch: ScheduledBatch, sampled: list[ScheduledSeq],
                           logits: torch.Tensor) -> list[TokenEvent]:
        """Sample the batch in one go; if that raises, item by item, so only the items that fail do."""
        try:
            results: list[Sampled | None] = list(self._sample(logits, sampled))
        except Exception:
            self.num_step_errors += 1
            log.exception("batched sampling failed; sampling item by item", num_seqs=len(sampled))
            results = self._sample_each(logits, sampled)
        by_item = {id(item): result for item, result in zip(sampled, results)}
        events = []
        for item in batch.seqs:
            if id(item) in by_item and by_item[id(item)] is None:
                events.append(self._fail(item.seq, "sampling failed"))
            else:
                events.extend(self._advance(item, by_item.get(id(item))))
        if self.proposer is not None:
            self.proposing.extend(sampled)
        return events

    def _sample(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[Sampled]:
        """Each item's tokens and logprobs, one per logits row (its last token's, then its drafts')."""
        seqs = [item.seq for item in items for _ in range(item.num_logits)]
        offsets = [offset for item in items for offset in range(item.num_logits)]
        tokens, logprobs = self.sampler.sample(logits, seqs, self.guided.mask(seqs), offsets)
        results, row = [], 0
        for item in items:
            results.append(Sampled(tokens[row : row + item.num_logits], logprobs[row : row + item.num_logits]))
            row += item.num_logits
        return results

    def _sample_each(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[Sampled | None]:
        results: list[Sampled | None] = []
        row = 0
        for item in items:
            try:
                results.append(self._sample(logits[row : row + item.num_logits], [item])[0])
            except Exception:
                log.exception("sampling failed", request_id=item.seq.request_id)
                results.append(None)
            row += item.num_logits
        return results

    def _advance(self, item: ScheduledSeq, sampled: Sampled | None) -> list[TokenEvent]:
        """Count the KV this step wrote, make its full blocks findable, and append what it sampled.

        With drafts: the model's own tokens up to and including the first that differs from its
        draft (the correction; the bonus token if all were right). A draft's KV counts once the
        token it guessed is appended, so the prefix cache only ever hashes real tokens."""
        seq = item.seq
        seq.num_computed_tokens += item.num_known_tokens
        self.scheduler.kv.cache_full_blocks(seq)
        if sampled is None:
            return []
        drafts = item.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == sampled.token_ids[accepted]:
            accepted += 1
        if drafts:
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            self.scheduler.charge_accepted(seq, accepted)
        events = []
        for i in range(accepted + 1):
            if i:
                seq.num_computed_tokens += 1
                self.scheduler.kv.cache_full_blocks(seq)
            events.append(self._append_or_fail(seq, sampled.token_ids[i], sampled.logprobs[i]))
            if events[-1].finished:
                break
        return events

    def _propose(self) -> None:
        """Drafts for this step of the sequences that sampled in the last one (made here, not at the
        end of that step, so its tokens went out before a draft model's forwards), unless the batch
        is too big for them to pay (a compute-bound step costs as much more as the tokens it runs)."""
        if self.proposer is None:
            return
        items, self.proposing = self.proposing, []
        for item in items:
            item.seq.draft_token_ids = []
        if self.scheduler.num_running <= self.speculative.disable_by_batch_size:
            live = [item.seq for item in items if item.seq.request_id in self.requests]
            for seq, drafts in zip(live, self.proposer.propose(live) if live else []):
                seq.draft_token_ids = drafts

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
