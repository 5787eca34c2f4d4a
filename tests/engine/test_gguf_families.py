"""GGUF files of several families (tiny random models written as llama.cpp lays them out,
tests/gguf_models.py): greedy output through our engine equals transformers' own load of the same
file, for Llama (q/k permuted), Qwen2 (biases), Qwen3 (q/k norms) and Phi-3 (q/k/v and gate/up
fused in the file: `attn_qkv`, `ffn_up`) and Qwen3-MoE (experts stacked in the file, `ffn_*_exps`:
each expert's slice kept as its own blocks), in block formats the CPU kernels keep (Q4_0, Q4_1, Q5_1,
Q8_0: those the gguf package can write), in a batch with chunked prefill; on the generic backend
and de-quantized too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.block_panels import BlockEmbedding
from engine.loader import load_model
from launch import EngineConfig, build_engine
from tests.engine.test_reference import GREEDY, generate_greedy, prompts
from tests.gguf_models import save_gguf_model
from tests.helpers import assert_all_blocks_free, run_to_completion

FILES = [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("llama", "Q5_1"), ("phi3", "Q8_0"),
         ("qwen3moe", "Q4_0"), ("qwen3moe", "Q8_0")]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GALLEY_CACHE_DIR", str(root / "cache"))
        yield {(family, qtype): save_gguf_model(family, root / f"{family}-{qtype}.gguf", qtype)
               for family, qtype in FILES}


@pytest.mark.parametrize("family, qtype", FILES)
@pytest.mark.parametrize("how", ["default", "generic", "de-quantized"])
def test_gguf_greedy_equals_transformers_on_the_same_file(gguf_files, family, qtype, how):
    file = gguf_files[(family, qtype)]
    options = {"generic": {"backend": "generic"}, "de-quantized": {"quantization": "none"}}.get(how, {})
    loaded = load_model(str(file), **options)
    assert loaded.backend == ("generic" if how == "generic" else "native")
    if loaded.backend == "native":  # the file's own blocks, unless told to de-quantize
        mlp = loaded.model.layers[0].mlp
        panels = (mlp.experts[0] if family == "qwen3moe" else mlp).gate_up_proj.panels
        assert panels.dtype == {"default": torch.uint8 if qtype.startswith("Q4") else torch.int8,
                                "de-quantized": torch.float32}[how]
        assert isinstance(loaded.model.embed_tokens, BlockEmbedding) == (how == "default")
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=24), num_blocks=64)  # prompts in chunks
    batch = prompts(3, 380, lengths=[7, 30, 19])
    ours = run_to_completion(engine, batch, GREEDY)
    assert_all_blocks_free(engine.scheduler.kv)
    hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # so min_new_tokens suppresses no token: we ignore EOS too
    assert ours == [generate_greedy(hf, prompt, GREEDY.max_tokens) for prompt in batch]


def test_without_the_kernels_a_gguf_file_is_de_quantized_at_load(gguf_files, monkeypatch):
    """Where the kernels failed to build, the torch path would de-quantize every block at every step."""
    from engine.cpu_kernels import CPU_KERNELS

    monkeypatch.setattr(CPU_KERNELS, "failed", True)
    loaded = load_model(str(gguf_files[("llama", "Q4_0")]))
    assert loaded.model.layers[0].mlp.gate_up_proj.panels.dtype == torch.float32
    assert isinstance(loaded.model.embed_tokens, torch.nn.Embedding)
