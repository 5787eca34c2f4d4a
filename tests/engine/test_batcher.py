"""The dynamic batcher on a real device worker thread, and the response cache as plain state:
batches, splits, failures, LRU and TTL."""

from __future__ import annotations

import threading
import time

import pytest

from engine.batcher import Batching, DynamicBatcher, Pending
from engine.worker import DeviceWorker, EncoderClient
from services.cache.response_cache import CacheEntries, ResponseCacheConfig, cache_key


class Recorder:
    """A run_batch that records each batch and doubles its inputs; it can be held or made to fail."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a batch has started: the worker is inside run_batch
        self.fail_on: int | None = None
        self.threads: set[str] = set()

    def __call__(self, items: list[int]) -> list[int]:
        self.entered.set()
        self.gate.wait(5)
        self.threads.add(threading.current_thread().name)
        self.batches.append(list(items))
        if self.fail_on in items:
            raise ValueError("bad input")
        return [2 * x for x in items]


@pytest.fixture
def recorder():
    return Recorder()


def make(recorder: Recorder, max_batch: int = 4, max_wait_ms: float = 50.0,
         preferred: tuple[int, ...] = ()) -> EncoderClient:
    """An encoder on a worker of its own (stopped with it), as tests.helpers.load_encoder_alone does."""
    worker = DeviceWorker("cpu#test", emit=lambda events: None)
    worker.start()
    client = worker.attach_encoder("m", DynamicBatcher("m", recorder, max_batch, max_wait_ms, preferred))
    client.owns_worker = True
    return client


def test_low_inputs_fill_the_room_interactive_requests_leave(recorder):
    recorder.gate.clear()  # hold the first batch so that the rest queue behind it
    batcher = make(recorder, max_batch=4, max_wait_ms=0)
    first = batcher.submit([0])
    assert recorder.entered.wait(5)  # the first batch is held in run_batch: the next ones queue behind it
    low = [batcher.submit(items, low=True) for items in ([100, 101], [102, 103, 104])]  # batch job items, first
    interactive = [batcher.submit([i]) for i in (1, 2)]
    recorder.gate.set()
    assert [f.result(5) for f in low] == [[200, 202], [204, 206, 208]]
    assert [f.result(5) for f in interactive] == [[2], [4]] and first.result(5) == [0]
    assert recorder.batches == [[0], [1, 2, 100, 101], [102, 103, 104]]  # whole requests where they fit


def test_requests_waiting_together_share_one_forward(recorder):
    recorder.gate.clear()  # hold the first batch so that the next three queue behind it
    batcher = make(recorder, max_batch=8, max_wait_ms=0)
    first = batcher.submit([1])
    assert recorder.entered.wait(5)  # the first batch is held in run_batch: the next ones queue behind it
    rest = [batcher.submit([10 + i, 20 + i]) for i in range(3)]
    recorder.gate.set()
    assert first.result(5) == [2]
    assert [f.result(5) for f in rest] == [[20, 40], [22, 42], [24, 44]]
    assert recorder.batches == [[1], [10, 20, 11, 21, 12, 22]]
    assert batcher.stats.batch_sizes == {1: 1, 6: 1} and batcher.stats.num_requests == 4
    assert recorder.threads == {"galley-worker-cpu#test"}  # batches run on the device worker's thread
    batcher.stop()


def test_a_full_batch_runs_before_the_wait_expires(recorder):
    batcher = make(recorder, max_batch=4, max_wait_ms=10_000)
    started = time.monotonic()
    futures = [batcher.submit([i]) for i in range(4)]
    assert [f.result(5) for f in futures] == [[0], [2], [4], [6]]
    assert time.monotonic() - started < 5
    assert recorder.batches == [[0, 1, 2, 3]]
    batcher.stop()


def test_the_largest_preferred_size_runs_at_once_and_the_rest_waits(recorder):
    recorder.gate.clear()
    batcher = make(recorder, max_batch=8, max_wait_ms=1500, preferred=(2, 4))
    first = batcher.submit([0, 1])  # fills the preferred 2: runs at once, held in run_batch
    assert recorder.entered.wait(5)
    rest = [batcher.submit([i]) for i in range(2, 7)]
    released = time.monotonic()
    recorder.gate.set()
    assert first.result(5) == [0, 2] and [f.result(5) for f in rest[:4]] == [[4], [6], [8], [10]]
    assert time.monotonic() - released < 1.0  # the four ran as a preferred batch, not after the wait
    assert rest[4].result(5) == [12] and time.monotonic() - released >= 1.4  # the fifth waited it out
    assert recorder.batches == [[0, 1], [2, 3, 4, 5], [6]]
    with pytest.raises(ValueError):
        DynamicBatcher("m", recorder, 4, 1.0, preferred=(8,))
    batcher.stop()


def test_a_lone_input_waits_at_most_max_wait(recorder):
    batcher = make(recorder, max_batch=64, max_wait_ms=30)
    started = time.monotonic()
    assert batcher.submit([5]).result(5) == [10]
    assert 0.025 <= time.monotonic() - started < 2
    batcher.stop()


def test_a_request_larger_than_max_batch_is_split_and_reassembled(recorder):
    batcher = make(recorder, max_batch=4, max_wait_ms=0)
    assert batcher.submit(list(range(10))).result(5) == [2 * x for x in range(10)]
    assert [len(b) for b in recorder.batches] == [4, 4, 2]
    assert batcher.stats.num_items == 10 and batcher.stats.num_requests == 1
    batcher.stop()


def test_a_failed_batch_fails_only_its_requests(recorder):
    recorder.gate.clear()
    recorder.fail_on = 7
    batcher = make(recorder, max_batch=2, max_wait_ms=0)
    held = batcher.submit([1])
    assert recorder.entered.wait(5)  # the first batch is held in run_batch: the next ones queue behind it
    bad, good = batcher.submit([7, 8]), batcher.submit([3])
    recorder.gate.set()
    assert held.result(5) == [2]
    with pytest.raises(ValueError, match="bad input"):
        bad.result(5)
    assert good.result(5) == [6]
    assert batcher.stats.num_failed_batches == 1
    batcher.stop()


def test_cancelled_requests_are_skipped_and_stop_fails_the_rest(recorder):
    recorder.gate.clear()
    batcher = make(recorder, max_batch=1, max_wait_ms=0)
    running = batcher.submit([1])
    assert recorder.entered.wait(5)  # the first batch is held in run_batch: the next ones queue behind it
    cancelled = batcher.submit([2])
    assert cancelled.cancel()
    recorder.gate.set()
    assert running.result(5) == [2]
    assert batcher.submit([3]).result(5) == [6]
    assert [2] not in recorder.batches
    batcher.stop()
    assert batcher.submit([]).result(1) == []


def test_detaching_fails_waiting_inputs_and_later_submits(recorder):
    worker = DeviceWorker("cpu#test", emit=lambda events: None)
    worker.start()
    try:
        client = worker.attach_encoder("m", DynamicBatcher("m", recorder, max_batch=64, max_wait_ms=10_000))
        waiting = client.submit([1, 2])
        client.stop()
        with pytest.raises(RuntimeError, match="unloaded"):
            waiting.result(5)
        with pytest.raises(RuntimeError, match="not loaded"):
            client.submit([3]).result(5)
        assert recorder.batches == [] and worker.encoders == {}
    finally:
        worker.stop()


def test_cache_is_lru_bounded_and_expires():
    now = [0.0]
    cache = CacheEntries(ResponseCacheConfig(max_entries=2, ttl_seconds=10), clock=lambda: now[0])
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recently used
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    now[0] = 10.5
    assert cache.get("a") is None and len(cache) == 1


def test_cache_keys_separate_tenants_versions_and_params():
    base = cache_key("t1", "m", "1", "hello", {"x": 1, "y": 2})
    assert base == cache_key("t1", "m", "1", "hello", {"y": 2, "x": 1})
    params = {"x": 1, "y": 2}
    others = [cache_key("t2", "m", "1", "hello", params), cache_key("t1", "m", "2", "hello", params),
              cache_key("t1", "m", "1", "hello!", params), cache_key("t1", "m", "1", "hello", {"x": 2, "y": 2})]
    assert base not in others and len(set(others)) == 4


def test_disabled_cache_stores_nothing():
    cache = CacheEntries(ResponseCacheConfig(enabled=False))
    cache.put("a", 1)
    assert cache.get("a") is None


def test_an_engine_and_an_encoder_share_the_worker_thread(llama_path):
    """Encoder batches run between the engine's steps, on the same thread, one batch per step
    while both have work; the greedy tokens are the same as the engine's alone."""
    from engine.types import GenerationRequest, SamplingParams
    from tests.helpers import make_engine, run_to_completion

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = run_to_completion(make_engine(llama_path), [[1, 2, 3, 4]], params)[0]
    timeline, tokens, done = [], [], threading.Event()

    def emit(batch):
        timeline.append("step")
        tokens.extend(t for e in batch for t in e.token_ids)
        if any(e.finish_reason is not None for e in batch):
            done.set()

    def encode(items):
        timeline.append(threading.current_thread().name)
        return [2 * x for x in items]

    worker = DeviceWorker("cpu#test", emit)
    worker.attach("tiny", make_engine(llama_path)).result()
    client = worker.attach_encoder("m", DynamicBatcher("m", encode, max_batch=2, max_wait_ms=0))
    worker.submit("tiny", GenerationRequest("r1", [1, 2, 3, 4], params))
    futures = [client.submit([i, 100 + i]) for i in range(10)]
    worker.start()
    try:
        assert [f.result(10) for f in futures] == [[2 * i, 200 + 2 * i] for i in range(10)]
        assert done.wait(30)
        assert tokens == alone
        assert set(timeline) == {"step", "galley-worker-cpu#test"}
        assert timeline[:20] == ["step", "galley-worker-cpu#test"] * 10  # alternating while both have work
    finally:
        worker.stop()


