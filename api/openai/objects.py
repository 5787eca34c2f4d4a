"""Response bodies of the OpenAI-compatible API (and the small ones beside it), for `/openapi.json`.

Field for field what OpenAI sends (tests validate every answer and chunk with the openai SDK's
own types, strictly); galley's additions are marked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (a multiple of the block size)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # on the final usage, not on continuous_usage_stats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "galley"
    kind: Literal["generate", "embed", "classify", "onnx", "tabular", "image-classify", "torch"] = "generate"
    max_model_len: int | None  # context (generate) or longest input (encoders), in tokens; null until loaded
    sampling_defaults: dict[str, float | int] | None = Field(
        None, description="galley extension: what a request that leaves a sampling field (or max_tokens) out "
        "gets: the model's `sampling_defaults` option over its generation_config.json over the API's defaults; "
        "generative models, null until loaded.")
    architecture: str | None = Field(None, description="galley extension: the loaded version's architecture "
                                     "(config.json's, e.g. Qwen3ForCausalLM); generative models, null until loaded.")
    family: str | None = Field(None, description="galley extension: the loaded version's model family "
                               "(config.json's model_type, e.g. qwen3_moe); generative models, null until loaded.")
    backend: Literal["native", "generic"] | None = Field(
        None, description="galley extension: native (galley's fused decoder) or generic (the model's own "
        "transformers code over galley's paged KV cache); generative models, null until loaded.")
    modalities: list[Literal["text", "image"]] = Field(["text"], description="galley extension: the inputs it "
                                                       "takes (`image`: a vision-language model, images as "
                                                       "`image_url` content parts).")
    parent: str | None = Field(None, description="A LoRA adapter's base model (as vLLM's cards say); null for a "
                               "model with weights of its own.")
    adapters: list[str] = Field([], description="galley extension: the LoRA adapters registered over this model.")
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
    refusal: None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    refusal: None = None
    annotations: list[dict] = []
    reasoning: str | None = None  # vLLM's field: a thinking model's thoughts (absent for other models)
    reasoning_content: str | None = None  # the same, by vLLM's old (and DeepSeek's) name


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None  # on a call's first delta
    arguments: str  # the next piece of the arguments' JSON text


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None  # on a call's first delta
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None
    reasoning: str | None = None  # vLLM's field: a piece of a thinking model's thoughts
    reasoning_content: str | None = None  # the same, by vLLM's old (and DeepSeek's) name


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None

class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # with `include_usage`: on the last chunk; with `continuous_usage_stats`: on each


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


class TokenizeResponse(BaseModel):
    """vLLM's shape."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- the Responses API's answer (tests validate it with the openai SDK's own types) -------


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = []
    logprobs: list[dict] = []


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[dict] = []
    content: list[ReasoningTextPart]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    error: dict[str, str] | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    temperature: float
    top_p: float
    tool_choice: str | dict[str, str]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    reasoning: dict[str, str | None]
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default"] = "default"
    metadata: dict[str, str]
    user: str | None = None


class ResponseEvent(BaseModel):
    """One streamed event: `response.created`, `response.output_text.delta`, ... (OpenAI's
    `ResponseStreamEvent`), each with its `sequence_number`."""

    type: str
    sequence_number: int
