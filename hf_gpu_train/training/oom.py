"""In-place OOM recovery for the Hugging Face Trainer: same step, same effective batch, every rank agrees.

``enable_oom_recovery(trainer)`` wraps the Trainer's ``training_step``, ``prediction_step`` and
``compute_loss`` on the instance (a Trainer callback has no exception hook). When a step runs out of memory:

1. only the error's text is kept; memory is freed *outside* the ``except`` block (the traceback holds
   tensors: pytorch #18853);
2. the micro-batch is halved and the step goes on with the *same* inputs, cut into micro-batches whose losses
   are scaled by their share of the batch (or left alone when the loss is normalised by
   ``num_items_in_batch``), so the gradient equals the whole batch's. An OOM in forward keeps what earlier
   micro-batches accumulated; an OOM part-way through backward has already added part of a gradient, so that
   micro-step is recomputed from its first sample (with gradient accumulation, earlier micro-steps of that
   optimizer step are lost, and a warning says so). ``global_step``, the LR schedule, the data order and the
   effective batch do not change;
3. with several processes, forward and backward run under DDP's ``no_sync`` and ``GradientReducer``
   (``grad_sync.py``) averages the gradients with DDP's overlap but a state we own: a rank that fails
   finishes the round with what it has, one small vote per optimizer step tells every rank, nobody applies a
   round that failed, and ranks that did not fail only reduce again. Every rank then runs the smallest
   micro-batch any rank needed. A rank that cannot fit one sample stops every rank with the remedies.

Compared with ``auto_find_batch_size`` (restarts the loop with a smaller batch, changes the effective batch,
no cross-rank agreement) and Composer's microbatching (in place, outside the HF stack).

Limits, said plainly: FSDP and DeepSpeed step aside with a warning (their collectives run inside forward and
backward). BatchNorm normalises each micro-batch with its own statistics, so a split step is close to, not
equal to, the whole batch (a warning says so once).
"""

from __future__ import annotations

import contextlib
import gc
import logging

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .grad_sync import BUCKET_BYTES, NO_LIMIT, GradientReducer, broadcast_buffers
from .loss_scaling import LossScalingGuard, guard_loss_scaling
from .microbatch import batch_size, describe_oom, is_oom_error, loss_items, slice_batch, split_batch
from .remedies import OutOfMemoryAtMicroBatchOne, remedies

log = logging.getLogger("hf_gpu_train.oom")
SUPPORTED_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU")
THRASH_STEPS = 3


