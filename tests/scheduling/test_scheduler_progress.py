"""The scheduler always makes progress: a schedule() call terminates and, while there is work
that fits, runs something. Simulated with a fake clock, random arrivals, priorities, tenants,
aging and preemption (hypothesis), plus the aging livelock found on a live server."""

from __future__ import annotations

import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache import KVCacheManager
from engine.types import GenerationRequest, Priority, SamplingParams, Sequence, SequenceStatus
from scheduling.fair_queue import FairQueue, FairShareConfig
from scheduling.scheduler import Scheduler, SchedulerConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seq(name: str, tenant: str, priority: Priority, clock: Clock, prompt: int = 4, max_tokens: int = 8) -> Sequence:
    return Sequence(GenerationRequest(name, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                                      arrival_s=clock.now, tenant=tenant, priority=priority))


def step(sched: Scheduler) -> tuple[int, list[Sequence]]:
    """One engine step on the schedule: count computed tokens, sample, finish. Returns the
    tokens it computed and the sequences that finished."""
    batch = schedule_within(sched)
    done = []
    for item in batch.seqs:
        s = item.seq
        completes = item.completes_prefill
        s.num_computed_tokens += item.num_new_tokens
        sched.kv.cache_full_blocks(s)  # as the engine does: the prompts share prefixes, so hits happen
        if completes:
            s.token_ids.append(7)
            if s.num_output_tokens >= s.params.max_tokens:
                done.append(s)
    for s in done:
        sched.finish(s)
    return batch.num_tokens, done


def schedule_within(sched: Scheduler, seconds: float = 5.0):
    """schedule() on a thread: a livelock shows up as a call that never returns."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(sched.schedule()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, "schedule() did not return: the scheduler livelocked"
    return result[0]


def test_aged_request_and_its_victim_do_not_preempt_each_other_forever():
    """The live repro: aging_seconds=2, max_num_seqs=2, three long streams of one priority
    class below... here: a low request ages into normal and preempts a running low one whose
    own wait had aged it too, so the victim went back ahead of it and was re-admitted."""
    clock = Clock()
    queue = FairQueue(FairShareConfig(aging_seconds=2), clock=clock)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2), KVCacheManager(64, 4), queue)
    streams = [seq(f"s{i}", "default", Priority.LOW, clock, max_tokens=480) for i in range(3)]
    for s in streams:
        sched.add(s)
    clock.now = 3.0  # all three have waited past aging_seconds before the first step
    for _ in range(20):
        batch = schedule_within(sched)
        assert batch.seqs, "a step with work scheduled nothing"
        for item in batch.seqs:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                item.seq.token_ids.append(7)
        clock.now += 0.5



def test_an_aged_request_takes_no_slot_by_fair_share_from_a_higher_class():
    """Found by the simulation below: one slot, a normal stream of tenant A and a low one of B.
    B's request aged into normal and took A's slot by fair share (A had more service); A, being
    of a higher class, took it back at once; step after step, and once a recompute no longer fit
    in one step's budget neither made progress. Fair share now compares the classes asked for."""
    clock = Clock()
    queue = FairQueue(FairShareConfig(aging_seconds=1.0, fair_quantum_tokens=0), clock=clock)
    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1), kv, queue)
    for i in range(5):  # A's service puts its counter ahead of B's
        sched.add(seq(f"h{i}", "A", Priority.HIGH, clock, prompt=1, max_tokens=1))
    sched.add(seq("normal", "A", Priority.NORMAL, clock, prompt=1, max_tokens=9))
    sched.add(seq("low", "B", Priority.LOW, clock, prompt=1, max_tokens=9))
    finished = []
    for _ in range(200):
        if not sched.has_work():
            break
        finished += [s.request_id for s in step(sched)[1]]
        clock.now += 1.0
    assert finished == ["h0", "h1", "h2", "h3", "h4", "normal", "low"]
    assert kv.num_free_blocks == kv.num_blocks

ARRIVAL = st.tuples(
    st.sampled_from(["A", "B", "C"]),
    st.sampled_from(list(Priority)),
    st.integers(1, 40),  # prompt tokens
    st.integers(1, 24),  # max tokens
    st.floats(0.0, 3.0),  # seconds after the previous arrival
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(ARRIVAL, min_size=1, max_size=30),
    max_num_seqs=st.integers(1, 4),
    num_blocks=st.integers(16, 40),
    budget=st.integers(8, 64),
    aging=st.floats(0.5, 5.0),
    quantum=st.integers(0, 8),
    step_seconds=st.floats(0.05, 1.0),
)
def test_every_step_makes_progress_and_everything_finishes(
    arrivals, max_num_seqs, num_blocks, budget, aging, quantum, step_seconds
):
    block_size = 4  # 16+ blocks of 4 hold any one sequence (40 + 24 tokens)
    clock = Clock()
    queue = FairQueue(FairShareConfig(aging_seconds=aging, fair_quantum_tokens=quantum), clock=clock)
    kv = KVCacheManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(budget, max_num_seqs), kv, queue)
    pending = list(enumerate(arrivals))
    next_arrival = 0.0
    finished = 0
    for _ in range(5000):
        while pending and next_arrival <= clock.now:
            i, (tenant, priority, prompt, max_tokens, gap) = pending.pop(0)
            sched.add(seq(f"r{i}", tenant, priority, clock, prompt, max_tokens))
            next_arrival = clock.now + gap
        if not pending and not sched.has_work():
            break
        if sched.has_work():
            num_tokens, done = step(sched)
            finished += len(done)
            assert num_tokens > 0, "a step with work computed nothing"
            assert all(s.status is SequenceStatus.RUNNING for s in sched.running)
            assert len(sched.running) <= max_num_seqs
            assert_holders_match_ref_counts(sched)
        clock.now += step_seconds
    assert finished == len(arrivals), "requests starved"
    assert kv.num_free_blocks == kv.num_blocks


def assert_holders_match_ref_counts(sched: Scheduler) -> None:
    """No block is freed while a sequence holds it, and none is held by nobody (prefix sharing)."""
    holders = [0] * sched.kv.num_blocks
    for s in sched.running:
        for block in s.block_table:
            holders[block] += 1
    assert holders == [sched.kv.pool.ref_count(b) for b in range(sched.kv.num_blocks)]
    assert sched.kv.num_free_blocks == holders.count(0)


def test_real_engine_with_instant_aging_finishes_every_stream(tiny_models):
    """The live repro on the real engine: aging_seconds=0 promotes every waiting request at once
    (the default 30 s, just sooner); two slots, three long low-priority streams of one tenant."""
    from engine.types import GenerationRequest, SamplingParams
    from tests.helpers import assert_all_blocks_free, make_engine

    engine = make_engine(tiny_models["llama"], num_blocks=256, max_num_seqs=2, policy="fair",
                         fair_share=FairShareConfig(aging_seconds=0.0))
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(GenerationRequest(f"s{i}", [5 + i, 6, 7, 8], params, priority=Priority.LOW))
    tokens = {f"s{i}": 0 for i in range(3)}
    done = threading.Event()

    def run() -> None:
        while engine.has_work():
            for event in engine.step():
                tokens[event.request_id] += len(event.token_ids)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(60), f"engine stopped making progress: {tokens}"
    assert tokens == {f"s{i}": 120 for i in range(3)}
    assert_all_blocks_free(engine.scheduler.kv)
