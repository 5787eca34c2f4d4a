"""A request's sampling options -> the engine's `SamplingParams`, checked against the model and the caller.

Plain values in, so every route builds its params the same way: the OpenAI and native handlers
fill `SamplingOptions` from their bodies, batch jobs from their stored params. A field a request
leaves out (None) takes the model's default (`ServedModel.sampling_defaults`: its
`generation_config.json` under its `sampling_defaults` option), else the API's (`SAMPLING_FIELDS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.types import SamplingParams
from scheduling.router import ServedModel
from services.errors import InvalidRequestError


@dataclass(frozen=True)
class Bounds:
    """A numeric sampling field: its type, range and the API's default. The request schemas, the
    model option `sampling_defaults` and the docs all read these, so they cannot disagree."""

    type: type
    default: float | int
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    help: str = ""

    def problem(self, value: object) -> str | None:
        """Why `value` is not one of this field's, or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.type is float else int):
            return f"must be {'a number' if self.type is float else 'an integer'}"
        if value != value or value in (float("inf"), float("-inf")):
            return "must be finite"
        for bound, ok, words in ((self.ge, lambda b: value >= b, ">="), (self.gt, lambda b: value > b, ">"),
                                 (self.le, lambda b: value <= b, "<=")):
            if bound is not None and not ok(bound):
                return f"must be {words} {bound}"
        return None


MAX_TOP_K = 1_000_000  # beyond any vocabulary; the sampler clamps to the model's
MAX_DEFAULT_TOKENS = 1 << 20
DEFAULT_MAX_TOKENS = 4096  # a request without max_tokens stops here unless its model says otherwise
# The fields a model may default (as vLLM reads from generation_config.json), with OpenAI's and vLLM's
# ranges: temperature 0-2 (OpenAI; below 1e-5 greedy), top_p (0, 1], penalties -2..2 (both), min_p 0-1
# and repetition_penalty > 0 (vLLM's; no upper bound there either). The sampler keeps the arithmetic
# finite for every value in range (engine.sampler.apply_penalties, finite_scores).
SAMPLING_FIELDS: dict[str, Bounds] = {
    "temperature": Bounds(float, 1.0, ge=0.0, le=2.0, help="below 1e-5: greedy (as 0)"),
    "top_p": Bounds(float, 1.0, gt=0.0, le=1.0),
    "top_k": Bounds(int, -1, ge=-1, le=MAX_TOP_K, help="-1 or 0 disables; above the vocabulary: all of it"),
    "min_p": Bounds(float, 0.0, ge=0.0, le=1.0),
    "repetition_penalty": Bounds(float, 1.0, gt=0.0, help="HF/CTRL style, over prompt and output; 1: off"),
    "frequency_penalty": Bounds(float, 0.0, ge=-2.0, le=2.0),
    "presence_penalty": Bounds(float, 0.0, ge=-2.0, le=2.0),
}
# and the default cap of a request that leaves `max_tokens` out (OpenAI leaves it to the server)
DEFAULTABLE: dict[str, Bounds] = {**SAMPLING_FIELDS, "max_tokens": Bounds(
    int, DEFAULT_MAX_TOKENS, ge=1, le=MAX_DEFAULT_TOKENS, help="when a request leaves max_tokens out "
    "(within the context and the caller's cap)")}


def check_sampling_defaults(values: object) -> str | None:
    """Why `values` is not a valid `sampling_defaults` table, or None."""
    if not isinstance(values, dict):
        return "must be a table of sampling fields"
    for name, value in values.items():
        if name not in DEFAULTABLE:
            return f"unknown field {name!r}; known: {', '.join(DEFAULTABLE)}"
        if (problem := DEFAULTABLE[name].problem(value)) is not None:
            return f"{name} {problem}"
    return None


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling fields a request asked for, None where it left one out (the model's default
    applies): `SamplingParams` without the two that depend on the model, the prompt and the caller
    (`max_tokens`, `logprobs`)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
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
    defaults = model_defaults(model)
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
    room = min(room, defaults["max_tokens"])
    check_token_ids(model, list(options.stop_token_ids), "stop_token_ids")
    check_token_ids(model, [token for token, _ in options.logit_bias], "logit_bias")
    max_tokens = max_tokens or room
    if options.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens is {options.min_tokens}, over the {max_tokens} tokens this "
                                  "completion may have (max_tokens, or the room the context leaves)",
                                  param="min_tokens")
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **with_defaults(options, defaults))


def model_defaults(model: ServedModel) -> dict[str, float | int]:
    """Every defaultable field's value for `model`: its own, else the API's."""
    own = model.sampling_defaults
    return {name: own.get(name, bounds.default) for name, bounds in DEFAULTABLE.items()}


def with_defaults(options: SamplingOptions, defaults: dict[str, float | int]) -> dict[str, object]:
    """`options` as SamplingParams fields, each field left out taking the model's default."""
    fields = dataclasses.asdict(options)
    return {name: defaults[name] if value is None and name in SAMPLING_FIELDS else value
            for name, value in fields.items()}


def sampling_defaults(generation_config: dict[str, object], own: dict[str, float | int] | None
                      ) -> dict[str, float | int]:
    """A model's defaults: what its `generation_config.json` sets of the fields vLLM reads from it
    (temperature, top_p, top_k, min_p, repetition_penalty; `max_new_tokens` as max_tokens), values
    out of range left out, under its own `sampling_defaults` option."""
    found = {"max_tokens" if key == "max_new_tokens" else key: value for key, value in generation_config.items()
             if key in SAMPLING_FIELDS or key == "max_new_tokens"}
    found = {key: value for key, value in found.items() if DEFAULTABLE[key].problem(value) is None}
    return {**found, **(own or {})}


def check_token_ids(model: ServedModel, token_ids: list[int], param: str) -> None:
    if token_ids and not 0 <= min(token_ids) <= max(token_ids) < model.vocab_size:
        raise InvalidRequestError(f"{param}: token ids must be in [0, {model.vocab_size}): this model has "
                                  f"{model.vocab_size} token embeddings", param=param)
