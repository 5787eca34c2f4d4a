"""Blocking torch work (loading, unloading models) off the event loop, on a thread that exits.

Why not the default executor: libgomp stops spin-waiting (throttles) in every OpenMP team once
live team masters hold more threads than there are CPUs, and an executor thread that ran torch
ops once keeps its team alive. Measured here (2 cores): a [1,576]x[576,1536] matmul on the engine
worker thread took 41 us with no other torch thread alive and 130 us after another long-lived
thread had run torch ops; the engine's single-stream decode slowed from ~29 to ~18 tokens/s.
A thread that exits frees its OpenMP team.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_fresh_thread(fn: Callable[..., T], *args) -> T:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=run, name=f"galley-offload-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future
