"""Chat messages as OpenAI clients send them, history included: what `message.model_dump()` of
an SDK answer gives back (`refusal`, `annotations`, `audio`, `function_call`, `tool_calls`;
LiteLLM's `provider_specific_fields`) and `tool` results, turned into the dicts a chat template renders."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from api.openai.fields import MAX_NAME_CHARS, Strict, str_or_list
from services.answers import parsed_arguments


class TextPart(Strict):
    type: Literal["text"]
    text: str


class RefusalPart(Strict):
    """An assistant's refusal, sent back in the history: its text is the message's text."""

    type: Literal["refusal"]
    refusal: str


class ImageUrl(Strict):
    url: str = Field(min_length=1, description="A `data:image/...;base64,` URL or bare base64; remote URLs are not "
                     "fetched (400).")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; the model's processor "
                                                          "decides the resolution.")


class ImageUrlPart(Strict):
    """An image, for a vision-language model (its card's `modalities` include `image`)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | RefusalPart | ImageUrlPart, Field(discriminator="type")]


class FunctionCall(Strict):
    name: str = Field(max_length=MAX_NAME_CHARS)
    arguments: str = Field(description="JSON text, as the model wrote it.")


class ToolCall(Strict):
    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str_or_list(str, list[ContentPart]) | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's calls, in the history.")
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS, description="A `tool` message: the call "
                                     "it answers.")
    refusal: str | None = Field(None, description="Accepted from an SDK's `model_dump()`; not shown to the model.")
    annotations: list[dict[str, Any]] | None = Field(None, description="Accepted and ignored.")
    audio: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    function_call: FunctionCall | None = Field(None, description="Deprecated form of `tool_calls`; accepted and "
                                               "ignored.")
    reasoning_content: str | None = Field(None, description="Accepted and ignored (a reasoning model's thoughts "
                                          "are not sent back to it).")
    reasoning: str | None = Field(None, description="vLLM's newer name of `reasoning_content`; accepted and ignored.")
    provider_specific_fields: dict[str, Any] | None = Field(None, description="LiteLLM's `Message.model_dump()` "
                                                            "adds it; accepted and ignored.")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text if isinstance(part, TextPart) else part.refusal
                           for part in self.content if not isinstance(part, ImageUrlPart))
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's convention, as vLLM passes it):
        `developer` is `system`, a tool call's arguments are an object when they parse as JSON. A
        message with images keeps its parts in order (text parts and `image_url` parts), for the
        model's processor (`services.inference.vision`)."""
        content: str | list[dict[str, Any]] = self.text()
        if isinstance(self.content, list) and any(isinstance(part, ImageUrlPart) for part in self.content):
            content = [{"type": "image_url", "image_url": {"url": part.image_url.url}} if isinstance(part, ImageUrlPart)
                       else {"type": "text", "text": part.text if isinstance(part, TextPart) else part.refusal}
                       for part in self.content]
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": parsed_arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out
