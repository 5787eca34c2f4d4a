"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) on the native decoder: q/k/v and gate/up come fused in the
checkpoint; greedy output equals HF `generate`, batched and chunked, on the C++ layer op and on the
torch path. What the native decoder does not compute (partial rotary embeddings, as Phi-4-mini's;
long-context rope) goes to the generic backend under `auto`, and is refused naming it under `native`."""

from __future__ import annotations

import json

import pytest

from engine.loader import ModelLoadError, load_model
from engine.packed_linear import PackedLinear
from engine.types import SamplingParams
from launch import EngineConfig, build_engine
from tests.engine.test_reference import hf_greedy, prompts
from tests.helpers import assert_all_blocks_free, run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_native_phi3_greedy_matches_hf(generic_models, cpu_kernels):
    path = generic_models["phi3"]
    loaded = load_model(str(path))
    assert loaded.backend == "native" and isinstance(loaded.model.layers[0].self_attn.qkv_proj, PackedLinear)
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=16, cpu_kernels=cpu_kernels), num_blocks=256)
    batch = prompts(6, 300, lengths=[3, 17, 40, 9, 26, 1])
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("rope, why", [
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial rotary"),
    ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
     "rope type 'longrope'"),  # Phi-3-mini-128k's
])
def test_what_the_native_decoder_does_not_compute_goes_generic(generic_models, tmp_path, rope, why):
    folder = tmp_path / "phi3"
    folder.mkdir()
    for file in generic_models["phi3"].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(folder))
    assert loaded.backend == "generic"
    engine = build_engine(loaded, EngineConfig(), num_blocks=64)
    batch = prompts(2, 300, lengths=[9, 20])
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(folder, p, 12) for p in batch]
    with pytest.raises(ModelLoadError, match=why):
        load_model(str(folder), backend="native")
