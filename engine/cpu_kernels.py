"""CPU float32 kernels in C++: decode and prefill attention over the paged KV cache, RMSNorm (with the
residual add fused), rotary embedding in place, the MLP's SiLU-and-multiply in one pass, and
linear layers over weights laid out in panels (`engine.packed_linear`); and a whole decoder layer
as one op made of those, so a step makes one call per layer from Python, not ~20. The C++ lives in
`engine/csrc/` (one file per job; common.h says how they fit); this module builds, loads and hands
out the ops (`CPU_KERNELS.ops`, the namespace `torch.ops.galley_cpu`).

Why: the torch path copies every decoding sequence's blocks into a padded tensor per layer
and runs SDPA with one query per sequence, a shape its CPU kernels handle poorly (measured
here at W = 32 x ~200 tokens of context: ~5 ms per layer for gather plus SDPA, one thread);
the decode kernel reads each sequence's keys and values once, in place, through its block
table. RMSNorm and rotary are five to nine torch ops each, every one a pass over memory
with a fresh tensor (14% of a 2048-token prefill, one thread); here each is one pass. The
norm and rotary follow the reference formulas operation by operation (no FMA contraction),
so they round as the torch path does up to the order of the norm's sum.

Compiled with the C++ compiler by torch's extension builder on first use (~40 s of CPU
here), in a background thread while the torch path serves, into TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions); later starts load that library directly. The files are
compiled as one translation unit (`_SOURCE`), and the library's name carries a hash of that text,
the flags, the CPU and torch's version, so a change to any of them builds anew. Without a
compiler, or if the build fails, the torch path stays in use (logged once).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# the translation unit's files, in order; each pulls in the headers it #includes (common.h declares
# the functions one file calls in another, so the order matters only for reading)
_FILES = (
    "norms_rotary.cpp",
    "linear.cpp",
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "lora.cpp",
    "moe.cpp",
    "decoder_layer.cpp",
    "gemma_layer.cpp",
    "ops.cpp",
)
_LOCAL_INCLUDE = re.compile(r'\s*#include\s+"([^"]+)"\s*$')


def _read_source(directory: Path = CSRC, files: tuple[str, ...] = _FILES) -> str:
    """The kernels as one C++ translation unit: the files in order, each local header's text in place
    of its first #include (a later one is dropped, as the header's #pragma once would have it), with
    #line directives so that the compiler's messages and __FILE__ name engine/csrc's files and lines."""
    seen: set[str] = set()

    def expand(name: str) -> list[str]:
        lines = [f'#line 1 "engine/csrc/{name}"']
        for number, line in enumerate((directory / name).read_text().splitlines(), 1):
            match = _LOCAL_INCLUDE.match(line)
            if match is None:
                lines.append("" if line.strip() == "#pragma once" else line)  # GCC warns of it in the main file
                continue
            if match[1] not in seen:
                seen.add(match[1])
                lines += expand(match[1])
            lines.append(f'#line {number + 1} "engine/csrc/{name}"')
        return lines

    return "\n".join(line for name in files for line in expand(name)) + "\n"


try:
    _SOURCE = _read_source()
except OSError:  # an install without engine/csrc: the build fails (logged) and the torch path serves
    _SOURCE = ""


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines)


def _flags(cpu: str) -> list[str]:
    """-march=native ties the build to this CPU (its name carries the CPU's identity too); ATen's
    vectorised math (exp) is told the widest vector set the CPU has, as torch's own kernels are;
    no FMA contraction, so elementwise ops round as torch's separate multiplies and adds do.
    -fopenmp because at::parallel_for is a header-inline `omp parallel`: compiled without it, every
    kernel ran on one thread whatever torch.set_num_threads said (decode attention took 29% of a
    32-sequence step at two threads). The library's libgomp.so.1 resolves to the one torch loaded."""
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off"]
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():  # GCC; Apple's clang lacks it
        flags.append("-fopenmp")
    cpu_flags = set(cpu.split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags:
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif {"avx2", "fma"} <= cpu_flags:
        flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def _build_name(flags: list[str], cpu: str, source: str = _SOURCE) -> str:
    digest = hashlib.sha256((source + " ".join(flags) + cpu + torch.__version__).encode())
    return f"galley_cpu_kernels_{digest.hexdigest()[:12]}"


STALE_LOCK_S = 900.0  # a build lock this old was left by a killed process


def _load_or_build(flags: list[str], cpu: str, source: str = _SOURCE) -> None:
    """Load the cached library directly when it exists: torch's builder would take its file lock and
    run ninja on every start, and a process killed holding that lock (SIGKILL in the first seconds)
    would make every later start wait on it forever. Build only when it is missing. `source`: another
    build's (bench/kernels_ab.py), under its own op namespace."""
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    source = source or _read_source()  # none read at import: read again, raising what failed there
    name = _build_name(flags, cpu, source)
    directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    library = directory / f"{name}.so"
    if library.is_file():
        torch.ops.load_library(str(library))
        return
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    openmp = [flag for flag in flags if flag == "-fopenmp"]
    load_inline(
        name,
        cpp_sources=source,
        extra_cflags=flags,
        extra_ldflags=openmp,
        is_python_module=False,
        build_directory=str(directory),
    )


class CpuKernels:
    """The build of the kernels, shared by every engine of the process (a library of torch ops
    can be loaded once per process). Invariant: `ops` is set only once the library is loaded;
    other threads see either None or the ready namespace `torch.ops.galley_cpu`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.ops = None
        self.failed = False

    def start(self) -> None:
        """Build or load the kernels in a background thread (once per process)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name="galley-kernel-build", daemon=True)
                self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Start if needed and block until the build ends; True when the kernels are usable."""
        self.start()
        assert self._thread is not None
        self._thread.join(timeout_s)
        return self.ops is not None

    def _build(self) -> None:
        try:
            cpu = _cpu_identity()
            _load_or_build(_flags(cpu), cpu)
            self.ops = torch.ops.galley_cpu
            log.info("cpu kernels ready")
        except Exception as exc:  # no compiler, no headers: the torch path serves
            self.failed = True
            log.warning("cpu kernels unavailable; using the torch path", error=str(exc)[-500:])


CPU_KERNELS = CpuKernels()


if __name__ == "__main__":  # `make install`: build now, so the first requests after a start run on the kernels
    started = time.monotonic()
    if CPU_KERNELS.wait():
        print(f"galley: CPU kernels ready ({time.monotonic() - started:.0f} s)")
    else:
        print("galley: the CPU kernels could not be built (no C++ compiler?): the torch ops serve, slower")
