"""The chat fields for tools and structured output, as OpenAI (and vLLM) define them, parsed
into plain values for the services (`ToolUse`, `OutputFormat`); the work is in
`services.inference.tools` and `services.inference.structured`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from api.errors import ParamError
from api.openai.fields import Strict
from services.inference import OutputFormat, ToolUse

MAX_TOOLS = 128  # OpenAI's limit
MAX_CHOICE_STRINGS = 1024
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
Schema = dict[str, Any]


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: Schema | None = Field(None, description="The arguments' JSON schema (default: any object).")
    strict: bool | None = Field(None, description="Arguments always match `parameters` with `tool_choice` "
                                "`required` or this function's name (constrained decoding); with `auto` they "
                                "are the model's own.")


class ChatTool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class JsonSchemaFormat(Strict):
    name: FunctionName
    description: str | None = None
    schema_: Schema | None = Field(None, alias="schema", description="The answer's JSON schema (default: any object).")
    strict: bool | None = Field(None, description="Always enforced: the answer is decoded under the schema.")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: Schema | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, max_length=MAX_CHOICE_STRINGS)
    grammar: str | None = None
    json_object: bool | None = None


class GuidedFields(Strict):
    """vLLM's structured-output fields (chat and text completions)."""

    guided_json: Schema | str | None = Field(None, description="vLLM extension: the answer matches this JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM extension: the answer matches this regular expression.")
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICE_STRINGS, description="vLLM extension: the "
                                            "answer is one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM extension: the answer matches this Lark grammar "
                                       "(llguidance's dialect).")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension: one of `json`, "
                                                         "`regex`, `choice`, `grammar`, `json_object`.")

    @model_validator(mode="after")
    def _check_formats(self) -> GuidedFields:
        if len(self.output_formats()) > 1:
            raise ValueError("give one of response_format, guided_json, guided_regex, guided_choice, "
                             "guided_grammar, structured_outputs")
        return self

    def output_format(self) -> OutputFormat | None:
        formats = self.output_formats()
        return formats[0] if formats else None

    def output_formats(self) -> list[OutputFormat]:
        found = []
        fmt = getattr(self, "response_format", None)
        if isinstance(fmt, JsonObjectFormat):
            found.append(OutputFormat("json_object"))
        elif isinstance(fmt, JsonSchemaResponseFormat):
            schema = fmt.json_schema.schema_
            found.append(OutputFormat("json_schema", schema) if schema is not None else OutputFormat("json_object"))
        vllm = {"guided_json": ("json_schema", self.guided_json), "guided_regex": ("regex", self.guided_regex),
                "guided_choice": ("choice", self.guided_choice), "guided_grammar": ("grammar", self.guided_grammar)}
        found += [OutputFormat(kind, value, param) for param, (kind, value) in vllm.items() if value is not None]
        so = self.structured_outputs
        if so is not None:
            given = [(kind, value) for kind, value in (("json_schema", so.json_), ("regex", so.regex),
                                                       ("choice", so.choice), ("grammar", so.grammar))
                     if value is not None]
            given += [("json_object", None)] if so.json_object else []
            if len(given) != 1:
                raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar, json_object")
            found.append(OutputFormat(*given[0], param="structured_outputs"))
        return found


class ToolFields(GuidedFields):
    """Tools and structured output on a chat completion."""

    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default `auto` with tools. `required` and a named function are enforced: the answer is "
        "a call in the model's own tool-call format with arguments matching the function's schema.")
    parallel_tool_calls: bool | None = Field(None, description="Default true: an answer may hold several calls.")
    response_format: ResponseFormat | None = Field(None, description="`json_object` or `json_schema`, enforced by "
                                                   "constrained decoding; a schema feature that cannot be enforced "
                                                   "is a 400 naming it.")

    @model_validator(mode="after")
    def _check_tools(self) -> ToolFields:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ParamError("tools", "tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ParamError("tool_choice",
                             f"tool_choice names {self.tool_choice.function.name!r}, which is not in `tools`")
        if self.tool_choice == "required" and not names:
            raise ParamError("tool_choice", "tool_choice `required` needs `tools`")
        return self

    def tool_use(self) -> ToolUse:
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        tools = tuple(tool.model_dump(exclude_none=True) for tool in self.tools or ())
        return ToolUse(tools, choice, self.parallel_tool_calls is not False)
