"""The loss-scaling guard asks the loss itself, and the OOM recovery scales micro-batches by the Trainer's own rule:
label smoothing and a compute_loss_func (normalised by num_items_in_batch, as transformers' contract says) come
through a split step exactly; a mean compute_loss_func is named with the fix."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery, guard_loss_scaling
from hf_gpu_train.oom.loss_scaling import MEAN, SUM, UNKNOWN, loss_normalisation
from tests.callbacks.tiny import TokenDataset
from tests.oom.test_oom import exact_bert, oom_args
from tests.scaling.equivalence import assert_same_params, assert_same_series
from tests.scaling.models import ImageData, vision_model


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def test_the_probe_reads_ratios_not_ulps():
    model = torch.nn.Linear(1, 1)

    def loss_for(scale):
        return lambda m, inputs, num_items_in_batch: torch.tensor(scale(float(num_items_in_batch)))

    assert loss_normalisation(loss_for(lambda n: 0.7), model, {}, 8) == MEAN
    assert loss_normalisation(loss_for(lambda n: 0.7 * (1 + 1e-3 * (n > 8))), model, {}, 8) == MEAN  # bf16-sized noise
    assert loss_normalisation(loss_for(lambda n: 5.6 / n), model, {}, 8) == SUM
    assert loss_normalisation(loss_for(lambda n: 5.6 / n + 0.5), model, {}, 8) == UNKNOWN  # an auxiliary term on top
    assert loss_normalisation(loss_for(lambda n: 0.0), model, {}, 8) == UNKNOWN
    assert loss_normalisation(loss_for(lambda n: 0.7), model, {}, None) == MEAN  # no item count: the Trainer averages


def test_label_smoothing_comes_through_a_split_step_exactly(tmp_path):
    """The Trainer's label smoother pops labels from the inputs it is given: the probe must not eat them."""
    def run(name, oom):
        model = exact_bert()
        if oom:
            OOMFaultInjector(max_batch=4).install(model)
        trainer = Trainer(model=model, args=oom_args(tmp_path / name, label_smoothing_factor=0.1), train_dataset=TokenDataset(n=96))
        enable_oom_recovery(trainer)
        trainer.train()
        return params(model)

    assert_same_params(run("split", oom=True), run("whole", oom=False), atol=2e-6)


def sum_over_items(outputs, labels, num_items_in_batch=None):
    losses = torch.nn.functional.cross_entropy(outputs["logits"], labels, reduction="sum")
    return losses / num_items_in_batch if num_items_in_batch is not None else losses / labels.numel()


def test_a_compute_loss_func_normalised_by_the_item_count_comes_through_a_split_step_exactly(tmp_path):
    """A model without **kwargs (timm), a loss normalised by num_items_in_batch: a split step must not halve it."""
    def run(name, oom):
        model = vision_model()
        if oom:
            OOMFaultInjector(max_batch=4).install(model)
        args = oom_args(tmp_path / name, logging_steps=1, adam_epsilon=1e-6)  # eps: tests/scaling/equivalence.py
        trainer = Trainer(model=model, args=args, train_dataset=ImageData(), compute_loss_func=sum_over_items)
        recovery = enable_oom_recovery(trainer)
        trainer.train()
        return trainer, params(model), recovery

    split, split_params, recovery = run("split", oom=True)
    whole, whole_params, _ = run("whole", oom=False)
    assert recovery.micro_batch == 4
    assert_same_series("logged loss", logged(split, "loss"), logged(whole, "loss"))
    assert_same_series("gradient norm", logged(split, "grad_norm"), logged(whole, "grad_norm"))  # a halved gradient shows here
    assert_same_params(split_params, whole_params)


def test_a_mean_compute_loss_func_is_named_with_the_fix(tmp_path, caplog):
    def mean(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs["logits"], labels)

    trainer = Trainer(model=vision_model(), args=oom_args(tmp_path, max_steps=1), train_dataset=ImageData(), compute_loss_func=mean)
    guard = guard_loss_scaling(trainer)
    with caplog.at_level("WARNING", logger="hf_gpu_train.loss_scaling"):
        trainer.train()
    assert guard.answer == MEAN
    assert any("divided by num_items_in_batch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("accepts", [True, False])
def test_the_guard_leaves_models_that_take_no_item_count_alone(tmp_path, accepts):
    trainer = Trainer(model=exact_bert(), args=oom_args(tmp_path, max_steps=1), train_dataset=TokenDataset(n=16))
    trainer.model_accepts_loss_kwargs = accepts
    guard = guard_loss_scaling(trainer)
    trainer.train()
    assert guard.answer == MEAN and trainer.model_accepts_loss_kwargs is False
