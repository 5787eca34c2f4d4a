"""OpenAI stream chunks from stream events, for live streams and replays alike.

A stream's events are stored (in memory, then SQLite) in a format-free shape; the chunk
format of the original request (chat or text completion, usage, logprobs) travels with the
stream, so a resumed or replayed stream looks exactly like the original one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.types import TokenLogprob


@dataclass(frozen=True)
class ChunkFormat:
    kind: str  # "chat" | "completion"
    id: str  # the chunk id, which is also the stream id
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChunkFormat:
        return cls(**data)

    @property
    def base(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return {**base, "usage": None} if self.include_usage else base


@dataclass
class StreamEvent:
    """One engine token of a stream: index i is the stream's i-th generated token."""

    index: int
    text: str
    text_offset: int  # characters of text before this event
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    usage: dict | None = None  # on the final event
    error: str | None = None
    error_status: int = 500
    error_code: str | None = None


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
