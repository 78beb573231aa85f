"""In-place OOM recovery for the Hugging Face Trainer: same step, same effective batch, every rank agrees.

``enable_oom_recovery(trainer)`` wraps the Trainer's ``training_step``, ``prediction_step`` and
``compute_loss`` on the instance (a Trainer callback has no exception hook). This module is the wiring; the pieces,
one concept each:

- ``policy.py``: the micro-batch policy, for training and evaluation alike: shrink on an OOM, grow back after clean
  steps, adopt what the ranks agreed, and the ranges a micro-step or a prediction step is cut into; the sizes are saved
  with every checkpoint (``OOMRecoveryState``).
- ``training_step.py``: the in-place training step. When a step runs out of memory the micro-batch halves and the step
  goes on with the *same* inputs, cut into micro-batches whose losses are weighed by their share of what the loss
  averages over (asked of the loss at the first step: ``loss_scaling.py``), so the gradient equals the whole batch's.
  ``global_step``, the LR schedule, the data order and the effective batch do not change.
- ``evaluation.py``: the in-place prediction step, with its own evaluation micro-batch, and the join of its results.
- ``step_machinery.py``: what both share on several processes: the gradient reducer (``grad_sync.py``: DDP's overlap
  with a state we own) and the ballots (``lockstep.py``: every rank in the same collectives while one recovers).
- the batch divides into samples by its layout (``microbatch.layout_for``): rows, or chosen/rejected pairs for TRL's DPO
  (its loss pairs row i with row i + n).

Compared with ``auto_find_batch_size`` (restarts the loop with a smaller batch, changes the effective batch,
no cross-rank agreement) and Composer's microbatching (in place, outside the HF stack).

Limits, said plainly: FSDP and DeepSpeed step aside with a warning, before training (their collectives run inside
forward and backward), and so do trainers that prepare their own batches inside each step (TRL's GRPO generates and
counts its calls in ``_prepare_inputs``). Collectives are seen through ``torch.distributed``'s Python functions,
looked up at call time (accelerate, TRL and most code do); one bound at import (``from torch.distributed import
all_reduce``) is not seen. BatchNorm normalises each micro-batch with its own statistics, so a split step is close to, not
equal to, the whole batch (a warning says so once).
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

from ..collectives.control_flags import agree_on_control
from ..collectives.lone_rank import check_not_alone
from ..errors import UsageError
from .batch_terms import RouterBalanceSplit
from .evaluation import InPlacePredictionStep
from .evaluation_memory import guard_evaluation_memory
from .grad_sync import BUCKET_BYTES, GradientReducer
from .lockstep import Lockstep
from .loss_scaling import LossScalingGuard, LossWeighting, Probe, guard_loss_scaling
from .microbatch import CHUNKS, is_oom_error, layout_for
from .policy import GROW_AFTER_STEPS, MicroBatchPolicy, OOMRecoveryState
from .step_machinery import StepMachinery
from .training_step import ON_INEXACT, InPlaceTrainingStep

log = logging.getLogger("hf_gpu_train.oom")
THRASH_STEPS = 3


class _RecoveryHooks(TrainerCallback):
    """The recovery's view of the loop: not exportable, so the Trainer never swaps it out."""

    def __init__(self, recovery: InPlaceOOMRecovery):
        self.recovery = recovery
        self._retries: list[float] = []
        self._warned_thrash = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.recovery.train_begins(state)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.recovery.optimizer_step_done()
        self._check_thrash()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.recovery.train_ends()
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        self.recovery.agree_on_eval_micro_batch()
        return control

    on_predict = on_evaluate

    def _check_thrash(self) -> None:
        """Allocator retries climbing step after step: cudaMalloc failed, caches were flushed, and it
        worked on the second try. That is memory thrash, and usually the step before an OOM."""
        # is_initialized, not is_available: no CUDA allocation has happened before CUDA started, and is_available asks
        # the driver at every call (~0.1 ms a step on a machine without a GPU)
        if self._warned_thrash or not torch.cuda.is_initialized():
            return
        # the nested form: memory_stats() flattens ~100 entries into a new dict at every step
        self._retries.append(float(torch.cuda.memory_stats_as_nested_dict().get("num_alloc_retries", 0)))
        self._retries = self._retries[-(THRASH_STEPS + 1):]
        rising = len(self._retries) > THRASH_STEPS and all(b > a for a, b in zip(self._retries, self._retries[1:]))
        if rising:
            self._warned_thrash = True
            log.warning("OOM recovery: CUDA allocator retries rose in each of the last %d steps (%d now): memory thrash, an "
                        "OOM is near. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or lower the micro-batch.",
                        THRASH_STEPS, int(self._retries[-1]))


