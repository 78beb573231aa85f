"""What checkpointing costs a run, and what failures cost it, measured: a TrainerCallback for anyone's Trainer.

- Each save's blocked time: from the moment the Trainer stops training to save (the step's end, or the end of the
  evaluation the Trainer runs first) to ``on_save`` (told at once for a background save: its staging's time). The
  slowest rank's, agreed at ``on_save`` (every rank saves).
- The work lost to failures: the main process notes its progress (step, time) in ``output_dir`` at most every
  ``PROGRESS_EVERY_S``; a run that starts from a checkpoint older than the noted step lost the steps in between
  (a stop signal's resume loses none: its checkpoint is the step it stopped at).
- At the end, ``CHECKPOINTING_RECORD`` in ``output_dir``: the saves, their blocked seconds, the lost work of every
  restart so far, and what the interval plan expected (``plan/checkpoint_interval.py``), for the run report.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from transformers import TrainerCallback

from ..report.story import CHECKPOINTING_RECORD

PROGRESS_FILE = "hf_gpu_train_progress.json"
PROGRESS_EVERY_S = 10.0


def _write_json(path: Path, data: dict) -> None:
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a record for the report; a full disk is the save's to report


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def slowest_rank(value: float, args) -> float:
    """The largest ``value`` over every rank (one all-reduce on the training's device; every rank calls it at the same
    point): a figure every rank plans with alike."""
    import torch

    if args.world_size < 2 or not torch.distributed.is_initialized():
        return value
    mine = torch.tensor([value], dtype=torch.float64, device=args.device)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    return float(mine.item())


class CheckpointCosts(TrainerCallback):
    hears_of_staged_saves = True  # its on_save is about the training, not the files (background_save.py)

    def __init__(self):
        self.blocked_s: list[float] = []
        self.plan = None  # the CheckpointInterval in use (``finetune/intervals.py`` sets it)
        self.training_s = 0.0
        self._stopped: float | None = None  # when the Trainer stopped training this step (to evaluate or save)
        self._step_began: float | None = None
        self._noted = 0.0
        self.lost: list[dict] = []

    # --- lost work: noted progress against the step a run starts from
    def on_train_begin(self, args, state, control, **kwargs):
        progress = _read_json(Path(args.output_dir) / PROGRESS_FILE)
        self.lost = list(progress.get("lost", []))
        reached = int(progress.get("step", 0) or 0)
        if reached > state.global_step and args.process_index == 0:
            per_step = float(progress.get("seconds_per_step", 0.0) or 0.0)
            self.lost.append({"from_step": reached, "resumed_at": state.global_step, "steps": reached - state.global_step,
                              "seconds": round((reached - state.global_step) * per_step, 3), "time": time.time()})
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_began = time.perf_counter()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._step_began is not None:
            self.training_s += now - self._step_began
        self._stopped = now
        if args.process_index == 0 and now - self._noted >= PROGRESS_EVERY_S:
            self._noted = now
            self.note_progress(args, state)
        return control

    def note_progress(self, args, state) -> None:
        per_step = self.training_s / max(1, state.global_step)
        _write_json(Path(args.output_dir) / PROGRESS_FILE, {"step": state.global_step, "time": time.time(),
                                                            "seconds_per_step": per_step, "lost": self.lost})

    def on_evaluate(self, args, state, control, **kwargs):
        self._stopped = time.perf_counter()  # the save, if one follows, starts now
        return control

    def on_save(self, args, state, control, **kwargs):
        # every rank saves here: the vote is every rank's whatever it measured (a background save is told at once:
        # the time is its staging's)
        blocked = time.perf_counter() - self._stopped if self._stopped is not None else 0.0
        self.blocked_s.append(slowest_rank(blocked, args))
        self._stopped = None
        if args.process_index == 0:
            self.note_progress(args, state)  # a checkpoint: the progress a failure from here on is measured against
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if args.process_index != 0:
            return control
        self.note_progress(args, state)
        plan = self.plan
        record = {"saves": len(self.blocked_s), "blocked_seconds": [round(s, 4) for s in self.blocked_s],
                  "training_seconds": round(self.training_s, 3), "lost": self.lost}
        if plan is not None:
            record["plan"] = {"interval_s": round(plan.interval_s, 2), "save_cost_s": round(plan.save_cost_s, 4),
                              "write_s": round(plan.write_s, 3), "mtbf_s": round(plan.mtbf_s), "mtbf_source": plan.mtbf_source,
                              "capped": plan.capped, "expected_saving_fraction": plan.saving_fraction,
                              "expected_lost_per_failure_s": plan.expected_loss_per_failure_s,
                              "expected_failures": plan.expected_failures(self.training_s)}
        _write_json(Path(args.output_dir) / CHECKPOINTING_RECORD, record)
        return control

