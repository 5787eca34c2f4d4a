"""Paged decode attention as a Triton kernel, for GPU decode steps captured in CUDA graphs.

Same contract as the C++ op `paged_decode_attention` (engine/csrc/decode_attention.cpp) and the
torch path of `engine.attention.paged_attention` for decodes: one query token per sequence,
reading its keys and values in place through its block table. The launch grid depends only on
tensor shapes and every loop bound is loaded on the device (the context length), so the call
never synchronises with the host and a captured graph can be replayed with new block tables and
context lengths written into the same buffers.

Triton is optional: `AVAILABLE` says whether it imports; the kernel is defined only then.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs: the torch and C++ paths serve them
    AVAILABLE = False


KEYS_PER_TILE = 64  # keys per step of the online softmax (flash attention's key block)

if AVAILABLE:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr,
        scale, sliding_window,
        stride_qb, stride_qh, stride_qd,
        stride_ob, stride_oh, stride_od,
        stride_ks, stride_kh, stride_kd,
        stride_vs, stride_vh, stride_vd,
        stride_tb, stride_tn,
        group: tl.constexpr, head_dim: tl.constexpr, block_size: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, KEYS: tl.constexpr,
    ):
        # One program per (query head, sequence): no constraint on the GQA group size (SmolLM2: 3). Heads
        # vary fastest, so the heads of one group, which read the same K/V tiles, run side by side and can
        # find them in L2. The (sequence, head) grid before measured ~350 GB/s of K/V on an H200 (64 x 2048
        # tokens, bf16); this order is not measured yet, and one program per group is the fuller fix
        head = tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
        kv_head = head // group
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < head_dim  # padding of a head_dim that is not a power of two

        context_len = tl.load(lens_ptr + seq)
        # first visible position: the window hides (context_len - 1) - p >= sliding_window
        first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
        q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims * stride_qd, mask=dim_ok, other=0.0)
        q = q.to(tl.float32)

        # finite start: a tile whose keys are all masked gives exp(-inf - m) = 0, never NaN
        m_i = tl.full((), -1.0e30, tl.float32)
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((HEAD_DIM_PAD,), tl.float32)
        # tiles of KEYS positions, as flash attention's key blocks: only those with visible keys, not up to
        # the table's (padded) width; each position finds its slot through its block's table entry
        for t in range(first // KEYS, tl.cdiv(context_len, KEYS)):
            pos = t * KEYS + tl.arange(0, KEYS)
            # masked loads: cache slots past the context (or before the window) may hold garbage/NaN
            visible = (pos >= first) & (pos < context_len)
            block = tl.load(tables_ptr + seq * stride_tb + (pos // block_size) * stride_tn, mask=visible, other=0)
            slots = block * block_size + pos % block_size
            tile_mask = visible[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :] * stride_kd,
                        mask=tile_mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :] * stride_vd,
                        mask=tile_mask, other=0.0).to(tl.float32)
            # the weights rounded to the inputs' dtype before they meet V, as flash attention's (and SDPA's)
            # half-precision matrix product takes them; their sum stays float32, as theirs does
            p_in = p.to(q_ptr.dtype.element_ty).to(tl.float32)
            acc = acc * alpha + tl.sum(p_in[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new

        # context_len 0 (never scheduled) writes zeros rather than 0/0
        result = acc / tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
                 result.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(
    out: torch.Tensor,  # [num_decodes, num_heads, head_dim], written in place
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int64 [num_decodes, max_blocks], padded with block 0
    context_lens: torch.Tensor,  # int64 [num_decodes], the new token included
    block_size: int,
    scale: float,
    sliding_window: int,  # 0: none
) -> None:
    """out[b, h] = softmax(q[b, h] . K[b] * scale) @ V[b] over the visible keys of sequence b.

    Checks only shapes and dtypes (host-side metadata): nothing here reads device memory.
    """
    if not AVAILABLE:
        raise RuntimeError("triton is not installed")
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match q {tuple(q.shape)} {q.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if block_tables.dtype != torch.long or context_lens.dtype != torch.long:
        raise ValueError("block_tables and context_lens must be int64")
    if block_tables.shape[0] != num_decodes or context_lens.shape != (num_decodes,):
        raise ValueError("block_tables and context_lens need one row per decode")
    if block_size < 1 or head_dim < 1:
        raise ValueError(f"block_size {block_size} and head_dim {head_dim} must be positive")
    if num_decodes == 0:
        return
    grid = (num_heads, num_decodes)
    _paged_decode_kernel[grid](
        out, q, k_cache, v_cache, block_tables, context_lens,
        float(scale), int(sliding_window),
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        group=num_heads // num_kv_heads, head_dim=head_dim, block_size=block_size,
        # tl.arange needs powers of two: a head_dim that is not one is padded and masked
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), KEYS=KEYS_PER_TILE,
    )
