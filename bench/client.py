"""The HTTP load client the benchmarks share (throughput.py, peers.py): streaming /v1/completions
with each text chunk's arrival time, and the small statistics and logging helpers."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import aiohttp


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile_ms(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))] * 1000


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class StreamStats:
    send_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carries text
    texts: list[str] = field(default_factory=list)  # the text of each of those chunks
    completion_tokens: int | None = None  # from the final usage chunk


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> StreamStats:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stats = StreamStats(send_s=time.perf_counter())
    # the response cache would answer a repeated greedy prompt without running the engine
    async with session.post(url, json=body, headers={"Cache-Control": "no-cache"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if resp.headers.get("X-Cache") == "hit":
            raise RuntimeError("answered from the response cache: the engine did not run")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if text := "".join(choice.get("text") or "" for choice in chunk.get("choices") or []):
                stats.chunk_s.append(time.perf_counter())
                stats.texts.append(text)
            if chunk.get("usage"):
                stats.completion_tokens = chunk["usage"]["completion_tokens"]
    return stats


async def send_requests(
    base_url: str, prompts: list[list[int]], max_tokens: int, concurrent: bool
) -> tuple[list[StreamStats], float]:
    url = f"{base_url}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()
        if concurrent:
            stats = list(await asyncio.gather(*(stream_completion(session, url, p, max_tokens) for p in prompts)))
        else:
            stats = [await stream_completion(session, url, p, max_tokens) for p in prompts]
        return stats, time.perf_counter() - start
