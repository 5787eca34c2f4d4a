"""The conversations API under /api/v1/conversations: create, list, read, delete.

Every handler is scoped to the caller's tenant: another tenant's conversation answers 404
exactly as a missing one does, so ids never leak. Creating one counts as one of the tenant's
requests (`requests_per_minute`). A new conversation is pinned to the version its model is
served at. Writes go through the DB writer thread, reads through the
read connection in a worker thread; the event loop never waits on SQLite.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import sqlite_utils
from aiohttp import web
from pydantic import BaseModel, Field

from api.auth import DATABASE, tenant_of
from api.errors import json_response
from api.openai.schemas import MAX_NAME_CHARS, Strict
from api.quotas import count_creation
from api.routes import Route
from api.validation import parse_body
from services.deployments.manager import resolve_model
from services.errors import NotFoundError
from storage import conversations
from storage.conversations import Conversation, Message

T = TypeVar("T")

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
    fields = dataclasses.asdict(message)
    return ConversationMessage(**{name: fields[name] for name in ConversationMessage.model_fields}).model_dump()


# ---- plumbing --------------------------------------------------------------------------


async def write(request: web.Request, fn: Callable[[sqlite_utils.Database], T]) -> T:
    return await asyncio.wrap_future(request.app[DATABASE].write(fn))


async def read(request: web.Request, fn: Callable[[sqlite_utils.Database], T]) -> T:
    return await asyncio.to_thread(request.app[DATABASE].read, fn)


def conversation_not_found(conversation_id: str) -> NotFoundError:
    return NotFoundError(f"No conversation `{conversation_id}`.", param="conversation_id",
                         code="conversation_not_found")


# ---- handlers --------------------------------------------------------------------------


async def create_conversation(request: web.Request) -> web.Response:
    body = await parse_body(request, ConversationCreate)
    count_creation(request)  # before resolving: that may load a cold model
    model = await resolve_model(request, body.model)
    tenant = tenant_of(request).name
    made = await write(request, lambda db: conversations.create_conversation(
        db, tenant, model.name, model.version, body.title))
    return json_response(conversation_json(made), status=201)


async def list_conversations(request: web.Request) -> web.Response:
    tenant = tenant_of(request).name
    listed = await read(request, lambda db: conversations.list_conversations(db, tenant))
    return json_response({"object": "list", "data": [conversation_json(c) for c in listed]})


async def get_conversation(request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    tenant = tenant_of(request).name

    def query(db: sqlite_utils.Database) -> tuple[Conversation, list[Message]] | None:
        found = conversations.get_conversation(db, conversation_id, tenant)
        return None if found is None else (found, conversations.list_messages(db, conversation_id))

    found = await read(request, query)
    if found is None:
        raise conversation_not_found(conversation_id)
    conversation, messages = found
    return json_response({**conversation_json(conversation), "messages": [message_json(m) for m in messages]})


async def delete_conversation(request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    tenant = tenant_of(request).name
    if not await write(request, lambda db: conversations.delete_conversation(db, conversation_id, tenant)):
        raise conversation_not_found(conversation_id)
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
