"""The bounded field types every request body shares (OpenAI's, native and batch), and `Strict`,
the base that makes unknown fields a 400 naming them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from services.sampling import DEFAULTABLE, Bounds

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 512  # per stop string: the detokenizer matches every stop after every token
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary comes near; the model's own size is checked per request
MAX_CONTEXT_TOKENS = 1 << 20  # bound of max_tokens: no served model has a longer context
MAX_NAME_CHARS = 256  # model names and end-user ids
MAX_N = 16  # choices per prompt: each is a whole generation (its own prefill and KV blocks)
MAX_PROMPTS = 64  # prompts per text completion; with n, at most MAX_CHOICES choices in all
MAX_CHOICES = 128
MAX_LOGIT_BIAS = 1024  # entries: each is added to a logit every step
GENERATION_MAX_BODY_BYTES = 4 * 1024 * 1024  # a generation's body: a long context's prompt with room to spare


def bounded(bounds: Bounds) -> Any:
    """A sampling field's type with its range (`services.sampling.SAMPLING_FIELDS`)."""
    return Annotated[bounds.type, Field(ge=bounds.ge, gt=bounds.gt, le=bounds.le, allow_inf_nan=False)]


def sampling_field(name: str, note: str = "") -> Any:
    """An optional request field `name`: left out, the model's default applies (GET /v1/models/{id}
    shows it), else the API's."""
    bounds = DEFAULTABLE[name]
    about = f"Default: the model's `sampling_defaults`, else {bounds.default}" + (f"; {bounds.help}" if bounds.help
                                                                                 else "") + "."
    return Field(None, description=f"{note} {about}".strip())


Temperature = bounded(DEFAULTABLE["temperature"])
TopP = bounded(DEFAULTABLE["top_p"])
TopK = bounded(DEFAULTABLE["top_k"])
MinP = bounded(DEFAULTABLE["min_p"])
RepetitionPenalty = bounded(DEFAULTABLE["repetition_penalty"])
Penalty = bounded(DEFAULTABLE["frequency_penalty"])


def str_or_list(text: Any, items: Any) -> Any:
    """`text | items`, told apart by the input's type, so an error names what was sent
    (`stop.list.0: String should have at least 1 character`, not the other member's complaint)."""
    return Annotated[Annotated[text, Tag("str")] | Annotated[items, Tag("list")],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Annotated[str_or_list(StopText, Annotated[list[StopText], Field(max_length=MAX_STOP)]) | None,
                 Field(description=f"Up to {MAX_STOP} stop sequences of at most {MAX_STOP_CHARS} characters.")]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
PromptText = Annotated[str, Field(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = str_or_list(PromptText, PromptIds)
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


def prompts_shape(value: object) -> str:
    """Which of the four shapes a completion's `prompt` is, from its first item, so the union is
    validated against that one member and an error names it (`prompt.texts.2`)."""
    if not isinstance(value, list):
        return "text"
    first = value[0] if value else None
    if isinstance(first, list):
        return "id_lists"
    return "texts" if isinstance(first, str) else "ids"


Prompts = Annotated[
    Annotated[PromptText, Tag("text")] | Annotated[PromptIds, Tag("ids")]
    | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag("id_lists")],
    Discriminator(prompts_shape)]


class Strict(BaseModel):
    """Unknown fields are errors, and no float may be NaN or infinite (every bound holds)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
