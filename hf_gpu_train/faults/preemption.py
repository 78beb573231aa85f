"""Preemption: a stop signal from a scheduler ends in a complete checkpoint and an exit that says "resume me".

A job on a scheduler ends in a signal far more often than in a crash: SLURM's time limit and preemption (SIGTERM,
then SIGKILL after KillWait), its ``--signal`` warning (SIGUSR1/SIGUSR2), a Kubernetes eviction (SIGTERM to PID 1, then
SIGKILL after terminationGracePeriodSeconds), a spot reclaim. The Hugging Face Trainer and accelerate handle none:
every process dies and the work since the last scheduled checkpoint is lost.

Here, on every rank:

1. The signal handler only notes the signal (nothing else is safe inside a handler), on whichever ranks it reached:
   one rank, every rank, or none (the launcher forwards it to its workers: ``launch/signals.py``).
2. At the next step boundary the rank that heard it sets ``should_save`` and ``should_training_stop``; the ranks agree
   on the flags before the Trainer acts on them (``collective_gate.agree_on_control``: one all-reduce of the flags,
   entered by every rank at every step whatever any rank heard), so every rank saves the same step and stops. The
   step in flight is finished first, all of its gradient-accumulation micro-batches: the checkpoint is at an
   optimizer-step boundary and the resume is exact. A signal during an evaluation lets the evaluation finish, then
   saves at once (``on_evaluate``); during a save, the save finishes and the run stops (``on_save``).
3. The checkpoint is the Trainer's own (model, optimizer, scheduler, every rank's RNG, the data position in
   ``trainer_state.json``, the OOM recovery's micro-batch with it), marked complete once every rank wrote its part
   (``disk_full.guard_saves``). Every rank then waits for the others, and ``train()`` ends the process with
   ``PREEMPTED_EXIT_CODE`` (75, EX_TEMPFAIL: "try again"); the same command resumes from that checkpoint.
4. A second signal (more than ``DUPLICATE_WINDOW_S`` after the first: a launcher forwarding the scheduler's signal, which
   SLURM also sent to every process, is the same request) or the grace running out ends the process at once, with the
   same exit code. A save it interrupts leaves a folder without its completion marker, which a resume sets aside; the
   last complete checkpoint is never touched.

The grace is finite (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds: 30 s by default): the run measures
every save (and evaluation), records the longest in ``output_dir/preemption.json`` (``launch/grace.py`` reads it for
the sbatch's ``--signal`` and the manifests' grace), and says at the start, and after a save that took longer, when the
step, evaluation and save cannot fit in the grace, with the fix.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback

from ..launch.grace import GRACE_ENV, RECORD
from ..launch.rank_report import PREEMPTED_EXIT_CODE, write_preempted, write_worker_pid
from .checkpoint_marker import complete_checkpoints, is_main_process
from .collective_gate import agree_on_control, any_rank
from .disk_full import guard_saves, state_bytes

log = logging.getLogger("hf_gpu_train.preemption")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
DUPLICATE_WINDOW_S = 2.0  # the same stop request reaching a rank twice (from the scheduler and from its launcher)
GRACE_MARGIN_S = 1.0  # the run's own exit comes this much before the scheduler's SIGKILL
DEFAULT_GRACE_S = 30.0  # SLURM's KillWait and Kubernetes' terminationGracePeriodSeconds, both by default
ASSUMED_WRITE_BYTES_PER_S = 200e6  # before the first save is measured (launch/grace.py says why this figure)


DEFAULT_GRACE_SOURCE = "assumed: the schedulers' default (SLURM KillWait, Kubernetes terminationGracePeriodSeconds)"


def grace_seconds(value=None) -> tuple[float, str]:
    """(seconds, where that figure came from): the option, else ``HF_GPU_TRAIN_GRACE_SECONDS``, else the default."""
    if value is not None:
        return float(value), "given"
    raw = os.environ.get(GRACE_ENV)
    if raw:
        try:
            return float(raw), GRACE_ENV
        except ValueError:
            log.warning("hf_gpu_train: %s=%r is not a number of seconds; assuming %.0f s", GRACE_ENV, raw, DEFAULT_GRACE_S)
    return DEFAULT_GRACE_S, DEFAULT_GRACE_SOURCE


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "a stop request"


@dataclass
class StopRequest:
    """What the signal handler noted: the first stop signal and when. Written by the handler, read at step boundaries."""

    signum: int | None = None
    at: float = 0.0
    _previous: dict = field(default_factory=dict)
    _pid: int = 0  # the process that installed the handlers

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self, signals=STOP_SIGNALS) -> str | None:
        """Handle ``signals`` in this process; None, or why not (not the main thread: Python delivers signals to the
        main thread only, and a thread cannot install a handler)."""
        if threading.current_thread() is not threading.main_thread():
            return "not on the main thread (signal handlers can be installed only there)"
        self._pid = os.getpid()
        for signum in signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)
        return None

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # a forked child (a DataLoader worker) inherits the handler: it lives on, for its parent to end it (a
            # worker ended by SLURM's signal to every process would fail the step the save is waiting for)
            return
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.at = signum, now
            _say(f"{signal_name(signum)} received: finishing this step, then saving a checkpoint and stopping "
                 f"(exit {PREEMPTED_EXIT_CODE}; run the same command again to resume)")
            return
        if now - self.at <= DUPLICATE_WINDOW_S:
            return  # the launcher forwarding what the scheduler sent every process: the same request
        _say(f"a second stop signal ({signal_name(signum)}): exiting now; the newest complete checkpoint is kept")
        _exit_now()


def _say(line: str) -> None:
    try:
        os.write(2, f"hf_gpu_train: preemption: {line}\n".encode())  # no buffered I/O inside a signal handler
    except OSError:
        pass


def _exit_now() -> None:
    write_preempted(_rank(), -1)
    os._exit(PREEMPTED_EXIT_CODE)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class PreemptionCallback(TrainerCallback):
    """Turns a noted stop signal into the Trainer's own save and stop, at the next step boundary."""

    def __init__(self, preemption: Preemption):
        self.preemption = preemption

    def on_train_begin(self, args, state, control, **kwargs):
        self.preemption.training_began(args)

    def _ask(self, control, save: bool) -> None:
        p = self.preemption
        if p.request.requested and p.training:
            if save:
                control.should_save = True
            control.should_training_stop = True
            p.stopping = True

    def on_step_end(self, args, state, control, **kwargs):
        self._ask(control, save=True)

    def on_log(self, args, state, control, **kwargs):
        self._ask(control, save=True)

    def on_evaluate(self, args, state, control, **kwargs):
        self._ask(control, save=True)  # the evaluation is finished: save now, not after another step

    def on_save(self, args, state, control, **kwargs):
        self.preemption.saved(args, state)
        self._ask(control, save=False)  # the checkpoint just written is the one to resume from

    def on_train_end(self, args, state, control, **kwargs):
        self.preemption.training = False


