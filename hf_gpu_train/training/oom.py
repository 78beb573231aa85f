"""In-place OOM recovery for the Hugging Face Trainer: same step, same effective batch, every rank agrees.

``enable_oom_recovery(trainer)`` wraps the Trainer's ``training_step`` and ``prediction_step`` on
the instance (a Trainer callback has no exception hook). When a step runs out of memory:

1. the error is caught and only its text kept; memory is freed *outside* the ``except`` block
   (the traceback holds tensors: pytorch #18853);
2. with several processes, one small all-reduce (MAX of an OOM flag) per step makes every rank
   agree, so a rank that failed alone (in forward or in backward) does not leave the others waiting
   in a collective. To make that safe, forward and backward run under DDP's ``no_sync`` and the
   gradients are all-reduced by us after the agreement (once per optimizer step);
3. this step's gradients are dropped, the micro-batch is halved, the *same* inputs are split and
   retried; each micro-batch's loss is scaled by its share of the batch (or, with transformers 5's
   ``num_items_in_batch`` normalisation, left as it is), so the gradient equals the full batch's.
   ``global_step``, the LR schedule, the data order and the effective batch do not change.

Compared with ``auto_find_batch_size`` (restarts the whole loop with a smaller batch, changes the
effective batch, no cross-rank agreement) and Composer (in place, outside the HF stack).

Limits, said plainly: with gradient accumulation > 1, an OOM in a later micro-step of an optimizer
step drops the earlier micro-steps of that one step (their inputs are gone; a warning says so).
FSDP and DeepSpeed are not supported (the recovery steps aside with a warning).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Sequence

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import UsageError
from .microbatch import batch_size, is_oom_error, split_batch

log = logging.getLogger("hf_gpu_train.oom")
SUPPORTED_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU")
THRASH_STEPS = 3


class OutOfMemoryAtMicroBatchOne(UsageError):
    """Even one sample does not fit: the message lists this run's remedies, most effective first."""


class OOMRecoveryState(TrainerCallback, ExportableState):
    """The micro-batch sizes, saved in ``trainer_state.json`` with every checkpoint and restored on resume."""

    def __init__(self):
        self.micro_batch: int | None = None
        self.eval_micro_batch: int | None = None
        self.recoveries = 0
        self.recovery: InPlaceOOMRecovery | None = None
        self._retries: list[float] = []
        self._warned_thrash = False

    def state(self) -> dict:
        return {"args": {}, "attributes": {"micro_batch": self.micro_batch, "eval_micro_batch": self.eval_micro_batch,
                                           "recoveries": self.recoveries}}

    def on_train_begin(self, args, state, control, **kwargs):
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if saved:
            for key, value in saved.get("attributes", {}).items():
                setattr(self, key, value)
            if self.micro_batch:
                log.info("OOM recovery: resuming with micro-batch %s recorded in the checkpoint", self.micro_batch)
        if self.recovery is not None:
            self.recovery.fresh = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.recovery is not None:
            self.recovery.optimizer_step_done()
        self._check_thrash()
        return control

    def _check_thrash(self) -> None:
        """Allocator retries climbing step after step: cudaMalloc failed, caches were flushed, and it
        worked on the second try. That is memory thrash, and usually the step before an OOM."""
        if not torch.cuda.is_available() or self._warned_thrash:
            return
        self._retries.append(float(torch.cuda.memory_stats().get("num_alloc_retries", 0)))
        self._retries = self._retries[-(THRASH_STEPS + 1):]
        rising = len(self._retries) > THRASH_STEPS and all(b > a for a, b in zip(self._retries, self._retries[1:]))
        if rising:
            self._warned_thrash = True
            log.warning("OOM recovery: CUDA allocator retries rose in each of the last %d steps (%d now): memory thrash, an "
                        "OOM is near. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or lower the micro-batch.",
                        THRASH_STEPS, int(self._retries[-1]))