class InPlaceOOMRecovery:
    """In-place OOM recovery on one Trainer, assembled: the micro-batch policy, the training step, the prediction step
    and the machinery they share, installed on the Trainer instance, with the callbacks that tell it where the loop is.
    Its attributes are the pieces' (read by tests, benchmarks and ``hf-gpu-train tune``)."""

    def __init__(self, trainer, guard: LossScalingGuard, grow_after_steps: int | None = GROW_AFTER_STEPS, bucket_bytes: int = BUCKET_BYTES,
                 weighting: LossWeighting | None = None, on_inexact: str = "recover"):
        self.trainer = trainer
        self.layout = layout_for(trainer)  # rows, or chosen/rejected pairs (TRL's DPO)
        self.policy = MicroBatchPolicy(lambda: trainer.state.global_step, grow_after_steps)
        self.machinery = StepMachinery(trainer, bucket_bytes)
        self.training = InPlaceTrainingStep(trainer, self.policy, self.machinery, self.layout, guard, weighting, on_inexact)
        self.evaluation = InPlacePredictionStep(trainer, self.policy, self.machinery, self.layout, self.training)
        self.hooks = _RecoveryHooks(self)
        self.stepped_aside: str | None = None  # why recovery is off for this Trainer, said before training

    def install(self) -> InPlaceOOMRecovery:
        t = self.trainer
        t.training_step = self.training.training_step
        t.prediction_step = self.evaluation.prediction_step
        t.compute_loss = self.training.compute_loss
        t.add_callback(self.state)
        t.add_callback(self.hooks)
        return self

    # -- the pieces' figures -------------------------------------------------------------------------------------------
    @property
    def state(self) -> OOMRecoveryState:
        return self.policy.state

    @property
    def micro_batch(self) -> int | None:
        return self.policy.micro_batch

    @property
    def events(self) -> list[dict]:
        return self.policy.events

    @property
    def grow_after_steps(self) -> int | None:
        return self.policy.grow_after_steps

    @property
    def weighting(self) -> LossWeighting | None:
        return self.training.weighting

    @property
    def inexact(self) -> Probe | None:
        return self.training.inexact

    @property
    def batch_terms(self) -> RouterBalanceSplit | None:
        return self.training.batch_terms

    @property
    def restarts(self) -> int:
        return self.training.restarts

    @property
    def _probes(self) -> int:
        return self.training._probes

    @property
    def reducer(self) -> GradientReducer | None:
        return self.machinery.reducer

    @property
    def lockstep(self) -> Lockstep | None:
        return self.machinery.lockstep

    @property
    def overlapped_buckets(self) -> int:
        return self.machinery.overlapped_buckets

    # -- the loop ------------------------------------------------------------------------------------------------------
    def train_begins(self, trainer_state) -> None:
        """Find the state object the Trainer holds now (it may have rebuilt it from a checkpoint) and, when the
        Trainer does not restore callback states itself, restore the micro-batches recorded in the checkpoint."""
        handler = self.trainer.callback_handler
        self.policy.state = next((c for c in handler.callbacks if isinstance(c, OOMRecoveryState)), self.policy.state)
        if not self.trainer.args.restore_callback_states_from_checkpoint:
            self.policy.state.restore_from(trainer_state)
        self.policy.begin_training()
        self.training.fresh = True
        CHUNKS.reset()

    def optimizer_step_done(self) -> None:
        self.training.fresh = True  # the next training_step starts an optimizer step
        self.policy.optimizer_step_done()

    def agree_on_eval_micro_batch(self) -> None:
        self.policy.agree_on_eval_micro_batch(self.trainer.accelerator.num_processes, self.trainer.accelerator.device)

    def train_ends(self) -> None:
        """Take the gradient hooks off the parameters: a later Trainer on the same model must not carry them."""
        CHUNKS.reset()  # a run that ended part-way through a recovery leaves no voided micro-batch behind
        self.machinery.close()


def step_aside_reason(trainer) -> str | None:
    """Why in-place recovery cannot work for this Trainer, known before training starts (None: it can)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "under FSDP its collectives run inside forward and backward; use the planner's micro-batch (plan-memory)"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return ("DeepSpeed's engine owns gradient accumulation and the optimizer step (it counts every backward as a "
                "micro-step and reduces gradients inside it), so a step cannot be run again in smaller pieces; use the "
                "planner's micro-batch (plan-memory)")
    from transformers import Trainer

    if getattr(type(trainer), "_prepare_inputs", None) is not Trainer._prepare_inputs:
        # GRPOTrainer (and RLOO, online DPO ...): its training_step receives prompts, generates and scores completions
        # inside _prepare_inputs and advances a counter of its own on every call
        return (f"{type(trainer).__name__} prepares its own batches inside every training step (it generates and scores "
                "completions and counts its calls), so a step cannot be run again in micro-batches; if it runs out of "
                "memory, lower per_device_train_batch_size and raise gradient_accumulation_steps (or steps_per_generation)")
    return None


class OutOfMemoryWithoutRecovery(UsageError):
    """An out-of-memory error in a Trainer whose in-place recovery stepped aside: the micro-batch is the user's to lower."""


