"""engine.host_memory against the real glibc: a step's worth of activations, freed and
allocated again, must come back without page faults."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.host_memory import keep_freed_memory

ROOT = Path(__file__).resolve().parents[2]

# Rounds of 5-25 MB tensors (a 2048-token prefill's activations at the SmolLM2 shape), all freed
# between rounds, in a thread as the engine's worker; prints the minor faults of the last rounds.
ROUNDS = """
import resource, sys, threading, torch
from engine.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
sizes = [2048 * 576, 2048 * 960, 2048 * 3072, 2048 * 1536, 2048 * 576, 2048 * 3072]
faults = []
def rounds():
    for i in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        live = [torch.ones(n) for n in sizes for _ in range(2)]
        del live
        if i >= 3:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(applied, max(faults))
"""


def faults_per_round(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_activations_are_reused_without_page_faults():
    applied, kept = faults_per_round("keep")
    _, default = faults_per_round("default")
    assert applied
    assert default > 2_000  # glibc's own thresholds hand pages back every round (6K faults here)
    assert kept < 100, (kept, default)


def test_the_users_malloc_settings_stand(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False
