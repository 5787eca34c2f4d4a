"""The engine's CPU fast paths compute what the plain torch paths compute.

The reference tests (greedy == HF) run with every fast path that is on by default; these
check each one directly against its plain counterpart, so a fast path that drifts shows up
here by name, not only as a changed token somewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.attention import build_metadata, paged_attention
from engine.loader import load_model
from engine.models.llama import RMSNorm, apply_rotary, rotate_qk
from engine.packed_linear import PackedLinear, to_panels
from tests.engine.test_reference import GREEDY, hf_greedy, prompts
from tests.helpers import assert_all_blocks_free, make_engine, run_to_completion
from tests.models import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 32, 300])
def test_packed_linear_matches_f_linear(bias, num_tokens):
    """Without the C++ kernels (not built yet, or no compiler) the panels go through torch.matmul."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(num_tokens, 96)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cpu_float32_models_load_with_packed_linears(tiny_models):
    """So the reference tests exercise the packed path; the tied embedding keeps its plain matrix,
    and each weight is held once (as panels), not beside a second copy."""
    model = load_model(str(tiny_models["qwen2"]), dtype="float32").model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert model.embed_tokens.weight.shape == (model.shape.vocab_size, model.shape.hidden_size)
    for layer in linears:
        names = [name for name, _ in layer.named_parameters()]
        assert names == ["panels"] + (["bias"] if layer.bias is not None else [])


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])  # one to eight vectors per head, and a ragged tail
@pytest.mark.parametrize("block_size", [4, 6, 16])  # runs shorter than and as long as the kernel's; 6: no shift
@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (8, 1), (4, 4)])  # groups of 3, 8 and 1 heads
def test_decode_kernel_matches_torch_path(kernels, sliding_window, head_dim, block_size, num_heads, num_kv_heads):
    """Random caches, block tables out of order, contexts ending mid-block and on a block edge, GQA."""
    torch.manual_seed(0)
    num_blocks = 40
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    context_lens = [1, 7, 8, 13, 30, 47]
    tables = [torch.randperm(num_blocks)[: -(-n // block_size)].tolist() for n in context_lens]
    q = torch.randn(len(context_lens), num_heads, head_dim)
    k = torch.randn(len(context_lens), num_kv_heads, head_dim)
    v = torch.randn(len(context_lens), num_kv_heads, head_dim)
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size for table, n in zip(tables, context_lens)]
    outs = []
    for kernel in (None, kernels):
        meta = build_metadata(list(zip(tables, context_lens)), [], slots, block_size, sliding_window,
                              torch.device("cpu"), kernel)
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])  # a window: no sharing
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_kernel_over_shared_blocks_matches_torch_path(kernels, sliding_window, head_dim, block_size):
    """Sequences whose tables start with the same blocks (a system prompt, n > 1 choices) are
    attended in tiles that read those blocks once: groups interleaved in the batch, a group of 20
    (two tiles or more), members that share fewer blocks than the rest, a context ending right
    after the shared blocks and one ending on their last position."""
    torch.manual_seed(0)
    num_blocks, kv_heads = 200, 2
    free = iter(torch.randperm(num_blocks).tolist())

    def own(count: int) -> list[int]:
        return [next(free) for _ in range(count)]

    system, other = own(3), own(2)
    contexts = []  # (table, context_len)
    for i in range(20):
        extra = i % 4 * block_size // 2 + 1 + i // 4
        contexts.append((system + own(2 + extra // block_size), 3 * block_size + extra))
    contexts += [
        (system + own(1), 3 * block_size),  # its newest token is in the shared third block: shares two
        (system[:1] + own(4), 4 * block_size + 2),  # shares one block with the group
        (other + own(1), 2 * block_size + 1),
        (other + own(2), 3 * block_size + 3),
        (own(3), block_size + 5),  # alone
    ]
    order = torch.randperm(len(contexts)).tolist()
    contexts = [contexts[i] for i in order]
    num_heads = 3 * kv_heads
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    q = torch.randn(len(contexts), num_heads, head_dim)
    k = torch.randn(len(contexts), kv_heads, head_dim)
    v = torch.randn(len(contexts), kv_heads, head_dim)
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size for table, n in contexts]
    outs = []
    for kernel in (None, kernels):
        meta = build_metadata(contexts, [], slots, block_size, sliding_window, torch.device("cpu"), kernel)
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: nothing to share the work with")
def test_decode_kernel_runs_on_torchs_threads(kernels):
    """The kernels split their work over torch's OpenMP team: with two threads the calling thread
    does about half the CPU work (built without -fopenmp it did all of it, serially)."""
    torch.manual_seed(0)
    block_size, num_seqs, context = 16, 64, 256
    blocks = num_seqs * context // block_size
    k_cache, v_cache = torch.randn(2, blocks * block_size, 2, 64)
    tables = torch.arange(blocks).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context)
    q, out = torch.randn(num_seqs, 6, 64), torch.empty(num_seqs, 6, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calling, process = time.thread_time(), time.process_time()
        for _ in range(40):
            kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, block_size, 0.125, 0)
        calling, process = time.thread_time() - calling, time.process_time() - process
    finally:
        torch.set_num_threads(threads)
    assert calling < 0.8 * process, (calling, process)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_with_kernels_matches_hf(tiny_models, kernels, family):
    """Six sequences, then three: every linear layer runs the panel kernel at every batch size."""
    path = tiny_models[family]
    engine = make_engine(path, max_num_batched_tokens=20)  # chunked prefills beside decodes
    assert engine.runner.cpu_kernels.ops is kernels
    for batch in (prompts(6, 300), prompts(3, 300, seed=21)):
        assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 16) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


