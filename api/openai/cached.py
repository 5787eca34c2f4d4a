"""/v1/completions and /v1/chat/completions answered from the response cache.

The cache keeps the raw text; its thoughts and tool calls are read from it as a live stream's are,
so a replayed answer equals the first (its calls' ids too: they derive from the stream id kept with it).

A deterministic request (greedy or seeded) with no logprobs and no conversation is looked up by
(tenant, model version, prompt token ids after the chat template, sampling parameters); a hit is
answered without the engine, as JSON or as an SSE stream of the live chunk shapes, under a fresh
id. Streamed and non-streamed requests share entries (same generation, same output). A replayed
stream is not resumable (it has no `X-Stream-Id`): it is written in one go.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from aiohttp import web

from api.openai.chunks import event_chunks, opening_chunks
from api.sse import Frame, serve_sse
from services.answers import AnswerReader, ChunkFormat, StreamEvent
from services.cache import CachedCompletion


async def replay(request: web.Request, fmt: ChunkFormat, answer: CachedCompletion) -> web.StreamResponse:
    """A cached answer as a stream: the opening chunk (chat: the role), one text chunk, the finish chunk,
    the usage chunk when asked for, `[DONE]`."""
    return await serve_sse(request, replay_frames(fmt, answer), {"X-Request-Id": request["request_id"]})


async def replay_frames(fmt: ChunkFormat, answer: CachedCompletion) -> AsyncGenerator[Frame, None]:
    prompt, completion = answer.usage["prompt_tokens"], answer.usage["completion_tokens"]
    for chunk in opening_chunks(fmt, 0, prompt):
        yield chunk, None
    event = StreamEvent(0, answer.text, 0, finish_reason=answer.finish_reason, usage=answer.usage,
                        num_prompt_tokens=prompt, num_output_tokens=completion)
    for chunk in event_chunks(fmt, None, AnswerReader.of(fmt, call_ids=answer.call_ids).read(event)):
        yield chunk, None
    yield "[DONE]", None
