"""Linear layers with weights prepacked for oneDNN, for float32 inference on CPU.

Why: `F.linear` goes to MKL's sgemm, which on the CPUs measured here (AMD EPYC, AVX-512)
streams a decode step's weights at 9-20 GB/s and reaches ~60% of oneDNN's rate on
prefill-sized GEMMs (lm_head at M=32: 39 ms against 12 ms). oneDNN with weights reordered
once into its blocked layout (what inductor's `freezing` does) is faster at every batch
size. The packed weight is an opaque mkldnn tensor: only `torch.ops.mkldnn` reads it, so
this module owns the only calls that may touch it. Other devices and dtypes keep
`nn.Linear`.

Steps of one to eight tokens (decoding up to eight sequences) are bound by streaming the weights
from memory, and oneDNN streams them at about half the bandwidth there is (measured on
SmolLM2-135M's shapes at two threads: 14-19 GB/s at one row, 42 GB/s available). Where memory
allows (`small_batch_copy_fits`), each layer also keeps its weight as panels of 16 output
features, each panel one contiguous run, which the C++ kernel of `engine.cpu_kernels` streams at
~32 GB/s: twice the weight memory for decode steps up to ~1.7x faster.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


# The batch size oneDNN picks the blocked layout for. Measured on SmolLM2-135M's shapes, one
# thread, whole decode steps: 32 made a step of 32 sequences 17% faster than 1 did (145 against
# 173 ms; lm_head alone 21 against 33 ms), with one sequence and 2048-token prefills no slower.
PACKING_BATCH_SIZE = 32


# Up to this many rows, a layer with panels runs the panel kernel; oneDNN above, where the step
# turns compute-bound and oneDNN's GEMM is the better one.
SMALL_BATCH_ROWS = 8
PANEL = 16  # output features per panel: one AVX-512 vector


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: panels[p, k, j] = weight[16 p + j, k], zeros past the end."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, in_features)
    padded[:out_features] = weight
    return padded.view(num_panels, PANEL, in_features).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W in oneDNN's blocked layout (read-only: inference only), and with
    `panels` W again for the small-batch kernel."""

    def __init__(self, linear: nn.Linear, panels: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.panels = nn.Parameter(to_panels(weight), requires_grad=False) if panels else None
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_SIZE),
                                   requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor, kernels: Any = None) -> torch.Tensor:  # [num_tokens, in_features]
        if kernels is not None and self.panels is not None and 0 < x.shape[0] <= SMALL_BATCH_ROWS:
            out = x.new_empty(x.shape[0], self.out_features)
            kernels.panel_linear(out, x.contiguous(), self.panels, self.bias)
            return out
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"panels={self.panels is not None}")


def linear(layer: nn.Module, x: torch.Tensor, kernels: Any) -> torch.Tensor:
    """`layer(x)`, passing the step's C++ kernels to a layer that can use them."""
    return layer(x, kernels) if isinstance(layer, PackedLinear) else layer(x)


def available_memory_bytes() -> int | None:
    """Physical memory the system could give now (Linux; None where unknown)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def small_batch_copy_fits(model: nn.Module) -> bool:
    """Keep panels when the copy takes at most a quarter of the memory still available, so a model
    that only just fits never pays for a faster decode with swapping or the OOM killer."""
    copy = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    available = available_memory_bytes()
    return available is not None and copy <= available // 4


def pack_linears(model: nn.Module, panels: bool = False) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (a tied lm_head gets its own packed
    copy; the embedding keeps the plain matrix), with panels if asked. Returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        model.set_submodule(name, PackedLinear(module, panels))
    return len(targets)
