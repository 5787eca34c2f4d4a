"""Automatic prefix caching: the pool's bookkeeping, and greedy tokens equal to HF `generate`
whenever a request reuses cached KV (shared prefixes, a conversation's next turn, preemption,
eviction, chunked prefill, a sliding window)."""

from __future__ import annotations

import pytest
import torch

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager
from engine.prefix_hash import prefix_hashes
from engine.types import GenerationRequest, SamplingParams, Sequence
from tests.engine.test_reference import GREEDY, hf_greedy, prompts
from tests.helpers import assert_all_blocks_free, make_engine, run_to_completion
from tests.models import FAMILIES, build_tokenizer, model_for


def seq_of(tokens: list[int], salt: str = "") -> Sequence:
    return Sequence(GenerationRequest(f"s{id(tokens)}-{len(tokens)}", tokens, GREEDY, cache_salt=salt))


# ---- hashes and the pool -------------------------------------------------------------------


def test_hash_chain_names_a_block_by_everything_before_it():
    a = prefix_hashes(list(range(12)), 4, "")
    assert len(a) == 3
    assert prefix_hashes(list(range(10)), 4, "") == a[:2]  # partial last block: not hashed
    changed_first = prefix_hashes([99, *range(1, 12)], 4, "")
    assert not set(changed_first) & set(a)  # a change in block 0 changes every later hash
    changed_last = prefix_hashes([*range(11), 99], 4, "")
    assert changed_last[:2] == a[:2] and changed_last[2] != a[2]
    assert not set(prefix_hashes(list(range(12)), 4, "tenant-b")) & set(a)  # salts never share


def test_freed_cached_blocks_stay_findable_and_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    first, second = pool.allocate(1), pool.allocate(1)
    pool.cache(first[0], b"h1")
    pool.cache(second[0], b"h2")
    pool.free(first, now=1.0)
    pool.free(second, now=2.0)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.lookup([b"h1", b"h2"]) == first + second
    assert pool.allocate(2) == [2, 3]  # empty blocks go before cached ones
    assert pool.allocate(1) == first  # then the least recently freed cached block, which is forgotten
    assert pool.lookup([b"h1"]) == [] and pool.lookup([b"h2"]) == second


def test_acquired_blocks_are_shared_and_never_evicted_while_held():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, b"h")
    pool.acquire([block])  # a second request reuses it while the first still holds it
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_free_blocks == 1  # still held once: not free, not evictable
    assert pool.allocate(1) != [block]
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.lookup([b"h"]) == [block]
    pool.acquire([block])  # reused from the free list: out of eviction's reach again
    assert pool.num_free_blocks == 0 and pool.ref_count(block) == 1  # the other block is held too
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


def test_a_prefix_computed_twice_keeps_the_first_copy():
    pool = BlockPool(2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a[0], b"h")
    pool.cache(b[0], b"h")
    pool.free(a + b)
    assert pool.lookup([b"h"]) == a and pool.num_cached_blocks == 1


def test_idle_cached_blocks_are_forgotten():
    pool = BlockPool(2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a[0], b"old")
    pool.cache(b[0], b"new")
    pool.free(a, now=10.0)
    pool.free(b, now=20.0)
    assert pool.evict_idle(freed_before=15.0) == 1
    assert pool.lookup([b"old"]) == [] and pool.lookup([b"new"]) == b
    assert pool.num_free_blocks == 2


def test_reuse_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = seq_of(list(range(1, 13)))  # 3 full blocks
    kv.allocate(first, 12)
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first)
    kv.free(first)
    same = seq_of(list(range(1, 13)))  # whole prompt cached: the last block is computed again
    assert kv.reuse_prefix(same) == 8 and same.block_table == first_blocks(kv, 2)
    longer = seq_of(list(range(1, 16)))
    assert kv.reuse_prefix(longer) == 12  # 3 cached blocks, 3 tokens to prefill
    other_tenant = seq_of(list(range(1, 16)), salt="b")
    assert kv.reuse_prefix(other_tenant) == 0
    for seq in (same, longer):
        kv.free(seq)
    assert_all_blocks_free(kv)


