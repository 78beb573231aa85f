"""Keep every rank in the same collectives while one of them recovers from an out-of-memory error.

Other people's training code issues collectives inside a step: TRL's ``SFTTrainer.compute_loss`` calls
``accelerator.gather_for_metrics`` three or four times per call, ``DPOTrainer`` as many, a user's subclass may
call ``dist.all_reduce`` itself. When one rank runs out of memory and runs its batch again as micro-batches, it
calls that code once per micro-batch, and the other ranks (which called it once) wait in a collective that
will never be matched: a hang (seen with TRL 1.16 on 2 gloo processes until the launch was killed).

The fix is a small vote, a *ballot*, taken by every rank before each collective issued inside a recovered
step and at the end of every micro-step, on a process group of its own (gloo, so the ballot is a CPU
all-reduce with no device sync, and it can never pair with a collective of the user's or of the gradient
buckets). A rank that ran out of memory says so at its next ballot; the ballot then tells every rank to
abandon the attempt (``RestartStep`` is raised out of the collective that was about to run, before it ran), and
every rank runs the step again from its first sample in micro-batches of the same size. So every rank issues
the same collectives, in the same order, with the same shapes, whatever the user's code gathers.

A ballot carries, per rank: where it was taken (before a collective, or at the end of a micro-step), whether
this rank ran out of memory since its last ballot and has not finished the micro-step (a restart), whether its
gradient round is unusable (a rank that recovered alone and finished: only the buckets are reduced again), a
fatal error (no room for one sample), a gradient accumulated twice, the micro-batch it can run, and which
parameters it gave a gradient to. Ranks at different kinds of ballot with nobody failing have taken different
paths through their own code: every rank raises ``RanksDiverged`` instead of hanging.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..collectives.wait_clock import waiting
from ..collectives.wrappers import on_default_group, raw, unwrap_collectives, wrap_collectives

NO_LIMIT = 2**31 - 1  # "the whole batch" in the micro-batch vote
GATE, END = 1, 2  # where a ballot is taken: before a collective, at the end of a micro-step


class Cost:
    """Where the recovery's own per-step work goes, over the process's life (read by benchmarks/oom_overhead.py and
    scripts/gpu_check.py): what decides its cost on a fast GPU is CPU time, not the all-reduces DDP makes too."""

    def __init__(self):
        self.hook_s = 0.0  # gradient hooks: counting what is ready, launching buckets (copies into them included)
        self.apply_s = 0.0  # the averaged buckets written into .grad
        self.ballot_s = 0.0  # inside ballots, waiting for the slower rank included
        self.ballots = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


COST = Cost()


class RestartStep(BaseException):  # noqa: N818 (control flow, not an error the user sees)
    """Raised on every rank out of a ballot that found a rank which must start the step again. A BaseException, so
    code that catches ``Exception`` around its own collective (and would then run it on this rank alone) lets it by."""

    def __init__(self, outcome: Outcome):
        super().__init__("a rank ran out of memory: every rank starts this step again in micro-batches")
        self.outcome = outcome


class RanksDiverged(RuntimeError):
    """The ranks are not at the same point of the step, and none of them ran out of memory."""


@dataclass(frozen=True)
class Outcome:
    restart: bool  # some rank ran out of memory mid-step: every rank runs the step again from its first sample
    failed: bool  # some rank's gradient round is unusable: nobody applies the averaged gradients
    fatal: bool  # some rank cannot fit one sample: every rank stops
    stale: bool  # some rank accumulated a gradient after its bucket left
    micro_batch: int | None  # the smallest micro-batch any rank asks for (None: the whole batch)
    diverged: bool = False  # ranks at different kinds of ballot with nobody failing
    used: tuple[bool, ...] = field(default=())


class Lockstep:
    """The ballots of one Trainer's recovery. ``attempt()`` marks the code of a step: collectives issued inside
    it by anyone's code pass a ballot first."""

    def __init__(self, num_params: int, group=None):
        self.num_params = num_params
        self.group = group if group is not None else dist.new_group(backend="gloo")  # every rank, at the same step
        self.pending_failure = False  # ran out of memory since the last ballot and has not finished the micro-step
        self.micro_batch: int | None = None  # what this rank can run, told at every ballot
        self.ballots = 0
        self._inside_collective = False

    def ballot(self, where: int, failed: bool = False, fatal: bool = False, stale: bool = False,
               used: list[bool] | None = None) -> Outcome:
        restart = self.pending_failure
        box = [where, -where, int(restart), int(failed), int(fatal), int(stale), -(self.micro_batch or NO_LIMIT)]
        box += [int(u) for u in used] if used is not None else [0] * self.num_params
        began = time.perf_counter()
        votes = torch.tensor(box, dtype=torch.int64)
        with waiting():
            raw.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        counts = votes.tolist()
        self.ballots += 1
        COST.ballot_s += time.perf_counter() - began
        COST.ballots += 1
        highest, lowest = counts[0], -counts[1]
        smallest = -counts[6]
        restart, fatal = bool(counts[2]), bool(counts[4])
        return Outcome(restart=restart, failed=bool(counts[3]), fatal=fatal, stale=bool(counts[5]),
                       micro_batch=None if smallest >= NO_LIMIT else smallest,
                       diverged=highest != lowest and not (restart or fatal), used=tuple(bool(u) for u in counts[7:]))

    def gate(self) -> None:
        """Before a collective of someone else's code inside a step: go on only when every rank is here too."""
        outcome = self.ballot(GATE)
        if outcome.restart or outcome.fatal:
            raise RestartStep(outcome)
        if outcome.diverged:
            raise RanksDiverged("the ranks are at different points of the training step: one is about to run a "
                                "collective (all_reduce, gather ...) that another is not, and no rank ran out of memory. "
                                "Code inside compute_loss / training_step that issues collectives must issue the same ones "
                                "on every rank")

    @contextlib.contextmanager
    def attempt(self):
        """Collectives issued by anyone's code inside this block pass a ballot first."""
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(self.group)


_ACTIVE: list[Lockstep] = []


def _gated(name: str, collective):
    def gated(*args, **kwargs):
        lockstep = _ACTIVE[-1] if _ACTIVE else None
        if lockstep is None or lockstep._inside_collective or not on_default_group(kwargs):
            return collective(*args, **kwargs)  # a sub-group's collective: not every rank takes part, so no ballot
        lockstep.gate()
        lockstep._inside_collective = True  # all_gather_object calls all_gather: one ballot per collective asked for
        try:
            return collective(*args, **kwargs)
        finally:
            lockstep._inside_collective = False

    return gated


GATE_MARK = "_hf_gpu_train_gated"


def install_gates() -> None:
    """Put the gates on ``torch.distributed``'s collectives (idempotent; ``collectives/wrappers.py``). Outside an
    ``attempt`` they call the collective at once."""
    wrap_collectives(GATE_MARK, _gated)


def remove_gates() -> None:
    if _ACTIVE:
        return
    unwrap_collectives(GATE_MARK)
