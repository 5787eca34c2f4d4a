"""Request bodies of the OpenAI-compatible API, defined once (responses: `api.openai.objects`).

The same pydantic models validate incoming JSON and generate `/openapi.json`, so the spec
cannot drift from what the handlers accept. Field names, ranges and nullability follow OpenAI
(`null` means the default wherever OpenAI allows it); vLLM's extensions are marked as such;
OpenAI fields that mean nothing for a self-hosted model are accepted and ignored (`Ignored`,
listed in docs/api.md). Any other field is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from api.errors import ParamError
from api.openai.fields import (
    GENERATION_MAX_BODY_BYTES,
    MAX_CHOICES,
    MAX_CONTEXT_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_NAME_CHARS,
    MAX_STOP_TOKEN_IDS,
    MinP,
    Penalty,
    Prompts,
    RepetitionPenalty,
    Stop,
    StopTokenIds,
    Strict,
    Temperature,
    TopK,
    TopP,
    sampling_field,
)
from api.openai.messages import ChatMessage
from api.openai.tooling import GuidedFields, ToolFields
from services.inference import ChatInput, PromptInput
from services.sampling import SamplingOptions

IGNORED = "Accepted and ignored: it has no meaning for a self-hosted model."
# apply_chat_template's own arguments: set by the server or by a top-level field, never by the template's variables
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_TEMPLATE_KWARGS = 64

TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-100.0, le=100.0)]],
                      Field(max_length=MAX_LOGIT_BIAS)]
TemplateKwargs = Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)]


class StreamOptions(Strict):
    include_usage: bool | None = Field(None, description="A last chunk with the usage (and `choices: []`).")
    continuous_usage_stats: bool | None = Field(None, description="vLLM extension: with `include_usage`, every "
                                                "chunk also carries the usage so far.")
    include_obfuscation: bool | None = Field(None, description="Accepted and ignored: OpenAI pads chunks against "
                                             "length side channels on its shared service; galley adds no padding.")


class GalleyOptions(Strict):
    on_disconnect: Literal["continue", "cancel"] | None = Field(
        None, description="When the client leaves: finish and store the answer, or cancel it. "
        "Default: continue for conversation streams, cancel for plain completions.")
    cache: bool | None = Field(None, description="false: skip the response cache for this request "
                               "(as does the header `Cache-Control: no-cache`)")
    speculative: bool | None = Field(None, description="false: no speculative drafts for this request (where the "
                                     "server has `[speculative]` on; the output is the same either way)")


class SamplingFields(Strict):
    """Fields shared by chat and text completions (and the native generate)."""

    max_body_bytes: ClassVar[int] = GENERATION_MAX_BODY_BYTES  # read by api.validation.parse_body

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    stream: bool | None = Field(None, description="Default false.")
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = sampling_field("temperature")
    top_p: TopP | None = sampling_field("top_p")
    n: int | None = Field(None, ge=1, le=MAX_N, description=f"Choices per prompt (default 1, at most {MAX_N}); "
                          "more than 1 not in a conversation.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS, description="Default: the model's "
                                   "`sampling_defaults.max_tokens`, else 4096 (chat; within the context), 16 (text).")
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    frequency_penalty: Penalty | None = sampling_field("frequency_penalty")
    presence_penalty: Penalty | None = sampling_field("presence_penalty")
    logit_bias: LogitBias | None = Field(None, description="Token id (a decimal string, as OpenAI's) -> a bias in "
                                         f"[-100, 100] added to its logit; at most {MAX_LOGIT_BIAS} entries, each id "
                                         "below the model's vocabulary size.")
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    top_k: TopK | None = sampling_field("top_k", "vLLM extension.")
    min_p: MinP | None = sampling_field("min_p", "vLLM extension.")
    repetition_penalty: RepetitionPenalty | None = sampling_field("repetition_penalty", "vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS.")
    min_tokens: int = Field(0, ge=0, le=MAX_CONTEXT_TOKENS, description="vLLM extension: no EOS or stop token (and "
                            "no stop string) ends the completion before this many tokens.")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string (or the stop "
                                             "token's text) at the end of the text.")
    skip_special_tokens: bool = Field(True, description="vLLM extension: false keeps special tokens' text.")
    stop_token_ids: StopTokenIds | None = Field(None, description=f"vLLM extension; at most {MAX_STOP_TOKEN_IDS}, "
                                                "each below the model's vocabulary size.")
    cache_salt: str | None = Field(None, max_length=MAX_NAME_CHARS, description="vLLM extension: only requests "
                                   "with the same salt share prefix-cache entries (always within one tenant).")
    priority: Literal["high", "normal", "low"] | None = Field(
        None, description="galley extension: scheduling class. Default `normal`, or the tenant's `max_priority` "
        "when that is lower; above the tenant's `max_priority`: 403."
    )
    galley: GalleyOptions | None = Field(None, description="galley extensions")

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, seed=self.seed, stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            speculative=not (self.galley and self.galley.speculative is False),
        )

    def generation_fields(self) -> dict[str, Any]:
        """What every generation input takes from the body (`services.inference.requests`)."""
        options = self.stream_options
        return {"model": self.model, "options": self.sampling_options(), "n": self.n or 1, "user": self.user,
                "priority": self.priority,
                "include_usage": bool(options and options.include_usage),
                "continuous_usage": bool(options and options.continuous_usage_stats),
                "on_disconnect": self.galley.on_disconnect if self.galley else None,
                "cache_salt": self.cache_salt or ""}


class Ignored(Strict):
    """OpenAI's chat fields that a self-hosted model has no use for: accepted, then ignored."""

    store: bool | None = Field(None, description=IGNORED + " (Nothing is kept for OpenAI's evals; conversations: "
                               "`conversation_id`.)")
    metadata: dict[str, str] | None = Field(None, max_length=16, description=IGNORED)
    service_tier: str | None = Field(None, max_length=32, description=IGNORED)
    prompt_cache_key: str | None = Field(None, max_length=MAX_NAME_CHARS, description=IGNORED + " (The prefix "
                                         "cache is automatic; `cache_salt` keeps requests apart.)")
    prompt_cache_retention: str | None = Field(None, max_length=32, description=IGNORED)
    safety_identifier: str | None = Field(None, max_length=MAX_NAME_CHARS, description=IGNORED)
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=IGNORED)
    reasoning_effort: str | None = Field(None, max_length=32, description="Accepted and ignored for now.")
    modalities: list[Literal["text"]] | None = Field(None, max_length=2, description="Only text.")
    audio: None = Field(None, description="Only null: audio output is not supported.")
    prediction: dict[str, Any] | None = Field(None, description=IGNORED + " (A speed hint: the output is the same.)")
    web_search_options: dict[str, Any] | None = Field(None, description="Accepted and ignored: the model answers "
                                                      "without searching.")