class Preemption:
    """One Trainer's preemption handling; ``attach_preemption`` makes it."""

    def __init__(self, trainer, grace: float | None = None, exit: bool = True):
        self.trainer = trainer
        self.request = StopRequest()
        self.grace_s, self.grace_source = grace_seconds(grace)
        self.exit = exit
        self.training = False
        self.stopping = False  # this rank asked to stop (the agreed flags may come from another rank)
        self.preempted = False  # the run stopped for a stop request, after a complete checkpoint
        self.save_seconds: list[float] = []
        self.evaluation_seconds: list[float] = []
        self.stopped_at_step: int | None = None
        self.inactive_reason: str | None = None
        self._said_too_long = False
        self._timer: threading.Timer | None = None

    # -- training ------------------------------------------------------------------------------------------------
    def training_began(self, args) -> None:
        self.training = True
        self.stopping = False
        self.preempted = False
        write_worker_pid(args.process_index)
        self._record_previous(args.output_dir)
        if args.process_index == 0:
            self._check_grace(args)

    def saved(self, args, state) -> None:
        """After a checkpoint: record its time (``preemption.json``, read by ``config --save-time-from``), and say
        once when a stop can no longer fit in the grace."""
        if not self.save_seconds or args.process_index != 0:
            return
        self.write_record(args.output_dir)
        needed = self.save_seconds[-1] + self._longest_evaluation()
        if needed > self.grace_s and not self._said_too_long:
            self._said_too_long = True
            print(f"hf_gpu_train: preemption: the save at step {state.global_step} took {self.save_seconds[-1]:.1f} s; "
                  f"with {self._longest_evaluation():.1f} s of evaluation that is more than the {self.grace_s:.0f} s grace "
                  f"({self.grace_source}): {self._fix()}", file=sys.stderr, flush=True)

    def _fix(self) -> str:
        return ("ask the scheduler for the warning earlier (SLURM: --signal=B:USR1@SECONDS, `hf-gpu-train config "
                "--save-time-from OUTPUT_DIR` computes it), a longer grace (KillWait, terminationGracePeriodSeconds), or a "
                "smaller checkpoint (save_only_model, LoRA)")

    def _longest_evaluation(self) -> float:
        return max(self.evaluation_seconds, default=0.0)

    def _check_grace(self, args) -> None:
        measured = max(self.save_seconds, default=None)
        if measured is not None:
            estimate, how = measured, "measured"
        else:
            try:
                size = state_bytes(self.trainer)
            except Exception:  # a model whose state cannot be counted yet (meta tensors): nothing to say
                return
            estimate, how = size / ASSUMED_WRITE_BYTES_PER_S, f"estimated, {size / 2**20:.0f} MiB at {ASSUMED_WRITE_BYTES_PER_S / 1e6:.0f} MB/s"
        if estimate > self.grace_s:
            print(f"hf_gpu_train: preemption: a checkpoint save takes about {estimate:.0f} s ({how}), more than the "
                  f"{self.grace_s:.0f} s grace ({self.grace_source}): a stop signal would end in SIGKILL before the save "
                  f"is complete (the previous complete checkpoint is kept): {self._fix()}", file=sys.stderr, flush=True)

    def _record_previous(self, output_dir: str) -> None:
        """A resumed run continues the record of the run before it (its measured saves)."""
        try:
            record = json.loads((Path(output_dir) / RECORD).read_text())
            self.save_seconds = [float(s) for s in record.get("save_seconds", [])][-20:]
            self.evaluation_seconds = [float(s) for s in record.get("evaluation_seconds", [])][-20:]
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def write_record(self, output_dir: str, extra: dict | None = None) -> None:
        if not is_main_process():
            return
        record = {"save_seconds": self.save_seconds[-20:], "save_seconds_max": max(self.save_seconds, default=None),
                  "evaluation_seconds": self.evaluation_seconds[-20:], "grace_seconds": self.grace_s,
                  "grace_source": self.grace_source, **(extra or {})}
        path = Path(output_dir) / RECORD
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # the record is advice for the next config; a full disk is reported by the save itself

    def _start_grace_timer(self) -> None:
        """Once stopping, with a grace that was given (never an assumed one: ending a save the scheduler would have
        let finish loses it): the grace running out ends the process, with the exit code that says "resume me", a
        moment before the scheduler's SIGKILL would."""
        if self._timer is not None or self.request.signum is None or self.grace_source == DEFAULT_GRACE_SOURCE:
            return
        left = self.grace_s - GRACE_MARGIN_S - (time.monotonic() - self.request.at)

        def out_of_time():
            _say(f"the {self.grace_s:.0f} s grace ran out before the checkpoint was complete: exiting now; the newest "
                 "complete checkpoint is kept")
            _exit_now()

        self._timer = threading.Timer(max(0.0, left), out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def done(self) -> None:
        """``train()`` returned: no timer, and the signals' handlers as they were (a signal now ends the process as
        it would have without us)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.request.uninstall()


def _timed(trainer, name: str, into: list[float], before=None) -> None:
    """Record how long ``trainer.<name>`` takes (the saves and evaluations a stop must fit in the grace)."""
    original = getattr(trainer, name)

    def timed(*args, **kwargs):
        if before is not None:
            before()
        start = time.monotonic()
        result = original(*args, **kwargs)
        into.append(time.monotonic() - start)
        return result

    setattr(trainer, name, timed)


def attach_preemption(trainer, grace: float | None = None, exit: bool = True) -> Preemption:
    """Make a stop signal (SIGTERM, SIGUSR1, SIGUSR2) end ``trainer.train()`` (anyone's Trainer, TRL's included) in a
    complete checkpoint at the next step boundary, on every rank alike, then exit the process with
    ``PREEMPTED_EXIT_CODE`` (``exit=False``: ``train()`` returns and ``Preemption.preempted`` says it stopped early).
    ``grace``: seconds from the signal to the scheduler's SIGKILL (default ``HF_GPU_TRAIN_GRACE_SECONDS``, else 30).
    The same command resumes: ``trainer.train(resume_from_checkpoint=True)`` takes the newest complete checkpoint
    (``guard_saves``, installed here unless it already is)."""
    preemption = Preemption(trainer, grace, exit)
    why_not = preemption.request.install()
    if why_not is not None:
        preemption.inactive_reason = why_not
        log.warning("hf_gpu_train: preemption handling off: %s", why_not)
        return preemption
    if not getattr(trainer, "_hf_gpu_train_saves_guarded", False):
        guard_saves(trainer)
    agree_on_control(trainer)  # a flag one rank set from its own signal becomes every rank's before the Trainer acts
    trainer.add_callback(PreemptionCallback(preemption))
    _timed(trainer, "_save_checkpoint", preemption.save_seconds,
           before=lambda: preemption._start_grace_timer() if preemption.stopping else None)
    _timed(trainer, "evaluate", preemption.evaluation_seconds)
    train = trainer.train

    def train_then_exit_if_preempted(*args, **kwargs):
        if any_rank(preemption.request.requested):  # every rank enters train(): a stop before it is every rank's
            if trainer.is_world_process_zero():
                _say("a stop signal came before training began: exiting, nothing new to save")
            write_preempted(trainer.args.process_index, -1)
            sys.exit(PREEMPTED_EXIT_CODE)
        try:
            result = train(*args, **kwargs)
        except BaseException:
            preemption.done()
            raise
        stopped = any_rank(preemption.stopping) and trainer.state.global_step < trainer.state.max_steps
        preemption.write_record(trainer.args.output_dir)
        if not stopped:
            preemption.done()
            return result
        preemption.preempted = True
        preemption.stopped_at_step = trainer.state.global_step
        kept = complete_checkpoints(trainer.args.output_dir)
        if trainer.is_world_process_zero():
            where = f"{kept[0]} is complete" if kept else "no complete checkpoint was written"
            print(f"hf_gpu_train: preemption: stopped at step {trainer.state.global_step} of {trainer.state.max_steps} "
                  f"for {signal_name(preemption.request.signum)}; {where}; the same command resumes from it",
                  file=sys.stderr, flush=True)
        if not preemption.exit:
            preemption.done()
            return result
        write_preempted(trainer.args.process_index, trainer.state.global_step)
        sys.exit(PREEMPTED_EXIT_CODE)

    trainer.train = train_then_exit_if_preempted
    trainer._hf_gpu_train_preemption = preemption
    return preemption
