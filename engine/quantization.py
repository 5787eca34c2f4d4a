"""Weight-only int8 and int4 linears for the decoder (the `quantization` model option).

What it owns: turning float weights (or GGUF 4-bit blocks, `engine.gguf`) into quantized linears.
On CPU in float32 (where the C++ kernels run) they become block panels for the block kernels
(`quantized_blocks` -> `PackedLinear`, engine/block_panels.py): 8-bit codes under one scale a row
(int8), 4-bit codes with a scale and a min a group (int4); activations stay float32 and the
kernels multiply by exactly the de-quantized weights; a mixture's experts are quantized too
(`moe_mlp` runs their panels). Elsewhere (CUDA, bfloat16, the generic backend) torch's packed
layouts and kernels, below: a quantized linear casts its input to bfloat16 for the kernel and its
output back.

- int8: per-output-channel symmetric, w = q * scale, `torch._weight_int8pack_mm` (CPU; on CUDA
  torch's kernel is a plain loop per output element, correct but not tuned, and unmeasured here).
- int4: groupwise asymmetric along K (the tinygemm form), w = (q - 8) * scale + zero with q in
  0..15, `_weight_int4pack_mm_for_cpu` on CPU and `_weight_int4pack_mm` (tinygemm, sm80+) on CUDA.

Why bfloat16 activations there: torch's CPU kernels for both have vectorised bf16 paths only; with
float32 activations they measured 10-20x slower than the float32 oneDNN linear they replace
(SmolLM2 shapes, M = 1, one thread), with bf16 1-9x faster; beyond a few rows they lose to float32
GEMM, which is why CPU float32 takes the block kernels. Scales live in bfloat16 too (the
kernels take them in the activations' dtype); `dequantize` gives the exact float weights the
kernels multiply by, for references and fake-quantized models.

Must not: touch the panel-packed linears (`engine.packed_linear` packs whatever stays
`nn.Linear` after this), or the embedding (a tied lm_head is quantized as its own copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from engine.block_panels import PANEL_BLOCK, QuantBlocks
from engine.packed_linear import PackedLinear

log = structlog.get_logger(__name__)

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 32  # GGUF's block size (Q4_0/Q4_1/Q4_K repack exactly); SmolLM2's K = 576 takes 32 or 64
COMPUTE_DTYPE = torch.bfloat16
# the decoder's projections; lm_head is opted in separately (it is the model's largest matrix)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj",  # ours, fused
               "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the generic backend's (transformers')


@dataclass(frozen=True)
class QuantizationSpec:
    """What `quantize_model` does: the model option names only `method`; benchmarks vary the rest."""

    method: str  # int8 | int4: the decoder's projections
    group_size: int = DEFAULT_INT4_GROUP_SIZE  # int4
    # int8 | int4 | None (float). int8 for both methods: on SmolLM2 an int4 lm_head cost +5.5% perplexity
    # (int8 +0.35%) for 3.7x instead of 3.0x fp32's decode tok/s (bench/README.md)
    lm_head: str | None = "int8"
    gguf_blocks: bool = True  # int4 from a GGUF file: its 4-bit blocks as they are (else de-quantized, re-quantized)
    block_kernels: bool = True  # CPU float32: the block kernels (False: torch's int linears, for benchmarks)

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.method!r} is not one of {', '.join(QUANTIZATIONS)} (or none)")
        if self.lm_head not in (None, *QUANTIZATIONS):
            raise ValueError(f"lm_head quantization {self.lm_head!r} is not one of {QUANTIZATIONS} or None")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size {self.group_size} is not one of {INT4_GROUP_SIZES}")

    def method_for(self, module_name: str, experts: bool = False) -> str | None:
        """How the linear named `module_name` is quantized; None: it is not. A mixture's experts only with
        `experts` (the CPU block kernels run them; torch's int kernels are not wired into `moe_mlp`)."""
        if module_name == "lm_head":
            return self.lm_head
        if ".experts." in module_name and not experts:
            return None
        return self.method if module_name.rpartition(".")[2] in PROJECTIONS else None

    @classmethod
    def parse(cls, value: str | QuantizationSpec | None) -> QuantizationSpec | None:
        """The model option (`int8`, `int4`, `none` or unset) as a spec; ValueError if unknown."""
        if value is None or isinstance(value, QuantizationSpec):
            return value
        return None if value == "none" else cls(value)


def to_compute(values: torch.Tensor) -> torch.Tensor:
    """Round to the kernels' dtype and back: what they will actually use."""
    return values.to(COMPUTE_DTYPE).float()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (q [N, K] int8, scale [N] float32, already bf16-exact)."""
    w = weight.float()
    scale = to_compute((w.abs().amax(dim=1) / 127).clamp(min=1e-8))
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


@dataclass
class Int4Groups:
    """A [N, K] weight as 4-bit codes: w[n, k] = (q[n, k] - 8) * scale[n, k // g] + zero[n, k // g].

    Plain (unpacked) so rows can be permuted and matrices concatenated before packing."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group_size] float32
    zero: torch.Tensor  # [N, K // group_size] float32

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group_size: int) -> Int4Groups:
        """Min/max per group (the range maps onto 0..15), scale and zero rounded to bf16 first so
        the codes are chosen for the values the kernel will use."""
        n, k = weight.shape
        w = weight.float().reshape(n, k // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale = to_compute(((high - low) / 15).clamp(min=1e-8))
        zero = to_compute(low + 8 * scale)
        q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, zero)

    @classmethod
    def cat(cls, parts: list[Int4Groups]) -> Int4Groups:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Groups:
        """The same rows reordered by `fn` (a function of a [N, ...] tensor), e.g. GGUF's q/k permutation."""
        return Int4Groups(fn(self.q), fn(self.scale), fn(self.zero))

    def to_blocks(self) -> QuantBlocks:
        """The same codes as the CPU block kernels' 4-bit form, w = q * scale + min (min = zero - 8 scale)."""
        return QuantBlocks(self.q, self.scale, self.zero - 8 * self.scale)

    def dequantize(self, rounded: bool = True) -> torch.Tensor:  # [N, K] float32
        """The weights the int4 kernels use (scale and zero `rounded` to bf16), or the exact ones."""
        g = self.group_size
        scale, zero = (to_compute(self.scale), to_compute(self.zero)) if rounded else (self.scale, self.zero)
        return (self.q.float() - 8) * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)


