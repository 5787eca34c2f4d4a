"""Linear layers with weights prepacked for oneDNN, for float32 inference on CPU.

Why: `F.linear` goes to MKL's sgemm, which on the CPUs measured here (AMD EPYC, AVX-512)
streams a decode step's weights at 9-20 GB/s and reaches ~60% of oneDNN's rate on
prefill-sized GEMMs (lm_head at M=32: 39 ms against 12 ms). oneDNN with weights reordered
once into its blocked layout (what inductor's `freezing` does) is faster at every batch
size. The packed weight is an opaque mkldnn tensor: only `torch.ops.mkldnn` reads it, so
this module owns the only calls that may touch it. Other devices and dtypes keep
`nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


# The batch size oneDNN picks the blocked layout for. Measured on SmolLM2-135M's shapes, one
# thread, whole decode steps: 32 made a step of 32 sequences 17% faster than 1 did (145 against
# 173 ms; lm_head alone 21 against 33 ms), with one sequence and 2048-token prefills no slower.
PACKING_BATCH_SIZE = 32


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W in oneDNN's blocked layout (read-only: inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_SIZE)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (a tied lm_head gets its own packed
    copy; the embedding keeps the plain matrix). Returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        model.set_submodule(name, PackedLinear(module))
    return len(targets)
