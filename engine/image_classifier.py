"""Image classifiers (`image-classify`): a transformers `AutoModelForImageClassification` folder with its own
image processor, behind the encoders' dynamic batcher.

Inputs reach the batcher already decoded (PIL images: `services.inference.images` decodes them off the
event loop, with a pixel cap); a batch is one processor call and one forward, and each image's output
is its logits (`EncoderOutput.values`), labelled by the config's `id2label`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.batcher import Batching
from engine.encoders import EncoderOutput
from engine.loader import ModelLoadError, resolve_dtype


class ImageClassifier:
    kind = "image-classify"

    def __init__(self, path: Path, device: str = "cpu", dtype: str = "auto") -> None:
        import warnings

        from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification

        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        try:
            self.config = AutoConfig.from_pretrained(path)
            with warnings.catch_warnings():  # the PIL backend when torchvision is absent: the same pixels
                warnings.simplefilter("ignore")
                self.processor = AutoImageProcessor.from_pretrained(path)
            self.model = AutoModelForImageClassification.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load an image classifier from {path}: {exc}") from exc

    @property
    def labels(self) -> list[str]:
        return [self.config.id2label.get(i, f"LABEL_{i}") for i in range(self.config.num_labels)]

    @torch.inference_mode()
    def run(self, images: list) -> list[EncoderOutput]:
        """One processor call and one forward over the batch's images: each one's logits."""
        pixels = self.processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
        logits = self.model(pixel_values=pixels["pixel_values"].to(self.device, self.dtype)).logits
        return [EncoderOutput(row, 0) for row in logits.float().cpu().tolist()]

    def example(self):
        from PIL import Image

        return Image.new("RGB", (32, 32))


def start_image_classifier(encoder_id: str, path: Path, worker, device: str, dtype: str, batching: Batching):
    """Load an image classifier and attach its batcher to the device's worker (blocking: off the event loop)."""
    classifier = ImageClassifier(path, device, dtype)
    classifier.run([classifier.example()])  # the first forward is slow: pay for it before serving
    return classifier, worker.attach_encoder(encoder_id, batching.batcher(encoder_id, classifier.run))