class CountingKernels:
    """The C++ ops, counting the calls of one, so a test knows the kernel ran and not a fallback."""

    def __init__(self, ops, name: str) -> None:
        self.ops, self.name, self.calls = ops, name, 0

    def __getattr__(self, attr: str):
        if attr == self.name:
            self.calls += 1
        return getattr(self.ops, attr)


@pytest.mark.parametrize("bias", [False, True])
# 0: a step whose chunks all sample nothing; then every tail of the 8-row tile, AVX2's packed 7 and 8
# rows, and several tiles
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 300])
@pytest.mark.parametrize("out_features", [200, 16, 32, 48, 1000])  # ragged last panel; groups of 1, 2, 3 panels
@pytest.mark.parametrize("in_features", [96, 97])  # an odd K
def test_panel_kernel_matches_f_linear(kernels, bias, num_tokens, out_features, in_features):
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(num_tokens, in_features)
    layer, counting = PackedLinear(linear), CountingKernels(kernels, "panel_linear")
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        torch.testing.assert_close(layer(x, counting), expected, rtol=1e-5, atol=1e-5)
    assert counting.calls == 1


@pytest.mark.parametrize("out_features", [200, 48])
def test_panel_kernel_rows_do_not_depend_on_their_batch(kernels, out_features):
    """A row's output is the same sum in the same order whichever tile its batch size takes (one row
    alone, tiles of 4-6 rows, AVX2's packed 8 rows, several tiles): a sequence decodes to the same
    greedy tokens alone and in any batch, bit for bit."""
    torch.manual_seed(0)
    w, b, x = torch.randn(out_features, 97), torch.randn(out_features), torch.randn(14, 97)
    panels = to_panels(w)
    alone = torch.empty(14, out_features)
    for i in range(14):
        kernels.panel_linear(alone[i : i + 1], x[i : i + 1], panels, b)
    for rows in range(1, 15):
        out = torch.empty(rows, out_features)
        kernels.panel_linear(out, x[:rows], panels, b)
        assert torch.equal(out, alone[:rows]), rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 3, 128, 300])  # one chunk of rows, exactly one, and three
