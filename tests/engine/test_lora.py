"""LoRA adapters (engine.lora): greedy output equals PEFT's unmerged model on HF `generate`, for
requests to the base and to several adapters in one batch, chunked, on the native decoder (fused
C++ path and torch path) and on the generic backend; what an adapter does that we cannot compute
is refused, naming it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.loader import load_model
from engine.lora import AdapterError, read_adapter
from engine.types import GenerationRequest, SamplingParams
from launch import EngineConfig, build_engine
from tests.engine.test_reference import generate_greedy, hf_greedy, prompts
from tests.helpers import assert_all_blocks_free
from tests.models import save_lora_adapter

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ATTENTION = ["q_proj", "v_proj"]
EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_models, generic_models, tmp_path_factory) -> dict:
    """Two adapters per base: PEFT's default attention targets, and every linear with rsLoRA and an
    alpha_pattern (per-module scales)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for base, path in (("llama", tiny_models["llama"]), ("gemma3", generic_models["gemma3"]),
                       ("qwen3moe", generic_models["qwen3moe"])):
        every = EVERY_LINEAR if base != "qwen3moe" else ["q_proj", "k_proj", "v_proj", "o_proj"]
        out[base] = (path, {
            "a": save_lora_adapter(path, root / f"{base}-a", ATTENTION, r=4, lora_alpha=32, seed=1),
            "b": save_lora_adapter(path, root / f"{base}-b", every, r=8, lora_alpha=64, seed=2, use_rslora=True,
                                   alpha_pattern={"o_proj": 16}),
        })
    return out


def peft_greedy(base, adapter, prompt: list[int], max_new_tokens: int) -> list[int]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    return generate_greedy(model, prompt, max_new_tokens)


