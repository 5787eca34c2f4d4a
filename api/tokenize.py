"""vLLM's POST /tokenize and /detokenize: a served model's tokenizer, in vLLM's request and response shapes.

`/tokenize` takes a `prompt` (special tokens added by default) or chat `messages` (through the
chat template, as a chat completion renders them), so a client can count a conversation's
tokens before sending it. `model` may be left out when the caller has one generative model.
"""

from __future__ import annotations

from typing import ClassVar

from aiohttp import web
from pydantic import ConfigDict, Field, model_validator

from api.auth import caller_of
from api.errors import json_response
from api.openai.fields import GENERATION_MAX_BODY_BYTES, MAX_NAME_CHARS, Strict, TokenId
from api.openai.messages import ChatMessage
from api.openai.objects import DetokenizeResponse, TokenizeResponse
from api.openai.schemas import TemplateKwargs, check_template_fields
from api.routes import Route
from api.services import services
from api.validation import parse_body
from services.inference import TokenizeInput, detokenize, tokenize

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    max_body_bytes: ClassVar[int] = GENERATION_MAX_BODY_BYTES

    model: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS, description="Default: the only "
                              "generative model this key may use.")
    prompt: str = Field(None, description="Text to tokenize (exactly one of `prompt` and `messages`).")
    messages: list[ChatMessage] = Field(None, min_length=1, description="A chat, through the model's chat template.")
    add_special_tokens: bool | None = Field(None, description="Default: true for a prompt, false for messages (the "
                                            "template writes them).")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's header.")
    continue_final_message: bool = False
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool | None = Field(None, description="Also each token's string form.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (a string) or `messages` (a chat)")
        check_template_fields(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message)
        return self

    def tokenize_input(self) -> TokenizeInput:
        template = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                    "continue_final_message": self.continue_final_message}
        messages = None if self.messages is None else [m.for_template() for m in self.messages]
        return TokenizeInput(self.model, self.prompt, messages, self.add_special_tokens, template,
                             bool(self.return_token_strs))


class DetokenizeRequest(Strict):
    max_body_bytes: ClassVar[int] = GENERATION_MAX_BODY_BYTES

    model: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS, description="Default: the only "
                              "generative model this key may use.")
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_IDS, description="Token ids, each below the model's "
                                  "vocabulary size.")


async def post_tokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, TokenizeRequest)
    tokenized = await tokenize(services(request).models, caller_of(request), body.tokenize_input())
    return json_response({"count": len(tokenized.token_ids), "max_model_len": tokenized.max_model_len,
                          "tokens": tokenized.token_ids, "token_strs": tokenized.token_strs})


async def depost_tokenize(request: web.Request) -> web.Response:
    body = await parse_body(request, DetokenizeRequest)
    text = await detokenize(services(request).models, caller_of(request), body.model, body.tokens)
    return json_response({"prompt": text})


ROUTES = [
    Route("POST", "/tokenize", post_tokenize, "Tokenize a prompt or a chat (vLLM)", request=TokenizeRequest,
          response=TokenizeResponse),
    Route("POST", "/detokenize", depost_tokenize, "Detokenize token ids (vLLM)", request=DetokenizeRequest,
          response=DetokenizeResponse),
]
