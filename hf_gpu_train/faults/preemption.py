"""Preemption: a stop signal from a scheduler ends in a complete checkpoint and an exit that says "resume me".

A job on a scheduler ends in a signal far more often than in a crash: SLURM's time limit and preemption (SIGTERM,
then SIGKILL after KillWait), its ``--signal`` warning (SIGUSR1/SIGUSR2), a Kubernetes eviction (SIGTERM to PID 1, then
SIGKILL after terminationGracePeriodSeconds), a spot reclaim. The Hugging Face Trainer and accelerate handle none:
every process dies and the work since the last scheduled checkpoint is lost.

Here, on every rank:

1. The signal handler only notes the signal (nothing else is safe inside a handler), on whichever ranks it reached:
   one rank, every rank, or none (the launcher forwards it to its workers: ``launch/signals.py``).
2. At the next step boundary the rank that heard it sets ``should_save`` and ``should_training_stop``; the ranks agree
   on the flags before the Trainer acts on them (``collectives.control_flags.agree_on_control``: one all-reduce of the flags,
   entered by every rank at every step whatever any rank heard), so every rank saves the same step and stops. The
   step in flight is finished first, all of its gradient-accumulation micro-batches: the checkpoint is at an
   optimizer-step boundary and the resume is exact. A signal during an evaluation lets the evaluation finish, then
   saves at once (``on_evaluate``); during a save, the save finishes and the run stops (``on_save``). An evaluation
   due at the step where the stop is taken is put off, not run before the save (a generating evaluation can outlast
   the grace): the checkpoint records it (``DeferredEvaluation``) and the resumed run runs it before its first step,
   where the uninterrupted run ran it (its metrics, a plateau scheduler, early stopping and the best checkpoint the same).
3. The checkpoint is the Trainer's own (model, optimizer, scheduler, every rank's RNG, the data position in
   ``trainer_state.json``, the OOM recovery's micro-batch with it), marked complete once every rank wrote its part
   (``disk_full.guard_saves``). With ``save_only_model=True`` the scheduled checkpoints hold the model only (the user's
   choice), but a stop's checkpoint holds the optimizer, scheduler and RNG states too: it is the one the next run
   continues from. Every rank then waits for the others, and ``train()`` ends the process with
   ``PREEMPTED_EXIT_CODE`` (75, EX_TEMPFAIL: "try again"); the same command resumes from that checkpoint.
4. A second signal (more than ``DUPLICATE_WINDOW_S`` after the first: a launcher forwarding the scheduler's signal, which
   SLURM also sent to every process, is the same request) ends the process at once, with the same exit code; the grace
   running out ends it with the scheduler's SIGKILL. A save either interrupts leaves a folder without its completion
   marker, which a resume sets aside; the last complete checkpoint is never touched. (No timer of ours ends the run
   before the scheduler does: a grace figure that is not the scheduler's would kill a save that could have finished.)
5. DataLoader workers ignore the stop signals (``IgnoreStopSignals``): SLURM signals every process of a job, and a
   worker torch ends on a SIGTERM from anyone but its parent would fail the step the checkpoint waits for.

The grace is finite (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds: 30 s by default): the run measures
every save (and evaluation), records the longest in ``output_dir/preemption.json`` (``launch/grace.py`` reads it for
the sbatch's ``--signal`` and the manifests' grace), and says at the start (the state's size at a conservative write
speed), and after the first save whose step, evaluation and save cannot fit in the grace, with the fix.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..collectives.control_flags import agree_on_control
from ..collectives.cpu_votes import any_rank
from ..collectives.lone_rank import check_not_alone
from ..launch.grace import GRACE_ENV, RECORD
from ..launch.rank_report import PREEMPTED_EXIT_CODE, read_stop_request, write_preempted, write_worker_pid
from .background_save import last_write_seconds
from .checkpoint_marker import complete_checkpoints, is_main_process
from .disk_full import guard_saves, state_bytes

log = logging.getLogger("hf_gpu_train.preemption")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
DUPLICATE_WINDOW_S = 2.0  # the same stop request reaching a rank twice (from the scheduler and from its launcher)
DEFAULT_GRACE_S = 30.0  # SLURM's KillWait and Kubernetes' terminationGracePeriodSeconds, both by default
ASSUMED_WRITE_BYTES_PER_S = 200e6  # before the first save is measured (launch/grace.py says why this figure)


DEFAULT_GRACE_SOURCE = "assumed: the schedulers' default (SLURM KillWait, Kubernetes terminationGracePeriodSeconds)"
# In output_dir from a stop until the next run begins: how a script under plain torchrun or accelerate launch (which end
# with 1 when a worker exits 75) tells a preemption from a crash: `[ -e OUTPUT_DIR/hf_gpu_train_preempted.json ] && exit 75`
PREEMPTED_FILE = "hf_gpu_train_preempted.json"


def write_preempted_file(output_dir: str, step: int, signum: int | None) -> None:
    """On the process that writes ``output_dir``: this run stopped for a stop signal at ``step``, resumable."""
    if not is_main_process():
        return
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / PREEMPTED_FILE).write_text(json.dumps({"step": step, "signal": signal_name(signum),
                                                                    "exit_code": PREEMPTED_EXIT_CODE, "time": time.time()}))
    except OSError:
        pass  # a courtesy to a launcher that cannot see exit 75; the checkpoint is what matters


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
    """What the signal handler noted: the first stop signal and when. Written by the handler, read at step boundaries.
    One per process (``STOP``): the handlers are the process's, and a fine-tune installs them before its model loads."""

    signum: int | None = None
    at: float = 0.0
    _previous: dict = field(default_factory=dict)
    _pid: int = 0  # the process that installed the handlers
    _taken: int = 0  # the launcher's noted stop requests this process has taken (launch/rank_report.py)
    output_dir: str | None = None  # the training run's, for the preempted file of an exit at once

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
        self.take_a_noted_request()
        return None

    def take_a_noted_request(self) -> None:
        """A stop signal the launcher forwarded before this process listened (it ignored it, or it went to its
        launcher): taken now, once, as if it had just arrived."""
        noted = read_stop_request()
        if noted is None or noted[1] <= self._taken:
            return
        self._taken = noted[1]
        if self.signum is None:
            self.signum, self.at = noted[0], time.monotonic()
            _say(f"{signal_name(noted[0])} came before this process listened (the launcher noted it): finishing this "
                 f"step, then saving a checkpoint and stopping (exit {PREEMPTED_EXIT_CODE})")

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def reset(self) -> None:
        self.signum, self.at = None, 0.0
        noted = read_stop_request()  # what the launcher noted has been handled with the request just ended
        self._taken = max(self._taken, noted[1]) if noted else self._taken

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
        _exit_now(self.output_dir, signum)