def run_mixed(engine, batch: list[tuple[list[int], str]], max_tokens: int | None = None) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter) in one batch; with `max_tokens`, stopping at EOS too."""
    params = GREEDY if max_tokens is None else SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs: dict[str, list[int]] = {}
    for i, (prompt, adapter) in enumerate(batch):
        engine.add_request(GenerationRequest(f"p{i}", prompt, params, adapter=adapter))
        outputs[f"p{i}"] = []
    while engine.has_work():
        for event in engine.step():
            assert event.error is None, event.error
            outputs[event.request_id].extend(event.token_ids)
    return [outputs[f"p{i}"] for i in range(len(batch))]


@pytest.mark.parametrize("base, cpu_kernels, backend", [
    ("llama", True, "native"), ("llama", False, "native"), ("gemma3", True, "generic"), ("qwen3moe", True, "generic"),
    ("qwen3moe", True, "native"), ("gemma3", True, "native"),
], ids=["native-kernels", "native-torch", "generic-gemma3", "generic-moe", "native-moe", "native-gemma3"])
def test_base_and_adapters_in_one_batch_equal_peft(adapters, base, cpu_kernels, backend):
    path, folders = adapters[base]
    engine = build_engine(load_model(str(path), backend=backend),
                          EngineConfig(max_num_batched_tokens=16, cpu_kernels=cpu_kernels), num_blocks=256)
    for name, folder in folders.items():
        engine.add_adapter(name, read_adapter(str(folder)))
    batch = prompts(6, 300, lengths=[5, 30, 12, 19, 3, 26], seed=4)
    names = ["", "a", "b", "a", "b", ""]  # chunked (prompts over 16 tokens), base and adapters interleaved
    got = run_mixed(engine, list(zip(batch, names)))
    for prompt, name, tokens in zip(batch, names, got):
        want = hf_greedy(path, prompt, 10) if not name else peft_greedy(path, folders[name], prompt, 10)
        assert tokens == want, name
    # each adapter changes the output (a test that an ignored adapter would fail)
    for name in folders:
        assert any(tokens != hf_greedy(path, prompt, 10) for prompt, n, tokens in zip(batch, names, got) if n == name)
    assert_all_blocks_free(engine.scheduler.kv)


def test_prefix_hits_stay_within_their_adapter(adapters):
    """The same prompt under the base and each adapter, then longer ones: every prefix hit reads KV that
    the same adapter (or the base) computed."""
    path, folders = adapters["llama"]
    engine = build_engine(load_model(str(path)), EngineConfig(), num_blocks=64)
    for name, folder in folders.items():
        engine.add_adapter(name, read_adapter(str(folder)))
    [prompt] = prompts(1, 300, lengths=[40], seed=5)
    names = ["", "a", "b"]
    for extra in ([], [7, 8, 9]):
        got = run_mixed(engine, [(prompt + extra, name) for name in names])
        assert got == [hf_greedy(path, prompt + extra, 10)] + [peft_greedy(path, folders[n], prompt + extra, 10)
                                                              for n in names[1:]]
    assert engine.scheduler.kv.num_hit_tokens >= 3 * 32
    assert_all_blocks_free(engine.scheduler.kv)


def test_a_request_for_an_adapter_not_loaded_is_refused_and_removing_one_fails_only_its_requests(adapters):
    path, folders = adapters["llama"]
    engine = build_engine(load_model(str(path)), EngineConfig(), num_blocks=64)
    with pytest.raises(KeyError):
        engine.add_request(GenerationRequest("x", [5, 6, 7], GREEDY, adapter="a"))
    engine.add_adapter("a", read_adapter(str(folders["a"])))
    engine.add_request(GenerationRequest("on-a", [5, 6, 7], GREEDY, adapter="a"))
    engine.add_request(GenerationRequest("on-base", [5, 6, 7], GREEDY))
    engine.step()
    [failed] = engine.remove_adapter("a")
    assert failed.request_id == "on-a" and failed.error is not None
    tokens = []
    while engine.has_work():
        tokens += [t for e in engine.step() for t in e.token_ids]
    assert len(tokens) == 9 and engine.runner.adapters == {} and engine.memory.adapter_bytes == {}
    assert_all_blocks_free(engine.scheduler.kv)


@pytest.mark.parametrize("change, why", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"peft_type": "IA3"}, "only LoRA adapters"),
])
def test_what_we_do_not_compute_is_refused_naming_it(adapters, tmp_path, change, why):
    _, folders = adapters["llama"]
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = json.loads((folders["a"] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (folder / "adapter_model.safetensors").write_bytes((folders["a"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=why):
        read_adapter(str(folder))


def test_pickled_adapters_are_never_loaded(adapters, tmp_path):
    _, folders = adapters["llama"]
    (tmp_path / "adapter_config.json").write_text((folders["a"] / "adapter_config.json").read_text())
    torch.save({}, tmp_path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle, never loaded"):
        read_adapter(str(tmp_path))


def test_an_adapter_of_another_model_does_not_fit(adapters, tiny_models, tmp_path):
    """A Qwen3 adapter (32-wide heads) on the Llama base: refused, naming the module and both shapes."""
    other = save_lora_adapter(tiny_models["qwen3"], tmp_path / "qwen3", ATTENTION)
    path, _ = adapters["llama"]
    engine = build_engine(load_model(str(path)), EngineConfig(), num_blocks=16)
    with pytest.raises(AdapterError, match="trained for another model"):
        engine.add_adapter("other", read_adapter(str(other)))
    embedding = save_lora_adapter(path, tmp_path / "embed", ["embed_tokens"])
    with pytest.raises(AdapterError, match="embedding"):
        read_adapter(str(embedding))
    assert engine.runner.adapters == {}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_layer_op_adds_adapters_as_the_per_op_path(tiny_models, kernels, family):
    """The C++ layer op adds a step's adapter deltas where the per-op path does (q/k/v before the norms and
    rotary, o, and an adapted MLP's gate/up and down): the same logits and cache, bit for bit, for two
    adapters on their own rows of a step of decodes and prefill chunks, beside rows of the base."""
    from engine.attention import build_metadata
    from engine.lora import LoraAdapter, LoraStep, PeftAdapter
    from tests.engine.test_fast_paths import CountingKernels, mixed_step

    model = load_model(str(tiny_models[family]), dtype="float32").model
    s, block_size, num_blocks = model.shape, 4, 64
    torch.manual_seed(0)
    h, q, kv, inter = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
             "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    parts = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}

    def adapter(name: str, targets: list[str], rank: int) -> LoraAdapter:
        modules = {f"model.layers.{i}.{kind}.{t}": (torch.randn(rank, sizes[t][0]), torch.randn(sizes[t][1], rank), 0.5)
                   for i in range(s.num_layers) for kind, names in parts.items() for t in names if t in targets}
        return LoraAdapter(name, model.lora_weights(PeftAdapter(tiny_models[family], modules, ""), torch.device("cpu"),
                                                    torch.float32))

    caches, decodes, chunks, positions, slots, input_ids = mixed_step(s, block_size, num_blocks)
    logits_at = torch.tensor([0, 1, 2, 3 + 13 - 1, len(slots) - 1])
    # decodes 0-1 and the first chunk: attention only; decode 2 and the second chunk: every linear
    lora = LoraStep([(adapter("a", ["q_proj", "v_proj"], 4), [(0, 2), (3, 16)]),
                     (adapter("b", list(sizes), 8), [(2, 3), (16, 25)])])
    results = []
    for fused in (False, True):
        model.fused, counting = fused, CountingKernels(kernels, "decoder_layer")
        meta = build_metadata(decodes, chunks, slots, block_size, None, torch.device("cpu"), counting)
        cache = [(k.clone(), v.clone()) for k, v in caches]
        with torch.inference_mode():
            logits = model(input_ids, torch.tensor(positions), cache, meta, logits_at, lora=lora)
            base = model(input_ids, torch.tensor(positions), [(k.clone(), v.clone()) for k, v in caches], meta,
                         logits_at)
        assert counting.calls == (2 * s.num_layers if fused else 0)
        assert not torch.equal(logits[:3], base[:3]) and not torch.equal(logits[4], base[4])  # the deltas count
        results.append((logits, cache))
    (expected, expected_cache), (got, got_cache) = results
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for pair, other in zip(got_cache, expected_cache) for a, b in zip(pair, other))


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 33])
@pytest.mark.parametrize("ranks, widths", [([16], [576]), ([4, 8, 1], [64, 97, 9]), ([5, 17], [130, 70]), ([3], [7])],
                         ids=["one", "qkv-like", "gate-up-like", "narrow"])
def test_lora_kernel_matches_torch(kernels, rows, ranks, widths):
    """The C++ `lora_add` against the torch path on a fused linear's parts (ranks and widths off the
    vector and chunk sizes, a column gap between parts); a row's delta does not depend on its batch."""
    from engine.lora import LoraAdapter, LoraStep, stack_parts

    torch.manual_seed(0)
    in_features, columns, parts = 83, 0, []
    for rank, width in zip(ranks, widths):
        parts.append((slice(columns + 2, columns + 2 + width), torch.randn(rank, in_features),
                      torch.randn(width, rank), 0.5))
        columns += 2 + width
    weights = stack_parts(parts, torch.device("cpu"), torch.float32)
    step = LoraStep([(LoraAdapter("a", {"0.x": weights}), [(2, 2 + rows)])])
    x, out = torch.randn(rows + 4, in_features), torch.randn(rows + 4, columns)
    want = step.add(out.clone(), x, "0.x")
    got = step.add(out.clone(), x, "0.x", kernels)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 sums in another order
    assert torch.equal(got[:2], out[:2]) and torch.equal(got[2 + rows:], out[2 + rows:])  # other rows untouched
    for row in range(rows):  # each row alone, as in a step of one
        alone = LoraStep([(LoraAdapter("a", {"0.x": weights}), [(0, 1)])]).add(out[2 + row:3 + row].clone(),
                                                                              x[2 + row:3 + row], "0.x", kernels)
        assert torch.equal(alone[0], got[2 + row])
