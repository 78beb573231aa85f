"""Timing one trial's measured steps: from the end of the last warm-up step to the end of the last measured step,
each end after a device sync, so a GPU's queued work is inside the window and not after it.

The trial's Trainer logs once, after the last step (``logging_steps`` is set past it), so no logging, no
``.item()`` and no telemetry gather happens inside the window. Tokens are counted by a ``TokenCounter`` of our own
(read at the two syncs only); step times and data waits come from the telemetry callback's ``LoopTimer``, sliced
to the measured steps.

How many steps are measured is decided once per search, in its first trial: after ``PROBE_STEPS`` measured steps
the first process's step time gives the count (``decide``), every process receives it, and the Trainer stops there.
Every later trial measures the same steps, so their batches are the same and their step times pair up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import TrainerCallback

from ..callbacks.devices import model_device
from ..callbacks.tokens import TokenCounter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PROBE_STEPS = 3


def _broadcast(value: int) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


class TrialMeter(TrainerCallback):
    """``measure_steps`` None: decided by ``decide(step_time_s)`` after ``PROBE_STEPS`` (the Trainer's max_steps must
    leave room for the largest count ``decide`` returns)."""

    def __init__(self, warmup_steps: int, measure_steps: int | None, telemetry, decide: Callable[[float], int] | None = None):
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.decide = decide
        self.timer = telemetry.timer  # the telemetry callback's LoopTimer (added before this callback)
        self.tokens = TokenCounter()
        self.device = torch.device("cpu")
        self.began: float | None = None
        self.start: float | None = None  # end of the warm-up
        self.end: float | None = None  # end of the measured steps
        self.measured_tokens = 0
        self.step_times: list[float] = []  # each measured step with the gap before it
        self.data_waits: list[float] = []
        self._marks = (0, 0, 0)

    @property
    def measured_s(self) -> float | None:
        return None if self.start is None or self.end is None else self.end - self.start

    @property
    def warmup_s(self) -> float | None:
        return None if self.began is None or self.start is None else self.start - self.began

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.device = model_device(model)
        if model is not None:
            self.tokens.install(model)
        self.began = time.perf_counter()
        return control

    def on_substep_end(self, args, state, control, **kwargs):
        self.tokens.micro_step_done()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.tokens.micro_step_done()
        step = state.global_step - self.warmup_steps
        if step == 0:
            _sync(self.device)
            self.tokens.take()
            self._marks = (len(self.timer.step_times), len(self.timer.gaps), len(self.timer.data_waits))
            self.start = time.perf_counter()
        if self.measure_steps is None and step == PROBE_STEPS:
            _sync(self.device)
            self.measure_steps = _broadcast(self.decide((time.perf_counter() - self.start) / PROBE_STEPS))
        if self.measure_steps is not None and step == self.measure_steps:
            _sync(self.device)
            self.end = time.perf_counter()
            self.measured_tokens = self.tokens.take()
            steps, gaps = self.timer.step_times[self._marks[0]:], self.timer.gaps[self._marks[1]:]
            self.step_times = [s + g for s, g in zip(steps, gaps)]
            self.data_waits = list(self.timer.data_waits[self._marks[2]:])
            control.should_training_stop = True
        return control

    def close(self) -> None:
        self.tokens.remove()