def test_a_limited_batch_cuts_a_request_and_reassembles_it(recorder):
    batcher = DynamicBatcher("m", recorder, max_batch=8, max_wait_ms=0)
    first, second = Pending([1, 2, 3]), Pending([4, 5])
    batcher.add(first)
    batcher.add(second)
    batcher.run_once(limit=2)  # cuts the first request
    batcher.run_once(limit=2)  # its rest; the second request does not fit beside it whole
    batcher.run_once()
    assert recorder.batches == [[1, 2], [3], [4, 5]]
    assert first.future.result(0) == [2, 4, 6] and second.future.result(0) == [8, 10]
    assert batcher.items_for(1.0) == 8 and batcher.items_for(0.0) == 1  # fast inputs: a full batch fits
    assert DynamicBatcher("n", recorder, 8, 0).items_for(1.0) == 1  # nothing measured yet: one


def test_while_generating_encoders_get_about_the_steps_time(llama_path):
    """A slow encoder's batches shrink to single inputs while a generation runs, spaced so that
    steps and encoding take turns by time, and grow back to max_batch once it is done."""
    from engine.types import GenerationRequest, SamplingParams
    from tests.helpers import make_engine

    timeline, done = [], threading.Event()

    def slow_encode(items):
        timeline.append(len(items))
        time.sleep(0.01 * len(items))  # 10 ms per input: far longer than a tiny model's step
        return items

    def emit(events):
        timeline.append("step")
        if any(e.finish_reason for e in events):
            done.set()

    worker = DeviceWorker("cpu#test", emit)
    worker.attach("tiny", make_engine(llama_path)).result()
    client = worker.attach_encoder("m", DynamicBatcher("m", slow_encode, max_batch=8, max_wait_ms=0))
    worker.submit("tiny", GenerationRequest("r1", [1, 2, 3, 4], SamplingParams(max_tokens=30, ignore_eos=True)))
    futures = [client.submit([i]) for i in range(60)]
    worker.start()
    try:
        assert done.wait(30)
        assert [f.result(30) for f in futures] == [[i] for i in range(60)]
    finally:
        worker.stop()
    last_step = max(i for i, x in enumerate(timeline) if x == "step")
    during = [x for x in timeline[:last_step] if x != "step"]
    assert during and set(during) == {1}  # single inputs while generating...
    assert timeline[:last_step].count("step") >= 2 * len(during)  # ...with several steps between them
    assert max(x for x in timeline[last_step:] if x != "step") == 8  # full batches once it finished


def test_a_models_options_become_its_batching():
    from launch import batching_of

    assert batching_of({}) == Batching(32, 5.0, ())
    assert batching_of({"max_batch": 8, "max_queue_delay_microseconds": 250, "preferred_batch_size": [4, 8]}) == \
        Batching(8, 0.25, (4, 8))
    assert Batching(8, 0.25, (4, 8)).batcher("m", lambda items: items).preferred == (8, 4)  # largest first
