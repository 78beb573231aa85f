"""One trial's measurements, and the choice of the winner: the fastest candidate that fits with headroom.

Pure data and rules, no torch: the trial processes fill ``TrialResult``; the search, the cache, the report and the
CLI read it.

"Fits with headroom" is: no out-of-memory at any point of the trial (a candidate the OOM recovery rescued at a
smaller micro-batch ran out of memory: it is marked and never the winner), and on a GPU a measured peak at most
``HEADROOM_FRACTION`` of the device's memory. The peak is measured over a few steps; a long run sees more: the
allocator fragments over time, evaluation runs batches of twice the micro-batch, a checkpoint save needs buffers,
other processes come and go. The memory planner keeps 8% for fragmentation alone (``plan/memory.py``); a measured
peak gets 10%.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from .candidates import Candidate

HEADROOM_FRACTION = 0.90
NOISE_FLOOR_PCT = 3.0  # closer than this, two measurements of a few seconds are the same speed (clocks, other jobs)
OK, OOM, FAILED, SKIPPED = "ok", "oom", "failed", "skipped"


@dataclass(frozen=True)
class TrialResult:
    """What one candidate did. Throughput is global (every process) over the measured steps only; memory is the
    largest of any process; ``seconds`` is what the trial cost the budget (setup and warm-up included)."""

    candidate: Candidate
    status: str  # ok | oom | failed | skipped
    reason: str = ""  # oom: what ran out; failed: the error; skipped: why it was not run
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    spread_pct: float | None = None  # relative standard error of the mean step time (the batches' own variation included)
    step_time_s: float | None = None
    data_wait_pct: float | None = None  # the slowest process's share of the measured time spent waiting for data
    peak_memory_bytes: int | None = None  # torch's peak reserved + what torch does not hold (CUDA context, others)
    device_memory_bytes: int | None = None
    warmup_s: float | None = None
    compile_s: float | None = None  # torch.compile: warm-up time beyond the warm-up steps' steady-state time
    rescued_micro_batch: int | None = None  # the OOM recovery's micro-batch at the end, when it had to shrink
    failed_micro_batch: int | None = None  # the smallest micro-batch that ran out of memory in this trial
    warmup_steps: int = 0
    measured_steps: int = 0
    step_times_s: tuple[float, ...] = ()  # each measured step, with the wait before it (the first process's clock)
    seconds: float = 0.0
    from_cache: bool = False
    memory_budget_bytes: int | None = None  # tune --memory-budget-gib: the peak must stay under it too
    launched_strategy: str | None = None  # what the trial's Trainer ran (its accelerator's state), in the planner's words
    peak_by_rank_bytes: tuple[int | None, ...] = ()  # each process's peak, rank 0 first (peak_memory_bytes is the largest)

    @property
    def within_budget(self) -> bool:
        """Under the memory budget (per process); a trial with no measured peak cannot show it fits one."""
        if self.memory_budget_bytes is None:
            return True
        return self.peak_memory_bytes is not None and self.peak_memory_bytes <= self.memory_budget_bytes

    @property
    def ran(self) -> bool:
        return self.status in (OK, OOM)

    @property
    def within_headroom(self) -> bool:
        if self.peak_memory_bytes is None or not self.device_memory_bytes:
            return True
        return self.peak_memory_bytes <= HEADROOM_FRACTION * self.device_memory_bytes

    @property
    def fits(self) -> bool:
        return self.status == OK and self.within_headroom and self.within_budget

    def throughput(self, metric: str) -> float | None:
        return self.tokens_per_s if metric == "tokens/s" and self.tokens_per_s else self.samples_per_s

    def verdict(self) -> str:
        """One word or phrase for tables: ok, over headroom, oom (rescued at 8), skipped: ..., failed: ..."""
        if self.status == OK:
            if not self.within_budget:
                if self.peak_memory_bytes is None:
                    return "no peak measured: the memory budget cannot be judged"
                return f"over the memory budget ({self.memory_budget_bytes / 2**30:.2f} GiB)"
            return "ok" if self.within_headroom else f"over {HEADROOM_FRACTION:.0%} of memory"
        if self.status == OOM:
            return f"oom (rescued at {self.rescued_micro_batch})" if self.rescued_micro_batch else "oom"
        return f"{self.status}: {self.reason}"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["candidate"] = self.candidate.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> TrialResult:
        return cls(**{**data, "candidate": Candidate.from_dict(data["candidate"]), "step_times_s": tuple(data.get("step_times_s", ())),
                      "peak_by_rank_bytes": tuple(data.get("peak_by_rank_bytes", ()))})

    def cached(self) -> TrialResult:
        return replace(self, from_cache=True)


def paired_noise_pct(a: TrialResult, b: TrialResult) -> float | None:
    """Twice the standard error of the mean step-by-step time ratio, in percent. Every trial of a search measures the
    same steps over the same batches (same effective batch, same seeded order, same step count), so step i of one
    trial and step i of another did the same work: their ratio varies only with noise (clocks, scheduling, other
    jobs), not with the batches' lengths. None when the steps do not pair up: another step count, packing (other
    batches), or another number of data loader workers (a loader that prefetches moves the waiting between steps, so
    step i of one trial is not step i of the other; their windows' totals are what compares)."""
    ta, tb = a.step_times_s, b.step_times_s
    if len(ta) < 3 or len(ta) != len(tb) or min(ta + tb) <= 0:
        return None
    if a.candidate.packing != b.candidate.packing or a.candidate.dataloader_num_workers != b.candidate.dataloader_num_workers:
        return None
    logs = [math.log(x / y) for x, y in zip(ta, tb)]
    spread = statistics.stdev(logs) / math.sqrt(len(logs))
    return 100.0 * (math.exp(2.0 * spread) - 1.0)


def margin_pct(a: TrialResult, b: TrialResult) -> float:
    """How much faster one of the two must be to count as faster: the noise floor, or the paired noise when larger."""
    return max(NOISE_FLOOR_PCT, paired_noise_pct(a, b) or 0.0)


def faster(a: TrialResult, b: TrialResult, metric: str) -> bool:
    """a is faster than b by more than the noise."""
    ta, tb = a.throughput(metric), b.throughput(metric)
    if ta is None:
        return False
    if tb is None:
        return True
    return ta > tb * (1.0 + margin_pct(a, b) / 100.0)


def extras(candidate: Candidate, base: Candidate) -> int:
    """What a candidate asks beyond the run's own settings: fp16 instead of bf16 (loss scaling), torch.compile
    (compile time at every start), checkpointing (recomputation), offloading (copies), other worker counts (processes,
    memory), another strategy than the launch config's (another config to launch)."""
    return (int(candidate.precision != base.precision) + int(candidate.strategy != base.strategy)
            + int(candidate.torch_compile and not base.torch_compile)
            + int(candidate.gradient_checkpointing and not base.gradient_checkpointing)
            + int(candidate.offload_activations and not base.offload_activations)
            + int(candidate.dataloader_num_workers != base.dataloader_num_workers))


@dataclass(frozen=True)
class Choice:
    winner: TrialResult | None
    reasons: tuple[str, ...]


def choose(results: Iterable[TrialResult], metric: str, base: Candidate) -> Choice:
    """The fastest candidate that fits with headroom. Among those within the noise of the fastest, the one that
    asks least beyond the run's own settings (``extras``), then the fastest: a 1% gain by noise is no reason
    to switch to fp16 or to compile."""
    results = list(results)
    fitting = [r for r in results if r.fits and r.throughput(metric)]
    if not fitting:
        return Choice(None, (_nothing_fits(results),))
    fastest = max(fitting, key=lambda r: r.throughput(metric))
    close = [r for r in fitting if not faster(fastest, r, metric)]
    winner = min(close, key=lambda r: (extras(r.candidate, base), -r.throughput(metric)))
    reasons = [f"fastest that fits: {_speed(winner, metric)} with {winner.candidate.describe()}"]
    if winner is not fastest:
        reasons.append(f"{fastest.candidate.describe()} measured {_speed(fastest, metric)}, within the noise "
                       f"({margin_pct(fastest, winner):.1f}%), and asks more of the run ({_extras_text(fastest.candidate, base)})")
    runner_up = _runner_up(fitting, winner, metric)
    if runner_up is not None:
        gain = 100.0 * (winner.throughput(metric) / runner_up.throughput(metric) - 1.0)
        reasons.append(f"next: {runner_up.candidate.describe()} at {_speed(runner_up, metric)} ({gain:+.1f}%)")
    excluded = [r for r in results if r.ran and not r.fits]
    if excluded:
        reasons.append("not eligible: " + "; ".join(f"{r.candidate.describe()}: {r.verdict()}" for r in excluded))
    return Choice(winner, tuple(reasons))


def _speed(result: TrialResult, metric: str) -> str:
    if metric == "tokens/s" and result.tokens_per_s:
        return f"{result.tokens_per_s:,.0f} tokens/s"
    return f"{result.samples_per_s:,.1f} samples/s"


def _extras_text(candidate: Candidate, base: Candidate) -> str:
    found = []
    if candidate.precision != base.precision:
        found.append(f"{candidate.precision} instead of {base.precision}")
    if candidate.torch_compile and not base.torch_compile:
        found.append("torch.compile")
    if candidate.gradient_checkpointing and not base.gradient_checkpointing:
        found.append("gradient checkpointing")
    if candidate.offload_activations and not base.offload_activations:
        found.append("activation offloading")
    if candidate.dataloader_num_workers != base.dataloader_num_workers:
        found.append(f"{candidate.dataloader_num_workers} workers instead of {base.dataloader_num_workers}")
    if candidate.strategy != base.strategy:
        own = "the config's own strategy"
        found.append(f"{candidate.strategy or own} instead of {base.strategy or own}: another launch config")
    return ", ".join(found) or "nothing more"


def _runner_up(fitting: Sequence[TrialResult], winner: TrialResult, metric: str) -> TrialResult | None:
    others = [r for r in fitting if r is not winner]
    return max(others, key=lambda r: r.throughput(metric)) if others else None


def _nothing_fits(results: Sequence[TrialResult]) -> str:
    ran = [r for r in results if r.ran]
    if not ran:
        return "no candidate ran (see the skipped ones and their reasons)"
    return ("no candidate fits: every one that ran " + ", ".join(sorted({r.verdict() for r in ran}))
            + "; lower max_length / image_size, use a smaller global batch, or a larger GPU")
