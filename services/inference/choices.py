"""n > 1, or several prompts: the choices of a request as one parent request.

Submitted all or nothing, read together (collected, or merged in the order their tokens come)
and aborted together: a caller that leaves, or a choice that fails, ends every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.types import TokenEvent
from scheduling.router import RequestStream, Router
from services.answers.reading import Answer, collect, scheduled_events
from services.observability.metrics import Metrics


class Choices:
    """Invariant: once the caller is done with them (`collect` returned or raised, `events` closed),
    no choice is left running."""

    def __init__(self, router: Router, metrics: Metrics, streams: list[RequestStream], n: int) -> None:
        self.router = router
        self.metrics = metrics
        self.streams = streams  # choice i is choice i % n of prompt i // n
        self.n = n

    def __len__(self) -> int:
        return len(self.streams)

    def num_prompt_tokens(self, index: int) -> int:
        return len(self.streams[index].request.prompt_token_ids)

    def abort(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.router.abort(stream)

    async def collect(self) -> list[Answer]:
        """Every choice to its end, in order; the first failure is raised as it is (a 503 stays a 503)."""
        tasks = [asyncio.ensure_future(collect(self.router, self.metrics, stream)) for stream in self.streams]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # cancels the rest: `collect` aborts their generations
                task.cancel()

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent | Exception]]:
        """(choice index, event) as the tokens come, until every choice has finished; a failure
        (an exception, or an event with an error) is the last item."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for event in scheduled_events(self.router, self.metrics, stream):
                    merged.put_nowait((index, event))
            except Exception as exc:
                merged.put_nowait((index, exc))

        pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(self.streams)]
        try:
            finished = 0
            while finished < len(self.streams):
                index, item = await merged.get()
                yield index, item
                if isinstance(item, Exception) or item.error is not None:
                    return
                finished += item.finished
        finally:
            for task in pumps:
                task.cancel()
            self.abort()
