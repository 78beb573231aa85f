"""Saves and evaluations that every rank enters, or none does.

With several processes an evaluation gathers every rank's predictions, a checkpoint holds every rank's RNG state
(and under FSDP or DeepSpeed its shards), and logging averages the loss over the ranks: one rank that enters one of
them alone waits forever for the others. Two ways a run gets there, and what is done about each:

1. **A decision one rank takes alone**: a callback sets ``control.should_save`` (or ``should_evaluate``,
   ``should_log``, ``should_training_stop``) from something only its rank sees (its own clock, a file it reads).
   Before the Trainer acts on its flags after a step, the ranks all-reduce them (one small all-reduce per step, a
   second after a log, evaluation or save): any rank's save or evaluation is every rank's. ``agree_on_control``
   (``collectives/control_flags.py``, below ``oom/`` and ``faults/``: the OOM recovery installs it too);
   ``attach_watchdog``, ``attach_telemetry`` and ``guard_saves`` each install it.
2. **A call made on one rank only**: ``if trainer.is_world_process_zero(): trainer.evaluate()`` (or
   ``save_model()`` under FSDP or DeepSpeed, where it gathers the shards). Each rank that enters such a call posts
   its entry to the rendezvous store and waits for every rank's; a rank that is seen going on to its next step
   (the watchdog thread publishes where its rank is), or entering another call, or not entering within
   ``timeout_s``, turns the wait into ``RankMismatch`` naming it, instead of a hang. ``EntryGate``, here.

``save_model()`` under plain DDP gathers nothing: calling it on rank 0 only is the documented idiom and stays allowed.
"""

from __future__ import annotations

import itertools
import json
import time

from ..collectives.control_flags import agree_on_control
from ..collectives.cpu_votes import several_processes
from ..process_group import rendezvous_store

_KEY = "hf_gpu_train/gate"
PASSED_PHASES = ("forward", "backward", "optimizer")  # a rank in one of these at my step has begun the next step
_namespaces = itertools.count()


class RankMismatch(RuntimeError):
    """A collective call entered by some ranks and not by others."""


def new_namespace() -> int:
    """One per watched Trainer, in the order every rank makes them: keys of an earlier Trainer are never read."""
    return next(_namespaces)


def publish_position(store, namespace: int, rank: int, position: dict) -> None:
    """Where this rank is: ``Progress.position()`` (called from the watchdog's thread, never the training path)."""
    store.set(f"{_KEY}/{namespace}/at/{rank}", json.dumps(position))


def not_coming(where: dict | None, step: int, collectives: int) -> str | None:
    """Why a rank that has not entered the call never will, from where it was last seen (None: it may yet come).
    Positions are published late, never early, so only what cannot be undone counts: it began a later step, or it
    waits in a collective this rank has not entered (its count is higher), which cannot end before this rank joins."""
    if where is None:
        return None
    if where["step"] > step or (where["step"] == step and where["phase"] in PASSED_PHASES):
        return f"went on to step {where['step'] + 1} ({where['phase']}) without it"
    if where.get("in_collective") and where.get("collectives", 0) > collectives:
        return (f"waits in {where['in_collective']} instead (its collective {where['collectives']}; this rank entered "
                f"{collectives})")
    return None


