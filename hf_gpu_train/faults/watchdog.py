"""A watchdog on every rank: a run that stops making progress ends in seconds, with every rank's stacks and the
rank that is not where the others are named, instead of waiting out a 30-minute collective timeout.

Why a thread and the rendezvous store: a stalled rank (a data loader that never returns, a deadlock, a collective
the others never enter) keeps its main thread blocked, and the ranks waiting for it sit inside a collective, so
nothing on the training path can notice. A daemon thread per rank watches the time since the last sign of
progress (a phase change: data, forward, backward, optimizer, evaluation, save), and the ranks tell each other of a
hang through the c10d store the process group was made with (its own TCP connection, never a collective), so
every rank dumps its Python stacks (``faulthandler``) into ``output_dir/hang-<time>/rank-N.txt`` before the run
ends with ``HANG_EXIT_CODE``.

How long is "no progress": ``factor`` times the median measured step time, never below a floor. The first step
(model compilation, loader workers starting), evaluation and saves have a long floor of their own.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from transformers import TrainerCallback

from ..collectives.lone_rank import check_not_alone
from ..collectives.wrappers import on_default_group, wrap_collectives
from ..hardware.backend import normalize_bus_id
from ..launch.rank_report import (  # exit 3: documented in the README
    HANG_EXIT_CODE,
    named_straggler,
    write_hang_report,
    write_progress,
)
from ..process_group import rendezvous_store
from .collective_gate import make_collective_safe, new_namespace, publish_position
from .gpu_health import RankGpu, named_events

PHASES = ("data", "forward", "backward", "optimizer", "evaluation", "save")  # the order a step goes through
_KEY = "hf_gpu_train/hang"


@dataclass(frozen=True)
class Limits:
    """Seconds without progress before the watchdog ends the run."""

    floor_s: float = 120.0  # a steady step
    long_floor_s: float = 600.0  # the first step, an evaluation, a save
    factor: float = 10.0  # times the median step time (or evaluation batch time), when that is longer

    @classmethod
    def from_setting(cls, value) -> Limits | None:
        """``auto`` -> the defaults; a number -> that floor for every phase; ``off`` -> None (no watchdog)."""
        if value in (None, "off", False, 0):
            return None
        if value == "auto":
            return cls()
        seconds = float(value)
        return cls(floor_s=seconds, long_floor_s=seconds)


class Progress:
    """Where this rank is, written by the training thread, read by the watchdog thread (plain attribute writes)."""

    def __init__(self):
        self.step = 0  # optimizer steps finished
        self.phase = "data"
        self.since = time.monotonic()
        self.step_times: deque[float] = deque(maxlen=50)
        # after an evaluation or a save the next step waits for the slowest rank's (rank 0 writes the checkpoint while
        # the others wait in the next collective): the long floor holds until a step ends
        self.after_long_phase = False
        self.eval_times: deque[float] = deque(maxlen=20)
        self._step_started: float | None = None
        self._eval_batch_at: float | None = None
        self.collectives = 0  # collectives entered on the default group (``track_collectives``)
        self.in_collective: str | None = None  # the one this rank waits in now

    def enter(self, phase: str) -> None:
        now = time.monotonic()
        if phase == "evaluation" and self.phase == "evaluation" and self._eval_batch_at is not None:
            self.eval_times.append(now - self._eval_batch_at)
        self._eval_batch_at = now if phase == "evaluation" else None
        if self.phase in ("evaluation", "save") and phase not in ("evaluation", "save"):
            self.after_long_phase = True
        self.phase, self.since = phase, now

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if self._step_started is not None:
            self.step_times.append(now - self._step_started)
        self._step_started = now
        self.step = step
        self.enter("data")
        self.after_long_phase = False

    def limit(self, limits: Limits) -> tuple[float, str]:
        """(seconds, why) allowed in the current phase: the larger of ``factor`` x the median and 3 x the longest
        recent step (a step that generates every few steps, a recompile), never below the floor."""
        long_phase = self.phase in ("evaluation", "save") or not self.step_times or self.after_long_phase
        times = self.eval_times if self.phase == "evaluation" else self.step_times
        floor = limits.long_floor_s if long_phase else limits.floor_s
        if times:
            typical, longest = statistics.median(times), max(times)
            derived, why = max((limits.factor * typical, f"{limits.factor:g} x the median {typical:.2f} s"),
                               (3 * longest, f"3 x the longest recent {longest:.2f} s"))
            if derived > floor:
                return derived, why
        what = ("first step" if not self.step_times else "step after an evaluation or save" if self.after_long_phase
                else self.phase)
        return floor, f"the floor for {what if long_phase else 'a step'}"

    def position(self) -> dict:
        return {"step": self.step, "phase": self.phase, "collectives": self.collectives, "in_collective": self.in_collective}

    def state(self) -> dict:
        return {"step": self.step, "phase": self.phase, "stalled_s": round(time.monotonic() - self.since, 1),
                "collectives": self.collectives, "in_collective": self.in_collective}


_TRACKED: list[Progress] = []  # the progress the collective wrappers count into (one watchdog per process)


def track_collectives(progress: Progress) -> None:
    """Count every collective entered on the default group and note the one this rank waits in. A rank that waits
    in its n-th collective while another has entered fewer is waiting for that other rank: the count names the
    culprit even when both ranks are in the same phase (a token-count gather while the other rank's loader hangs)."""
    _TRACKED[:] = [progress]
    wrap_collectives("_hf_gpu_train_tracked", _tracked)


def _tracked(name: str, collective):
    def tracked(*args, **kwargs):
        progress = _TRACKED[0] if _TRACKED else None
        if progress is None or not on_default_group(kwargs) or progress.in_collective:
            return collective(*args, **kwargs)
        progress.collectives += 1
        progress.in_collective = name
        try:
            return collective(*args, **kwargs)
        finally:
            progress.in_collective = None

    return tracked


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), 1


