"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API.

A handler parses, makes one call to `services.inference.responses_api`, and renders the run: a
`Response` object, or its stream of events (`event:` and `data:` lines, as OpenAI sends them, each
numbered by `sequence_number`): `response.created`, `response.in_progress`, per output item
`output_item.added`, `content_part.added`, text (or thoughts, or call arguments) deltas and their
`done`s, `output_item.done`, then `response.completed` (`response.incomplete` when
`max_output_tokens` cut it, `response.failed` when generation failed after the stream began). A
failure before the first token is a plain HTTP error, as on chat completions.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator

from aiohttp import web

from api.auth import caller_of
from api.errors import json_response
from api.openai.objects import InputTokens, ResponseEvent, ResponseObject
from api.openai.responses_schemas import InputTokensRequest, ResponseCreateRequest
from api.routes import Route
from api.services import services
from api.sse import Frame, serve_sse
from api.validation import parse_body
from services.inference import Change, OutputItem, Record, ResponseRun, Responses


def item_json(item: OutputItem, status: str, *, empty: bool = False) -> dict:
    """An output item as OpenAI shows it (`empty`: as it is added, before its text)."""
    text = "" if empty else item.text
    if item.type == "function_call":
        return {"id": item.id, "type": "function_call", "status": status, "call_id": item.call_id,
                "name": item.name, "arguments": text}
    parts = [] if empty else [part_json(item, text)]
    if item.type == "reasoning":
        return {"id": item.id, "type": "reasoning", "status": status, "summary": [], "content": parts}
    return {"id": item.id, "type": "message", "status": status, "role": "assistant", "content": parts}


def part_json(item: OutputItem, text: str) -> dict:
    if item.type == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_status(record: Record, items: list[OutputItem], index: int) -> str:
    """The last item of a response cut by `max_output_tokens` is incomplete."""
    return "incomplete" if record.status == "incomplete" and index == len(items) - 1 else "completed"


def usage_json(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage["input_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": usage["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": usage["reasoning_tokens"]},
            "total_tokens": usage["input_tokens"] + usage["output_tokens"]}


def response_json(record: Record, items: list[OutputItem], *, status: str | None = None) -> dict:
    """The Response object; `status` given (`in_progress`, at the start of a stream): without output or usage."""
    status = status or record.status
    done = status != "in_progress"
    body = {
        "id": record.id, "object": "response", "created_at": record.created_at, "status": status,
        "background": False, "model": record.model, "truncation": "disabled", "service_tier": "default",
        "error": {"code": "server_error", "message": record.error} if status == "failed" else None,
        "incomplete_details": {"reason": record.incomplete_reason} if status == "incomplete" else None,
        "output": [item_json(item, item_status(record, items, i)) for i, item in enumerate(items)] if done else [],
        "usage": usage_json(record.usage) if done else None,
        **record.settings,
    }
    if done and record.completed_at is not None:
        body["completed_at"] = record.completed_at
    return body


class Events:
    """A response's stream of events, numbered from 0."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.sequence_number = 0

    def event(self, kind: str, **fields) -> Frame:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return data, None, kind

    def response(self, kind: str, status: str | None = None) -> Frame:
        return self.event(kind, response=response_json(self.run.record, self.run.items, status=status))

    def changes(self, changes: list[Change]) -> Iterator[Frame]:
        for change in changes:
            item = self.run.items[change.index]
            at = {"output_index": change.index}
            if change.kind == "added":
                yield self.event("response.output_item.added", item=item_json(item, "in_progress", empty=True), **at)
                if item.type != "function_call":
                    yield self.event("response.content_part.added", item_id=item.id, content_index=0,
                                     part=part_json(item, ""), **at)
            elif change.kind == "delta":
                yield self.delta(item, change, at)
            else:
                yield from self.done(item, change.index)

    def delta(self, item: OutputItem, change: Change, at: dict) -> Frame:
        if item.type == "function_call":
            return self.event("response.function_call_arguments.delta", item_id=item.id, delta=change.text, **at)
        if item.type == "reasoning":
            return self.event("response.reasoning_text.delta", item_id=item.id, content_index=0, delta=change.text,
                              **at)
        return self.event("response.output_text.delta", item_id=item.id, content_index=0, delta=change.text,
                          logprobs=[], **at)

    def done(self, item: OutputItem, index: int) -> Iterator[Frame]:
        at = {"output_index": index}
        if item.type == "function_call":
            yield self.event("response.function_call_arguments.done", item_id=item.id, arguments=item.text, **at)
        else:
            if item.type == "reasoning":
                yield self.event("response.reasoning_text.done", item_id=item.id, content_index=0, text=item.text,
                                 **at)
            else:
                yield self.event("response.output_text.done", item_id=item.id, content_index=0, text=item.text,
                                 logprobs=[], **at)
            yield self.event("response.content_part.done", item_id=item.id, content_index=0,
                             part=part_json(item, item.text), **at)
        status = item_status(self.run.record, self.run.items, index)
        yield self.event("response.output_item.done", item=item_json(item, status), **at)


async def response_frames(run: ResponseRun) -> AsyncGenerator[Frame, None]:
    events, changes = Events(run), run.changes()
    try:
        first = await anext(changes)  # a failure before the first token is a plain HTTP error
        yield events.response("response.created", "in_progress")
        yield events.response("response.in_progress", "in_progress")
        for frame in events.changes(first):
            yield frame
        try:
            async for batch in changes:
                for frame in events.changes(batch):
                    yield frame
        except Exception:  # logged by the service; the client sees its fixed message
            yield events.response("response.failed")
            return
        yield events.response("response.incomplete" if run.record.status == "incomplete" else "response.completed")
    finally:
        await changes.aclose()


def responses_of(request: web.Request) -> Responses:
    return Responses(services(request).inference)


async def create_response(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, ResponseCreateRequest)
    run = await responses_of(request).create(caller_of(request), body.response_input())
    if body.stream:
        return await serve_sse(request, response_frames(run), {"X-Request-Id": request["request_id"]})
    await run.collect()
    return json_response(response_json(run.record, run.items))


async def count_input_tokens(request: web.Request) -> web.Response:
    body = await parse_body(request, InputTokensRequest)
    count = await responses_of(request).count_input_tokens(caller_of(request), body.response_input())
    return json_response({"object": "response.input_tokens", "input_tokens": count})


async def get_response(request: web.Request) -> web.Response:
    record, items = await responses_of(request).retrieve(caller_of(request), request.match_info["response_id"])
    return json_response(response_json(record, items))


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await responses_of(request).delete(caller_of(request), response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


RESPONSE_PATH = "/v1/responses/{response_id:(?!input_tokens$)[^/]+}"  # input_tokens is POST's alone
ROUTES = [
    Route("POST", "/v1/responses", create_response, "Create a model response (OpenAI's Responses API)",
          request=ResponseCreateRequest, response=ResponseObject, stream_response=ResponseEvent),
    Route("POST", "/v1/responses/input_tokens", count_input_tokens, "Count a response's input tokens",
          request=InputTokensRequest, response=InputTokens),
    Route("GET", RESPONSE_PATH, get_response, "A stored response", response=ResponseObject),
    Route("DELETE", RESPONSE_PATH, delete_response, "Delete a stored response"),
]
