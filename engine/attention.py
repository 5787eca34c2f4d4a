"""Paged attention over a flat batch, with torch ops only (runs on CPU and GPU alike).

Tokens of one step are packed: decode tokens first (one per sequence), then the prefill
chunks. Decodes run as one call: the C++ kernel of `engine.cpu_kernels` when the runner
passes those ops (it reads the blocks in place), the step's `decode_kernel` where it has one
(a CUDA graph's Triton kernel, also in place), else one batched SDPA call over keys gathered
from the paged cache. Each prefill chunk runs its own call (causal, offset by what is
already cached): the C++ prefill kernel over the blocks in place, else SDPA. A chunk with
bidirectional spans (a Gemma 3 image's tokens, which see each other both ways) runs SDPA with its
mask whatever the kernels. The metadata is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    start_pos: int  # the chunk's first position in its sequence (what is already cached before it)
    block_table: torch.Tensor | None  # [num_blocks] to read; None (torch path): the chunk is the whole context
    mask: torch.Tensor | None  # [1, 1, chunk_len, num_blocks * block_size] bool; None: plain causal or kernel
    # position runs [a, b) whose tokens see each other both ways (`visible_mask`); each ends inside the chunk
    spans: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    block_size: int
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None  # [num_decodes] tokens in the cache, the new one included
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool; None with a kernel
    prefills: list[PrefillChunk]
    sliding_window: int | None = None
    kernels: Any = None  # torch.ops.galley_cpu (engine.cpu_kernels) once built, for CPU float32; else None
    # a decode attention over the blocks in place, the C++ op's signature (CUDA graphs: engine/triton_attention.py)
    decode_kernel: Any = None
    _windows: dict[int | None, AttentionMetadata] = field(default_factory=dict, repr=False)

    @property
    def prefill_bounds(self) -> list[int]:
        """(start, end, start_pos) of each prefill chunk, flat: what the fused layer kernel reads."""
        return [n for chunk in self.prefills for n in (chunk.start, chunk.end, chunk.start_pos)]

    def windowed(self, sliding_window: int | None) -> AttentionMetadata:
        """This step's metadata for layers with another sliding window (models whose layers mix
        windows): the kernels take the window as an argument; the torch path's masks are built once
        per step and window."""
        if sliding_window == self.sliding_window:
            return self
        if sliding_window not in self._windows:
            self._windows[sliding_window] = self._rebuilt(sliding_window)
        return self._windows[sliding_window]

    def _rebuilt(self, window: int | None) -> AttentionMetadata:
        if self.kernels is not None:  # the kernels take the window; only chunks with spans have masks
            prefills = [replace(c, mask=chunk_mask(c, self.block_size, window)) if c.spans else c
                        for c in self.prefills]
            return replace(self, sliding_window=window, prefills=prefills, _windows={})
        decode_mask = None
        if self.num_decodes and self.decode_kernel is None:
            width = self.decode_block_tables.shape[1] * self.block_size
            lens = self.decode_context_lens
            decode_mask = visible_mask(lens - 1, width, lens[:, None], window)[:, None, None, :]
        prefills = [replace(chunk, mask=chunk_mask(chunk, self.block_size, window, self.slot_mapping.device))
                    for chunk in self.prefills]
        return replace(self, decode_mask=decode_mask, prefills=prefills, sliding_window=window, _windows={})


def chunk_mask(chunk: PrefillChunk, block_size: int, window: int | None,
               device: torch.device | None = None) -> torch.Tensor:
    """[1, 1, chunk_len, num_keys] bool: what a prefill chunk's queries see of its keys (its blocks, or
    its own tokens where it is its whole sequence)."""
    n, context_len = chunk.end - chunk.start, chunk.start_pos + chunk.end - chunk.start
    if chunk.block_table is not None:
        device = chunk.block_table.device
    positions = torch.arange(chunk.start_pos, context_len, device=device)
    num_keys = len(chunk.block_table) * block_size if chunk.block_table is not None else n
    return visible_mask(positions, num_keys, context_len, window, chunk.spans)[None, None]


def visible_mask(
    query_positions: torch.Tensor, num_keys: int, context_len: torch.Tensor | int, sliding_window: int | None,
    spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """[num_queries, num_keys] bool: may the query at position p see the key at position k? Causally
    (within the sliding window, if any), and both ways inside each span [a, b), whatever the window:
    HF ORs its blockwise mask over the causal and sliding ones (`block_sequence_ids`).

    Keys at or past `context_len` are padding of the last block and never visible.
    """
    q, k = query_positions[:, None], torch.arange(num_keys, device=query_positions.device)[None, :]
    mask = k <= q
    if sliding_window is not None:
        mask &= q - k < sliding_window
    for a, b in spans:
        mask |= (q >= a) & (q < b) & (k >= a) & (k < b)
    return mask & (k < context_len)


def build_metadata(
    decode_contexts: list[tuple[list[int], int]],
    prefill_chunks: list[tuple[list[int], int, int]],
    slot_mapping: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    kernels: Any = None,
    prefill_spans: list[tuple[tuple[int, int], ...]] | None = None,
) -> AttentionMetadata:
    """decode_contexts: (block_table, context_len); prefill_chunks: (block_table, start_pos, chunk_len);
    prefill_spans: each chunk's bidirectional spans (`visible_mask`), where any has some."""
    decode_tables = decode_lens = decode_mask = None
    if decode_contexts:
        num_blocks = [cdiv(ctx, block_size) for _, ctx in decode_contexts]
        width = max(num_blocks)
        rows = [table[:n] + [0] * (width - n) for (table, _), n in zip(decode_contexts, num_blocks)]
        decode_tables = torch.tensor(rows, dtype=torch.long, device=device)
        decode_lens = torch.tensor([ctx for _, ctx in decode_contexts], dtype=torch.long, device=device)
        if kernels is None:
            last = decode_lens - 1
            decode_mask = visible_mask(last, width * block_size, decode_lens[:, None], sliding_window)[:, None, None, :]

    prefills = []
    offset = len(decode_contexts)
    for i, (table, start_pos, chunk_len) in enumerate(prefill_chunks):
        context_len = start_pos + chunk_len
        n = cdiv(context_len, block_size)
        chunk = PrefillChunk(offset, offset + chunk_len, start_pos, None, None,
                             prefill_spans[i] if prefill_spans else ())
        # the kernel reads the chunk's keys from the cache and masks by position; SDPA reads the blocks
        # with a mask unless the chunk is its whole (causal) sequence
        if kernels is not None or chunk.spans or start_pos > 0 or (
                sliding_window is not None and context_len > sliding_window):
            chunk.block_table = torch.tensor(table[:n], dtype=torch.long, device=device)
        if chunk.spans or (kernels is None and chunk.block_table is not None):
            chunk.mask = chunk_mask(chunk, block_size, sliding_window)
        prefills.append(chunk)
        offset += chunk_len

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        block_size=block_size,
        num_decodes=len(decode_contexts),
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        decode_mask=decode_mask,
        prefills=prefills,
        sliding_window=sliding_window,
        kernels=kernels,
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., max_blocks] block ids -> [..., kv_heads, max_blocks * block_size, head_dim].

    Copies whole blocks (contiguous runs of block_size tokens), far cheaper than per-slot indexing.
    """
    blocks = cache.view(-1, block_size, *cache.shape[1:])  # [num_blocks, block_size, kv_heads, head_dim]
    picked = blocks.index_select(0, block_tables.reshape(-1))
    picked = picked.view(*block_tables.shape[:-1], block_tables.shape[-1] * block_size, *cache.shape[1:])
    return picked.transpose(-3, -2)


def chunk_context(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  chunk: PrefillChunk, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a prefill chunk attends to, [kv_heads, num_keys, head_dim] each: its own
    tokens' when it is its whole sequence (no block table), else its blocks of the cache."""
    if chunk.block_table is None:
        return k[chunk.start : chunk.end].transpose(0, 1), v[chunk.start : chunk.end].transpose(0, 1)
    return gather_blocks(k_cache, chunk.block_table, block_size), gather_blocks(v_cache, chunk.block_table, block_size)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd and meta.kernels is not None:
        meta.kernels.paged_decode_attention(out[:nd], q[:nd].contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, meta.block_size, scale, meta.sliding_window or 0)
    elif nd and meta.decode_kernel is not None:
        meta.decode_kernel(out[:nd], q[:nd].contiguous(), k_cache, v_cache, meta.decode_block_tables,
                           meta.decode_context_lens, meta.block_size, scale, meta.sliding_window or 0)
    elif nd:
        keys = gather_blocks(k_cache, meta.decode_block_tables, meta.block_size)  # [nd, kv_heads, ctx, head_dim]
        values = gather_blocks(v_cache, meta.decode_block_tables, meta.block_size)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd, :, None, :], keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)
    for chunk in meta.prefills:
        if meta.kernels is not None and chunk.mask is None:
            meta.kernels.paged_prefill_attention(out[chunk.start : chunk.end], q[chunk.start : chunk.end], k_cache,
                                                 v_cache, chunk.block_table, chunk.start_pos, meta.block_size, scale,
                                                 meta.sliding_window or 0)
            continue
        query = q[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, heads, chunk, head_dim]
        keys, values = chunk_context(k, v, k_cache, v_cache, chunk, meta.block_size)
        result = F.scaled_dot_product_attention(
            query, keys[None], values[None], attn_mask=chunk.mask, is_causal=chunk.mask is None,
            scale=scale, enable_gqa=True,
        )
        out[chunk.start : chunk.end] = result[0].transpose(0, 1)
    return out


