"""What one replica holds in memory: its weights (a draft model's and LoRA adapters' too) and KV cache,
for the admin page, the memory budget's measurements and the device gauges."""

from __future__ import annotations

import torch

from engine.model_runner import ModelRunner
from engine.speculative import Proposer


class DeviceMemory:
    """Memory figures of one replica for the admin page and the device gauges (CUDA only for the latter)."""

    def __init__(self, runner: ModelRunner, proposer: Proposer | None = None) -> None:
        self.device = runner.device
        self.weights_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
        self.kv_cache_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                  for k, v in runner.kv_caches)
        draft = getattr(proposer, "runner", None)  # a draft model's weights and KV count as the replica's
        if draft is not None:
            of_draft = DeviceMemory(draft)
            self.weights_bytes += of_draft.weights_bytes
            self.kv_cache_bytes += of_draft.kv_cache_bytes
        self.adapter_bytes: dict[str, int] = {}  # LoRA adapters loaded over the weights
        self.total_bytes = (torch.cuda.get_device_properties(self.device).total_memory
                            if self.device.type == "cuda" else None)

    def used_bytes(self) -> int | None:
        """torch's allocated bytes on the device (a counter read: no sync); None off CUDA."""
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
