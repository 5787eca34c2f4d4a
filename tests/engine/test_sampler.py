"""Sampler behaviour on real logits tensors and through the real engine."""

from __future__ import annotations

import math

import torch

from engine.sampler import Sampler, apply_penalties, draw, filter_probs, greedy, keep_mask
from engine.types import SamplingParams
from tests.helpers import assert_all_blocks_free, make_engine, make_seq, run_to_completion


def seq_with(output: list[int], **params):
    seq = make_seq(2, **params)
    seq.token_ids = [5, 6] + output
    return seq


def test_greedy_is_argmax_with_the_first_of_ties():
    torch.manual_seed(0)
    logits = torch.randn(32, 49152)
    logits[3, [7, 9000, 40000]] = 100.0  # a tie: the first index wins, as with argmax and HF
    logits[5, :] = 0.0
    assert greedy(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert greedy(logits)[3] == 7 and greedy(logits)[5] == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seq = seq_with([1], repetition_penalty=2.0)
    seq.token_ids = [0, 1]
    out = apply_penalties(logits.clone(), [seq])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    seq = seq_with([2, 2, 3], frequency_penalty=0.5, presence_penalty=1.0)
    seq.token_ids = [1, 1] + [2, 2, 3]
    seq.num_prompt_tokens = 2
    out = apply_penalties(logits.clone(), [seq])
    assert out.tolist() == [[0.0, 0.0, -2.0, -1.5]]


def test_penalties_of_a_batch_are_each_rows_own():
    """Rows with different penalties, one with none, penalised in one pass: each as if alone."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 30, generator=gen)
    seqs = [seq_with([3, 3, 9], repetition_penalty=1.5), seq_with([3, 7, 7, 7], frequency_penalty=0.4),
            seq_with([], temperature=1.0), seq_with([9, 9, 1], repetition_penalty=0.8, presence_penalty=0.3)]
    together = apply_penalties(logits.clone(), seqs)
    for row, seq in enumerate(seqs):
        alone = apply_penalties(logits[row:row + 1].clone(), [seq])
        assert torch.equal(together[row], alone[0]), row
    assert torch.equal(together[2], logits[2])
    assert math.isclose(together[1, 7], logits[1, 7] - 0.4 * 3, rel_tol=1e-6)  # three 7s in the output
    penalised = logits[0, 5] / 1.5 if logits[0, 5] > 0 else logits[0, 5] * 1.5  # 5: in the prompt
    assert math.isclose(together[0, 5], penalised, rel_tol=1e-6)
    assert math.isclose(together[3, 9], (logits[3, 9] / 0.8 if logits[3, 9] > 0 else logits[3, 9] * 0.8) - 0.3,
                        rel_tol=1e-6)


def test_top_k_top_p_min_p_mask_the_tail():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    seqs = [make_seq(1, top_k=2), make_seq(1, top_p=0.7), make_seq(1, min_p=0.2)]
    kept = (filter_probs(probs.clone(), seqs) > 0).tolist()
    assert kept == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]


def sorted_reference(probs: torch.Tensor, seqs) -> torch.Tensor:
    """The whole-vocabulary sort that filter_probs avoids where it can."""
    vocab = probs.shape[1]
    top_k = torch.tensor([min(s.params.top_k or vocab, vocab) for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    min_p = torch.tensor([s.params.min_p for s in seqs])
    values, ids = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(1, ids, values * keep_mask(values, top_k, top_p, min_p))


def test_filter_probs_keeps_what_a_whole_sort_keeps():
    """Peaked rows cut among the first candidates, flatter ones among the second, flat ones need the
    sort; rows of one batch take different ways, and rows without a filter stay whole."""
    gen = torch.Generator().manual_seed(0)
    vocab = 5000
    settings = [dict(top_p=0.9), dict(top_p=0.99), dict(top_k=40), dict(top_k=300), dict(top_k=3000),
                dict(min_p=0.05), dict(top_p=0.8, top_k=200, min_p=0.01), dict(top_p=0.5, min_p=0.3), dict()]
    for sharpness in (0.05, 1.0, 3.0, 8.0):
        probs = (torch.randn(len(settings), vocab, generator=gen) * sharpness).softmax(dim=-1)
        seqs = [make_seq(1, temperature=1.0, **kw) for kw in settings]
        expected = sorted_reference(probs, seqs)
        got = filter_probs(probs.clone(), seqs)
        assert torch.equal(got > 0, expected > 0), sharpness
        assert torch.allclose(got, expected)


def test_draw_never_picks_a_dropped_token():
    probs = torch.tensor([[0.0, 0.4, 0.0, 0.6, 0.0, 0.0]] * 4)
    uniforms = torch.tensor([0.0, 0.399, 0.4, 1.0 - 2.0**-53], dtype=torch.float64)  # token 1 owns [0, 0.4)
    assert draw(probs, uniforms).tolist() == [1, 1, 3, 3]
    assert draw(torch.tensor([[1e-30, 0.0, 0.0]]), torch.tensor([0.999999], dtype=torch.float64)).tolist() == [0]


def test_filtered_sampling_follows_the_kept_distribution():
    """Each filter's survivors are drawn in proportion to their probability, the rest never."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 6000
    cases = [(dict(top_p=0.7), [0.625, 0.375, 0, 0]), (dict(top_k=3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
             (dict(min_p=0.5), [0.625, 0.375, 0, 0])]
    for kw, expected in cases:
        seqs = [make_seq(1, temperature=1.0, **kw) for _ in range(n)]
        tokens, _ = Sampler(torch.device("cpu"), seed=7).sample(probs.log().repeat(n, 1), seqs)
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
        assert torch.allclose(freq, torch.tensor(expected), atol=0.025), (kw, freq)


def test_top_k_one_is_greedy_and_logprobs_are_reported():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seqs = [make_seq(1, temperature=1.0, top_k=1, logprobs=3) for _ in range(3)]
    tokens, logprobs = Sampler(torch.device("cpu")).sample(logits.clone(), seqs)
    assert tokens == logits.argmax(-1).tolist()
    for row, lp in enumerate(logprobs):
        expected = logits[row].log_softmax(-1)
        assert lp.token_id == tokens[row]
        assert math.isclose(lp.logprob, expected[tokens[row]].item(), rel_tol=1e-5)
        assert [t for t, _ in lp.top] == expected.topk(3).indices.tolist()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    seqs = [make_seq(1, temperature=1.0) for _ in range(4000)]
    tokens, _ = Sampler(torch.device("cpu"), seed=3).sample(probs.log().repeat(4000, 1), seqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seed_gives_same_output_alone_and_in_a_batch(tiny_models):
    path = tiny_models["llama"]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    prompt = list(range(3, 20))
    alone = run_to_completion(make_engine(path), [prompt], seeded)[0]
    engine = make_engine(path, max_num_batched_tokens=9)
    from engine.types import GenerationRequest

    noise = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    engine.add_request(GenerationRequest("n1", list(range(40, 70)), noise))
    engine.add_request(GenerationRequest("n2", list(range(5, 9)), noise))
    in_batch = run_to_completion(engine, [prompt], seeded)[0]
    assert in_batch == alone
    other_seed = run_to_completion(make_engine(path), [prompt], SamplingParams(
        max_tokens=12, temperature=1.0, seed=43, ignore_eos=True))[0]
    assert other_seed != alone
    assert_all_blocks_free(engine.scheduler.kv)


def test_resumed_generation_continues_exactly_greedy_and_seeded(tiny_models):
    """A restart re-prefills prompt + emitted tokens; the rest equals an uninterrupted run."""
    from engine.types import GenerationRequest

    path = tiny_models["qwen2"]
    prompt = list(range(3, 15))
    for params in (SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True,
                                  frequency_penalty=0.5)):
        whole = run_to_completion(make_engine(path), [prompt], params)[0]
        engine = make_engine(path)
        engine.add_request(GenerationRequest("r", prompt, params, resume_token_ids=whole[:8]))
        rest = []
        while engine.has_work():
            for event in engine.step():
                rest.extend(event.token_ids)
                assert event.num_output_tokens == 8 + len(rest)
        assert whole[:8] + rest == whole


def test_logit_bias_moves_the_greedy_choice_and_leaves_other_rows_alone():
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0]] * 3)
    seqs = [make_seq(1, temperature=0.0, logit_bias={1: 5.0}), make_seq(1, temperature=0.0),
            make_seq(1, temperature=1.0, logit_bias={0: -100.0, 3: 100.0})]
    tokens, logprobs = Sampler(torch.device("cpu")).sample(logits.clone(), seqs)
    assert tokens == [1, 0, 3]
    assert make_seq(1, logit_bias={"7": 1, 2: -1}).params.logit_bias == ((2, -1.0), (7, 1.0))


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 3)
    eos = frozenset({1})
    short = seq_with([3], temperature=0.0, min_tokens=2, stop_token_ids=[2])
    done = seq_with([3, 3], temperature=0.0, min_tokens=2, stop_token_ids=[2])
    ignoring = seq_with([], temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[2])
    tokens, _ = Sampler(torch.device("cpu"), eos_token_ids=eos).sample(logits.clone(), [short, done, ignoring])
    assert tokens == [3, 1, 1]  # short: both banned; done: EOS allowed; ignore_eos: EOS is no stop