def _store():
    """A private connection to the store the process group was made with (None: one process, or no store)."""

    return rendezvous_store()


def behind(states: dict[int, dict]) -> list[int]:
    """The ranks that are not where the others are. First by collectives: a rank waits in its n-th collective on the
    default group, so a rank that entered fewer has not reached it (it is elsewhere: a loader, another group's
    collective, a deadlock). Else by progress: the ranks with the fewest steps, or the earliest phase of the step."""
    waiting = [s.get("collectives", 0) for s in states.values() if s and s.get("in_collective")]
    if waiting:
        lagging = sorted(r for r, s in states.items() if s and s.get("collectives", 0) < max(waiting))
        if lagging:
            return lagging

    def progress(s):
        return (s["step"], PHASES.index(s["phase"]) if s["phase"] in PHASES else -1)

    known = {r: progress(s) for r, s in states.items() if s}
    if len(set(known.values())) <= 1:
        return []
    least = min(known.values())
    return sorted(r for r, p in known.items() if p == least)


def summary(states: dict[int, dict | None], culprit_rank: int, limit_s: float, why: str, folder: Path) -> list[str]:
    """The lines the run ends with: what was seen, where every rank was, which ranks are not with the others."""
    lagging = behind({r: s for r, s in states.items() if s})
    lines = [f"hang: no progress for {states[culprit_rank]['stalled_s'] if states.get(culprit_rank) else '?'} s on rank "
             f"{culprit_rank} (limit {limit_s:.0f} s: {why}); every rank's Python stacks are in {folder}"]
    for rank in sorted(states):
        s = states[rank]
        where = (f"step {s['step']} finished, in {s['phase']} for {s['stalled_s']} s"
                 + (f", waiting in {s['in_collective']} (collective {s['collectives']})" if s.get("in_collective") else
                    f", not in a collective ({s.get('collectives', 0)} entered)")
                 if s else "no answer (stuck holding the interpreter, or gone)")
        lines.append(f"  rank {rank}: {where}" + ("   <- not where the others are" if rank in lagging else ""))
    health = named_events([e for r in sorted(states) if states[r] for e in states[r].get("gpu_health", [])],
                          {r: s["gpu"] for r, s in states.items() if s and s.get("gpu") is not None})
    if health:  # each rank read its own GPU: a hang on a GPU that reported an XID is the GPU's, not the code's
        lines.append("  GPU health changed during the run:")
        lines += [f"    {line}" for line in health]
    named = next((s["straggler"] for r, s in sorted(states.items()) if s and s.get("straggler")), None)
    if named:  # every rank names the same one (callbacks/arrivals.py)
        lines.append(f"  before the hang, telemetry had named a {named['line']} (at step {named['since_step']})")
    if len(states) == 1:
        lines.append("  one process: its stacks show where it waits")
    elif not lagging:
        lines.append("  every rank that answered is at the same place: they wait for each other in the same collective "
                     "or on the same resource (see the stacks)")
    lines.append("  a step, evaluation or save that is only slow (a long context on a CPU, a first compile): watchdog=SECONDS "
                 "sets the limit for every phase, watchdog=off turns it off")
    return lines


