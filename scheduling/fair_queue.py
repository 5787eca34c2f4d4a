"""Priority classes with aging, and weighted fair share between tenants within a class.

Fair share follows the virtual token counter of "Fairness in Serving Large Language Models"
(Sheng et al., OSDI'24): each tenant's counter grows by the service it receives,
`(w_in * prompt_tokens + w_out * generated_tokens) / weight`; the next admission goes to the
backlogged tenant with the least counter, and a tenant returning from idle is lifted to the
least counter of the active tenants so it cannot bank credit. The same order picks
preemption victims (lowest priority, then most over-served tenant, then newest), and a
waiting request of an under-served tenant may preempt an over-served tenant's sequence
once that sequence has decoded `fair_quantum_tokens` since it was admitted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.types import Priority, Sequence


@dataclass(frozen=True)
class FairShareConfig:
    w_in: float = 1.0  # cost of a prompt (prefill) token
    w_out: float = 2.0  # cost of a generated token
    aging_seconds: float = 30.0  # waiting longer promotes a request one class
    fair_quantum_tokens: int = 32  # tokens a sequence keeps before fair-share preemption


class FairQueue:
    """Invariant: `_waiting[(tenant, priority)]` holds those waiting sequences in arrival order."""

    def __init__(self, config: FairShareConfig = FairShareConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._waiting: dict[tuple[str, Priority], deque[Sequence]] = {}
        self.counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # unfinished sequences per tenant, waiting or running
        self._len = 0

    # -- the WaitingQueue protocol ----------------------------------------------------------

    def push(self, seq: Sequence) -> None:
        if not self._active.get(seq.tenant):
            self._lift_returning_tenant(seq.tenant)
        self._active[seq.tenant] = self._active.get(seq.tenant, 0) + 1
        seq.enqueued_s = self.clock()
        self._line(seq).append(seq)
        self._len += 1

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first in its tenant's line, keeping its place in time."""
        seq.enqueued_s = min(seq.enqueued_s, self.clock())
        self._line(seq).appendleft(seq)
        self._len += 1

    def peek(self) -> Sequence | None:
        heads = [q[0] for q in self._waiting.values() if q]
        return min(heads, key=self._admission_key) if heads else None

    def pop(self) -> Sequence:
        seq = self.peek()
        assert seq is not None, "pop from an empty queue"
        self._line(seq).popleft()
        self._len -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        self._line(seq).remove(seq)
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        for queue in list(self._waiting.values()):
            yield from queue

    # -- accounting and preemption policy -----------------------------------------------------

    def charge(self, seq: Sequence, num_prompt_tokens: int, num_output_tokens: int) -> None:
        cost = self.config.w_in * num_prompt_tokens + self.config.w_out * num_output_tokens
        self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + cost / seq.weight

    def on_finish(self, seq: Sequence) -> None:
        self._active[seq.tenant] -= 1
        if not self._active[seq.tenant]:
            del self._active[seq.tenant]
            for key in [k for k, line in self._waiting.items() if k[0] == seq.tenant and not line]:
                del self._waiting[key]

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        return max(running, key=self._victim_key)

    def preempt_for(self, waiting: Sequence, running: list[Sequence]) -> Sequence | None:
        """Preempt a lower-class sequence at once, or an over-served tenant's after its quantum.

        Classes compare by the waiting request's own class, not its aged one: aging orders the
        queue but grants no preemption, since a peer preempted by an aged request would itself
        have aged and go back ahead of it (the livelock of issue 11). A victim requeues with its
        wait restarted, so it never outranks the request it made room for."""
        my_counter = self.counters.get(waiting.tenant, 0.0)

        def eligible(seq: Sequence) -> bool:
            if seq.priority > waiting.priority:
                return True
            decoded = seq.num_output_tokens - seq.num_output_at_admission
            return (
                seq.priority == waiting.priority  # not the aged class: an aged low request taking a normal
                # one's slot by fair share would be taken back at once by class, step after step
                and seq.tenant != waiting.tenant
                and self.counters.get(seq.tenant, 0.0) > my_counter
                and decoded >= self.config.fair_quantum_tokens
            )

        candidates = [seq for seq in running if eligible(seq)]
        if not candidates:
            return None
        victim = max(candidates, key=self._victim_key)
        victim.enqueued_s = self.clock()  # its wait starts over when it is requeued (push_front keeps it)
        return victim

    def effective_priority(self, seq: Sequence) -> Priority:
        """One class up after waiting `aging_seconds`, so low never starves forever."""
        if seq.priority > Priority.HIGH and self.clock() - seq.enqueued_s >= self.config.aging_seconds:
            return Priority(seq.priority - 1)
        return seq.priority

    def depth_by_class(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for seq in self:
            key = (seq.priority.name.lower(), seq.tenant)
            counts[key] = counts.get(key, 0) + 1
        return counts

    # -- helpers ------------------------------------------------------------------------------

    def _line(self, seq: Sequence) -> deque[Sequence]:
        return self._waiting.setdefault((seq.tenant, seq.priority), deque())

    def _admission_key(self, seq: Sequence) -> tuple:
        return (self.effective_priority(seq), self.counters.get(seq.tenant, 0.0), seq.enqueued_s)

    def _victim_key(self, seq: Sequence) -> tuple:
        return (seq.priority, self.counters.get(seq.tenant, 0.0), seq.arrival_s)

    def _lift_returning_tenant(self, tenant: str) -> None:
        active = [self.counters.get(t, 0.0) for t in self._active if self._active[t]]
        if active:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(active))