class OOMRecoveryState(TrainerCallback, ExportableState):
    """The micro-batch sizes, saved in ``trainer_state.json`` with every checkpoint and restored on resume.
    Data only: with ``restore_callback_states_from_checkpoint=True`` the Trainer replaces this object by a
    new one built from the checkpoint, and the recovery finds the new one (``_RecoveryHooks``)."""

    def __init__(self):
        self.micro_batch: int | None = None
        self.eval_micro_batch: int | None = None
        self.recoveries = 0

    def state(self) -> dict:
        return {"args": {}, "attributes": {"micro_batch": self.micro_batch, "eval_micro_batch": self.eval_micro_batch,
                                           "recoveries": self.recoveries}}


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
    def __init__(self, trainer, guard: LossScalingGuard, grow_after_steps: int | None = None, bucket_bytes: int = BUCKET_BYTES):
        self.trainer = trainer
        self.bucket_bytes = bucket_bytes
        self.overlapped_buckets = 0  # gradient buckets reduced while backward still ran (DDP's overlap), over the runs
        self.guard = guard
        self.grow_after_steps = grow_after_steps
        self._training_step = trainer.training_step
        self._prediction_step = trainer.prediction_step
        self._compute_loss = trainer.compute_loss
        self.state = OOMRecoveryState()
        self.hooks = _RecoveryHooks(self)
        self.reducer: GradientReducer | None = None
        self.share = 1.0  # this micro-batch's share of the step's batch, while one runs
        self.fresh = True  # the next training_step starts an optimizer step
        self.clean_steps = 0
        self.events: list[dict] = []
        self._last_batch = 0
        self._warned: set[str] = set()
        self.seen_items = None
        self._earlier: list[tuple] = []  # this optimizer step's completed micro-steps (inputs, item count)
        self._fatal: str | None = None  # an OOM at micro-batch 1 in a micro-step without sync, raised at the step's vote

    # -- wiring --------------------------------------------------------------------------------
    def install(self) -> InPlaceOOMRecovery:
        t = self.trainer
        t.training_step = self.training_step
        t.prediction_step = self.prediction_step
        t.compute_loss = self.compute_loss
        t.add_callback(self.state)
        t.add_callback(self.hooks)
        return self

    @property
    def micro_batch(self) -> int | None:
        return self.state.micro_batch

    def train_begins(self, trainer_state) -> None:
        """Find the state object the Trainer holds now (it may have rebuilt it from a checkpoint) and, when the
        Trainer does not restore callback states itself, restore the micro-batches recorded in the checkpoint."""
        handler = self.trainer.callback_handler
        self.state = next((c for c in handler.callbacks if isinstance(c, OOMRecoveryState)), self.state)
        if not self.trainer.args.restore_callback_states_from_checkpoint:
            saved = (trainer_state.stateful_callbacks or {}).get(OOMRecoveryState.__name__)
            saved = saved[0] if isinstance(saved, list) and saved else saved
            for key, value in ((saved or {}).get("attributes") or {}).items():
                setattr(self.state, key, value)
        if self.state.micro_batch:
            log.info("OOM recovery: resuming with micro-batch %s recorded in the checkpoint", self.state.micro_batch)
        self.fresh = True

    def train_ends(self) -> None:
        """Take the gradient hooks off the parameters: a later Trainer on the same model must not carry them."""
        if self.reducer is not None:
            self.reducer.remove()
            self.overlapped_buckets += self.reducer.launched_in_backward
            self.reducer = None

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _distributed(self, model) -> bool:
        return self.trainer.accelerator.num_processes > 1

    def _supported(self, model, training: bool = True) -> bool:
        accelerator = self.trainer.accelerator
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
        if getattr(self.trainer, "is_fsdp_enabled", False):
            kind = "FSDP"
        elif getattr(self.trainer, "is_deepspeed_enabled", False):
            kind = "DEEPSPEED"
        if kind not in SUPPORTED_DISTRIBUTED:
            self._warn_once("unsupported", "OOM recovery is off under %s: its collectives run inside forward and backward "
                            "(single process and DDP are supported)", kind)
            return False
        if training and self._distributed(model) and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._warn_once("not-ddp", "OOM recovery is off: %d processes but the model is not wrapped in DDP (%s)",
                            accelerator.num_processes, type(model).__name__)
            return False
        return True

    def _reducer_for(self, model) -> GradientReducer:
        if self.reducer is None:
            accelerator = self.trainer.accelerator
            self.reducer = GradientReducer(model.parameters(), accelerator.num_processes, accelerator.device,
                                           bucket_bytes=self.bucket_bytes)
            if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
                log.warning("OOM recovery: this model has BatchNorm layers; after an OOM each micro-batch is normalised "
                            "with its own statistics, so a split step is close to, not equal to, the whole batch's")
        return self.reducer

    # -- training --------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen_items = num_items_in_batch  # what the Trainer counted (and gathered) for this call
        result = self._compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        # a loss normalised by the whole batch's item count adds up over micro-batches as it is
        scale = 1.0 if self._loss_already_scaled(num_items_in_batch) else self.share
        if scale == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * scale, outputs
        return result * scale

    def _loss_already_scaled(self, num_items_in_batch) -> bool:
        """The Trainer's own rule (``Trainer.training_step``): a loss normalised by the whole step's item count adds up
        over micro-batches as it is; a per-batch mean is weighed by each micro-batch's share."""
        t = self.trainer
        if getattr(t, "loss_is_scaled_for_ga", None) is not None:
            return bool(t.loss_is_scaled_for_ga)
        return bool((t.model_accepts_loss_kwargs and num_items_in_batch is not None) or t.compute_loss_func is not None)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._supported(model):
            return self._training_step(model, inputs, num_items_in_batch)
        size = batch_size(inputs)
        self._last_batch = size
        fresh, self.fresh = self.fresh, False
        if fresh:
            self._earlier, self._fatal = [], None
        reducer = self._reducer_for(model)
        distributed = self._distributed(model)
        syncs = distributed and model.require_backward_grad_sync  # the last micro-step of the optimizer step
        if distributed and fresh:
            broadcast_buffers(model)  # DDP's per-step buffer sync, kept out of the guarded forwards
        done, total = 0, None  # samples of this micro-step whose gradients are in .grad, and their loss
        replay: list[tuple] = []  # earlier micro-steps of this optimizer step to compute again
        while True:
            micro = min(self.state.micro_batch or size, size)
            failure, polluted = None, False
            if self._fatal is None and (replay or done < size):
                events, replaying = reducer.grad_events, bool(replay)
                try:
                    with model.no_sync() if distributed else contextlib.nullcontext():
                        while replay:  # the earlier micro-steps, whole, before this one goes on
                            self._accumulate(model, *replay[0], micro, distributed=distributed)
                            replay.pop(0)
                        replaying, events = False, reducer.grad_events
                        for start in range(done, size, micro):
                            stop = min(size, start + micro)
                            loss = self._chunk(model, slice_batch(inputs, start, stop), num_items_in_batch, (stop - start) / size,
                                               arm=syncs and stop == size, distributed=distributed)
                            total = loss if total is None else total + loss
                            done, events = stop, reducer.grad_events
                except Exception as error:  # only OOM is handled; everything else is re-raised untouched
                    if not is_oom_error(error):
                        raise
                    failure = describe_oom(error)
                    # backward had begun adding a micro-batch's gradient, or a replay was under way
                    polluted = replaying or reducer.grad_events != events
                finally:
                    self.share = 1.0
            fatal = failure is not None and micro <= 1
            if failure is not None:
                if polluted:
                    self._drop_gradients(model)
                    done, total, replay = 0, None, list(self._earlier)
                self._free_memory()
                if not fatal:
                    self._shrink(micro, size, failure, "train")
            if not syncs:
                if fatal and distributed:  # raise with every rank, at the step's vote, not alone in the middle of it
                    self._fatal = failure
                    model.zero_grad(set_to_none=True)
                if failure is None or self._fatal is not None:
                    if self._fatal is None:
                        self._earlier.append((inputs, num_items_in_batch))
                        return total
                    return torch.zeros((), device=self.trainer.accelerator.device)
                if fatal:
                    raise OutOfMemoryAtMicroBatchOne(remedies(self.trainer.args, model, inputs, failure))
                continue
            vote = reducer.finish(failed=failure is not None, fatal=fatal or self._fatal is not None, micro_batch=self.state.micro_batch)
            if vote.fatal:
                raise OutOfMemoryAtMicroBatchOne(remedies(self.trainer.args, model, inputs, failure or self._fatal))
            self._adopt(vote.micro_batch, size)
            if vote.failed:
                reducer.discard()
                continue
            if vote.stale:  # every rank saw it: reduce again from the complete gradients, without overlap from now on
                reducer.discard()
                reducer.overlap = False
                log.info("OOM recovery: a gradient was accumulated twice in one backward (reentrant checkpointing?): "
                         "gradients are averaged after backward from now on")
                vote = reducer.finish(micro_batch=self.state.micro_batch)
            reducer.apply(vote)
            return total

    def _chunk(self, model, chunk, num_items_in_batch, share: float, arm: bool, distributed: bool):
        """One micro-batch's forward and backward (its loss scaled by ``share`` where the loss is a mean)."""
        if arm:
            self.reducer.arm()
        self.share = share
        if distributed:
            model.require_forward_param_sync = False  # no DDP buffer broadcast inside a forward that may fail
        return self._training_step(model, chunk, num_items_in_batch)

    def _accumulate(self, model, inputs, num_items_in_batch, micro: int, distributed: bool) -> None:
        """An earlier micro-step computed again, whole, in micro-batches (its loss was already reported; a micro-step
        without sync, so no bucket is armed)."""
        size = batch_size(inputs)
        for begin in range(0, size, micro):
            stop = min(size, begin + micro)
            self._chunk(model, slice_batch(inputs, begin, stop), num_items_in_batch, (stop - begin) / size,
                        arm=False, distributed=distributed)

    def _adopt(self, agreed: int | None, size: int) -> None:
        """Every rank runs the smallest micro-batch any rank needed."""
        if agreed is None or agreed >= NO_LIMIT or (self.state.micro_batch is not None and self.state.micro_batch <= agreed):
            return
        current = self.state.micro_batch or size
        self.state.micro_batch = agreed
        self.clean_steps = 0
        self.events.append({"step": self.trainer.state.global_step, "phase": "train", "batch": size, "from": current,
                            "to": agreed, "cause": "out of memory on another rank"})
        log.warning("OOM recovery (step %d): another rank ran out of memory; every rank now runs micro-batches of %d",
                    self.trainer.state.global_step, agreed)

    def _drop_gradients(self, model) -> None:
        """Part of a micro-batch's gradient is in .grad: start the optimizer step's gradients again. The earlier
        micro-steps of this optimizer step are computed again from their inputs (the Trainer holds every micro-batch of
        the step already, so keeping them costs no memory)."""
        if self._earlier:
            log.info("OOM recovery: out of memory part-way through backward; the %d earlier micro-step(s) of this optimizer "
                     "step are computed again", len(self._earlier))
        model.zero_grad(set_to_none=True)

    @staticmethod
    def _free_memory() -> None:
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
        """An OOM in evaluation shrinks the evaluation micro-batch only (not the training one). The only
        collective inside a prediction step is the Trainer's gather of the item count (losses normalised by
        ``num_items_in_batch`` with ``average_tokens_across_devices``): micro-batches count locally, and one
        gather per step stands for the one the whole batch would have made, so a rank retries alone without
        desynchronising the others. The ranks agree on the evaluation micro-batch after each evaluation."""
        if not self._supported(model, training=False):
            return self._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        size = batch_size(inputs)
        global_items = None  # the item count of the whole batch over every rank, once this step has gathered it
        while True:
            micro = min(self.state.eval_micro_batch or size, size)
            failure = None
            self.seen_items = None
            try:
                if micro >= size:
                    return self._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
                return self._predict_in_chunks(model, inputs, micro, prediction_loss_only, ignore_keys, global_items)
            except Exception as error:
                if not is_oom_error(error):
                    raise
                failure = describe_oom(error)
                if micro >= size and self._gathers_item_counts(inputs) and self.seen_items is not None:
                    global_items = self.seen_items  # the failed whole-batch call had gathered it
            self._free_memory()
            if micro <= 1:
                raise OutOfMemoryAtMicroBatchOne(f"evaluation does not fit even one sample ({failure}): use bf16/fp16, a "
                                                 "shorter max_length or a smaller image_size")
            self._shrink(micro, size, failure, "eval")

    def _gathers_item_counts(self, inputs) -> bool:
        t = self.trainer
        counts = "labels" in inputs and (t.model_accepts_loss_kwargs or t.compute_loss_func is not None)
        return counts and t.args.average_tokens_across_devices and t.accelerator.num_processes > 1

    def _predict_in_chunks(self, model, inputs, micro, prediction_loss_only, ignore_keys, global_items):
        gathers = self._gathers_item_counts(inputs)
        args = self.trainer.args
        parts, items = [], []
        averaging = args.average_tokens_across_devices
        args.average_tokens_across_devices = False  # each micro-batch counts its own items, without a collective
        try:
            for chunk in split_batch(inputs, micro):
                self.seen_items = None
                parts.append(self._prediction_step(model, chunk, prediction_loss_only, ignore_keys=ignore_keys))
                items.append(float(self.seen_items) if self.seen_items is not None else float(loss_items(chunk)))
        finally:
            args.average_tokens_across_devices = averaging
        loss, logits, labels = _combine(parts, items)
        if gathers:
            if global_items is None:
                mine = torch.tensor(sum(items), device=self.trainer.accelerator.device)
                global_items = self.trainer.accelerator.gather(mine).sum()
            if loss is not None:  # the whole batch's loss is this rank's sum over every rank's item count, x world
                loss = loss * sum(items) * self.trainer.accelerator.num_processes / float(global_items)
        return loss, logits, labels

    def agree_on_eval_micro_batch(self) -> None:
        """After an evaluation every rank takes the smallest evaluation micro-batch any rank needed."""
        if self.trainer.accelerator.num_processes < 2 or not torch.distributed.is_initialized():
            return
        mine = torch.tensor([-(self.state.eval_micro_batch or NO_LIMIT)], dtype=torch.int64, device=self.trainer.accelerator.device)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
        smallest = -int(mine.item())
        self.state.eval_micro_batch = None if smallest >= NO_LIMIT else smallest


