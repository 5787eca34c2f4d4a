"""Where a model's load is: a phase and the fraction of the whole load done, passed to a callback
(the admin API's model state) at every step, and logged at each phase and each tenth. Torch-free; the loader
calls it, it knows nothing of who listens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

ProgressCallback = Callable[[str, float], None]  # (phase, fraction of the whole load done, 0..1)

# Each phase's share of the whole load, as (start, end): reading weights dominates (de-quantizing
# GGUF blocks, or reading safetensors); a phase a load does not have is skipped over.
PHASES: dict[str, tuple[float, float]] = {
    "reading metadata": (0.0, 0.05),
    "reading weights": (0.05, 0.85),
    "quantizing": (0.85, 0.92),
    "building kernels": (0.92, 0.95),
    "checking attention": (0.95, 0.97),  # the generic backend's check against the model's own attention
    "loading tokenizer": (0.97, 1.0),
    "loaded": (1.0, 1.0),
}


@dataclass
class LoadProgress:
    """Invariant: `fraction` never decreases and is 1.0 only once the load is done."""

    source: str
    report: ProgressCallback | None = None
    phase: str = "starting"
    fraction: float = 0.0
    started_s: float = field(default_factory=time.monotonic)
    _logged_tenths: int = 0

    def enter(self, phase: str) -> None:
        self._move(phase, PHASES[phase][0])

    def advance(self, done: int, total: int, **fields: Any) -> None:
        """`done` of `total` units (bytes, tensors) of the current phase's work; `fields` go to the log."""
        start, end = PHASES[self.phase]
        self._move(self.phase, start + (end - start) * (done / total if total else 1.0), **fields)

    def _move(self, phase: str, fraction: float, **fields: Any) -> None:
        new_phase = phase != self.phase
        self.phase, self.fraction = phase, max(self.fraction, min(fraction, 1.0))
        if self.report is not None:
            self.report(self.phase, self.fraction)
        tenths = int(self.fraction * 10 + 1e-9)
        if tenths > self._logged_tenths or new_phase:
            self._logged_tenths = tenths
            log.info("loading model", source=self.source, phase=phase, progress=round(self.fraction, 3),
                     seconds=round(time.monotonic() - self.started_s, 2), **fields)
