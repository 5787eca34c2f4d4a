"""`POST /v1/responses` (OpenAI's Responses API): its request body, parsed into plain values for
`services.inference.responses_api`, and the shape of its answer for `/openapi.json`.

What a self-hosted model cannot do is a 400 naming the field: built-in tools (`web_search`,
`file_search`, ...), `background`, `include` values that need them, images by `file_id` (there is
no files API), file and audio input, `truncation: auto`. OpenAI's fields that mean nothing here are
accepted and ignored (as on chat). Its answer's shape is in `api.openai.objects`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from api.errors import ParamError
from api.openai.fields import (
    GENERATION_MAX_BODY_BYTES,
    MAX_CONTEXT_TOKENS,
    MAX_NAME_CHARS,
    MinP,
    Penalty,
    RepetitionPenalty,
    Stop,
    Strict,
    Temperature,
    TopK,
    TopP,
    sampling_field,
    str_or_list,
)
from api.openai.tooling import MAX_TOOLS, FunctionName, Schema
from services.inference import OutputFormat, ResponseInput, ToolUse
from services.sampling import SamplingOptions

IGNORED = "Accepted and ignored: it has no meaning for a self-hosted model."
MAX_ITEMS = 2048


class InputText(Strict):
    type: Literal["input_text"]
    text: str


class OutputText(Strict):
    """An earlier answer's text, sent back as input (as the SDK dumps it)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(Strict):
    """An image, for a vision-language model (as `image_url` parts on chat completions)."""

    type: Literal["input_image"]
    image_url: str | None = Field(None, min_length=1, description="A `data:image/...;base64,` URL or bare "
                                  "base64; remote URLs are not fetched (400).")
    file_id: str | None = Field(None, max_length=MAX_NAME_CHARS, description="Refused (400): there is no files API.")
    detail: Literal["auto", "low", "high", "original"] | None = Field(
        None, description="Accepted; the model's processor decides the resolution.")

    def chat_part(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self.image_url}}


Part = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]


class MessageItem(Strict):
    type: Literal["message"] | None = Field(None, description="May be left out.")
    role: Literal["user", "assistant", "system", "developer"]
    content: str_or_list(str, list[Part]) = Field(description="Text, or parts: text and `input_image` (no file "
                                                  "or audio).")
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.refusal if isinstance(part, Refusal) else part.text for part in self.content
                       if not isinstance(part, InputImage))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """Its text, or with images its parts in order as chat's vision path reads them."""
        if isinstance(self.content, str) or not any(isinstance(part, InputImage) for part in self.content):
            return self.text()
        return [part.chat_part() if isinstance(part, InputImage) else {
            "type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text} for part in self.content]


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(max_length=MAX_NAME_CHARS)
    name: FunctionName
    arguments: str = Field(description="JSON text, as the model wrote it.")
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = Field(None, max_length=MAX_NAME_CHARS, description="Accepted and ignored.")


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=MAX_NAME_CHARS)
    output: str_or_list(str, list[InputText])
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningItem(Strict):
    """An earlier answer's thoughts, sent back: accepted, not shown to the model (as on chat)."""

    type: Literal["reasoning"]
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def item_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(item_type)]


class FunctionTool(Strict):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: Schema | None = Field(None, description="The arguments' JSON schema (default: any object).")
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: FunctionName


class ResponseTextFormat(Strict):
    type: Literal["text"]


class ResponseJsonObject(Strict):
    type: Literal["json_object"]


class ResponseJsonSchema(Strict):
    type: Literal["json_schema"]
    name: FunctionName
    schema_: Schema = Field(alias="schema")
    description: str | None = None
    strict: bool | None = Field(None, description="Always enforced: the answer is decoded under the schema.")


class TextConfig(Strict):
    format: Annotated[ResponseTextFormat | ResponseJsonObject | ResponseJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=IGNORED)


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="`none` turns a thinking model's thoughts off where its chat template can "
        "(`enable_thinking: false`); other values are accepted and ignored.")
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description=IGNORED)
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description=IGNORED)


class ResponseStreamOptions(Strict):
    include_obfuscation: bool | None = Field(None, description=IGNORED)


