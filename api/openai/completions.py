"""POST /v1/completions: parse, plan the prompt (`services.inference`), answer it (`api.openai.answer`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from api.auth import caller_of
from api.openai.answer import Shape, how, respond
from api.openai.chunks import completion_logprobs
from api.openai.objects import Completion
from api.openai.schemas import CompletionRequest
from api.routes import Route
from api.services import services
from api.validation import parse_body
from services.answers import Answer, ChunkFormat


def completion_choice(fmt: ChunkFormat, tokenizer: Any, index: int, result: Answer) -> dict:
    logprobs = completion_logprobs(tokenizer, result.logprobs, 0) if fmt.logprobs else None
    text = fmt.echo[index] + result.text if fmt.echo else result.text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}


COMPLETION = Shape("text_completion", completion_choice, resumable=False)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await parse_body(request, CompletionRequest)
    outcome = await services(request).inference.complete(caller_of(request), body.prompt_input(), **how(request, body))
    return await respond(request, outcome, COMPLETION)


ROUTES = [
    Route("POST", "/v1/completions", completions, "Create a text completion",
          request=CompletionRequest, response=Completion, stream_response=Completion),
]
