"""Exact-state tests of the fair queue, token buckets and admission (fake clocks, no timing)."""

from __future__ import annotations

import pytest

from engine.types import GenerationRequest, Priority, SamplingParams, Sequence
from scheduling.fair_queue import FairQueue, FairShareConfig
from scheduling.limiter import Rejected, TenantLimiter, TenantLimits
from scheduling.limits import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seq(name: str, tenant: str, priority: Priority = Priority.NORMAL, weight: float = 1.0, t: float = 0.0) -> Sequence:
    return Sequence(GenerationRequest(name, [1, 2, 3], SamplingParams(max_tokens=4), arrival_s=t,
                                      tenant=tenant, priority=priority, weight=weight))


def drain(queue: FairQueue) -> list[str]:
    return [queue.pop().request_id for _ in range(len(queue))]


def test_least_served_tenant_goes_next_fifo_within_a_tenant():
    q = FairQueue(clock=Clock())
    for s in [seq("a1", "A"), seq("a2", "A"), seq("b1", "B")]:
        q.push(s)
    q.counters.update(A=10.0, B=5.0)
    assert drain(q) == ["b1", "a1", "a2"]


def test_charge_is_weighted_service():
    q = FairQueue(FairShareConfig(w_in=1.0, w_out=2.0))
    a, b = seq("a", "A", weight=3.0), seq("b", "B")
    q.charge(a, num_prompt_tokens=30, num_output_tokens=15)
    q.charge(b, num_prompt_tokens=10, num_output_tokens=5)
    assert q.counters == {"A": 20.0, "B": 20.0}


def test_returning_tenant_is_lifted_to_the_least_active_counter():
    q = FairQueue(clock=Clock())
    a = seq("a", "A")
    q.push(a)
    q.counters.update(A=100.0, B=3.0)  # B was served long ago and went idle
    q.push(seq("b", "B"))
    assert q.counters["B"] == 100.0  # no banked credit
    assert drain(q) == ["a", "b"]  # equal counters: earlier arrival first


def test_priority_is_strict_and_aging_promotes_one_class():
    clock = Clock()
    q = FairQueue(FairShareConfig(aging_seconds=10), clock=clock)
    q.push(seq("low", "A", Priority.LOW))
    clock.now = 5
    q.push(seq("normal", "B", Priority.NORMAL))
    q.counters.update(A=0.0, B=50.0)  # fair share would favour A; priority wins
    assert q.peek().request_id == "normal"
    clock.now = 12  # "low" waited 12 s > 10: now normal, and A is less served ("normal" waited only 7 s)
    assert q.peek().request_id == "low"


def test_victims_lowest_priority_then_most_served_then_newest():
    q = FairQueue(clock=Clock())
    running = [seq("a_old", "A", t=1), seq("a_new", "A", t=2), seq("b", "B", t=3), seq("c_low", "C", Priority.LOW)]
    q.counters.update(A=50.0, B=10.0, C=0.0)
    assert q.pick_victim(running).request_id == "c_low"
    assert q.pick_victim(running[:3]).request_id == "a_new"


def test_preempt_for_waits_for_the_quantum_then_takes_the_over_served():
    q = FairQueue(FairShareConfig(fair_quantum_tokens=4), clock=Clock())
    a = seq("a", "A")
    b = seq("b", "B")
    q.counters.update(A=40.0, B=10.0)
    a.token_ids += [7, 7, 7]  # decoded 3 since admission
    assert q.preempt_for(b, [a]) is None
    a.token_ids += [7]
    assert q.preempt_for(b, [a]) is a
    q.counters["B"] = 50.0  # B is now the over-served one: no preemption for it
    assert q.preempt_for(b, [a]) is None
    high = seq("h", "B", Priority.HIGH)
    assert q.preempt_for(high, [seq("l", "A", Priority.LOW)]).request_id == "l"  # lower class: at once


def test_token_bucket_refills_with_the_clock_and_settles_debt():
    clock = Clock()
    bucket = TokenBucket(60, period_s=60, clock=clock)  # 1 token per second
    assert bucket.try_take(50)
    assert not bucket.try_take(20)
    assert bucket.retry_after_s(20) == 10
    clock.now = 10
    assert bucket.try_take(20)
    bucket.refund(-30)  # the request used 30 more than estimated
    assert bucket.level == -30
    assert bucket.retry_after_s(1) == 31


def test_admission_limits_and_release():
    clock = Clock()
    admission = TenantLimiter(clock=clock)
    limits = TenantLimits("A", max_concurrent=2, requests_per_minute=3, tokens_per_minute=100)
    first = admission.admit(limits, 40)
    admission.admit(limits, 40)
    with pytest.raises(Rejected) as exc:
        admission.admit(limits, 10)
    assert exc.value.reason == "concurrency"
    admission.release(first, used_tokens=10)  # settles: 30 tokens come back
    with pytest.raises(Rejected) as exc:
        admission.admit(limits, 60)
    assert exc.value.reason == "tokens_per_minute" and exc.value.retry_after_s == 6
    third = admission.admit(limits, 40)
    admission.release(third, used_tokens=40)
    with pytest.raises(Rejected) as exc:
        admission.admit(limits, 1)
    assert exc.value.reason == "requests_per_minute"
    clock.now = 60  # a minute later the buckets are full again
    admission.admit(limits, 1)