def _name_an_oom_without_recovery(trainer, reason: str) -> None:
    """An OOM that ends ``trainer.train()`` while recovery is off ends it with the reason and the fix, not a bare
    traceback (raised on the rank that ran out; the others end as their launcher ends them). Wrapped once per Trainer."""
    if getattr(trainer, "_hf_gpu_train_oom_named", False):
        return
    trainer._hf_gpu_train_oom_named = True
    train = trainer.train

    def train_naming_the_oom(*args, **kw):
        try:
            return train(*args, **kw)
        except Exception as error:
            if not is_oom_error(error):
                raise
            a = trainer.args
            raise OutOfMemoryWithoutRecovery(
                f"out of memory on rank {a.process_index} after optimizer step {trainer.state.global_step} "
                f"(per_device_train_batch_size={a.per_device_train_batch_size}, per_device_eval_batch_size="
                f"{a.per_device_eval_batch_size}); in-place OOM recovery is off for {type(trainer).__name__}: {reason}. "
                "In a training step: lower per_device_train_batch_size and raise gradient_accumulation_steps by the same "
                "factor (the effective batch stays; `hf-gpu-train plan-memory` sizes it); in an evaluation: lower "
                "per_device_eval_batch_size. Then resume from the last complete checkpoint (scripts/finetune.py: the "
                f"same command) [{str(error).splitlines()[0][:200]}]") from error

    trainer.train = train_naming_the_oom


def enable_oom_recovery(trainer, grow_after_steps: int | None = GROW_AFTER_STEPS, bucket_bytes: int = BUCKET_BYTES,
                        loss_weighting=None, on_inexact: str = "recover") -> InPlaceOOMRecovery:
    """One line for anyone's Trainer: ``enable_oom_recovery(trainer)`` before ``trainer.train()``. Installs the
    loss-scaling guard too (``loss_scaling.py``): micro-batch scaling needs to know a mean from a sum. ``bucket_bytes``:
    the size of the gradient buckets averaged under DDP (DDP's ``bucket_cap_mb``, 25 MiB).

    Where recovery cannot work for this Trainer (``step_aside_reason``) it says so now, once, and changes nothing:
    the returned object's ``stepped_aside`` holds the reason.

    ``grow_after_steps``: clean optimizer steps at a smaller micro-batch before it doubles again (the wait doubles
    each time a grown micro-batch runs out of memory again); None: never grow back.

    ``loss_weighting``: what the loss averages over, when the loss itself cannot tell (``loss_scaling.py`` asks it at the
    first steps and says so when it cannot): ``"rows"``, ``"tokens"`` (labelled tokens), ``"next-tokens"`` (a causal LM's
    shifted labels), ``"sum"``, or a function of a micro-batch's inputs returning how many items its loss averages over.

    ``on_inexact``: what an OOM does in a run whose loss was found, at the first step, not to split into micro-batches
    exactly (a term over the whole batch that no weighting splits; said then, with the measured deviation):
    ``"recover"`` approximately (the default), or ``"stop"`` with the fix (``InexactSplitRefused``, a usage error). A
    mixture-of-experts router's load-balancing loss is split exactly (``batch_terms.py``) and checked like the rest."""
    check_not_alone(trainer)
    if on_inexact not in ON_INEXACT:
        raise ValueError(f"on_inexact={on_inexact!r} is not one of {', '.join(map(repr, ON_INEXACT))}: 'recover' trains on "
                         "approximately after an OOM in a step whose loss does not split exactly, 'stop' stops with the fix")
    told = LossWeighting.told(loss_weighting) if loss_weighting is not None else None
    guard = guard_loss_scaling(trainer)
    guard_evaluation_memory(trainer)  # predictions piling up in an evaluation: said, moved off the GPU, before the OOM
    recovery = InPlaceOOMRecovery(trainer, guard, grow_after_steps=grow_after_steps, bucket_bytes=bucket_bytes, weighting=told,
                                  on_inexact=on_inexact)
    reason = step_aside_reason(trainer)
    if reason is not None:
        recovery.stepped_aside = reason
        log.warning("OOM recovery is off for %s: %s", type(trainer).__name__, reason)
        _name_an_oom_without_recovery(trainer, reason)
        return recovery
    recovery.install()
    # the evaluation micro-batch is agreed by an all-reduce after each evaluation: every rank must evaluate, also when a
    # callback set should_evaluate on one rank alone (collectives/control_flags.py agrees the flags where one may)
    agree_on_control(trainer)
    train = trainer.train

    def train_and_unhook(*args, **kw):
        try:
            return train(*args, **kw)
        finally:
            recovery.train_ends()  # the gradient hooks come off the parameters even when training raises

    trainer.train = train_and_unhook
    return recovery
