"""Restart without a person: a launch whose rank died starts again from the newest complete checkpoint, up to a limit.

A rank that dies (the kernel's OOM killer, a segfault, an ECC error, a lost NCCL peer) ends the whole launch: accelerate
and torchrun stop every rank. Plain torchrun's ``--max-restarts`` starts the workers again whatever the failure: a usage
error or a bug that fails at the same step is restarted until the limit, each time reloading everything. Here
``hf-gpu-train launch`` starts the same command again (scripts/finetune.py resumes from the newest complete
checkpoint by itself; anyone's script that does ``trainer.train(resume_from_checkpoint=True)`` under ``guard_saves``
the same) when, and only when, a restart can help:

- never after success (0), a usage error (2: the same command fails the same way) or a stop signal (75: the scheduler
  wants the job gone, and requeues it itself);
- never for a script that did not say it resumes (``rank_report.write_resumes``: scripts/finetune.py with
  ``resume=auto``, or ``train(resume_from_checkpoint=...)`` under ``guard_saves``): started again it would train from
  step 0, and the Trainer's rotation by time could delete the checkpoints the first start made;
- never when the failure is the one before again: the same exit of the same kind at the same step reached (a bug, a
  batch that always runs out of memory, a data row that crashes the collator), said with the step;
- at most ``--max-restarts`` times (default ``DEFAULT_RESTARTS``) per launch.

Under a scheduler's job (the sbatch ``config`` writes), each node's launcher takes the same decision once and leaves it
in ``HF_GPU_TRAIN_REQUEUE_DIR`` (``record_verdict``): the policy's state of the job, kept across requeues, and the
node's ``.restart`` or ``.stop`` verdict; the sbatch starts the training again when some node says restart and none
says stop (in its allocation, on the nodes still usable; requeued when too few are: slurm.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from .rank_report import HANG_EXIT_CODE, PREEMPTED_EXIT_CODE

DEFAULT_RESTARTS = 3
RESTART_OPTIONS = ("--max-restarts", "--max_restarts")  # ours; accelerate's --max_restarts is torchelastic's, taken here
REQUEUE_DIR_ENV = "HF_GPU_TRAIN_REQUEUE_DIR"  # set by the sbatch: the scheduler restarts, the launchers say whether
ATTEMPT_ENV = "HF_GPU_TRAIN_ATTEMPT"  # set by the sbatch: which start of the training this is (requeues.starts)


@dataclass(frozen=True)
class Outcome:
    """How one launch ended: its exit code, torchelastic's root cause (rank, exit code), each rank's last finished
    step, and whether it ended on a usage error, a stop signal or a hang."""

    code: int
    cause: tuple[int, int] | None = None
    steps: tuple[tuple[int, int], ...] = ()  # (rank, step) of each rank's last finished step
    usage_error: bool = False
    preempted: bool = False
    resumes: bool = False  # a training process said it resumes from its newest complete checkpoint (rank_report)
    rendezvous_closed: bool = False  # an elastic start that found the rendezvous closed, before any process trained

    @property
    def furthest_step(self) -> int | None:
        return max((step for _, step in self.steps), default=None)

    def failure(self) -> tuple:
        """What makes two failures the same one: the kind of exit and where training had got to."""
        kind = self.cause[1] if self.cause else self.code
        return (kind, self.furthest_step)

    def describe(self) -> str:
        if self.code == HANG_EXIT_CODE:
            what = "a hang"
        elif self.cause is not None:
            rank, code = self.cause
            what = f"rank {rank} {_how(code)}"
        else:
            what = f"exit {self.code}"
        step = self.furthest_step
        return what + (f" after step {step}" if step is not None else " (its step not recorded: watchdog=off?)")


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"exited {code}"


class RestartPolicy:
    """Decides after each launch whether to start it again; says why in one line either way."""

    def __init__(self, max_restarts: int = DEFAULT_RESTARTS, restarts: int = 0, previous_failures: frozenset = frozenset()):
        self.max_restarts = max_restarts
        self.restarts = restarts
        # Outcome.failure() of the start before: one here; under a scheduler, what each node saw of it (record_verdict)
        self.previous_failures = previous_failures

    def restart_line(self, outcome: Outcome) -> tuple[bool, str | None]:
        """(start again?, the line to say: None when there is nothing to say)."""
        previous, self.previous_failures = self.previous_failures, frozenset({outcome.failure()})
        if outcome.code == 0 or outcome.usage_error or outcome.preempted or outcome.code == PREEMPTED_EXIT_CODE:
            return False, None
        if outcome.code == 2:  # a usage error from the launcher itself (bad options): the same command fails again
            return False, None
        if self.max_restarts <= 0:
            return False, None
        if not outcome.resumes:
            return False, (f"{outcome.describe()}: not restarted, as the training processes did not say they resume from "
                           "their newest complete checkpoint (scripts/finetune.py and -m hf_gpu_train.finetune do with "
                           "resume=auto; a Trainer of your own under guard_saves does with train(resume_from_checkpoint="
                           "...)): a restart would train from step 0 and its rotation could delete the checkpoints made")
        if outcome.furthest_step is not None and outcome.failure() in previous:  # no step known: not "the same"
            return False, (f"the same failure as the start before ({outcome.describe()}): not restarting again; the "
                           f"newest complete checkpoint is kept. Fix the cause, then run the same command")
        if self.restarts >= self.max_restarts:
            return False, (f"{outcome.describe()}; {self.max_restarts} restart(s) used (--max-restarts): not restarting "
                           "again; run the same command to resume from the newest complete checkpoint")
        self.restarts += 1
        return True, (f"{outcome.describe()}: restarting ({self.restarts} of {self.max_restarts}, --max-restarts); the "
                      "run resumes from its newest complete checkpoint")


def record_verdict(outcome: Outcome, max_restarts: int, folder: Path, node: str, attempt: str) -> str | None:
    """The decision ``RestartPolicy`` takes for ``outcome`` where the scheduler restarts the job (the sbatch), one
    for the job however many nodes decide. ``folder/ledger.json`` holds the policy's state before this ``attempt`` (a
    start of the training: the sbatch's requeue count and its own count of starts) and after it: the restarts used,
    counted once per attempt, and every node's failure of it, so that "the same failure twice" holds whichever node
    saw it first. Read and written under a lock, replaced whole. For a failure, ``folder/NODE.restart`` or
    ``folder/NODE.stop`` holds the line said; a stop signal's exit leaves no verdict (the sbatch requeues it itself).
    Returns the line (None: nothing to say)."""
    folder.mkdir(parents=True, exist_ok=True)
    ledger = folder / "ledger.json"
    with open(folder / "ledger.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:  # a shared filesystem mounted without locks (Lustre's noflock): decided unlocked
            print(f"hf-gpu-train launch: no lock on {folder} ({error}): nodes deciding at once may count a restart "
                  "twice", flush=True)
        try:
            state = json.loads(ledger.read_text())
        except FileNotFoundError:
            state = {}
        except (OSError, ValueError) as error:
            print(f"hf-gpu-train launch: {ledger} unreadable ({error}): the restarts counted from 0", flush=True)
            state = {}
        if state.get("attempt") != attempt:
            state = {"attempt": attempt, "before": state.get("after", {"restarts": 0, "failures": []})}
        before = state["before"]
        policy = RestartPolicy(max_restarts, int(before.get("restarts", 0)),
                               frozenset(tuple(f) for f in before.get("failures", [])))
        again, line = policy.restart_line(outcome)
        after = state.setdefault("after", {"restarts": before.get("restarts", 0), "failures": []})
        after["restarts"] = max(int(after["restarts"]), policy.restarts)
        failures = {tuple(f) for f in after["failures"]} | {outcome.failure()}
        after["failures"] = sorted(map(list, failures), key=str)
        partial = ledger.with_name(f"ledger.{node}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(state))
        partial.replace(ledger)
    if outcome.code != 0 and not outcome.preempted and outcome.code != PREEMPTED_EXIT_CODE:
        (folder / f"{node}.{'restart' if again else 'stop'}").write_text(f"{line or outcome.describe()}\n")
    return line