@pytest.mark.parametrize("intermediate", [40, 37])  # an odd one: gate and up split mid-panel
def test_silu_mlp_matches_torch(kernels, bias, num_tokens, intermediate):
    torch.manual_seed(0)
    gate_up, down = nn.Linear(48, 2 * intermediate, bias=bias), nn.Linear(intermediate, 48, bias=bias)
    x = torch.randn(num_tokens, 48)
    out = torch.empty(num_tokens, 48)
    with torch.inference_mode():
        gate, up = F.linear(x, gate_up.weight, gate_up.bias).split(intermediate, dim=-1)
        expected = F.linear(F.silu(gate) * up, down.weight, down.bias)
        packed_gate_up, packed_down = PackedLinear(gate_up), PackedLinear(down)
        kernels.silu_mlp(out, x, packed_gate_up.panels, packed_gate_up.bias, packed_down.panels, packed_down.bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


PORTABLE_CHECK = """
import sys
import torch, torch.nn.functional as F
from torch.utils.cpp_extension import load_inline
from engine import cpu_kernels
from engine.packed_linear import to_panels
flags = cpu_kernels._flags(sys.argv[1])  # the build a CPU with these flags gets
load_inline(cpu_kernels._build_name(flags, sys.argv[1] + " check"), cpp_sources=cpu_kernels._SOURCE, extra_cflags=flags,
            extra_ldflags=[f for f in flags if f == "-fopenmp"], is_python_module=False)
ops = torch.ops.galley_cpu
torch.manual_seed(0)
for rows in (0, 1, 5, 7, 8, 9, 33, 300):
    for out_features in (200, 16, 48):
        w, b, x = torch.randn(out_features, 97), torch.randn(out_features), torch.randn(rows, 97)
        out = torch.empty(rows, out_features)
        ops.panel_linear(out, x, to_panels(w), b)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
gate_up, down, x = torch.randn(2 * 37, 48) / 7, torch.randn(48, 37) / 6, torch.randn(130, 48)  # outputs ~1
out = torch.empty(130, 48)
ops.silu_mlp(out, x, to_panels(gate_up), None, to_panels(down), None)
gate, up = F.linear(x, gate_up).split(37, -1)
torch.testing.assert_close(out, F.linear(F.silu(gate) * up, down), rtol=1e-5, atol=1e-5)
from engine.block_panels import QuantBlocks  # a GGUF file's blocks: the float kernels' outputs, bit for bit
for codes in (torch.randint(0, 16, (40, 64), dtype=torch.uint8), torch.randint(-128, 128, (40, 64), dtype=torch.int8)):
    blocks = QuantBlocks(codes, (torch.rand(40, 2) + 0.5).half().float(), torch.randn(40, 2).half().float())
    for rows in (1, 2, 9):
        x, got, expected = torch.randn(rows, 64), torch.empty(rows, 40), torch.empty(rows, 40)
        ops.panel_linear(got, x, blocks.to_panels(), None)
        ops.panel_linear(expected, x, to_panels(blocks.dequantize()), None)
        assert torch.equal(got, expected), (codes.dtype, rows)
"""


@pytest.mark.parametrize("cpu_flags", ["avx2 fma", "neither"])  # the AVX2 tile, and the generic vector code
def test_linear_kernels_without_avx512_match_torch(kernels, cpu_flags):
    """The panel GEMM's paths for CPUs without AVX-512, each built and checked in its own process:
    one process cannot register the kernels' namespace twice."""
    if cpu_kernels._flags(cpu_flags) == cpu_kernels._flags(cpu_kernels._cpu_identity()):
        pytest.skip("this host's own build is that one, and every kernel test here runs it (a second build: ~90 s)")
    command = [sys.executable, "-c", PORTABLE_CHECK, cpu_flags]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_engine_without_cpu_kernels_uses_the_torch_path(tiny_models):
    engine = make_engine(tiny_models["llama"], cpu_kernels=False)
    assert engine.runner.cpu_kernels is None
    [prompt] = prompts(1, 300, lengths=[11])
    assert run_to_completion(engine, [prompt], GREEDY) == [hf_greedy(tiny_models["llama"], prompt, 16)]


@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_norm_kernels_match_torch(kernels, num_tokens):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(num_tokens, 96), torch.randn(num_tokens, 96)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x, kernels), norm(x), rtol=1e-6, atol=1e-6)
        expected, expected_residual = norm.add_forward(x, residual)
        got, got_residual = norm.add_forward(x.clone(), residual.clone(), kernels)
    assert torch.equal(got_residual, expected_residual)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, width", [(1, 1536), (33, 40), (7, 37), (2048, 96)])  # vector runs and scalar tails
def test_silu_and_mul_kernel_rounds_as_torch(kernels, rows, width):
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * width) * 6
    gate, up = gate_up.split(width, dim=-1)
    out = torch.empty(rows, width)
    kernels.silu_and_mul(out, gate_up)
    assert torch.equal(out, F.silu(gate) * up)


def test_rotary_kernel_rounds_as_torch(kernels):
    """In place through views of a fused qkv output, as the model calls it; bit for bit."""
    torch.manual_seed(0)
    num_tokens, heads, kv_heads, head_dim = 7, 4, 2, 16
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(num_tokens, 1, head_dim), torch.randn(num_tokens, 1, head_dim)
    def views(t):
        q, k, _ = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
    expected = [apply_rotary(t, cos, sin) for t in views(qkv)]
    got = rotate_qk(*views(qkv), cos, sin, kernels)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(views(qkv)[0], got[0])  # written in place


