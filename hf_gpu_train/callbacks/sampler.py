"""A background thread that samples the GPUs this process uses and the host, off the training loop.

NVML refreshes its counters every 1/6 s to 1 s, so sampling faster than the default 1 s adds
nothing (torch.cuda.power_draw docs); one NVML call costs ~0.1 ms, against 10-20 ms for an
``nvidia-smi`` subprocess. The sampler never breaks training: an error in a query is reported once,
that field is dropped from later samples, and sampling goes on.

The GPUs' health (XID events, ECC, row remapping, PCIe replays, NVLink errors: ``hardware/health.HealthWatch``) is
read by the same thread every ``health_every_s``: what changed since the run began, each finding once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..hardware.backend import UNKNOWN_VALUE_KINDS, NvmlBackend, NvmlFailure
from ..hardware.health import HealthWatch
from ..hardware.profile import clock_event_reason_names

log = logging.getLogger("hf_gpu_train.telemetry")
GIB = 2**30



@dataclass
class Sample:
    t: float
    gpus: dict[int, dict[str, Any]] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"t": self.t, "gpus": {str(k): v for k, v in self.gpus.items()}, "host": self.host}


class DeviceSampler:
    """Samples ``handles`` ({NVML index: handle}) every ``interval_s`` in a daemon thread."""

    def __init__(self, backend: NvmlBackend | None, handles: dict[int, Any], interval_s: float = 1.0, keep: int = 200_000,
                 health_every_s: float = 10.0):
        self.backend = backend
        self.health_every_s = health_every_s
        self.health = None  # the HealthWatch, made in the thread (its baseline takes a few NVML calls per GPU)
        self.health_events: list[dict] = []  # every finding so far; ``take_health_events`` hands out the new ones
        self._health_cursor = 0
        self._health_due = 0.0
        self.handles = handles
        self.interval_s = interval_s
        self.keep = keep
        self.samples: list[Sample] = []
        self._cursor = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._broken: set[str] = set()
        self.errors: list[str] = []
        self._process = None
        try:
            import psutil

            self._psutil = psutil
            self._process = psutil.Process(os.getpid())
            psutil.cpu_percent(None)  # the first call only primes the counter
        except ImportError:  # psutil is a dependency; degrade anyway
            self._psutil = None

    # -- thread ------------------------------------------------------------------------------
    def start(self) -> DeviceSampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hf_gpu_train-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_now()
            if self.backend is not None and self.handles and time.monotonic() >= self._health_due:
                self.check_health()
            self._stop.wait(self.interval_s)
        if self.health is not None:
            self.health.close()

    def check_health(self) -> list[dict]:
        """Read the GPUs' health now: the findings since the baseline (the first call takes it). Never raises."""
        self._health_due = time.monotonic() + self.health_every_s
        try:
            if self.health is None:
                self.health = HealthWatch(self.backend, self.handles)
                return []
            found = self.health.poll_json()
        except Exception as error:  # health is a bonus: it must never take the sampler down
            self._give_up("gpu_health", f"GPU health: {type(error).__name__}: {error}")
            self._health_due = float("inf")
            return []
        with self._lock:
            self.health_events.extend(found)
        return found

    def take_health_events(self) -> list[dict]:
        """The health findings since the last take."""
        with self._lock:
            new = self.health_events[self._health_cursor:]
            self._health_cursor = len(self.health_events)
        return new

    # -- sampling ---------------------------------------------------------------------------
    def _query(self, name: str, fn, *args):
        if name in self._broken:
            return None
        try:
            return fn(*args)
        except NvmlFailure as failure:
            if failure.kind in UNKNOWN_VALUE_KINDS:  # this GPU does not report it: drop quietly
                self._broken.add(name)
            else:
                self._give_up(name, f"{name} failed ({failure.kind}): {failure}")
        except Exception as error:  # a sampler must never take training down
            self._give_up(name, f"{name}: {type(error).__name__}: {error}")
        return None

    def _give_up(self, name: str, message: str) -> None:
        self._broken.add(name)
        self.errors.append(message)
        log.warning("telemetry: %s; this metric is no longer sampled (training goes on)", message)

    def sample_now(self) -> Sample:
        sample = Sample(t=time.time())
        b = self.backend
        for index, h in self.handles.items():
            g: dict[str, Any] = {}
            if b is not None:
                util = self._query("utilization_pct", b.utilization_pct, h)
                mem = self._query("memory_info", b.memory_info, h)
                power = self._query("power_usage_mw", b.power_usage_mw, h)
                limit = self._query("power_limit_mw", b.power_limit_mw, h)
                temp = self._query("temperature_c", b.temperature_c, h)
                clock = self._query("sm_clock_mhz", b.sm_clock_mhz, h)
                clock_max = self._query("sm_clock_max_mhz", b.sm_clock_max_mhz, h)
                reasons = self._query("clock_event_reasons", b.clock_event_reasons, h)
                pcie = self._query("pcie_link", b.pcie_link, h)
                g = {
                    "util_pct": None if util is None else util[0],
                    "mem_util_pct": None if util is None else util[1],
                    "mem_used_gib": None if mem is None else mem[1] / GIB,
                    "mem_total_gib": None if mem is None else mem[0] / GIB,
                    "power_w": None if power is None else power / 1000.0,
                    "power_limit_w": None if limit is None else limit / 1000.0,
                    "temp_c": temp,
                    "sm_clock_mhz": clock,
                    "sm_clock_max_mhz": clock_max,
                    "throttle_reasons": list(clock_event_reason_names(reasons)) if reasons is not None else None,
                    "pcie_gen": None if pcie is None else pcie[0],
                    "pcie_width": None if pcie is None else pcie[1],
                }
            sample.gpus[index] = {k: v for k, v in g.items() if v is not None}
        if self._psutil is not None:
            vm = self._psutil.virtual_memory()
            sample.host = {"cpu_pct": self._psutil.cpu_percent(None), "ram_used_gib": (vm.total - vm.available) / GIB,
                           "rss_gib": self._process.memory_info().rss / GIB}
        with self._lock:
            self.samples.append(sample)
            if len(self.samples) > self.keep:
                drop = len(self.samples) - self.keep
                del self.samples[:drop]
                self._cursor = max(0, self._cursor - drop)
        return sample

    def drain(self) -> list[Sample]:
        """Samples taken since the last drain."""
        with self._lock:
            new = self.samples[self._cursor:]
            self._cursor = len(self.samples)
        return new
