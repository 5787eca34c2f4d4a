"""Decode steps through the CUDA-graph buffers (engine/cuda_graphs.py), checked on CPU: the same static
buffers, bucket padding and scratch block a captured graph reads, run uncaptured with the C++ decode
attention (the Triton kernel's signature). Greedy tokens equal HF's; tests/engine/test_gpu.py captures
and replays the graphs on CUDA."""

from __future__ import annotations

import pytest

from engine.cuda_graphs import bucket_sizes
from engine.loader import load_model
from launch import EngineConfig, build_engine
from tests.engine.test_gpu import GREEDY, hf_model
from tests.engine.test_reference import generate_greedy, prompts
from tests.helpers import assert_all_blocks_free, run_to_completion


def test_bucket_sizes_cover_every_batch_with_less_than_half_of_it_padding():
    sizes = bucket_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    for n in range(1, 257):
        bucket = next(b for b in sizes if b >= n)
        assert bucket < 2 * n
    assert bucket_sizes(5) == [1, 2, 4, 5]


def graphed_engine(path, kernels, max_batch: int):
    engine = build_engine(load_model(str(path), dtype="float32"),
                          EngineConfig(max_num_batched_tokens=24, cpu_kernels=False), num_blocks=128)
    assert engine.runner.capture_graphs(max_batch, 512, kernels.paged_decode_attention) is None
    return engine


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_graphed_decode_steps_match_hf(tiny_models, kernels, family):
    """Seven prompts in buckets of up to 8 rows (padded steps of 7, then fewer as they finish; chunked
    prefills beside them run eagerly), then again as prefix hits: HF's tokens each time; the scratch
    block is never handed out, so padding rows never touch a sequence's cache."""
    engine = graphed_engine(tiny_models[family], kernels, max_batch=8)
    graphs = engine.runner.graphs
    batch = prompts(7, 300)
    model = hf_model(tiny_models[family], "cpu", "float32")
    expected = [generate_greedy(model, p, GREEDY.max_tokens) for p in batch]
    assert run_to_completion(engine, batch, GREEDY) == expected
    replays = graphs.replays
    assert replays >= GREEDY.max_tokens - 1  # the decode steps ran through the buffers
    assert run_to_completion(engine, batch, GREEDY) == expected
    assert graphs.replays > replays
    assert engine.stats().num_graph_steps == graphs.replays  # galley_engine_graph_steps_total
    assert engine.runner.scratch_block == engine.scheduler.kv.num_blocks  # past every block the scheduler owns
    assert_all_blocks_free(engine.scheduler.kv)


def test_graphed_gemma3_with_sliding_layers_matches_hf(generic_models, kernels):
    """Gemma 3's sliding-window layers take the window per layer from the same static metadata."""
    engine = graphed_engine(generic_models["gemma3"], kernels, max_batch=8)
    batch = prompts(5, 300)  # longer than the window of 8
    model = hf_model(generic_models["gemma3"], "cpu", "float32")
    assert run_to_completion(engine, batch, GREEDY) == [generate_greedy(model, p, GREEDY.max_tokens) for p in batch]
    assert engine.runner.graphs.replays >= GREEDY.max_tokens - 1


def test_speculative_drafts_run_through_the_graph_buffers(tiny_models, kernels):
    """A decode with n-gram drafts is 1 + drafts decode rows, each over the cache up to itself: graphable
    like any decode rows. Greedy and seeded outputs equal the same engine's without graphs."""
    from tests.engine.test_speculative import NGRAM, SEEDED, repeating_prompts, run

    batch = repeating_prompts(4, seed=21)
    outputs = []
    for graphed in (False, True):
        engine = build_engine(load_model(str(tiny_models["llama"]), dtype="float32"),
                              EngineConfig(cpu_kernels=False, speculative=NGRAM), num_blocks=128)
        if graphed:
            assert engine.runner.capture_graphs(16, 512, kernels.paged_decode_attention) is None
        outputs.append([o.token_ids for o in run(engine, batch, [GREEDY, SEEDED] * 2)])
        assert engine.num_draft_tokens > 0
    assert engine.runner.graphs.replays > 0 and outputs[0] == outputs[1]


def test_a_step_wider_than_the_largest_bucket_runs_eagerly(tiny_models, kernels):
    engine = graphed_engine(tiny_models["llama"], kernels, max_batch=2)
    batch = prompts(5, 300)
    model = hf_model(tiny_models["llama"], "cpu", "float32")
    assert run_to_completion(engine, batch, GREEDY) == [generate_greedy(model, p, GREEDY.max_tokens) for p in batch]


def test_models_the_graphs_cannot_run_are_named(generic_models, kernels):
    engine = build_engine(load_model(str(generic_models["mixtral"]), dtype="float32"),
                          EngineConfig(cpu_kernels=False), num_blocks=16)
    assert "not a dense native decoder" in engine.runner.capture_graphs(4, 64, kernels.paged_decode_attention)
    assert engine.runner.capture_graphs(4, 64) == "CUDA graphs need a CUDA device"
