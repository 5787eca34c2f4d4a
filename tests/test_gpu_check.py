"""scripts/gpu_check.sh, the one command a GPU machine runs, goes through all its steps on CPU
(`--cpu`: the CUDA tests skip, bench/gpu.py runs a tiny shape in float32) and writes what a GPU run
would bring back: the environment, the tests' log and report, the benchmark's JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_step_on_cpu(tmp_path):
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    written = {p.name for p in tmp_path.iterdir()}
    assert {"env.txt", "pytest.log", "pytest.xml", "bench.log", "gpu_bench.json"} <= written
    assert "torch" in (tmp_path / "env.txt").read_text()
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    [row] = report["shapes"]
    assert row["shape"] == "tiny" and row["engine_4"]["tok_s"] > 0 and row["hf_4"]["tok_s"] > 0
    assert row["greedy_equals_hf_one"] and row["greedy_equals_hf_batch"]  # the reference holds on CPU
    assert 0 < row["single_stream_decode_fraction_of_limit"]
