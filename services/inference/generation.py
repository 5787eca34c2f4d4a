"""The generation service: a chat or a prompt -> an admitted generation, answered.

A route's handler parses its body into a `ChatInput` or `PromptInput` and makes one call:
`chat`, `complete` (OpenAI) or `generate` (native). Each plans the request (tenant checks,
conversation history, routing to a model version, prompt ids, sampling params), then answers it
the first way that applies: n > 1 choices as one parent request (`Choices`), a response-cache
hit, a collected answer, or a live, resumable stream (`services.streams.hub`). The handler
renders the `Outcome`. Every submit goes through `Admission` and the shadow mirror; every read
through the one first-event timeout (`services.answers.reading`). The WebSocket starts its
chats with `start_chat`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.types import ImageInputs, SamplingParams, TokenEvent
from scheduling.router import RequestStream, Router, ServedModel
from services.admission import Admission
from services.answers.deltas import AnswerReader, call_ids_of, read_answer
from services.answers.events import ChunkFormat
from services.answers.reading import Answer, collect, finish_reason, scheduled_events, stream_failed
from services.answers.reasoning import Reasoning, marks_are_special, reasoning_for
from services.cache.response_cache import CachedCompletion, ResponseCache
from services.conversations import Conversations
from services.deployments.manager import ModelManager
from services.deployments.shadow import ShadowMirror
from services.errors import InvalidRequestError
from services.inference.choices import Choices
from services.inference.prompts import decode_tokens, encode_chat, encode_prompt
from services.inference.requests import ChatInput, GenerationInput, PromptInput
from services.inference.structured import constrain
from services.inference.tools import chat_template_of, constrained_params, prompt_with_tools
from services.inference.vision import encode_vision_chat, has_images, image_names
from services.observability.metrics import Metrics
from services.sampling import sampling_params
from services.streams.hub import LiveStream, StreamHub
from services.tenancy import Caller

CHUNK_ID_PREFIX = {"chat": "chatcmpl", "completion": "cmpl"}


@dataclass
class Plan:
    """A generation validated, routed and encoded, not yet submitted."""

    kind: str  # chat | completion
    ask: GenerationInput
    model: ServedModel
    prompt_ids: list[int]
    params: SamplingParams
    new_messages: list[dict] = field(default_factory=list)  # a conversation's messages to store
    echo: str = ""  # a text completion's prompt text, when `echo` asks for it
    tool_format: str | None = None  # tools are in play: the answer's calls are parsed in this format
    reasoning: Reasoning | None = None  # a thinking model: its thoughts are split from its answer
    images: ImageInputs | None = None  # a vision-language model's prompt images

    @property
    def conversation_id(self) -> str | None:
        return getattr(self.ask, "conversation_id", None)


@dataclass
class Outcome:
    """How a planned generation is answered: exactly one of `answers`, `choices`, `cached` and `live`."""

    fmt: ChunkFormat
    model: ServedModel  # the version that answered (its tokenizer shows logprobs)
    answers: list[Answer] | None = None  # complete: n choices collected, a cache hit, a collected answer
    choices: Choices | None = None  # n > 1 choices to stream, merged
    cached: CachedCompletion | None = None  # a cache hit to stream
    live: LiveStream | None = None  # a live, resumable stream to serve
    resumable: bool = True  # the answer names its stream (X-Stream-Id); several choices are not resumable
    n: int = 1  # choices per prompt (`answers` and `choices` hold a prompt's n choices side by side)
    served: Callable[[], None] = lambda: None  # to call once `live` was served: its answer may go to the cache


@dataclass
class Generated:
    """A native generation: `stream` to read (streamed), else its `result` (JSON, perhaps from the cache)."""

    model: ServedModel
    stream: RequestStream | None = None
    result: dict | None = None


@dataclass
class Started:
    """A submitted generation and the chunk format (its id: the stream id) it is shown in."""

    stream: RequestStream
    fmt: ChunkFormat


class Inference:
    def __init__(self, router: Router, models: ModelManager, admission: Admission, metrics: Metrics, hub: StreamHub,
                 shadows: ShadowMirror, conversations: Conversations, cache: ResponseCache) -> None:
        self.router = router
        self.models = models  # routes each request to its served version
        self.admission = admission
        self.metrics = metrics
        self.hub = hub
        self.shadows = shadows
        self.conversations = conversations
        self.cache = cache

    # ---- planning ----------------------------------------------------------------------

    async def plan_chat(self, caller: Caller, ask: ChatInput, pinned_version: str | None = None) -> Plan:
        """Check, route and apply the chat template (after the conversation's history); `pinned_version`:
        the version a continued chat ran on (a stored response's, `services.inference.responses_api`)."""
        check_n(ask)
        caller.check_priority(ask.priority)
        history, pinned = [], pinned_version
        if ask.conversation_id:
            history, pinned = await self.conversations.history(caller, ask.conversation_id, ask.model)
        model = await self.models.route(caller, ask.model, user=ask.user, conversation_id=ask.conversation_id,
                                       pinned_version=pinned)
        tools = prompt_with_tools(model.tokenizer, history + ask.messages, ask.tools, model.tool_parser)
        images = None
        if has_images(tools.messages):
            names = ["conversation_id"] * len(image_names(history)) + image_names(ask.messages)
            prompt_ids, images = await encode_vision_chat(model, tools.messages, names=names,
                                                          template_kwargs=tools.template_kwargs(ask.template_kwargs))
        else:
            prompt_ids = await encode_chat(model, tools.messages,
                                           template_kwargs=tools.template_kwargs(ask.template_kwargs))
        params = sampling_params(ask.options, ask.max_tokens, len(prompt_ids), model, ask.logprobs,
                                 cap=caller.tenant.max_tokens, prompt_param="messages")
        params = await constrained_params(model, params, ask.tools, ask.output, tools.format)
        reasoning = None
        if params.guided is None:  # a grammar decides the answer from its first token
            reasoning = reasoning_for(model.tokenizer, chat_template_of(model.tokenizer), prompt_ids,
                                      model.reasoning_parser)
            if reasoning is not None and marks_are_special(model.tokenizer):
                params = dataclasses.replace(params, skip_special_tokens=False)
        return Plan("chat", ask, model, prompt_ids, params, ask.messages, tool_format=tools.format,
                    reasoning=reasoning, images=images)

    async def plan_prompts(self, caller: Caller, ask: PromptInput) -> list[Plan]:
        """Route once, then check and tokenize each prompt (a text completion's, a native generation's one)."""
        check_n(ask)
        model = await self.models.route(caller, ask.model, user=ask.user)
        caller.check_priority(ask.priority)
        prompts = ask.prompts()
        return [await self.plan_text(caller, ask, model, prompt, "prompt" if len(prompts) == 1 else f"prompt.{i}")
                for i, prompt in enumerate(prompts)]

    async def plan_prompt(self, caller: Caller, ask: PromptInput) -> Plan:
        """A request of one prompt (a native generation), planned."""
        return (await self.plan_prompts(caller, ask))[0]

    async def plan_text(self, caller: Caller, ask: PromptInput, model: ServedModel, prompt: str | list[int],
                        param: str) -> Plan:
        prompt_ids = await encode_prompt(model, prompt, param)
        default = ask.default_max_tokens
        if default is not None and ask.default_within_context:
            default = max(1, min(default, model.max_model_len - len(prompt_ids)))
        params = sampling_params(ask.options, ask.max_tokens, len(prompt_ids), model, ask.logprobs,
                                 cap=caller.tenant.max_tokens, default_max_tokens=default, prompt_param=param)
        if ask.output is not None:
            params = await constrain(model, params, ask.output.spec(), ask.output.param)
        echo = "" if not ask.echo else prompt if isinstance(prompt, str) else await decode_tokens(model, prompt)
        return Plan("completion", ask, model, prompt_ids, params, echo=echo)

    def format(self, plans: list[Plan], request_id: str) -> ChunkFormat:
        """The chunk format of the answer to `plans` (their choices in order); its id (the stream
        id) from `request_id`."""
        ask = plans[0].ask
        echo = tuple(plan.echo for plan in plans for _ in range(ask.n)) if getattr(ask, "echo", False) else ()
        reasoning = plans[0].reasoning
        return ChunkFormat(plans[0].kind, f"{CHUNK_ID_PREFIX[plans[0].kind]}-{request_id}", int(time.time()),
                           self.router.label(plans[0].model), ask.include_usage, ask.logprobs is not None,
                           continuous_usage=ask.include_usage and ask.continuous_usage, echo=echo,
                           tool_format=plans[0].tool_format,
                           reasoning_starts_inside=None if reasoning is None else reasoning.starts_inside)

    # ---- answering ---------------------------------------------------------------------

    async def chat(self, caller: Caller, ask: ChatInput, *, stream: bool, cache_asked: bool | None) -> Outcome:
        """A chat completion, planned and answered."""
        plan = await self.plan_chat(caller, ask)
        return await self.answer(caller, plan, stream=stream, cache_asked=cache_asked)

    async def complete(self, caller: Caller, ask: PromptInput, *, stream: bool,
                       cache_asked: bool | None) -> Outcome:
        """A text completion (of one prompt or several), planned and answered."""
        plans = await self.plan_prompts(caller, ask)
        if len(plans) > 1:
            return await self.answer_choices(caller, plans, stream=stream)
        return await self.answer(caller, plans[0], stream=stream, cache_asked=cache_asked)

    async def generate(self, caller: Caller, ask: PromptInput, *, stream: bool,
                       cache_asked: bool | None) -> Generated:
        """A native generation: streamed (submitted; read it with `events`), or collected to
        {"model", "text", "finish_reason", "usage", "model_version"}, from the response cache when it can be."""
        plan = await self.plan_prompt(caller, ask)
        model = plan.model
        if stream:
            return Generated(model, stream=self.submit_plan(caller, plan))
        key = self.cache.generation_key(caller, model, plan.prompt_ids, plan.params, cache_asked, "native")
        result = self.cache.lookup(caller, model.name, key)  # None: not cacheable, or a miss
        if result is None:
            answer = await self.collect(self.submit_plan(caller, plan))
            result = {"model": self.router.label(model), "text": answer.text, "finish_reason": answer.finish_reason,
                      "usage": answer.usage, "model_version": model.version}
            self.cache.remember(key, result)
        return Generated(model, result=result)

    async def answer(self, caller: Caller, plan: Plan, *, stream: bool, cache_asked: bool | None) -> Outcome:
        """Answer a planned chat or text completion, the first of four ways that applies: n > 1
        choices (streamed merged, or collected); a response-cache hit; a collected answer; a live,
        resumable stream (streamed, or followed to its end for a conversation turn, whose answer the
        stream stores). Thoughts and tool calls are read out of the text the same way in each
        (`services.answers.deltas`): the cache and the stream keep the raw text."""
        if plan.ask.n > 1:
            return await self.answer_choices(caller, [plan], stream=stream)
        key = self.cache.generation_key(caller, plan.model, plan.prompt_ids, plan.params, cache_asked, "openai",
                                        plan.conversation_id, images=plan.images)
        cached = self.cache.lookup(caller, plan.model.name, key)  # None: not cacheable, or a miss
        if cached is not None:
            fmt = self.format([plan], uuid.uuid4().hex)
            if stream:
                return Outcome(fmt, plan.model, cached=cached)
            hit = Answer(cached.text, [], cached.finish_reason, cached.usage)
            return Outcome(fmt, plan.model, answers=[read_answer(hit, AnswerReader.of(fmt, call_ids=cached.call_ids))])
        started = await self.start(caller, plan)
        if not stream and not plan.conversation_id:
            result = await self.collect(started.stream)
            self.cache.remember_completion(key, result.text, result.finish_reason, result.usage,
                                           call_ids_of(started.fmt.id))
            return Outcome(started.fmt, plan.model, answers=[read_answer(result, AnswerReader.of(started.fmt))])
        live = self.go_live(plan, started)
        if stream:
            return Outcome(started.fmt, plan.model, live=live, served=lambda: self.cache.remember_live(key, live))
        answer = read_answer(await self.collect_live(live), AnswerReader.of(started.fmt))
        return Outcome(started.fmt, plan.model, answers=[answer])

    async def answer_choices(self, caller: Caller, plans: list[Plan], *, stream: bool) -> Outcome:
        """n choices of each planned prompt as one parent request, streamed merged or collected."""
        choices = self.submit_n(caller, plans)
        fmt, n = self.format(plans, uuid.uuid4().hex), plans[0].ask.n
        if stream:
            return Outcome(fmt, plans[0].model, choices=choices, resumable=False, n=n)
        answers = [read_answer(answer, AnswerReader.of(fmt, i)) for i, answer in enumerate(await choices.collect())]
        return Outcome(fmt, plans[0].model, answers=answers, resumable=False, n=n)

    # ---- submitting --------------------------------------------------------------------

    def submit(self, caller: Caller, model: ServedModel, prompt_ids: list[int], params: SamplingParams,
               priority: str | None, cache_salt: str = "", images: ImageInputs | None = None) -> RequestStream:
        """One generation through admission (and the shadow mirror, when the model has one)."""
        limits, weight = caller.limits()
        stream = self.admission.generation(model, prompt_ids, params, limits, weight, caller.priority(priority),
                                           cache_salt=cache_salt, images=images)
        self.shadows.mirror(stream, self.metrics.log_prompts)
        return stream

    def submit_plan(self, caller: Caller, plan: Plan) -> RequestStream:
        return self.submit(caller, plan.model, plan.prompt_ids, plan.params, plan.ask.priority, plan.ask.cache_salt,
                           plan.images)

    def submit_n(self, caller: Caller, plans: list[Plan]) -> Choices:
        """`n` generations of each planned prompt, side by side (seeded: seed, seed + 1, ..., so a
        prompt's choices differ yet repeat); all or nothing: if one is refused, the others are aborted."""
        n, streams = plans[0].ask.n, []
        priority = caller.priority(plans[0].ask.priority)  # once, not per choice
        try:
            for plan in plans:
                for i in range(n):
                    seed = None if plan.params.seed is None else (plan.params.seed + i) % 2**63
                    streams.append(self.submit(caller, plan.model, plan.prompt_ids,
                                               dataclasses.replace(plan.params, seed=seed), priority,
                                               plan.ask.cache_salt, plan.images))
        except Exception:
            for stream in streams:
                self.router.abort(stream)
            raise
        return Choices(self.router, self.metrics, streams, n)

    async def start(self, caller: Caller, plan: Plan) -> Started:
        """Submit a planned generation; store the new messages of a conversation. Nothing owns the
        stream until this returns, so if the write fails (or the caller leaves during it) the
        generation is aborted: left running it would hold a slot to the end of the context for no one."""
        stream = self.submit_plan(caller, plan)
        started = Started(stream, self.format([plan], stream.request_id))
        conversation_id = plan.conversation_id
        if conversation_id:
            try:
                await self.conversations.append(conversation_id, plan.new_messages)  # deleted meanwhile: 404
            except BaseException:
                self.router.abort(stream)
                raise
        return started

    def go_live(self, plan: Plan, started: Started) -> LiveStream:
        """Record a started generation as a resumable stream (its followers read it from the hub)."""
        conversation = bool(plan.conversation_id)
        on_disconnect = plan.ask.on_disconnect or (self.hub.config.on_disconnect_conversation if conversation
                                                   else self.hub.config.on_disconnect_plain)
        return self.hub.start(started.stream, started.fmt, kind=plan.kind, conversation_id=plan.conversation_id,
                              on_disconnect=on_disconnect)

    async def start_chat(self, caller: Caller, ask: ChatInput) -> LiveStream:
        """A chat as one live stream (one choice, as the WebSocket streams it)."""
        if ask.n > 1:
            raise InvalidRequestError("a chat over the WebSocket streams one choice: n must be 1", param="n")
        plan = await self.plan_chat(caller, ask)
        return self.go_live(plan, await self.start(caller, plan))

    # ---- reading -----------------------------------------------------------------------

    def events(self, stream: RequestStream) -> AsyncIterator[TokenEvent]:
        """A generation's events (the first-event timeout applies); the reader aborts what it leaves."""
        return scheduled_events(self.router, self.metrics, stream)

    async def collect(self, stream: RequestStream) -> Answer:
        """A generation to its end; the caller leaving aborts it."""
        return await collect(self.router, self.metrics, stream)

    async def collect_live(self, live: LiveStream) -> Answer:
        """Follow a live stream to its end."""
        self.hub.attach(live)
        try:
            text, logprobs, last = "", [], None
            async for event in live.follow():
                if event.error:
                    raise stream_failed(event)
                text += event.text
                logprobs.extend(event.logprobs or [])
                last = event
            return Answer(text, logprobs, finish_reason(last.finish_reason), last.usage)
        finally:
            self.hub.detach(live)

    def abort(self, stream: RequestStream) -> None:
        if not stream.finished:
            self.router.abort(stream)


def check_n(ask: GenerationInput) -> None:
    if ask.n > 1 and getattr(ask, "conversation_id", None):
        raise InvalidRequestError("n > 1 cannot continue a conversation: it would not know which choice to keep",
                                  param="n")

