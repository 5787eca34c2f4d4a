"""Request and response bodies of /v1/embeddings and the native API (/api/v1/embed, predict,
generate); the same pydantic models validate requests and write /openapi.json."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from api.openai.schemas import (
    MAX_CONTEXT_TOKENS,
    MAX_NAME_CHARS,
    MAX_TOP_K,
    GalleyOptions,
    Prompt,
    SamplingFields,
    Strict,
    TokenId,
)

MAX_INPUTS = 2048
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CacheOptions(Strict):
    cache: bool | None = Field(None, description="false: skip the response cache for this request "
                               "(as does the header `Cache-Control: no-cache`)")


# ---- /v1/embeddings (OpenAI) -------------------------------------------------------------


def input_shape(value: object) -> str:
    """Which of the four shapes an embeddings `input` is, from its first item: the union is then
    validated against that one member, so an error names it (`input.list.3`), and a huge list
    is not validated four times over with an error per item (seconds holding the GIL)."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else None
    if isinstance(first, list):
        return "lists"
    return "ids" if isinstance(first, int) and not isinstance(first, bool) else "list"


EmbeddingInput = Annotated[
    Annotated[Text, Tag("str")] | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS), Tag("list")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS), Tag("lists")],
    Discriminator(input_shape)]


class EmbeddingRequest(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: EmbeddingInput = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each embedding is the base64 of its little-endian float32 bytes.")
    dimensions: int | None = Field(None, ge=1, le=1 << 20, description="Only the model's own dimension is supported.")
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    galley: CacheOptions | None = Field(None, description="galley extensions")

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---- /api/v1/embed ------------------------------------------------------------------------


class EmbedRequest(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    inputs: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    user: str | None = Field(None, max_length=256,
                             description="End-user id: the same user keeps landing on the same version of a split.")
    galley: CacheOptions | None = Field(None, description="galley extensions")

    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    dimensions: int
    model_version: str
    usage: EmbeddingUsage


# ---- /api/v1/predict ----------------------------------------------------------------------


class PredictParams(Strict):
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="How logits become scores; default softmax (sigmoid for multi-label models).")
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K, description="Return only the k best-scoring labels in "
                              "`scores`.")


class PredictRequest(Strict):
    """Exactly one of `input` and `inputs` (each may be left out, neither may be null)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["input"]}, {"required": ["inputs"]}]})

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: Text = None
    inputs: Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] = None
    params: PredictParams | None = None
    user: str | None = Field(None, max_length=256,
                             description="End-user id: the same user keeps landing on the same version of a split.")
    galley: CacheOptions | None = Field(None, description="galley extensions")

    @model_validator(mode="after")
    def _one_input(self) -> PredictRequest:
        if (self.input is None) == (self.inputs is None):
            raise ValueError("give exactly one of `input` (a string) or `inputs` (a list of strings)")
        return self


class NamedPredictRequest(PredictRequest):
    """/api/v1/models/{name}/predict: the path names the model, the body does not."""

    model: ClassVar[None] = None


class PredictResponse(BaseModel):
    """For `input`: one prediction; for `inputs`: `prediction`, `confidence`, `scores` are lists."""

    model: str
    prediction: str | list[str]
    confidence: float | list[float]
    scores: dict[str, float] | list[dict[str, float]]
    model_version: str
    latency_ms: float


# ---- /api/v1/generate ---------------------------------------------------------------------


class GenerateRequest(SamplingFields):
    prompt: Prompt = Field(description="A string or a list of token ids (each below the model's vocabulary size).")
    n: Literal[1] = Field(1, description="One generation per request (several choices: /v1/completions).")
    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS, description="Default 128.")
    galley: GalleyOptions | None = Field(None, description="galley extensions")


class NamedGenerateRequest(GenerateRequest):
    """/api/v1/models/{name}/generate: the path names the model, the body does not."""

    model: ClassVar[None] = None


class GenerateUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class GenerateResponse(BaseModel):
    model: str
    text: str
    finish_reason: str | None
    usage: GenerateUsage
    model_version: str
    latency_ms: float


class GenerateEvent(BaseModel):
    """One SSE event: `{"token": "..."}` per piece of text, then `{"type": "done", "usage", ...}`
    (or `{"type": "error", "error": {...}}`)."""

    token: str | None = None
    type: Literal["done", "error"] | None = None
    usage: GenerateUsage | None = None
    finish_reason: str | None = None
    model_version: str | None = None
    error: dict | None = None
