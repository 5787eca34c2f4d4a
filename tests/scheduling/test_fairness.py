"""Two tenants on the real engine: fair share vs FIFO, counted in engine steps and tokens.

Tenant A opens 24 long streams on an engine that runs at most 8 sequences; a few steps later
tenant B opens 4. Fair share gets B's first tokens within about one quantum and splits the
generated tokens by weight while both are backlogged; FIFO makes B wait for A's backlog.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.types import GenerationRequest, Priority, SamplingParams
from scheduling.fair_queue import FairShareConfig
from tests.helpers import assert_all_blocks_free, make_engine

QUANTUM = 32
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


@dataclass
class Run:
    b_sent_step: int = 0
    b_first_step: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})  # while B is backlogged


def run_two_tenants(path, policy: str, weight_a: float = 1.0, weight_b: float = 1.0) -> Run:
    engine = make_engine(path, num_blocks=512, max_num_seqs=8, policy=policy,
                         fair_share=FairShareConfig(fair_quantum_tokens=QUANTUM))
    for i in range(24):
        engine.add_request(GenerationRequest(f"A{i}", [5 + i, 6, 7, 8], LONG, tenant="A", weight=weight_a))
    for _ in range(5):
        engine.step()
    run = Run(b_sent_step=engine.num_steps)
    for i in range(4):
        engine.add_request(GenerationRequest(f"B{i}", [9 + i, 10, 11], LONG, tenant="B", weight=weight_b))
    b_unfinished = 4
    while engine.has_work():
        for event in engine.step():
            tenant = event.request_id[0]
            if b_unfinished:
                run.tokens[tenant] += len(event.token_ids)
            if tenant == "B":
                run.b_first_step.setdefault(event.request_id, engine.num_steps)
                b_unfinished -= event.finished
    assert_all_blocks_free(engine.scheduler.kv)
    return run


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


def share_of_b(run: Run) -> float:
    return run.tokens["B"] / (run.tokens["A"] + run.tokens["B"])


def test_fair_share_equal_weights(path):
    run = run_two_tenants(path, "fair")
    waits = [step - run.b_sent_step for step in run.b_first_step.values()]
    assert max(waits) <= QUANTUM + 5, waits
    assert 0.5 * 0.85 <= share_of_b(run) <= 0.5 * 1.15, run.tokens


def test_fair_share_follows_weights_three_to_one(path):
    run = run_two_tenants(path, "fair", weight_a=3.0)
    assert 0.25 * 0.85 <= share_of_b(run) <= 0.25 * 1.15, run.tokens


def test_fifo_makes_b_wait_for_a_backlog(path):
    run = run_two_tenants(path, "fifo")
    waits = [step - run.b_sent_step for step in run.b_first_step.values()]
    # 24 streams of 300 tokens, 8 at a time: B starts only when A's queue has drained
    assert min(waits) >= 2 * 300 - 10, waits


def test_high_priority_is_admitted_next_on_a_saturated_engine(path):
    engine = make_engine(path, max_num_seqs=4)
    for i in range(8):
        engine.add_request(GenerationRequest(f"low{i}", [5, 6, 7], LONG, priority=Priority.LOW))
    engine.step()
    engine.add_request(GenerationRequest("high", [5, 6, 7], LONG, priority=Priority.HIGH))
    events = engine.step()
    assert "high" in {e.request_id for e in events}  # admitted (preempting a low) and sampled at once
    assert engine.scheduler.num_preemptions == 1
    for request_id in list(engine.requests):
        engine.abort(request_id)
    assert_all_blocks_free(engine.scheduler.kv)
