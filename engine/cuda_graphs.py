"""Decode steps replayed from CUDA graphs, captured at load, one per batch-size bucket.

Why: on a GPU a decode step of a small batch is bound by the host. Run op by op, a step's ~25 kernel
launches a layer took ~20 ms on an H200 for a 135M and an 8B model alike, where reading the 8B
model's weights once takes ~4 ms (bench/README.md). A graph replays a whole step with one launch.

A graph has fixed shapes and addresses, so each bucket's graph reads static buffers that a step fills
before the replay: token ids, positions, KV slots, context lengths, and block tables as wide as the
longest context. Decode attention is a kernel that reads each row's blocks in place up to its
context length (engine/triton_attention.py on CUDA), so nothing in the step depends on the batch's
contents. A batch smaller than its bucket is padded with rows that attend to, and write into, a
scratch block no sequence owns. Steps with prefill chunks, adapters or images run eagerly, as do
models whose forward syncs with the host (mixtures of experts) or attends otherwise (soft-capping).

On CPU the same buffers and padding run without capture (`capture=False`): tests check there that a
padded, static-buffer step gives the tokens an eager one gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.attention import AttentionMetadata, cdiv

STEP_INPUTS = 4  # rows of the step buffer: token ids, positions, KV slots, context lengths


def bucket_sizes(max_batch: int) -> list[int]:
    """Batch sizes a graph is captured for (vLLM's spacing): fewer than half of a step's rows are padding."""
    sizes = [1, 2, 4, 8, *range(16, 65, 16), *range(96, max_batch + 32, 32)]
    return sorted({min(size, max_batch) for size in sizes})


class DecodeGraphs:
    def __init__(self, model: Any, kv_caches: list, block_size: int, scratch_block: int, max_blocks: int,
                 max_batch: int, sliding_window: int | None, decode_kernel: Any, capture: bool) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.scratch_block, self.capture = scratch_block, capture
        self.sizes = bucket_sizes(max_batch)
        n, device = self.sizes[-1], kv_caches[0][0].device
        self.inputs = torch.zeros(STEP_INPUTS, n, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)  # every row's logits
        pinned = capture  # page-locked host copies: the step's inputs go up without a staging copy of their own
        self.host_inputs = torch.zeros(STEP_INPUTS, n, dtype=torch.long, pin_memory=pinned)
        self.host_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.long, pin_memory=pinned)
        self.padding = torch.tensor([0, 0, scratch_block * block_size, 1])[:, None]  # id, position, slot, length
        self.metas = {b: AttentionMetadata(
            slot_mapping=self.inputs[2, :b], block_size=block_size, num_decodes=b, decode_block_tables=self.tables[:b],
            decode_context_lens=self.inputs[3, :b], decode_mask=None, prefills=[], sliding_window=sliding_window,
            decode_kernel=decode_kernel) for b in self.sizes}
        self._pad(0, n)
        self.inputs.copy_(self.host_inputs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps run through the buffers
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.inputs[0, :b], self.inputs[1, :b], self.kv_caches, self.metas[b], self.rows[:b])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, all in one memory pool: the smaller graphs reuse its intermediates."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            for b in self.sizes:
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) of the host buffers as padding: token 0 at position 0 in the scratch block."""
        self.host_inputs[:, start:end] = self.padding
        self.host_tables[start:end, 0] = self.scratch_block

    def fits(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_batch

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            contexts: list[tuple[list[int], int]]) -> torch.Tensor:
        """Logits [rows, vocab] float32 of a step of decode rows (each row's own block table and
        context length, its new token included), as the model's eager forward gives them."""
        n = len(input_ids)
        b = next(size for size in self.sizes if size >= n)
        used = [cdiv(length, self.block_size) for _, length in contexts]
        width = max(used)
        host = self.host_inputs.numpy()
        host[:, :n] = np.array([input_ids, positions, slots, [length for _, length in contexts]])
        self._pad(n, b)
        tables = self.host_tables.numpy()
        for row, ((table, _), blocks) in enumerate(zip(contexts, used)):
            tables[row, :blocks] = table[:blocks]
        self.inputs[:, :b].copy_(self.host_inputs[:, :b], non_blocking=True)
        self.tables[:b, :width].copy_(self.host_tables[:b, :width], non_blocking=True)
        self.replays += 1
        if not self.capture:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        return self.logits[b][:n].clone()  # the next replay overwrites the graph's output
