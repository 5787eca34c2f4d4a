"""Linear layers with weights prepacked in panels, for float32 inference on CPU.

Why: `F.linear` goes to MKL's sgemm, and oneDNN's GEMM with prepacked weights (what inductor's
`freezing` does) is faster but still far from this machine's limits on a decode step's shapes:
with one row it streams the weights at half the memory bandwidth there is, and at 32 rows it
reaches about half of the FMA units' peak. Here each weight is stored once, as panels of 16
output features ([ceil(out / 16), in, 16]: each panel one contiguous run), and the C++ kernel of
`engine.cpu_kernels` computes every batch size from that layout: a register tile of 8 rows by 3
panels with AVX-512 (6 rows by one panel with AVX2), with the next panels prefetched while the
current ones are in cache. Measured against `F.linear` on SmolLM2-135M's shapes at two threads:
on an AVX-512 Xeon, 1.3-1.45x faster from 1 to 64 rows, 1.1-1.2x at 128-512, level at 2048; on an
AVX2 EPYC (Zen 3), 1.7-2.5x at 1-8 rows, 1.4-1.5x at 32, 1.15x at 128, level at 512.

Until the kernels are built (their first build runs in the background) or where they cannot be
built (no compiler), the same panels go through one batched `torch.matmul`, within ~1.3x of
oneDNN's speed. Other devices and dtypes keep `nn.Linear`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.block_panels import QuantBlocks, panels_to_float


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


PANEL = 16  # output features per panel: one AVX-512 vector


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: panels[p, k, j] = weight[16 p + j, k], zeros past the end."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, PANEL, in_features).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W stored as panels (read-only: inference only): float32, or a GGUF file's
    blocks (`engine.block_panels`, `from_blocks`)."""

    def __init__(self, linear: nn.Linear, blocks: QuantBlocks | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        panels = to_panels(linear.weight.detach()) if blocks is None else blocks.to_panels()
        self.panels = nn.Parameter(panels, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor, kernels: Any = None) -> torch.Tensor:  # [num_tokens, in_features]
        if kernels is not None:
            out = x.new_empty(x.shape[0], self.out_features)
            kernels.panel_linear(out, x.contiguous(), self.panels, self.bias)
            return out
        panels = self.panels if self.panels.is_floating_point() else panels_to_float(self.panels)
        # [num_panels, num_tokens, 16] -> [num_tokens, out_features]
        out = torch.matmul(x, panels).transpose(0, 1).reshape(len(x), self.panels.shape[0] * PANEL)
        out = out[:, : self.out_features]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        blocks = "" if self.panels.is_floating_point() else f", {self.panels.dtype} blocks"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{blocks}"


def linear(layer: nn.Module, x: torch.Tensor, kernels: Any) -> torch.Tensor:
    """`layer(x)`, passing the step's C++ kernels to a layer that can use them."""
    return layer(x, kernels) if isinstance(layer, PackedLinear) else layer(x)


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (a tied lm_head gets its own packed
    copy; the embedding keeps the plain matrix). Returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        model.set_submodule(name, PackedLinear(module))
    return len(targets)
