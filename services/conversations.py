"""Conversations and their messages, for a caller: create, list, read, delete, and what a chat
turn reads (the history) and writes (its new messages).

Everything a tenant does is scoped to its tenant: another tenant's conversation is not found
exactly as a missing one is, so ids never leak. Writes go through the DB writer thread, reads
through the read connection in a worker thread; the event loop never waits on SQLite. The
assistant's answer is stored by the stream hub, with the stream's end, in one transaction.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import Any

from scheduling.rollout import parse_model_ref
from services.admission import Admission
from services.answers.tool_parser import parsed_arguments
from services.deployments.manager import ModelManager
from services.errors import ConflictError, NotFoundError
from services.tenancy import Caller, limits_of
from storage.conversations import Conversation, ConversationNotFoundError, ConversationStore, Message

__all__ = ["Conversation", "Conversations", "Message"]


def not_found(conversation_id: str) -> NotFoundError:
    return NotFoundError(f"No conversation `{conversation_id}`.", param="conversation_id",
                         code="conversation_not_found")


def not_found_in_chat(conversation_id: str) -> NotFoundError:
    """The wording chat requests and the admin API have always used (clients may match on it)."""
    return NotFoundError(f"no conversation {conversation_id!r}", param="conversation_id",
                         code="conversation_not_found")


class Conversations:
    """The conversations service: every read and write of conversations and messages but the
    assistant's answer goes through here."""

    def __init__(self, store: ConversationStore, models: ModelManager, admission: Admission) -> None:
        self.store = store
        self.models = models  # routes a new conversation to the version it is pinned to
        self.admission = admission  # creating a conversation counts as one of the tenant's requests

    # ---- a tenant's own ----------------------------------------------------------------

    async def create(self, caller: Caller, model_ref: str, title: str | None = None) -> Conversation:
        """A new conversation of the caller's, pinned to the version `model_ref` routes to now (a cold
        one loads). It counts as one of the caller's requests, before routing: that may load a model."""
        self.admission.count_request(limits_of(caller.tenant))
        served = await self.models.route(caller, model_ref)
        return await asyncio.wrap_future(self.store.create(caller.tenant.name, served.name, served.version, title))

    async def create_for_chat(self, caller: Caller, model_ref: str, user: str | None) -> Conversation:
        """A conversation for a chat that names none (a WebSocket chat), pinned to the version HTTP
        would route that chat to: the split, by `user` or a fresh key (a cold version loads). The
        chat itself is the request that counts."""
        served = await self.models.route(caller, model_ref, user=user, conversation_id=uuid.uuid4().hex)
        return await asyncio.wrap_future(self.store.create(caller.tenant.name, served.name, served.version))

    async def list_for(self, caller: Caller) -> list[Conversation]:
        """The caller's conversations, most recently updated first (at most 100)."""
        return await asyncio.to_thread(self.store.of_tenant, caller.tenant.name)

    async def get(self, caller: Caller, conversation_id: str) -> tuple[Conversation, list[Message]]:
        """The caller's conversation and its messages; NotFoundError when it is not theirs."""
        found = await asyncio.to_thread(self.store.with_messages, conversation_id, tenant=caller.tenant.name)
        if found is None:
            raise not_found(conversation_id)
        return found

    async def delete(self, caller: Caller, conversation_id: str) -> None:
        """Deletes the caller's conversation and its messages; NotFoundError when it is not theirs."""
        if not await asyncio.wrap_future(self.store.delete(conversation_id, caller.tenant.name)):
            raise not_found(conversation_id)

    async def discard(self, tenant: str, conversation_id: str) -> None:
        """Deletes a conversation just created for a chat that then failed, by its tenant's name (the
        caller may have been revoked meanwhile); gone already: nothing to do."""
        await asyncio.wrap_future(self.store.delete(conversation_id, tenant))

    # ---- a chat turn -------------------------------------------------------------------

    async def history(self, caller: Caller, conversation_id: str, model_ref: str) -> tuple[list[dict], str]:
        """The stored messages of the caller's conversation as chat messages, and the version it is
        pinned to. NotFoundError when it is not theirs; ConflictError when `model_ref` names
        another model or version."""
        found = await asyncio.to_thread(self.store.with_messages, conversation_id, tenant=caller.tenant.name)
        if found is None:
            raise not_found_in_chat(conversation_id)
        conversation, messages = found
        name, version = parse_model_ref(model_ref)
        if conversation.model != name or version not in (None, conversation.model_version):
            raise ConflictError(f"conversation {conversation_id!r} is pinned to "
                                f"{conversation.model}@{conversation.model_version}", param="model")
        return [template_message(m) for m in messages], conversation.model_version

    async def append(self, conversation_id: str, messages: Sequence[dict]) -> None:
        """Stores a turn's new messages ({"role", "content"}) in one transaction; NotFoundError when
        the conversation was deleted meanwhile."""
        try:
            await asyncio.wrap_future(self.store.add_messages(
                conversation_id, [(m["role"], stored_text(m), stored_extra(m)) for m in messages]))
        except ConversationNotFoundError as exc:
            raise not_found_in_chat(conversation_id) from exc

    # ---- every tenant's (the admin API) ------------------------------------------------

    async def across_tenants(self, limit: int, tenant: str | None = None) -> list[tuple[Conversation, int]]:
        """Conversations of every tenant (or one) with their message counts, most recent first."""
        return await asyncio.to_thread(self.store.across_tenants, limit, tenant)

    async def find(self, conversation_id: str) -> tuple[Conversation, list[Message]]:
        """Any tenant's conversation and its messages; NotFoundError when there is none."""
        found = await asyncio.to_thread(self.store.with_messages, conversation_id, tenant=None)
        if found is None:
            raise not_found_in_chat(conversation_id)
        return found


TEMPLATE_FIELDS = ("tool_calls", "tool_call_id", "name")  # thoughts are never sent back to the model


def stored_text(message: dict[str, Any]) -> str:
    """A message's text: its content, or the text of its parts (a message with images)."""
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text") or "" for p in content)


def stored_extra(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message's fields beyond role and content, as stored: tool calls in OpenAI's shape
    (arguments as JSON text, whatever the template was given), and a message with images' parts in
    order (`content_parts`: its images as sent, so a later turn sees them again)."""
    extra = {name: message[name] for name in TEMPLATE_FIELDS if message.get(name) is not None}
    if isinstance(message.get("content"), list):
        extra["content_parts"] = message["content"]
    if "tool_calls" in extra:
        extra["tool_calls"] = [{**call, "function": {**call["function"], "arguments": as_text(
            call["function"]["arguments"])}} for call in extra["tool_calls"]]
    return extra


def template_message(message: Message) -> dict[str, Any]:
    """A stored message as chat templates read it (as `api.openai.messages.ChatMessage.for_template`:
    a call's arguments an object when they parse as JSON)."""
    extra = message.extra or {}
    out: dict[str, Any] = {"role": message.role, "content": extra.get("content_parts") or message.content}
    out.update({name: extra[name] for name in TEMPLATE_FIELDS if name in extra})
    if "tool_calls" in out:
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": parsed_arguments(
            call["function"]["arguments"])}} for call in out["tool_calls"]]
    return out


def as_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
