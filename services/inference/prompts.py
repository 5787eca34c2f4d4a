"""Prompt text -> token ids for the generation routes, bounded before any work and off the event loop.

A prompt longer in characters than the model's context could hold (`max_model_len` tokens of at
most `max_token_chars` characters each) is refused before it is tokenized or templated; what is
left is tokenized (and a long chat templated) on a small thread pool, never on the loop (the
tokenizers library releases the GIL, so the loop keeps answering). Token ids, sent or produced by
the tokenizer, must be rows of the model's embedding (a tokenizer may know more tokens than the
model has: an id past the embedding fails the forward, and on CUDA every later step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from jinja2 import TemplateError

from scheduling.router import ServedModel
from services.errors import InvalidRequestError
from services.sampling import check_token_ids

INLINE_CHARS = 8192  # shorter texts are tokenized on the loop: under a millisecond, less than a thread hop
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="galley-tokenize")
T = TypeVar("T")


def max_prompt_chars(model: ServedModel) -> int:
    return model.max_model_len * model.max_token_chars


def check_prompt_chars(model: ServedModel, num_chars: int, param: str) -> None:
    """400 for a prompt too long in characters to fit the context, before tokenizing it."""
    if num_chars > max_prompt_chars(model):
        raise InvalidRequestError(
            f"This model's maximum context length is {model.max_model_len} tokens; a prompt of {num_chars} "
            f"characters cannot fit it (at most {max_prompt_chars(model)} characters)",
            param=param, code="context_length_exceeded")


async def off_loop(num_chars: int, work: Callable[[], T]) -> T:
    """`work()` inline if the input is small, else on the tokenizer pool."""
    if num_chars <= INLINE_CHARS:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_POOL, work)


async def encode_text(model: ServedModel, text: str, param: str = "prompt", add_special_tokens: bool = True
                      ) -> list[int]:
    """A completion prompt's token ids (by default with the tokenizer's special tokens added)."""
    check_prompt_chars(model, len(text), param)
    token_ids = await off_loop(len(text), lambda: model.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    check_token_ids(model, token_ids, param)
    return token_ids


async def encode_prompt(model: ServedModel, prompt: str | list[int], param: str = "prompt") -> list[int]:
    """A prompt given as text or as token ids."""
    if isinstance(prompt, str):
        return await encode_text(model, prompt, param)
    check_token_ids(model, prompt, param)
    return list(prompt)


def _render(model: ServedModel, messages: list[dict[str, Any]], param: str, template_kwargs: dict[str, Any]) -> str:
    try:
        rendered = model.tokenizer.apply_chat_template(
            messages, tokenize=False, **{"add_generation_prompt": True, **template_kwargs})
    except (TemplateError, ValueError) as exc:  # the template (or transformers) refuses this conversation;
        # its message is written for users
        raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param=param) from exc
    check_prompt_chars(model, len(rendered), param)
    return rendered


def chat_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' text (content parts' `text`; an image part counts none)."""
    return sum(len(m.get("content") or "") if not isinstance(m.get("content"), list)
               else sum(len(part.get("text") or "") for part in m["content"]) for m in messages)


async def encode_chat(model: ServedModel, messages: list[dict[str, Any]], param: str = "messages",
                      template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False) -> list[int]:
    """A conversation through the model's chat template (which writes its special tokens), then its token ids."""
    num_chars = chat_chars(messages)
    check_prompt_chars(model, num_chars, param)

    def work() -> list[int]:
        rendered = _render(model, messages, param, template_kwargs or {})
        return model.tokenizer.encode(rendered, add_special_tokens=add_special_tokens)

    token_ids = await off_loop(num_chars + 64 * len(messages), work)  # each message adds template text
    check_token_ids(model, token_ids, param)
    return token_ids


async def decode_tokens(model: ServedModel, token_ids: list[int], param: str = "tokens") -> str:
    """Token ids (each a row of the model's embedding) as text, special tokens included."""
    check_token_ids(model, token_ids, param)
    return await off_loop(len(token_ids), lambda: model.tokenizer.decode(token_ids))