def cat_rows(parts: list) -> torch.Tensor | Int4Groups | QuantBlocks:
    """Fuse weights (q/k/v, gate/up) that may be int4 codes or a GGUF file's blocks: codes stay codes
    when every part is, with one group size, blocks when every part is; otherwise all are
    de-quantized (a GGUF file may mix Q4_K with Q6_K, or with a type kept as floats)."""
    if all(isinstance(p, Int4Groups) for p in parts) and len({p.group_size for p in parts}) == 1:
        return Int4Groups.cat(parts)
    if all(isinstance(p, QuantBlocks) for p in parts):
        return QuantBlocks.cat(parts)
    return torch.cat([p.dequantize(rounded=False) if isinstance(p, Int4Groups)
                      else p.dequantize() if isinstance(p, QuantBlocks) else p for p in parts])


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + b with q int8 per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        q, scale = quantize_int8(weight)
        self.weight = nn.Parameter(q.to(weight.device), requires_grad=False)
        self.scale = nn.Parameter(scale.to(weight.device, COMPUTE_DTYPE), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features]
        y = torch._weight_int8pack_mm(x.to(COMPUTE_DTYPE), self.weight, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def inner_k_tiles(k: int) -> int:
    """tinygemm's packing factor: the largest of 8, 4, 2 with K a multiple of 16 of them."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


class Int4Linear(nn.Module):
    """y = x @ W.T + b with W in torch's int4 packed layout for the weight's device."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = groups.q.shape
        self.group_size = groups.group_size
        self.on_cuda = device.type == "cuda"
        q = groups.q.to(device)
        if self.on_cuda:  # tinygemm takes two codes per byte, high nibble first
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(),
                                                       inner_k_tiles(self.in_features))
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # [K // group_size, N, 2]: (scale, zero) per group and output channel
        scale_zero = torch.stack([groups.scale.T, groups.zero.T], dim=-1).to(device, COMPUTE_DTYPE).contiguous()
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.scale_zero = nn.Parameter(scale_zero, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features]
        mm = torch._weight_int4pack_mm if self.on_cuda else torch._weight_int4pack_mm_for_cpu
        y = mm(x.to(COMPUTE_DTYPE), self.weight, self.group_size, self.scale_zero).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


