"""Requests that reach an idle worker together start together: the first one does not run a step
alone while the rest queue behind its prefill (a burst sharing a system prompt, clients at once)."""

from __future__ import annotations

import threading
import time

from engine.types import GenerationRequest, SamplingParams
from engine.worker import BURST_MAX_S, BURST_QUIET_S, DeviceWorker
from tests.helpers import make_engine

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def first_tokens_by_call(llama_path, gap_s: float, count: int = 6) -> tuple[list[set[str]], float, dict[int, int]]:
    """Submit `count` requests `gap_s` apart to an idle worker: which requests got their first
    token in each emit call (one call per step), the longest gap there really was, and the
    worker's burst sizes (for `galley_worker_burst_requests`)."""
    calls: list[set[str]] = []
    seen: set[str] = set()
    finished: set[str] = set()
    done = threading.Event()

    def emit(events) -> None:
        firsts = {e.request_id for e in events if e.request_id not in seen}
        seen.update(firsts)
        if firsts:
            calls.append(firsts)
        finished.update(e.request_id for e in events if e.finished)
        if len(finished) == count:
            done.set()

    worker = DeviceWorker("cpu", emit)
    worker.start()
    try:
        worker.attach("e", make_engine(llama_path)).result(60)
        sent = []
        for i in range(count):
            worker.submit("e", GenerationRequest(f"r{i}", [5 + i, 6, 7, 8], PARAMS))
            sent.append(time.monotonic())
            time.sleep(gap_s)
        assert done.wait(60)
    finally:
        worker.stop()
    return calls, max(b - a for a, b in zip(sent, sent[1:])), dict(worker.burst_sizes)


def test_a_burst_starts_in_one_step(llama_path):
    for _ in range(3):  # a busy machine may sleep the sender past the window: then try again
        calls, longest_gap, bursts = first_tokens_by_call(llama_path, gap_s=BURST_QUIET_S / 5)
        if longest_gap < BURST_QUIET_S * 0.8:
            break
    assert calls[0] == {f"r{i}" for i in range(6)}
    assert bursts == {6: 1}


def test_requests_further_apart_than_the_burst_window_do_not_wait_for_each_other(llama_path):
    calls, _, _ = first_tokens_by_call(llama_path, gap_s=BURST_MAX_S)
    assert calls[0] == {"r0"}
