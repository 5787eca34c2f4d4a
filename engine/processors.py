"""A vision-language model's processor: transformers' own (`AutoProcessor`), which renders the chat,
expands each image into its run of image tokens and makes the arrays the vision encoder takes.

Galley takes images, not video. Several families' processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
LLaVA-OneVision, SmolVLM2) hold a video processor too, and transformers' video processors need
torchvision; where that part does not load, the processor is built without it, from the folder's
image processor, tokenizer and chat template, so images are served all the same.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path
from typing import Any


class ProcessorError(ValueError):
    """The folder's processor does not load; the message says why."""


def load_processor(path: Path, architecture: str) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError as exc:  # a part needs a library that is not installed (torchvision, for video)
        try:
            return images_only_processor(path)
        except (ProcessorError, OSError, ValueError, ImportError, TypeError) as inner:
            raise ProcessorError(f"{architecture} takes images, but its processor does not load: "
                                 f"{' '.join(str(exc).split())} ({inner})") from exc
    except (OSError, ValueError) as exc:
        raise ProcessorError(f"{architecture} takes images, but its processor does not load: {exc}") from exc


def images_only_processor(path: Path) -> Any:
    """The folder's processor class with no video processor: its image processor, tokenizer, chat
    template and other settings as `from_pretrained` reads them."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer, ProcessorMixin

    settings, _ = ProcessorMixin.get_processor_dict(path)
    name = settings.get("processor_class") or processor_class_named(path)
    cls = getattr(transformers, name or "", None)
    if cls is None or "video_processor" not in cls.get_attributes():
        raise ProcessorError(f"no processor class with a video part to leave out ({name})")

    class ImagesOnly(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            # transformers cannot even look up a video processor's class without torchvision
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{cls.__name__}ImagesOnly"
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                  "video_processor"}
    kwargs = {key: value for key, value in settings.items() if key in accepted}
    return ImagesOnly(image_processor=AutoImageProcessor.from_pretrained(path),
                      tokenizer=AutoTokenizer.from_pretrained(path), video_processor=None, **kwargs)


def processor_class_named(path: Path) -> str | None:
    """The processor class a folder's configs name, where `AutoProcessor` looks for it."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if (path / name).is_file():
            with contextlib.suppress(ValueError, AttributeError):
                if found := json.loads((path / name).read_text()).get("processor_class"):
                    return found
    return None
