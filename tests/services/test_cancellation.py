"""A task reading a generation through `Metrics.observe` ends when it is cancelled (a server shutting
down cancels its batch items and streams), whenever the cancel lands, also in the loop iteration
that brings the first event. There, Python 3.11's `asyncio.wait_for` returned the event and dropped
the cancel; the task read on, and waited forever once the engine stopped (a test's teardown hung on
it). Real engine and router on the tiny model."""

from __future__ import annotations

import asyncio

import pytest

from engine.types import GenerationRequest, SamplingParams
from services.observability.metrics import Metrics
from tests.api.test_api import wait_blocks_free
from tests.helpers import start_tiny_engines


async def test_a_cancel_that_lands_with_the_first_event_is_not_lost(llama_path):
    router, workers = await start_tiny_engines(llama_path)
    metrics = Metrics(router)
    try:
        model = router.find("tiny")
        for spins in range(4):  # the cancel 0-3 loop iterations after the reader starts
            params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
            stream = router.submit(model, GenerationRequest(f"cancel-{spins}", [1, 2, 3], params))
            while stream.events.empty():  # the first event is queued, not yet read
                await asyncio.sleep(0.001)

            async def read(stream=stream) -> None:
                async for _ in metrics.observe(stream, first_event_timeout_s=60):
                    pass

            reader = asyncio.ensure_future(read())
            for _ in range(spins):
                await asyncio.sleep(0)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(30):
                    await reader  # a lost cancel: the reader reads on to the 64th token and returns
            router.abort(stream)
        await wait_blocks_free(router)
    finally:
        for worker in workers:
            worker.stop()