def test_a_hit_never_ends_inside_a_span_that_attends_both_ways_nor_does_a_chunk():
    """Tokens of a bidirectional span saw the rest of their span: a hit that ends inside one stops
    at the block before it, and a chunk that would end inside one ends before it or takes all of it."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = seq_of(list(range(1, 17)))  # 4 full blocks, all cached
    kv.allocate(first, 16)
    first.num_computed_tokens = 16
    kv.cache_full_blocks(first)
    kv.free(first)
    for spans, hit in ((((6, 14),), 16), (((10, 20),), 8), (((0, 17),), 0), (((16, 17),), 16), (((12, 17),), 12)):
        seq = seq_of(list(range(1, 18)))
        seq.bidirectional_spans = spans
        assert kv.reuse_prefix(seq) == hit, spans  # the plain hit: 16 tokens, ending past or inside the span
        kv.free(seq)
    assert_all_blocks_free(kv)
    seq = seq_of(list(range(1, 30)))
    seq.bidirectional_spans = ((6, 14), (20, 24))
    seq.num_computed_tokens = 2
    assert [seq.chunk_len(budget) for budget in (3, 4, 8, 13, 20, 30)] == [3, 4, 4, 13, 18, 27]
    seq.num_computed_tokens = 6  # at the span's start: all of it, over the budget
    assert [seq.chunk_len(budget) for budget in (1, 8, 10)] == [8, 8, 10]


def first_blocks(kv: KVCacheManager, n: int) -> list[int]:
    return kv.pool.lookup(prefix_hashes(list(range(1, 13)), 4, ""))[:n]


# ---- greedy tokens equal HF with prefix hits ----------------------------------------------------


def run_one(engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return run_to_completion(engine, [prompt], params)[0]


def hits(engine) -> int:
    return engine.scheduler.kv.num_hit_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefix_partial_and_exact_block_match_hf(tiny_models, family):
    path = tiny_models[family]
    engine = make_engine(path)
    [base] = prompts(1, 300, lengths=[32], seed=1)  # exactly two blocks of 16
    [tail] = prompts(1, 300, lengths=[9], seed=2)
    assert run_one(engine, base) == hf_greedy(path, base, 16)
    assert hits(engine) == 0
    cases = [
        base[:20] + tail,  # shares one full block and part of the next
        base + tail,  # shares exactly two blocks
        base,  # the whole prompt cached: its last block is computed again
    ]
    for prompt in cases:
        before = hits(engine)
        assert run_one(engine, prompt) == hf_greedy(path, prompt, 16)
        assert hits(engine) > before
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_next_turn_reuses_the_previous_turns_prompt_and_answer(tiny_models, family):
    path = tiny_models[family]
    engine = make_engine(path)
    [history] = prompts(1, 300, lengths=[21], seed=3)
    computed = 0  # tokens whose KV the previous turn computed: its prompt and answer but the last token
    for turn in range(4):
        before = hits(engine)
        answer = run_one(engine, history)
        assert answer == hf_greedy(path, history, 16)
        assert hits(engine) - before == computed // 16 * 16
        computed = len(history) + len(answer) - 1
        history = history + answer + prompts(1, 300, lengths=[7], seed=10 + turn)[0]
    assert_all_blocks_free(engine.scheduler.kv)


def test_requests_sharing_a_prompt_together_compute_it_once_in_one_step(tiny_models):
    """The first computes the 48 shared tokens; the others read those blocks in the same step
    (each layer writes all K/V before attending), so all four sample their first token at once."""
    path = tiny_models["qwen2"]
    engine = make_engine(path)
    [system] = prompts(1, 300, lengths=[48], seed=4)
    batch = [system + own for own in prompts(4, 300, lengths=[5, 9, 3, 12], seed=5)]
    for i, prompt in enumerate(batch):
        engine.add_request(GenerationRequest(f"p{i}", prompt, GREEDY))
    first = engine.step()
    assert sorted(event.request_id for event in first) == ["p0", "p1", "p2", "p3"]
    assert engine.scheduler.kv.num_hit_tokens == 3 * 48
    ours = {event.request_id: list(event.token_ids) for event in first}
    while engine.has_work():
        for event in engine.step():
            ours[event.request_id].extend(event.token_ids)
    assert [ours[f"p{i}"] for i in range(4)] == [hf_greedy(path, p, 16) for p in batch]
    assert engine.scheduler.kv.num_query_tokens == sum(map(len, batch))
    assert_all_blocks_free(engine.scheduler.kv)


def test_a_reader_of_blocks_computed_this_step_stays_correct_when_chunked(tiny_models):
    """A budget that ends inside the shared prompt: later requests take only the blocks computed
    so far, then compute on from there; every output still equals HF."""
    path = tiny_models["llama"]
    engine = make_engine(path, max_num_batched_tokens=40)
    [system] = prompts(1, 300, lengths=[50], seed=18)
    batch = [system + own for own in prompts(3, 300, lengths=[4, 20, 7], seed=19)]
    assert run_to_completion(engine, batch, GREEDY) == [hf_greedy(path, p, 16) for p in batch]
    assert hits(engine) > 0
    assert_all_blocks_free(engine.scheduler.kv)


def test_n_choices_of_one_prompt_share_its_prefill(tiny_models):
    path = tiny_models["llama"]
    engine = make_engine(path)
    [prompt] = prompts(1, 300, lengths=[40], seed=6)
    ours = run_to_completion(engine, [prompt] * 3, GREEDY)
    assert ours == [hf_greedy(path, prompt, 16)] * 3
    assert hits(engine) == 2 * 32


def test_tenants_do_not_share_cached_prefixes(tiny_models):
    engine = make_engine(tiny_models["llama"])
    [prompt] = prompts(1, 300, lengths=[40], seed=7)
    for tenant in ("a", "b"):
        engine.add_request(GenerationRequest(tenant, prompt, GREEDY, cache_salt=tenant))
        while engine.has_work():
            engine.step()
    assert hits(engine) == 0
    engine.add_request(GenerationRequest("a-again", prompt, GREEDY, cache_salt="a"))
    while engine.has_work():
        engine.step()
    assert hits(engine) == 32


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_hits_under_preemption_match_hf(tiny_models, family):
    path = tiny_models[family]
    engine = make_engine(path, num_blocks=10)  # too small for all of them: preemption must happen
    [system] = prompts(1, 300, lengths=[32], seed=8)
    batch = [system + own for own in prompts(6, 300, lengths=[6, 12, 3, 9, 14, 1], seed=9)]
    ours = run_to_completion(engine, batch, GREEDY)
    assert engine.scheduler.num_preemptions > 0 and hits(engine) > 0
    assert ours == [hf_greedy(path, p, 16) for p in batch]
    assert_all_blocks_free(engine.scheduler.kv)


def test_after_eviction_the_prefix_is_recomputed_correctly(tiny_models):
    path = tiny_models["llama"]
    engine = make_engine(path, num_blocks=6)
    [first] = prompts(1, 300, lengths=[40], seed=11)
    assert run_one(engine, first) == hf_greedy(path, first, 16)
    kv = engine.scheduler.kv
    for other in prompts(2, 300, lengths=[60, 60], seed=12):  # needs every block: evicts `first`'s
        run_one(engine, other)
    assert kv.pool.lookup(prefix_hashes(first, 16, "")) == []
    before = hits(engine)
    assert run_one(engine, first) == hf_greedy(path, first, 16)
    assert hits(engine) == before
    assert_all_blocks_free(kv)


def test_chunked_prefill_after_a_hit_matches_hf(tiny_models):
    path = tiny_models["qwen3"]
    engine = make_engine(path, max_num_batched_tokens=7)
    [base] = prompts(1, 300, lengths=[35], seed=13)
    run_one(engine, base)
    prompt = base + prompts(1, 300, lengths=[30], seed=14)[0]
    assert run_one(engine, prompt) == hf_greedy(path, prompt, 16)
    assert hits(engine) == 32


def test_sliding_window_model_with_hits_matches_hf(tmp_path):
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = model_for("mistral", len(tokenizer), sliding_window=24)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = make_engine(tmp_path)
    [base] = prompts(1, 300, lengths=[50], seed=15)
    run_one(engine, base)
    prompt = base + prompts(1, 300, lengths=[10], seed=16)[0]
    assert run_one(engine, prompt) == hf_greedy(tmp_path, prompt, 16)
    assert hits(engine) == 48


def test_prefix_caching_off_never_hits(tiny_models):
    from engine.model_runner import CacheConfig

    path = tiny_models["llama"]
    engine = make_engine(path, cache=CacheConfig(enable_prefix_caching=False))
    [prompt] = prompts(1, 300, lengths=[40], seed=17)
    assert run_one(engine, prompt) == run_one(engine, prompt) == hf_greedy(path, prompt, 16)
    assert hits(engine) == 0 and engine.scheduler.kv.pool.num_cached_blocks == 0
