"""A model's output -> its text and its tool calls, incrementally, for the tool-call formats of
common open models: Hermes/Qwen (`<tool_call>{json}</tool_call>`), Llama 3 (`{"name",
"parameters"}` objects, `;`-separated, maybe after `<|python_tag|>`) and Mistral
(`[TOOL_CALLS][{...}]` or `[TOOL_CALLS]name[ARGS]{...}`).

One parser serves streamed and collected answers alike: `feed` text as it comes, `finish` at
the end; each returns the deltas that are certain by then. A call's `arguments` are the raw JSON
text of its arguments as the model wrote them, so the streamed fragments put together are
exactly the collected call's `arguments`. Each view of the text is a pure function of the text
so far, and what it shows only grows, so nothing sent is ever taken back.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

# a call object that names its function first: what streaming argument fragments needs
CALL_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class CallView:
    name: str | None  # None: not known yet (or not a call)
    arguments: str  # raw JSON text so far
    complete: bool = False  # the call's arguments are final


@dataclass
class View:
    """What the text so far says: its content and its calls (each only ever grows)."""

    content: str
    calls: list[CallView] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # with the name, on a call's first delta
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        return {**out, "function": function}


@dataclass
class Delta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value at `start` (strings and brackets matched), None if it is not complete."""
    if start >= len(text):
        return None
    opener = text[start]
    if opener not in "{[\"":
        match = re.compile(r"[^,}\]\s;]*").match(text, start)
        return match.end() if match.end() < len(text) else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if opener == '"':
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_call(text: str, start: int, final: bool) -> tuple[CallView, int | None]:
    """The call object at `start`, and the index past it (None while it is not complete)."""
    begin = len(text) - len(text[start:].lstrip())
    end = value_end(text, begin)
    prefix = CALL_PREFIX.match(text, start)
    if prefix is not None:
        name = json.loads(f'"{prefix.group(1)}"')
        args_end = value_end(text, prefix.end())
        arguments = text[prefix.end(): args_end if args_end is not None else len(text)]
        return CallView(name, arguments, args_end is not None or final), end
    if end is None and not final:
        return CallView(None, ""), None
    try:  # a call whose keys come in another order: whole, once complete
        obj = json.loads(text[begin:end])
        arguments = obj.get("arguments", obj.get("parameters", {}))
        return CallView(str(obj["name"]), json.dumps(arguments, ensure_ascii=False), True), end
    except (ValueError, KeyError, TypeError, AttributeError):
        return CallView(None, "", True), end


