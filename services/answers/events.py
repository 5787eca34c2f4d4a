"""What a stream's log holds: format-free token events, and the chunk format they are shown in.

A stream's events are stored (in memory, then SQLite) in one shape whatever API started it;
the format of the original request (chat or text completion, usage, logprobs) travels with the
stream, so a resumed or replayed stream looks exactly like the original one (`api/openai/chunks.py`
renders them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.types import TokenLogprob


@dataclass(frozen=True)
class ChunkFormat:
    kind: str  # "chat" | "completion"
    id: str  # the chunk id, which is also the stream id
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
    echo: tuple[str, ...] = ()  # text completions' `echo`: each choice's prompt text, sent before its output
    tool_format: str | None = None  # tools are in play: calls are read out of the text in this format
    reasoning_starts_inside: bool | None = None  # a thinking model (thoughts read apart): whether it starts in them

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChunkFormat:
        return cls(**{**data, "echo": tuple(data.get("echo", ()))})

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
    has_token: bool = True  # false for an end without a token (a cancel): it shows no text chunk
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, this event's tokens included
