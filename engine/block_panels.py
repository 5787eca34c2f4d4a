"""A GGUF file's quantized weights kept as the file has them, for the CPU kernels (the default for
a GGUF source on CPU in float32; `quantization = "none"` de-quantizes them at load instead).

Why: de-quantized to float32, SmolLM2-135M's Q4_1 file grows from 98 MB to ~650 MB, and one
decoding stream reads all of it per token: memory bandwidth, not arithmetic, sets its speed
(0.6x of llama.cpp's on the same file, bench/README.md). Kept as blocks, a token reads 0.75 bytes
per weight; the kernels (`engine/csrc/block_gemm.h`) de-quantize each block in L1 just before its
FMAs.

The de-quantized model's weights: every format here is w = code * scale + min with code * scale
exact in float32 (an fp16 scale, or an fp16 times a 6-bit or int8 sub-scale, times a 4- to 8-bit
code), so a weight is the float the `gguf` package's numpy kernels give. From five rows the kernels
run the float panels' FMAs in their order (the float path's outputs bit for bit); one to four rows
(decoding a few streams) sum each block's x * code before its scale and min, the same sums in
another order, equal to float32's rounding (tested; greedy output equals the de-quantized model's).

Formats (`QuantBlocks`, from a tensor's GGUF type in `from_gguf`):
- 4-bit codes in blocks of 32: Q4_0 (min = -8 scale), Q4_1, Q4_K (a sub-block's scale and min);
- 8-bit codes: Q5_0, Q5_1, Q5_K (5-bit codes, blocks of 32), Q8_0 (blocks of 32), Q6_K (blocks of
  16, min 0).
Other types (Q2_K, Q3_K, IQ*, F16, ...) are de-quantized to float32 as before. A fused matrix
(q/k/v, gate/up) whose parts differ takes the 8-bit form for all; one with a float part is float.

Panels (`to_panels`), what the kernels read: [ceil(N / 16), K / block, 384] bytes, per panel of 16
output features and block of K: 16 scales, 16 mins (float32), then the codes, k-major: 4-bit
[32][8] bytes (feature i in the low nibble, i + 8 in the high; dtype uint8), 8-bit [16][16] (int8).
8-bit codes with no mins in blocks of 32 (Q8_0, a tied lm_head's usual type) drop the mins and take
32 k a block: 16 scales, then [32][16] codes, 576 bytes (int8), 1.125 bytes a weight instead of 1.5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

PANEL = 16
BLOCK_BYTES = 384
SCALED_BLOCK_BYTES = 576  # 8-bit codes without mins: 16 scales, 32 k of codes
PANEL_BLOCK = {4: 32, 8: 16}  # k per panel block, by code width
SCALED_BLOCK = 32  # k per panel block of 8-bit codes without mins
# the GGUF types kept, by the width of their codes here (5-bit codes take the 8-bit form)
FORMAT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q8_0": 8, "Q6_K": 8}
FORMATS = tuple(FORMAT_BITS)
SCALED_FORMATS = ("Q5_0", "Q8_0")  # 8-bit codes, no mins, blocks of 32: the scaled panels (`scaled_only`)


def panel_bytes_per_weight(qtype: str) -> float:
    """What a weight of `qtype` takes in the kernels' panels (0.75 bytes for 4-bit codes, 1.125 for
    8-bit codes without mins in blocks of 32, 1.5 for other 8-bit codes)."""
    if qtype in SCALED_FORMATS:
        return SCALED_BLOCK_BYTES / (SCALED_BLOCK * PANEL)
    return BLOCK_BYTES / (PANEL_BLOCK[FORMAT_BITS[qtype]] * PANEL)


@dataclass
class QuantBlocks:
    """w[n, k] = codes[n, k] * scale[n, k // block] + min[n, k // block], rows as the weight's."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15 (4-bit) or int8 (8-bit)
    scale: torch.Tensor  # [N, K // block] float32
    min: torch.Tensor  # [N, K // block] float32

    @property
    def bits(self) -> int:
        return 4 if self.codes.dtype == torch.uint8 else 8

    @property
    def block(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, as the gguf package computes it
        b = self.block
        return self.codes.float() * self.scale.repeat_interleave(b, 1) + self.min.repeat_interleave(b, 1)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantBlocks:
        """The same rows reordered by `fn` (of a [N, ...] tensor), e.g. GGUF's q/k permutation."""
        return QuantBlocks(fn(self.codes), fn(self.scale), fn(self.min))

    def with_block(self, block: int) -> QuantBlocks:
        """The same weights with scales repeated over smaller blocks."""
        repeat = self.block // block
        return QuantBlocks(self.codes, self.scale.repeat_interleave(repeat, 1), self.min.repeat_interleave(repeat, 1))

    def eight_bit(self) -> QuantBlocks:
        return self if self.bits == 8 else QuantBlocks(self.codes.to(torch.int8), self.scale, self.min)

    @classmethod
    def cat(cls, parts: list[QuantBlocks]) -> QuantBlocks:
        """Row-wise: 4-bit if every part is, else all as 8-bit on the smallest block."""
        if any(p.bits == 8 for p in parts) or len({p.block for p in parts}) > 1:
            block = min(p.block for p in parts)
            parts = [p.eight_bit().with_block(block) for p in parts]
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "min")))

    def can_pack(self) -> bool:
        return self.block % PANEL_BLOCK[self.bits] == 0

    def scaled_only(self) -> bool:
        """8-bit codes with no mins in blocks of 32 or more: the smaller 8-bit panels."""
        return self.bits == 8 and self.block % SCALED_BLOCK == 0 and not self.min.any()

    def to_panels(self) -> torch.Tensor:
        """The kernels' layout (module docstring): uint8 for 4-bit codes, int8 for 8-bit."""
        scaled = self.scaled_only()
        b = self.with_block(SCALED_BLOCK if scaled else PANEL_BLOCK[self.bits])
        n, k = b.codes.shape
        p, nb = -(-n // PANEL), b.scale.shape[1]
        pad = p * PANEL - n  # zero codes, scales and mins: w = 0 past the last feature

        def per_panel(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [P, 16, ...]
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]).view(p, PANEL, *t.shape[1:])

        def floats(t: torch.Tensor) -> torch.Tensor:  # [N, nb] -> [P, nb, 64] bytes
            return per_panel(t.float()).transpose(1, 2).contiguous().view(torch.uint8)

        codes = per_panel(b.codes.view(torch.uint8)).view(p, PANEL, nb, k // nb).permute(0, 2, 3, 1)  # [P, nb, k, 16]
        if self.bits == 4:
            codes = codes[..., :8] | codes[..., 8:] << 4
        heads = [floats(b.scale)] if scaled else [floats(b.scale), floats(b.min)]
        packed = torch.cat([*heads, codes.reshape(p, nb, -1)], dim=2).contiguous()
        return packed if self.bits == 4 else packed.view(torch.int8)


def panels_to_float(panels: torch.Tensor) -> torch.Tensor:
    """Block panels -> float panels [P, K, 16] (the torch path, before or without the kernels)."""
    raw = panels.view(torch.uint8)
    p, nb, size = raw.shape
    if size == SCALED_BLOCK_BYTES:
        scale = raw[..., :64].contiguous().view(torch.float32)[:, :, None, :]
        codes = raw[..., 64:].view(torch.int8).reshape(p, nb, SCALED_BLOCK, PANEL)
        return (codes.float() * scale).reshape(p, -1, PANEL)
    scale, min_ = (raw[..., i:i + 64].contiguous().view(torch.float32)[:, :, None, :] for i in (0, 64))
    if panels.dtype == torch.uint8:
        codes = raw[..., 128:].reshape(p, nb, 32, 8)
        codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1)
    else:
        codes = raw[..., 128:].view(torch.int8).reshape(p, nb, 16, 16)
    return (codes.float() * scale + min_).reshape(p, -1, PANEL)


