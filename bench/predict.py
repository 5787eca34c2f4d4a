"""Light models at fixed request rates: a tabular model (XGBoost on iris) and an ONNX graph served over the
Open Inference Protocol's REST `infer` (JSON tensors, one row a request) and its gRPC `ModelInfer` (raw
tensor bytes) at 100, 500 and 1000 requests/s on loopback, open loop (requests leave on schedule whether or
not earlier ones have answered): achieved rate, p50 and p99 latency, errors, and the server process's CPU
time per request (steadier than the tail, which swings run to run once client and server near the 2 cores);
beside the same model called in-process one row at a time (the floor).

The client (aiohttp or grpc.aio, one process) shares the 2 cores with the server, so at the higher rates part of
what is measured is the client's own cost; the in-process column has neither HTTP nor batching.

    python bench/predict.py
    python bench/predict.py --rates 100,500 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ modules import each other flat
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import percentile_ms  # noqa: E402
from servers import free_port, start_server, stop_server, wait_ready  # noqa: E402

from engine.predictors import load_predictor  # noqa: E402


def save_models(root: Path) -> dict[str, tuple[Path, str, list]]:
    """name -> (file, kind, one request's input rows)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from sklearn.datasets import load_iris
    from xgboost import XGBClassifier

    x, y = load_iris(return_X_y=True)
    XGBClassifier(n_estimators=50, max_depth=4).fit(x, y).save_model(root / "iris.json")
    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(64, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["p"], axis=1)],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "mlp.onnx")
    return {"iris": (root / "iris.json", "tabular", [x[0].astype(np.float32).tolist()]),
            "mlp": (root / "mlp.onnx", "onnx", [rng.normal(size=16).astype(np.float32).tolist()])}


def in_process(path: Path, kind: str, rows: list, n: int = 2000) -> dict:
    predictor = load_predictor(path, kind)
    spec = predictor.inputs[0]
    request = {spec.name: np.array(rows, dtype=np.float32)}
    latencies = []
    for _ in range(n):
        started = time.perf_counter()
        predictor.run([request])
        latencies.append(time.perf_counter() - started)
    return {"rate": n / sum(latencies), "p50_ms": percentile_ms(latencies, 50), "p99_ms": percentile_ms(latencies, 99)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def open_loop(call, rate: float, seconds: float) -> dict:
    """`call()` (an awaitable that raises on a failed request) `rate` times a second for `seconds`, each
    leaving on schedule whether or not earlier ones have answered: achieved rate, p50, p99, errors."""
    latencies, errors = [], 0

    async def one() -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            await call()
        except Exception:  # a refused or failed request: counted, not timed
            errors += 1
            return
        latencies.append(time.perf_counter() - started)

    tasks, begin = [], time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - begin
    return {"offered": rate, "achieved": len(latencies) / elapsed, "p50_ms": percentile_ms(latencies, 50),
            "p99_ms": percentile_ms(latencies, 99), "errors": errors}


async def at_rate(url: str, name: str, tensor: str, datatype: str, rows: list, rate: float, seconds: float) -> dict:
    body = json.dumps({"inputs": [{"name": tensor, "shape": [len(rows), len(rows[0])], "datatype": datatype,
                                   "data": rows}]})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
        async def call() -> None:
            async with session.post(f"{url}/v2/models/{name}/infer", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                resp.raise_for_status()

        return await open_loop(call, rate, seconds)


async def grpc_at_rate(address: str, name: str, tensor: str, rows: list, rate: float, seconds: float) -> dict:
    import grpc

    from api.oip_grpc import inference_pb2 as pb
    from api.oip_grpc import inference_pb2_grpc

    array = np.array(rows, dtype=np.float32)
    request = pb.ModelInferRequest(model_name=name, raw_input_contents=[array.tobytes()])
    request.inputs.add(name=tensor, datatype="FP32", shape=list(array.shape))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        return await open_loop(lambda: stub.ModelInfer(request), rate, seconds)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,500,1000")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-wait-ms", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = save_models(root)
        config = "".join(f'[[models]]\nname = "{name}"\npath = "{path}"\nkind = "{kind}"\nmax_batch = 64\n'
                         f"max_wait_ms = {args.max_wait_ms}\n\n" for name, (path, kind, _) in models.items())
        config += "[response_cache]\nenabled = false\n"
        port, grpc_port = free_port(), free_port()
        proc = start_server(root, ["--data-dir", str(root / "data"), "--log-format", "console", "--grpc-port",
                                   str(grpc_port)], port, root / "server.log", config_text=config, model_flag=False)
        try:
            await wait_ready(f"http://127.0.0.1:{port}", proc)
            for name, (path, kind, rows) in models.items():
                floor = in_process(path, kind, rows)
                tensor = "input" if kind == "tabular" else "x"
                for rate in map(float, args.rates.split(",")):
                    for protocol in ("REST", "gRPC"):
                        cpu_before = cpu_seconds(proc.pid)
                        measured = (await at_rate(f"http://127.0.0.1:{port}", name, tensor, "FP32", rows, rate,
                                                  args.seconds) if protocol == "REST" else
                                    await grpc_at_rate(f"127.0.0.1:{grpc_port}", name, tensor, rows, rate,
                                                       args.seconds))
                        measured["server_cpu_ms"] = (1e3 * (cpu_seconds(proc.pid) - cpu_before)
                                                     / max(1, rate * args.seconds))
                        row = {"model": name, "protocol": protocol, **measured, "in_process_p50_ms": floor["p50_ms"],
                               "in_process_p99_ms": floor["p99_ms"], "in_process_rate": floor["rate"]}
                        rows_out.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            stop_server(proc)
    print("\n| model | protocol | offered req/s | achieved req/s | p50 ms | p99 ms | errors | server CPU ms / req | "
          "in-process p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['model']} | {r['protocol']} | {r['offered']:.0f} | {r['achieved']:.0f} | {r['p50_ms']:.1f} | "
              f"{r['p99_ms']:.1f} | {r['errors']} | {r['server_cpu_ms']:.2f} | "
              f"{r['in_process_p50_ms']:.3f} / {r['in_process_p99_ms']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