def can_quantize(method: str, linear: nn.Linear, group_size: int) -> bool:
    """int4 needs K in whole groups (and, on CUDA, in tinygemm's tiles) and N a multiple of 8."""
    if method == "int8":
        return True
    k, n = linear.in_features, linear.out_features
    return k % group_size == 0 and k % 32 == 0 and n % 8 == 0


def quantized_linear(method: str, linear: nn.Linear, group_size: int,
                     groups: Int4Groups | None = None, device: torch.device | None = None) -> nn.Module:
    """`groups`: int4 codes read from the checkpoint (GGUF blocks), used as they are (the linear's
    weight is then not read: it may be on the meta device)."""
    if groups is not None:
        return Int4Linear(groups, linear.bias, device or groups.q.device)
    weight = linear.weight.detach()
    if method == "int8":
        return Int8Linear(weight, linear.bias)
    return Int4Linear(Int4Groups.from_weight(weight, group_size), linear.bias, weight.device)


def quantized_blocks(method: str, weight: torch.Tensor, group_size: int,
                     groups: Int4Groups | None = None) -> QuantBlocks:
    """The linear's weight quantized as the CPU block kernels take it (engine.block_panels): int8 per
    output channel as 8-bit codes under one scale a row, int4 groups as 4-bit codes with a scale and
    a min a group. Scales are bfloat16-exact, so code * scale is exact in float32 and the kernels
    compute the `dequantize()`d weights' products exactly."""
    if method == "int4":
        return (groups or Int4Groups.from_weight(weight, group_size)).to_blocks()
    q, scale = quantize_int8(weight)
    per_block = scale[:, None].expand(q.shape[0], q.shape[1] // PANEL_BLOCK[8]).contiguous()
    return QuantBlocks(q, per_block, torch.zeros_like(per_block))


def quantize_model(model: nn.Module, spec: QuantizationSpec, prequantized: dict[str, Int4Groups] | None = None,
                   device: torch.device | None = None, blocks: bool = False) -> int:
    """Replace the decoder's projections (and lm_head as the spec says) by quantized linears;
    returns how many. `prequantized`: module name -> int4 codes to use instead of quantizing its
    weight (placed on `device`). `blocks` (CPU float32 with the kernels): as block panels for the
    CPU kernels (`PackedLinear`), a mixture's experts too; else torch's int8/int4 linears."""
    prequantized = prequantized or {}
    targets = [(name, module, spec.method_for(name, experts=blocks)) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and spec.method_for(name, experts=blocks)]
    replaced = 0
    for name, module, method in targets:
        groups = prequantized.get(name) if method == "int4" else None
        size = groups.group_size if groups is not None else spec.group_size
        if blocks and module.in_features % (PANEL_BLOCK[8] if method == "int8" else size) == 0:
            weight = module.weight.detach() if groups is None else None  # GGUF codes: the weight may be on meta
            model.set_submodule(name, PackedLinear(module, quantized_blocks(method, weight, size, groups)))
            replaced += 1
            continue
        if not can_quantize(method, module, size):
            log.warning("layer left unquantized: its shape does not fit the int4 kernel", layer=name,
                        shape=tuple(module.weight.shape), group_size=size)
            if groups is not None:
                module.weight = nn.Parameter(groups.dequantize().to(device), requires_grad=False)
            continue
        model.set_submodule(name, quantized_linear(method, module, size, groups, device))
        replaced += 1
    return replaced
