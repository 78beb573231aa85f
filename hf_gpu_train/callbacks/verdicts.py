"""What holds the run back, as one verdict with its evidence and the next step for this run.

Pure functions of a window's numbers (``WindowStats``), tested on synthetic series. Order: a
throttled GPU explains everything downstream of it, then a starved one, then memory pressure,
then a batch too small to fill it; otherwise healthy.

A GPU at its power limit (SwPowerCap) under full load is running as designed: boost clocks trade
against the board's power budget. That is a qualifier on the verdict ("healthy, at power limit"),
never "throttled". Throttling is heat (SwThermal/HwThermal), a hardware slowdown (HwSlowdown) or
the power brake (HwPowerBrake), with the SM clock below its maximum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

THROTTLED_PCT = 20.0
CLOCK_RATIO = 0.9
DATA_WAIT_PCT = 20.0
LOW_UTIL_PCT = 70.0
RESERVED_GAP_FRACTION = 0.3
RESERVED_GAP_MIN_GIB = 1.0
SLOWDOWN = 0.15
POWER_CAPPED_PCT = 20.0
THERMAL = {"SwThermalSlowdown", "HwThermalSlowdown"}
AT_POWER_LIMIT = "at power limit"


@dataclass(frozen=True)
class WindowStats:
    on_gpu: bool
    gpu_util_pct: float | None = None
    data_wait_pct: float | None = None
    throttled_pct: float | None = None
    power_capped_pct: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    throttle_reasons: frozenset[str] = frozenset()
    temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    alloc_retries_delta: int = 0
    reserved_gib: float | None = None
    allocated_gib: float | None = None
    samples_per_s: float | None = None
    dataloader_workers: int | None = None
    micro_batch: int | None = None
    suggested_micro_batch: int | None = None
    host_cpu_pct: float | None = None


@dataclass(frozen=True)
class Verdict:
    kind: str  # throttled | data-bound | memory-pressure | under-utilized | healthy
    evidence: str
    next_step: str
    notes: tuple[str, ...] = field(default=())
    qualifiers: tuple[str, ...] = field(default=())  # short, normal facts: "at power limit"

    def label(self) -> str:
        """The verdict in a few words, for the one console line: "healthy, at power limit"."""
        return ", ".join((self.kind, *self.qualifiers))

    def line(self) -> str:
        text = f"{self.label()}: {self.evidence}. Next: {self.next_step}"
        return text + "".join(f" Note: {n}" for n in self.notes)

    def with_note(self, note: str) -> Verdict:
        return Verdict(self.kind, self.evidence, self.next_step, self.notes + (note,), self.qualifiers)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "evidence": self.evidence, "next_step": self.next_step, "notes": list(self.notes),
                "qualifiers": list(self.qualifiers)}

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        return cls(d["kind"], d["evidence"], d["next_step"], tuple(d.get("notes", ())), tuple(d.get("qualifiers", ())))


def _fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    return "?" if value is None else f"{value:.{digits}f}{unit}"


def judge(w: WindowStats) -> Verdict:
    verdict = _judge(w)
    if w.on_gpu and (w.power_capped_pct or 0) >= POWER_CAPPED_PCT:
        return Verdict(verdict.kind, verdict.evidence, verdict.next_step, verdict.notes + (_power_limit_note(w),),
                       verdict.qualifiers + (AT_POWER_LIMIT,))
    return verdict


def _power_limit_note(w: WindowStats) -> str:
    return (f"{AT_POWER_LIMIT} in {_fmt(w.power_capped_pct, '%')} of readings (SwPowerCap; {_fmt(w.power_w, ' W')} of "
            f"{_fmt(w.power_limit_w, ' W')}, SM clock {_fmt(w.sm_clock_mhz)}/{_fmt(w.sm_clock_max_mhz)} MHz): normal under "
            "full load, the GPU trades boost clock for its power budget. If `nvidia-smi -q -d POWER` shows a limit below "
            "the default, raising it back helps")


def _judge(w: WindowStats) -> Verdict:
    clock_ratio = (w.sm_clock_mhz / w.sm_clock_max_mhz) if w.sm_clock_mhz and w.sm_clock_max_mhz else None
    if w.on_gpu and (w.throttled_pct or 0) >= THROTTLED_PCT and clock_ratio is not None and clock_ratio < CLOCK_RATIO:
        reasons = sorted(w.throttle_reasons)
        thermal = bool(THERMAL & w.throttle_reasons)
        evidence = (f"clocks held back in {_fmt(w.throttled_pct, '%')} of samples ({', '.join(reasons) or 'unnamed'}), "
                    f"SM clock {_fmt(w.sm_clock_mhz)}/{_fmt(w.sm_clock_max_mhz)} MHz, {_fmt(w.temp_c, ' C')}, "
                    f"power {_fmt(w.power_w, ' W')} of {_fmt(w.power_limit_w, ' W')}")
        step = ("improve cooling (fans, airflow, datacenter inlet temperature; `nvidia-smi -q -d TEMPERATURE`)" if thermal else
                "a hardware slowdown or power brake is a signal from the board or the system: check the power cables and "
                "the power supply, and `nvidia-smi -q -d PERFORMANCE` for which one")
        return Verdict("throttled", evidence, step)
    wait = w.data_wait_pct or 0.0
    util = w.gpu_util_pct
    if wait >= DATA_WAIT_PCT or (w.on_gpu and util is not None and util < LOW_UTIL_PCT and wait >= DATA_WAIT_PCT / 2):
        workers = w.dataloader_workers
        more = max(2, (workers or 0) * 2)
        evidence = f"{_fmt(wait, '%')} of wall time waiting for the next batch" + (f", GPU utilization {_fmt(util, '%')}" if util is not None else "")
        step = (f"raise dataloader_num_workers from {workers if workers is not None else '?'} to {more}, "
                "keep pin_memory and persistent workers on, raise dataloader_prefetch_factor, and pre-tokenize / "
                "pre-decode the data once instead of per step")
        return Verdict("data-bound", evidence, step)
    if w.on_gpu and (w.alloc_retries_delta > 0 or _reserved_gap(w)):
        gap = None if w.reserved_gib is None or w.allocated_gib is None else w.reserved_gib - w.allocated_gib
        evidence = (f"allocator retries +{w.alloc_retries_delta} since the last log" if w.alloc_retries_delta > 0 else
                    f"reserved {_fmt(w.reserved_gib, ' GiB', 1)} vs allocated {_fmt(w.allocated_gib, ' GiB', 1)} "
                    f"({_fmt(gap, ' GiB', 1)} cached but unused: fragmentation)")
        return Verdict("memory-pressure", evidence,
                       "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; if retries keep climbing, lower the micro-batch "
                       "or turn on gradient_checkpointing before an OOM does it for you")
    if w.on_gpu and util is not None and util < LOW_UTIL_PCT:
        suggestion = (f"raise per_device_train_batch_size from {w.micro_batch} to {w.suggested_micro_batch} (the memory planner's fit)"
                      if w.suggested_micro_batch and w.micro_batch and w.suggested_micro_batch > w.micro_batch else
                      "raise per_device_train_batch_size (run `hf-gpu-train plan-memory --model ...` for the largest that fits)")
        return Verdict("under-utilized", f"GPU utilization {_fmt(util, '%')} with little data wait ({_fmt(wait, '%')}): "
                       "kernels too small to fill the GPU", suggestion)
    if not w.on_gpu:
        return Verdict("healthy", f"CPU run: {_fmt(wait, '%')} data wait" + (f", host CPU {_fmt(w.host_cpu_pct, '%')}"
                       if w.host_cpu_pct is not None else ""), "nothing to change (GPU verdicts need a GPU)")
    return Verdict("healthy", f"GPU utilization {_fmt(util, '%')}, {_fmt(wait, '%')} data wait, no throttling",
                   "nothing to change")


def _reserved_gap(w: WindowStats) -> bool:
    if w.reserved_gib is None or w.allocated_gib is None or w.reserved_gib <= 0:
        return False
    gap = w.reserved_gib - w.allocated_gib
    return gap >= RESERVED_GAP_MIN_GIB and gap / w.reserved_gib >= RESERVED_GAP_FRACTION


def speed_trend(history: list[WindowStats]) -> str | None:
    """Speed falling over time, with the likely cause, or None."""
    speeds = [h.samples_per_s for h in history if h.samples_per_s]
    if len(speeds) < 3:
        return None
    best, now = max(speeds[:-1]), speeds[-1]
    if now >= best * (1 - SLOWDOWN):
        return None
    last, first = history[-1], history[0]
    causes = []
    if last.throttle_reasons:
        causes.append(f"throttling ({', '.join(sorted(last.throttle_reasons))})")
    if (last.data_wait_pct or 0) > (first.data_wait_pct or 0) + 10:
        causes.append(f"data wait rose from {_fmt(first.data_wait_pct, '%')} to {_fmt(last.data_wait_pct, '%')} (I/O or preprocessing)")
    if last.host_cpu_pct is not None and last.host_cpu_pct > 90:
        causes.append(f"host CPU at {_fmt(last.host_cpu_pct, '%')} (background processes?)")
    if last.on_gpu and last.gpu_util_pct is not None and first.gpu_util_pct is not None and last.gpu_util_pct < first.gpu_util_pct - 15:
        causes.append(f"GPU utilization fell from {_fmt(first.gpu_util_pct, '%')} to {_fmt(last.gpu_util_pct, '%')} (another process on the GPU?)")
    return (f"speed fell {100 * (1 - now / best):.0f}% from its best ({best:.1f} to {now:.1f} samples/s)"
            + (": " + "; ".join(causes) if causes else ""))
