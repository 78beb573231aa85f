"""How long a scheduler must wait between "stop" and SIGKILL for a run to save a complete checkpoint.

A job on a scheduler ends in a signal far more often than in a crash: SLURM's time limit and preemption (SIGTERM,
then SIGKILL after KillWait, 30 s by default), a Kubernetes eviction (SIGTERM to PID 1, SIGKILL after
terminationGracePeriodSeconds, 30 s by default), a spot reclaim. The run (``faults/preemption.py``) stops at the next
step boundary and saves; that takes the rest of the step in flight, the save, and the exit. The generated sbatch asks
SLURM for a warning signal that much ahead of its time limit (``--signal=B:USR1@N``), and the Kubernetes manifests
ask for that much grace.

The save time is measured by a run (``preemption.json`` in its output_dir, written after every save) when one is
given, else estimated from what the plan says a checkpoint holds (weights, optimizer states, master weights, per
GPU, times the GPUs of a machine) written at a conservative disk speed. No torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..plan.strategies import EVERYTHING, STRATEGIES

ASSUMED_WRITE_BYTES_PER_S = 200e6  # a network file system under load; a local NVMe writes 10x faster
FIXED_SECONDS = 30.0  # the step in flight, the ranks agreeing, the exit; no model at all still needs this
UNKNOWN_SAVE_SECONDS = 60.0  # no model in the plan: a guess, said as one
RECORD = "preemption.json"  # faults/preemption.py writes the measured save time here
GRACE_ENV = "HF_GPU_TRAIN_GRACE_SECONDS"  # set by the generated sbatch and manifests: seconds from the signal to SIGKILL


@dataclass(frozen=True)
class Grace:
    """``save_seconds``: how long one checkpoint save takes; ``source``: where that figure came from."""

    save_seconds: float
    source: str

    @property
    def seconds(self) -> int:
        """From the signal to every process gone: the step in flight, twice the save (a slower disk, a save that
        had just begun), the exit; rounded up to 10 s."""
        return int(math.ceil((FIXED_SECONDS + 2 * self.save_seconds) / 10.0) * 10)

    def describe(self) -> str:
        return f"{self.seconds} s (a save takes {self.save_seconds:.0f} s, {self.source}; plus the step in flight and the exit)"


def checkpoint_bytes(plan) -> float | None:
    """What the busiest machine writes in a checkpoint, from the memory plan: the weights, optimizer states and
    master weights (LoRA: the adapters and their states). What every rank holds whole (DDP's everything, the
    weights under FSDP's SHARD_GRAD_OP and ZeRO-2) is written once, by the main process; what is sharded, each rank
    writes its own shard of, so a machine writes its ranks' shards. None without a memory plan."""
    memory = getattr(plan, "memory", None)
    if memory is None:
        return None
    b = memory.breakdown
    weights = b.adapter_weights if b.method != "full" else b.weights
    states = b.optimizer + b.master_weights
    ranks = plan.processes_per_machine
    row = STRATEGIES.get(b.strategy)
    if row is not None and row.replicated:
        return weights + states
    weights_sharded = row is not None and row.shards == EVERYTHING
    return (weights * ranks if weights_sharded else weights) + states * ranks


def measured_save_seconds(output_dir: str | Path) -> float | None:
    """The longest save a run into ``output_dir`` measured (``preemption.json``), or None."""
    try:
        record = json.loads((Path(output_dir) / RECORD).read_text())
        return float(record["save_seconds_max"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def grace_for(plan, measured_from: str | Path | None = None) -> Grace:
    """The grace a job of ``plan`` needs: from a run's measured save time (``measured_from``: its output_dir) when
    there is one, else estimated from the plan's checkpoint size."""
    if measured_from is not None:
        seconds = measured_save_seconds(measured_from)
        if seconds is not None:
            return Grace(seconds, f"measured by the run in {measured_from}")
    size = checkpoint_bytes(plan)
    if size is None:
        return Grace(UNKNOWN_SAVE_SECONDS, "a guess: the plan has no model (give --model, or --save-time-from a run's output_dir)")
    return Grace(size / ASSUMED_WRITE_BYTES_PER_S,
                 f"estimated: {size / 2**30:.1f} GiB of checkpoint per machine at {ASSUMED_WRITE_BYTES_PER_S / 1e6:.0f} MB/s")
