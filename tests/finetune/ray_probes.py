"""Trainer callbacks the Ray tests hand to ``ray_train.fit(callbacks=...)``: pickled to the Ray workers, so they live in
a module the workers import (the driver's sys.path reaches them). Each acts on one rank, chosen by ``RANK``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from transformers import TrainerCallback

from hf_gpu_train.oom import OOMFaultInjector


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class InjectOOM(TrainerCallback):
    """An OOM in the backward of one training step on ``rank``, after ``start_after`` forwards: the recovery splits it."""

    def __init__(self, rank: int, max_batch: int, start_after: int):
        self.rank, self.max_batch, self.start_after = rank, max_batch, start_after
        self.injector = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.injector = OOMFaultInjector(max_batch=self.max_batch, rank=self.rank, phase="backward", times=1,
                                         start_after=self.start_after).install(model)

    def on_train_end(self, args, state, control, **kwargs):
        if _rank() == self.rank:  # what the worker saw, for the test
            Path(args.output_dir, f"oom-raised-rank{self.rank}.txt").write_text(str(self.injector.raised))


class KillOnce(TrainerCallback):
    """SIGKILL ``rank`` at the end of ``step``, once (``marker`` remembers it across Ray's restart of the group)."""

    def __init__(self, rank: int, step: int, marker: str):
        self.rank, self.step, self.marker = rank, step, marker

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and _rank() == self.rank and not Path(self.marker).exists():
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class StepLog(TrainerCallback):
    """Rank 0 appends "pid step" for each step it finishes: which attempt trained which steps."""

    def __init__(self, path: str):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        if _rank() == 0:
            with open(self.path, "a") as f:
                f.write(f"{os.getpid()} {state.global_step}\n")


class HangAt(TrainerCallback):
    """``rank`` stops making progress after ``step`` (a loader that never returns, as far as the others can tell)."""

    def __init__(self, rank: int, step: int, seconds: float = 600.0):
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and _rank() == self.rank:
            time.sleep(self.seconds)
