"""What a generation route asks for, as plain values (the handlers build these from their bodies)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.inference.params import SamplingOptions


@dataclass(frozen=True)
class GenerationInput:
    model: str  # `name` or `name@version`
    options: SamplingOptions = SamplingOptions()
    max_tokens: int | None = None
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    n: int = 1
    user: str | None = None
    priority: str | None = None  # high | normal | low; None: the caller's default
    include_usage: bool = False  # a stream ends with a usage chunk
    on_disconnect: str | None = None  # continue | cancel; None: the stream hub's default for the kind
    cache_salt: str = ""  # vLLM's field: only requests with the same salt (and tenant) share cached prefixes


@dataclass(frozen=True)
class ChatInput(GenerationInput):
    messages: list[dict] = field(default_factory=list)  # {"role", "content"} with `developer` as `system`
    conversation_id: str | None = None


@dataclass(frozen=True)
class PromptInput(GenerationInput):
    prompt: str | list[int] = ""
    default_max_tokens: int | None = None  # when `max_tokens` is not given (within the caller's cap)
    default_within_context: bool = False  # the default shrinks to the room the prompt leaves (at least 1)