class Watchdog:
    """The thread, the trip protocol and the dump. One per process."""

    def __init__(self, output_dir: str | Path, limits: Limits, poll_s: float = 1.0, collect_s: float = 10.0,
                 exit=os._exit, namespace: int | None = None):
        self.output_dir, self.limits, self.poll_s, self.collect_s = Path(output_dir), limits, poll_s, collect_s
        self.namespace = namespace  # where this rank's position is published for the entry gate (collective_gate)
        self._published: dict | None = None
        self.progress = Progress()
        self.active = False
        self._exit = exit
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._store = None
        self.gpu: RankGpu | None = None  # this rank's GPU and its health events, for the summary (WatchdogCallback)

    def start(self) -> None:
        """Watch from now on (a thread while watched, none otherwise: nothing outlives the training it watched)."""
        if not self.active:
            self.progress.since = time.monotonic()  # time spent unwatched is not a stall
        self.active = True
        if self._thread is None:
            if self._store is None:
                self._store = _store()
                if self._store is not None:
                    track_collectives(self.progress)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._watch, args=(self._stop,), name="hf_gpu_train-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop watching: the thread ends within one poll."""
        self.active = False
        self._stop.set()
        self._thread = None

    def _watch(self, stopped: threading.Event) -> None:
        while not stopped.wait(self.poll_s):
            try:
                seen = self._store is not None and self._store.check([_KEY])
            except Exception:  # noqa: BLE001 (the store's host is gone: the launcher is ending the run)
                seen = False
            if seen:
                self._report(self._store.get(_KEY).decode(), culprit=None)
                return
            if not self.active or stopped.is_set():
                return
            self._publish_position()
            limit, why = self.progress.limit(self.limits)
            if time.monotonic() - self.progress.since > limit:
                self._report(None, culprit=(limit, why))
                return

    def _publish_position(self) -> None:
        """Tell the other ranks' entry gates where this rank is, when that changed (from this thread: the training
        path never waits on the store for it)."""
        where = self.progress.position()
        if self._store is None or self.namespace is None or where == self._published:
            return

        with contextlib.suppress(Exception):  # the store's host gone: the launcher is ending the run
            publish_position(self._store, self.namespace, _rank()[0], where)
            self._published = where

    def _report(self, stamp: str | None, culprit: tuple[float, str] | None) -> None:
        """Dump, tell, collect, exit: whatever fails on the way (a full disk, a gone store), the process exits."""
        try:
            self._tell_and_dump(stamp, culprit)
        except BaseException as error:  # noqa: BLE001 (the run is ending: nothing here may keep it alive)
            with contextlib.suppress(BaseException):
                print(f"hf_gpu_train: hang detected; its report failed ({type(error).__name__}: {error})", file=sys.stderr,
                      flush=True)
                _stacks_to_stderr()
        finally:
            self._exit(HANG_EXIT_CODE)

    def _tell_and_dump(self, stamp: str | None, culprit: tuple[float, str] | None) -> None:
        rank, world = _rank()
        store = self._store
        if stamp is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            if store is not None:
                try:  # the first rank to trip names the folder; the others follow it
                    stamp = store.compare_set(_KEY, "", f"{stamp}|{rank}").decode()
                except Exception:  # noqa: BLE001
                    pass
        stamp, _, first = stamp.partition("|")
        folder = self.output_dir / f"hang-{stamp}"
        state = {**self.progress.state(), "pid": os.getpid(), "straggler": named_straggler()}
        if self.gpu is not None:  # NVML answers in microseconds; a lost GPU's may not: bounded
            gpu, health = self.gpu, []
            _within(min(self.collect_s, 5.0), lambda: health.extend(gpu.events()))
            state.update(gpu=gpu.index, gpu_health=list(health))
        if culprit is not None:
            state["limit_s"], state["why"] = culprit
        if store is not None:  # before any file: a disk that stops answering must not keep rank 0 from the states
            with contextlib.suppress(Exception):
                store.set(f"{_KEY}/rank/{rank}", json.dumps(state))
        stacks = folder / f"rank-{rank}.txt"

        def dump():
            folder.mkdir(parents=True, exist_ok=True)
            with open(stacks, "w") as f:
                f.write(f"rank {rank} of {world}, pid {os.getpid()}: {json.dumps(state)}\n\n")
                faulthandler.dump_traceback(f, all_threads=True)
            _flight_record(folder, rank)

        if not _within(self.collect_s, dump):
            print(f"hf_gpu_train: rank {rank}: could not write {stacks}; the stacks follow", file=sys.stderr, flush=True)
            _stacks_to_stderr()
        if store is None:
            self._finish({rank: state}, rank, folder, state)
        elif rank == 0:
            states = self._collect(store, world)
            culprit_rank = int(first) if first.isdigit() else rank
            self._finish(states, culprit_rank, folder, states.get(culprit_rank) or state)
            with contextlib.suppress(Exception):
                store.set(f"{_KEY}/done", "1")
        else:
            print(f"hf_gpu_train: rank {rank}: hang detected, stacks in {stacks}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):  # rank 0 gone: what this rank knows is written
                store.wait([f"{_KEY}/done"], _timedelta(self.collect_s + 5))

    def _collect(self, store, world: int) -> dict[int, dict | None]:
        deadline = time.monotonic() + self.collect_s
        states: dict[int, dict | None] = {}
        for other in range(world):
            key = f"{_KEY}/rank/{other}"
            while other not in states:
                try:
                    if store.check([key]):
                        states[other] = json.loads(store.get(key))
                except Exception:  # noqa: BLE001
                    states[other] = None
                if other not in states and time.monotonic() > deadline:
                    states[other] = None
                elif other not in states:
                    time.sleep(0.2)
        return states

    def _finish(self, states, culprit_rank: int, folder: Path, culprit_state: dict) -> None:
        lines = summary(states, culprit_rank, culprit_state.get("limit_s", 0.0), culprit_state.get("why", "seen by another rank"),
                        folder)
        report = {"folder": str(folder), "ranks": {str(r): s for r, s in states.items()},
                  "behind": behind({r: s for r, s in states.items() if s}), "first_to_trip": culprit_rank}
        print("\n".join(f"hf_gpu_train: {line}" for line in lines), file=sys.stderr, flush=True)
        write_hang_report(report)  # for hf-gpu-train launch's last line

        def write():
            (folder / "summary.txt").write_text("\n".join(lines) + "\n")
            (folder / "summary.json").write_text(json.dumps(report, indent=2))

        _within(self.collect_s, write)


def _stacks_to_stderr() -> None:
    """Every thread's stack to the process's stderr (faulthandler needs a real file descriptor)."""
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(stream, all_threads=True)
            return


def _within(seconds: float, work) -> bool:
    """Run ``work`` on a thread of its own and wait at most ``seconds``: True when it finished without error (a disk
    that stops answering blocks that thread, not the report)."""
    done, failed = threading.Event(), []

    def run():
        try:
            work()
        except Exception as error:  # noqa: BLE001
            failed.append(error)
        finally:
            done.set()

    threading.Thread(target=run, name="hf_gpu_train-watchdog-write", daemon=True).start()
    return done.wait(seconds) and not failed


def _flight_record(folder: Path, rank: int) -> None:
    """On NCCL, PyTorch's flight recorder's record of this rank's last collectives (the watchdog ends the run long
    before a collective timeout would dump it). Private torch API: silently nothing where it is missing."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        if dist.is_initialized() and dist.get_backend() == "nccl":
            from torch._C._distributed_c10d import _dump_nccl_trace

            (folder / f"nccl-trace-rank-{rank}.pkl").write_bytes(_dump_nccl_trace())


def _timedelta(seconds: float):

    return timedelta(seconds=seconds)


def _watch_gpu(model, rank: int) -> RankGpu | None:
    """This rank's GPU (by the PCI bus id of the model's device), watched for health events from now on, and left
    in the launcher's progress folder so a launcher can name the GPU of a rank that died."""
    import torch

    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    gpu = RankGpu.watch(normalize_bus_id(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"))
    if gpu is not None:
        gpu.record(rank)
    return gpu


class WatchdogCallback(TrainerCallback):
    """Marks the phases the Trainer goes through; ``attach_watchdog`` adds the evaluation and save phases."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog
        self._hooks = []
        self._in_step = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        progress = self.watchdog.progress
        # a compiled model would trace the hooks (a graph break each): the step's callbacks give its phases then
        if model is not None and not self._hooks and not args.torch_compile:
            self._hooks = [model.register_forward_pre_hook(lambda *a: self._training("forward")),
                           model.register_forward_hook(lambda *a: self._training("backward"))]
        progress.step = state.global_step
        progress.enter("data")
        write_progress(args.process_index, state.global_step, "data")
        if self.watchdog.gpu is None and model is not None:
            self.watchdog.gpu = _watch_gpu(model, args.process_index)
        self.watchdog.start()

    def _training(self, phase: str) -> None:
        progress = self.watchdog.progress
        if progress.phase == "evaluation" and phase == "forward":
            progress.enter("evaluation")  # each evaluation batch is progress
        elif self._in_step and progress.phase not in ("evaluation", "save"):
            # only inside a step: a forward between steps (a callback generating samples in on_log) is not the next
            # step, and the entry gates read "forward at step N" as a rank that went on past step N
            progress.enter(phase)

    def on_step_begin(self, args, state, control, **kwargs):
        self._in_step = True
        self.watchdog.progress.enter("forward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.watchdog.progress.enter("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self._in_step = False
        self.watchdog.progress.step_done(state.global_step)
        write_progress(args.process_index, state.global_step, "data")

    def on_prediction_step(self, args, state, control, **kwargs):
        self.watchdog.progress.enter("evaluation")

    def on_train_end(self, args, state, control, **kwargs):
        self.watchdog.stop()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def attach_watchdog(trainer, timeout="auto", output_dir: str | Path | None = None, **options) -> Watchdog | None:
    """Watch ``trainer`` (anyone's Trainer, TRL's included) on this rank. ``timeout``: ``auto`` (a floor of 120 s per
    step and 600 s for the first step, evaluations and saves, or 10 x the measured time when longer), seconds, or
    ``off``. With several processes its evaluations and saves are made collective-safe too
    (``collective_gate.make_collective_safe``). Returns the Watchdog (None when off)."""

    check_not_alone(trainer)
    limits = Limits.from_setting(timeout)
    if limits is None:
        return None
    namespace = new_namespace()
    watchdog = Watchdog(output_dir or trainer.args.output_dir, limits, namespace=namespace, **options)
    trainer.add_callback(WatchdogCallback(watchdog))
    # evaluations and saves every rank enters, or a clear error (inside the phase wrappers: the wait is watched too)
    make_collective_safe(trainer, namespace, watchdog.progress, timeout_s=limits.long_floor_s)
    for name, phase in (("evaluate", "evaluation"), ("_save_checkpoint", "save"), ("save_model", "save")):
        _wrap_phase(trainer, name, phase, watchdog)
    _disarm_after(trainer, "train", watchdog)
    trainer._hf_gpu_train_watchdog = watchdog
    return watchdog


def _disarm_after(trainer, name: str, watchdog: Watchdog) -> None:
    """However ``trainer.<name>`` ends (an exception, a KeyboardInterrupt, a callback that stops it), the watchdog
    stops with it: an armed watchdog outliving its training would end the process minutes later."""
    original = getattr(trainer, name)

    def disarming(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            watchdog.stop()

    setattr(trainer, name, disarming)


def _wrap_phase(trainer, name: str, phase: str, watchdog: Watchdog) -> None:
    """Run ``trainer.<name>`` as ``phase``: its own floor, and after it the phase the run was in (an evaluation
    outside training is watched too, and unwatched again after)."""
    original = getattr(trainer, name)

    def wrapped(*args, **kwargs):
        progress, was_active = watchdog.progress, watchdog.active
        before = progress.phase
        if before == phase:  # save_model inside _save_checkpoint: one phase
            return original(*args, **kwargs)
        progress.enter(phase)
        watchdog.start()
        try:
            return original(*args, **kwargs)
        finally:
            progress.enter("data" if before in ("optimizer", "backward", "forward") else before)
            if not was_active:
                watchdog.stop()

    setattr(trainer, name, wrapped)
