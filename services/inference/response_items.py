"""A Responses API's input items: as conversation messages (how a stored response keeps them), and
as the chat messages its prompt is made of.

Messages of plain text are stored as they are; a message with images keeps its parts (as chat
turns do, `content_parts`), so a follow-up by `previous_response_id` sees its images again; other
items (calls, call outputs, thoughts, the response's record) are JSON under ITEM_KEY. A message's
parts are in the shape the vision path reads (`services.inference.vision`): `{"type": "text"}` and
`{"type": "image_url", "image_url": {"url"}}`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.conversations import Message
from services.errors import InvalidRequestError

ITEM_KEY = "galley_response_item"
CHAT_ITEMS = ("message", "function_call", "function_call_output")
STORED_ROLE = {"function_call": "assistant", "reasoning": "assistant", "function_call_output": "tool",
               "response": "system"}
MESSAGE_PARAM = re.compile(r"messages\.(\d+)(\..+)?")


def encode(item: dict) -> dict:
    """An item as a conversation message ({"role", "content"}: a text, or a message's parts)."""
    if item["type"] == "message":
        return {"role": item["role"], "content": item["content"]}
    return {"role": STORED_ROLE[item["type"]], "content": json.dumps({ITEM_KEY: item}, ensure_ascii=False)}


def decode(message: Message) -> dict:
    content = message.content
    if content.startswith('{"' + ITEM_KEY + '"'):
        try:
            return json.loads(content)[ITEM_KEY]
        except (ValueError, KeyError):
            pass
    parts = (message.extra or {}).get("content_parts")
    return {"type": "message", "role": message.role, "content": parts or content}


def chat_messages(items: list[dict]) -> tuple[list[dict], list[int]]:
    """Items as chat-template messages: a turn's calls on one assistant message (after its text),
    call outputs as `tool` messages; thoughts are not shown again. And, per message, the index of
    the item it begins with."""
    out: list[dict] = []
    sources: list[int] = []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": parsed_arguments(item["arguments"])}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            continue
        sources.append(i)
    return out, sources


def renamed(exc: InvalidRequestError, message_params: list[str]) -> InvalidRequestError:
    """A chat's error (`messages.2.content.0`, a bad image) named by the request's own field
    (`input.3.content.0`): `message_params` names each chat message where the request put it (an
    item of `input`, or `instructions`, `previous_response_id`: those are named whole)."""
    found = MESSAGE_PARAM.fullmatch(exc.param or "")
    if found is None or int(found[1]) >= len(message_params):
        return exc
    param = message_params[int(found[1])]
    if param.startswith("input."):
        param += found[2] or ""
    return InvalidRequestError(exc.message, param=param, code=exc.code)


def parsed_arguments(arguments: str) -> Any:
    """A call's arguments as chat templates expect them: an object when they are JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