STOP = StopRequest()


def listen() -> str | None:
    """Note stop signals from now on (an entry point, before its model loads: a signal then ends the run at once,
    exit 75, instead of killing it). None, or why it cannot (not the main thread)."""
    return STOP.install()


def _say(line: str) -> None:
    try:
        os.write(2, f"hf_gpu_train: preemption: {line}\n".encode())  # no buffered I/O inside a signal handler
    except OSError:
        pass


def _exit_now(output_dir: str | None = None, signum: int | None = None) -> None:
    write_preempted(int(os.environ.get("RANK", "0")), -1)
    if output_dir is not None:
        write_preempted_file(output_dir, -1, signum)
    os._exit(PREEMPTED_EXIT_CODE)


class IgnoreStopSignals:
    """A DataLoader worker's ``worker_init_fn``: the stop signals ignored in the worker, then the Trainer's own
    init. torch's worker loop installs a SIGTERM handler that ends the worker when anyone but its parent sends
    SIGTERM, and SLURM signals every process of a job: the worker would die, and the step the checkpoint waits for fail
    ("DataLoader worker exited unexpectedly"). The parent still ends its workers as always (its sentinel, or a worker
    noticing the parent gone). A class, not a closure: spawned workers get it pickled."""

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def _shield_loader_workers(trainer) -> None:
    """The loaders the Trainer makes get ``IgnoreStopSignals`` in their workers."""
    for name in ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader"):
        original = getattr(trainer, name, None)
        if original is None:
            continue

        def shielded(*args, _original=original, **kwargs):
            loader = _original(*args, **kwargs)
            # accelerate's prepared loader iterates the DataLoader it wraps (base_dataloader) and reads its attributes
            inner = getattr(loader, "base_dataloader", loader)
            if getattr(inner, "num_workers", 0) and not isinstance(getattr(inner, "worker_init_fn", None), IgnoreStopSignals):
                try:
                    inner.worker_init_fn = IgnoreStopSignals(inner.worker_init_fn)
                except (AttributeError, ValueError):  # a loader that takes no attribute: its workers as they were
                    pass
            return loader

        setattr(trainer, name, shielded)


