"""Pure bookkeeping between two log steps: step time and data wait from the loop's events, and
mean/max of the sampler's readings. No torch, no threads: tested on synthetic timestamps."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..hardware.clock_events import POWER_CAP_REASON, THROTTLE_REASONS
from .sampler import Sample


@dataclass
class LoopTimer:
    """Step time from on_step_begin to on_step_end; data wait from the end of one step (or of a log,
    eval or save that followed it) until this rank's next batch is ready (``batch_ready``), or until
    the next on_step_begin when loading happens in worker processes.

    Training time is step time plus the whole gap before each step (loading, and the item-count
    all-reduce after it): the time the loop spends training. Logging, evaluation and checkpointing are
    not in it (``pause_end`` restarts the gap), so throughput over a window that held an ``evaluate()``
    or a save is the training speed, not diluted by them."""

    step_times: list[float] = field(default_factory=list)
    data_waits: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    _gap_start: float | None = None
    _step_start: float | None = None
    _batch_ready: float | None = None

    def batch_ready(self, now: float) -> None:
        """This rank's batch is collated (main-process loading). What follows until the step begins is
        not loading: transformers 5 all-reduces the item count there, i.e. waits for the slowest rank."""
        self._batch_ready = now

    def step_begin(self, now: float) -> None:
        if self._gap_start is not None:
            ready = self._batch_ready if self._batch_ready is not None and self._batch_ready >= self._gap_start else now
            self.data_waits.append(max(0.0, min(ready, now) - self._gap_start))
            self.gaps.append(max(0.0, now - self._gap_start))
        self._gap_start = None
        self._batch_ready = None
        self._step_start = now

    def step_end(self, now: float) -> None:
        if self._step_start is not None:
            self.step_times.append(max(0.0, now - self._step_start))
        self._step_start = None
        self._gap_start = now

    def pause_end(self, now: float) -> None:
        """A log, evaluation or save just finished: it is not data wait, restart the gap here."""
        if self._gap_start is not None:
            self._gap_start = now

    def take(self) -> dict[str, float]:
        """Summary since the last take; resets the window."""
        steps, waits = self.step_times, self.data_waits
        busy, wait = sum(steps), sum(waits)
        out: dict[str, float] = {}
        if steps:
            out["loop/step_time_s"] = busy / len(steps)
            out["loop/step_time_s_max"] = max(steps)
            out["loop/steps"] = float(len(steps))
            out["loop/train_time_s"] = busy + sum(self.gaps)
        if steps or waits:
            out["loop/data_wait_pct"] = 100.0 * wait / (busy + wait) if busy + wait > 0 else 0.0
            out["loop/data_wait_s"] = wait
        self.step_times, self.data_waits, self.gaps = [], [], []
        return out


def is_full_window(metrics: dict[str, float], interval_steps: int) -> bool:
    """A window that covers a whole logging interval. The last window at train end may hold a single
    step (or none): its numbers are noise, so it must not decide the run's verdict or its trend."""
    return metrics.get("loop/steps", 0.0) >= max(1, interval_steps)


def deciding_window(records: list[dict], interval_steps: int) -> dict | None:
    """The record whose verdict is the run's: the last full window, else the last with any step."""
    for candidates in ([r for r in records if is_full_window(r["metrics"], interval_steps)],
                       [r for r in records if r["metrics"].get("loop/steps")], records):
        if candidates:
            return candidates[-1]
    return None


NUMERIC_GPU_KEYS = ("util_pct", "mem_util_pct", "mem_used_gib", "mem_total_gib", "power_w", "power_limit_w", "temp_c", "sm_clock_mhz",
                    "sm_clock_max_mhz", "pcie_gen", "pcie_width")
MAX_TOO = ("util_pct", "mem_used_gib", "power_w", "temp_c", "sm_clock_mhz")


def summarize_samples(samples: list[Sample]) -> tuple[dict[str, float], dict[int, set[str]]]:
    """({key: value} with means and ``_max`` for the peaks, {gpu: throttle reasons seen}).

    ``gpuN/throttled_pct``: share of readings with a throttle reason (heat, hardware slowdown, power brake);
    ``gpuN/power_capped_pct``: share at the board's power limit (SwPowerCap), which is not throttling."""
    values: dict[str, list[float]] = defaultdict(list)
    reasons: dict[int, set[str]] = defaultdict(set)
    throttled: dict[int, list[bool]] = defaultdict(list)
    capped: dict[int, list[bool]] = defaultdict(list)
    for s in samples:
        for index, g in s.gpus.items():
            for key in NUMERIC_GPU_KEYS:
                if key in g:
                    values[f"gpu{index}/{key}"].append(float(g[key]))
            if "throttle_reasons" in g:
                hit = set(g["throttle_reasons"]) & THROTTLE_REASONS
                reasons[index] |= hit
                throttled[index].append(bool(hit))
                capped[index].append(POWER_CAP_REASON in g["throttle_reasons"])
        for key, value in s.host.items():
            values[f"host/{key}"].append(float(value))
    out: dict[str, float] = {}
    for key, series in values.items():
        out[key] = sum(series) / len(series)
        name = key.split("/", 1)[1]
        if name in MAX_TOO or key.startswith("host/"):
            out[f"{key}_max"] = max(series)
    for index, flags in throttled.items():
        out[f"gpu{index}/throttled_pct"] = 100.0 * sum(flags) / len(flags)
    for index, flags in capped.items():
        out[f"gpu{index}/power_capped_pct"] = 100.0 * sum(flags) / len(flags)
    return out, dict(reasons)
