"""A torch profiler recording on a device worker's thread around its engine steps.

torch.profiler records CPU ops of the thread that starts it, and only one profiler may run
in a process, so the worker thread itself starts and stops it: `start` when the command
arrives through the worker's inbox, `tick` after each loop turn stops it once its time is
up and hands the Chrome-trace JSON to the caller's future. Must not import aiohttp or the
server side; the API layer only sees the future's bytes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from concurrent.futures import Future

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_RUNNING = threading.Lock()  # one profiler per process


class ProfilerBusy(RuntimeError):
    pass


class StepProfiler:
    """Invariant: `_session` is set exactly while this worker holds `_RUNNING`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._session: profile | None = None
        self._future: Future | None = None
        self._deadline_s = 0.0

    @property
    def is_active(self) -> bool:
        return self._session is not None

    def start(self, seconds: float, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        if not _RUNNING.acquire(blocking=False):
            future.set_exception(ProfilerBusy("a profile is already being recorded"))
            return
        activities = [ProfilerActivity.CPU]
        if self.device.startswith("cuda") and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        try:
            session = profile(activities=activities, record_shapes=True)
            session.__enter__()
        except Exception as exc:
            _RUNNING.release()
            future.set_exception(exc)
            return
        self._session, self._future = session, future
        self._deadline_s = time.monotonic() + seconds

    def timeout_s(self) -> float | None:
        """How long the worker may block waiting for work before `tick` must run; None: forever."""
        return max(0.0, self._deadline_s - time.monotonic()) if self.is_active else None

    def label(self, name: str):
        """A named range in the trace around one engine step, while recording."""
        return record_function(name) if self.is_active else contextlib.nullcontext()

    def tick(self) -> None:
        if self.is_active and time.monotonic() >= self._deadline_s:
            self.stop()

    def stop(self) -> None:
        """End the recording and resolve the future with the trace (JSON bytes)."""
        session, future = self._session, self._future
        if session is None:
            return
        self._session = self._future = None
        try:
            session.__exit__(None, None, None)
            fd, path = tempfile.mkstemp(prefix="galley-profile-", suffix=".json")
            os.close(fd)
            try:
                session.export_chrome_trace(path)
                with open(path, "rb") as f:
                    future.set_result(f.read())
            finally:
                os.unlink(path)
        except Exception as exc:
            future.set_exception(exc)
        finally:
            _RUNNING.release()
