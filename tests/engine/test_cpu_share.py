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


def test_an_idle_worker_still_checks_its_neighbours(monkeypatch):
    """A neighbour busy while no request came (another server starting, a build) is not held against the
    next requests: idle, the worker checks once a CHECK_INTERVAL_S, so it is on all its threads again
    before work resumes. Checked only after steps, the first check after an idle spell counted it."""
    import time

    from engine import worker as worker_module

    start = time.monotonic()

    def read() -> CpuTimes:  # others: 0.8 cores for the first 1.5 s, then nothing; ours: idle
        return CpuTimes(round(min(time.monotonic() - start, 1.5) * 0.8 * 100), 0)

    monkeypatch.setattr(worker_module, "CpuShare", lambda: CpuShare(max_threads=2, read=read, ticks_per_s=100))
    worker = worker_module.DeviceWorker("cpu-idle-test", emit=lambda events: None)
    worker.start()
    try:
        seen, deadline = set(), time.monotonic() + 10
        while time.monotonic() < deadline and not (1 in seen and worker.cpu_share.threads == 2):
            seen.add(worker.cpu_share.threads)
            time.sleep(0.05)
        assert 1 in seen and worker.cpu_share.threads == 2  # one thread beside the neighbour, all once it left
    finally:
        worker.stop()
