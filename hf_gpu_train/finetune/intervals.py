"""``eval_strategy=auto`` / ``save_strategy=auto``: evaluate and checkpoint every ``checkpoint_minutes`` of training,
and at the end; not every epoch. ``checkpoint_minutes=auto`` (the default): the interval that minimises saving plus
lost work (``plan/checkpoint_interval.py``: Young/Daly from a save's blocked time and the expected time between
failures, ``mtbf_hours`` or the default for the run's GPU count), planned at calibration from an estimate of the save
(the checkpoint's bytes at host-copy speed) and again after every save from its measured blocked time.

A checkpoint (weights, optimizer state, RNG) and an evaluation pass per epoch cost ~15% of a short run on 2 CPU
cores; a run shorter than the interval pays for one evaluation at the end and its final model, and a killed run is
simply run again (same seed, same result). A long run loses at most ``checkpoint_minutes`` to a crash.

The interval is turned into a number of optimizer steps once, after ``CALIBRATION_STEPS`` steps, from the slowest
rank's step time (one all-reduce, once): every rank then saves at the same steps, as saving under FSDP needs. The clock
starts at the first step: what runs at train begin (the evaluation before training, evaluate_before.py) is not a step.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from ..faults.checkpoint_costs import CheckpointCosts, slowest_rank
from ..plan.checkpoint_interval import plan_interval

CALIBRATION_STEPS = 10
STAGING_BYTES_PER_S = 2e9  # the estimate of a save's blocked time before one is measured: a host memory copy


def steps_for(minutes: float, seconds_per_step: float) -> int:
    return max(1, round(minutes * 60.0 / max(seconds_per_step, 1e-9)))


def estimated_save_seconds(model) -> float:
    """A save's blocked time before any was measured: the weights and two optimizer moments copied at host speed."""
    def count(p) -> int:  # ZeRO-3 partitions a parameter to an empty tensor: its ds_numel is the whole
        return int(getattr(p, "ds_numel", 0) or p.numel())

    parameters = sum(count(p) * p.element_size() for p in model.parameters()) if model is not None else 0
    trained = sum(count(p) * 4 for p in model.parameters() if p.requires_grad) if model is not None else 0
    return (parameters + 2 * trained) / STAGING_BYTES_PER_S


class EveryFewMinutes(TrainerCallback):
    """``minutes``: a fixed interval; None: planned (Young/Daly) from ``costs`` (the run's ``CheckpointCosts``)."""
    hears_of_staged_saves = True  # its on_save is about the training, not the files (background_save.py)


    def __init__(self, minutes: float | None, evaluate: bool, save: bool, costs: CheckpointCosts | None = None,
                 mtbf_hours: float | None = None, say=print):
        self.minutes = minutes
        self.evaluate = evaluate
        self.save = save
        self.costs = costs if costs is not None else CheckpointCosts()
        self.mtbf_hours = mtbf_hours
        self.say = say
        self.write_seconds = lambda: 0.0  # the newest background write's seconds (run.py sets it once the Trainer is built)
        self.every: int | None = None  # optimizer steps between checkpoints, once calibrated
        self.seconds_per_step: float | None = None
        self._start: float | None = None
        self._start_step = 0
        self._said = False

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
            self.seconds_per_step = slowest_rank((time.perf_counter() - self._start) / done, args)
            self._plan(args, estimated_save_seconds(kwargs.get("model")), "estimated")
        if self.every is not None and state.global_step % self.every == 0:
            control.should_evaluate = control.should_evaluate or self.evaluate
            control.should_save = control.should_save or self.save
        return control

    def on_save(self, args, state, control, **kwargs):
        # CheckpointCosts (before this callback) measured this save on every rank alike: the interval from it
        if self.minutes is None and self.seconds_per_step is not None and self.costs.blocked_s:
            self._plan(args, self.costs.blocked_s[-1], "measured")
        return control

    def _plan(self, args, save_seconds: float, how: str) -> None:
        if self.minutes is not None:
            self.every = steps_for(self.minutes, self.seconds_per_step)
            return
        # every input agreed (the slowest rank's), so every rank plans the same steps
        save_seconds = slowest_rank(save_seconds, args)
        plan = plan_interval(save_seconds, self.mtbf_hours, max(1, args.world_size), write_s=slowest_rank(self.write_seconds(), args))
        self.costs.plan = plan
        every = steps_for(plan.interval_s / 60.0, self.seconds_per_step)
        if every != self.every and args.process_index == 0 and (not self._said or how == "measured" and self.every
                                                                and abs(every - self.every) > 0.2 * self.every):
            self.say(f"hf_gpu_train: {plan.line()}: every {every} steps ({how} save)")
            self._said = True
        self.every = every


def interval_callbacks(eval_strategy: str, save_strategy: str, minutes: float | str, mtbf_hours: float | None = None,
                       costs: CheckpointCosts | None = None) -> list:
    """The callbacks of ``*_strategy=auto`` (none when neither is auto); ``minutes``: a number or ``"auto"``."""
    evaluate, save = eval_strategy == "auto", save_strategy == "auto"
    fixed = None if minutes == "auto" else float(minutes)
    return [EveryFewMinutes(fixed, evaluate, save, costs, mtbf_hours)] if evaluate or save else []