@pytest.mark.parametrize("sliding_window", [None, 5, 40])
@pytest.mark.parametrize("head_dim", [24, 64, 128])  # 24: a ragged last panel of values; 64, 128: 4 and 8 whole
@pytest.mark.parametrize("block_size", [4, 6, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (8, 1), (4, 4)])
def test_prefill_kernel_matches_torch_path(kernels, sliding_window, head_dim, block_size, num_heads, num_kv_heads):
    """Chunks from the start of a sequence and after a cached prefix (ending mid-block and on a
    block edge), one token long and longer than a row tile, in one step beside decodes, GQA,
    queries as the strided views the model's fused QKV projection gives."""
    torch.manual_seed(0)
    num_blocks = 120
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    free = iter(torch.randperm(num_blocks).tolist())
    decodes = [([next(free) for _ in range(-(-n // block_size))], n) for n in (9, 30)]
    chunks = []  # (table, start_pos, chunk_len)
    for start, length in [(0, 1), (0, 37), (3 * block_size, 2 * block_size), (13, 1), (29, 50), (0, 8)]:
        chunks.append(([next(free) for _ in range(-(-(start + length) // block_size))], start, length))
    slots = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size for table, n in decodes]
    for table, start, length in chunks:
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + length)]
    tokens = len(slots)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim)  # split as the model does: strided views
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    v = v.view(tokens, num_kv_heads, head_dim)
    outs = []
    for kernel in (None, kernels):
        meta = build_metadata(decodes, chunks, slots, block_size, sliding_window, torch.device("cpu"), kernel)
        outs.append(paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layer_kernel_matches_per_op_path(tiny_models, kernels, family, sliding_window):
    """One C++ op per decoder layer runs the same kernels in the same order as the per-op path: the
    same logits and the same cache, bit for bit, on a step of decodes beside prefill chunks from
    the start and after a cached prefix (biases: qwen2; q/k norms: qwen3)."""
    model = load_model(str(tiny_models[family]), dtype="float32").model
    assert_fused_equals_per_op(model, kernels, "decoder_layer", sliding_window)


def assert_fused_equals_per_op(model, kernels, op: str, sliding_window: int | None = None,
                               every_row: bool = False) -> None:
    """The model's C++ layer op (`op`, counted: it ran, once a layer) against its per-op path on a
    `mixed_step`: the same logits (of a few rows, or `every_row`) and the same cache, bit for bit."""
    s, block_size = model.shape, 4
    torch.manual_seed(0)
    caches, decodes, chunks, positions, slots, input_ids = mixed_step(s, block_size)
    logits_at = torch.arange(len(slots)) if every_row else torch.tensor([0, 1, 2, 3 + 13 - 1, len(slots) - 1])
    results = []
    for fused in (False, True):
        model.fused, counting = fused, CountingKernels(kernels, op)
        meta = build_metadata(decodes, chunks, slots, block_size, sliding_window, torch.device("cpu"), counting)
        cache = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode():
            logits = model(input_ids, torch.tensor(positions), cache, meta, logits_at)
        assert counting.calls == (s.num_layers if fused else 0)
        results.append((logits, cache))
    (expected, expected_cache), (got, got_cache) = results
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for pair, other in zip(got_cache, expected_cache) for a, b in zip(pair, other))


def mixed_step(s, block_size: int = 4, num_blocks: int = 64) -> tuple:
    """A step of three decodes (9, 30 and 1 tokens of context) beside two prefill chunks (13 tokens from
    the start, 9 after a cached prefix of 7) over random caches, for a model of shape `s`: (caches,
    decodes, chunks, positions, slots, input_ids), as the fused-op tests run it."""
    caches = [(torch.randn(num_blocks * block_size, s.num_kv_heads, s.head_dim),
               torch.randn(num_blocks * block_size, s.num_kv_heads, s.head_dim)) for _ in range(s.num_layers)]
    free = iter(torch.randperm(num_blocks).tolist())
    decodes = [([next(free) for _ in range(-(-n // block_size))], n) for n in (9, 30, 1)]
    chunks = [([next(free) for _ in range(-(-(start + n) // block_size))], start, n) for start, n in [(0, 13), (7, 9)]]
    positions = [n - 1 for _, n in decodes] + [p for _, start, n in chunks for p in range(start, start + n)]
    tables = [table for table, _ in decodes] + [table for table, _, n in chunks for _ in range(n)]
    slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)]
    return caches, decodes, chunks, positions, slots, torch.randint(0, s.vocab_size, (len(slots),))
