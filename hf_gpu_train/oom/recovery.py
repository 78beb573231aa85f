"""In-place OOM recovery for the Hugging Face Trainer: same step, same effective batch, every rank agrees.

``enable_oom_recovery(trainer)`` wraps the Trainer's ``training_step``, ``prediction_step`` and
``compute_loss`` on the instance (a Trainer callback has no exception hook). When a step runs out of memory:

1. only the error's text is kept; memory is freed *outside* the ``except`` block (the traceback holds
   tensors: pytorch #18853);
2. the micro-batch is halved and the step goes on with the *same* inputs, cut into micro-batches whose losses
   are weighed by their share of what the loss averages over (rows, labelled tokens, a causal LM's next tokens; 1 for
   a sum, or a loss normalised by ``num_items_in_batch``: ``loss_scaling.py`` asks the loss at the first step), so
   the gradient equals the whole batch's. An OOM in forward keeps what earlier
   micro-batches accumulated; an OOM part-way through backward has already added part of a gradient, so that
   micro-step is recomputed from its first sample (with gradient accumulation, the earlier micro-steps of that
   optimizer step are computed again from their inputs, their tokens not counted twice). ``global_step``, the LR schedule, the data order and the
   effective batch do not change;
3. with several processes, forward and backward run under DDP's ``no_sync`` and ``GradientReducer``
   (``grad_sync.py``) averages the gradients with DDP's overlap but a state we own. Every micro-step ends with a
   small ballot, and every collective that anyone's code issues inside a step (TRL's metric gathers, a subclass's
   ``all_reduce``) passes one first (``lockstep.py``). A rank that runs out of memory goes on alone in
   micro-batches; if the others are past every collective of the step they meet it at the ballot at the end and
   only reduce again; if they wait in a collective of the step, the ballot there tells every rank, and every rank
   computes the optimizer step again from its first micro-step in micro-batches of the same size (the Trainer's
   tallies, ``trainer_state.py``'s explicit list, put back as they were), so all ranks issue the same collectives.
   Every rank then runs the smallest micro-batch any rank needed. A rank that cannot fit one sample stops every rank with the remedies.
4. the batch divides into samples by its layout (``microbatch.layout_for``): rows, or chosen/rejected pairs for
   TRL's DPO (its loss pairs row i with row i + n).

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

import contextlib
import gc
import logging

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..errors import UsageError
from ..faults.collective_gate import agree_on_control
from ..faults.lone_rank import check_not_alone
from . import trainer_state as restorable
from .batch_terms import NotSpliceable, RouterBalanceSplit
from .evaluation_memory import guard_evaluation_memory
from .grad_sync import BUCKET_BYTES, GradientReducer, broadcast_buffers
from .lockstep import END, NO_LIMIT, Lockstep, RanksDiverged, RestartStep, install_gates, remove_gates
from .loss_scaling import (
    MEAN,
    PROBE_TRIES,
    UNDECIDED,
    LossScalingGuard,
    LossWeighting,
    Probe,
    agree_on_weighting,
    decomposes,
    guard_loss_scaling,
    probe_weighting,
)
from .microbatch import (
    CHUNKS,
    Pairs,
    describe_oom,
    is_oom_error,
    label_counts,
    layout_for,
    loss_items,
    replaying_micro_steps,
)
from .remedies import OutOfMemoryAtMicroBatchOne, remedies

log = logging.getLogger("hf_gpu_train.oom")
SUPPORTED_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU")
THRASH_STEPS = 3
GROW_AFTER_STEPS = 50  # clean optimizer steps at a smaller micro-batch before trying twice as many samples again
ON_INEXACT = ("recover", "stop")  # after an OOM, a loss that does not split exactly: recover approximately, or stop


class OOMRecoveryState(TrainerCallback, ExportableState):
    """The micro-batch sizes, saved in ``trainer_state.json`` with every checkpoint: what the run needed, for the record.
    A resumed run reads them, says them, and starts at the configured batch (it may run on another machine, with more
    memory; an OOM there recovers again, in place). Data only: with ``restore_callback_states_from_checkpoint=True`` the Trainer replaces this object by a
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
    def __init__(self, trainer, guard: LossScalingGuard, grow_after_steps: int | None = GROW_AFTER_STEPS, bucket_bytes: int = BUCKET_BYTES,
                 weighting: LossWeighting | None = None, on_inexact: str = "recover"):
        self.trainer = trainer
        self.on_inexact = on_inexact
        self.inexact: Probe | None = None  # the loss does not split exactly (found at the first steps), with the deviation
        self.weighting = weighting  # what a mean loss averages over: told, or asked of the loss at the first steps
        self._probes = 0  # optimizer steps whose batch was probed for the weighting
        self._provisional = LossWeighting("rows")  # until the weighting is known (_decide_weighting)
        self._per_sample: tuple = (None, None, None)  # (inputs, weighting, what each sample adds to the count)
        self.bucket_bytes = bucket_bytes
        self.overlapped_buckets = 0  # gradient buckets reduced while backward still ran (DDP's overlap), over the runs
        self.guard = guard
        self.grow_after_steps = grow_after_steps or None
        self._grow_wait = self.grow_after_steps  # doubles each time a grown micro-batch runs out of memory again
        self._grown = False  # the micro-batch grew and has not yet run a whole wait since
        self.layout = layout_for(trainer)  # rows, or chosen/rejected pairs (TRL's DPO)
        # a mixture-of-experts router's load-balancing loss, split from the whole batch's routing (batch_terms.py)
        self.batch_terms = None if isinstance(self.layout, Pairs) else RouterBalanceSplit.find(trainer.model)
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
        self._fatal: str | None = None  # an OOM at micro-batch 1 on several processes, raised at the micro-step's ballot
        self.lockstep: Lockstep | None = None  # the ballots that keep every rank in the same collectives (several processes)
        self.restarts = 0  # steps every rank computed again because one rank ran out of memory inside a collective's reach
        self._tallies: dict = {}  # the Trainer's tallies (trainer_state.py) at the start of the optimizer step
        self.stepped_aside: str | None = None  # why recovery is off for this Trainer, said before training
        self._chunk_tallies: dict = {}  # the same, at the start of the micro-batch that runs now

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
        recorded = {"training": self.state.micro_batch, "evaluation": self.state.eval_micro_batch}
        recorded = {phase: size for phase, size in recorded.items() if size}
        if recorded:
            log.warning("OOM recovery: the checkpoint recorded micro-batch %s after an out-of-memory error; this run "
                        "starts at the configured batch (a new OOM recovers again, in place)",
                        " and ".join(f"{size} in {phase}" for phase, size in recorded.items()))
            self.state.micro_batch = self.state.eval_micro_batch = None
        self.clean_steps, self._grow_wait, self._grown = 0, self.grow_after_steps, False
        self.fresh = True
        CHUNKS.reset()

    def train_ends(self) -> None:
        """Take the gradient hooks off the parameters: a later Trainer on the same model must not carry them."""
        CHUNKS.reset()  # a run that ended part-way through a recovery leaves no voided micro-batch behind
        if self.reducer is not None:
            self.reducer.remove()
            self.overlapped_buckets += self.reducer.launched_in_backward
            self.reducer = None
        if self.lockstep is not None:
            self.lockstep.close()
            self.lockstep = None
            remove_gates()

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
        scale = self._loss_scale()
        if scale == 1.0:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * scale, outputs
        return result * scale

    def _loss_scale(self) -> float:
        """What the running micro-batch's loss is multiplied by: 1 for a loss normalised by the whole batch's item count
        (it adds up over micro-batches as it is), else the micro-batch's share of what the mean averages over."""
        return 1.0 if self._loss_already_scaled(self.seen_items) else self.share

    def _loss_already_scaled(self, num_items_in_batch) -> bool:
        """The Trainer's own rule (``Trainer.training_step``): a loss normalised by the whole step's item count adds up
        over micro-batches as it is; a per-batch mean is weighed by each micro-batch's share."""
        t = self.trainer
        if getattr(t, "loss_is_scaled_for_ga", None) is not None:
            return bool(t.loss_is_scaled_for_ga)
        if self.guard.answer == MEAN:  # the loss guard found a per-batch mean (a compute_loss_func can return one too)
            return False
        return bool((t.model_accepts_loss_kwargs and num_items_in_batch is not None) or t.compute_loss_func is not None)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._supported(model):
            return self._training_step(model, inputs, num_items_in_batch)
        try:
            return self._step_in_place(model, inputs, num_items_in_batch)
        finally:
            if self.batch_terms is not None:  # a micro-step's recorded router logits go with it (a replay records again)
                self.batch_terms.forget(inputs)

    def _step_in_place(self, model, inputs, num_items_in_batch):
        """One micro-step of the Trainer's, whole or (after an OOM) in micro-batches, on every rank in step."""
        size = self.layout.size(inputs)
        self._last_batch = max(self._last_batch, size)  # the whole batch (an epoch's short last batch is not it)
        fresh, self.fresh = self.fresh, False
        CHUNKS.begin_micro_step()
        if fresh:
            self._earlier, self._fatal = [], None
            if self.weighting is None and self._probes < PROBE_TRIES:
                self._decide_weighting(model, inputs, num_items_in_batch)
            self._tallies = restorable.take(self.trainer)  # what a restarted step must not count twice
        reducer = self._reducer_for(model)
        distributed = self._distributed(model)
        lock = self._lockstep_for(reducer) if distributed else None
        syncs = distributed and model.require_backward_grad_sync  # the last micro-step of the optimizer step
        if distributed and fresh:
            broadcast_buffers(model)  # DDP's per-step buffer sync, kept out of the guarded forwards
        done, total = 0, None  # samples of this micro-step whose gradients are in .grad, and their loss
        replay: list[tuple] = []  # earlier micro-steps of this optimizer step to compute again
        round_failed = False  # this rank ran out of memory in this micro-step: its gradient buckets are unusable
        while True:
            micro = min(self.state.micro_batch or size, size)
            if lock:  # what this rank can run in training, told at every ballot of this step
                lock.micro_batch = self.state.micro_batch
            failure, polluted, restart = None, False, None
            if self._fatal is None and (replay or done < size):
                events, replaying = reducer.grad_events, bool(replay)
                try:
                    with model.no_sync() if distributed else contextlib.nullcontext(), \
                            lock.attempt() if lock else contextlib.nullcontext():
                        with replaying_micro_steps():
                            while replay:  # the earlier micro-steps, whole, before this one goes on
                                self._accumulate(model, *replay[0], micro, distributed=distributed)
                                replay.pop(0)
                        replaying, events = False, reducer.grad_events
                        if micro < size:
                            self._say_an_inexact_split()
                            self._record_whole_batch(model, inputs, micro)
                        for start, stop in self._ranges(inputs, done, micro):
                            loss = self._chunk(model, inputs, start, stop, num_items_in_batch, arm=syncs and stop == size,
                                               distributed=distributed)
                            total = loss if total is None else total + loss
                            done, events = stop, reducer.grad_events
                except RestartStep as stop_here:  # a ballot inside someone's collective: every rank starts again
                    restart = stop_here.outcome
                except _SplitNotExact as refused:  # on_inexact='stop': stopped with every rank, as an OOM at one sample
                    failure = str(refused)
                except Exception as error:  # only OOM is handled; everything else is re-raised untouched
                    if not is_oom_error(error):
                        raise
                    failure = describe_oom(error)
                    CHUNKS.void_current()  # this micro-batch runs again: its tokens count once
                    # backward had begun adding a micro-batch's gradient, or a replay was under way
                    polluted = replaying or reducer.grad_events != events
                finally:
                    self.share = 1.0
            if restart is not None:
                done, total, replay = self._restart(model, inputs, reducer, lock, restart, size, syncs)
                round_failed = False
                continue
            if failure is not None:
                self._free_memory()
                if micro <= 1 or self._refuses_to_split():
                    if not distributed:
                        raise self._fatal_error(model, inputs, failure)
                    self._fatal = failure  # raised with every rank, at this micro-step's ballot
                    model.zero_grad(set_to_none=True)
                else:
                    if polluted:  # the step again from its first micro-step: the Trainer's tallies as they were then
                        self._drop_gradients(model)
                        restorable.put_back(self.trainer, self._tallies)
                        CHUNKS.void_all()
                        done, total, replay = 0, None, list(self._earlier)
                    else:  # the failed micro-batch runs again: what it tallied before failing (in backward) is put back
                        restorable.put_back(self.trainer, self._chunk_tallies)
                    self._shrink(micro, size, failure, "train")
                    round_failed = True
                    if lock:  # the other ranks may be inside a collective of this step: they learn at the next ballot
                        lock.pending_failure = True
                    continue  # go on alone, in micro-batches, up to the next ballot
            if not distributed:
                self._earlier.append((inputs, num_items_in_batch))
                return total
            lock.pending_failure = False
            if syncs:
                outcome = reducer.finish(lock, failed=round_failed, fatal=self._fatal is not None)
            else:
                outcome = lock.ballot(END, fatal=self._fatal is not None)
            if outcome.fatal:
                raise self._fatal_error(model, inputs, self._fatal)
            if outcome.restart:  # a rank is still inside this micro-step, at a collective: every rank starts again
                done, total, replay = self._restart(model, inputs, reducer, lock, outcome, size, syncs)
                round_failed = False
                continue
            if outcome.diverged:
                raise RanksDiverged("the ranks reached the end of a micro-step at different points of their code")
            self._adopt(outcome.micro_batch, size)
            if not syncs:
                self._earlier.append((inputs, num_items_in_batch))
                return total
            if outcome.failed:  # a rank recovered alone: its buckets carried a partial gradient; reduce again
                reducer.discard()
                round_failed = False
                continue
            if outcome.stale:  # every rank saw it: reduce again from the complete gradients, without overlap from now on
                reducer.discard()
                reducer.overlap = False
                log.info("OOM recovery: a gradient was accumulated twice in one backward (reentrant checkpointing?): "
                         "gradients are averaged after backward from now on")
                outcome = reducer.finish(lock)
            reducer.apply(outcome)
            return total

    def _restart(self, model, inputs, reducer, lock, outcome, size: int, syncs: bool):
        """Every rank, on the same ballot: end the gradient round, take the smallest micro-batch, and compute this
        optimizer step again from its first micro-step (the Trainer's tallies put back as they were at its start)."""
        if syncs:
            reducer.complete_round()
        if outcome.fatal:
            raise self._fatal_error(model, inputs, self._fatal)
        lock.pending_failure = False
        self._adopt(outcome.micro_batch, size)  # the loop tells the next ballots from the state
        model.zero_grad(set_to_none=True)
        restorable.put_back(self.trainer, self._tallies)
        CHUNKS.void_all()
        self.restarts += 1
        if self._earlier:
            log.info("OOM recovery: every rank computes this optimizer step again (%d earlier micro-step(s) first), in "
                     "micro-batches of %s", len(self._earlier), self.state.micro_batch)
        return 0, None, list(self._earlier)

    def _lockstep_for(self, reducer) -> Lockstep:
        if self.lockstep is None:
            install_gates()
            self.lockstep = Lockstep(num_params=len(reducer.params))
        return self.lockstep

    def _chunk(self, model, inputs, start: int, stop: int, num_items_in_batch, arm: bool, distributed: bool):
        """Samples ``start:stop`` of ``inputs``, forward and backward: the loss scaled by their share where it is a mean,
        a batch-level term split from the whole batch's (``batch_terms.py``)."""
        if arm:
            self.reducer.arm()
        CHUNKS.begin_chunk()
        self._chunk_tallies = restorable.take(self.trainer)  # put back if this micro-batch fails (it runs again)
        self.share = self._share(inputs, start, stop)
        if distributed:
            model.require_forward_param_sync = False  # no DDP buffer broadcast inside a forward that may fail
        with self._splicing(inputs, start, stop, self._loss_scale):
            loss = self._training_step(model, self.layout.slice(inputs, start, stop), num_items_in_batch)
        broken = self.batch_terms.broken if self.batch_terms is not None else None
        if broken:  # this micro-batch computed its own router term (said): the step goes on approximately
            unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            self._split_broke(type(unwrapped).__name__, broken)
        return loss

    def _accumulate(self, model, inputs, num_items_in_batch, micro: int, distributed: bool) -> None:
        """An earlier micro-step computed again, whole, in micro-batches (its loss was already reported; a micro-step
        without sync, so no bucket is armed)."""
        if micro < self.layout.size(inputs):
            self._record_whole_batch(model, inputs, micro)
        for begin, stop in self._ranges(inputs, 0, micro):
            self._chunk(model, inputs, begin, stop, num_items_in_batch, arm=False, distributed=distributed)

    # -- a loss term over the whole batch ------------------------------------------------------------------------------
    def _record_whole_batch(self, model, inputs, micro: int, training: bool = True) -> None:
        """Before a split micro-step: the whole batch's arguments of a batch-level term (a router's load-balancing
        loss), from a forward without gradients in micro-batches of ``micro``. An OOM in it is an OOM of the step."""
        split = self.batch_terms
        if split is None or split.recorded(inputs):
            return
        unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        try:
            with replaying_micro_steps():  # not a training forward: its tokens are not counted
                split.record(unwrapped, self.layout.split(inputs, micro), self.trainer._prepare_inputs, key=inputs)
        except NotSpliceable as error:
            self._split_broke(type(unwrapped).__name__, str(error), training)

    def _split_broke(self, model_name: str, why: str, training: bool = True) -> None:
        """The router split cannot be made for this model (its recording or a micro-batch's arguments did not fit the
        whole batch's): from here the split is approximate, said once, and ``on_inexact='stop'`` stops at this OOM."""
        self.batch_terms = None
        self.inexact = Probe("unknown", None)
        log.warning("OOM recovery: the router's load-balancing loss of %s cannot be split from the whole batch (%s): "
                    "each micro-batch computes it from its own rows, an approximation", model_name, why)
        if self.on_inexact == "stop" and training:  # (an evaluation's loss is said, not stopped for)
            raise _SplitNotExact(f"the router's load-balancing loss of {model_name} cannot be split exactly ({why})")

    def _splicing(self, inputs, start: int, stop: int, scale_of):
        split = self.batch_terms
        if split is None or stop - start >= self.layout.size(inputs):
            return contextlib.nullcontext()
        return split.splicing(inputs, start, stop, self.layout.size(inputs), scale_of)

    def _pair_splice(self, model):
        """For the first step's probes: sample ``index`` of a pair alone carries its part of the pair's batch-level term
        (``mean``: the probe weighs the samples' losses itself, so each keeps the whole term's value)."""
        split = self.batch_terms
        if split is None:
            return None

        def splice(pair, index: int, mean: bool):
            if not split.recorded(pair):
                split.record(model, [self.layout.take(pair, [0]), self.layout.take(pair, [1])], lambda x: x, key=pair)
            return split.splicing(pair, index, index + 1, 2, (lambda: 0.5) if mean else (lambda: 1.0))

        return splice

    def _refuses_to_split(self) -> bool:
        """The loss was found not to split exactly and the user asked to stop rather than recover approximately."""
        return self.inexact is not None and self.on_inexact == "stop"

    def _say_an_inexact_split(self) -> None:
        if self.inexact is not None:
            self._warn_once("inexact-split", "OOM recovery: this split step is approximate: %s's loss does not split into "
                            "micro-batches exactly (%s); enable_oom_recovery(trainer, on_inexact='stop') stops at the OOM "
                            "instead", type(self.trainer).__name__, self._deviation_words())

    def _fatal_error(self, model, inputs, failure: str | None) -> Exception:
        """What ends the run when a step cannot be recovered: one sample does not fit, or (``on_inexact='stop'``) the
        split would be approximate. On several processes every rank raises it at the same ballot."""
        if not self._refuses_to_split():
            return OutOfMemoryAtMicroBatchOne(remedies(self.trainer.args, model, inputs, failure or
                                                       "out of memory at micro-batch 1 on another rank"))
        return InexactSplitRefused(
            f"out of memory at optimizer step {self.trainer.state.global_step} ({failure or 'on another rank'}), and "
            f"{type(self.trainer).__name__}'s loss does not split into micro-batches exactly ({self._deviation_words()}): "
            "on_inexact='stop' stops here rather than train other weights. Lower per_device_train_batch_size and raise "
            "gradient_accumulation_steps by the same factor (the Trainer then computes the batch-level term per "
            "micro-batch, alike in every run; `hf-gpu-train plan-memory` sizes it), or pass on_inexact='recover' to "
            "recover approximately; then resume from the last complete checkpoint")

    def _deviation_words(self) -> str:
        if self.inexact is None or self.inexact.deviation is None:
            return "its batch-level term could not be split from the whole batch, or another rank's samples did not add up"
        return (f"two samples' loss together differs from the combination of each alone by "
                f"{self.inexact.deviation:.2g} of the loss")

    # -- what a micro-batch's loss weighs ----------------------------------------------------------
    def _decide_weighting(self, model, inputs, num_items_in_batch) -> None:
        """At the first optimizer steps, on every rank at once (the probe runs the Trainer's compute_loss, whose
        collectives must pair up): ask the loss what it averages over, and whether it splits at all, before any weight
        changes. A loss normalised by ``num_items_in_batch`` is weighed 1 in every micro-batch, which is exact only if it
        is a sum over items: checked on two samples too (``loss_scaling.decomposes``). A batch of one sample is never
        split: nothing to ask (nor to say) while the configured batch is one sample.

        Every rank makes the same calls of ``compute_loss`` (someone's may gather across ranks): what a rank found is
        agreed before any call that depends on it (a second question with labels that differ, a probe without the
        router split)."""
        t = self.trainer
        if t.args.per_device_train_batch_size < 2 or (t.accelerator.num_processes < 2 and self.layout.size(inputs) < 2):
            return
        prepared = t._prepare_inputs(inputs)  # what compute_loss sees (on the device)
        alone = t.accelerator.num_processes < 2  # a probe that fails on one rank of several would leave it out of step
        if self.guard.answer is None and num_items_in_batch is not None:
            # the loss guard's question first (on two samples: cheap, and it fits where the step does)
            few = self.layout.take(prepared, [0, 1]) if self.layout.size(prepared) > 2 else prepared
            try:
                self.guard.decide(model, few, num_items_in_batch)
            except Exception as error:  # one process: it asks again at the step's first compute_loss
                if not (alone and is_oom_error(error)):
                    raise
                self._free_memory()
        normalised = self.guard.answer is not None and self._loss_already_scaled(num_items_in_batch)
        self._probes += 1
        probed = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        found, kind = self._probe(probed, prepared, num_items_in_batch, normalised, alone)
        if kind == "unknown" and self.batch_terms is not None:  # the router term spliced, and still no match (agreed)
            self.batch_terms = None
            log.warning("OOM recovery: splitting %s's router load-balancing loss from the whole batch's routing did not "
                        "give the loss of two samples together (off by %.2g of it): not used", type(probed).__name__,
                        found.deviation or 0.0)
            found, kind = self._probe(probed, prepared, num_items_in_batch, normalised, alone)
        name = type(t).__name__
        if normalised:
            self.weighting = LossWeighting("normalised")
            if kind is UNDECIDED and self._probes < PROBE_TRIES:
                self.weighting = None  # weighed 1 meanwhile (_loss_already_scaled); the next step's batch may tell
                return
            if kind == "unknown":
                self.inexact = Probe("unknown", found.deviation)
                log.warning("OOM recovery: %s's loss does not add up over micro-batches: it is normalised by "
                            "num_items_in_batch, but %s. A term computed over the whole batch (a z-loss, a regulariser or "
                            "contrastive loss of the batch, a router's load-balancing loss of an unknown form) is counted "
                            "once per micro-batch by a split step, and by gradient accumulation alike. After an OOM: "
                            "recovered approximately (the default, on_inexact='recover'), or enable_oom_recovery(trainer, "
                            "on_inexact='stop') stops there with the fix", name, self._deviation_words())
            elif self.batch_terms is not None and kind == "normalised":
                log.info("OOM recovery: %s's router load-balancing loss splits exactly: a split step computes each "
                         "micro-batch's term from the whole batch's routing (checked on two samples)", type(probed).__name__)
            return
        # until it is known, the labels' shape weighs an OOM of these steps: labelled tokens for token labels (exact too
        # when the batch cannot tell because every sample has as many), rows otherwise
        fallback = "tokens" if label_counts(prepared) is not None else "rows"
        if kind is UNDECIDED and self._probes < PROBE_TRIES:
            self._provisional = LossWeighting(fallback)
            return  # the next step's batch may tell
        if kind == "unknown":
            self.inexact = Probe("unknown", found.deviation)
            log.warning("OOM recovery: cannot tell what %s.compute_loss averages over: on two samples of different label "
                        "counts its loss matched neither a mean over rows, nor a mean over labelled tokens, nor a sum "
                        "(%s; a term over the whole batch does that too). After an OOM micro-batches would be weighed by "
                        "their share of rows, exact only for a mean over rows. Tell it: enable_oom_recovery(trainer, "
                        "loss_weighting='rows' | 'tokens' | 'next-tokens' | 'sum', or a function of a micro-batch's inputs "
                        "returning how many items its loss averages over), or stop at an OOM instead: on_inexact='stop'",
                        name, self._deviation_words())
        elif kind is UNDECIDED:
            kind = fallback
            log.warning("OOM recovery: the first %d batches could not tell what %s.compute_loss averages over (their "
                        "samples' losses were too close, or had the same label counts, also with labels rewritten to "
                        "differ); micro-batches are weighed by %s. If that is wrong, say it: enable_oom_recovery(trainer, "
                        "loss_weighting=...)", PROBE_TRIES, name, LossWeighting(kind).describe())
        self.weighting = LossWeighting(kind)

    def _probe(self, probed, prepared, num_items_in_batch, normalised: bool, alone: bool) -> tuple[Probe, str | None]:
        """(what this rank's two samples said, what every rank agreed): two samples of this batch, alone and together,
        through the Trainer's compute_loss: what the loss averages over (a mean), or whether it adds up (a loss
        normalised by ``num_items_in_batch``); a mean that no pair could tell is asked again with labels that differ,
        on every rank when every rank could not tell. Its tallies are put back."""
        t = self.trainer
        tolerance = _probe_tolerance(t, probed)
        tallies = restorable.take(t)  # TRL files metrics at every compute_loss call: the probe's are not the run's
        try:
            if normalised:
                found = self._asking(lambda splice: decomposes(self._compute_loss, probed, prepared, self.layout,
                                                               num_items_in_batch, tolerance, splice), probed, alone)
                return found, agree_on_weighting(found.kind, t.accelerator)
            found = self._asking(lambda splice: probe_weighting(self._compute_loss, probed, prepared, self.layout, tolerance,
                                                                splice), probed, alone)
            kind = agree_on_weighting(found.kind, t.accelerator)
            if kind is UNDECIDED:  # no rank could tell: every rank asks again, with labels that differ
                found = self._asking(lambda splice: probe_weighting(self._compute_loss, probed, prepared, self.layout,
                                                                    tolerance, splice, relabelled=True), probed, alone)
                kind = agree_on_weighting(found.kind, t.accelerator)
            return found, kind
        finally:
            restorable.put_back(t, tallies)
            if self.batch_terms is not None:
                self.batch_terms.forget()

    def _asking(self, ask, probed, alone: bool) -> Probe:
        """``ask(splice)`` with the router split when there is one (without, where it cannot be recorded for this model:
        the same on every rank), and an OOM of one process's probe an answer for the next step."""
        try:
            try:
                return ask(self._pair_splice(probed))
            except NotSpliceable as error:
                self.batch_terms = None
                log.warning("OOM recovery: the router's load-balancing loss of %s cannot be split from the whole batch "
                            "(%s): each micro-batch computes it from its own rows, an approximation", type(probed).__name__,
                            error)
                return ask(None)
        except Exception as error:  # one process: two samples without gradients did not fit; the next step asks again
            if not (alone and is_oom_error(error)):
                raise
            self._free_memory()
            return Probe(UNDECIDED)

    def _weighing(self) -> LossWeighting:
        """The weighting in force: known, or until then the labels' shape's (``_decide_weighting``)."""
        return self.weighting or self._provisional

    def _counts(self, inputs) -> list[float]:
        """What each sample of this micro-step adds to the count its loss averages over (kept for the micro-step)."""
        if self._per_sample[0] is not inputs or self._per_sample[1] is not self._weighing():
            weighing = self._weighing()
            self._per_sample = (inputs, weighing, weighing.per_sample(inputs, self.layout))
        return self._per_sample[2]

    def _share(self, inputs, start: int, stop: int) -> float:
        """Samples ``start:stop``'s weight in the micro-step's loss: their share of what the loss averages over."""
        return self._weighing().share(self._counts(inputs), start, stop)

    def _ranges(self, inputs, start: int, micro: int) -> list[tuple[int, int]]:
        """Micro-batches of at most ``micro`` samples from ``start``; under a mean over labelled tokens a micro-batch
        without a labelled token (its own mean is 0/0) is joined to its neighbour."""
        size = self.layout.size(inputs)
        ranges = [(begin, min(size, begin + micro)) for begin in range(start, size, micro)]
        if self._weighing().kind in ("normalised", "sum", "rows", "unknown"):
            return ranges
        counts = self._counts(inputs)
        joined: list[tuple[int, int]] = []
        for begin, stop in ranges:
            if joined and (sum(counts[begin:stop]) == 0 or sum(counts[joined[-1][0]:joined[-1][1]]) == 0):
                joined[-1] = (joined[-1][0], stop)
            else:
                joined.append((begin, stop))
        return joined

    def _adopt(self, agreed: int | None, size: int) -> None:
        """Every rank runs the smallest micro-batch any rank needed."""
        if agreed is None or agreed >= NO_LIMIT or (self.state.micro_batch is not None and self.state.micro_batch <= agreed):
            return
        current = self.state.micro_batch or size
        self.state.micro_batch = agreed
        self._lowered()
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
        if phase == "train":  # an evaluation OOM must not move when this rank grows the training micro-batch back
            self._lowered()
        event = {"step": self.trainer.state.global_step, "phase": phase, "batch": size, "from": micro, "to": new,
                 "cause": failure or "out of memory on another rank"}
        self.events.append(event)
        log.warning("OOM recovery (%s, step %d): %s; retrying the same %d samples as micro-batches of %d",
                    phase, event["step"], event["cause"], size, new)

    def _lowered(self) -> None:
        """The training micro-batch went down: count clean steps from here; a grown micro-batch that failed before a
        whole wait passed makes the next wait twice as long (growing costs at most a recomputed step, and less and
        less often)."""
        self.clean_steps = 0
        if self._grown and self._grow_wait:
            self._grow_wait *= 2
        self._grown = False

    def optimizer_step_done(self) -> None:
        """After each optimizer step: grow the micro-batch back after ``_grow_wait`` clean steps. Every rank counts the
        same steps (each shrinks or adopts the smallest micro-batch at the same ballot), so they grow at the same step."""
        self.fresh = True
        if self.state.micro_batch is None:
            return
        self.clean_steps += 1
        if self._grow_wait and self.clean_steps >= self._grow_wait:
            if self._grown:  # the grown micro-batch ran a whole wait: the next growth waits the configured time again
                self._grow_wait = self.grow_after_steps
            grown = self.state.micro_batch * 2  # a new OOM halves it again, in place
            self.state.micro_batch = None if grown >= self._last_batch else grown  # None: the whole batch at once
            self.clean_steps, self._grown = 0, True
            log.warning("OOM recovery: %d clean steps, trying micro-batch %s", self._grow_wait,
                        self.state.micro_batch or f"{self._last_batch} (the whole batch)")

    # -- evaluation ------------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """An OOM in evaluation shrinks the evaluation micro-batch only (not the training one). On several processes
        every prediction step ends with a ballot (``lockstep.py``), and collectives issued inside it (TRL's metric
        gathers, the Trainer's gather of the item count) pass one first: a rank that ran out of memory goes on alone
        in micro-batches when the others are past every collective of the step, and every rank computes the step
        again in micro-batches when the others wait in one. Micro-batches count items locally, and one gather per
        step stands for the one the whole batch would have made. Every rank leaves each step with the smallest
        evaluation micro-batch any rank needed."""
        if not self._supported(model, training=False):
            return self._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        size = self.layout.size(inputs)
        lock = self._lockstep_for(self._reducer_for(model)) if self._distributed(model) else None
        tallies = restorable.take(self.trainer) if lock else {}
        global_items = None  # the item count of the whole batch over every rank, once this step has gathered it
        fatal = None
        while True:
            micro = min(self.state.eval_micro_batch or size, size)
            if lock:  # in evaluation the ballots carry the evaluation micro-batch
                lock.micro_batch = self.state.eval_micro_batch
            failure, result, restart = None, None, None
            self.seen_items = None
            try:
                with lock.attempt() if lock else contextlib.nullcontext():
                    if fatal is not None:
                        pass
                    elif micro >= size:
                        result = self._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
                    else:
                        result = self._predict_in_chunks(model, inputs, micro, prediction_loss_only, ignore_keys, global_items)
            except RestartStep as stop_here:
                restart = stop_here.outcome
            except Exception as error:
                if not is_oom_error(error):
                    raise
                failure = describe_oom(error)
                if micro >= size and self._gathers_item_counts(inputs) and self.seen_items is not None:
                    global_items = self.seen_items  # the failed whole-batch call had gathered it
            if failure is not None:
                self._free_memory()
                if micro <= 1:
                    fatal = failure
                    if lock is None:
                        break
                else:
                    self._shrink(micro, size, failure, "eval")
                    if lock:
                        lock.pending_failure = True
                    continue
            if lock is None:
                return result
            if restart is None:
                lock.pending_failure = False
                restart = lock.ballot(END, fatal=fatal is not None)
                if not (restart.restart or restart.fatal):
                    if restart.diverged:
                        raise RanksDiverged("the ranks reached the end of an evaluation step at different points of their code")
                    self._adopt_eval(restart.micro_batch)
                    return result
            if restart.fatal:
                fatal = fatal or "out of memory at micro-batch 1 on another rank"
                break
            lock.pending_failure = False
            self._adopt_eval(restart.micro_batch)
            restorable.put_back(self.trainer, tallies)
            global_items = None  # every rank computes the step again, and gathers the item count again
        raise OutOfMemoryAtMicroBatchOne(f"evaluation does not fit even one sample ({fatal}): use bf16/fp16, a "
                                         "shorter max_length or a smaller image_size")

    def _adopt_eval(self, agreed: int | None) -> None:
        if agreed is not None and agreed < NO_LIMIT and (self.state.eval_micro_batch is None or agreed < self.state.eval_micro_batch):
            log.warning("OOM recovery (eval, step %d): another rank ran out of memory; every rank now evaluates in "
                        "micro-batches of %d", self.trainer.state.global_step, agreed)
            self.state.eval_micro_batch = agreed

    def _gathers_item_counts(self, inputs) -> bool:
        t = self.trainer
        counts = "labels" in inputs and (t.model_accepts_loss_kwargs or t.compute_loss_func is not None)
        return counts and t.args.average_tokens_across_devices and t.accelerator.num_processes > 1

    def _predict_in_chunks(self, model, inputs, micro, prediction_loss_only, ignore_keys, global_items):
        gathers = self._gathers_item_counts(inputs)
        args = self.trainer.args
        parts, items, counted = [], [], False
        shifted = _predicts_next_token(model)
        # what the training loss was found to average over; before the first training step, the labels' shape tells
        known = self.weighting if self.weighting is not None and self.weighting.kind not in ("normalised", "unknown") else None
        averaging = args.average_tokens_across_devices
        args.average_tokens_across_devices = False  # each micro-batch counts its own items, without a collective
        size = self.layout.size(inputs)
        summed = known is not None and known.kind == "sum"
        try:
            self._record_whole_batch(model, inputs, micro, training=False)  # a router's term from the whole batch
            for start in range(0, size, micro):
                stop = min(size, start + micro)
                chunk = self.layout.slice(inputs, start, stop)
                self.seen_items = None
                # each micro-batch's loss then carries the whole batch's term: weighed by shares that add up to 1 (or
                # its rows' share of it, for a sum)
                share = (stop - start) / size
                with self._splicing(inputs, start, stop, (lambda: 1.0) if summed else (lambda s=share: s)):
                    parts.append(self._prediction_step(model, chunk, prediction_loss_only, ignore_keys=ignore_keys))
                if self.batch_terms is not None and self.batch_terms.broken:
                    self._split_broke(type(model).__name__, self.batch_terms.broken, training=False)
                counted = counted or self.seen_items is not None
                if self.seen_items is not None:
                    items.append(float(self.seen_items))
                elif known is not None:
                    items.append(float(sum(known.per_sample(chunk, self.layout))))
                else:
                    items.append(float(loss_items(chunk, shifted)))
                    self._warn_once("eval-before-weighting", "OOM recovery: an evaluation is split before the first "
                                    "training step has asked the loss what it averages over: its micro-batches are "
                                    "weighed by the labels' shape (%s); a loss that averages otherwise (CTC's per-row "
                                    "mean, a sum) gets an approximate evaluation loss. Tell it: enable_oom_recovery("
                                    "trainer, loss_weighting=...)", "labelled tokens" if label_counts(chunk) else "rows")
            # a router's term of the whole batch, counted once by the whole batch's loss (not rescaled below)
            router_term = self.batch_terms.term_value(inputs) if self.batch_terms is not None else None
        finally:
            args.average_tokens_across_devices = averaging
            if self.batch_terms is not None:
                self.batch_terms.forget(inputs)
        # a preference batch's rows are every chosen row, then every rejected one: so are the joined micro-batches'
        pairs = [self.layout.size(chunk) for chunk in self.layout.split(inputs, micro)] if isinstance(self.layout, Pairs) else None
        loss, logits, labels = _combine(parts, items, summed=summed and not counted, pairs=pairs)
        # only a loss normalised by the item count it was given is rescaled (TRL's prediction steps give none: their
        # loss is this rank's own mean, and stays one)
        if gathers and counted:
            if global_items is None:
                mine = torch.tensor(sum(items), device=self.trainer.accelerator.device)
                global_items = self.trainer.accelerator.gather(mine).sum()
            if loss is not None:  # the whole batch's loss is this rank's sum over every rank's item count, x world
                world, share = self.trainer.accelerator.num_processes, sum(items) / float(global_items)
                loss = loss * share * world
                if router_term is not None:  # the item-normalised part is rescaled, the router's term is this rank's own
                    loss = loss + router_term * world * (1 - share)
        return loss, logits, labels

    def agree_on_eval_micro_batch(self) -> None:
        """After an evaluation every rank takes the smallest evaluation micro-batch any rank needed."""
        if self.trainer.accelerator.num_processes < 2 or not torch.distributed.is_initialized():
            return
        mine = torch.tensor([-(self.state.eval_micro_batch or NO_LIMIT)], dtype=torch.int64, device=self.trainer.accelerator.device)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
        smallest = -int(mine.item())
        if smallest < NO_LIMIT and smallest != self.state.eval_micro_batch:
            log.warning("OOM recovery: another rank ran out of memory in evaluation; every rank now evaluates in "
                        "micro-batches of %d", smallest)
        self.state.eval_micro_batch = None if smallest >= NO_LIMIT else smallest


def _probe_tolerance(trainer, model) -> float:
    """How closely the pair's loss must match a candidate: fp32 arithmetic leaves ~1e-6 (1e-4 is the band); 16-bit
    parameters or autocast, and TF32 matmuls on a GPU (~1e-3), leave more (2e-2)."""
    args = trainer.args
    tf32 = torch.cuda.is_available() and (torch.backends.cuda.matmul.allow_tf32 or bool(getattr(args, "tf32", False))
                                          or torch.get_float32_matmul_precision() != "highest")
    loose = args.bf16 or args.fp16 or tf32 or any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad)
    return 2e-2 if loose else 1e-4


def _predicts_next_token(model) -> bool:
    """A causal LM's loss reads labels shifted by one: its items are the labelled positions after the first."""
    inner = getattr(model, "module", model)
    get_base = getattr(inner, "get_base_model", None)
    inner = get_base() if callable(get_base) else inner
    return type(inner).__name__.endswith("ForCausalLM")


def _combine(parts, weights, summed: bool = False, pairs: list[int] | None = None):
    """Join micro-batch ``prediction_step`` results as the Trainer's evaluation loop joins batches: losses averaged by
    what each one averages over (samples, or labelled tokens; added up for a loss that is a sum), logits, labels and
    generated tokens concatenated, each padded to the longest along its second dimension with -100
    (``nested_concat``): with ``predict_with_generate`` every micro-batch generates up to its own longest row. ``pairs``
    (a preference batch: each part's rows are its chosen rows, then its rejected ones) joins every part's first half,
    then every second half, as the whole batch holds them."""
    from transformers.trainer_pt_utils import nested_concat

    losses = [p[0] for p in parts]
    loss = None
    if all(x is not None for x in losses):
        total = 1 if summed else (sum(weights) or 1)
        # a micro-batch without a labelled token has a loss of 0/0 and no weight in the whole batch's mean
        kept = [(x, w) for x, w in zip(losses, weights) if summed or w > 0 or total == 1] or list(zip(losses, weights))
        loss = sum(x * (1 if summed else w / total) for x, w in kept)

    def join(items):
        if all(i is None for i in items):
            return None
        if not isinstance(items[0], (torch.Tensor, tuple, list, dict)):
            return items[0]
        if pairs is not None and all(isinstance(i, torch.Tensor) and i.dim() > 0 and i.shape[0] == 2 * n
                                     for i, n in zip(items, pairs)):
            items = [i[:n] for i, n in zip(items, pairs)] + [i[n:] for i, n in zip(items, pairs)]
        elif pairs is not None and isinstance(items[0], (tuple, list)):
            return type(items[0])(join([i[k] for i in items]) for k in range(len(items[0])))
        joined = items[0]
        for item in items[1:]:
            joined = nested_concat(joined, item, padding_index=-100)
        return joined

    return loss, join([p[1] for p in parts]), join([p[2] for p in parts])


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


class _SplitNotExact(Exception):
    """Inside a step: the split cannot be exact and ``on_inexact='stop'`` asked to stop (routed as a failure)."""


class InexactSplitRefused(UsageError):
    """An OOM in a step whose loss does not split into micro-batches exactly, with ``on_inexact='stop'``."""


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
    # callback set should_evaluate on one rank alone (collective_gate.py agrees the flags where one may)
    agree_on_control(trainer)
    train = trainer.train

    def train_and_unhook(*args, **kw):
        try:
            return train(*args, **kw)
        finally:
            recovery.train_ends()  # the gradient hooks come off the parameters even when training raises

    trainer.train = train_and_unhook
    return recovery
