"""Exact-state tests of the token-budget scheduler: who runs, how many tokens, who is preempted."""

from engine.kv_cache import KVCacheManager
from engine.types import SequenceStatus
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests import helpers


def make_seq(num_prompt_tokens: int, **params):
    """Policy tests: prompts that share no prefix (prefix caching has its own tests)."""
    return helpers.make_seq(num_prompt_tokens, distinct=True, **params)


def make_scheduler(num_blocks=16, block_size=4, budget=16, max_seqs=4) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_seqs), KVCacheManager(num_blocks, block_size))


def advance(batch) -> None:
    """What the engine does after a step: count computed tokens, append a sample when due."""
    for item in batch.seqs:
        completes = item.completes_prefill
        item.seq.num_computed_tokens += item.num_new_tokens
        if completes:
            item.seq.token_ids.append(7)


def plan(batch) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in batch.seqs]


def test_long_prompt_is_chunked_to_the_budget():
    sched = make_scheduler(budget=8)
    seq = make_seq(20)
    sched.add(seq)
    for expected in (8, 8, 4):
        batch = sched.schedule()
        assert plan(batch) == [(seq.request_id, expected)]
        advance(batch)
    assert seq.num_output_tokens == 1
    assert plan(sched.schedule()) == [(seq.request_id, 1)]


def test_running_decodes_go_before_new_prefills():
    sched = make_scheduler(budget=10)
    a, b = make_seq(6), make_seq(12)
    sched.add(a)
    advance(sched.schedule())
    sched.add(b)
    batch = sched.schedule()
    assert plan(batch) == [(a.request_id, 1), (b.request_id, 9)]


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_seqs=2)
    seqs = [make_seq(2) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [s.seq for s in batch.seqs] == seqs[:2]
    assert sched.num_waiting == 1


def test_out_of_blocks_preempts_newest_and_requeues_it_first():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a, b = make_seq(8), make_seq(8)  # each takes 2 of the 4 blocks
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())
    assert sched.kv.num_free_blocks == 0
    # a needs a third block for its 9th token: b (newest) is preempted and requeued at the front
    batch = sched.schedule()
    assert batch.preempted == [b]
    assert plan(batch) == [(a.request_id, 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting.peek() is b
    assert b.num_output_tokens == 1  # the generated token is kept for recompute


def test_preempted_sequence_resumes_by_recomputing_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    a, b = make_seq(8), make_seq(8)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())
    advance(sched.schedule())  # b preempted
    sched.finish(a)
    batch = sched.schedule()
    assert plan(batch) == [(b.request_id, 9)]  # 8 prompt tokens + 1 generated


def test_finish_and_abort_free_blocks_from_any_state():
    sched = make_scheduler(num_blocks=4, block_size=4, max_seqs=1)
    a, b = make_seq(4), make_seq(4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b)  # still waiting
    sched.finish(a)  # running
    assert sched.kv.num_free_blocks == 4
    assert not sched.has_work()


def test_preempting_a_sequence_unschedules_those_reading_blocks_it_computes():
    """Found by the progress simulation: a high request took the block a low one was filling in
    the same step; a normal one then preempted the low one for its slot. The high one must not
    read a block nobody computes: it goes back and is admitted again, computing it itself."""
    from engine.types import GenerationRequest, Priority, SamplingParams, Sequence
    from scheduling.fair_queue import FairQueue, FairShareConfig

    def request(name: str, tokens: list[int], priority: Priority) -> Sequence:
        return Sequence(GenerationRequest(name, tokens, SamplingParams(max_tokens=4), priority=priority))

    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig(20, 2), kv, FairQueue(FairShareConfig()))
    low = request("low", list(range(1, 27)), Priority.LOW)
    sched.add(low)
    advance(sched.schedule())  # 20 of its 26 tokens: five blocks cached
    kv.cache_full_blocks(low)
    high = request("high", list(range(1, 35)), Priority.HIGH)  # shares low's prompt and its sixth block
    normal = request("normal", list(range(100, 110)), Priority.NORMAL)
    sched.add(high)
    sched.add(normal)
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["low"]
    assert sorted(plan(batch)) == [("high", 14), ("normal", 6)]  # high computes block 5 itself now
    assert all(not item.reads_from for item in batch.seqs)
    assert high.num_computed_tokens == 20 and low.status is SequenceStatus.WAITING
    assert kv.num_hit_tokens == 24 + 20  # admitted with the block in flight, then without it
