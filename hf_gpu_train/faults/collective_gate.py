"""Saves and evaluations that every rank enters, or none does.

With several processes an evaluation gathers every rank's predictions, a checkpoint holds every rank's RNG state
(and under FSDP or DeepSpeed its shards), and logging averages the loss over the ranks: one rank that enters one of
them alone waits forever for the others. Two ways a run gets there, and what this module does about each:

1. **A decision one rank takes alone**: a callback sets ``control.should_save`` (or ``should_evaluate``,
   ``should_log``, ``should_training_stop``) from something only its rank sees (its own clock, a file it reads).
   Before the Trainer acts on its flags after a step, the ranks all-reduce them (one small all-reduce per step, a
   second after a log, evaluation or save): any rank's save or evaluation is every rank's. ``agree_on_control``;
   ``attach_watchdog``, ``attach_telemetry`` and ``guard_saves`` each install it.
2. **A call made on one rank only**: ``if trainer.is_world_process_zero(): trainer.evaluate()`` (or
   ``save_model()`` under FSDP or DeepSpeed, where it gathers the shards). Each rank that enters such a call posts
   its entry to the rendezvous store and waits for every rank's; a rank that is seen going on to its next step
   (the watchdog thread publishes where its rank is), or entering another call, or not entering within
   ``timeout_s``, turns the wait into ``RankMismatch`` naming it, instead of a hang. ``EntryGate``.

``save_model()`` under plain DDP gathers nothing: calling it on rank 0 only is the documented idiom and stays allowed.
"""

from __future__ import annotations

import itertools
import json
import time

from ..process_group import rendezvous_store

FLAGS = ("should_log", "should_evaluate", "should_save", "should_training_stop", "should_epoch_stop")
STOP_FLAGS = ("should_training_stop", "should_epoch_stop")
_KEY = "hf_gpu_train/gate"
PASSED_PHASES = ("forward", "backward", "optimizer")  # a rank in one of these at my step has begun the next step
_namespaces = itertools.count()


class RankMismatch(RuntimeError):
    """A collective call entered by some ranks and not by others."""


def new_namespace() -> int:
    """One per watched Trainer, in the order every rank makes them: keys of an earlier Trainer are never read."""
    return next(_namespaces)


def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def agree_flags(control, names=FLAGS) -> None:
    """Every rank's flags become the OR of all ranks' (one all-reduce of ``len(names)`` integers, on the CPU: never a
    GPU synchronisation per step; on NCCL through a gloo group made for it)."""
    import torch

    dist = _distributed()
    if dist is None:
        return
    flags = torch.tensor([int(bool(getattr(control, name))) for name in names], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=_cpu_group(dist))
    for name, value in zip(names, flags.tolist()):
        setattr(control, name, bool(value))


_CPU_GROUP: list = []


def _cpu_group(dist, timeout=None):
    """None (the default group) where it takes CPU tensors, else a gloo group over every rank, made on first use: in
    the preflight (``timeout``: its short one, then the run's), or at every rank's first step's flags (the collective
    ``new_group`` is safe there: every rank reaches it in the same order)."""
    if dist.get_backend() == "gloo":
        return None
    if not _CPU_GROUP:
        _CPU_GROUP.append(dist.new_group(backend="gloo", **({"timeout": timeout} if timeout is not None else {})))
    return _CPU_GROUP[0]


AFTER_AGREEMENT = "_hf_gpu_train_after_agreement"  # the hooks run once the flags are agreed (an attribute of ours)
ACTING_FLAGS = ("should_log", "should_evaluate", "should_save")
# Callbacks that set no control flag, or set them only from what every rank sees alike (the Trainer's schedule, metrics
# gathered from every rank, a value all-reduced once). With only these, no rank can hold a flag the others lack, and the
# per-step all-reduce is left out (measured on 2 gloo processes here: ~5 ms of an 18 ms tiny step). Exact classes, by
# name: a subclass, any other callback (the user's, TRL's, transformers' JITCheckpointCallback, set from a SIGTERM on
# one rank) turns the agreement on.
FLAGS_ALIKE = frozenset({
    "transformers.trainer_callback.DefaultFlowCallback", "transformers.trainer_callback.PrinterCallback",
    "transformers.trainer_callback.ProgressCallback", "transformers.trainer_callback.EarlyStoppingCallback",
    "transformers.utils.notebook.NotebookProgressCallback",
    "hf_gpu_train.callbacks.telemetry.TelemetryCallback", "hf_gpu_train.callbacks.console.CompactPrinterCallback",
    "hf_gpu_train.callbacks.guards.CpuByAccidentGuard", "hf_gpu_train.faults.watchdog.WatchdogCallback",
    "hf_gpu_train.oom.recovery.OOMRecoveryState", "hf_gpu_train.oom.recovery._RecoveryHooks",
    "hf_gpu_train.levers.optimizer_in_backward._InBackwardGuard", "hf_gpu_train.finetune.intervals.EveryFewMinutes",
    "hf_gpu_train.finetune.evaluate_before.EvaluateBeforeTraining", "hf_gpu_train.tune.meter.TrialMeter",
})
REPORTERS = "transformers.integrations.integration_utils"  # the report_to sinks (TensorBoard, W&B ...): they set no flag