class ResponseInputFields(Strict):
    """What makes a response's prompt: shared by `POST /v1/responses` and its token count."""

    max_body_bytes: ClassVar[int] = GENERATION_MAX_BODY_BYTES

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    input: str_or_list(str, Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS)]) = Field(
        description="Text (a user message), or items: messages, function calls and their outputs, earlier "
        "thoughts (not shown to the model).")
    instructions: str | None = Field(None, description="A system message first; not carried into a follow-up.")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS, description="Function tools only.")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(
        None, description="`required` and a named function are enforced by constrained decoding.")
    parallel_tool_calls: bool | None = Field(None, description="Default true.")
    text: TextConfig | None = Field(None, description="`format`: `json_object` or `json_schema`, enforced.")
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(None, max_length=MAX_NAME_CHARS, description="Continue a stored "
                                             "response of this key's tenant (its items come first).")
    truncation: Literal["disabled"] | None = Field(None, description="Only `disabled`: a too-long input is a 400.")

    @field_validator("tools", "tool_choice", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else [value]):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                where = f" (item {i})" if isinstance(value, list) else ""
                raise ValueError(f"the built-in tool {kind!r}{where} is not supported here: only `function` tools")
        return value

    @model_validator(mode="after")
    def _check_images(self) -> ResponseInputFields:
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            for j, part in enumerate(item.content if isinstance(item, MessageItem) else ()):
                if isinstance(part, InputImage) and part.image_url is None:
                    where = f"input.{i}.content.{j}"
                    raise ParamError(where, f"{where}: images by `file_id` are not supported here (there is no "
                                     "files API): send `image_url`, a data: URL" if part.file_id is not None
                                     else f"{where}: an `input_image` needs `image_url`")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ResponseInputFields:
        names = [tool.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ParamError("tools", "tools: function names must be unique")
        if isinstance(self.tool_choice, FunctionChoice) and self.tool_choice.name not in names:
            raise ParamError("tool_choice", f"tool_choice names {self.tool_choice.name!r}, which is not in `tools`")
        if self.tool_choice == "required" and not names:
            raise ParamError("tool_choice", "tool_choice `required` needs `tools`")
        return self

    def items(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        out = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"type": "message", "role": item.role, "content": item.chat_content()})
            elif isinstance(item, FunctionCallItem):
                out.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                            "arguments": item.arguments})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"type": "function_call_output", "call_id": item.call_id, "output": item.text()})
        return out

    def item_params(self) -> list[str]:
        """Where each of `items()` is in the request, to name it in an error."""
        if isinstance(self.input, str):
            return ["input"]
        return [f"input.{i}" for i, item in enumerate(self.input) if not isinstance(item, ReasoningItem)]

    def output_format(self) -> OutputFormat | None:
        fmt = self.text.format if self.text else None
        if isinstance(fmt, ResponseJsonObject):
            return OutputFormat("json_object", param="text.format")
        if isinstance(fmt, ResponseJsonSchema):
            return OutputFormat("json_schema", fmt.schema_, param="text.format")
        return None

    def tool_use(self) -> ToolUse:
        choice = self.tool_choice or "auto"
        tools = tuple({"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                      for tool in self.tools or ())
        return ToolUse(tools, choice.name if isinstance(choice, FunctionChoice) else choice,
                       self.parallel_tool_calls is not False)

    def prompt_fields(self) -> dict[str, Any]:
        """The `ResponseInput` fields that make the prompt."""
        thinking_off = self.reasoning is not None and self.reasoning.effort == "none"
        return {"model": self.model, "items": self.items(), "item_params": self.item_params(),
                "instructions": self.instructions,
                "tools": self.tool_use(), "output": self.output_format(),
                "previous_response_id": self.previous_response_id,
                "template_kwargs": {"enable_thinking": False} if thinking_off else {}}

    def response_input(self) -> ResponseInput:
        return ResponseInput(**self.prompt_fields())


class InputTokensRequest(ResponseInputFields):
    """`POST /v1/responses/input_tokens` (`client.responses.input_tokens.count`)."""


class ResponseCreateRequest(ResponseInputFields):
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS)
    temperature: Temperature | None = sampling_field("temperature")
    top_p: TopP | None = sampling_field("top_p")
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = Field(None, description="Default true: keep the response (as a conversation of the "
                               "tenant) so that `previous_response_id` and GET can find it.")
    background: Literal[False] | None = Field(None, description="Only false: responses run in the foreground.")
    include: list[Literal["reasoning.encrypted_content"]] | None = Field(
        None, max_length=8, description="Only `reasoning.encrypted_content`, accepted and ignored (thoughts are "
        "never encrypted here).")
    top_logprobs: int | None = Field(None, ge=0, le=0, description="Only 0: no logprobs on responses.")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Kept with the response.")
    user: str | None = Field(None, max_length=MAX_NAME_CHARS, description="Keys a traffic split.")
    safety_identifier: str | None = Field(None, max_length=MAX_NAME_CHARS, description=IGNORED)
    prompt_cache_key: str | None = Field(None, max_length=MAX_NAME_CHARS, description=IGNORED)
    prompt_cache_retention: str | None = Field(None, max_length=32, description=IGNORED)
    service_tier: str | None = Field(None, max_length=32, description=IGNORED)
    priority: Literal["high", "normal", "low"] | None = Field(None, description="galley extension: scheduling "
                                                              "class (as on chat completions).")
    # vLLM's sampling extensions on this endpoint (guidellm sends `stop: null` and `ignore_eos`)
    stop: Stop = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="vLLM extension.")
    top_k: TopK | None = sampling_field("top_k", "vLLM extension.")
    min_p: MinP | None = sampling_field("min_p", "vLLM extension.")
    repetition_penalty: RepetitionPenalty | None = sampling_field("repetition_penalty", "vLLM extension.")
    frequency_penalty: Penalty | None = sampling_field("frequency_penalty", "vLLM extension.")
    presence_penalty: Penalty | None = sampling_field("presence_penalty", "vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS.")

    def settings(self) -> dict[str, Any]:
        """How the Response object shows its request."""
        text = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format \
            else {"type": "text"}
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "tool_choice": choice or "auto",  # (temperature and top_p: as sampled, services.inference.responses_api)
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "text": {"format": text, "verbosity": self.text.verbosity if self.text and self.text.verbosity
                     else "medium"},
            "reasoning": {"effort": self.reasoning.effort, "summary": self.reasoning.summary} if self.reasoning
            else {"effort": None, "summary": None},
            "metadata": self.metadata or {}, "user": self.user,
        }

    def response_input(self) -> ResponseInput:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        options = SamplingOptions(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)
        return ResponseInput(**self.prompt_fields(), options=options, max_output_tokens=self.max_output_tokens,
                             store=self.store is not False, user=self.user, priority=self.priority,
                             settings=self.settings())