class EntryGate:
    """Every rank posts each gated call it enters, in order; ``enter`` returns once all ranks posted the same call."""

    def __init__(self, namespace: int, progress=None, timeout_s: float = 120.0, poll_s: float = 0.05):
        self.namespace, self.progress, self.timeout_s, self.poll_s = namespace, progress, timeout_s, poll_s
        self.entered = 0
        self._store = None

    def _connect(self):
        if self._store is None:

            self._store = rendezvous_store()
        return self._store

    def enter(self, call: str, step: int) -> None:
        dist = several_processes()
        store = self._connect() if dist is not None else None
        if store is None:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        self.entered += 1
        prefix = f"{_KEY}/{self.namespace}/entry/{self.entered}"
        store.set(f"{prefix}/{rank}", json.dumps({"call": call, "step": step}))
        missing = set(range(world)) - {rank}
        deadline, pause = time.monotonic() + self.timeout_s, self.poll_s
        while missing:
            for other in sorted(missing):
                if store.check([f"{prefix}/{other}"]):
                    theirs = json.loads(store.get(f"{prefix}/{other}"))
                    if theirs["call"] != call:
                        raise RankMismatch(self._message(call, step, rank, other, f"entered {theirs['call']} instead"))
                    missing.discard(other)
                    continue
                why = not_coming(self._position(store, other), step, self.progress.collectives if self.progress else 0)
                if why:
                    raise RankMismatch(self._message(call, step, rank, other, why))
            if missing and time.monotonic() > deadline:
                raise RankMismatch(self._message(call, step, rank, min(missing), f"did not enter it within {self.timeout_s:.0f} s"))
            if missing:
                time.sleep(pause)
                pause = min(pause * 1.5, 1.0)

    def _position(self, store, other: int) -> dict | None:
        key = f"{_KEY}/{self.namespace}/at/{other}"
        return json.loads(store.get(key)) if store.check([key]) else None

    @staticmethod
    def _message(call: str, step: int, rank: int, other: int, what: str) -> str:
        return (f"{call} was entered by rank {rank} at step {step}, but rank {other} {what}. With several processes "
                f"{call} needs every rank (it gathers from all of them): call it on every rank, not under "
                "`if trainer.is_world_process_zero()` (it writes files on the main process only by itself), and take "
                "any decision to call it from something every rank sees alike. Stopped here instead of hanging.")


def gated(trainer, name: str, gate: EntryGate, when=lambda *args, **kwargs: True) -> None:
    """``trainer.<name>`` passes ``gate`` first when ``when(*args, **kwargs)``."""
    original = getattr(trainer, name)

    def through_the_gate(*args, **kwargs):
        if when(*args, **kwargs):
            gate.enter(f"trainer.{name.lstrip('_')}()", trainer.state.global_step)
        return original(*args, **kwargs)

    setattr(trainer, name, through_the_gate)


def gathers_in_save_model(trainer) -> bool:
    """Whether ``save_model`` needs every rank: FSDP with a full state dict, DeepSpeed ZeRO-3 (the shards are gathered).
    Plain DDP, ZeRO-1/2 and FSDP's sharded state dict write from each rank's own copy."""
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = getattr(getattr(trainer.accelerator, "state", None), "fsdp_plugin", None)
        return "FULL_STATE_DICT" in str(getattr(plugin, "state_dict_type", "FULL_STATE_DICT"))
    if getattr(trainer, "is_deepspeed_enabled", False):
        config = getattr(getattr(trainer, "deepspeed", None), "config", None) or {}
        return (config.get("zero_optimization", {}) or {}).get("stage") == 3
    return False


def _user_call(*args, _internal_call=False, **kwargs) -> bool:
    return not (_internal_call or (len(args) > 1 and args[1] is True))


def make_collective_safe(trainer, namespace: int, progress=None, timeout_s: float = 600.0) -> EntryGate:
    """Agree the control flags after each step, and gate evaluations, checkpoints and (where it gathers) save_model.
    ``progress``: this rank's ``watchdog.Progress`` (its collective count tells a stale position from a real one).
    ``timeout_s``: how long a rank waits for the others without evidence that they will not come (the watchdog's long
    floor: rank 0 may still be writing a report or a checkpoint while the others wait)."""
    gate = EntryGate(namespace, progress, timeout_s)
    agree_on_control(trainer)
    gated(trainer, "save_model", gate, when=lambda *a, **kw: _user_call(*a, **kw) and gathers_in_save_model(trainer))
    gated(trainer, "evaluate", gate)
    gated(trainer, "_save_checkpoint", gate)
    return gate