class InPlaceOOMRecovery:
    def __init__(self, trainer, grow_after_steps: int | None = None):
        self.trainer = trainer
        self.grow_after_steps = grow_after_steps
        self._training_step = trainer.training_step
        self._prediction_step = trainer.prediction_step
        self._compute_loss = trainer.compute_loss
        self.loss_scale = 1.0
        self.fresh = True
        self.clean_steps = 0
        self.events: list[dict] = []
        self._sum_normalised_answer: bool | None = None
        self._last_batch = 0
        self.state = OOMRecoveryState()
        self.state.recovery = self

    # -- wiring --------------------------------------------------------------------------------
    def install(self) -> InPlaceOOMRecovery:
        t = self.trainer
        t.training_step = self.training_step
        t.prediction_step = self.prediction_step
        t.compute_loss = self.compute_loss
        t.add_callback(self.state)
        return self

    @property
    def micro_batch(self) -> int | None:
        return self.state.micro_batch

    def _supported(self) -> bool:
        kind = str(getattr(self.trainer.accelerator.distributed_type, "value", self.trainer.accelerator.distributed_type))
        if kind.upper() not in SUPPORTED_DISTRIBUTED:
            if not getattr(self, "_warned_unsupported", False):
                log.warning("OOM recovery is off under %s (only single process and DDP are supported)", kind)
                self._warned_unsupported = True
            return False
        return True

    # -- training --------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = self._compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.loss_scale == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * self.loss_scale, outputs
        return result * self.loss_scale

    def _sum_normalised(self, model, chunk, num_items_in_batch) -> bool:
        """Does this model's loss divide a sum by ``num_items_in_batch`` (transformers 5), so micro-batch
        losses already add up to the batch loss? Trainer flags (``model_accepts_loss_kwargs``) say a model
        *takes* the argument, not that its loss uses it, so ask the loss itself, once: with dropout off and
        no graph, the loss of one chunk for N and for 2N items halves exactly when it is sum-normalised."""
        if num_items_in_batch is None:
            return False
        if self._sum_normalised_answer is None:
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    one = float(self._compute_loss(model, chunk, num_items_in_batch=num_items_in_batch))
                    two = float(self._compute_loss(model, chunk, num_items_in_batch=num_items_in_batch * 2))
            finally:
                model.train(was_training)
            self._sum_normalised_answer = abs(one - 2 * two) <= 1e-4 * abs(one) + 1e-8 and abs(one - two) > 1e-4 * abs(one)
        return self._sum_normalised_answer

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._supported():
            return self._training_step(model, inputs, num_items_in_batch)
        size = batch_size(inputs)
        self._last_batch = size
        fresh, self.fresh = self.fresh, False
        accelerator = self.trainer.accelerator
        distributed = accelerator.num_processes > 1
        while True:
            micro = min(self.state.micro_batch or size, size)
            failure = None
            total = None
            if distributed:
                # DDP broadcasts buffers in a forward when the previous forward finished outside no_sync; a
                # forward that died of OOM on one rank leaves that flag different across ranks, and the next
                # forward would then broadcast on one rank only (a hang). Keep collectives out of the guarded
                # region: buffers are broadcast by us after the step (_sync_after_step).
                _set_ddp_flag(model, "require_forward_param_sync", False)
            try:
                with accelerator.no_sync(model) if distributed else contextlib.nullcontext():
                    chunks = split_batch(inputs, micro) if micro < size else [inputs]
                    sum_normalised = micro < size and self._sum_normalised(model, chunks[0], num_items_in_batch)
                    for chunk in chunks:
                        self.loss_scale = 1.0 if sum_normalised or micro >= size else batch_size(chunk) / size
                        loss = self._training_step(model, chunk, num_items_in_batch)
                        total = loss if total is None else total + loss
            except Exception as error:  # only OOM is handled; everything else is re-raised untouched
                if not is_oom_error(error):
                    raise
                failure = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            finally:
                self.loss_scale = 1.0
            if not self._agree(failure is not None, distributed):
                if distributed and accelerator.sync_gradients:
                    self._all_reduce_gradients(model)
                    self._broadcast_buffers(model)
                return total
            total = None
            self._free_memory(model, fresh)
            if micro <= 1:
                raise OutOfMemoryAtMicroBatchOne(self.remedies(model, inputs, failure))
            self._shrink(micro, size, failure, "train")

    def _agree(self, failed: bool, distributed: bool) -> bool:
        """One small all-reduce per step: did any rank run out of memory?"""
        if not distributed:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device=self.trainer.accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _all_reduce_gradients(self, model, bucket_bytes: int = 25 * 2**20) -> None:
        """What DDP would have done in backward: average the gradients over ranks, in flat buckets."""
        world = self.trainer.accelerator.num_processes
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        buckets: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        size = 0
        for g in grads:
            if current and (size + g.numel() * g.element_size() > bucket_bytes or g.dtype != current[0].dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(g)
            size += g.numel() * g.element_size()
        if current:
            buckets.append(current)
        for bucket in buckets:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            torch.distributed.all_reduce(flat)
            flat /= world
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def _broadcast_buffers(self, model) -> None:
        """DDP's buffer sync (rank 0's BatchNorm statistics to every rank), done once per optimizer step."""
        if not getattr(model, "broadcast_buffers", False):
            return
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)

    def _free_memory(self, model, fresh: bool) -> None:
        if not fresh:
            log.warning("OOM recovery: out of memory in a later gradient-accumulation micro-step; the earlier micro-steps "
                        "of this optimizer step are dropped (their inputs are gone), later steps keep the full batch")
        model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _shrink(self, micro: int, size: int, failure: str | None, phase: str) -> None:
        new = max(1, micro // 2)
        key = "micro_batch" if phase == "train" else "eval_micro_batch"
        setattr(self.state, key, new)
        self.state.recoveries += 1
        self.clean_steps = 0
        event = {"step": self.trainer.state.global_step, "phase": phase, "batch": size, "from": micro, "to": new,
                 "cause": failure or "out of memory on another rank"}
        self.events.append(event)
        log.warning("OOM recovery (%s, step %d): %s; retrying the same %d samples as micro-batches of %d",
                    phase, event["step"], event["cause"], size, new)

    def optimizer_step_done(self) -> None:
        self.fresh = True
        if self.state.micro_batch is None:
            return
        self.clean_steps += 1
        if self.grow_after_steps and self.clean_steps >= self.grow_after_steps:
            grown = self.state.micro_batch * 2  # try growing back; a new OOM halves it again
            self.state.micro_batch = None if grown >= self._last_batch else grown  # None: the whole batch at once
            self.clean_steps = 0
            log.info("OOM recovery: %d clean steps, trying micro-batch %s", self.grow_after_steps, self.state.micro_batch or "full")

    # -- evaluation ------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """An OOM in evaluation shrinks the evaluation micro-batch only (not the training one)."""
        size = batch_size(inputs)
        while True:
            micro = min(self.state.eval_micro_batch or size, size)
            failure = None
            try:
                if micro >= size:
                    return self._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
                parts = [self._prediction_step(model, chunk, prediction_loss_only, ignore_keys=ignore_keys)
                         for chunk in split_batch(inputs, micro)]
                return _combine(parts, [batch_size(c) for c in split_batch(inputs, micro)])
            except Exception as error:
                if not is_oom_error(error):
                    raise
                failure = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if micro <= 1:
                raise OutOfMemoryAtMicroBatchOne(f"evaluation does not fit even one sample ({failure}): lower "
                                                 "per_device_eval_batch_size is not enough; use bf16/fp16 or a shorter max_length")
            self._shrink(micro, size, failure, "eval")

    # -- the last word ------------------------------------------------------------------------------
    def remedies(self, model, inputs, failure: str | None) -> str:
        args = self.trainer.args
        steps = []
        if not (args.bf16 or args.fp16):
            steps.append("mixed precision: precision=bf16 (compute capability >= 8.0) or fp16")
        if not args.gradient_checkpointing:
            steps.append("gradient_checkpointing=true (recompute activations in backward)")
        steps.append("a shorter max_length (text) or a smaller image_size (vision)")
        if "adafactor" not in str(args.optim) and "8bit" not in str(args.optim):
            steps.append("a lighter optimizer: Adafactor (optim=adafactor) or 8-bit AdamW (optim=adamw_bnb_8bit)")
        steps.append("shard the model: `hf-gpu-train config --strategy fsdp` (or deepspeed-zero3) and launch with that config")
        estimate = self._planner_estimate(model, inputs)
        lines = [f"out of memory even at micro-batch 1 ({failure or 'on another rank'}). For this run, in order:"]
        lines += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
        if estimate:
            lines.append(f"Memory planner: {estimate}")
        return "\n".join(lines)

    def _planner_estimate(self, model, inputs) -> str | None:
        from ..launch.memory import TrainingShape, estimate
        from ..launch.model_spec import ModelSpec

        try:
            config = getattr(getattr(model, "module", model), "config", None)
            spec = ModelSpec(name="this model", params=sum(p.numel() for p in model.parameters()),
                             num_layers=getattr(config, "num_hidden_layers", None), hidden_size=getattr(config, "hidden_size", None),
                             num_heads=getattr(config, "num_attention_heads", None))
            seq = int(inputs["input_ids"].shape[1]) if "input_ids" in inputs else 512
            args = self.trainer.args
            precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
            breakdown = estimate(spec, TrainingShape(micro_batch=1, seq_len=seq, precision=precision), "single")
            total = f"{breakdown.total / 2**30:.1f} GiB per GPU at micro-batch 1"
            if torch.cuda.is_available():
                total += f" of {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB"
            return total + " (run `hf-gpu-train plan-memory --params N` for each strategy)"
        except Exception:  # an estimate is a bonus: never hide the real error behind it
            return None


def _set_ddp_flag(model, name: str, value) -> None:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        setattr(model, name, value)


def _combine(parts: Sequence[tuple], sizes: Sequence[int]):
    """Join micro-batch prediction_step results: losses weighted by size, logits/labels concatenated."""
    losses = [p[0] for p in parts]
    loss = None
    if all(x is not None for x in losses):
        total = sum(sizes)
        loss = sum(x * (n / total) for x, n in zip(losses, sizes))

    def cat(items):
        if all(i is None for i in items):
            return None
        first = items[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(items, dim=0)
        if isinstance(first, (tuple, list)):
            return type(first)(cat([i[k] for i in items]) for k in range(len(first)))
        return first

    return loss, cat([p[1] for p in parts]), cat([p[2] for p in parts])


def enable_oom_recovery(trainer, grow_after_steps: int | None = None) -> InPlaceOOMRecovery:
    """One line for anyone's Trainer: ``enable_oom_recovery(trainer)`` before ``trainer.train()``."""
    return InPlaceOOMRecovery(trainer, grow_after_steps=grow_after_steps).install()
