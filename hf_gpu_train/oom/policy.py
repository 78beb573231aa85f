"""The micro-batch policy of in-place OOM recovery: one place decides how many samples a training micro-step or a
prediction step runs at once, for training and evaluation alike.

- **Shrink** on an out-of-memory error: the micro-batch halves, and the same samples run again in micro-batches.
- **Grow back** after ``grow_after_steps`` clean optimizer steps: the micro-batch doubles (the whole batch again once it
  reaches it). A grown micro-batch that runs out of memory again halves and doubles the wait, so a batch that does not
  fit is tried less and less often.
- **Agree** across ranks: every rank runs the smallest micro-batch any rank needed (told by the ballots in a step, by
  one all-reduce after an evaluation), so every rank counts the same clean steps and grows at the same step.
- **Ranges**: the samples ``[start, stop)`` a micro-step or a prediction step is cut into, the same function for both;
  a micro-batch whose samples add nothing to what the loss averages over (no labelled token: its own mean is 0/0) is
  joined to its neighbour where the caller says what each sample adds.

The sizes live in ``OOMRecoveryState``, saved with every checkpoint for the record. Training and evaluation keep
separate sizes: an evaluation that ran out of memory does not shrink the training micro-batch, nor the reverse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .lockstep import NO_LIMIT
from .microbatch import Rows

log = logging.getLogger("hf_gpu_train.oom")
GROW_AFTER_STEPS = 50  # clean optimizer steps at a smaller micro-batch before trying twice as many samples again


class OOMRecoveryState(TrainerCallback, ExportableState):
    """The micro-batch sizes, saved in ``trainer_state.json`` with every checkpoint: what the run needed, for the record.
    A resumed run reads them, says them, and starts at the configured batch (it may run on another machine, with more
    memory; an OOM there recovers again, in place). Data only: with ``restore_callback_states_from_checkpoint=True`` the Trainer replaces this object by a
    new one built from the checkpoint, and the recovery finds the new one (``recovery._RecoveryHooks``)."""

    def __init__(self):
        self.micro_batch: int | None = None
        self.eval_micro_batch: int | None = None
        self.recoveries = 0

    def state(self) -> dict:
        return {"args": {}, "attributes": {"micro_batch": self.micro_batch, "eval_micro_batch": self.eval_micro_batch,
                                           "recoveries": self.recoveries}}

    def restore_from(self, trainer_state) -> None:
        """The sizes recorded in a checkpoint's ``trainer_state.json``, for a Trainer that does not restore callback
        states itself."""
        saved = (trainer_state.stateful_callbacks or {}).get(OOMRecoveryState.__name__)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        for key, value in ((saved or {}).get("attributes") or {}).items():
            setattr(self, key, value)


class MicroBatchPolicy:
    """The training and evaluation micro-batch sizes (``None``: the whole batch at once) and every change of them. Each
    change is a warning (one's own Trainer hides ``INFO``); every shrink, and every training micro-batch adopted from
    another rank, is an event in ``events`` too (tune and the benchmarks read them).

    ``global_step()``: the Trainer's optimizer step now, for the events and the warnings."""

    def __init__(self, global_step: Callable[[], int], grow_after_steps: int | None = GROW_AFTER_STEPS):
        self.state = OOMRecoveryState()
        self.global_step = global_step
        self.grow_after_steps = grow_after_steps or None
        self._grow_wait = self.grow_after_steps  # doubles each time a grown micro-batch runs out of memory again
        self._grown = False  # the micro-batch grew and has not yet run a whole wait since
        self.clean_steps = 0
        self.events: list[dict] = []
        self._whole_batch = 0  # the largest training batch seen: what a grown micro-batch stops at

    # -- the sizes -----------------------------------------------------------------------------------------------------
    @property
    def micro_batch(self) -> int | None:
        return self.state.micro_batch

    @property
    def eval_micro_batch(self) -> int | None:
        return self.state.eval_micro_batch

    def saw_training_batch(self, size: int) -> None:
        """A training micro-step of ``size`` samples begins: the largest is the whole batch a grown micro-batch stops at
        (an epoch's short last batch is not it)."""
        self._whole_batch = max(self._whole_batch, size)

    def training_micro_batch(self, size: int) -> int:
        """The micro-batch a training micro-step of ``size`` samples runs now."""
        return min(self.state.micro_batch or size, size)

    def evaluation_micro_batch(self, size: int) -> int:
        return min(self.state.eval_micro_batch or size, size)

    def begin_training(self) -> None:
        """A new ``train()``: sizes recorded in a checkpoint are said, and the run starts at the configured batch (it may
        run on another machine, or with more memory free; a new OOM recovers again, in place)."""
        recorded = {"training": self.state.micro_batch, "evaluation": self.state.eval_micro_batch}
        recorded = {phase: size for phase, size in recorded.items() if size}
        if recorded:
            log.warning("OOM recovery: the checkpoint recorded micro-batch %s after an out-of-memory error; this run "
                        "starts at the configured batch (a new OOM recovers again, in place)",
                        " and ".join(f"{size} in {phase}" for phase, size in recorded.items()))
            self.state.micro_batch = self.state.eval_micro_batch = None
        self.clean_steps, self._grow_wait, self._grown = 0, self.grow_after_steps, False

    # -- shrink --------------------------------------------------------------------------------------------------------
    def shrink(self, micro: int, size: int, failure: str | None, phase: str) -> None:
        """An OOM at ``micro`` samples (of a batch of ``size``) in ``phase`` ("train" or "eval"): half as many."""
        new = max(1, micro // 2)
        key = "micro_batch" if phase == "train" else "eval_micro_batch"
        setattr(self.state, key, new)
        self.state.recoveries += 1
        if phase == "train":  # an evaluation OOM must not move when this rank grows the training micro-batch back
            self._lowered()
        event = {"step": self.global_step(), "phase": phase, "batch": size, "from": micro, "to": new,
                 "cause": failure or "out of memory on another rank"}
        self.events.append(event)
        log.warning("OOM recovery (%s, step %d): %s; retrying the same %d samples as micro-batches of %d",
                    phase, event["step"], event["cause"], size, new)

    def _lowered(self) -> None:
        """The training micro-batch went down: count clean steps from here; a grown micro-batch that failed before a
        whole wait passed makes the next wait twice as long (growing costs at most a recomputed step, and less and
        less often)."""
        self.clean_steps = 0
        if self._grown and self._grow_wait:
            self._grow_wait *= 2
        self._grown = False

    # -- grow back -----------------------------------------------------------------------------------------------------
    def optimizer_step_done(self) -> None:
        """After each optimizer step: grow the micro-batch back after ``_grow_wait`` clean steps. Every rank counts the
        same steps (each shrinks or adopts the smallest micro-batch at the same ballot), so they grow at the same step."""
        if self.state.micro_batch is None:
            return
        self.clean_steps += 1
        if self._grow_wait and self.clean_steps >= self._grow_wait:
            if self._grown:  # the grown micro-batch ran a whole wait: the next growth waits the configured time again
                self._grow_wait = self.grow_after_steps
            grown = self.state.micro_batch * 2  # a new OOM halves it again, in place
            self.state.micro_batch = None if grown >= self._whole_batch else grown  # None: the whole batch at once
            self.clean_steps, self._grown = 0, True
            log.warning("OOM recovery: %d clean steps, trying micro-batch %s", self._grow_wait,
                        self.state.micro_batch or f"{self._whole_batch} (the whole batch)")

    # -- agree across ranks --------------------------------------------------------------------------------------------
    def adopt(self, agreed: int | None, size: int) -> None:
        """Every rank runs the smallest training micro-batch any rank needed (``agreed``: the ballot's)."""
        if agreed is None or agreed >= NO_LIMIT or (self.state.micro_batch is not None and self.state.micro_batch <= agreed):
            return
        current = self.state.micro_batch or size
        self.state.micro_batch = agreed
        self._lowered()
        step = self.global_step()
        self.events.append({"step": step, "phase": "train", "batch": size, "from": current, "to": agreed,
                            "cause": "out of memory on another rank"})
        log.warning("OOM recovery (step %d): another rank ran out of memory; every rank now runs micro-batches of %d",
                    step, agreed)

    def adopt_eval(self, agreed: int | None) -> None:
        """Every rank evaluates in the smallest evaluation micro-batch any rank needed in this prediction step."""
        if agreed is not None and agreed < NO_LIMIT and (self.state.eval_micro_batch is None or agreed < self.state.eval_micro_batch):
            log.warning("OOM recovery (eval, step %d): another rank ran out of memory; every rank now evaluates in "
                        "micro-batches of %d", self.global_step(), agreed)
            self.state.eval_micro_batch = agreed

    def agree_on_eval_micro_batch(self, num_processes: int, device) -> None:
        """After an evaluation every rank takes the smallest evaluation micro-batch any rank needed."""
        if num_processes < 2 or not torch.distributed.is_initialized():
            return
        mine = torch.tensor([-(self.state.eval_micro_batch or NO_LIMIT)], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
        smallest = -int(mine.item())
        if smallest < NO_LIMIT and smallest != self.state.eval_micro_batch:
            log.warning("OOM recovery: another rank ran out of memory in evaluation; every rank now evaluates in "
                        "micro-batches of %d", smallest)
        self.state.eval_micro_batch = None if smallest >= NO_LIMIT else smallest

    # -- ranges --------------------------------------------------------------------------------------------------------
    @staticmethod
    def ranges(size: int, start: int, micro: int, counts: list[float] | None = None) -> list[tuple[int, int]]:
        """Micro-batches of at most ``micro`` of ``size`` samples, from ``start``. ``counts`` (what each sample adds to
        what the loss averages over, for a mean over labelled tokens): a micro-batch that adds nothing (its own mean is
        0/0) is joined to its neighbour."""
        ranges = [(begin, min(size, begin + micro)) for begin in range(start, size, micro)]
        if counts is None:
            return ranges
        joined: list[tuple[int, int]] = []
        for begin, stop in ranges:
            if joined and (sum(counts[begin:stop]) == 0 or sum(counts[joined[-1][0]:joined[-1][1]]) == 0):
                joined[-1] = (joined[-1][0], stop)
            else:
                joined.append((begin, stop))
        return joined

    def cut(self, layout: Rows, inputs: Mapping[str, Any], micro: int) -> list[dict[str, Any]]:
        """The batch itself in micro-batches of at most ``micro`` samples (``ranges`` from the first, not joined)."""
        return [layout.slice(inputs, start, stop) for start, stop in self.ranges(layout.size(inputs), 0, micro)]
