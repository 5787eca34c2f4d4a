"""A request's sampling options -> the engine's `SamplingParams`, checked against the model and the caller.

Plain values in, so every route builds its params the same way: the OpenAI and native handlers
fill `SamplingOptions` from their bodies, batch jobs from their stored params.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.types import SamplingParams
from scheduling.router import ServedModel
from services.errors import InvalidRequestError
from services.inference.prompts import check_token_ids


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling fields a request asked for (the defaults are the API's): `SamplingParams`
    without the two that depend on the model, the prompt and the caller (`max_tokens`, `logprobs`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # false: no speculative drafts (galley.speculative)


def sampling_params(options: SamplingOptions, max_tokens: int | None, prompt_len: int, model: ServedModel,
                    logprobs: int | None, *, cap: int | None, default_max_tokens: int | None = None,
                    prompt_param: str = "prompt") -> SamplingParams:
    """`max_tokens` as asked (over the caller's cap `cap`: 400); when not asked, `default_max_tokens`
    within the cap, else the rest of the context within the cap. `prompt_param` names the field a
    prompt too long for the context came in."""
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, over this API key's cap of {cap}", param="max_tokens")
    if max_tokens is None and default_max_tokens is not None:
        max_tokens = default_max_tokens if cap is None else min(default_max_tokens, cap)
    room = model.max_model_len - prompt_len
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        asked = f"{prompt_len} in the prompt" + (f" and {max_tokens} for the completion" if max_tokens else "")
        raise InvalidRequestError(
            f"This model's maximum context length is {model.max_model_len} tokens, "
            f"but you requested {prompt_len + (max_tokens or 0)} tokens ({asked}).",
            param=prompt_param, code="context_length_exceeded",
        )
    if cap is not None:
        room = min(room, cap)
    check_token_ids(model, list(options.stop_token_ids), "stop_token_ids")
    check_token_ids(model, [token for token, _ in options.logit_bias], "logit_bias")
    max_tokens = max_tokens or room
    if options.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens is {options.min_tokens}, over the {max_tokens} tokens this "
                                  "completion may have (max_tokens, or the room the context leaves)",
                                  param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **dataclasses.asdict(options))
