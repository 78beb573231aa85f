"""The peak resident memory of a CPU trial: what `tune --memory-budget-gib` holds a candidate to on a machine
without a GPU (on a GPU, torch's peak reserved: ``callbacks.devices.device_peak``).

The trials of a launch share one process, so the operating system's own high-water mark (``ru_maxrss``) only ever
grows: a thread samples the resident set while the trial runs instead. Before it starts, memory the C allocator kept
from earlier trials goes back to the system (glibc's ``malloc_trim``), so a trial is not charged for the one before
it. Large tensors are mapped and unmapped by themselves; the samples, 5 ms apart, catch the peaks of steps that last
tens of milliseconds and more (a step is its forward's activations held until the backward frees them).
"""

from __future__ import annotations

import threading

import psutil

from ..c_library import c_function

SAMPLE_S = 0.005


def give_back_free_memory() -> None:
    """Return the C allocator's free pages to the system (glibc; a no-op elsewhere)."""
    trim = c_function("malloc_trim")
    if trim is not None:
        trim(0)


class PeakResident:
    """``with PeakResident() as peak: ...`` then ``peak.bytes``: the largest resident set seen meanwhile."""

    def __init__(self, interval_s: float = SAMPLE_S):
        self.interval_s = interval_s
        self.bytes = 0
        self._stop = threading.Event()
        self._process = psutil.Process()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.bytes = max(self.bytes, self._process.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakResident:
        give_back_free_memory()
        self.bytes = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, name="hf-gpu-train-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.bytes = max(self.bytes, self._process.memory_info().rss)
