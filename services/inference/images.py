"""Images in requests: base64 (or a `data:` URL) in JSON, or raw bytes, decoded with Pillow off the event
loop, with caps on their bytes and pixels (a decompression bomb is refused before it is decoded). Remote
URLs are never fetched: a server that fetches what a tenant names can be made to reach its own network."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io

from services.errors import InvalidRequestError

MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 40_000_000  # about 6300 x 6300


def image_bytes(data: str | bytes, param: str) -> bytes:
    """The encoded image: raw bytes as given, or a string's base64 (with or without a `data:` URL's prefix)."""
    if isinstance(data, bytes):
        raw = data
    else:
        if data.startswith(("http://", "https://")):
            raise InvalidRequestError("remote image URLs are not fetched: send the image as base64 or a data: URL",
                                      param=param)
        if data.startswith("data:"):
            header, _, data = data.partition(",")
            if not header.endswith(";base64"):
                raise InvalidRequestError("a data: URL image must be base64 (data:image/png;base64,...)", param=param)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"the image is not valid base64: {exc}", param=param) from exc
    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"the image is {len(raw)} bytes; at most {MAX_IMAGE_BYTES}", param=param)
    return raw


def decode_image(raw: bytes, param: str):
    """A PIL image, fully decoded (an undecodable or truncated file, or one of too many pixels, is a 400)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(f"the image is {image.width}x{image.height}; at most {MAX_IMAGE_PIXELS} "
                                          "pixels", param=param)
            image.load()
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"the image cannot be decoded: {exc}", param=param) from exc


async def decode_images(items: list[str | bytes], param: str) -> list:
    """Each image decoded, in a thread (decoding a large image would hold the event loop for its time)."""
    def decode_all() -> list:
        return [decode_image(image_bytes(item, f"{param}.{i}"), f"{param}.{i}") for i, item in enumerate(items)]
    return await asyncio.to_thread(decode_all)
