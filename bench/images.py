"""Image classification throughput with dynamic batching vs one image at a time, in the same run.

A ViT-Tiny-shaped classifier (224 px, patch 16, 192 hidden, 12 layers, 3 heads: 5.5M parameters,
random weights, built from its config) is served twice by one server: `vit-batched` (`max_batch =
16`, `max_wait_ms = 5`) and `vit-single` (`max_batch = 1`), the same folder. Concurrent clients
each send one JPEG (base64 JSON, `/api/v1/models/{name}/predict`) per request, closed loop; the two
models are measured in turns (ABAB) so drift hits both. Beside them, the model in-process: the
processor and forward over 16 images at once and over one at a time (the floors, no HTTP).

    python bench/images.py
    python bench/images.py --clients 16 --seconds 8 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
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


def save_vit(folder: Path) -> None:
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    labels = {i: f"class-{i}" for i in range(10)}
    config = ViTConfig(image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                       intermediate_size=768, num_labels=10, id2label=labels,
                       label2id={v: k for k, v in labels.items()})
    ViTForImageClassification(config).eval().save_pretrained(folder)
    ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(folder)


def jpegs(n: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (240 + 8 * i, 320 - 8 * i, 3), dtype=np.uint8)).save(buffer, "JPEG")
        out.append(buffer.getvalue())
    return out


def in_process(folder: Path, pictures: list[bytes], seconds: float) -> dict[str, float]:
    """Images/s of processor + forward in-process, 16 at once and one at a time."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pictures]
    rates = {}
    for size in (16, 1):
        with torch.inference_mode():  # the first forward of a shape is slow: not timed
            model(**processor(images=images[:size], return_tensors="pt"))
        done, begin = 0, time.perf_counter()
        while time.perf_counter() - begin < seconds:
            batch = [images[(done + i) % len(images)] for i in range(size)]
            with torch.inference_mode():
                model(**processor(images=batch, return_tensors="pt"))
            done += size
        rates[f"in_process_{size}"] = done / (time.perf_counter() - begin)
    return rates


async def closed_loop(url: str, name: str, bodies: list[bytes], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        nonlocal errors
        i = offset
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            async with session.post(f"{url}/api/v1/models/{name}/predict", data=bodies[i % len(bodies)],
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
                else:
                    latencies.append(time.perf_counter() - started)
            i += 1

    begin = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session, k) for k in range(clients)))
    elapsed = time.perf_counter() - begin
    return {"images_per_s": len(latencies) / elapsed, "p50_ms": percentile_ms(latencies, 50),
            "p99_ms": percentile_ms(latencies, 99), "errors": errors}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_vit(root / "vit")
        pictures = jpegs(16)
        bodies = [json.dumps({"inputs": [{"image": base64.b64encode(p).decode()}]}).encode() for p in pictures]
        config = "".join(f'[[models]]\nname = "{name}"\npath = "{root / "vit"}"\nkind = "image-classify"\n'
                         f"max_batch = {batch}\nmax_wait_ms = 5.0\n\n"
                         for name, batch in (("vit-batched", 16), ("vit-single", 1)))
        config += "[response_cache]\nenabled = false\n"
        port = free_port()
        proc = start_server(root, ["--data-dir", str(root / "data"), "--log-format", "console", "--grpc-port", "0"],
                            port, root / "server.log", config_text=config, model_flag=False)
        rows = []
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_ready(url, proc)
            for name in ("vit-batched", "vit-single"):  # warm both
                await closed_loop(url, name, bodies, 2, 1.0)
            for repeat in range(args.repeats):
                for name in ("vit-batched", "vit-single") if repeat % 2 == 0 else ("vit-single", "vit-batched"):
                    row = {"model": name, "repeat": repeat,
                           **await closed_loop(url, name, bodies, args.clients, args.seconds)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            stop_server(proc)
        floors = in_process(root / "vit", pictures, args.seconds / 2)
    print(json.dumps(floors))
    mean = {name: np.mean([r["images_per_s"] for r in rows if r["model"] == name])
            for name in ("vit-batched", "vit-single")}
    print(f"\n{args.clients} clients, one JPEG a request, ViT-Tiny shape at 224 px, {args.repeats} turns each:\n")
    print("| served | images/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|")
    for name in ("vit-batched", "vit-single"):
        mine = [r for r in rows if r["model"] == name]
        print(f"| {name} | {mean[name]:.1f} | {np.mean([r['p50_ms'] for r in mine]):.0f} | "
              f"{np.mean([r['p99_ms'] for r in mine]):.0f} | {sum(r['errors'] for r in mine)} |")
    print(f"| in-process, 16 at once | {floors['in_process_16']:.1f} | | | |")
    print(f"| in-process, one at a time | {floors['in_process_1']:.1f} | | | |")
    print(f"\nbatched / one at a time: {mean['vit-batched'] / mean['vit-single']:.2f}x served, "
          f"{floors['in_process_16'] / floors['in_process_1']:.2f}x in-process")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **floors}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
