"""What serving LoRA adapters costs: output tokens/s of the base model alone, of one adapter, and of
several adapters and the base mixed in one batch, on one engine, side by side in one run (in-process,
no HTTP); and HF `generate` with PEFT's unmerged adapter one request at a time on the same weights
(what a server without multi-adapter batching does), whose greedy tokens ours must equal.

A seeded random Llama of SmolLM2-135M's shape (30 layers, hidden 576); adapters are random PEFT LoRA
adapters of rank R on all seven linears of every layer. Workloads: one stream, and S streams at once
(round-robin over the adapters in the mixed case); P-token random prompts, O greedy tokens.

    python bench/lora.py --quick
    python bench/lora.py --json bench/results/lora.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/lora.py`

from bench.families import save_family  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.lora import read_adapter  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=LINEARS, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():  # small deltas: a trained adapter's size, not a random one's
        if "lora_B" in name:
            param.data.mul_(0.05)
    peft_model.save_pretrained(out)
    return out


def engine_tok_s(engine, prompts: list[list[int]], adapters: list[str], output_len: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        outputs[f"r{i}-{start}"] = []
        engine.add_request(GenerationRequest(f"r{i}-{start}", prompt, params, adapter=adapter))
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id].extend(event.token_ids)
    return sum(map(len, outputs.values())) / (time.perf_counter() - start), list(outputs.values())


@torch.inference_mode()
def peft_tok_s(base: Path, adapter: Path, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()

    def generate(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             eos_token_id=None, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    generate(prompts[0][:8])
    start = time.perf_counter()
    outputs = [generate(p) for p in prompts]
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8, help="adapters in the mixed workload (with the base)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--peft-sequential", type=int, default=2, help="prompts HF+PEFT runs one at a time")
    parser.add_argument("--repeats", type=int, default=2, help="the engine workloads, interleaved, this many times")
    parser.add_argument("--quick", action="store_true", help="8 layers, 32 tokens in and out")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.prompt_len, args.output_len = 8, 32, 32
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 40000, (args.streams, args.prompt_len), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        base = save_family("llama", args.layers, Path(tmp) / "base")
        folders = [save_adapter(base, Path(tmp) / f"a{i}", args.rank, seed=i + 1) for i in range(args.adapters)]
        engine = build_engine(load_model(str(base)), EngineConfig(max_num_seqs=args.streams), num_blocks=4096)
        for i, folder in enumerate(folders):
            engine.add_adapter(f"a{i}", read_adapter(str(folder)))
        names = [*(f"a{i}" for i in range(args.adapters)), ""]
        workloads = {"base": lambda n: [""] * n, "one adapter": lambda n: ["a0"] * n,
                     "mixed": lambda n: [names[i % len(names)] for i in range(n)]}
        engine_tok_s(engine, [p[:8] for p in prompts[:2]], ["", "a0"], 4)  # warm-up
        results: dict[str, list[float]] = {}
        outputs = {}
        for _ in range(args.repeats):
            for label, assign in workloads.items():
                for n in (1, args.streams):
                    rate, out = engine_tok_s(engine, prompts[:n], assign(n), args.output_len)
                    results.setdefault(f"{label} {n}", []).append(rate)
                    outputs[(label, n)] = out
        peft_rate, peft_out = peft_tok_s(base, folders[0], prompts[: args.peft_sequential], args.output_len)
        equal = outputs[("one adapter", args.streams)][: args.peft_sequential] == peft_out
    best = {key: max(rates) for key, rates in results.items()}
    n = args.streams
    print(f"\n| workload | 1 stream tok/s | {n} streams tok/s | {n} streams / base {n} |")
    print("|---|---|---|---|")
    for label in workloads:
        print(f"| {label} | {best[f'{label} 1']:.0f} | {best[f'{label} {n}']:.0f} | "
              f"{best[f'{label} {n}'] / best[f'base {n}']:.2f} |")
    print(f"| HF + PEFT, one request at a time | {peft_rate:.0f} | | |")
    print(f"\none adapter at {n} streams / HF+PEFT one at a time: {best[f'one adapter {n}'] / peft_rate:.1f}x; "
          f"greedy equals PEFT: {equal}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": results,
                                         "peft_sequential": peft_rate, "greedy_equals_peft": equal}, indent=1))


if __name__ == "__main__":
    main()