def softcapped_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention whose scores are soft-capped, `softcap * tanh(scores / softcap)` before the softmax
    (Gemma 2), which neither SDPA nor the C++ kernels compute: explicit scores, one sequence at a
    time, over the same paged cache and the same visibility rule (causal, context, sliding window)."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]

    def attend(rows: slice, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len,
               spans: tuple[tuple[int, int], ...] = ()) -> None:
        keys, values = (t.repeat_interleave(groups, dim=0) for t in (keys, values))  # [heads, num_keys, head_dim]
        # in the model's dtype up to the softmax, which is float32, as HF's eager attention rounds (bfloat16)
        scores = q[rows].transpose(0, 1) @ keys.transpose(1, 2) * scale  # [heads, n, num_keys]
        scores = torch.tanh(scores / softcap) * softcap
        visible = visible_mask(positions, keys.shape[1], context_len, meta.sliding_window, spans)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out[rows] = (weights @ values).transpose(0, 1)

    for i in range(meta.num_decodes):
        context_len = int(meta.decode_context_lens[i])
        table = meta.decode_block_tables[i, : cdiv(context_len, meta.block_size)]
        # only the window's keys, as HF's sliding cache holds them: a sum over more (zero-weighted) values
        # rounds otherwise in bfloat16
        first = max(0, context_len - meta.sliding_window) if meta.sliding_window else 0
        keys, values = (gather_blocks(c, table, meta.block_size)[:, first:context_len] for c in (k_cache, v_cache))
        attend(slice(i, i + 1), meta.decode_context_lens[i : i + 1] - 1 - first, keys, values, context_len - first)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.end)
        context_len = chunk.start_pos + chunk.end - chunk.start
        positions = torch.arange(chunk.start_pos, context_len, device=q.device)
        attend(rows, positions, *chunk_context(k, v, k_cache, v_cache, chunk, meta.block_size), context_len,
               chunk.spans)
    return out
