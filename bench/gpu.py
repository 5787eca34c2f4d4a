"""The engine on one GPU against HF `generate` on the same GPU and against the card's memory bandwidth.

Random-weight Llama models of two real shapes (SmolLM2-135M and Llama-3-8B), built on the device in
bfloat16, saved once to a temp folder (our loader reads folders) and kept in memory as the HF
baseline. Per shape: the in-process engine with one stream and with N streams (prefill and decode
timed apart: TTFT, inter-token latency p50/p99), its decode steps replayed from CUDA graphs and
again op by op, and HF `generate` (dynamic cache) with one stream
and on a static batch of N. The single stream is also given as a fraction of the bandwidth limit:
tokens/s if every decode step read the weights once at the measured device-to-device copy rate.

Results are written to `--json` after each shape, so a run cut short keeps what it measured.

    python bench/gpu.py --json out.json                 # on a CUDA machine: small, then 8b
    python bench/gpu.py --cpu --json out.json           # a tiny shape in float32 on CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/gpu.py`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import build_tokenizer  # noqa: E402

from engine.loader import load_model  # noqa: E402
from engine.types import GenerationRequest, SamplingParams  # noqa: E402
from launch import EngineConfig, build_engine  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
    "small": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536, vocab_size=49152),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s a device-to-device copy moves, reads and writes counted (the decode step's weights are
    read once each: this is the rate it can read at best)."""
    src = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * n / (time.perf_counter() - start)


def build(shape: str, device: torch.device, dtype: torch.dtype, out: Path) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=shape != "8b",
                         eos_token_id=0, pad_token_id=0, bos_token_id=None, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):  # built in its dtype: the 8B shape in float32 first would take 32 GB
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    model.save_pretrained(out)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    return model


def engine_run(engine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"{tag}{i}", prompt, params))
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.token_ids:
                first.setdefault(event.request_id, now - start)
                stamps.setdefault(event.request_id, []).append(now)
                outputs.setdefault(event.request_id, []).extend(event.token_ids)
    wall = time.perf_counter() - start
    gaps = [b - a for times in stamps.values() for a, b in zip(times, times[1:])]
    return {"tok_s": sum(map(len, outputs.values())) / wall, "wall_s": wall,
            "ttft_ms": 1000 * statistics.mean(first.values()),
            "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
            "itl_p99_ms": 1000 * sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else None,
            "outputs": [outputs[f"{tag}{i}"] for i in range(len(prompts))]}


@torch.inference_mode()
def hf_run(model, prompts: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(prompts, device=model.device)  # one length: no padding
    sync(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                         eos_token_id=None, do_sample=False, pad_token_id=0)  # as ignore_eos: no stop, no mask
    sync(model.device)
    wall = time.perf_counter() - start
    return {"tok_s": out[:, ids.shape[1]:].numel() / wall, "wall_s": wall, "outputs": out[:, ids.shape[1]:].tolist()}


def measure(shape: str, args, device: torch.device, dtype: torch.dtype, bandwidth: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        hf = build(shape, device, dtype, Path(tmp))
        weights = sum(p.numel() * p.element_size() for p in hf.parameters())
        loaded = load_model(tmp, device=str(device), dtype=str(dtype).removeprefix("torch."))
        engine = build_engine(loaded, EngineConfig(max_num_seqs=args.streams, max_num_batched_tokens=8192))
        build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, SHAPES[shape]["vocab_size"], (args.streams, args.prompt_len), generator=gen).tolist()
    engine_run(engine, prompts, 4, "warm")  # every shape the runs below meet (the 64-prompt prefill too), once
    hf_run(hf, prompts[:1], 4)
    one = engine_run(engine, prompts[:1], args.output_len, "one")
    many = engine_run(engine, prompts, args.output_len, "many")
    graphs, engine.runner.graphs = engine.runner.graphs, None  # the same engine op by op, to see what graphs buy
    eager_one = engine_run(engine, prompts[:1], args.output_len, "eager-one")
    eager_many = engine_run(engine, prompts, args.output_len, "eager-many")
    engine.runner.graphs = graphs
    hf_one, hf_many = hf_run(hf, prompts[:1], args.output_len), hf_run(hf, prompts, args.output_len)
    limit = bandwidth / weights  # decode steps/s if each read every weight once at the copy rate
    decode_tok_s = 1000 / one["itl_p50_ms"] if one["itl_p50_ms"] else None
    row = {
        "shape": shape, "dtype": str(dtype), "weights_gb": weights / 1e9, "build_and_load_s": build_s,
        "engine_1": {k: v for k, v in one.items() if k != "outputs"},
        f"engine_{args.streams}": {k: v for k, v in many.items() if k != "outputs"},
        "cuda_graphs": graphs.sizes if graphs is not None else None,
        "engine_1_eager": {k: v for k, v in eager_one.items() if k != "outputs"},
        f"engine_{args.streams}_eager": {k: v for k, v in eager_many.items() if k != "outputs"},
        "hf_1": {k: v for k, v in hf_one.items() if k != "outputs"},
        f"hf_{args.streams}": {k: v for k, v in hf_many.items() if k != "outputs"},
        "bandwidth_limit_tok_s": limit,
        "single_stream_decode_fraction_of_limit": decode_tok_s / limit if decode_tok_s else None,
        f"engine_{args.streams}_over_hf_batch": many["tok_s"] / hf_many["tok_s"],
        "graphs_equal_eager": one["outputs"] == eager_one["outputs"] and many["outputs"] == eager_many["outputs"],
        "greedy_equals_hf_one": one["outputs"] == hf_one["outputs"],
        "greedy_equals_hf_batch": many["outputs"] == hf_many["outputs"],
    }
    del engine, loaded, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the tiny shape in float32 on CPU (checks the script)")
    parser.add_argument("--shapes", default=None, help="comma list of tiny, small, 8b (default: small,8b; tiny on CPU)")
    parser.add_argument("--streams", type=int, default=None, help="default 64 (4 on CPU)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    shapes = (args.shapes or ("tiny" if args.cpu else "small,8b")).split(",")
    args.streams = args.streams or (4 if args.cpu else 64)
    if args.cpu:
        args.prompt_len, args.output_len = min(args.prompt_len, 16), min(args.output_len, 8)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
              "copy_bandwidth_gb_s": copy_bandwidth(device) / 1e9, "shapes": []}
    for shape in shapes:
        row = measure(shape, args, device, dtype, report["copy_bandwidth_gb_s"] * 1e9)
        report["shapes"].append(row)
        args.json.write_text(json.dumps(report, indent=1))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
