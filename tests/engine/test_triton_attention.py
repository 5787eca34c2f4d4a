"""The Triton decode kernel (engine/triton_attention.py) computes what the torch paths compute.

No GPU here: each check runs in a subprocess under Triton's interpreter (TRITON_INTERPRET=1, read
when the kernel is defined, so before triton is imported), which runs the kernel on CPU tensors.
The interpreter checks the arithmetic and which memory is read, not GPU code generation.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # of the output's magnitude
CONTEXTS = [1, 7, 16, 53, 40]  # one token, a partial block, exactly one block, many blocks (block_size 16)


def _run_python(code: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _fix_interpreter_for_numpy_2_4() -> None:
    """triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound with
    int(array), an error from numpy 2.4 (triton-lang/triton#9171, fixed upstream by #9172)."""
    import triton.runtime.interpreter as interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_squeezed", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._squeezed = True
    interpreter._patch_lang_tensor = patched


def _case(contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          width: int, seed: int = 0, strided: bool = False) -> dict:
    """Random q and caches; each sequence's blocks shuffled over the cache; every slot that no
    visible key uses (blocks off the tables, the last block's tail) is NaN. Tables are `width`
    blocks wide, padded with block 0, itself NaN: a kernel reading past cdiv(len, block_size) or
    not masking the last block's tail gets NaN."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in contexts]
    num_blocks = 1 + sum(needed) + 3  # block 0: padding only; 3 unused
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(contexts), width, dtype=torch.long)
    slots = []
    for i, (n, blocks) in enumerate(zip(contexts, needed)):
        tables[i, :blocks] = torch.tensor(order[:blocks])
        order = order[blocks:]
        slots.append(torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)],
                                  dtype=torch.long))
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    if strided:  # k and v interleaved in one buffer: neither cache is contiguous
        k_cache, v_cache = torch.full((shape[0], 2, *shape[1:]), float("nan"), dtype=dtype).unbind(1)
    else:
        k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    used = torch.cat(slots)
    k_cache[used] = torch.randn(len(used), num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache[used] = torch.randn(len(used), num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=torch.tensor(contexts), slots=slots,
                block_size=block_size, scale=head_dim**-0.5)


def _reference(case: dict, window: int) -> torch.Tensor:
    """float64 softmax over each sequence's visible keys, gathered slot by slot."""
    q = case["q"].double()
    group = q.shape[1] // case["k_cache"].shape[1]
    out = torch.empty_like(q)
    for i, slots in enumerate(case["slots"]):
        first = max(0, len(slots) - window) if window else 0
        keys = case["k_cache"][slots[first:]].double().repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        values = case["v_cache"][slots[first:]].double().repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,nhd->hn", q[i], keys) * case["scale"]).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", weights, values)
    return out


def _triton(case: dict, window: int, tables: torch.Tensor | None = None) -> torch.Tensor:
    from engine.triton_attention import paged_decode_attention

    out = torch.full_like(case["q"], float("nan"))
    tables = case["tables"] if tables is None else tables
    paged_decode_attention(out, case["q"], case["k_cache"], case["v_cache"], tables, case["lens"], case["block_size"],
                           case["scale"], window)
    return out


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == dtype and torch.isfinite(got).all(), what
    bound = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    error = (got.double() - expected.double()).abs().max().item()
    assert error <= bound, f"{what}: max error {error:.3g} > {bound:.3g}"


