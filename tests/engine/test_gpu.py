"""The engine on CUDA (skipped without it): greedy tokens equal HF `generate` on the same device
and dtype, for every model family, batched, with chunked prefill and prefix hits; the logits of a
prefill are close to HF's.

A CUDA machine runs them with `pytest -m gpu` (scripts/gpu_check.sh; results in bench/README.md); the
same checks run on CPU in float32 (`test_reference_checks_pass_on_cpu`), so what they ask is known to
hold there.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.attention import build_metadata
from engine.loader import load_model
from engine.types import SamplingParams
from launch import EngineConfig, build_engine
from tests.engine.test_reference import generate_greedy, prompts
from tests.helpers import assert_all_blocks_free, run_to_completion
from tests.models import FAMILIES

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_model(path, device: str, dtype: str):
    """HF's model; a mixture of experts through transformers' own per-expert loop (`eager`), whose adds
    our experts follow: its default, a grouped GEMM, sums a token's experts in float32 and rounds once,
    which differs from the loop's half-precision adds in the last bit."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], experts_implementation="eager").to(
        device).eval()


def check_matches_hf(path, device: str, dtype: str, graphs: bool = False) -> None:
    """Eight prompts at once with a 20-token step budget (chunked prefills beside decodes), then
    the same prompts again (every one a prefix hit); the tokens equal HF's each time. `graphs`: the
    decode steps replay CUDA graphs (engine/cuda_graphs.py), checked to have run."""
    engine = build_engine(load_model(str(path), device=device, dtype=dtype),
                          EngineConfig(max_num_batched_tokens=20, cuda_graphs=graphs), num_blocks=256)
    model = hf_model(path, device, dtype)
    batch = prompts(8, 300)
    expected = [generate_greedy(model, p, 16) for p in batch]
    assert run_to_completion(engine, batch, GREEDY) == expected
    assert run_to_completion(engine, batch, GREEDY) == expected
    assert engine.scheduler.kv.num_hit_tokens > 0
    assert_all_blocks_free(engine.scheduler.kv)
    if graphs:
        assert engine.runner.graphs is not None and engine.runner.graphs.replays >= 2 * (GREEDY.max_tokens - 1)


def check_logits_close(path, device: str, dtype: str) -> None:
    """One 40-token prefill through the engine's model and paged cache: every position's logits are
    HF's to the dtype's precision."""
    engine = build_engine(load_model(str(path), device=device, dtype=dtype), EngineConfig(), num_blocks=16)
    runner = engine.runner
    [prompt] = prompts(1, 300, lengths=[40])
    n, bs = len(prompt), runner.block_size
    table = list(range(-(-n // bs)))  # a fresh cache: blocks 0, 1, 2 hold positions 0..n-1 in order
    meta = build_metadata([], [(table, 0, n)], list(range(n)), bs, runner.model.shape.sliding_window,
                          runner.device)
    positions = torch.arange(n, device=runner.device)
    with torch.inference_mode():
        ours = runner.model(torch.tensor(prompt, device=runner.device), positions, runner.kv_caches, meta, positions)
        expected = hf_model(path, device, dtype)(torch.tensor([prompt], device=device)).logits[0].float()
    tol = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}[dtype]
    torch.testing.assert_close(ours.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_on_cuda_matches_hf(tiny_models, family, dtype):
    check_matches_hf(tiny_models[family], "cuda", dtype)
    check_logits_close(tiny_models[family], "cuda", dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_match_hf(tiny_models, family, dtype):
    check_matches_hf(tiny_models[family], "cuda", dtype, graphs=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["gemma3", "gemma2", "qwen3moe", "mixtral", "phi3"])  # native: phi3, the experts
def test_more_families_on_cuda_match_hf(generic_models, family, dtype):
    check_logits_close(generic_models[family], "cuda", dtype)  # first: a failure says whether one prefill is off
    check_matches_hf(generic_models[family], "cuda", dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["gemma3", "phi3"])  # native and dense (the experts' routing syncs: eager)
def test_more_native_families_under_cuda_graphs(generic_models, family):
    check_matches_hf(generic_models[family], "cuda", "bfloat16", graphs=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])  # causal, multi-axis positions, both ways
def test_vision_on_cuda_matches_hf(tmp_path, family, dtype):
    from tests.engine.test_vision import check_images_match_hf
    from tests.models import save_vision_model

    check_images_match_hf(save_vision_model(family, tmp_path / family), "cuda", dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_reference_checks_pass_on_cpu(tiny_models, family):
    """What the CUDA test asks, on CPU in float32, so the checks themselves are known to be right."""
    check_matches_hf(tiny_models[family], "cpu", "float32")
    check_logits_close(tiny_models[family], "cpu", "float32")


def test_reference_checks_pass_on_cpu_for_the_generic_backend(generic_models):
    check_matches_hf(generic_models["gemma3"], "cpu", "float32")
    check_logits_close(generic_models["gemma3"], "cpu", "float32")


def check_lora_matches_peft(base, adapter, device: str, dtype: str) -> None:
    """Requests to the base and to a LoRA adapter in one batch (chunked): the adapter's tokens equal PEFT's
    unmerged model on the same device and dtype, the base's equal the model with the adapter disabled."""
    from peft import PeftModel

    from engine.lora import read_adapter
    from tests.engine.test_lora import run_mixed

    engine = build_engine(load_model(str(base), device=device, dtype=dtype), EngineConfig(max_num_batched_tokens=20),
                          num_blocks=256)
    engine.add_adapter("a", read_adapter(str(adapter)))
    peft = PeftModel.from_pretrained(hf_model(base, device, dtype), adapter).eval()
    batch = prompts(6, 300)
    names = ["a" if i % 2 else "" for i in range(len(batch))]
    got = run_mixed(engine, list(zip(batch, names)))
    for prompt, name, tokens in zip(batch, names, got):
        if name:
            assert tokens == generate_greedy(peft, prompt, 10)
        else:
            with peft.disable_adapter():
                assert tokens == generate_greedy(peft, prompt, 10)


@pytest.fixture(scope="module")
def lora_adapter(tiny_models, tmp_path_factory):
    from tests.models import save_lora_adapter

    return save_lora_adapter(tiny_models["llama"], tmp_path_factory.mktemp("gpu-lora") / "a",
                             ["q_proj", "v_proj", "o_proj", "down_proj"], r=8, lora_alpha=32, seed=3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_on_cuda_matches_peft(tiny_models, lora_adapter, dtype):
    check_lora_matches_peft(tiny_models["llama"], lora_adapter, "cuda", dtype)


def test_lora_check_passes_on_cpu(tiny_models, lora_adapter):
    check_lora_matches_peft(tiny_models["llama"], lora_adapter, "cpu", "float32")