def held_back(text: str, marker: str) -> int:
    """Characters at the end of `text` that may be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def content_before(text: str, marker_at: int, marker: str, final: bool) -> str:
    """The content ahead of the first call: all of it at the end if no call came, else what
    cannot be the start of a call (trailing whitespace waits: before a call it is dropped)."""
    if marker_at >= 0:
        return text[:marker_at].rstrip()
    if final:
        return text
    return text[: len(text) - held_back(text, marker)].rstrip()


def hermes_view(text: str, final: bool) -> View:
    first = text.find(HERMES_OPEN)
    view = View(content_before(text, first, HERMES_OPEN, final))
    at = first
    while at >= 0:
        start = at + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, start)
        body = text[start: close if close >= 0 else len(text)]
        call, _ = scan_call(body, 0, final or close >= 0)
        view.calls.append(call)
        at = text.find(HERMES_OPEN, close) if close >= 0 else -1
    return view


def llama3_view(text: str, final: bool) -> View:
    stripped = text.lstrip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):]
    elif not stripped.startswith("{"):
        if not final and (not stripped or PYTHON_TAG.startswith(stripped)):
            return View("")
        return View(content_before(text, -1, "", final))
    view, at = View(""), 0
    while True:
        call, end = scan_call(stripped, at, final)
        if call.name is None and call.complete:  # a JSON answer, not a call
            return View(text) if final else View("")
        view.calls.append(call)
        if end is None:
            return view
        rest = stripped[end:].lstrip()
        if not rest.startswith(";"):
            return view
        at = len(stripped) - len(rest) + 1


def mistral_view(text: str, final: bool) -> View:
    first = text.find(MISTRAL_MARK)
    view = View(content_before(text, first, MISTRAL_MARK, final))
    if first < 0:
        return view
    body = text[first + len(MISTRAL_MARK):]
    if body.lstrip().startswith("["):  # [{"name", "arguments"}, ...]
        at = len(body) - len(body.lstrip()) + 1
        while True:
            call, end = scan_call(body, at, final)
            if call.name is None and not call.complete:
                return view
            view.calls.append(call)
            rest = body[end:].lstrip() if end is not None else ""
            if not rest.startswith(","):
                return view
            at = len(body) - len(rest) + 1
    for part in body.split(MISTRAL_MARK):  # name[ARGS]{...}, repeated
        name, sep, args = part.partition(MISTRAL_ARGS)
        if not sep:
            return view
        begin = len(args) - len(args.lstrip())
        end = value_end(args, begin)
        view.calls.append(CallView(name.strip(), args[begin:end] if end else args[begin:], end is not None or final))
    return view


VIEWS = {"hermes": hermes_view, "llama3_json": llama3_view, "mistral": mistral_view}


class ToolCallParser:
    """Invariant: what was sent (`sent_content`, each call's name and `sent_args`) is a prefix of
    what the latest view shows."""

    def __init__(self, fmt: str, call_ids: str = "") -> None:
        """`call_ids`: what the calls' ids are derived from (a stream's id and choice), so that a
        replay names them as the original did; empty: random ids."""
        self.view = VIEWS[fmt]
        self.call_ids = call_ids
        self.text = ""
        self.sent_content = 0
        self.sent_calls: list[int] = []  # arguments characters sent, per call that has a name
        self.ids: list[str] = []

    def feed(self, text: str) -> Delta:
        self.text += text
        return self._delta(final=False)

    def finish(self) -> Delta:
        return self._delta(final=True)

    @property
    def num_calls(self) -> int:
        return len(self.sent_calls)

    def _delta(self, final: bool) -> Delta:
        view = self.view(self.text, final)
        delta = Delta(view.content[self.sent_content:])
        self.sent_content = max(self.sent_content, len(view.content))
        for index, call in enumerate(view.calls):
            if call.name is None:
                break
            if index == len(self.sent_calls):
                self.sent_calls.append(0)
                self.ids.append(call_id(self.call_ids, index))
                delta.tool_calls.append(ToolCallDelta(index, self.ids[index], call.name, call.arguments))
            elif len(call.arguments) > self.sent_calls[index]:
                delta.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[self.sent_calls[index]:]))
            self.sent_calls[index] = max(self.sent_calls[index], len(call.arguments))
        return delta


def call_id(seed: str, index: int) -> str:
    """A call's id: OpenAI's shape (`call_` and 24 characters), from `seed` and its index when given."""
    if not seed:
        return f"call_{uuid.uuid4().hex[:24]}"
    return f"call_{hashlib.sha256(f'{seed}:{index}'.encode()).hexdigest()[:24]}"


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict]


def parse_all(fmt: str, text: str) -> ParsedAnswer:
    """A whole answer: its content (None when it is only calls) and its calls in OpenAI's shape."""
    parser = ToolCallParser(fmt)
    deltas = [parser.feed(text), parser.finish()]
    return assemble(deltas)


def assemble(deltas: list[Delta]) -> ParsedAnswer:
    content = "".join(d.content for d in deltas)
    calls: list[dict] = []
    for delta in deltas:
        for part in delta.tool_calls:
            if part.index == len(calls):
                calls.append({"id": part.id, "type": "function", "function": {"name": part.name, "arguments": ""}})
            calls[part.index]["function"]["arguments"] += part.arguments
    return ParsedAnswer(content if content or not calls else None, calls)


def parsed_arguments(arguments: str) -> Any:
    """A call's arguments as chat templates read them: an object when they parse as JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