class DeferredEvaluation(TrainerCallback, ExportableState):
    """The evaluation a stop signal put off (the step it was due at), saved with the stop's checkpoint in
    ``trainer_state.json``: the resumed run runs it before its first step. Data only (the Trainer may rebuild it from the
    checkpoint with ``restore_callback_states_from_checkpoint=True``; ``Preemption`` finds the one it holds)."""

    def __init__(self):
        self.due_step: int | None = None

    def state(self) -> dict:
        return {"args": {}, "attributes": {"due_step": self.due_step}}


class PreemptionCallback(TrainerCallback):
    """Turns a noted stop signal into the Trainer's own save and stop, at the next step boundary."""
    hears_of_staged_saves = True  # its on_save is about the training, not the files (background_save.py)


    def __init__(self, preemption: Preemption):
        self.preemption = preemption

    def on_train_begin(self, args, state, control, **kwargs):
        self.preemption.training_began(args, state)

    def _ask(self, control, save: bool) -> None:
        p = self.preemption
        if p.request.requested and p.training:
            if save:
                control.should_save = True
            control.should_training_stop = True
            p.stopping = True

    def on_step_begin(self, args, state, control, **kwargs):
        self.preemption.run_the_deferred_evaluation(state)
        self.preemption.step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        p = self.preemption
        if p.step_started is not None:
            p.step_seconds.append(time.monotonic() - p.step_started)
            del p.step_seconds[:-20]
        self._ask(control, save=True)

    def on_log(self, args, state, control, **kwargs):
        self._ask(control, save=True)

    def on_evaluate(self, args, state, control, **kwargs):
        self._ask(control, save=True)  # the evaluation is finished: save now, not after another step

    def on_save(self, args, state, control, **kwargs):
        self.preemption.saved(args, state)
        self._ask(control, save=False)  # the checkpoint just written is the one to resume from

    def on_epoch_end(self, args, state, control, **kwargs):
        # the Trainer's epoch-end save (save_strategy=epoch) after a stop would write the step just saved again, into
        # the same folder: its marker removed first, a kill in it would take the checkpoint just made. Every rank has
        # saved_step (on_save runs on every rank), so every rank clears it alike.
        if control.should_training_stop and self.preemption.saved_step == state.global_step:
            control.should_save = False

    def on_train_end(self, args, state, control, **kwargs):
        self.preemption.training = False