def sets_flags_alike(callback) -> bool:
    kind = type(callback)
    return f"{kind.__module__}.{kind.__qualname__}" in FLAGS_ALIKE or kind.__module__ == REPORTERS


def needs_agreement(trainer) -> bool:
    """Whether any rank's Trainer has a callback that may set a flag from what its rank alone sees: asked once per
    ``train()`` (one all-reduce), as a rank may add a callback the others lack (``if is_main_process: add_callback``)."""
    handler = getattr(trainer, "callback_handler", None)
    return any_rank(any(not sets_flags_alike(callback) for callback in getattr(handler, "callbacks", [])))


def any_rank(mine: bool) -> bool:
    """True on every rank when it is true on any (one all-reduce on the CPU; every rank must call it at the same
    point: only where every rank arrives whatever it decided)."""
    import torch

    dist = _distributed()
    if dist is None:
        return bool(mine)
    votes = torch.tensor([int(bool(mine))], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=_cpu_group(dist))
    return bool(votes.item())


def lowest_and_highest(value: int) -> tuple[int, int]:
    """(the lowest, the highest) of ``value`` over every rank (one all-reduce on the CPU; every rank must call it at the
    same point)."""
    import torch

    dist = _distributed()
    if dist is None:
        return value, value
    both = torch.tensor([-int(value), int(value)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_cpu_group(dist))
    return -int(both[0]), int(both[1])


def agree_on_control(trainer, after_agreement=None) -> bool:
    """Agree the control flags before the Trainer logs, evaluates, saves or stops after a step (whatever callback set
    them, in whatever order callbacks were added), and the stop flags again after a log, evaluation or save (a
    callback's ``on_log``, ``on_evaluate`` or ``on_save`` may set them from what its rank alone sees; on the other
    steps none of those runs, so the second all-reduce is left out). When every rank's callbacks set their flags alike
    (``FLAGS_ALIKE``; asked once per ``train()``), there is nothing to agree and no all-reduce. Installed once per
    Trainer, by whichever of
    ``attach_watchdog``, ``attach_telemetry`` and ``guard_saves`` comes first. ``after_agreement()`` runs once the
    flags are agreed, before the Trainer acts on them: the place for anything of ours that may enter a collective on a
    flag (telemetry's gather at a log step). Returns False for a Trainer without this step (nothing agreed)."""
    hooks = getattr(trainer, AFTER_AGREEMENT, None)
    if hooks is None:
        original = getattr(trainer, "_maybe_log_save_evaluate", None)
        if original is None:  # a Trainer without this step: nothing to agree on here
            return False
        hooks = []
        asked: list = [None, False]  # (the TrainerState of the train() it was asked for, its answer)

        def agreed(*args, **kwargs):
            if asked[0] is not trainer.state:  # a new train() makes a new TrainerState
                asked[:] = [trainer.state, needs_agreement(trainer)]
            if asked[1]:
                agree_flags(trainer.control)
            acting = any(getattr(trainer.control, name) for name in ACTING_FLAGS)  # agreed: alike on every rank
            for hook in list(hooks):
                hook()
            if not asked[1]:
                return original(*args, **kwargs)
            # the Trainer logs, then evaluates, then saves, in this one call: a callback's on_log or on_evaluate may set
            # should_evaluate or should_save from what its rank alone sees, so the flags are agreed again after each
            # (every rank logs or evaluates here, or none: what decides it was agreed)
            restore = _agree_after(trainer, ("log", "_evaluate"))
            try:
                result = original(*args, **kwargs)  # an exception leaves at once: no collective while it is in flight
            finally:
                restore()
            if acting:
                agree_flags(trainer.control, STOP_FLAGS)
            return result

        trainer._maybe_log_save_evaluate = agreed
        setattr(trainer, AFTER_AGREEMENT, hooks)
    if after_agreement is not None and after_agreement not in hooks:
        hooks.append(after_agreement)
    return True


def _agree_after(trainer, names: tuple[str, ...]):
    """Wrap these methods of the Trainer instance so the control flags are agreed after each call; returns the undo."""
    wrapped = {}
    for name in names:
        original = getattr(trainer, name, None)
        if original is None:
            continue
        had_own = name in vars(trainer)

        def agreeing(*args, _original=original, **kwargs):
            result = _original(*args, **kwargs)
            agree_flags(trainer.control)
            return result

        wrapped[name] = (had_own, original)
        setattr(trainer, name, agreeing)

    def restore() -> None:
        for name, (had_own, original) in wrapped.items():
            if had_own:
                setattr(trainer, name, original)
            else:
                delattr(trainer, name)

    return restore


def wait_for_every_rank() -> None:
    """A barrier on the CPU (a gloo all-reduce of one integer), for a step every rank takes on an agreed decision."""
    import torch

    dist = _distributed()
    if dist is not None:
        dist.all_reduce(torch.zeros(1, dtype=torch.int32), group=_cpu_group(dist))


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
        dist = _distributed()
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
