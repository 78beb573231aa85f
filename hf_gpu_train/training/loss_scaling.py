"""Is this loss a per-batch mean or a sum normalised by ``num_items_in_batch``? Ask the loss, not the signature.

transformers 5 decides from a model's ``forward`` signature (``**kwargs`` means yes) that its loss is a
sum over the items of the whole global batch divided by their count (``num_items_in_batch``). For such a
loss the Trainer skips the division by the gradient-accumulation steps and, with
``average_tokens_across_devices`` (on by default), multiplies it by the number of processes, which DDP's
gradient averaging then undoes. A model whose ``forward`` takes ``**kwargs`` but returns a plain mean
(BERT sequence classification and most classification heads) therefore carries N times its loss and its
gradients on N processes: the logged loss is N times too large and gradient clipping trips N times sooner
(measured here: 2 processes log exactly 2x the loss of one on the same global batch).

``loss_normalisation`` asks the loss once: without a graph and without dropout, the loss of the same inputs
for n and for 2n items halves when it is sum-normalised and does not move when it is a mean.
``guard_loss_scaling(trainer)`` applies the answer before the first loss is used: a mean loss sets
``trainer.model_accepts_loss_kwargs = False``, the public switch the Trainer reads in ``compute_loss``
(no multiplication by the number of processes) and in ``training_step`` (division by the accumulation
steps), and says so once.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("hf_gpu_train.loss_scaling")
MEAN, SUM, UNKNOWN = "mean", "sum-normalised", "unknown"


def loss_normalisation(compute_loss, model, inputs, num_items_in_batch) -> str:
    """MEAN, SUM or UNKNOWN for ``compute_loss(model, inputs, num_items_in_batch=...)``.

    The inputs are copied for each call: ``Trainer.compute_loss`` pops ``labels`` from the dict it is given
    when label smoothing or a ``compute_loss_func`` is on."""
    if num_items_in_batch is None:
        return MEAN
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            once = float(compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch))
            twice = float(compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch * 2))
    finally:
        model.train(was_training)
    if once == 0.0:
        return UNKNOWN
    if abs(once - twice) <= 1e-6 * abs(once):
        return MEAN
    if abs(once - 2.0 * twice) <= 1e-5 * abs(once):
        return SUM
    return UNKNOWN


class LossScalingGuard:
    """Wraps ``trainer.compute_loss`` on the instance; decides at the first call that carries an item count."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.compute_loss_unguarded = trainer.compute_loss
        self.answer: str | None = None if getattr(trainer, "model_accepts_loss_kwargs", False) else MEAN

    def install(self) -> LossScalingGuard:
        self.trainer.compute_loss = self.compute_loss
        self.trainer._hf_gpu_train_loss_guard = self  # our own attribute: one guard per Trainer
        return self

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.answer is None and num_items_in_batch is not None:
            self.decide(model, inputs, num_items_in_batch)
        return self.compute_loss_unguarded(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def decide(self, model, inputs, num_items_in_batch) -> str:
        unwrapped = self.trainer.accelerator.unwrap_model(model)  # no DDP collectives in the probe
        self.answer = loss_normalisation(self.compute_loss_unguarded, unwrapped, inputs, num_items_in_batch)
        if self.answer == MEAN and self.trainer.model_accepts_loss_kwargs:
            self.trainer.model_accepts_loss_kwargs = False
            log.warning("hf_gpu_train: %s's forward takes **kwargs, so transformers treats its loss as normalised by "
                        "num_items_in_batch, but it is a per-batch mean: set trainer.model_accepts_loss_kwargs = False, so the "
                        "loss is divided by the accumulation steps and not multiplied by the %d process(es)",
                        type(unwrapped).__name__, self.trainer.accelerator.num_processes)
        elif self.answer == UNKNOWN:
            log.warning("hf_gpu_train: cannot tell whether %s's loss is a mean or normalised by num_items_in_batch; "
                        "left as transformers decided (model_accepts_loss_kwargs=%s)", type(unwrapped).__name__,
                        self.trainer.model_accepts_loss_kwargs)
        return self.answer


def guard_loss_scaling(trainer) -> LossScalingGuard:
    """One line for anyone's Trainer, before ``trainer.train()``; ``enable_oom_recovery`` and
    ``attach_telemetry`` call it too. Installing it twice returns the first guard."""
    existing = getattr(trainer, "_hf_gpu_train_loss_guard", None)
    return existing if existing is not None else LossScalingGuard(trainer).install()
