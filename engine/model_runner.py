"""Turns a scheduled batch into logits: packs tokens, owns the KV tensors, runs the model.

The only module that allocates KV memory. Decode tokens are packed first (a decode's
speculative drafts too, each a decode row over the cache up to itself), then prefill
chunks, so attention can run all decodes as one batched call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention import build_metadata
from engine.cpu_kernels import CPU_KERNELS
from engine.cuda_graphs import DecodeGraphs
from engine.lora import LoraAdapter, LoraStep, PeftAdapter
from engine.models.llama import LlamaForCausalLM
from engine.types import ScheduledBatch, ScheduledSeq

GIB = 1024**3
MAX_HELD_IMAGE_FEATURES = 32  # prompts whose image features wait for their next prefill chunk


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_gib: float = 1.0  # CPU budget
    gpu_memory_utilization: float = 0.85  # CUDA: share of free memory after the weights
    enable_prefix_caching: bool = True  # reuse the KV of a prompt's longest cached prefix
    prefix_cache_idle_seconds: float = 0.0  # > 0: cached blocks unused this long are dropped; 0: kept until needed


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    s = model.shape
    return 2 * s.num_layers * block_size * s.num_kv_heads * s.head_dim * torch.tensor([], dtype=dtype).element_size()


def num_kv_blocks(model: LlamaForCausalLM, cfg: CacheConfig, device: torch.device, dtype: torch.dtype) -> int:
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = free_bytes * cfg.gpu_memory_utilization
    else:
        budget = cfg.kv_cache_gib * GIB
    return max(1, int(budget // kv_bytes_per_block(model, cfg.block_size, dtype)))


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype, block_size: int, num_blocks: int,
        cpu_kernels: bool = True,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        s = model.shape
        self.scratch_block = num_blocks  # one more block, no sequence's: padding rows of a graphed step write there
        num_slots = (num_blocks + 1) * block_size
        self.kv_caches = [
            (
                torch.zeros(num_slots, s.num_kv_heads, s.head_dim, device=device, dtype=dtype),
                torch.zeros(num_slots, s.num_kv_heads, s.head_dim, device=device, dtype=dtype),
            )
            for _ in range(s.num_layers)
        ]
        # the C++ kernels build in the background; steps use the torch path until they are ready
        self.cpu_kernels = CPU_KERNELS if cpu_kernels and device.type == "cpu" and dtype == torch.float32 else None
        if self.cpu_kernels is not None:
            self.cpu_kernels.start()
        self.adapters: dict[str, LoraAdapter] = {}  # LoRA adapters over these weights, by name
        # a prompt's image features, computed at its first chunk with image tokens and held until its last
        # (a prompt evicted from here by newer ones, or preempted, computes them again)
        self.image_features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from CUDA graphs (`capture_graphs`)

    def capture_graphs(self, max_batch: int, max_model_len: int, decode_kernel: Any = None) -> str | None:
        """Capture the decode steps' CUDA graphs (engine/cuda_graphs.py); returns why not where they cannot
        be. `decode_kernel`: tests on CPU give the C++ op, which runs the same padded steps uncaptured."""
        capture = self.device.type == "cuda"
        if capture and decode_kernel is None:
            from engine import triton_attention

            if not triton_attention.AVAILABLE:
                return "triton is not installed"
            decode_kernel = triton_attention.paged_decode_attention
        if decode_kernel is None:
            return "CUDA graphs need a CUDA device"
        if not isinstance(self.model, LlamaForCausalLM) or self.model.shape.experts is not None:
            return f"{type(self.model).__name__} is not a dense native decoder"
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.scratch_block,
                                       -(-max_model_len // self.block_size), max_batch, self.model.shape.sliding_window,
                                       decode_kernel, capture)
        except Exception as exc:  # noqa: BLE001 (Triton compile errors too): eager steps still serve the model
            self.graphs = None
            return f"capture failed: {exc}"
        return None

    def add_adapter(self, name: str, adapter: PeftAdapter) -> LoraAdapter:
        """Load a LoRA adapter onto this replica (AdapterError: it does not fit the model). Its weights are
        float32 whatever the model's dtype, as PEFT keeps them over a half-precision model (autocast_adapter_dtype)."""
        loaded = LoraAdapter(name, self.model.lora_weights(adapter, self.device, torch.float32))
        self.adapters[name] = loaded
        return loaded

    def remove_adapter(self, name: str) -> bool:
        return self.adapters.pop(name, None) is not None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Returns the items that sample, in logits order, and their logits, [num_logits, vocab]
        float32: `item.num_logits` rows each (the last token's, then one per draft)."""
        # stable: decodes first, each part grouped by LoRA adapter (so an adapter's rows are at most two slices)
        ordered = sorted(batch.seqs, key=lambda s: (not s.is_decode, s.seq.adapter))
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledSeq] = []
        decodes: list[tuple[list[int], int]] = []
        prefills: list[tuple[list[int], int, int]] = []
        prefill_spans: list[tuple[tuple[int, int], ...]] = []  # each prefill's bidirectional spans
        bs = self.block_size
        adapter_rows: dict[str, list[tuple[int, int]]] = {}  # adapter -> its slices of the packed rows
        image_rows: list[int] = []  # packed rows that are image tokens of a prompt, and their features
        image_parts: list[torch.Tensor] = []
        axis_positions: list[tuple[int, np.ndarray]] = []  # (first packed row, [3, n]) of multi-axis rotaries
        for item in ordered:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if seq.images is not None and not item.is_decode:
                self._add_image_rows(seq, start, n, len(input_ids), image_rows, image_parts)
            if seq.images is not None and getattr(self.model, "rope_args", None) is not None:
                axis_positions.append((len(input_ids), self._axis_positions(seq, start, n)))
            if seq.adapter:
                slices, first = adapter_rows.setdefault(seq.adapter, []), len(input_ids)
                if slices and slices[-1][1] == first:
                    slices[-1] = (slices[-1][0], first + n)
                else:
                    slices.append((first, first + n))
            input_ids.extend(seq.token_ids[start : start + item.num_known_tokens])
            input_ids.extend(item.draft_token_ids)
            positions.extend(range(start, start + n))
            slot_mapping.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.is_decode:  # with drafts, each one a decode row seeing the cache up to itself
                decodes.extend((seq.block_table, start + 1 + i) for i in range(n))
            else:
                prefills.append((seq.block_table, start, n))
                prefill_spans.append(tuple((a, b) for a, b in seq.bidirectional_spans if a < start + n and b > start))
            if item.num_logits:
                logits_indices.extend(range(len(input_ids) - item.num_logits, len(input_ids)))
                sampled.append(item)
        if (self.graphs is not None and not prefills and not adapter_rows and not image_rows
                and self.graphs.fits(len(input_ids)) and logits_indices == list(range(len(input_ids)))):
            return sampled, self.graphs.run(input_ids, positions, slot_mapping, decodes)
        kernels = self.cpu_kernels.ops if self.cpu_kernels is not None else None
        meta = build_metadata(decodes, prefills, slot_mapping, bs, self.model.shape.sliding_window, self.device,
                              kernels, prefill_spans if any(prefill_spans) else None)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        lora = None
        if adapter_rows:  # KeyError for an adapter not loaded here: the engine fails the requests that name it
            lora = LoraStep([(self.adapters[name], slices) for name, slices in adapter_rows.items()])
        images = (as_tensor(image_rows), torch.cat(image_parts)) if image_rows else None
        position_ids = as_tensor(positions)
        if axis_positions:  # the step's rows on three axes: text rows the same on each
            position_ids = position_ids.expand(3, -1).clone()
            for first, rows in axis_positions:
                position_ids[:, first:first + rows.shape[1]] = torch.from_numpy(rows)
        logits = self.model(
            as_tensor(input_ids), position_ids, self.kv_caches, meta, as_tensor(logits_indices), lora=lora,
            **({"images": images} if images is not None else {}),
        )
        return sampled, logits

    def _axis_positions(self, seq, start: int, n: int) -> np.ndarray:
        """Tokens start..start+n of a prompt with images under a multi-axis rotary, [3, n]: the prompt's
        own positions (computed at its first step), then each later token's index plus the offset."""
        if seq.rope_positions is None:
            seq.rope_positions = self.model.prompt_positions(seq.token_ids[:seq.num_prompt_tokens], seq.images.arrays)
        prompt, offset = seq.rope_positions
        index = np.arange(start, start + n)
        out = np.repeat((index + offset)[None], 3, axis=0)
        inside = index < prompt.shape[1]
        out[:, inside] = prompt[:, index[inside]]
        return out

    def _add_image_rows(self, seq, start: int, n: int, offset: int, rows: list[int], parts: list[torch.Tensor]) -> None:
        """The image tokens among a prefill chunk's prompt tokens (packed from row `offset`) and the
        features that replace their embeddings: the prompt's k-th image token takes its k-th feature row."""
        token_id = self.model.image_token_id
        end = min(start + n, seq.num_prompt_tokens)
        hits = [i for i in range(start, end) if seq.token_ids[i] == token_id]
        if not hits:
            return
        features = self.image_features.pop(seq.request_id, None)
        if features is None:
            features = self.model.image_features(seq.images.arrays)
            num_tokens = seq.token_ids[:seq.num_prompt_tokens].count(token_id)
            if features.shape[0] != num_tokens:
                raise ValueError(f"the prompt has {num_tokens} image tokens for {features.shape[0]} image features")
        before = seq.token_ids[:start].count(token_id)
        rows.extend(offset + i - start for i in hits)
        parts.append(features[before:before + len(hits)])
        if before + len(hits) < features.shape[0]:  # more image tokens in a later chunk
            self.image_features[seq.request_id] = features
            while len(self.image_features) > MAX_HELD_IMAGE_FEATURES:
                self.image_features.popitem(last=False)
