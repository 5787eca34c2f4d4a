"""A GGUF file's blocks kept as they are (`engine.block_panels`, `engine/csrc/block_gemm.h`): each
format reads as the `gguf` package de-quantizes it, and the kernels over the blocks give the float
kernels' outputs on the de-quantized weights bit for bit, at every row count, so the real model's
greedy tokens (tests/engine/test_gguf.py) and its logits are the de-quantized model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.block_panels import FORMATS, BlockEmbedding, QuantBlocks, from_gguf, panel_bytes_per_weight, panels_to_float
from engine.packed_linear import PackedLinear, to_panels

# where each format keeps its float16 scales in a block's bytes (the rest are codes and sub-scales)
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,),
                "Q5_1": (0, 2), "Q5_K": (0, 2)}


def gguf_tensor(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of `qtype` ([rows, bytes per row], as `engine.gguf.read_tensors` gives them), with
    finite float16 scales of a few magnitudes and signs; every code and sub-scale byte random."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        halves = (rng.uniform(0.5, 2, len(data)) * 10.0 ** rng.integers(-4, 0, len(data))
                  * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", FORMATS)
def test_each_format_reads_as_the_gguf_package_dequantizes_it(qtype):
    data = gguf_tensor(qtype, 48, 512)
    blocks = from_gguf(data, qtype)
    expected = torch.from_numpy(dequantize(data, GGMLQuantizationType[qtype]).astype(np.float32))
    assert blocks.shape == (48, 512) and blocks.bits == (4 if qtype.startswith("Q4") else 8)
    assert torch.equal(blocks.dequantize(), expected)
    # the panels the kernels read hold the same floats (the torch path's view of them)
    float_panels = panels_to_float(blocks.to_panels())
    assert torch.equal(float_panels, to_panels(expected))
    assert blocks.to_panels().numel() == panel_bytes_per_weight(qtype) * 48 * 512  # the pre-load estimate's figure
    assert from_gguf(data, "Q3_K") is None  # other types stay floats


def test_fused_parts_of_different_formats_take_the_eight_bit_form():
    """q/k/v of a Q4_K_M file: Q4_K and Q6_K parts; the fused matrix is every part, exactly."""
    parts = [from_gguf(gguf_tensor(t, n, 256, seed), t) for seed, (t, n) in enumerate([("Q4_K", 32), ("Q6_K", 16),
                                                                                       ("Q4_0", 20)])]
    fused = QuantBlocks.cat(parts)
    assert fused.bits == 8 and fused.block == 16
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    four_bit = QuantBlocks.cat([parts[0], parts[2]])
    assert four_bit.bits == 4 and torch.equal(four_bit.dequantize(), torch.cat([parts[0].dequantize(),
                                                                                 parts[2].dequantize()]))


def test_block_embedding_looks_up_de_quantized_rows():
    blocks = from_gguf(gguf_tensor("Q8_0", 100, 64), "Q8_0")
    ids = torch.tensor([3, 99, 0, 3])
    assert torch.equal(BlockEmbedding(blocks)(ids), blocks.dequantize()[ids])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_K", "Q8_0", "Q6_K", "mixed"])
@pytest.mark.parametrize("bias", [False, True])
def test_block_kernels_equal_the_float_kernels(kernels, qtype, bias):
    """Every row count the kernels split differently (one to four rows in registers, a tile, the packed
    8-row pass of the float path, chunks of 128), outputs not a whole number of panels. From five rows
    the blocks are de-quantized into float panels: bit for bit the float kernels' outputs. One to four
    rows take each block's dot product with its codes, then its scale and min (fewer FMAs a weight):
    the same sums in another order, equal to float32's rounding."""
    torch.manual_seed(0)
    in_features = 256
    if qtype == "mixed":
        blocks = QuantBlocks.cat([from_gguf(gguf_tensor("Q4_K", 40, in_features), "Q4_K"),
                             from_gguf(gguf_tensor("Q6_K", 20, in_features, 1), "Q6_K")])
    else:
        blocks = from_gguf(gguf_tensor(qtype, 60, in_features), qtype)
    weight = blocks.dequantize()
    b = torch.randn(60) if bias else None
    block_panels, float_panels = blocks.to_panels(), to_panels(weight)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 130):
        x = torch.randn(rows, in_features)
        got, expected = torch.empty(rows, 60), torch.empty(rows, 60)
        kernels.panel_linear(got, x, block_panels, b)
        kernels.panel_linear(expected, x, float_panels, b)
        if rows <= 4:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
            assert not torch.equal(got, expected), rows  # the factored sums ran
        else:
            assert torch.equal(got, expected), rows
    reference = torch.nn.functional.linear(x, weight, b)  # only the order of the sums differs
    torch.testing.assert_close(expected, reference, rtol=1e-4, atol=1e-5 * reference.abs().max().item())


def test_block_mlp_equals_the_float_mlp(kernels):
    gate_up = from_gguf(gguf_tensor("Q4_1", 2 * 96, 128), "Q4_1")
    down = from_gguf(gguf_tensor("Q8_0", 128, 96, 1), "Q8_0")
    for rows in (1, 2, 5, 40):
        x = torch.randn(rows, 128)
        got, expected = torch.empty(rows, 128), torch.empty(rows, 128)
        kernels.silu_mlp(got, x, gate_up.to_panels(), None, down.to_panels(), None)
        kernels.silu_mlp(expected, x, to_panels(gate_up.dequantize()), None, to_panels(down.dequantize()), None)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
        assert torch.equal(got, expected) == (rows > 4), rows


def test_packed_linear_over_blocks_runs_without_the_kernels():
    """The torch path (before the kernels are built, or without a compiler): the same floats."""
    blocks = from_gguf(gguf_tensor("Q4_0", 40, 64), "Q4_0")
    linear = torch.nn.Linear(64, 40, bias=False)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        got = PackedLinear(linear, blocks)(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, blocks.dequantize()), rtol=1e-5, atol=1e-5)
