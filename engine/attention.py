"""Paged attention over a flat batch, with torch ops only (runs on CPU and GPU alike).

Tokens of one step are packed: decode tokens first (one per sequence), then the prefill
chunks. Decodes run as one batched SDPA call over keys gathered from the paged cache;
each prefill chunk runs its own SDPA call (causal, offset by what is already cached).
The metadata is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    end: int
    context_slots: torch.Tensor | None  # [context_len] slots to read; None: chunk is the whole context
    mask: torch.Tensor | None  # [1, 1, chunk_len, context_len] bool; None: plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context_len]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context_len] bool
    prefills: list[PrefillChunk]


def context_slots(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(num_tokens)]


def visible_mask(
    query_positions: torch.Tensor, context_len: int, sliding_window: int | None
) -> torch.Tensor:
    """[num_queries, context_len] bool: may query at position p see key position k?"""
    keys = torch.arange(context_len, device=query_positions.device)
    mask = keys[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= query_positions[:, None] - keys[None, :] < sliding_window
    return mask


def build_metadata(
    decode_contexts: list[tuple[list[int], int]],
    prefill_chunks: list[tuple[list[int], int, int]],
    slot_mapping: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """decode_contexts: (block_table, context_len); prefill_chunks: (block_table, start_pos, chunk_len)."""
    decode_slots = decode_mask = None
    if decode_contexts:
        max_len = max(ctx for _, ctx in decode_contexts)
        rows = [context_slots(table, ctx, block_size) + [0] * (max_len - ctx) for table, ctx in decode_contexts]
        decode_slots = torch.tensor(rows, dtype=torch.long, device=device)
        last = torch.tensor([ctx - 1 for _, ctx in decode_contexts], device=device)
        mask = torch.arange(max_len, device=device)[None, :] <= last[:, None]
        if sliding_window is not None:
            mask &= last[:, None] - torch.arange(max_len, device=device)[None, :] < sliding_window
        decode_mask = mask[:, None, None, :]

    prefills = []
    offset = len(decode_contexts)
    for table, start_pos, chunk_len in prefill_chunks:
        context_len = start_pos + chunk_len
        slots = mask = None
        needs_window = sliding_window is not None and context_len > sliding_window
        if start_pos > 0 or needs_window:
            slots = torch.tensor(context_slots(table, context_len, block_size), device=device)
            positions = torch.arange(start_pos, context_len, device=device)
            mask = visible_mask(positions, context_len, sliding_window)[None, None]
        prefills.append(PrefillChunk(offset, offset + chunk_len, slots, mask))
        offset += chunk_len

    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        num_decodes=len(decode_contexts),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
    )


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
    if nd:
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [nd, kv_heads, ctx, head_dim]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        out[:nd] = F.scaled_dot_product_attention(
            q[:nd, :, None, :], keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        ).squeeze(2)
    for chunk in meta.prefills:
        query = q[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, heads, chunk, head_dim]
        if chunk.context_slots is None:
            keys = k[chunk.start : chunk.end].transpose(0, 1)[None]
            values = v[chunk.start : chunk.end].transpose(0, 1)[None]
        else:
            keys = k_cache[chunk.context_slots].transpose(0, 1)[None]
            values = v_cache[chunk.context_slots].transpose(0, 1)[None]
        result = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None,
            scale=scale, enable_gqa=True,
        )
        out[chunk.start : chunk.end] = result[0].transpose(0, 1)
    return out