def test_min_tokens_through_the_engine(tiny_models):
    """A +100 bias on EOS ends a generation at its first token; min_tokens holds EOS off for 3."""
    path = tiny_models["llama"]
    engine = make_engine(path)
    eos = next(iter(engine.eos_token_ids))
    free = run_to_completion(engine, [[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0,
                                                                  logit_bias={eos: 100.0}))[0]
    assert free == [eos]
    held = run_to_completion(engine, [[3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3,
                                                                  logit_bias={eos: 100.0}))[0]
    assert len(held) == 4 and eos not in held[:3] and held[3] == eos


# ---- issue 32: whatever the logits hold, the token is one of the vocabulary's ----------------------


def test_a_subnormal_repetition_penalty_keeps_the_logits_finite():
    """1e-300 is 0 in float32: the penalised logit was inf, the row's softmax NaN, and the drawn id
    the vocabulary's size, which failed the next step's embedding lookup (a 500)."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    for penalty in (1e-300, 5e-324, 2.2e-308, 1e300):
        seq = seq_with([1], repetition_penalty=penalty)
        seq.token_ids = [0, 1]
        out = apply_penalties(logits.clone(), [seq])
        assert not out.isnan().any() and not out.isposinf().any(), (penalty, out)
        assert out[0, 2:].tolist() == [1.0, 0.5]  # unseen tokens untouched


def test_no_logits_make_the_sampler_leave_the_vocabulary():
    vocab = 50
    rows = {
        "nan": torch.full((vocab,), float("nan")),
        "+inf": torch.zeros(vocab).index_fill_(0, torch.tensor([3, 17]), float("inf")),
        "-inf": torch.full((vocab,), float("-inf")),  # every token masked
        "mixed": torch.randn(vocab).index_fill_(0, torch.tensor([5]), float("nan")),
        "huge": torch.full((vocab,), torch.finfo(torch.float32).max),
    }
    sampler = Sampler(torch.device("cpu"), seed=0)
    for name, row in rows.items():
        for params in ({"temperature": 1.0}, {"temperature": 0.0}, {"temperature": 1e-5, "top_p": 0.5},
                       {"temperature": 2.0, "top_k": 3, "min_p": 0.5}, {"repetition_penalty": 1e-300}):
            seqs = [seq_with([1, 2], **params) for _ in range(3)]
            tokens, _ = sampler.sample(row.repeat(3, 1), seqs)
            assert all(0 <= t < vocab for t in tokens), (name, params, tokens)
    tokens, _ = sampler.sample(rows["+inf"].repeat(64, 1), [seq_with([], temperature=1.0) for _ in range(64)])
    assert set(tokens) == {3, 17}  # infinities share the row's mass

