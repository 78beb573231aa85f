"""How often to checkpoint: the interval that minimises the time a run spends saving plus the work it loses to failures.

A save blocks training for ``C`` seconds; failures come every ``M`` seconds on average; a failure loses the work since
the newest complete checkpoint (half an interval on average) plus what the save's write and the restart take. Saving
every ``tau`` seconds of training costs ``C / tau`` of the run in saves and ``(tau / 2 + W) / M`` in lost work; Young
(1974) and Daly (2006) give the ``tau`` that minimises the sum: about ``sqrt(2 C M)`` (Daly's higher-order form below,
for ``C`` not small against ``M``). A background save (``faults/background_save.py``) makes ``C`` the staging time
only, so the interval shrinks with it, but never below the write's own time ``W`` (one write in flight at a time).

``M``: the user's figure (``mtbf_hours``), else the failure rate Meta measured training Llama 3 405B (419 unexpected
interruptions in 54 days on 16,384 H100 GPUs: one per ~2,100 GPU-days, The Llama 3 Herd of Models, 2024, section
3.3.4) divided by the run's GPU count (its processes on a CPU run): a job on more GPUs fails more often. A stop signal
is not a failure here: it costs no work (``faults/preemption.py``).

The interval is capped (``CAP_MINUTES``): on one GPU the optimum is hours, and a process killed by a person, the kernel's
OOM killer or a driver fault is not in a large cluster's statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .strategies import DEEPSPEED, EVERYTHING, family_of, strategy

GPU_DAYS_PER_FAILURE = 54 * 16384 / 419  # Llama 3 405B pre-training: ~2,112 GPU-days between unexpected interruptions
MTBF_SOURCE = "Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs"
CAP_MINUTES = 60.0


def default_mtbf_hours(gpus: int) -> float:
    """The mean time between failures of a job on ``gpus`` GPUs (processes), from the Llama 3 figure."""
    return GPU_DAYS_PER_FAILURE * 24.0 / max(1, gpus)


def optimal_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) first-order-corrected optimum of the compute time between checkpoints; ``M`` when ``C >= 2M``."""
    c, m = max(save_cost_s, 0.0), mtbf_s
    if c >= 2 * m:
        return m
    if c == 0:
        return 0.0
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


@dataclass(frozen=True)
class CheckpointInterval:
    """The interval, its inputs and what it is expected to cost (fractions of the training time)."""

    interval_s: float
    save_cost_s: float  # training blocked per save
    write_s: float  # the background write after it (0: synchronous)
    mtbf_s: float
    mtbf_source: str
    capped: bool

    @property
    def saving_fraction(self) -> float:
        return self.save_cost_s / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def expected_loss_per_failure_s(self) -> float:
        """Half an interval on average, plus the write of the newest checkpoint (not yet marked while it writes)."""
        return self.interval_s / 2 + self.write_s

    @property
    def lost_fraction(self) -> float:
        return self.expected_loss_per_failure_s / self.mtbf_s

    def expected_failures(self, training_s: float) -> float:
        return training_s / self.mtbf_s

    def line(self) -> str:
        c = f"a save blocks training {self.save_cost_s:.2f} s" + (f" and writes for {self.write_s:.1f} s more" if self.write_s else "")
        return (f"checkpoints every {self.interval_s / 60:.1f} min of training ({c}; a failure every "
                f"{self.mtbf_s / 3600:.0f} h expected, {self.mtbf_source}): saving costs {100 * self.saving_fraction:.2f}% "
                f"of the training, a failure loses {self.expected_loss_per_failure_s / 60:.1f} min on average"
                + (f" (capped at {CAP_MINUTES:.0f} min: the optimum is longer)" if self.capped else ""))


def plan_interval(save_cost_s: float, mtbf_hours: float | None, gpus: int, write_s: float = 0.0,
                  cap_minutes: float = CAP_MINUTES) -> CheckpointInterval:
    """The checkpoint interval for a save that blocks ``save_cost_s`` (and writes ``write_s`` more in the background) on
    a job of ``gpus`` processes; ``mtbf_hours``: the user's figure (None: ``default_mtbf_hours``)."""
    if mtbf_hours is None:
        mtbf_s, source = default_mtbf_hours(gpus) * 3600.0, f"the default for {gpus} GPU{'s' if gpus != 1 else ''}: {MTBF_SOURCE}"
    else:
        mtbf_s, source = float(mtbf_hours) * 3600.0, "mtbf_hours"
    best = max(optimal_interval_s(save_cost_s, mtbf_s), write_s)
    capped = best > cap_minutes * 60.0
    return CheckpointInterval(min(best, cap_minutes * 60.0), save_cost_s, write_s, mtbf_s, source, capped)


def staging_bytes(breakdown, world: int) -> float:
    """Host memory a background save holds on its largest writer (``faults/background_save.py``'s buffers, kept for
    the run), from the plan's per-GPU breakdown and its strategy's family:

    - one GPU, DDP: rank 0 writes the weights and the optimizer's states (a LoRA run: its adapters and their states);
    - FSDP: every rank its shards of the same (``torch.distributed.checkpoint``'s ``async_save`` copies them to host
      memory, freshly allocated at each save);
    - DeepSpeed ZeRO: every rank its optimizer partition (fp32 master weights and states), and rank 0 the whole 16-bit
      model twice more (the engine's module states, and the model file gathered for the save: the toolkit's ZeRO-3
      config gathers it, ``stage3_gather_16bit_weights_on_model_save``)."""
    family = family_of(breakdown.strategy)
    lora = breakdown.method in ("lora", "qlora")
    if family == DEEPSPEED:
        shards_weights = strategy(breakdown.strategy).shards == EVERYTHING  # ZeRO-3: each GPU holds 1/world of them
        whole_16bit = breakdown.weights * (max(1, world) if shards_weights else 1)
        shard = breakdown.optimizer + breakdown.master_weights
        return shard + (2 * (breakdown.adapter_weights if lora else whole_16bit))
    if lora:
        return breakdown.adapter_weights + breakdown.optimizer
    return breakdown.weights + breakdown.optimizer + breakdown.master_weights
