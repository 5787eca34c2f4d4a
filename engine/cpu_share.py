"""How many threads a CPU worker's steps use: all of torch's while the process has the cores to
itself, one while another process busy at normal priority holds some of them.

Why: the threads of a parallel region wait for each other at its end, and a decode step runs
hundreds of regions; when another process takes a core, the thread it displaces is late to every
barrier and its partner spins or sleeps meanwhile. Measured (bench/throughput.py mode a, 32 streams
x 64/64 of the SmolLM2-135M shape, 2 cores): quiet, 182 tok/s on 2 threads and 112 on 1; beside one
`nice 0` busy process, 65 tok/s on 2 threads and 119 on 1. A neighbour at `nice 19` takes no share
from two busy threads (CFS weights 1024 : 15; 196 tok/s beside it, 193 without), so niced time is
not counted: /proc/stat keeps it apart.

The worker checks after each round of steps and, idle, once a CHECK_INTERVAL_S. Idle checks only
give threads back: a neighbour busy while no request came (another server starting or serving, a
build) may be gone when work comes, and the first check of a busy spell only starts its measurement.
Before, checked only between steps, a busy spell inherited what an idle minute had seen: beside
vLLM's start-up galley ran W's first 12 s on one thread (150 tok/s, TTFT 8.8 s, against 200 tok/s
and 5.4 s), and each run right after vLLM's own ran its first seconds on one thread.

Linux only (/proc); elsewhere the thread count never changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 1.0
# others' normal-priority use at or above this: one thread. Half a core: beside our two busy threads a
# spinning process gets only about 2/3 of one (three runnable threads of equal weight on two cores);
# at 0.8 the switch came late or not at all (97 tok/s beside it instead of 121)
BUSY_NEIGHBOUR_CORES = 0.5
QUIET_NEIGHBOUR_CORES = 0.25  # below this for two checks in a row: all threads again


@dataclass(frozen=True)
class CpuTimes:
    """Ticks (USER_HZ) of normal-priority busy time: the machine's, and this process's own."""

    machine: int
    own: int


def read_cpu_times(stat: str = "/proc/stat", own_stat: str = "/proc/self/stat") -> CpuTimes | None:
    try:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open(own_stat) as f:
            own = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    user, _nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return CpuTimes(user + system + irq + softirq + steal, int(own[11]) + int(own[12]))  # utime, stime


class CpuShare:
    """Invariant: `threads` is what torch was last set to on the worker's thread (1 or `max_threads`)."""

    def __init__(self, max_threads: int | None = None, read: Callable[[], CpuTimes | None] = read_cpu_times,
                 clock: Callable[[], float] = time.monotonic, ticks_per_s: float | None = None) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = self.max_threads
        self.read = read
        self.clock = clock
        self.ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self.last = (clock(), read())
        self.quiet_checks = 0
        self.busy = True  # whether the worker stepped between the last two checks

    def tick(self, busy: bool = True) -> None:
        """Call after each round of steps (`busy`) and now and then while idle, on the worker's thread: at
        most once per CHECK_INTERVAL_S, sets torch's threads by how much of the machine other processes
        took since the last check."""
        now = self.clock()
        if busy and not self.busy:  # work resumed: measure from here, not over the idle spell
            self.busy, self.last = True, (now, self.read())
            return
        if self.max_threads < 2 or now - self.last[0] < CHECK_INTERVAL_S:
            return
        times, (then, before) = self.read(), self.last
        self.last, self.busy = (now, times), busy
        if times is None or before is None:
            return
        others = max(0, (times.machine - before.machine) - (times.own - before.own)) / self.ticks_per_s / (now - then)
        wanted = self.threads
        if others >= BUSY_NEIGHBOUR_CORES:
            self.quiet_checks = 0
            if busy:  # idle, a neighbour costs nothing yet
                wanted = 1
        elif others < QUIET_NEIGHBOUR_CORES:
            self.quiet_checks += 1
            if self.quiet_checks >= 2:
                wanted = self.max_threads
        else:
            self.quiet_checks = 0
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            self.threads = wanted
            log.info("cpu threads changed", threads=wanted, other_processes_cores=round(others, 2))
