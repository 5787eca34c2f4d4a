"""Tokenizing and detokenizing with a served model's tokenizer (vLLM's /tokenize and /detokenize):
a prompt's or a chat's token count before sending it, through the same paths a generation takes
(`services.inference.prompts`), for a model the caller may use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduling.router import ServedModel
from services.deployments.manager import ModelManager
from services.errors import InvalidRequestError
from services.inference.prompts import decode_tokens, encode_chat, encode_text
from services.tenancy import Caller


@dataclass(frozen=True)
class TokenizeInput:
    model: str | None  # None: the one generative model the caller may use
    prompt: str | None = None  # exactly one of `prompt` and `messages`
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (the template adds them)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_strs: bool = False


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # each token's string form, when asked


async def model_for(models: ModelManager, caller: Caller, ref: str | None) -> ServedModel:
    """The served version of `ref`, or with no `ref`, of the only generative model the caller may use."""
    if ref is None:
        names = [card["id"] for card in models.catalog()
                 if card["kind"] == "generate" and caller.tenant.allows_model(card["id"])]
        if len(names) != 1:
            raise InvalidRequestError(f"model: required (there are {len(names)} generative models to choose from)",
                                      param="model")
        ref = names[0]
    return await models.route(caller, ref)


async def tokenize(models: ModelManager, caller: Caller, ask: TokenizeInput) -> Tokenized:
    model = await model_for(models, caller, ask.model)
    if ask.messages is not None:
        token_ids = await encode_chat(model, ask.messages, template_kwargs=ask.template_kwargs,
                                      add_special_tokens=bool(ask.add_special_tokens))
    else:
        add = True if ask.add_special_tokens is None else ask.add_special_tokens
        token_ids = await encode_text(model, ask.prompt or "", add_special_tokens=add)
    strs = model.tokenizer.convert_ids_to_tokens(token_ids) if ask.return_token_strs else None
    return Tokenized(token_ids, model.max_model_len, strs)


async def detokenize(models: ModelManager, caller: Caller, ref: str | None, token_ids: list[int]) -> str:
    return await decode_tokens(await model_for(models, caller, ref), token_ids)
