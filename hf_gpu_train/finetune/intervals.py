"""``eval_strategy=auto`` / ``save_strategy=auto``: evaluate and checkpoint every ``checkpoint_minutes`` of training,
and at the end; not every epoch.

A checkpoint (weights, optimizer state, RNG) and an evaluation pass per epoch cost ~15% of a short run on 2 CPU
cores; a run shorter than the interval pays for one evaluation at the end and its final model, and a killed run is
simply run again (same seed, same result). A long run loses at most ``checkpoint_minutes`` to a crash.

The interval is turned into a number of optimizer steps once, after ``CALIBRATION_STEPS`` steps, from the slowest
rank's step time (one all-reduce, once): every rank then saves at the same steps, as saving under FSDP needs. The clock
starts at the first step: what runs at train begin (the evaluation before training, evaluate_before.py) is not a step.
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

CALIBRATION_STEPS = 10


def steps_for(minutes: float, seconds_per_step: float) -> int:
    return max(1, round(minutes * 60.0 / max(seconds_per_step, 1e-9)))


class EveryFewMinutes(TrainerCallback):
    def __init__(self, minutes: float, evaluate: bool, save: bool):
        self.minutes = minutes
        self.evaluate = evaluate
        self.save = save
        self.every: int | None = None  # optimizer steps between checkpoints, once calibrated
        self._start: float | None = None
        self._start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = None  # timed from the first step: not the evaluation before training, nor a resume's loading
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if self._start is None:
            self._start, self._start_step = time.perf_counter(), state.global_step
        return control

    def on_step_end(self, args, state, control, **kwargs):
        done = state.global_step - self._start_step
        if self.every is None and done >= CALIBRATION_STEPS:
            self.every = steps_for(self.minutes, self._slowest((time.perf_counter() - self._start) / done, args))
        if self.every is not None and state.global_step % self.every == 0:
            control.should_evaluate = control.should_evaluate or self.evaluate
            control.should_save = control.should_save or self.save
        return control

    @staticmethod
    def _slowest(seconds_per_step: float, args) -> float:
        if args.world_size < 2 or not torch.distributed.is_initialized():
            return seconds_per_step
        mine = torch.tensor([seconds_per_step], dtype=torch.float64, device=args.device)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
        return float(mine.item())


def interval_callbacks(eval_strategy: str, save_strategy: str, minutes: float) -> list:
    evaluate, save = eval_strategy == "auto", save_strategy == "auto"
    return [EveryFewMinutes(minutes, evaluate, save)] if evaluate or save else []
