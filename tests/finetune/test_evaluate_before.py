"""evaluate_before=auto decides from what the evaluation costs beside the training, says why when it does not run,
removes an earlier start's baseline (not this run's), and a resumed run keeps its own."""

from __future__ import annotations

import json

import pytest

from hf_gpu_train.finetune.evaluate_before import BASELINE, attach_evaluate_before, trained_rows, why_not


@pytest.mark.parametrize("validation, trained, sharded, reason", [
    (199, 2400, False, ""),  # the default run: 199 sentences beside 3 epochs of 800
    (200, 100, False, ""),  # small however short the training: seconds
    (1000, 2000, False, "would cost more than about a tenth"),  # a short training beside a large validation set
    (1000, 8000, False, ""),
    (5000, 10**7, False, "has 5000 rows (auto: at most 4000)"),
    (100, 1000, True, "sharded"),
])
def test_auto_weighs_the_evaluation_against_the_training(validation, trained, sharded, reason):
    got = why_not("auto", validation, sharded, trained)
    assert (reason in got) if reason else got == ""
    assert why_not(True, validation, sharded, trained) == ""
    assert why_not(False, validation, sharded, trained) == "evaluate_before=false"


def test_the_rows_trained_follow_max_steps_or_the_epochs():
    assert trained_rows(-1, 3.0, 800, 32) == 2400
    assert trained_rows(10, 3.0, 800, 32) == 320


class FakeTrainer:
    is_deepspeed_enabled = False

    def __init__(self):
        self.callbacks = []

    def is_world_process_zero(self):
        return True

    def add_callback(self, callback):
        self.callbacks.append(callback)


def test_a_run_that_does_not_evaluate_first_says_why_and_drops_an_earlier_starts_file(tmp_path, capsys):
    (tmp_path / BASELINE).write_text(json.dumps({"eval_loss": 9.0}))  # an earlier start of another config
    trainer = FakeTrainer()
    assert attach_evaluate_before("auto", tmp_path, trainer, 5000, resuming=False, trained_rows=10**6) is None
    assert not (tmp_path / BASELINE).exists() and not trainer.callbacks
    assert "no evaluation before training: the validation set has 5000 rows" in capsys.readouterr().out
    (tmp_path / BASELINE).write_text(json.dumps({"eval_loss": 1.5}))  # this run's, from its first start
    assert attach_evaluate_before("auto", tmp_path, trainer, 100, resuming=True, trained_rows=1000) is None
    assert json.loads((tmp_path / BASELINE).read_text()) == {"eval_loss": 1.5}  # a resumed run keeps its own
    callback = attach_evaluate_before("auto", tmp_path, trainer, 100, resuming=False, trained_rows=1000)
    assert callback is not None and trainer.callbacks == [callback]
