"""The loss-scaling probe runs the Trainer's own compute_loss on a training batch (twice, in eval mode). Under TRL's
SFTTrainer that filed the batch's entropy and token accuracy among the *evaluation* metrics, which the first
evaluation then averaged in. The probe must leave the trainer as it found it: the evaluation logs the same figures
with and without it."""

from __future__ import annotations

import pytest

from hf_gpu_train.oom import guard_loss_scaling
from hf_gpu_train.oom.trainer_state import put_back, take
from tests.integrations.peers import build, prompt_completion

pytest.importorskip("trl")


def evaluation_after_one_step(tmp_path, guarded: bool) -> dict:
    from datasets import Dataset

    trainer = build("SFTTrainer", str(tmp_path / str(guarded)), 8)
    trainer.eval_dataset = Dataset.from_list(prompt_completion(8))
    trainer.eval_dataset = trainer._prepare_dataset(trainer.eval_dataset, trainer.processing_class, trainer.args, False,
                                                    None, "eval")
    trainer.args.max_steps, trainer.args.eval_strategy, trainer.args.eval_steps = 1, "steps", 1
    if guarded:
        guard = guard_loss_scaling(trainer)
    trainer.train()
    if guarded:
        assert guard.answer is not None  # the probe ran
    return next(h for h in trainer.state.log_history if "eval_loss" in h)


def test_the_probe_leaves_no_metric_behind(tmp_path):
    plain, guarded = evaluation_after_one_step(tmp_path, False), evaluation_after_one_step(tmp_path, True)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert guarded[key] == pytest.approx(plain[key], rel=1e-6), key


def test_plain_state_copies_tallies_and_leaves_objects_alone():
    class Holder:
        hf_gpu_train_state = ("metrics", "count", "model")  # a subclass names its own tallies (and, here, an object)

    holder = Holder()
    holder.metrics = {"train": {"entropy": [1.0]}, "eval": {}}
    holder.count, holder.model = 3, object()
    saved = take(holder)
    holder.metrics["eval"]["entropy"] = [9.0]
    holder.count += 1
    model = holder.model
    put_back(holder, saved)
    assert holder.metrics == {"train": {"entropy": [1.0]}, "eval": {}} and holder.count == 3 and holder.model is model
    put_back(holder, saved)  # reusable: the saved copy was not handed out
    holder.metrics["train"]["entropy"].append(2.0)
    put_back(holder, saved)
    assert holder.metrics["train"]["entropy"] == [1.0]


def test_the_trainers_own_state_is_never_put_back(tmp_path):
    """transformers' own Trainer attributes are the loop's state, not tallies: the loss guard turns
    model_accepts_loss_kwargs off part-way through the first step, and putting it back on one rank made that rank
    gather item counts the others did not (a hang, found by tests/scaling). TRL's tallies are put back."""
    trainer = build("SFTTrainer", str(tmp_path), 8)
    saved = take(trainer)
    assert "model_accepts_loss_kwargs" not in saved and "_metrics" in saved and "_total_train_tokens" in saved
    trainer.model_accepts_loss_kwargs = not trainer.model_accepts_loss_kwargs
    trainer._metrics["train"]["entropy"].append(1.0)
    flipped = trainer.model_accepts_loss_kwargs
    put_back(trainer, saved)
    assert trainer.model_accepts_loss_kwargs == flipped and trainer._metrics["train"]["entropy"] == []
