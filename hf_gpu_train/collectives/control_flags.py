"""The Trainer's control flags agreed by every rank before the Trainer acts on them.

With several processes an evaluation gathers every rank's predictions, a checkpoint holds every rank's RNG state
(and under FSDP or DeepSpeed its shards), and logging averages the loss over the ranks: one rank that enters one of
them alone waits forever for the others. A callback may set ``control.should_save`` (or ``should_evaluate``,
``should_log``, ``should_training_stop``) from something only its rank sees (its own clock, a file it reads). Before
the Trainer acts on its flags after a step, the ranks all-reduce them (one small all-reduce per step, a second after a
log, evaluation or save): any rank's save or evaluation is every rank's. ``agree_on_control``; ``attach_watchdog``,
``attach_telemetry``, ``guard_saves``, ``attach_preemption`` and ``enable_oom_recovery`` each install it (once per
Trainer). A call made on one rank only (``if trainer.is_world_process_zero(): trainer.evaluate()``) is the entry
gate's (``faults/collective_gate.py``).
"""

from __future__ import annotations

from ..instance_methods import replace_methods
from .cpu_votes import any_rank, cpu_group, several_processes
from .wait_clock import waiting

FLAGS = ("should_log", "should_evaluate", "should_save", "should_training_stop", "should_epoch_stop")
STOP_FLAGS = ("should_training_stop", "should_epoch_stop")


def agree_flags(control, names=FLAGS) -> None:
    """Every rank's flags become the OR of all ranks' (one all-reduce of ``len(names)`` integers, on the CPU: never a
    GPU synchronisation per step; on NCCL through a gloo group made for it)."""
    import torch

    dist = several_processes()
    if dist is None:
        return
    flags = torch.tensor([int(bool(getattr(control, name))) for name in names], dtype=torch.int32)
    with waiting():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cpu_group(dist))
    for name, value in zip(names, flags.tolist()):
        setattr(control, name, bool(value))


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
    "hf_gpu_train.oom.policy.OOMRecoveryState", "hf_gpu_train.oom.recovery._RecoveryHooks",
    "hf_gpu_train.levers.optimizer_in_backward._InBackwardGuard", "hf_gpu_train.finetune.intervals.EveryFewMinutes",
    "hf_gpu_train.finetune.evaluate_before.EvaluateBeforeTraining", "hf_gpu_train.tune.meter.TrialMeter",
    "hf_gpu_train.faults.checkpoint_costs.CheckpointCosts",  # sets no flag
    # votes on the write in flight; the callbacks it tells at a vote hear alike on every rank
    "hf_gpu_train.faults.background_save.attach_to_trainer.<locals>.BackgroundSavesAtStepBoundaries",
})
REPORTERS = "transformers.integrations.integration_utils"  # the report_to sinks (TensorBoard, W&B ...): they set no flag
# A callback of the user's that sets no control flag, or sets them only from what every rank sees alike, says so with
# this class attribute set to True: without it any callback of the user's turns the per-step all-reduce on
DECLARED_ALIKE = "hf_gpu_train_sets_flags_alike"


def sets_flags_alike(callback) -> bool:
    kind = type(callback)
    return (f"{kind.__module__}.{kind.__qualname__}" in FLAGS_ALIKE or kind.__module__ == REPORTERS
            or vars(kind).get(DECLARED_ALIKE) is True)


def needs_agreement(trainer) -> bool:
    """Whether any rank's Trainer has a callback that may set a flag from what its rank alone sees: asked once per
    ``train()`` (one all-reduce), as a rank may add a callback the others lack (``if is_main_process: add_callback``)."""
    handler = getattr(trainer, "callback_handler", None)
    return any_rank(any(not sets_flags_alike(callback) for callback in getattr(handler, "callbacks", [])))


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

    def agreeing_after(original):
        def agreeing(*args, **kwargs):
            result = original(*args, **kwargs)
            agree_flags(trainer.control)
            return result

        return agreeing

    return replace_methods(trainer, dict.fromkeys(names, agreeing_after))
