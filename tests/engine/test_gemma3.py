"""Gemma 3's text decoder on the native path (engine/models/gemma3.py): greedy equals HF `generate`
batched, chunked and with prefix hits, with the C++ kernels op by op and on the torch path; a prefill's
logits equal HF's; what it does not compute goes to the generic backend under `auto`.

The tiny model's norms get random weights: transformers initialises Gemma's at zero, where
(1 + weight) and a plain 1 agree, and the test would not see the difference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.loader import ModelLoadError, load_model
from engine.models.gemma3 import Gemma3ForCausalLM
from launch import EngineConfig, build_engine
from tests.engine.test_gpu import GREEDY, check_logits_close, hf_model
from tests.engine.test_reference import generate_greedy, prompts
from tests.helpers import assert_all_blocks_free, run_to_completion
from tests.models import save_generic_model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The tiny Gemma 3 (sliding windows of 8 on every other layer), its norms' weights random."""
    root = tmp_path_factory.mktemp("gemma3")
    model = AutoModelForCausalLM.from_pretrained(save_generic_model("gemma3", root / "zeros"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(root / "model")
    for file in (root / "zeros").glob("tokenizer*"):
        (root / "model" / file.name).write_bytes(file.read_bytes())
    return root / "model"


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_native_gemma3_greedy_equals_hf(gemma3, cpu_kernels):
    loaded = load_model(str(gemma3))
    assert loaded.backend == "native" and isinstance(loaded.model, Gemma3ForCausalLM)
    engine = build_engine(loaded, EngineConfig(max_num_batched_tokens=20, cpu_kernels=cpu_kernels), num_blocks=256)
    hf = hf_model(gemma3, "cpu", "float32")
    batch = prompts(8, 300)  # most longer than the window: the sliding layers mask
    expected = [generate_greedy(hf, p, GREEDY.max_tokens) for p in batch]
    assert run_to_completion(engine, batch, GREEDY) == expected
    assert run_to_completion(engine, batch, GREEDY) == expected  # prefix hits
    assert engine.scheduler.kv.num_hit_tokens > 0
    assert_all_blocks_free(engine.scheduler.kv)


def test_native_gemma3_logits_equal_hf(gemma3):
    check_logits_close(gemma3, "cpu", "float32")


@pytest.mark.parametrize("setting, named", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
])
def test_what_the_native_layer_does_not_compute_goes_generic(gemma3, tmp_path, setting, named):
    model = AutoModelForCausalLM.from_pretrained(gemma3)
    for key, value in setting.items():
        setattr(model.config, key, value)
    model.save_pretrained(tmp_path / "m")
    for file in gemma3.glob("tokenizer*"):
        (tmp_path / "m" / file.name).write_bytes(file.read_bytes())
    assert load_model(str(tmp_path / "m")).backend == "generic"
    with pytest.raises(ModelLoadError, match=named):
        load_model(str(tmp_path / "m"), backend="native")


def test_the_layer_op_matches_the_per_op_path(gemma3, kernels):
    """`gemma_layer` runs the per-op path's kernels (and ATen's GELU) in its order: the same logits and the
    same cache, bit for bit, on decodes beside prefill chunks, through sliding and full layers."""
    from tests.engine.test_fast_paths import assert_fused_equals_per_op

    assert_fused_equals_per_op(load_model(str(gemma3), dtype="float32").model, kernels, "gemma_layer")
