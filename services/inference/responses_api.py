"""The Responses API's work (`POST /v1/responses`): input items -> a chat -> output items, stored so
that `previous_response_id` continues it.

A stored response is a conversation of its tenant (`services.conversations`), so only that tenant
can read or continue it: the chain's earlier items, this response's input items and its output
items, then a record of the response (what `GET /v1/responses/{id}` shows). The response id is the
conversation's (`resp_<hex>` names `conv_<hex>`); its items are stored as
`services.inference.response_items` says (a message with images keeps its parts). Instructions are
not carried into a follow-up (as OpenAI does); thoughts are not shown to the model again.

The generation is planned like a chat completion (`Inference.plan_chat`: routing, the chat
template with tools, constrained decoding, a vision model's images) and read as one choice;
`ResponseOutput` turns its text into output items (thoughts, a message, function calls) as it comes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from scheduling.router import ServedModel
from services.answers.deltas import AnswerReader
from services.answers.reading import cached_tokens, failure, generation_failed, usage
from services.answers.tool_parser import Delta
from services.conversations import Conversations
from services.errors import InvalidRequestError, NotFoundError
from services.inference.choices import Choices
from services.inference.generation import Inference, Plan
from services.inference.requests import ChatInput
from services.inference.response_items import CHAT_ITEMS, chat_messages, decode, encode, renamed
from services.inference.structured import OutputFormat
from services.inference.tools import ToolUse
from services.sampling import SamplingOptions
from services.tenancy import Caller

RESPONSE_PREFIX, CONVERSATION_PREFIX = "resp_", "conv_"
ITEM_PREFIX = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}
_background: set[asyncio.Task] = set()  # discards of unfinished responses' conversations, until they ran


@dataclass(frozen=True)
class ResponseInput:
    """A `POST /v1/responses` as plain values. Items: {"type": "message", "role", "content": text or
    parts (`text` and `image_url`, as on chat)}, {"type": "function_call", "call_id", "name",
    "arguments"}, {"type": "function_call_output", "call_id", "output"}."""

    model: str
    items: list[dict]
    item_params: list[str] = field(default_factory=list)  # where each item is in the request (`input.3`)
    instructions: str | None = None
    options: SamplingOptions = SamplingOptions()
    max_output_tokens: int | None = None
    tools: ToolUse = ToolUse()
    output: OutputFormat | None = None  # `text.format`
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None
    priority: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # how the response shows its request (stored with it)


@dataclass
class OutputItem:
    """One output item: thoughts (`reasoning`), a `message`, or a `function_call`; `text` is the
    thoughts, the message's text or the call's arguments (JSON text)."""

    type: str
    id: str
    text: str = ""
    name: str | None = None  # function_call
    call_id: str | None = None  # function_call
    done: bool = False


@dataclass(frozen=True)
class Change:
    """What one piece of the answer did to the output: `added` an item, a `delta` of its text, or
    `done` with it (item `index` of the output)."""

    kind: str
    index: int
    text: str = ""


class ResponseOutput:
    """A generation's text -> output items, in the order they come (thoughts, then a message, then
    calls); one item is open at a time. Invariant: the items' texts are what the changes added."""

    def __init__(self, reader: AnswerReader) -> None:
        self.reader = reader  # thoughts and calls read as on every other delivery
        self.items: list[OutputItem] = []
        self.num_reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int = 1) -> list[Change]:
        thinking = self.reader.thinking
        thoughts, delta = self.reader.feed(text, final=False)
        if thinking or self.reader.thinking:
            self.num_reasoning_tokens += num_tokens
        return self._add(thoughts, delta)

    def finish(self) -> list[Change]:
        """The rest of the text, every item closed; an answer of no text is an empty message."""
        changes = self._add(*self.reader.feed("", final=True))
        if not any(item.type != "reasoning" for item in self.items):
            changes += self._open("message")
        if self.items and not self.items[-1].done:
            changes.append(self._close())
        return changes

    def _add(self, thoughts: str, delta: Delta) -> list[Change]:
        changes = self._write("reasoning", thoughts) + self._write("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                changes += self._open("function_call", name=call.name, call_id=call.id)
            changes += self._append(call.arguments)
        return changes

    def _write(self, kind: str, text: str) -> list[Change]:
        if not text:
            return []
        opened = [] if self.items and self.items[-1].type == kind and not self.items[-1].done else self._open(kind)
        return opened + self._append(text)

    def _open(self, kind: str, **fields: Any) -> list[Change]:
        changes = [self._close()] if self.items and not self.items[-1].done else []
        self.items.append(OutputItem(kind, ITEM_PREFIX[kind] + uuid.uuid4().hex, **fields))
        return [*changes, Change("added", len(self.items) - 1)]

    def _append(self, text: str) -> list[Change]:
        if not text:
            return []
        self.items[-1].text += text
        return [Change("delta", len(self.items) - 1, text)]

    def _close(self) -> Change:
        self.items[-1].done = True
        return Change("done", len(self.items) - 1)


@dataclass
class Record:
    """A response as `GET /v1/responses/{id}` shows it, less its output items."""

    id: str
    created_at: int
    model: str
    settings: dict[str, Any]
    status: str = "in_progress"  # in_progress | completed | incomplete | failed
    incomplete_reason: str | None = None  # max_output_tokens
    usage: dict | None = None  # input_tokens, output_tokens, reasoning_tokens, cached_tokens
    error: str | None = None
    completed_at: int | None = None


class ResponseRun:
    """A submitted response: read its `changes` (streamed) or `collect` it; at its end it is stored.
    Invariant: once read (to its end, or left), its generation is not running, and a response
    that did not complete left nothing stored."""

    def __init__(self, record: Record, output: ResponseOutput, choices: Choices, conversations: Conversations,
                 tenant: str, stored: list[dict] | None) -> None:
        self.record = record
        self.output = output
        self.choices = choices
        self.conversations = conversations
        self.tenant = tenant
        self.stored = stored  # the items to store before the output (None: not stored)

    @property
    def items(self) -> list[OutputItem]:
        return self.output.items

    async def changes(self) -> AsyncIterator[list[Change]]:
        """The output's changes, token event by token event; the record's status and usage are set
        before the last. A failure is raised (before the first change: nothing was sent yet)."""
        events, done = self.choices.events(), False
        try:
            async for _, event in events:
                if isinstance(event, Exception):
                    raise failure(event)
                if event.error is not None:
                    raise generation_failed(event)
                changes = self.output.feed(event.text, len(event.token_ids))
                if event.finished:
                    changes += self.output.finish()
                    self.finish(event)
                    await self.store()
                    done = True
                yield changes
        except Exception as exc:
            self.record.status, self.record.error = "failed", failure(exc).message
            raise
        finally:
            await events.aclose()
            if not done:
                self.discard()

    async def collect(self) -> ResponseRun:
        async for _ in self.changes():
            pass
        return self

    def finish(self, event: Any) -> None:
        counts = usage(event)
        self.record.usage = {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                             "reasoning_tokens": self.output.num_reasoning_tokens,
                             "cached_tokens": cached_tokens(counts)}
        self.record.completed_at = int(time.time())
        if getattr(event.finish_reason, "value", event.finish_reason) == "length":
            self.record.status, self.record.incomplete_reason = "incomplete", "max_output_tokens"
        else:
            self.record.status = "completed"

    async def store(self) -> None:
        if self.stored is None:
            return
        items = [*self.stored, *(stored_item(item) for item in self.items),
                 {"type": "response", **vars(self.record), "num_output": len(self.items)}]
        await self.conversations.append(conversation_id(self.record.id), [encode(item) for item in items])

    def discard(self) -> None:
        if self.stored is not None:
            task = asyncio.ensure_future(self.conversations.discard(self.tenant, conversation_id(self.record.id)))
            _background.add(task)
            task.add_done_callback(_background.discard)


class Responses:
    """Creates and reads responses, over the generation service and the conversations."""

    def __init__(self, inference: Inference) -> None:
        self.inference = inference
        self.conversations = inference.conversations

    async def plan(self, caller: Caller, ask: ResponseInput) -> tuple[Plan, list[dict]]:
        """The response planned as a chat (after its chain's items, on the version the chain ran on
        when the model is the same), and the chain's items."""
        history, pinned = [], None
        if ask.previous_response_id:
            history, model_name, pinned = await self.chain(caller, ask.previous_response_id)
            pinned = pinned if ask.model == model_name else None
        messages, sources = chat_messages(history + ask.items)
        item_params = ["previous_response_id"] * len(history) + (ask.item_params or ["input"] * len(ask.items))
        message_params = [item_params[i] for i in sources]
        if ask.instructions:
            messages, message_params = [{"role": "system", "content": ask.instructions}, *messages], \
                ["instructions", *message_params]
        chat = ChatInput(model=ask.model, options=ask.options, max_tokens=ask.max_output_tokens, user=ask.user,
                         priority=ask.priority, messages=messages, template_kwargs=ask.template_kwargs,
                         tools=ask.tools, output=ask.output)
        try:
            return await self.inference.plan_chat(caller, chat, pinned_version=pinned), history
        except InvalidRequestError as exc:  # a bad image: named by its `input` item, not a chat message
            raise renamed(exc, message_params) from None

    async def count_input_tokens(self, caller: Caller, ask: ResponseInput) -> int:
        """The prompt tokens a response to `ask` would have (its usage's `input_tokens`)."""
        plan, _ = await self.plan(caller, ask)
        return len(plan.prompt_ids)

    async def create(self, caller: Caller, ask: ResponseInput) -> ResponseRun:
        """Plan, store the start of, and submit a response (read it from the returned run)."""
        plan, history = await self.plan(caller, ask)
        response_id = RESPONSE_PREFIX + uuid.uuid4().hex
        if ask.store:
            response_id = await self.start_conversation(caller, plan.model)
        settings = {**ask.settings, "temperature": plan.params.temperature, "top_p": plan.params.top_p}  # as sampled
        record = Record(response_id, int(time.time()), self.inference.router.label(plan.model), settings)
        try:
            choices = self.inference.submit_n(caller, [plan])
        except BaseException:
            if ask.store:
                await self.conversations.discard(caller.tenant.name, conversation_id(response_id))
            raise
        fmt = self.inference.format([plan], response_id)
        return ResponseRun(record, ResponseOutput(AnswerReader.of(fmt)), choices, self.conversations,
                           caller.tenant.name, history + ask.items if ask.store else None)

    async def start_conversation(self, caller: Caller, model: ServedModel) -> str:
        conversation = await asyncio.wrap_future(self.conversations.store.create(
            caller.tenant.name, model.name, model.version, "Responses API"))
        return RESPONSE_PREFIX + conversation.id.removeprefix(CONVERSATION_PREFIX)

    async def chain(self, caller: Caller, response_id: str) -> tuple[list[dict], str, str]:
        """The items of the caller's stored response `response_id` (earlier responses' included),
        the model and version it ran on; 404 when it is not the caller's or not stored."""
        items, conversation = await self.stored(caller, response_id, "previous_response_id")
        if not any(item["type"] == "response" for item in items):  # not a response, or one not finished
            raise response_not_found(response_id, "previous_response_id")
        return [item for item in items if item["type"] in CHAT_ITEMS], conversation.model, conversation.model_version

    async def retrieve(self, caller: Caller, response_id: str) -> tuple[Record, list[OutputItem]]:
        """The caller's stored response and its output items."""
        items, _ = await self.stored(caller, response_id, "response_id")
        records = [i for i, item in enumerate(items) if item["type"] == "response"]
        if not records:
            raise response_not_found(response_id, "response_id")
        data = dict(items[records[-1]])
        num_output = data.pop("num_output")
        del data["type"]
        output = [output_item(item) for item in items[records[-1] - num_output: records[-1]]]
        return Record(**data), output

    async def delete(self, caller: Caller, response_id: str) -> None:
        """Deletes the caller's stored response (its conversation); 404 when it is not theirs."""
        await self.stored(caller, response_id, "response_id")  # the same 404 as GET
        await self.conversations.delete(caller, conversation_id(response_id))

    async def stored(self, caller: Caller, response_id: str, param: str) -> tuple[list[dict], Any]:
        if not response_id.startswith(RESPONSE_PREFIX):
            raise response_not_found(response_id, param)
        try:
            conversation, messages = await self.conversations.get(caller, conversation_id(response_id))
        except NotFoundError:
            raise response_not_found(response_id, param) from None
        return [decode(m) for m in messages], conversation


def response_not_found(response_id: str, param: str) -> NotFoundError:
    return NotFoundError(f"No stored response with id {response_id!r}.", param=param, code="response_not_found")


def conversation_id(response_id: str) -> str:
    return CONVERSATION_PREFIX + response_id.removeprefix(RESPONSE_PREFIX)


# ---- output items in the conversation store ------------------------------------------------


def stored_item(item: OutputItem) -> dict:
    if item.type == "message":
        return {"type": "message", "role": "assistant", "content": item.text}
    if item.type == "function_call":
        return {"type": "function_call", "id": item.id, "call_id": item.call_id, "name": item.name,
                "arguments": item.text}
    return {"type": "reasoning", "id": item.id, "text": item.text}


def output_item(item: dict) -> OutputItem:
    """A stored output item back (a message's id is not kept: it gets a fresh one)."""
    if item["type"] == "message":
        return OutputItem("message", ITEM_PREFIX["message"] + uuid.uuid4().hex, item["content"], done=True)
    if item["type"] == "function_call":
        return OutputItem("function_call", item["id"], item["arguments"], item["name"], item["call_id"], done=True)
    return OutputItem("reasoning", item["id"], item["text"], done=True)
