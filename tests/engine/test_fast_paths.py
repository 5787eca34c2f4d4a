"""The engine's CPU fast paths compute what the plain torch paths compute.

The reference tests (greedy == HF) run with every fast path that is on by default; these
check each one directly against its plain counterpart, so a fast path that drifts shows up
here by name, not only as a changed token somewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.loader import load_model
from engine.packed_linear import PackedLinear, can_pack

needs_mkldnn = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN in this torch")


@needs_mkldnn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3, 32, 300])
def test_packed_linear_matches_f_linear(bias, num_tokens):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(num_tokens, 96)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_mkldnn
def test_cpu_float32_models_load_with_packed_linears(tiny_models):
    """So the reference tests exercise the packed path; the tied embedding keeps its plain matrix."""
    model = load_model(str(tiny_models["qwen2"]), dtype="float32").model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert not model.embed_tokens.weight.is_mkldnn