def _combine(parts, weights):
    """Join micro-batch ``prediction_step`` results: losses averaged by what each one averages over (samples,
    or labelled tokens), logits and labels concatenated."""
    losses = [p[0] for p in parts]
    loss = None
    if all(x is not None for x in losses):
        total = sum(weights) or 1
        loss = sum(x * (w / total) for x, w in zip(losses, weights))

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


def enable_oom_recovery(trainer, grow_after_steps: int | None = None, bucket_bytes: int = BUCKET_BYTES) -> InPlaceOOMRecovery:
    """One line for anyone's Trainer: ``enable_oom_recovery(trainer)`` before ``trainer.train()``. Installs the
    loss-scaling guard too (``loss_scaling.py``): micro-batch scaling needs to know a mean from a sum. ``bucket_bytes``:
    the size of the gradient buckets averaged under DDP (DDP's ``bucket_cap_mb``, 25 MiB)."""
    guard = guard_loss_scaling(trainer)
    recovery = InPlaceOOMRecovery(trainer, guard, grow_after_steps=grow_after_steps, bucket_bytes=bucket_bytes).install()
    train = trainer.train

    def train_and_unhook(*args, **kw):
        try:
            return train(*args, **kw)
        finally:
            recovery.train_ends()  # the gradient hooks come off the parameters even when training raises

    trainer.train = train_and_unhook
    return recovery