class Preemption:
    """One Trainer's preemption handling; ``attach_preemption`` makes it."""

    def __init__(self, trainer, grace: float | None = None, exit: bool = True):
        self.trainer = trainer
        self.request = STOP
        self.grace_s, self.grace_source = grace_seconds(grace)
        self.exit = exit
        self.training = False
        self.stopping = False  # this rank asked to stop (the agreed flags may come from another rank)
        self.preempted = False  # the run stopped for a stop request, after a complete checkpoint
        self.save_seconds: list[float] = []
        self.evaluation_seconds: list[float] = []
        self.step_seconds: list[float] = []
        self.step_started: float | None = None
        self.saved_step: int | None = None
        self.stopped_at_step: int | None = None
        self.inactive_reason: str | None = None
        self.saved_full_state = True  # the last checkpoint holds the optimizer, scheduler and RNG states too
        self.deferred = DeferredEvaluation()
        self.evaluation_put_off: int | None = None  # this run put off the evaluation due at this step
        self._said_too_long = False

    # -- training ------------------------------------------------------------------------------------------------
    def training_began(self, args, state) -> None:
        self.training = True
        self.stopping = False
        self.preempted = False
        self.evaluation_put_off = None
        self._find_the_deferred_evaluation(state)
        self.request.output_dir = args.output_dir
        if is_main_process():  # a new run: the last one's "preempted" is answered
            (Path(args.output_dir) / PREEMPTED_FILE).unlink(missing_ok=True)
        write_worker_pid(args.process_index)
        self._record_previous(args.output_dir)
        if args.process_index == 0:
            self._check_grace(args)
            if args.save_only_model and str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
                log.warning("hf_gpu_train: save_only_model=True: the scheduled checkpoints hold the model only, so a run "
                            "resumed from one of them starts its optimizer, learning-rate schedule and random state "
                            "afresh, not where this run was; a stop signal's checkpoint holds them too and resumes "
                            "exactly. For exact resumes from every checkpoint: save_only_model=False")

    def _find_the_deferred_evaluation(self, state) -> None:
        """The ``DeferredEvaluation`` the Trainer holds now, with the step a resumed checkpoint recorded."""
        handler = getattr(self.trainer, "callback_handler", None)
        self.deferred = next((c for c in getattr(handler, "callbacks", []) if isinstance(c, DeferredEvaluation)), self.deferred)
        if not self.trainer.args.restore_callback_states_from_checkpoint:
            saved = (getattr(state, "stateful_callbacks", None) or {}).get(DeferredEvaluation.__name__)
            saved = saved[0] if isinstance(saved, list) and saved else saved
            self.deferred.due_step = ((saved or {}).get("attributes") or {}).get("due_step")
        if self.deferred.due_step is not None and self.deferred.due_step != state.global_step:
            self.deferred.due_step = None  # a checkpoint of another step: not this resume's

    def put_off_the_evaluation(self) -> None:
        """Before the Trainer logs, evaluates and saves after a step (the flags agreed on every rank): an evaluation due
        now, with a stop requested on any rank, is put off to the resumed run, and the stop's save comes first."""
        control, state = self.trainer.control, self.trainer.state
        if not (self.training and control.should_evaluate and state.global_step < state.max_steps):
            return  # (the last step's evaluation is the run's own end: no stop, nothing to put off)
        if not any_rank(self.request.requested):  # every rank asks: should_evaluate is agreed
            return
        control.should_evaluate = False
        control.should_save = control.should_training_stop = True
        self.stopping = True
        self.deferred.due_step = self.evaluation_put_off = self.trainer.state.global_step

    def run_the_deferred_evaluation(self, state) -> None:
        """The first step of a resumed run: the evaluation the stopped run put off, as the uninterrupted run ran it
        after that step (its metrics logged, a plateau scheduler stepped, the best metric kept), on every rank."""
        if self.deferred.due_step is None or self.deferred.due_step != state.global_step:
            return
        self.deferred.due_step = None
        strategy = str(getattr(self.trainer.args.eval_strategy, "value", self.trainer.args.eval_strategy))
        if self.trainer.eval_dataset is None or strategy == "no":  # the resumed run evaluates nothing: neither this
            return
        if is_main_process():
            _say(f"running the evaluation due at step {state.global_step}, put off by the stop signal of the run this "
                 "one resumes")
        metrics = self.trainer._evaluate(None, None)
        determine = getattr(self.trainer, "_determine_best_metric", None)
        if callable(determine):
            determine(metrics=metrics, trial=None)

    def saved(self, args, state) -> None:
        """After a checkpoint: record its step and time (``preemption.json``, read by ``config --save-time-from``),
        and say once when a stop can no longer fit in the grace."""
        self.saved_step = state.global_step
        if not self.save_seconds or args.process_index != 0:
            return
        self.write_record(args.output_dir)
        needed = self._step() + self.save_seconds[-1] + self._longest_evaluation()
        if needed > self.grace_s and not self._said_too_long:
            self._said_too_long = True
            print(f"hf_gpu_train: preemption: a step ({self._step():.1f} s), an evaluation ({self._longest_evaluation():.1f} s) "
                  f"and the save at step {state.global_step} ({self.save_seconds[-1]:.1f} s) take {needed:.1f} s, more than "
                  f"the {self.grace_s:.0f} s grace ({self.grace_source}): {self._fix()}", file=sys.stderr, flush=True)

    def _fix(self) -> str:
        # never save_only_model: a stop's checkpoint holds the optimizer's state anyway, which an exact resume needs
        return ("ask the scheduler for the warning earlier (SLURM: --signal=B:USR1@SECONDS, `hf-gpu-train config "
                "--save-time-from OUTPUT_DIR` computes it), a longer grace (KillWait, terminationGracePeriodSeconds), or a "
                "smaller model state (LoRA instead of a full fine-tune, or a lighter optimizer: its state is most of a "
                "checkpoint)")

    def _longest_evaluation(self) -> float:
        return max(self.evaluation_seconds, default=0.0)

    def _step(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else 0.0

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
                  "evaluation_seconds": self.evaluation_seconds[-20:], "step_seconds_median": self._step(),
                  "grace_seconds": self.grace_s, "grace_source": self.grace_source, **(extra or {})}
        path = Path(output_dir) / RECORD
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # the record is advice for the next config; a full disk is reported by the save itself

    def done(self) -> None:
        """``train()`` returned (or a preempted process's caller is done with it): the signals' handlers as they
        were (a signal now ends the process as it would have without us), and no request left for the next
        ``train()``."""
        self.request.uninstall()
        self.request.reset()