class BlockEmbedding(nn.Module):
    """An embedding table kept as blocks; the step's rows are de-quantized as they are looked up."""

    def __init__(self, blocks: QuantBlocks) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = blocks.shape
        self.codes = nn.Parameter(blocks.codes, requires_grad=False)
        self.scale = nn.Parameter(blocks.scale, requires_grad=False)
        self.min = nn.Parameter(blocks.min, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return QuantBlocks(self.codes[ids], self.scale[ids], self.min[ids]).dequantize()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.codes.dtype} codes"


def from_gguf(data: np.ndarray, qtype: str) -> QuantBlocks | None:
    """A GGUF tensor ([N, bytes per row], the file's blocks) as `QuantBlocks`; None for other types."""
    rows = data.shape[0]
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = data.reshape(-1, head + 16)
        scale = halves(blocks[:, 0:2])
        min_ = -8 * scale if qtype == "Q4_0" else halves(blocks[:, 2:4])
        codes = nibbles(blocks[:, head:])  # [blocks, 32]
    elif qtype == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(-1, 144)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each
        scale = (halves(blocks[:, 0:2])[:, None] * sc.astype(np.float32)).reshape(-1)
        min_ = (-halves(blocks[:, 2:4])[:, None] * m.astype(np.float32)).reshape(-1)
        # 4 runs of 32 bytes: the low nibbles are sub-block 2i, the high ones 2i + 1
        codes = nibbles(blocks[:, 16:].reshape(-1, 32))
    elif qtype in ("Q5_0", "Q5_1"):  # d (q - 16), d q + m; the fifth bits of a block's 32 codes in a uint32
        head = 2 if qtype == "Q5_0" else 4
        blocks = data.reshape(-1, head + 20)
        scale = halves(blocks[:, 0:2])
        min_ = np.zeros_like(scale) if qtype == "Q5_0" else halves(blocks[:, 2:4])
        fifth = (blocks[:, head:head + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        codes = (nibbles(blocks[:, head + 4:]) | fifth.astype(np.uint8) << 4).astype(np.int8)
        codes = codes - 16 if qtype == "Q5_0" else codes
    elif qtype == "Q5_K":  # Q4_K's scales and layout, the fifth bit of sub-block i in bit i of qh
        from gguf.quants import Q4_K

        blocks = data.reshape(-1, 176)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = (halves(blocks[:, 0:2])[:, None] * sc.astype(np.float32)).reshape(-1)
        min_ = (-halves(blocks[:, 2:4])[:, None] * m.astype(np.float32)).reshape(-1)
        low = nibbles(blocks[:, 48:].reshape(-1, 32)).reshape(-1, 8, 32)
        fifth = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [blocks, 8, 32]
        codes = (low | fifth << 4).astype(np.int8)
    elif qtype == "Q8_0":
        blocks = data.reshape(-1, 34)
        scale = halves(blocks[:, 0:2])
        min_ = np.zeros_like(scale)
        codes = blocks[:, 2:].copy().view(np.int8)
    elif qtype == "Q6_K":
        blocks = data.reshape(-1, 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sub_scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [blocks, 16]
        scale = (halves(blocks[:, 208:210])[:, None] * sub_scales).reshape(-1)
        min_ = np.zeros_like(scale)
        # as gguf.quants.Q6_K: 2 halves of 128, each 4 runs of 32 from ql's nibbles and qh's 2-bit pairs
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
        codes = (low.reshape(-1, 2, 4, 32) | high.reshape(-1, 2, 4, 32) << 4).astype(np.int8) - 32
    else:
        return None
    return QuantBlocks(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
                  torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, -1)),
                  torch.from_numpy(np.ascontiguousarray(min_, dtype=np.float32).reshape(rows, -1)))


def halves(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n] float32 from their float16."""
    return raw.copy().view(np.float16).astype(np.float32)[:, 0]


def nibbles(packed: np.ndarray) -> np.ndarray:
    """[n, b] bytes -> [n, 2b] codes: the b low nibbles, then the b high ones (GGUF's order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)
