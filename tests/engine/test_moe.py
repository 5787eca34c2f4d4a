"""Mixtures of experts on the native decoder (engine.models.moe): Qwen3-MoE (top k as they come, or
renormalised; dense layers among the sparse ones) and Mixtral give HF `generate`'s greedy tokens,
batched and chunked, on the C++ layer op and on the torch path; the op routes and adds as the
per-op path does, bit for bit; an adapter on experts is refused."""

from __future__ import annotations

import pytest
import torch

from engine.loader import load_model
from engine.lora import AdapterError, PeftAdapter
from engine.models.moe import SparseMoe
from engine.types import SamplingParams
from launch import EngineConfig, build_engine
from tests.engine.test_fast_paths import assert_fused_equals_per_op
from tests.engine.test_reference import hf_greedy, prompts
from tests.helpers import assert_all_blocks_free, run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MOE = ["qwen3moe", "qwen3moe-mixed", "mixtral"]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("family", MOE)
def test_native_moe_greedy_matches_hf(generic_models, family, cpu_kernels):
    path = generic_models[family]
    loaded = load_model(str(path))
    assert loaded.backend == "native"
    sparse = [isinstance(layer.mlp, SparseMoe) for layer in loaded.model.layers]
    assert sparse == ([False, True] if family == "qwen3moe-mixed" else [True, True])
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=16, cpu_kernels=cpu_kernels), num_blocks=256)
    batch = prompts(6, 300, lengths=[3, 17, 40, 9, 26, 1])  # prompts above 16 tokens are chunked
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("family", MOE)
def test_fused_moe_layer_matches_per_op_path(generic_models, kernels, family):
    """The C++ layer op with its `moe_mlp` (router, top k, each expert once on its gathered tokens, the
    weighted outputs added in expert order) gives the per-op path's logits and cache, bit for bit."""
    model = load_model(str(generic_models[family]), dtype="float32").model
    assert_fused_equals_per_op(model, kernels, "decoder_layer", every_row=True)


def test_an_adapter_on_a_layer_of_experts_is_refused(generic_models):
    """PEFT names a dense MLP's linears; on a layer that routes to experts they adapt nothing we compute."""
    path = generic_models["qwen3moe-mixed"]
    model = load_model(str(path)).model
    s = model.shape
    dense = {"model.layers.0.mlp.gate_proj": (torch.zeros(4, s.hidden_size), torch.zeros(s.intermediate_size, 4), 1.0)}
    assert model.lora_weights(PeftAdapter(path, dense, ""), torch.device("cpu"), torch.float32)  # layer 0: dense
    sparse = {"model.layers.1.mlp.gate_proj": dense["model.layers.0.mlp.gate_proj"]}
    with pytest.raises(AdapterError, match="layer 1 routes to experts"):
        model.lora_weights(PeftAdapter(path, sparse, ""), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("family, method", [("qwen3moe", "int4"), ("mixtral", "int8")])
def test_quantized_moe_greedy_equals_hf_on_the_same_quantized_weights(generic_models, family, method):
    """On CPU in float32 the experts are quantized with the attention (block kernels, inside `moe_mlp`); the
    router stays float. On the generic backend (torch's int kernels) transformers' 3-D experts stay float."""
    from engine.quantization import Int4Linear, Int8Linear
    from tests.engine.test_quantization import assert_greedy_equals_fake_quantized_hf, code_bits

    assert_greedy_equals_fake_quantized_hf(generic_models[family], method, backend="native")
    bits = {"int4": 4, "int8": 8}[method]
    layer = load_model(str(generic_models[family]), quantization=method).model.layers[1]
    assert code_bits(layer.self_attn.qkv_proj) == bits
    assert all(code_bits(linear) == bits for e in layer.mlp.experts for linear in (e.gate_up_proj, e.down_proj))
    assert code_bits(layer.mlp.gate) is None
    generic = load_model(str(generic_models[family]), quantization=method, backend="generic").model
    assert any(isinstance(m, (Int4Linear, Int8Linear)) for m in generic.modules())
