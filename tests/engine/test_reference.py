"""Our greedy tokens equal Hugging Face `generate` on the same weights, however they are batched.

Tiny random-weight Llama, Mistral, Qwen2, Qwen3 (and a llama3-rope Llama) built from configs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.types import SamplingParams
from tests.helpers import assert_all_blocks_free, make_engine, run_to_completion
from tests.models import FAMILIES

PROMPT_LENGTHS = [3, 17, 5, 40, 1, 9, 26, 12]


def prompts(n: int, vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


_hf_cache: dict = {}


def hf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    key = (str(path), tuple(prompt), max_new_tokens)
    if key not in _hf_cache:
        if str(path) not in _hf_cache:
            _hf_cache[str(path)] = AutoModelForCausalLM.from_pretrained(path).eval()
        _hf_cache[key] = generate_greedy(_hf_cache[str(path)], prompt, max_new_tokens)
    return _hf_cache[key]


def generate_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`'s greedy tokens after `prompt`, exactly max_new_tokens of them, on the model's device.
    No EOS stops it and none is masked: what `ignore_eos` asks of the engine (`min_new_tokens` would mask
    EOS instead, and a tiny Mixtral picks its EOS, 2, in these tests' prompts)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=None, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_single_prompt_matches_hf(tiny_models, family):
    path = tiny_models[family]
    engine = make_engine(path)
    [prompt] = prompts(1, 300, lengths=[11])
    assert run_to_completion(engine, [prompt], GREEDY) == [hf_greedy(path, prompt, 16)]
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("family", FAMILIES)
def test_eight_prompts_batched_match_hf(tiny_models, family):
    path = tiny_models[family]
    engine = make_engine(path)
    batch = prompts(8, 300)
    ours = run_to_completion(engine, batch, GREEDY)
    assert ours == [hf_greedy(path, p, 16) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_matches_hf(tiny_models, family):
    path = tiny_models[family]
    engine = make_engine(path, max_num_batched_tokens=7)  # every prompt above 7 tokens is chunked
    batch = prompts(4, 300, lengths=[40, 23, 9, 15])
    ours = run_to_completion(engine, batch, GREEDY)
    assert ours == [hf_greedy(path, p, 16) for p in batch]
    assert engine.num_steps > 40 // 7
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_preemption_matches_hf(tiny_models, family):
    path = tiny_models[family]
    # 8 blocks of 16 tokens cannot hold 6 sequences of up to 26 + 16 tokens: preemption must happen
    engine = make_engine(path, num_blocks=8)
    batch = prompts(6, 300, lengths=[26, 12, 20, 17, 9, 24])
    ours = run_to_completion(engine, batch, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert ours == [hf_greedy(path, p, 16) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


def test_same_prompt_alone_and_in_mixed_batch_give_same_tokens(tiny_models):
    path = tiny_models["qwen2"]
    batch = prompts(5, 300)
    alone = run_to_completion(make_engine(path), [batch[0]], GREEDY)
    mixed = run_to_completion(make_engine(path, max_num_batched_tokens=20), batch, GREEDY)
    assert mixed[0] == alone[0]


def test_abort_frees_blocks(tiny_models):
    from engine.types import GenerationRequest

    engine = make_engine(tiny_models["llama"])
    engine.add_request(GenerationRequest("a", list(range(3, 40)), GREEDY))
    engine.add_request(GenerationRequest("b", list(range(3, 20)), GREEDY))
    engine.step()
    assert engine.scheduler.kv.num_free_blocks < engine.scheduler.kv.num_blocks
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")
    assert not engine.has_work()
    assert_all_blocks_free(engine.scheduler.kv)


def test_a_failed_step_fails_its_batch_and_the_engine_lives_on(tiny_models):
    from engine.types import GENERATION_FAILED, FinishReason, GenerationRequest

    engine = make_engine(tiny_models["llama"])
    # token id far past the vocabulary: the embedding lookup raises inside the step
    engine.add_request(GenerationRequest("bad", [5, 10_000_000], GREEDY))
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("bad", FinishReason.ERROR)]
    assert events[0].error == GENERATION_FAILED  # fixed text: the exception is for the log only
    assert_all_blocks_free(engine.scheduler.kv)
    [prompt] = prompts(1, 300, lengths=[11])
    assert run_to_completion(engine, [prompt], GREEDY) == [hf_greedy(tiny_models["llama"], prompt, 16)]
