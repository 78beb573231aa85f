"""The in-place prediction step: an evaluation's (or ``predict``'s) batch, whole or (after an OOM) in micro-batches of
the evaluation micro-batch (``policy.py``; the training one is not touched), and the micro-batches' results joined
back as the Trainer's evaluation loop joins batches.

The losses of the micro-batches are weighed by what each averages over: what training found (``training_step.py``);
before the first training step, the labels' shape. Micro-batches count their items locally, and one gather per step
stands for the one the whole batch would have made. A router's load-balancing term is computed from the whole batch's
routing, as in training. A preference batch (TRL's DPO: chosen rows, then rejected rows) comes back in the whole
batch's order. On several processes every prediction step ends with a ballot (``lockstep.py``), and every rank leaves
it with the smallest evaluation micro-batch any rank needed.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers.trainer_pt_utils import nested_concat

from . import trainer_state as restorable
from .lockstep import END, RanksDiverged, RestartStep
from .microbatch import Pairs, Rows, describe_oom, free_memory, is_oom_error, label_counts, loss_items
from .policy import MicroBatchPolicy
from .remedies import OutOfMemoryAtMicroBatchOne
from .step_machinery import StepMachinery
from .training_step import InPlaceTrainingStep

log = logging.getLogger("hf_gpu_train.oom")


class InPlacePredictionStep:
    """Stands for the Trainer's ``prediction_step`` (installed on the instance by ``recovery.InPlaceOOMRecovery``).
    ``training``: the training step, whose weighting, router split and item count (its ``compute_loss`` notes what the
    Trainer gave it) an evaluation reads."""

    def __init__(self, trainer, policy: MicroBatchPolicy, machinery: StepMachinery, layout: Rows,
                 training: InPlaceTrainingStep):
        self.trainer = trainer
        self.policy = policy
        self.machinery = machinery
        self.layout = layout
        self.training = training
        self._prediction_step = trainer.prediction_step
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """An OOM in evaluation shrinks the evaluation micro-batch only (not the training one). On several processes
        every prediction step ends with a ballot (``lockstep.py``), and collectives issued inside it (TRL's metric
        gathers, the Trainer's gather of the item count) pass one first: a rank that ran out of memory goes on alone
        in micro-batches when the others are past every collective of the step, and every rank computes the step
        again in micro-batches when the others wait in one. Micro-batches count items locally, and one gather per
        step stands for the one the whole batch would have made. Every rank leaves each step with the smallest
        evaluation micro-batch any rank needed."""
        if not self.machinery.supported(model, training=False):
            return self._prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        size = self.layout.size(inputs)
        training, machinery = self.training, self.machinery
        lock = machinery.lockstep_for(machinery.reducer_for(model)) if machinery.several_processes() else None
        tallies = restorable.take(self.trainer) if lock else {}
        global_items = None  # the item count of the whole batch over every rank, once this step has gathered it
        fatal = None
        while True:
            micro = self.policy.evaluation_micro_batch(size)
            if lock:  # in evaluation the ballots carry the evaluation micro-batch
                lock.micro_batch = self.policy.eval_micro_batch
            failure, result, restart = None, None, None
            training.seen_items = None
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
                if micro >= size and self._gathers_item_counts(inputs) and training.seen_items is not None:
                    global_items = training.seen_items  # the failed whole-batch call had gathered it
            if failure is not None:
                free_memory()
                if micro <= 1:
                    fatal = failure
                    if lock is None:
                        break
                else:
                    self.policy.shrink(micro, size, failure, "eval")
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
                    self.policy.adopt_eval(restart.micro_batch)
                    return result
            if restart.fatal:
                fatal = fatal or "out of memory at micro-batch 1 on another rank"
                break
            lock.pending_failure = False
            self.policy.adopt_eval(restart.micro_batch)
            restorable.put_back(self.trainer, tallies)
            global_items = None  # every rank computes the step again, and gathers the item count again
        raise OutOfMemoryAtMicroBatchOne(f"evaluation does not fit even one sample ({fatal}): use bf16/fp16, a "
                                         "shorter max_length or a smaller image_size")

    def _gathers_item_counts(self, inputs) -> bool:
        t = self.trainer
        counts = "labels" in inputs and (t.model_accepts_loss_kwargs or t.compute_loss_func is not None)
        return counts and t.args.average_tokens_across_devices and t.accelerator.num_processes > 1

    def _predict_in_chunks(self, model, inputs, micro, prediction_loss_only, ignore_keys, global_items):
        training = self.training  # what training found: the weighting, the router split; the item count it was given
        gathers = self._gathers_item_counts(inputs)
        args = self.trainer.args
        parts, items, counted = [], [], False
        shifted = _predicts_next_token(model)
        # what the training loss was found to average over; before the first training step, the labels' shape tells
        known = training.weighting if training.weighting is not None and training.weighting.kind not in ("normalised", "unknown") \
            else None
        averaging = args.average_tokens_across_devices
        args.average_tokens_across_devices = False  # each micro-batch counts its own items, without a collective
        size = self.layout.size(inputs)
        # the policy's ranges, as a training micro-step's; one without a labelled token is not joined: _combine weighs it 0
        ranges = self.policy.ranges(size, 0, micro)
        summed = known is not None and known.kind == "sum"
        try:
            training.record_whole_batch(model, inputs, micro, training=False)  # a router's term from the whole batch
            for start, stop in ranges:
                chunk = self.layout.slice(inputs, start, stop)
                training.seen_items = None
                # each micro-batch's loss then carries the whole batch's term: weighed by shares that add up to 1 (or
                # its rows' share of it, for a sum)
                share = (stop - start) / size
                with training.splicing(inputs, start, stop, (lambda: 1.0) if summed else (lambda s=share: s)):
                    parts.append(self._prediction_step(model, chunk, prediction_loss_only, ignore_keys=ignore_keys))
                if training.batch_terms is not None and training.batch_terms.broken:
                    training.split_broke(type(model).__name__, training.batch_terms.broken, training=False)
                counted = counted or training.seen_items is not None
                if training.seen_items is not None:
                    items.append(float(training.seen_items))
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
            router_term = training.batch_terms.term_value(inputs) if training.batch_terms is not None else None
        finally:
            args.average_tokens_across_devices = averaging
            if training.batch_terms is not None:
                training.batch_terms.forget(inputs)
        # a preference batch's rows are every chosen row, then every rejected one: so are the joined micro-batches'
        pairs = [stop - start for start, stop in ranges] if isinstance(self.layout, Pairs) else None
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
