"""Request and response bodies of the OpenAI-compatible API, defined once.

The same pydantic models validate incoming JSON and generate `/openapi.json`, so the spec
cannot drift from what the handlers accept. Field names and ranges follow OpenAI; vLLM's
extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`) are
marked as such.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from services.inference.params import SamplingOptions
from services.inference.requests import ChatInput, PromptInput

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 512  # per stop string: the detokenizer matches every stop after every token
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary comes near; the model's own size is checked per request
MAX_TOP_K = 1_000_000  # beyond any vocabulary; the sampler clamps to the model's
MAX_CONTEXT_TOKENS = 1 << 20  # bound of max_tokens: no served model has a longer context
MAX_NAME_CHARS = 256  # model names and end-user ids
GENERATION_MAX_BODY_BYTES = 4 * 1024 * 1024  # a generation's body: a long context's prompt with room to spare


def str_or_list(text: Any, items: Any) -> Any:
    """`text | items`, told apart by the input's type, so an error names what was sent
    (`stop.list.0: String should have at least 1 character`, not the other member's complaint)."""
    return Annotated[Annotated[text, Tag("str")] | Annotated[items, Tag("list")],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Annotated[str_or_list(StopText, Annotated[list[StopText], Field(max_length=MAX_STOP)]) | None,
                 Field(description=f"Up to {MAX_STOP} stop sequences of at most {MAX_STOP_CHARS} characters.")]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Prompt = str_or_list(Annotated[str, Field(min_length=1)], Annotated[list[TokenId], Field(min_length=1)])
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


MAX_N = 16  # choices per request: each is a whole generation (its own prefill and KV blocks)


class Strict(BaseModel):
    """Unknown fields are errors, and no float may be NaN or infinite (every bound holds)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class GalleyOptions(Strict):
    on_disconnect: Literal["continue", "cancel"] | None = Field(
        None, description="When the client leaves: finish and store the answer, or cancel it. "
        "Default: continue for conversation streams, cancel for plain completions.")
    cache: bool | None = Field(None, description="false: skip the response cache for this request "
                               "(as does the header `Cache-Control: no-cache`)")


class SamplingFields(Strict):
    """Fields shared by chat and text completions."""

    max_body_bytes: ClassVar[int] = GENERATION_MAX_BODY_BYTES  # read by api.validation.parse_body

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Below 1e-5: greedy (as 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N, description=f"Choices to generate (at most {MAX_N}); more than 1 not in a "
                   "conversation.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS)
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="vLLM extension; -1 or 0 disables; "
                              "above the vocabulary: the whole vocabulary.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extension.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0, description="vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS.")
    stop_token_ids: StopTokenIds | None = Field(None, description=f"vLLM extension; at most {MAX_STOP_TOKEN_IDS}, "
                                                "each below the model's vocabulary size.")
    cache_salt: str | None = Field(None, max_length=MAX_NAME_CHARS, description="vLLM extension: only requests "
                                   "with the same salt share prefix-cache entries (always within one tenant).")
    priority: Literal["high", "normal", "low"] | None = Field(
        None, description="galley extension: scheduling class. Default `normal`, or the tenant's `max_priority` "
        "when that is lower; above the tenant's `max_priority`: 403."
    )
    galley: GalleyOptions | None = Field(None, description="galley extensions")

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, seed=self.seed, stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
        )

    def generation_fields(self) -> dict[str, Any]:
        """What every generation input takes from the body (`services.inference.requests`)."""
        return {"model": self.model, "options": self.sampling_options(), "n": self.n, "user": self.user,
                "priority": self.priority,
                "include_usage": bool(self.stream_options and self.stream_options.include_usage),
                "on_disconnect": self.galley.on_disconnect if self.galley else None,
                "cache_salt": self.cache_salt or ""}


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [  # for the spec: `_check_logprobs`, and `check_n`
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},  # of inference
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": {"required": ["conversation_id"], "properties": {"conversation_id": {"type": "string"}}},
         "then": {"properties": {"n": {"const": 1}}}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    conversation_id: str | None = Field(
        None, max_length=MAX_NAME_CHARS, description="galley extension: continue a stored conversation (its history "
        "is prepended, the new messages and the answer are stored)")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def chat_input(self) -> ChatInput:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        return ChatInput(**self.generation_fields(), max_tokens=self.max_completion_tokens or self.max_tokens,
                         logprobs=(self.top_logprobs or 0) if self.logprobs else None, messages=messages,
                         conversation_id=self.conversation_id)


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="A string or a list of token ids (each below the model's vocabulary size).")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False

    def prompt_input(self) -> PromptInput:
        return PromptInput(**self.generation_fields(), max_tokens=self.max_tokens, logprobs=self.logprobs,
                           prompt=self.prompt, default_max_tokens=16)
    suffix: None = None


# ---- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "galley"
    kind: Literal["generate", "embed", "classify"] = "generate"
    max_model_len: int | None  # context (generate) or longest input (encoders), in tokens; null until loaded
    ready: bool  # a version is loaded and can answer now; false: the first request loads it (cold)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "loading", "draining", "stalled", "storage_failing"]
