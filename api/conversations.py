"""The conversations API under /api/v1/conversations: create, list, read, delete.

Every handler is scoped to the caller's tenant: another tenant's conversation answers 404
exactly as a missing one does, so ids never leak. Creating one counts as one of the tenant's
requests (`requests_per_minute`). A new conversation is pinned to the version its model is
served at. The reads and writes are `services.conversations.Conversations`'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field

from api.auth import caller_of
from api.errors import json_response
from api.openai.fields import MAX_NAME_CHARS, Strict
from api.routes import Route
from api.services import services
from api.validation import parse_body
from services.conversations import Conversation, Message

Role = Literal["system", "developer", "user", "assistant", "tool"]


# ---- schemas ---------------------------------------------------------------------------


class ConversationCreate(Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS,
                       description="A served model; the conversation is pinned to its version.")
    title: str | None = Field(None, max_length=256)


class ConversationMessage(BaseModel):
    role: Role
    content: str
    prompt_tokens: int | None
    completion_tokens: int | None
    stream_id: str | None = Field(description="The stream that generated it, for assistant messages.")
    created_at: str
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant's calls, in OpenAI's shape.")
    tool_call_id: str | None = Field(None, description="A `tool` message: the call it answers.")
    name: str | None = None
    reasoning_content: str | None = Field(None, description="A thinking model's thoughts, apart from `content`.")


class ConversationOut(BaseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    tenant: str
    model: str
    model_version: str = Field(description="The model version the conversation is pinned to.")
    title: str | None
    created_at: str
    updated_at: str


class ConversationDetail(ConversationOut):
    messages: list[ConversationMessage] = Field(description="In the order they were added.")


class ConversationList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ConversationOut] = Field(description="Most recently updated first, at most 100.")


class ConversationDeleted(BaseModel):
    id: str
    deleted: bool


def conversation_json(conversation: Conversation) -> dict[str, Any]:
    return ConversationOut(**dataclasses.asdict(conversation)).model_dump()


def message_json(message: Message) -> dict[str, Any]:
    fields = {**dataclasses.asdict(message), **(message.extra or {})}
    return ConversationMessage(**{name: fields[name] for name in ConversationMessage.model_fields
                                  if name in fields}).model_dump(exclude_unset=True)  # extra fields: when there


# ---- handlers --------------------------------------------------------------------------


async def create_conversation(request: web.Request) -> web.Response:
    body = await parse_body(request, ConversationCreate)
    made = await services(request).conversations.create(caller_of(request), body.model, body.title)
    return json_response(conversation_json(made), status=201)


async def list_conversations(request: web.Request) -> web.Response:
    listed = await services(request).conversations.list_for(caller_of(request))
    return json_response({"object": "list", "data": [conversation_json(c) for c in listed]})


async def get_conversation(request: web.Request) -> web.Response:
    conversation, messages = await services(request).conversations.get(caller_of(request),
                                                                  request.match_info["conversation_id"])
    return json_response({**conversation_json(conversation), "messages": [message_json(m) for m in messages]})


async def delete_conversation(request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    await services(request).conversations.delete(caller_of(request), conversation_id)
    return json_response({"id": conversation_id, "deleted": True})


CONVERSATIONS_PATH = "/api/v1/conversations"
CONVERSATION_PATH = CONVERSATIONS_PATH + "/{conversation_id}"

ROUTES = [
    Route("POST", CONVERSATIONS_PATH, create_conversation, "Create a conversation pinned to a model's version",
          request=ConversationCreate, response=ConversationOut, status=201),
    Route("GET", CONVERSATIONS_PATH, list_conversations, "List your conversations, most recently updated first",
          response=ConversationList),
    Route("GET", CONVERSATION_PATH, get_conversation, "Get a conversation with its messages",
          response=ConversationDetail),
    Route("DELETE", CONVERSATION_PATH, delete_conversation, "Delete a conversation and its messages",
          response=ConversationDeleted),
]