def _timed(trainer, name: str, into: list[float], also: Callable[[], float] = lambda: 0.0) -> None:
    """Record how long ``trainer.<name>`` takes (the saves and evaluations a stop must fit in the grace), plus ``also()``
    (a save's background write: a stop's save is waited for before the process exits)."""
    original = getattr(trainer, name)

    def timed(*args, **kwargs):
        start = time.monotonic()
        result = original(*args, **kwargs)
        into.append(time.monotonic() - start + also())
        return result

    setattr(trainer, name, timed)


def _full_state_for_a_stop(trainer, preemption: Preemption) -> None:
    """``save_only_model=True`` leaves the optimizer, scheduler, scaler and RNG states out of every checkpoint; a stop's
    checkpoint is the one the next run continues from, so it gets them (decided on every rank alike: a rank that heard
    no signal writes its RNG state too). Scheduled saves stay as the user asked."""
    original = trainer._save_checkpoint

    def saving(*args, **kwargs):
        settings = trainer.args
        if not settings.save_only_model:
            preemption.saved_full_state = True
            return original(*args, **kwargs)
        # a stop requested on any rank (still so after train() returns, for the save the stop owes): every rank saves
        # here, so the decision is agreed
        full = any_rank(preemption.request.requested)
        preemption.saved_full_state = full
        if not full:
            return original(*args, **kwargs)
        settings.save_only_model = False
        try:
            return original(*args, **kwargs)
        finally:
            settings.save_only_model = True

    trainer._save_checkpoint = saving


