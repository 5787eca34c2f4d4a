"""A step that fails fails only the requests that caused it (issue 11, item 2b), on the real engine.

The hostile requests are built as `SamplingParams` / prompt ids directly, as if a check at the
boundary had missed them: a token id past the embedding fails the packed forward, a parameter of
the wrong type fails the batched sampler. Their greedy neighbours in the same steps must go on
untouched (the same tokens as when run alone), and the failed request hears only the engine's
fixed message, never the exception's text.
"""

from __future__ import annotations

import pytest

from engine.types import GENERATION_FAILED, FinishReason, GenerationRequest, SamplingParams
from tests.helpers import assert_all_blocks_free, make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def alone(llama_path) -> list[list[int]]:
    """Each neighbour's tokens when it runs alone."""
    engine = make_engine(llama_path)
    return [run_to_completion(engine, [prompt], GREEDY)[0] for prompt in PROMPTS]


def run_with(engine, hostile: GenerationRequest) -> tuple[dict[str, list[int]], dict]:
    """The neighbours and `hostile` submitted together, stepped to the end: tokens and last event per id."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(GenerationRequest(f"n{i}", prompt, GREEDY))
    engine.add_request(hostile)
    tokens: dict[str, list[int]] = {}
    last = {}
    for _ in range(200):
        if not engine.has_work():
            break
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            last[event.request_id] = event
    assert not engine.has_work()
    return tokens, last


def check_isolated(engine, tokens, last, alone) -> None:
    assert [tokens[f"n{i}"] for i in range(len(PROMPTS))] == alone
    assert all(last[f"n{i}"].finish_reason == FinishReason.LENGTH for i in range(len(PROMPTS)))
    bad = last["hostile"]
    assert bad.finish_reason == FinishReason.ERROR and bad.error == GENERATION_FAILED
    assert engine.num_unfinished == 0
    assert engine.stats().num_step_errors >= 1
    assert_all_blocks_free(engine.scheduler.kv)


def test_a_token_past_the_embedding_fails_only_its_request(llama_path, alone):
    engine = make_engine(llama_path)
    vocab = engine.runner.model.shape.vocab_size
    hostile = GenerationRequest("hostile", [5, vocab + 3, 7], GREEDY)  # the packed forward raises (IndexError)
    tokens, last = run_with(engine, hostile)
    check_isolated(engine, tokens, last, alone)
    assert "index" not in last["hostile"].error.lower()


def test_a_request_reading_blocks_its_failing_neighbour_computes_is_recomputed(llama_path):
    """The neighbour takes the shared prefix the hostile request computes in the same step. That
    step fails; alone, the hostile one fails again and its blocks hold nothing, so the neighbour
    goes back to the queue and computes the prefix itself: the same tokens as alone."""
    shared = list(range(40, 72))  # two full blocks of 16
    prompt = shared + [5, 6, 7]
    [expected] = run_to_completion(make_engine(llama_path), [prompt], GREEDY)
    engine = make_engine(llama_path)
    vocab = engine.runner.model.shape.vocab_size
    engine.add_request(GenerationRequest("hostile", shared + [vocab + 3], GREEDY))
    engine.add_request(GenerationRequest("n", prompt, GREEDY))
    tokens: list[int] = []
    last = {}
    while engine.has_work():
        for event in engine.step():
            tokens += event.token_ids if event.request_id == "n" else []
            last[event.request_id] = event
    assert engine.scheduler.kv.num_hit_tokens == 32  # it did read the hostile request's blocks
    assert tokens == expected and last["n"].finish_reason == FinishReason.LENGTH
    assert last["hostile"].finish_reason == FinishReason.ERROR
    assert_all_blocks_free(engine.scheduler.kv)


def test_a_parameter_the_sampler_chokes_on_fails_only_its_request(llama_path, alone):
    engine = make_engine(llama_path)
    broken = SamplingParams(max_tokens=10, temperature=1.0, min_p=None)  # None > 0.0 raises TypeError
    tokens, last = run_with(engine, GenerationRequest("hostile", [30, 31, 32], broken))
    check_isolated(engine, tokens, last, alone)
    assert "TypeError" not in last["hostile"].error


def test_a_huge_top_k_is_clamped_to_the_vocabulary(llama_path):
    """2**63 overflowed int64 in the sampler and failed the whole step; now it means 'no limit'."""
    engine = make_engine(llama_path)
    seeded = dict(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    huge = run_to_completion(engine, [PROMPTS[0]], SamplingParams(top_k=2**63, **seeded))
    unlimited = run_to_completion(engine, [PROMPTS[0]], SamplingParams(**seeded))
    assert huge == unlimited and len(huge[0]) == 8
    assert engine.stats().num_step_errors == 0


def test_a_tiny_temperature_is_greedy(llama_path):
    """1e-46 is 0 in float32: dividing by it gave NaN probabilities (garbage tokens); it is greedy now."""
    engine = make_engine(llama_path)
    tiny = run_to_completion(engine, PROMPTS, SamplingParams(max_tokens=10, temperature=1e-46, ignore_eos=True))
    assert tiny == run_to_completion(engine, PROMPTS, GREEDY)
