"""Per-step scheduling policy: who runs this step and with how many tokens. Torch-free.

One token budget per step, no separate prefill and decode phases (the vLLM v1 idea):
running sequences go first (a decode costs one token, an unfinished prefill takes what the
budget leaves), then waiting sequences in queue order, chunked to fit the budget. When the
KV pool runs dry the newest running sequence is preempted: its blocks are freed and it goes
back to the front of the queue with its generated tokens, to be recomputed later.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache import KVCacheManager
from engine.types import ScheduledBatch, ScheduledSeq, Sequence, SequenceStatus
from scheduling.queue import FifoQueue, WaitingQueue


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64


class Scheduler:
    """Invariant: every sequence is in exactly one of `running` (admission order) or `waiting`."""

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, waiting: WaitingQueue | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.waiting: WaitingQueue = waiting if waiting is not None else FifoQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(seqs=[])
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_new, batch):
                break  # `seq` itself was preempted; everything after it is gone too
            self.kv.allocate(seq, num_new)
            batch.seqs.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running sequences until `seq` fits; False if `seq` was one."""
        while not self.kv.can_allocate(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                return
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.can_allocate(seq, num_new):
                return
            self.waiting.pop()
            self.kv.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that is done (or aborted), wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
