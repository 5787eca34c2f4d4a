"""Request and response bodies of the native API (/api/v1/embed, predict, generate); the same
pydantic models validate requests and write /openapi.json. (/v1/embeddings: `api.openai.embeddings`.)"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.openai.embeddings import MAX_INPUTS, CacheOptions, EmbeddingUsage, Text
from api.openai.fields import MAX_CONTEXT_TOKENS, MAX_NAME_CHARS, Prompt, Strict
from api.openai.schemas import GalleyOptions, SamplingFields
from services.sampling import MAX_TOP_K

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


class TextIn(Strict):
    text: Text


class ImageIn(Strict):
    image: str = Field(min_length=1, description="An image, base64 or a data: URL (remote URLs are not fetched).")


class FeaturesIn(Strict):
    features: Annotated[list[float], Field(min_length=1, max_length=1 << 16)] = Field(
        description="One row of a tabular model's features, in its order.")


PredictItem = Text | TextIn | FeaturesIn | ImageIn


class PredictParams(Strict):
    version: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS,
                                description="The model version to run (as `name@version`).")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="How logits become scores; default softmax (sigmoid for multi-label models).")
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K, description="Return only the k best-scoring labels in "
                              "`scores`.")


class PredictRequest(Strict):
    """Exactly one of `input` and `inputs` (each may be left out, neither may be null)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["input"]}, {"required": ["inputs"]}]})

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: PredictItem = Field(None, description="A text (a string or `{\"text\"}`), `{\"features\": [...]}` "
                               "for a tabular model, or `{\"image\"}` for an image classifier.")
    inputs: Annotated[list[PredictItem], Field(min_length=1, max_length=MAX_INPUTS)] = None
    params: PredictParams | None = None
    user: str | None = Field(None, max_length=256,
                             description="End-user id: the same user keeps landing on the same version of a split.")
    galley: CacheOptions | None = Field(None, description="galley extensions")

    @model_validator(mode="after")
    def _one_input(self) -> PredictRequest:
        if (self.input is None) == (self.inputs is None):
            raise ValueError("give exactly one of `input` or `inputs` (a list)")
        return self

    def items(self) -> list[str | list[float] | dict]:
        """Each input as a text, a row of features, or `{"image": ...}`."""
        given = [self.input] if self.input is not None else self.inputs
        return [x if isinstance(x, str) else x.text if isinstance(x, TextIn) else x.features
                if isinstance(x, FeaturesIn) else {"image": x.image} for x in given]


class NamedPredictRequest(PredictRequest):
    """/api/v1/models/{name}/predict: the path names the model, the body does not."""

    model: ClassVar[None] = None


class PredictResponse(BaseModel):
    """For `input`: one prediction; for `inputs`: `prediction`, `confidence`, `scores` are lists."""

    model: str
    prediction: str | float | list[str | float] = Field(description="A label, or a regressor's value.")
    confidence: float | None | list[float | None] = Field(description="The label's probability; null for a "
                                                          "regressor.")
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
