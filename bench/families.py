"""Output tokens/s per model family: the generic backend, the native decoder where the family has
one, and HF `generate` on the same weights, side by side in one run (in-process, no HTTP).

Each family is a seeded random-weight model of about SmolLM2-135M's size (hidden 576, 9 heads of
64, 3 KV heads; mixtures of experts with 8 experts of 384, 2 per token), built from its
transformers config. Workloads: one stream, and 32 streams at once; P-token random prompts, O
greedy output tokens, EOS ignored. HF `generate` runs the 32 prompts one at a time (what a
server without continuous batching does; a subset, extrapolated) and as one static batch.

    python bench/families.py --quick
    python bench/families.py --families llama,gemma3,qwen3moe --json bench/results/families.json
    python bench/families.py --families qwen3moe,mixtral --experts eager   # transformers' per-expert loop

`--experts` picks transformers' experts implementation for the mixtures of experts, in the engine
and in HF alike: `grouped_mm` (transformers' default where torch has it: one grouped GEMM per
projection over the tokens sorted by expert) or `eager` (a Python loop over the experts hit).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/families.py`

from engine.loader import load_model  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
             vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
MOE = dict(moe_intermediate_size=384, num_experts_per_tok=2)
# family -> (config class, overrides, has a native decoder)
FAMILIES: dict[str, tuple[str, dict, bool]] = {
    "llama": ("LlamaConfig", {}, True),
    "qwen3": ("Qwen3Config", {}, True),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=512, query_pre_attn_scalar=64), True),
    "phi3": ("Phi3Config", dict(pad_token_id=0), True),
    "olmo2": ("Olmo2Config", {}, False),
    "qwen3moe": ("Qwen3MoeConfig", dict(MOE, num_experts=8), True),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=384), True),
}


def save_family(family: str, num_layers: int, out: Path) -> Path:
    config_class, overrides, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, "num_hidden_layers": num_layers, **overrides})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "models" / "demo").save_pretrained(
        out)  # any tokenizer: prompts are token ids and EOS is ignored
    return out


EXPERTS: str | None = None  # --experts: transformers' experts implementation for MoE models (None: its default)


def engine_tok_s(path: Path, backend: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    loaded = load_model(str(path), backend=backend)
    if EXPERTS and backend == "generic" and loaded.model.hf._can_set_experts_implementation():
        loaded.model.hf.set_experts_implementation(EXPERTS)
    engine = build_engine(loaded, EngineConfig(max_num_seqs=len(prompts)), num_blocks=4096)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def run(batch: list[list[int]], tag: str) -> list[list[int]]:
        outputs: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(batch))}
        for i, prompt in enumerate(batch):
            engine.add_request(GenerationRequest(f"{tag}{i}", prompt, params))
        while engine.has_work():
            for event in engine.step():
                outputs[event.request_id].extend(event.token_ids)
        return list(outputs.values())

    run([p[:8] for p in prompts[:2]], "warm")
    start = time.perf_counter()
    outputs = run(prompts, "run")
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


@torch.inference_mode()
def hf_tok_s(path: Path, prompts: list[list[int]], output_len: int, batched: bool) -> tuple[float, list[list[int]]]:
    kwargs = {"experts_implementation": EXPERTS} if EXPERTS else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()

    def generate(batch: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(batch)  # prompts of one length: no padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             eos_token_id=None, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    generate([prompts[0][:8]])
    start = time.perf_counter()
    outputs = generate(prompts) if batched else [generate([p])[0] for p in prompts]
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--hf-sequential", type=int, default=4, help="prompts HF runs one at a time (extrapolated)")
    parser.add_argument("--quick", action="store_true", help="8 layers, 32 tokens in and out")
    parser.add_argument("--experts", choices=("grouped_mm", "eager"), help="MoE experts implementation (default: "
                        "transformers' own choice)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global EXPERTS
    EXPERTS = args.experts
    if args.quick:
        args.layers, args.prompt_len, args.output_len = 8, 32, 32
    torch.set_num_threads(torch.get_num_threads())
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 40000, (args.streams, args.prompt_len), generator=gen).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = save_family(family, args.layers, Path(tmp) / family)
            row: dict = {"family": family}
            backends = ["generic", "native"] if FAMILIES[family][2] else ["generic"]
            for backend in backends:
                row[f"{backend}_1"], single = engine_tok_s(path, backend, prompts[:1], args.output_len)
                row[f"{backend}_{args.streams}"], many = engine_tok_s(path, backend, prompts, args.output_len)
                row.setdefault("outputs", many)
                row[f"{backend}_equal"] = many == row["outputs"]
            row["hf_sequential"], seq = hf_tok_s(path, prompts[: args.hf_sequential], args.output_len, batched=False)
            row["hf_batch"], batch = hf_tok_s(path, prompts, args.output_len, batched=True)
            row["greedy_equals_hf"] = row.pop("outputs") == batch and many[: len(seq)] == seq
            rows.append(row)
            print(json.dumps(row), flush=True)
    n = args.streams
    print(f"\n| family | generic 1 | native 1 | generic {n} | native {n} | HF one at a time | HF batch of {n} | "
          f"generic {n} / HF one at a time | generic / native ({n}) | greedy == HF |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        native_1, native_n = r.get("native_1"), r.get(f"native_{n}")
        print(f"| {r['family']} | {r['generic_1']:.0f} | {native_1 or 0:.0f} | {r[f'generic_{n}']:.0f} | "
              f"{native_n or 0:.0f} | {r['hf_sequential']:.0f} | {r['hf_batch']:.0f} | "
              f"{r[f'generic_{n}'] / r['hf_sequential']:.1f}x | "
              f"{(r[f'generic_{n}'] / native_n) if native_n else float('nan'):.2f} | {r['greedy_equals_hf']} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
