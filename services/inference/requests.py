"""What a generation route asks for, as plain values (the handlers build these from their bodies)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.inference.structured import OutputFormat
from services.inference.tools import ToolUse
from services.sampling import SamplingOptions


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
    continuous_usage: bool = False  # and every chunk carries the usage so far (vLLM's continuous_usage_stats)
    on_disconnect: str | None = None  # continue | cancel; None: the stream hub's default for the kind
    cache_salt: str = ""  # vLLM's field: only requests with the same salt (and tenant) share cached prefixes
    output: OutputFormat | None = None  # the answer must match this (response_format, vLLM's guided_*)


@dataclass(frozen=True)
class ChatInput(GenerationInput):
    messages: list[dict] = field(default_factory=list)  # {"role", "content", ...} with `developer` as `system`
    conversation_id: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # for `apply_chat_template` (checked by the API)
    tools: ToolUse = ToolUse()


@dataclass(frozen=True)
class PromptInput(GenerationInput):
    prompt: str | list[int] | list[str] | list[list[int]] = ""  # one prompt, or a list of prompts (texts or ids)
    echo: bool = False  # each choice's text starts with its prompt's text
    default_max_tokens: int | None = None  # when `max_tokens` is not given (within the caller's cap)
    default_within_context: bool = False  # the default shrinks to the room the prompt leaves (at least 1)

    def prompts(self) -> list[str | list[int]]:
        """The prompts asked for: a string or a list of token ids is one."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)