def _check_matches_reference() -> None:
    # (heads, kv heads, head_dim, block_size): GQA groups 1, 3 (SmolLM2: 9 over 3) and 4; a head_dim
    # and a block_size that are not powers of two (padded and masked)
    shapes = [(4, 4, 64, 16), (9, 3, 128, 16), (8, 2, 32, 16), (6, 2, 80, 12)]
    for dtype in (torch.float32, torch.bfloat16):
        for index, (heads, kv_heads, head_dim, block_size) in enumerate(shapes):
            contexts = [n for n in CONTEXTS if n != 16] + [block_size]
            width = 3 * -(-max(contexts) // block_size) + 5  # far wider than any context needs
            case = _case(contexts, heads, kv_heads, head_dim, block_size, dtype, width, seed=index,
                         strided=index % 2 == 1)
            for window in (0, 20):  # 20: cuts into a block of the longer contexts, hides whole blocks before
                _assert_close(_triton(case, window), _reference(case, window), dtype,
                              f"{dtype} heads {heads}/{kv_heads} head_dim {head_dim} window {window}")


def _check_matches_torch_path() -> None:
    """engine.attention.paged_attention (writes the new tokens' k/v, then SDPA over gathered blocks)."""
    from engine.attention import build_metadata, paged_attention

    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    for dtype in (torch.float32, torch.bfloat16):
        for window in (None, 20):
            gen = torch.Generator().manual_seed(1)
            num_blocks = 1 + sum(-(-n // block_size) for n in CONTEXTS)
            order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
            contexts, slot_mapping = [], []
            for n in CONTEXTS:
                blocks = -(-n // block_size)
                table, order = order[:blocks], order[blocks:]
                contexts.append((table, n))
                slot_mapping.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size)
            k_cache, v_cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
            q = torch.randn(len(CONTEXTS), heads, head_dim, generator=gen).to(dtype)
            k, v = torch.randn(2, len(CONTEXTS), kv_heads, head_dim, generator=gen).to(dtype)
            meta = build_metadata(contexts, [], slot_mapping, block_size, window, torch.device("cpu"))
            expected = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)  # writes k, v into the caches
            case = dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=meta.decode_block_tables,
                        lens=meta.decode_context_lens, block_size=block_size, scale=head_dim**-0.5)
            padded = torch.cat([meta.decode_block_tables, torch.zeros(len(CONTEXTS), 20, dtype=torch.long)], 1)
            for tables in (meta.decode_block_tables, padded):
                _assert_close(_triton(case, window or 0, tables), expected, dtype, f"{dtype} window {window}")


def _check_reads_only_visible_slots() -> None:
    """Changing any slot a sequence may not see leaves its output bit for bit the same: blocks off the
    table, table padding beyond cdiv(len, block_size), the last block's tail, keys before the window."""
    for window in (0, 20):
        case = _case(CONTEXTS, 8, 2, 64, 16, torch.float32, width=12, seed=3)
        for cache in (case["k_cache"], case["v_cache"]):
            cache.nan_to_num_(0.0)  # a kernel that reads them is now still finite: a second run must tell
        before = _triton(case, window)
        visible = torch.cat([s[max(0, len(s) - window) if window else 0 :] for s in case["slots"]])
        hidden = torch.ones(case["k_cache"].shape[0], dtype=torch.bool)
        hidden[visible] = False
        for cache in (case["k_cache"], case["v_cache"]):
            cache[hidden] = 1e4  # big enough to move any softmax that reads it
        after = _triton(case, window)
        assert torch.equal(before, after), f"window {window}: output depends on slots it may not see"
        case["tables"][:, 5:] = 7  # a live block of another sequence in the padding, as in a stale graph buffer
        assert torch.equal(_triton(case, window), after), f"window {window}: read beyond cdiv(len, block_size)"


def _check_padding_rows() -> None:
    """CUDA-graph padding rows (context 1, block 0) and a context of 0 neither crash nor disturb the
    other rows; the length-1 row attends to its one key: its value, exactly."""
    case = _case([1, 53, 0, 1], 6, 2, 64, 16, torch.float32, width=8, seed=4)
    case["tables"][3] = 0  # padding row: its table all block 0
    case["k_cache"][0], case["v_cache"][0] = torch.randn(2, 2, 64)
    out = _triton(case, 0)
    expected = _reference({**case, "q": case["q"][:2], "slots": case["slots"][:2]}, 0)
    _assert_close(out[:2], expected, torch.float32, "live rows")
    assert torch.equal(out[3], case["v_cache"][0].repeat_interleave(3, dim=0)), "padding row"
    assert torch.isfinite(out[2]).all(), "context 0 writes zeros, not 0/0"


CHECKS = [_check_matches_reference, _check_matches_torch_path, _check_reads_only_visible_slots, _check_padding_rows]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the `test` extra installs it)")
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_triton_decode_attention_in_interpreter(check):
    code = f"import tests.engine.test_triton_attention as t; t._fix_interpreter_for_numpy_2_4(); t.{check}()"
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_module_imports_without_triton():
    """Installs without triton (CPU-only) import the module and read AVAILABLE = False."""
    code = ("import sys; sys.modules['triton'] = None\n"  # None in sys.modules: `import triton` raises ImportError
            "import engine.triton_attention as m\n"
            "assert m.AVAILABLE is False and not hasattr(m, '_paged_decode_kernel')")
    proc = _run_python(code, interpret=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
