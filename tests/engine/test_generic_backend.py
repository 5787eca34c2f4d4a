"""The generic backend (engine.models.generic): any transformers `*ForCausalLM` over our paged KV
cache gives HF `generate`'s greedy tokens, batched, chunked, preempted and with prefix hits; what it
cannot compute is refused at load with a message that names it.

Tiny random models (tests.models.GENERIC_FAMILIES): Gemma 3 (sliding-window and full layers mixed),
Gemma 2 (soft-capped scores), Phi-3, OLMo 2, Granite, GPT-NeoX, GPT-2 (`GPT2LMHeadModel`), OPT, which
have no native decoder; Qwen3-MoE and Mixtral (mixtures of experts) and a Qwen3, which do, forced
onto the generic backend. GPT-OSS (attention sinks), Llama 4 (chunked attention) and
Falcon (no pluggable attention) are refused.
"""

from __future__ import annotations

import pytest

from engine.loader import ModelLoadError, load_model
from engine.types import GenerationRequest, SamplingParams
from launch import EngineConfig, build_engine
from tests.engine.test_reference import hf_greedy, prompts
from tests.helpers import assert_all_blocks_free, run_to_completion

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SERVED = ["gemma3", "gemma2", "phi3", "qwen3moe", "mixtral", "olmo2", "granite", "gpt_neox", "gpt2", "opt"]
REFUSED = {"gpt_oss": "attention sinks", "llama4": "chunked_attention", "falcon": "pluggable attention"}


def generic_engine(path, num_blocks: int = 256, backend: str = "generic", **engine_kw):
    loaded = load_model(str(path), backend=backend)
    assert loaded.backend == "generic"
    return build_engine(loaded, EngineConfig(**engine_kw), num_blocks=num_blocks)


@pytest.mark.parametrize("family", SERVED)
def test_batched_and_chunked_greedy_matches_hf(generic_models, family):
    path = generic_models[family]
    engine = generic_engine(path, max_num_batched_tokens=16)  # prompts above 16 tokens are chunked
    batch = prompts(6, 300, lengths=[3, 17, 40, 9, 26, 1])
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


def test_ngram_speculation_matches_hf(generic_models):
    """Drafts are decode rows of several tokens each, verified in one forward: the generic model sees
    them as any other rows of the packed step."""
    from engine.speculative import SpeculativeConfig

    path = generic_models["qwen3moe"]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    engine = generic_engine(path, speculative=spec)
    batch = [p * 3 for p in prompts(4, 300, lengths=[5, 7, 3, 6], seed=3)]  # repeats: drafts get proposed
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]
    assert engine.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen3moe"])
def test_quantized_greedy_equals_hf_on_the_same_quantized_weights(generic_models, family, method):
    """The projections transformers names `*_proj` (Phi-3's fused qkv_proj and gate_up_proj too)
    quantized as on the native path; the reference is HF on the same weights, de-quantized."""
    from tests.engine.test_quantization import assert_greedy_equals_fake_quantized_hf

    assert_greedy_equals_fake_quantized_hf(generic_models[family], method, backend="generic")


def test_a_native_family_forced_onto_the_generic_backend_matches_hf(tiny_models):
    path = tiny_models["qwen3"]
    engine = generic_engine(path, backend="generic")
    batch = prompts(4, 300)
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_preemption_and_prefix_hits_match_hf(generic_models, cpu_kernels):
    """Gemma 3's sliding layers see 8 tokens back: a prefix hit and a recomputed (preempted)
    sequence must mask the cached keys exactly as HF does, on either attention path (the C++
    kernels take each layer's window; the torch path builds its masks per window)."""
    path = generic_models["gemma3"]
    engine = generic_engine(path, num_blocks=8, cpu_kernels=cpu_kernels)  # 8 blocks of 16 < 6 x (26 + 12) tokens
    batch = prompts(6, 300, lengths=[26, 12, 20, 17, 9, 24])
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]
    assert engine.scheduler.num_preemptions > 0

    shared = prompts(1, 300, lengths=[40], seed=1)[0]  # two blocks' worth cached, then other tails
    first = [shared + [5, 6, 7]]
    second = [shared + [8, 9], shared + [10]]
    assert run_to_completion(engine, first, GREEDY) == [hf_greedy(path, first[0], 12)]
    hits = engine.scheduler.kv.num_hit_tokens
    assert run_to_completion(engine, second, GREEDY) == [hf_greedy(path, p, 12) for p in second]
    assert engine.scheduler.kv.num_hit_tokens >= hits + 2 * 32  # both reused the two full shared blocks
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("family", REFUSED)
def test_what_the_paged_attention_does_not_compute_is_refused_at_load_naming_it(generic_models, family):
    with pytest.raises(ModelLoadError, match=f"cannot be served: .*{REFUSED[family]}"):
        load_model(str(generic_models[family]))


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_soft_capped_sliding_layers_match_hf_through_preemption(generic_models, cpu_kernels):
    """Gemma 2 caps its attention scores (tanh) and alternates sliding (8 tokens) and full layers."""
    path = generic_models["gemma2"]
    engine = generic_engine(path, num_blocks=8, cpu_kernels=cpu_kernels, max_num_batched_tokens=16)
    batch = prompts(6, 300, lengths=[26, 12, 20, 17, 9, 24])
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 12) for p in batch]
    assert engine.scheduler.num_preemptions > 0


def test_a_family_without_a_native_decoder_is_refused_on_the_native_backend(generic_models):
    with pytest.raises(ModelLoadError, match="no native backend: architecture Olmo2ForCausalLM is not one of"):
        load_model(str(generic_models["olmo2"]), backend="native")


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    from tests.models import build_tokenizer

    tokenizer = build_tokenizer()
    BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, intermediate_size=64)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_a_failing_step_fails_only_its_request(generic_models):
    from engine.types import FinishReason

    path = generic_models["phi3"]
    engine = generic_engine(path)
    engine.add_request(GenerationRequest("bad", [5, 10_000_000], GREEDY))  # past the vocabulary
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("bad", FinishReason.ERROR)]
    [prompt] = prompts(1, 300, lengths=[11])
    assert run_to_completion(engine, [prompt], GREEDY) == [hf_greedy(path, prompt, 12)]
    assert_all_blocks_free(engine.scheduler.kv)
