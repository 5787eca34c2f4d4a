"""engine/cpu_share.py: a CPU worker's threads follow how much of the machine other processes take."""

from __future__ import annotations

import torch

from engine.cpu_share import CHECK_INTERVAL_S, CpuShare, CpuTimes, read_cpu_times


class Machine:
    """Scripted /proc readings: per check, the cores others used at normal priority and ours."""

    def __init__(self) -> None:
        self.now = 0.0
        self.times = CpuTimes(0, 0)

    def advance(self, others_cores: float, own_cores: float = 2.0, seconds: float = CHECK_INTERVAL_S) -> None:
        self.now += seconds
        own = round(own_cores * seconds * 100)
        self.times = CpuTimes(self.times.machine + own + round(others_cores * seconds * 100), self.times.own + own)


def test_one_thread_beside_a_busy_neighbour_and_all_again_once_it_left():
    before = torch.get_num_threads()
    machine = Machine()
    share = CpuShare(max_threads=2, read=lambda: machine.times, clock=lambda: machine.now, ticks_per_s=100)
    try:
        seen = []
        for others in [0.0, 0.0, 0.8, 0.8, 0.1, 0.3, 0.1, 0.1, 0.6]:
            machine.advance(others)
            share.tick()
            seen.append(share.threads)
        # a busy neighbour: one thread at once; quiet again: all of them after two quiet checks in a row
        # (0.3 is neither: it resets the count)
        assert seen == [2, 2, 1, 1, 1, 1, 1, 2, 1]
        assert torch.get_num_threads() == 1
        machine.advance(0.9, seconds=CHECK_INTERVAL_S / 4)
        share.tick()  # within the interval: nothing is read
        assert share.last[0] == machine.now - CHECK_INTERVAL_S / 4
    finally:
        torch.set_num_threads(before)


def test_niced_and_idle_time_are_not_a_neighbour(tmp_path):
    stat, own = tmp_path / "stat", tmp_path / "self_stat"
    stat.write_text("cpu  100 5000 20 900 7 1 2 3 0 0\ncpu0 1 2 3 4\n")  # user nice system idle iowait irq ...
    own.write_text("42 (a (strange) name) R " + " ".join(["0"] * 10) + " 60 15 0 0\n")  # fields 14, 15
    assert read_cpu_times(str(stat), str(own)) == CpuTimes(100 + 20 + 1 + 2 + 3, 75)
    assert read_cpu_times(str(tmp_path / "missing"), str(own)) is None
    assert read_cpu_times() is not None  # this machine's /proc


def test_idle_checks_only_give_threads_back_and_a_busy_spell_measures_from_its_start():
    """While idle, a busy neighbour costs nothing yet (it may be gone when work comes: another server
    starting or serving, a build), a neighbour gone gives the threads back; the first check of a busy
    spell only starts its measurement, so a busy spell never inherits what the idle one saw."""
    before = torch.get_num_threads()
    machine = Machine()
    share = CpuShare(max_threads=2, read=lambda: machine.times, clock=lambda: machine.now, ticks_per_s=100)
    try:
        seen = []
        for others, busy in [(0.8, True), (1.9, False), (1.9, False), (0.0, False), (0.0, False), (1.9, False),
                             (1.9, True), (0.0, True), (0.8, True)]:
            machine.advance(others, own_cores=2.0 if busy else 0.0)
            share.tick(busy=busy)
            seen.append(share.threads)
        # busy beside 0.8: one thread; idle beside 1.9: no change; idle and quiet twice: all again; idle
        # beside 1.9: no change; work resumes while the neighbour ran: measured from here (no change);
        # a quiet second and a busy one: one thread
        assert seen == [1, 1, 1, 1, 2, 2, 2, 2, 1]
    finally:
        torch.set_num_threads(before)


def test_an_idle_worker_still_checks_its_neighbours(monkeypatch):
    """A neighbour gone while no request came gives the threads back before work resumes: idle, the
    worker checks once a CHECK_INTERVAL_S (before, it checked after steps only)."""
    import time

    from engine import worker as worker_module

    start = time.monotonic()

    def read() -> CpuTimes:  # others: 0.8 cores for the first 0.5 s, then nothing; ours: idle
        return CpuTimes(round(min(time.monotonic() - start, 0.5) * 0.8 * 100), 0)

    monkeypatch.setattr(worker_module, "CpuShare", lambda: CpuShare(max_threads=2, read=read, ticks_per_s=100))
    worker = worker_module.DeviceWorker("cpu-idle-test", emit=lambda events: None)
    worker.cpu_share.threads = 1  # as a neighbour seen in the last busy spell left it
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and worker.cpu_share.threads != 2:
            time.sleep(0.05)
        assert worker.cpu_share.threads == 2
    finally:
        worker.stop()
