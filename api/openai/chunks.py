"""OpenAI stream chunks from stream events (`services.streams.events`), for live streams and
replays alike: the chunk format of the original request travels with the stream, so a resumed
or replayed stream looks exactly like the original one.
"""

from __future__ import annotations

from typing import Any

from engine.types import TokenLogprob
from services.streams.events import ChunkFormat, StreamEvent


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, items: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items
    ]}


def completion_logprobs(tokenizer: Any, items: list[TokenLogprob], offset: int) -> dict:
    tokens, offsets = [], []
    for lp in items:
        tokens.append(token_text(tokenizer, lp.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


def role_chunk(fmt: ChunkFormat) -> dict:
    """The first chunk of a chat stream: the assistant role."""
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return {**fmt.base, "choices": [choice]}


def _chunk(fmt: ChunkFormat, tokenizer: Any, text: str, logprobs: list[TokenLogprob] | None, offset: int,
           finish: str | None) -> dict:
    if fmt.kind == "chat":
        lp = chat_logprobs(tokenizer, logprobs) if fmt.logprobs and logprobs else None
        choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": finish}
    else:
        lp = completion_logprobs(tokenizer, logprobs, offset) if fmt.logprobs and logprobs else None
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
    return {**fmt.base, "choices": [choice]}


def event_chunks(fmt: ChunkFormat, tokenizer: Any, event: StreamEvent) -> list[dict]:
    """The chunks one event becomes: its text (if any), then on the last event the finish chunk
    and, when asked for, the usage chunk. Events with no text and no logprobs send nothing."""
    chunks = []
    if event.text or (fmt.logprobs and event.logprobs):
        chunks.append(_chunk(fmt, tokenizer, event.text, event.logprobs, event.text_offset, None))
    if event.finish_reason in ("stop", "length"):
        chunks.append(_chunk(fmt, tokenizer, "", None, event.text_offset, event.finish_reason))
        if fmt.include_usage and event.usage is not None:
            chunks.append({**fmt.base, "choices": [], "usage": event.usage})
    return chunks


def error_chunk(event: StreamEvent) -> dict:
    """The last chunk of a stream that failed after its first token."""
    return {"error": {"message": event.error, "type": "internal_error", "param": None, "code": event.error_code}}
