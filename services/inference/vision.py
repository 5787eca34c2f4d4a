"""Images in chat messages (OpenAI's `image_url` content parts) for vision-language models.

Each image is decoded with the caps of `services.inference.images` (base64 or a `data:` URL; remote
URLs are never fetched), put in the conversation where the client put it, as the processor's chat
template reads it (`{"type": "image"}`), and the model's own processor (transformers'
`apply_chat_template`, as HF's examples call it) renders the conversation, expands each image into
its run of image tokens and makes the pixel arrays the engine's vision encoder takes. All of it off
the event loop. A model without a processor refuses images with a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from jinja2 import TemplateError

from engine.types import ImageInputs
from scheduling.router import ServedModel
from services.errors import InvalidRequestError
from services.inference.images import decode_image, image_bytes
from services.inference.prompts import chat_chars, check_prompt_chars
from services.sampling import check_token_ids

MAX_IMAGES = 8  # per request: each is hundreds to thousands of tokens of prefill and an encoder pass


def image_url(part: dict[str, Any]) -> str | None:
    """The URL (or base64) of an `image_url` (Chat Completions) or `input_image` (Responses) part, else None."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if part.get("type") == "input_image":
        return part.get("image_url")
    return None


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(image_url(p) is not None for p in m["content"])
               for m in messages)


def image_names(messages: list[dict[str, Any]], param: str = "messages") -> list[str]:
    """Where each image part of `messages` sits, in order: `{param}.{i}.content.{j}`."""
    return [f"{param}.{i}.content.{j}" for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"]) if image_url(p) is not None]


async def encode_vision_chat(model: ServedModel, messages: list[dict[str, Any]], param: str = "messages",
                             template_kwargs: dict[str, Any] | None = None,
                             names: list[str] | None = None) -> tuple[list[int], ImageInputs]:
    """Token ids (each image a run of image tokens) and the images' arrays and digests; 400 naming the
    part for an image that is refused, cannot be decoded, or goes to a model that takes no images.
    `names`: each image's place in the request, where `messages` are not the request's own (a
    conversation's history before them, a tools system message inserted)."""
    urls = [url for m in messages if isinstance(m.get("content"), list) for p in m["content"]
            if (url := image_url(p)) is not None]
    names = names if names is not None and len(names) == len(urls) else image_names(messages, param)
    located = list(zip(names, urls, strict=True))
    if model.processor is None:
        why = f": {model.images_refused}" if model.images_refused else ""
        raise InvalidRequestError(f"the model `{model.name}` takes no images: image_url parts need a vision-language "
                                  f"model (its modalities: text){why}",
                                  param=located[0][0], code="images_not_supported")
    if len(located) > MAX_IMAGES:
        raise InvalidRequestError(f"{len(located)} images; at most {MAX_IMAGES} a request", param=located[0][0])
    check_prompt_chars(model, chat_chars(messages), param)

    def work() -> tuple[list[int], ImageInputs]:
        raws = [image_bytes(url or "", where) for where, url in located]
        images = iter([decode_image(raw, where) for raw, (where, _) in zip(raws, located)])
        conversation = [{**m, "content": [{"type": "image", "image": next(images)} if image_url(p) is not None
                                          else p for p in m["content"]]} if isinstance(m.get("content"), list)
                        else m for m in messages]
        try:
            encoded = model.processor.apply_chat_template(
                conversation, tokenize=True, return_dict=True, return_tensors="np",
                **{"add_generation_prompt": True, **(template_kwargs or {})})
        except (TemplateError, ValueError, TypeError) as exc:  # the template or processor refuses these messages
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}", param=param) from exc
        arrays = {name: value for name, value in encoded.items() if name not in ("input_ids", "attention_mask")}
        digests = tuple(hashlib.sha256(raw).hexdigest() for raw in raws)
        return encoded["input_ids"][0].tolist(), ImageInputs(arrays, digests)

    token_ids, images = await asyncio.to_thread(work)
    check_token_ids(model, token_ids, param)
    return token_ids, images
