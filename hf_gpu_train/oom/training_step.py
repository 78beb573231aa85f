"""The in-place training step: one micro-step of the Trainer's, whole or (after an OOM) in micro-batches, on every
rank in step, with the same gradient as the whole batch's.

When a micro-step runs out of memory, only the error's text is kept and memory is freed outside the ``except`` block
(the traceback holds tensors: pytorch #18853); the micro-batch halves (``policy.py``) and the step goes on with the
*same* inputs, cut into micro-batches whose losses are weighed by their share of what the loss averages over (rows,
labelled tokens, a causal LM's next tokens; 1 for a sum, or a loss normalised by ``num_items_in_batch``). What it
averages over is asked of the loss itself at the first optimizer steps, on two samples alone and together
(``loss_scaling.py``: ``_decide_weighting``), and so is whether it adds up over micro-batches at all: a term over the
whole batch that no weighting splits is said then, with its size (``on_inexact``: recover approximately, or stop at the
OOM). A mixture-of-experts router's load-balancing loss is split from the whole batch's routing (``batch_terms.py``).

An OOM in forward keeps what earlier micro-batches accumulated; an OOM part-way through backward has already added
part of a gradient, so that micro-step is recomputed from its first sample (with gradient accumulation, the earlier
micro-steps of that optimizer step are computed again from their inputs, their tokens not counted twice).
``global_step``, the LR schedule, the data order and the effective batch do not change.

With several processes, forward and backward run under DDP's ``no_sync`` and the recovery's own reducer averages the
gradients (``grad_sync.py``); every micro-step ends with a ballot, and collectives inside it pass one first
(``lockstep.py``). A rank that runs out of memory goes on alone in micro-batches; if the others wait in a collective of
the step, every rank computes the optimizer step again from its first micro-step (``_restart``: the Trainer's tallies,
``trainer_state.py``'s list, put back as they were). Every rank then runs the smallest micro-batch any rank needed. A
rank that cannot fit one sample stops every rank with the remedies.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..errors import UsageError
from . import trainer_state as restorable
from .batch_terms import NotSpliceable, RouterBalanceSplit
from .grad_sync import broadcast_buffers
from .lockstep import END, RanksDiverged, RestartStep
from .loss_scaling import (
    MEAN,
    PROBE_TRIES,
    UNDECIDED,
    LossScalingGuard,
    LossWeighting,
    Probe,
    agree_on_weighting,
    decomposes,
    probe_weighting,
)
from .microbatch import (
    CHUNKS,
    Pairs,
    Rows,
    describe_oom,
    free_memory,
    is_oom_error,
    label_counts,
    replaying_micro_steps,
)
from .policy import MicroBatchPolicy
from .remedies import OutOfMemoryAtMicroBatchOne, remedies
from .step_machinery import StepMachinery

log = logging.getLogger("hf_gpu_train.oom")
ON_INEXACT = ("recover", "stop")  # after an OOM, a loss that does not split exactly: recover approximately, or stop


class InPlaceTrainingStep:
    """Stands for the Trainer's ``training_step`` and ``compute_loss`` (installed on the instance by
    ``recovery.InPlaceOOMRecovery``). ``policy``: the micro-batch sizes; ``machinery``: the reducer and the ballots;
    ``layout``: how a batch divides into samples (rows, or chosen/rejected pairs for TRL's DPO)."""

    def __init__(self, trainer, policy: MicroBatchPolicy, machinery: StepMachinery, layout: Rows, guard: LossScalingGuard,
                 weighting: LossWeighting | None = None, on_inexact: str = "recover"):
        self.trainer = trainer
        self.policy = policy
        self.machinery = machinery
        self.layout = layout
        self.guard = guard
        self.on_inexact = on_inexact
        self.inexact: Probe | None = None  # the loss does not split exactly (found at the first steps), with the deviation
        self.weighting = weighting  # what a mean loss averages over: told, or asked of the loss at the first steps
        self._probes = 0  # optimizer steps whose batch was probed for the weighting
        self._provisional = LossWeighting("rows")  # until the weighting is known (_decide_weighting)
        self._per_sample: tuple = (None, None, None)  # (inputs, weighting, what each sample adds to the count)
        # a mixture-of-experts router's load-balancing loss, split from the whole batch's routing (batch_terms.py)
        self.batch_terms = None if isinstance(layout, Pairs) else RouterBalanceSplit.find(trainer.model)
        self._training_step = trainer.training_step
        self._compute_loss = trainer.compute_loss
        self.share = 1.0  # this micro-batch's share of the step's batch, while one runs
        self.fresh = True  # the next training_step starts an optimizer step
        self.seen_items = None  # the item count the Trainer gave the running compute_loss (read by evaluation too)
        self._earlier: list[tuple] = []  # this optimizer step's completed micro-steps (inputs, item count)
        self._fatal: str | None = None  # an OOM at micro-batch 1 on several processes, raised at the micro-step's ballot
        self.restarts = 0  # steps every rank computed again because one rank ran out of memory inside a collective's reach
        self._tallies: dict = {}  # the Trainer's tallies (trainer_state.py) at the start of the optimizer step
        self._tallies_unused = False
        self._chunk_tallies: dict = {}  # the same, at the start of the micro-batch that runs now
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # -- the loss of a micro-batch ------------------------------------------------------------------------------------
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

    # -- the step ------------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.machinery.supported(model):
            return self._training_step(model, inputs, num_items_in_batch)
        try:
            return self._step_in_place(model, inputs, num_items_in_batch)
        finally:
            if self.batch_terms is not None:  # a micro-step's recorded router logits go with it (a replay records again)
                self.batch_terms.forget(inputs)

    def _step_in_place(self, model, inputs, num_items_in_batch):
        """One micro-step of the Trainer's, whole or (after an OOM) in micro-batches, on every rank in step."""
        size = self.layout.size(inputs)
        self.policy.saw_training_batch(size)
        fresh, self.fresh = self.fresh, False
        CHUNKS.begin_micro_step()
        if fresh:
            self._earlier, self._fatal = [], None
            if self.weighting is None and self._probes < PROBE_TRIES:
                self._decide_weighting(model, inputs, num_items_in_batch)
            self._tallies = restorable.take(self.trainer)  # what a restarted step must not count twice
            self._tallies_unused = True  # nothing ran since: the first micro-batch's copy is this one (a copy less per step)
        reducer = self.machinery.reducer_for(model)
        distributed = self.machinery.several_processes()
        lock = self.machinery.lockstep_for(reducer) if distributed else None
        syncs = distributed and model.require_backward_grad_sync  # the last micro-step of the optimizer step
        if distributed and fresh:
            broadcast_buffers(model)  # DDP's per-step buffer sync, kept out of the guarded forwards
        done, total = 0, None  # samples of this micro-step whose gradients are in .grad, and their loss
        replay: list[tuple] = []  # earlier micro-steps of this optimizer step to compute again
        round_failed = False  # this rank ran out of memory in this micro-step: its gradient buckets are unusable
        while True:
            micro = self.policy.training_micro_batch(size)
            if lock:  # what this rank can run in training, told at every ballot of this step
                lock.micro_batch = self.policy.micro_batch
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
                            self.record_whole_batch(model, inputs, micro)
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
                free_memory()
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
                    self.policy.shrink(micro, size, failure, "train")
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
            self.policy.adopt(outcome.micro_batch, size)
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
        self.policy.adopt(outcome.micro_batch, size)  # the loop tells the next ballots from the state
        model.zero_grad(set_to_none=True)
        restorable.put_back(self.trainer, self._tallies)
        CHUNKS.void_all()
        self.restarts += 1
        if self._earlier:
            log.info("OOM recovery: every rank computes this optimizer step again (%d earlier micro-step(s) first), in "
                     "micro-batches of %s", len(self._earlier), self.policy.micro_batch)
        return 0, None, list(self._earlier)

    def _chunk(self, model, inputs, start: int, stop: int, num_items_in_batch, arm: bool, distributed: bool):
        """Samples ``start:stop`` of ``inputs``, forward and backward: the loss scaled by their share where it is a mean,
        a batch-level term split from the whole batch's (``batch_terms.py``)."""
        if arm:
            self.machinery.reducer.arm()
        CHUNKS.begin_chunk()
        if self._tallies_unused:  # taken at this optimizer step's start, and nothing has run since
            self._chunk_tallies = self._tallies
        else:
            self._chunk_tallies = restorable.take(self.trainer)  # put back if this micro-batch fails (it runs again)
        self._tallies_unused = False
        self.share = self._share(inputs, start, stop)
        if distributed:
            model.require_forward_param_sync = False  # no DDP buffer broadcast inside a forward that may fail
        with self.splicing(inputs, start, stop, self._loss_scale):
            loss = self._training_step(model, self.layout.slice(inputs, start, stop), num_items_in_batch)
        broken = self.batch_terms.broken if self.batch_terms is not None else None
        if broken:  # this micro-batch computed its own router term (said): the step goes on approximately
            unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            self.split_broke(type(unwrapped).__name__, broken)
        return loss

    def _accumulate(self, model, inputs, num_items_in_batch, micro: int, distributed: bool) -> None:
        """An earlier micro-step computed again, whole, in micro-batches (its loss was already reported; a micro-step
        without sync, so no bucket is armed)."""
        if micro < self.layout.size(inputs):
            self.record_whole_batch(model, inputs, micro)
        for begin, stop in self._ranges(inputs, 0, micro):
            self._chunk(model, inputs, begin, stop, num_items_in_batch, arm=False, distributed=distributed)

    def _drop_gradients(self, model) -> None:
        """Part of a micro-batch's gradient is in .grad: start the optimizer step's gradients again. The earlier
        micro-steps of this optimizer step are computed again from their inputs (the Trainer holds every micro-batch of
        the step already, so keeping them costs no memory)."""
        if self._earlier:
            log.info("OOM recovery: out of memory part-way through backward; the %d earlier micro-step(s) of this optimizer "
                     "step are computed again", len(self._earlier))
        model.zero_grad(set_to_none=True)

    def _ranges(self, inputs, start: int, micro: int) -> list[tuple[int, int]]:
        """This micro-step's micro-batches from sample ``start`` (``MicroBatchPolicy.ranges``); under a mean over
        labelled tokens a micro-batch without a labelled token (its own mean is 0/0) is joined to its neighbour."""
        joins = self._weighing().kind not in ("normalised", "sum", "rows", "unknown")
        return self.policy.ranges(self.layout.size(inputs), start, micro, self._counts(inputs) if joins else None)

    # -- a loss term over the whole batch ------------------------------------------------------------------------------
    def record_whole_batch(self, model, inputs, micro: int, training: bool = True) -> None:
        """Before a split micro-step: the whole batch's arguments of a batch-level term (a router's load-balancing
        loss), from a forward without gradients in micro-batches of ``micro``. An OOM in it is an OOM of the step."""
        split = self.batch_terms
        if split is None or split.recorded(inputs):
            return
        unwrapped = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        try:
            with replaying_micro_steps():  # not a training forward: its tokens are not counted
                split.record(unwrapped, self.policy.cut(self.layout, inputs, micro), self.trainer._prepare_inputs, key=inputs)
        except NotSpliceable as error:
            self.split_broke(type(unwrapped).__name__, str(error), training)

    def split_broke(self, model_name: str, why: str, training: bool = True) -> None:
        """The router split cannot be made for this model (its recording or a micro-batch's arguments did not fit the
        whole batch's): from here the split is approximate, said once, and ``on_inexact='stop'`` stops at this OOM."""
        self.batch_terms = None
        self.inexact = Probe("unknown", None)
        log.warning("OOM recovery: the router's load-balancing loss of %s cannot be split from the whole batch (%s): "
                    "each micro-batch computes it from its own rows, an approximation", model_name, why)
        if self.on_inexact == "stop" and training:  # (an evaluation's loss is said, not stopped for)
            raise _SplitNotExact(f"the router's load-balancing loss of {model_name} cannot be split exactly ({why})")

    def splicing(self, inputs, start: int, stop: int, scale_of):
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

    # -- what a micro-batch's loss weighs ------------------------------------------------------------------------------
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
                free_memory()
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
            free_memory()
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


def _probe_tolerance(trainer, model) -> float:
    """How closely the pair's loss must match a candidate: fp32 arithmetic leaves ~1e-6 (1e-4 is the band); 16-bit
    parameters or autocast, and TF32 matmuls on a GPU (~1e-3), leave more (2e-2)."""
    args = trainer.args
    tf32 = torch.cuda.is_available() and (torch.backends.cuda.matmul.allow_tf32 or bool(getattr(args, "tf32", False))
                                          or torch.get_float32_matmul_precision() != "highest")
    loose = args.bf16 or args.fp16 or tf32 or any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad)
    return 2e-2 if loose else 1e-4


class _SplitNotExact(Exception):
    """Inside a step: the split cannot be exact and ``on_inexact='stop'`` asked to stop (routed as a failure)."""


class InexactSplitRefused(UsageError):
    """An OOM in a step whose loss does not split into micro-batches exactly, with ``on_inexact='stop'``."""