def attach_preemption(trainer, grace: float | None = None, exit: bool = True) -> Preemption:
    """Make a stop signal (SIGTERM, SIGUSR1, SIGUSR2) end ``trainer.train()`` (anyone's Trainer, TRL's included) in a
    complete checkpoint at the next step boundary, on every rank alike, then exit the process with
    ``PREEMPTED_EXIT_CODE`` (``exit=False``: ``train()`` returns and ``Preemption.preempted`` says it stopped early).
    ``grace``: seconds from the signal to the scheduler's SIGKILL, for the warning when a save cannot fit (default
    ``HF_GPU_TRAIN_GRACE_SECONDS``, else 30). The same command resumes: ``trainer.train(resume_from_checkpoint=True)``
    takes the newest complete checkpoint (``guard_saves``, installed here unless it already is)."""
    check_not_alone(trainer)
    preemption = Preemption(trainer, grace, exit)
    why_not = preemption.request.install()
    if why_not is not None:
        preemption.inactive_reason = why_not
        log.warning("hf_gpu_train: preemption handling off: %s", why_not)
        return preemption
    if not getattr(trainer, "_hf_gpu_train_saves_guarded", False):
        guard_saves(trainer)
    # a flag one rank set from its own signal becomes every rank's before the Trainer acts; then an evaluation due at a
    # stop is put off to the resumed run
    agree_on_control(trainer, after_agreement=preemption.put_off_the_evaluation)
    trainer.add_callback(PreemptionCallback(preemption))
    trainer.add_callback(preemption.deferred)
    _full_state_for_a_stop(trainer, preemption)
    # a background write's time is known once it ended: the newest one's stands for this one's
    _timed(trainer, "_save_checkpoint", preemption.save_seconds, also=lambda: last_write_seconds(trainer))
    _timed(trainer, "evaluate", preemption.evaluation_seconds)
    _shield_loader_workers(trainer)
    train = trainer.train

    def train_then_exit_if_preempted(*args, **kwargs):
        preemption.request.install()  # again for a train() after one that returned (done() gave the handlers back)
        if any_rank(preemption.request.requested):  # every rank enters train(): a stop before it is every rank's
            if trainer.is_world_process_zero():
                _say("a stop signal came before training began: exiting, nothing new to save")
            write_preempted(trainer.args.process_index, -1)
            write_preempted_file(trainer.args.output_dir, trainer.state.global_step, preemption.request.signum)
            if preemption.exit:
                sys.exit(PREEMPTED_EXIT_CODE)
            preemption.preempted = True
            preemption.done()
            return None
        try:
            result = train(*args, **kwargs)
        except BaseException:
            preemption.done()
            raise
        stopped = any_rank(preemption.stopping) and trainer.state.global_step < trainer.state.max_steps
        if stopped and (preemption.saved_step != trainer.state.global_step or not preemption.saved_full_state):
            # a save strategy that decided against the stop's save (save_strategy="best" at an evaluation that was
            # not the best), or a model-only save that a signal reached while it wrote: every rank knows these values
            # alike, so every rank saves here, the full state
            trainer._save_checkpoint(trainer.model, trial=None)
            preemption.saved_step = trainer.state.global_step
        preemption.write_record(trainer.args.output_dir)
        if not stopped:
            preemption.done()
            return result
        preemption.preempted = True
        preemption.stopped_at_step = trainer.state.global_step
        write_preempted_file(trainer.args.output_dir, trainer.state.global_step, preemption.request.signum)
        kept = complete_checkpoints(trainer.args.output_dir)
        if trainer.is_world_process_zero():
            where = f"{kept[0]} is complete" if kept else "no complete checkpoint was written"
            put_off = (f"; the evaluation due at step {preemption.evaluation_put_off} was put off (the save came first): "
                       "the resumed run runs it before its first step" if preemption.evaluation_put_off is not None else "")
            print(f"hf_gpu_train: preemption: stopped at step {trainer.state.global_step} of {trainer.state.max_steps} "
                  f"for {signal_name(preemption.request.signum)}; {where}; the same command resumes from it{put_off}",
                  file=sys.stderr, flush=True)
        if not preemption.exit:
            preemption.done()
            return result
        write_preempted(trainer.args.process_index, trainer.state.global_step)
        sys.exit(PREEMPTED_EXIT_CODE)

    trainer.train = train_then_exit_if_preempted
    trainer._hf_gpu_train_preemption = preemption
    return preemption
