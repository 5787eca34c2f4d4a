"""WebSocket chat at `GET /ws/chat`: JSON messages over one socket, any number of streams.

The client sends `chat`, `resume` and `cancel` messages; the server answers with `start`,
`token`, `done` and `error` (the protocol is in docs/api.md, "WebSocket chat"). A chat goes
through the same inference service (`Inference.start_chat`) as `POST /v1/chat/completions`
(tenant checks, limits, priority, history, storage, resumable stream), and every chat is a
conversation: one is created when the client names none, so its stream goes on when the
socket drops and its answer is stored. Each followed stream is one task that reads the
stream's event log; all writes to the socket go through one lock. Closing the socket
cancels the followers and detaches them from their streams; the streams themselves follow
their `on_disconnect` policy. The socket reaches generations only through the inference service
and the stream hub.

The socket authenticates once, at the upgrade, and is re-checked against the tenant
directory on every message and whenever the directory changes: a revoked key or deleted
tenant closes it (code 1008) at once, and each chat sees the tenant's limits as they are
now. While the server drains, idle sockets close (1001) and busy ones close when their
last stream ends.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import Annotated, Any, Literal

import structlog
from aiohttp import WSCloseCode, WSMsgType, web
from pydantic import Field, TypeAdapter, ValidationError, model_validator

from api.auth import caller_of, check_priority_access, current_tenant, tenant_of
from api.errors import validation_error
from api.openai.fields import MAX_NAME_CHARS, Strict
from api.openai.schemas import ChatCompletionRequest
from api.quotas import count_creation
from api.routes import Route
from api.services import SERVICES, services
from services.answers import AnswerReader
from services.errors import InvalidRequestError, NotFoundError, RateLimitError, ServiceError
from services.streams import LiveStream, StreamStatus

log = structlog.get_logger(__name__)

HEARTBEAT_S = 20.0
MAX_STREAMS_PER_SOCKET = 64  # followed at once; tenant limits bound generations, this bounds resumes
RESERVED_PARAMS = ("model", "messages", "conversation_id", "stream")
FINISH_REASONS = {"abort": "cancelled"}  # the engine's name -> the protocol's
SOCKETS = web.AppKey("websockets", weakref.WeakSet)  # every open ChatSocket


# ---- client messages -------------------------------------------------------------------


class ChatIn(Strict):
    type: Literal["chat"]
    model: str
    conversation_id: str | None = None
    messages: list[Any] | None = None  # checked as chat's are (`ChatMessage`: image parts too), in chat_request
    content: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_of_messages_or_content(self) -> ChatIn:
        if (self.messages is None) == (self.content is None):
            raise ValueError("send exactly one of `messages` and `content`")
        return self


class ResumeIn(Strict):
    type: Literal["resume"]
    stream_id: str = Field(max_length=MAX_NAME_CHARS)
    after: int = Field(-1, ge=-1)


class CancelIn(Strict):
    type: Literal["cancel"]
    stream_id: str = Field(max_length=MAX_NAME_CHARS)


ClientMessage = TypeAdapter(Annotated[ChatIn | ResumeIn | CancelIn, Field(discriminator="type")])


def chat_request(message: ChatIn) -> ChatCompletionRequest:
    """The chat-completion request a `chat` message stands for (pydantic's ValidationError if invalid)."""
    reserved = [name for name in RESERVED_PARAMS if name in message.params]
    if reserved:
        raise InvalidRequestError(f"params.{reserved[0]}: set it on the message, not in params",
                                  param=f"params.{reserved[0]}")
    messages = message.messages if message.messages is not None else [{"role": "user", "content": message.content}]
    return ChatCompletionRequest(model=message.model, messages=messages, conversation_id=message.conversation_id,
                                 stream=True, **message.params)


# ---- server messages -------------------------------------------------------------------


def error_message(code: str, message: str, stream_id: str | None = None, param: str | None = None) -> dict:
    """`param`: the field at fault, as HTTP's 400 names it (`messages.1.content.0`)."""
    out = {"type": "error", "code": code, "message": message}
    if param is not None:
        out["param"] = param
    return out if stream_id is None else {**out, "stream_id": stream_id}


def final_message(live: LiveStream, reader: AnswerReader | None = None) -> dict:
    """`done` or `error` for a stream that has ended (`tool_calls` when `reader` read a call)."""
    last = live.events[-1] if live.events else None
    if last is not None and last.error:
        return error_message(last.error_code or "internal_error", last.error, live.id)
    if live.status == StreamStatus.FAILED:
        return error_message("internal_error", "the generation failed", live.id)
    reason = last.finish_reason if last is not None else live.record.finish_reason
    if reader is not None:
        reason = reader.finish_reason(reason)
    return {"type": "done", "stream_id": live.id, "finish_reason": FINISH_REASONS.get(reason, reason),
            "usage": last.usage if last is not None else None}


# ---- one socket ------------------------------------------------------------------------


class ChatSocket:
    """One client's socket. Invariant: every task in `followers` is attached to its stream,
    and is detached exactly once, when the task ends (however it ends)."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.hub = services(request).streams
        self.tenant = tenant_of(request).name
        self.followers: set[asyncio.Task] = set()
        self._write = asyncio.Lock()
        self._closing: asyncio.Task | None = None

    async def send(self, message: dict) -> None:
        if self.ws.closed:
            return
        async with self._write:
            await self.ws.send_json(message)

    def close_soon(self, code: int, reason: str, error: dict | None = None) -> None:
        """Close the socket from outside its receive loop (a directory change, a drain), once."""
        if self._closing is None and not self.ws.closed:
            self._closing = asyncio.get_running_loop().create_task(self._close_with(code, reason, error))

    async def _close_with(self, code: int, reason: str, error: dict | None) -> None:
        try:
            if error is not None:
                await self.send(error)
            await self.ws.close(code=code, message=reason.encode())
        except ConnectionError:
            pass  # the client is gone already

    def check_key(self) -> bool:
        """False (and the socket closing) once the key it opened with is revoked or its tenant deleted."""
        if current_tenant(self.request) is not None:
            return True
        self.close_soon(WSCloseCode.POLICY_VIOLATION, "API key revoked",
                        error_message("invalid_api_key", "Invalid API key: unknown or revoked."))
        return False

    async def handle(self, text: str) -> None:
        """Act on one client message; any error is answered with an `error` message."""
        if not self.check_key():
            return
        try:
            message = ClientMessage.validate_json(text)
        except ValidationError as exc:
            await self.send(error_message("invalid_message", validation_error(exc).message))
            return
        stream_id = getattr(message, "stream_id", None)
        try:
            if not isinstance(message, CancelIn) and len(self.followers) >= MAX_STREAMS_PER_SOCKET:
                raise RateLimitError(f"at most {MAX_STREAMS_PER_SOCKET} streams at once on one socket",
                                     code="too_many_streams")
            if isinstance(message, ChatIn):
                await self.chat(message)
            elif isinstance(message, ResumeIn):
                count_creation(self.request)  # a replay is work: it counts as a request
                await self.follow(await self.find(message.stream_id), message.after)
            else:
                self.cancel(await self.find(message.stream_id))
        except ValidationError as exc:
            invalid = validation_error(exc)
            await self.send(error_message("invalid_request_error", invalid.message, stream_id, invalid.param))
        except ServiceError as exc:
            await self.send(error_message(exc.code or exc.type, exc.message, stream_id, exc.param))
        except ConnectionError:
            pass  # the socket is closing; the receive loop ends next
        except Exception:
            log.exception("websocket message failed", message_type=message.type)
            await self.send(error_message("internal_error", "internal server error", stream_id))

    async def chat(self, message: ChatIn) -> None:
        body = chat_request(message)
        created = None
        if body.conversation_id is None:
            created = await self.new_conversation(body)
            body = body.model_copy(update={"conversation_id": created})
        try:
            live = await services(self.request).inference.start_chat(caller_of(self.request), body.chat_input())
        except Exception:
            if created is not None:  # nothing was said in it: leave no empty conversation behind
                await services(self.request).conversations.discard(self.tenant, created)
            raise
        await self.follow(live, -1)

    async def new_conversation(self, body: ChatCompletionRequest) -> str:
        """A conversation pinned to the version HTTP would route it to (the split, by `user` or a
        fresh key; a cold version loads), after the same access checks."""
        check_priority_access(self.request, body.priority)
        conversations = services(self.request).conversations
        made = await conversations.create_for_chat(caller_of(self.request), body.model, body.user)
        return made.id

    async def find(self, stream_id: str) -> LiveStream:
        live = await self.hub.find(stream_id, self.tenant)
        if live is None:
            raise NotFoundError(f"no stream {stream_id!r} (unknown, expired, or not yours)", param="stream_id",
                                code="stream_not_found")
        return live

    async def follow(self, live: LiveStream, after: int) -> None:
        """Announce `live` with `start`, then forward its events after `after` in a task of its own."""
        self.hub.attach(live)
        task = asyncio.get_running_loop().create_task(self.forward(live, after))
        self.followers.add(task)
        task.add_done_callback(functools.partial(self._ended, live))
        # The task first runs once we wait below, so it queues on the write lock behind this start.
        await self.send({"type": "start", "stream_id": live.id, "conversation_id": live.record.conversation_id})

    def _ended(self, live: LiveStream, task: asyncio.Task) -> None:
        self.followers.discard(task)
        self.hub.detach(live)
        if not self.followers and services(self.request).state.draining:
            self.close_soon(WSCloseCode.GOING_AWAY, "server shutting down")

    async def forward(self, live: LiveStream, after: int) -> None:
        """Each event after `after` that adds to the answer as a `token` message: its `text`, and a
        thinking model's `reasoning` and a tool call's deltas (`tool_calls`, as OpenAI's chunks) apart.
        Every event is read, sent or not: what it adds depends on all the text before it."""
        reader = AnswerReader.of(live.fmt)
        try:
            async for event in live.follow():
                if event.error:
                    continue
                delta = reader.read(event)
                if event.index <= after or not (delta.content or delta.reasoning or delta.tool_calls):
                    continue
                message = {"type": "token", "stream_id": live.id, "index": event.index, "text": delta.content}
                if delta.reasoning:
                    message["reasoning"] = delta.reasoning
                if delta.tool_calls:
                    message["tool_calls"] = [call.to_dict() for call in delta.tool_calls]
                await self.send(message)
            await self.send(final_message(live, reader))
        except ConnectionError:
            pass  # the socket closed under us; `close` cancels the rest

    def cancel(self, live: LiveStream) -> None:
        """Abort the generation; its followers (on any socket) then see `done` with `cancelled`."""
        self.hub.cancel(live)

    async def close(self) -> None:
        for task in list(self.followers):
            task.cancel()
        await asyncio.gather(*self.followers, return_exceptions=True)
        if self._closing is not None:
            await asyncio.gather(self._closing, return_exceptions=True)


async def ws_chat(request: web.Request) -> web.WebSocketResponse:
    """Upgrade to a WebSocket (authenticated before the upgrade), then serve chat messages."""
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S)
    await ws.prepare(request)
    socket = ChatSocket(request, ws)
    request.app[SOCKETS].add(socket)
    if services(request).state.draining:  # opened as the drain began
        socket.close_soon(WSCloseCode.GOING_AWAY, "server shutting down")
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await socket.handle(message.data)
            elif message.type == WSMsgType.BINARY:
                await socket.send(error_message("invalid_message", "messages are JSON in text frames"))
    except ConnectionError:
        pass  # the client left while we wrote: a normal end
    finally:
        await socket.close()
        request.app[SOCKETS].discard(socket)
    return ws


def check_keys(app: web.Application) -> None:
    """After a tenant directory change: close the sockets whose key was revoked or tenant deleted."""
    for socket in list(app[SOCKETS]):
        socket.check_key()


def close_idle_sockets(app: web.Application) -> None:
    """At drain start: close the sockets that follow no stream (the others close as their last ends)."""
    for socket in list(app[SOCKETS]):
        if not socket.followers:
            socket.close_soon(WSCloseCode.GOING_AWAY, "server shutting down")


async def close_sockets(app: web.Application) -> None:
    """On shutdown: close every socket (their conversation streams continue or wait for a restart)."""
    for socket in list(app[SOCKETS]):
        await socket.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


def setup(app: web.Application) -> None:
    app[SOCKETS] = weakref.WeakSet()
    app[SERVICES].auth.directory.listeners.append(functools.partial(check_keys, app))
    app.on_shutdown.append(close_sockets)


ROUTES = [
    Route("GET", "/ws/chat", ws_chat,
          "WebSocket chat: upgrade, then JSON messages chat/resume/cancel -> start/token/done/error (see docs/api.md)"),
]