class ChatCompletionRequest(SamplingFields, Ignored, ToolFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [  # for the spec: `_check_logprobs`, `_check_template`
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},  # and `check_n`
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},  # of inference
        {"if": {"required": ["conversation_id"], "properties": {"conversation_id": {"type": "string"}}},
         "then": {"properties": {"n": {"enum": [1, None]}}}},
        {"if": {"required": ["continue_final_message"], "properties": {"continue_final_message": {"const": True}}},
         "then": {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}}},
        {"properties": {"chat_template_kwargs": {
            "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}}}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    conversation_id: str | None = Field(
        None, max_length=MAX_NAME_CHARS, description="galley extension: continue a stored conversation (its history "
        "is prepended, the new messages and the answer are stored)")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS)
    logprobs: bool | None = Field(None, description="Default false.")
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: TemplateKwargs | None = Field(None, description="vLLM extension: variables for the chat "
                                                        "template (e.g. `enable_thinking`).")
    add_generation_prompt: bool = Field(True, description="vLLM extension: end the prompt with the assistant's "
                                        "header.")
    continue_final_message: bool = Field(False, description="vLLM extension: continue the last (assistant) "
                                         "message instead of starting a new one; needs add_generation_prompt false.")

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_template(self) -> ChatCompletionRequest:
        check_template_fields(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def chat_input(self) -> ChatInput:
        return ChatInput(**self.generation_fields(), max_tokens=self.max_completion_tokens or self.max_tokens,
                         logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                         messages=[m.for_template() for m in self.messages], conversation_id=self.conversation_id,
                         template_kwargs=self.template_kwargs(), output=self.output_format(), tools=self.tool_use())


def check_template_fields(kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                          continue_final_message: bool) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
    if reserved:
        raise ParamError("chat_template_kwargs", f"chat_template_kwargs may not set {reserved[0]!r}: the server "
                         "(or a top-level field) sets it")
    if add_generation_prompt and continue_final_message:
        raise ParamError("continue_final_message",
                         "continue_final_message continues the last message, so add_generation_prompt must be false")


class CompletionRequest(SamplingFields, GuidedFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [  # for the spec: `_check_echo`
        {"if": {"required": ["echo"], "properties": {"echo": {"const": True}}},
         "then": {"properties": {"logprobs": {"type": "null"}}}},
    ]})

    prompt: Prompts = Field(description="A string, a list of token ids, or a list of either (one choice, or n, "
                            "per prompt: prompt i's choices have indexes i*n to i*n+n-1); token ids must be below "
                            "the model's vocabulary size.")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = Field(None, description="The prompt's text starts each choice's text (not with logprobs).")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Only equal to n: every generated choice is "
                                "returned.")
    suffix: str | None = Field(None, max_length=0, description="Not supported (no fill-in-the-middle): null or empty.")

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        if isinstance(value, str) and value:
            raise ValueError("suffix is not supported: this server does not fill in the middle; send null or omit it")
        return value

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise ParamError("best_of", f"best_of ({self.best_of}) must equal n ({n}) or be left out: galley "
                             "returns every choice it generates, it does not rank them")
        num_prompts = len(self.prompt) if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) \
            else 1
        if num_prompts * n > MAX_CHOICES:
            raise ParamError("n", f"{num_prompts} prompts with n={n} make {num_prompts * n} choices, over the limit of "
                             f"{MAX_CHOICES} per request")
        if self.echo and self.logprobs is not None:
            raise ParamError("echo", "echo with logprobs is not supported (the prompt's logprobs are not computed)")
        return self

    def prompt_input(self) -> PromptInput:
        return PromptInput(**self.generation_fields(), max_tokens=self.max_tokens, logprobs=self.logprobs,
                           prompt=self.prompt, echo=bool(self.echo), default_max_tokens=16,
                           output=self.output_format())
