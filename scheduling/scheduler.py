"""Per-step scheduling policy: who runs this step and with how many tokens. Torch-free.

One token budget per step, no separate prefill and decode phases (the vLLM v1 idea):
running sequences go first (a decode costs one token, an unfinished prefill takes what the
budget leaves), then waiting sequences in queue order, chunked to fit the budget. When the
KV pool runs dry the newest running sequence is preempted: its blocks are freed and it goes
back to the front of the queue with its generated tokens, to be recomputed later. Which
sequence is preempted, and whether a waiting one may preempt a running one to get in, is
the queue's policy (FIFO never does; the fair queue does for priority and fair share).
A sequence admitted first takes the cached blocks of its prompt's longest cached prefix
(automatic prefix caching, `engine.kv_cache`), continued by blocks that sequences scheduled
before it compute in this same step, and prefills only the rest: a burst of requests sharing a
system prompt fills one step, not one for the first and the next for the others. Such a
sequence reads what its sources compute, so if one of them is preempted while the step is
planned, it goes back to the queue too (to be admitted again, computing those blocks
itself). A decode with speculative drafts (`engine.speculative`) runs them too, as far as
budget and free blocks allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.prefix_hash import BlockHash
from engine.types import ScheduledBatch, ScheduledSeq, Sequence, SequenceStatus
from scheduling.queue import FifoQueue, WaitingQueue


@dataclass
class InFlight:
    """The full blocks this step's sequences compute, which a sequence admitted after them in the
    same step may take as part of its cached prefix."""

    blocks: dict[BlockHash, int] = field(default_factory=dict)  # hash -> block id
    computer: dict[int, Sequence] = field(default_factory=dict)  # block id -> the sequence computing it

    def add(self, kv: KVCacheManager, seq: Sequence, num_new: int) -> None:
        """`seq`'s blocks that its next `num_new` tokens fill (block ids already allocated)."""
        first = seq.num_computed_tokens // kv.block_size
        for index, block_hash in enumerate(kv.pending_block_hashes(seq, num_new), start=first):
            if block_hash not in self.blocks:
                self.blocks[block_hash] = seq.block_table[index]
                self.computer[seq.block_table[index]] = seq

    def computers(self, seq: Sequence) -> list[Sequence]:
        """The sequences computing blocks `seq` holds."""
        found = {id(c): c for block_id in seq.block_table if (c := self.computer.get(block_id)) is not None}
        return list(found.values())


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
        self.kv.evict_idle()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        for item in batch.seqs:
            self._charge(item)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = seq.chunk_len(budget)
            while not self.kv.can_allocate(seq, num_new):
                victim = self.waiting.pick_victim(self.running)
                budget += self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                drafts = self._drafts(seq, budget)
                self.kv.allocate(seq, num_new + len(drafts))
                batch.seqs.append(ScheduledSeq(seq, num_new + len(drafts), drafts))
                budget -= num_new + len(drafts)
        return budget

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The speculative drafts a decode verifies this step: what the budget leaves, and only if
        their slots are free (a guess never preempts anyone)."""
        if seq.num_uncomputed_tokens != 1 or not seq.draft_token_ids:
            return []
        drafts = seq.draft_token_ids[: budget - 1]
        return drafts if self.kv.can_allocate(seq, 1 + len(drafts)) else []

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit in queue order, each sequence first taking its cached prefix. Terminates by
        construction: each pass admits a sequence or preempts one, a sequence preempted in this
        call is not admitted again in it, and one admitted again was unscheduled by a preemption."""
        in_flight = self._in_flight(batch) if len(self.waiting) else InFlight()
        while budget > 0:
            seq = self.waiting.peek()
            if seq is None or seq in batch.preempted:
                return
            self.kv.reuse_prefix(seq, in_flight.blocks)
            num_new = seq.chunk_len(budget)
            if len(self.running) >= self.config.max_num_seqs or not self.kv.can_allocate(seq, num_new):
                if not self._preempt_to_admit(seq, num_new, batch):
                    self.kv.free(seq)
                    return
                self.kv.free(seq)  # a victim may have been computing part of its prefix: look again
                budget = self.config.max_num_batched_tokens - batch.num_tokens
                in_flight = self._in_flight(batch)
                continue
            self.waiting.pop()
            self.kv.count_lookup(seq)
            reads_from = in_flight.computers(seq)
            self.kv.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            seq.num_output_at_admission = seq.num_output_tokens
            self.running.append(seq)
            batch.seqs.append(ScheduledSeq(seq, num_new, reads_from=reads_from))
            in_flight.add(self.kv, seq, num_new)
            budget -= num_new

    def _in_flight(self, batch: ScheduledBatch) -> InFlight:
        in_flight = InFlight()
        for item in batch.seqs:
            in_flight.add(self.kv, item.seq, item.num_known_tokens)
        return in_flight

    def _preempt_to_admit(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt what the queue's policy allows until `seq` fits; False if it still does not."""
        while len(self.running) >= self.config.max_num_seqs or not self.kv.can_allocate(seq, num_new):
            victim = self.waiting.preempt_for(seq, self.running)
            if victim is None:
                return False
            self._preempt(victim, batch)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Free `seq` and requeue it at the front (with its readers, `_unschedule`); returns the
        budget they held in this batch."""
        returned = self._unschedule(seq, batch)
        self.num_preemptions += 1
        batch.preempted.append(seq)
        return returned

    def _unschedule(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Take `seq` out of this batch and back to the queue, and with it the sequences admitted
        after it to read blocks it was to compute (they may be admitted again in this call, to
        compute those themselves); returns the budget they held."""
        returned = 0
        for item in batch.seqs:
            if item.seq is seq:
                batch.seqs.remove(item)
                returned = item.num_new_tokens
                break
        self.requeue(seq)
        for item in [item for item in batch.seqs if seq in item.reads_from]:
            returned += self._unschedule(item.seq, batch)
        return returned

    def requeue(self, seq: Sequence) -> None:
        """Put a running sequence back at the front of the queue, its blocks freed: it will be
        recomputed from its tokens (after a preemption, or when a step it depended on failed)."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.push_front(seq)

    def _charge(self, item: ScheduledSeq) -> None:
        """Service this step gives the tenant: prompt tokens prefilled for the first time and
        the token it samples. Recomputing after a preemption is the server's cost, not theirs,
        and a prefix found cached costs nobody anything."""
        seq = item.seq
        end = min(seq.num_computed_tokens + item.num_known_tokens, seq.num_prompt_tokens)
        num_prompt = max(0, end - max(seq.num_computed_tokens, seq.num_prompt_tokens_charged))
        seq.num_prompt_tokens_charged = max(seq.num_prompt_tokens_charged, end)
        self.waiting.charge(seq, num_prompt, 1 if item.completes_prefill else 0)

    def charge_accepted(self, seq: Sequence, num_tokens: int) -> None:
        """Drafts the model accepted are tokens served like the one each step samples."""
        self.waiting.charge(seq, 0, num_tokens)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that is done (or aborted), wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.waiting.on_finish(seq)
