"""Tool calling, request side: which tool-call format a model speaks, how the tools reach its
prompt, and the grammar that makes `tool_choice` `required` (or a named function) binding.

The tools go through the model's chat template (`apply_chat_template(..., tools=...)`, as
transformers and vLLM pass them). A template that never mentions tools gets them the way
Hermes/Qwen templates write them, in a system message, with earlier calls and results shown as
`<tool_call>` / `<tool_response>` text, so even a plain ChatML model sees what it may call.
`required` and a named function are enforced by a grammar producing the model's own format
with arguments matching each function's JSON schema, so the answer is always a valid call.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.grammar import JSON_OPTIONS
from engine.types import GuidedSpec, SamplingParams
from scheduling.router import ServedModel
from services.answers.tool_parser import HERMES_CLOSE, HERMES_OPEN, MISTRAL_MARK
from services.errors import InvalidRequestError
from services.inference.structured import OutputFormat, constrain

FORMATS = ("hermes", "llama3_json", "mistral")
MAX_PARALLEL_CALLS = 8  # a forced answer holds at most this many calls (a weak model could repeat forever)
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as plain values: OpenAI tool definitions, `choice` auto | required |
    none | a function's name, and whether several calls may come in one answer."""

    tools: tuple[dict, ...] = ()
    choice: str = "auto"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model is told about the tools and its answer parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"

    def functions(self) -> list[dict]:
        """The functions a forced answer may call (all for `required`, else the named one)."""
        functions = [tool["function"] for tool in self.tools]
        if self.choice in ("auto", "required", "none"):
            return functions
        named = [f for f in functions if f["name"] == self.choice]
        if not named:
            raise InvalidRequestError(f"tool_choice names {self.choice!r}, which is not in `tools`",
                                      param="tool_choice")
        return named


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (Hermes when it shows none)."""
    template = chat_template or ""
    if MISTRAL_MARK in template:
        return "mistral"
    if HERMES_OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def renders_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def chat_template_of(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool-use one when there is one
        return template.get("tool_use") or template.get("default")
    return template


@dataclass(frozen=True)
class ToolPrompt:
    """How a conversation with tools is rendered (messages, and `tools=` for the template) and
    the format its answer is parsed in (None: tools are not in play)."""

    messages: list[dict]
    template_tools: list[dict] | None
    format: str | None

    def template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs if self.template_tools is None else {**kwargs, "tools": self.template_tools}


def prompt_with_tools(tokenizer: Any, messages: list[dict], use: ToolUse, parser: str | None = None) -> ToolPrompt:
    """`parser`: the model's configured tool-call format (None: detected from its chat template)."""
    template = chat_template_of(tokenizer)
    fmt = (parser or detect_format(template)) if use.active else None
    if renders_tools(template):
        return ToolPrompt(messages, list(use.tools) if use.active else None, fmt)
    if not use.active and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return ToolPrompt(messages, None, None)
    return ToolPrompt(hermes_messages(messages, use.tools if use.active else ()), None, fmt)


async def constrained_params(model: ServedModel, params: SamplingParams, use: ToolUse, output: OutputFormat | None,
                             fmt: str | None) -> SamplingParams:
    """`params` under the grammar the request asks for: a forced call's, or `response_format`'s."""
    if use.active and output is not None:
        raise InvalidRequestError(f"{output.param} cannot be combined with tools (unless tool_choice is `none`)",
                                  param=output.param)
    if fmt in ("mistral", "llama3_json"):  # their call markers are special tokens: keep their text to parse
        params = dataclasses.replace(params, skip_special_tokens=False)
    if use.forced:
        mark = special_token_id(model.tokenizer, MISTRAL_MARK) if fmt == "mistral" else None
        return await constrain(model, params, forced_grammar(use, fmt or "hermes", mark), "tools")
    if output is not None:
        return await constrain(model, params, output.spec(), output.param)
    return params


def hermes_messages(messages: list[dict], tools: tuple[dict, ...]) -> list[dict]:
    """For a template that knows no tools: the tools in the system message, earlier calls and
    their results as Hermes text (what Qwen's templates render)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            text = "\n".join(f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                              "arguments": c["function"]["arguments"]})
                             + f"\n{HERMES_CLOSE}" for c in calls)
            out.append({"role": "assistant", "content": "\n".join(filter(None, [message.get("content"), text]))})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content")})
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def call_schema(function: dict, arguments_key: str) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}


def forced_grammar(use: ToolUse, fmt: str, special_token_id: int | None = None) -> GuidedSpec:
    """A Lark grammar (llguidance's, with `%json`) whose every sentence is one call, or up to
    MAX_PARALLEL_CALLS with `parallel`, of the allowed functions in `fmt`'s syntax."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    schemas = [call_schema(f, key) for f in use.functions()]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    def calls(separator: str) -> str:
        return f'call ({json.dumps(separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}' if use.parallel else "call"

    if fmt == "llama3_json":
        return GuidedSpec("lark", f"start: {calls('; ')}\ncall: {call}")
    if fmt == "mistral":
        mark = f"<[{special_token_id}]>" if special_token_id is not None else json.dumps(MISTRAL_MARK)
        return GuidedSpec("lark", f'start: {mark} " [" {calls(", ")} "]"\ncall: {call}')
    return GuidedSpec("lark", f"start: {calls(chr(10))}\n"
                              f"call: {json.dumps(HERMES_OPEN + chr(10))} {call} {json.dumps(chr(10) + HERMES_CLOSE)}")


def special_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the tokenizer has it as one special token (a grammar must name it by id)."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None
