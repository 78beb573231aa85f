"""evaluate_before=auto decides from what the evaluation costs beside the training, says why when it does not run,
removes an earlier start's baseline (not this run's), and a resumed run keeps its own."""

from __future__ import annotations

import json

import pytest

from hf_gpu_train.finetune.evaluate_before import (
    BASELINE,
    SAMPLE_ROWS,
    attach_evaluate_before,
    sample_indices,
    sample_words,
    trained_rows,
    why_not,
)


@pytest.mark.parametrize("validation, trained, sharded, reason", [
    (199, 2400, False, ""),  # the default run: 199 sentences beside 3 epochs of 800
    (200, 100, False, ""),  # small however short the training: seconds
    (400, 1000, False, "would cost more than about a tenth"),  # a short training beside a large validation set
    (1000, 2400, False, ""),  # 512 of its rows, a sample: under a quarter of 2400
    (1000, 1600, False, "its 512 validation rows (a sample) would cost"),
    (5000, 10**7, False, ""),  # a sample however large the set (4000 rows was the limit before the sample)
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
    assert attach_evaluate_before("auto", tmp_path, trainer, 5000, resuming=False, trained_rows=1000) is None
    assert not (tmp_path / BASELINE).exists() and not trainer.callbacks
    assert "no evaluation before training: its 512 validation rows (a sample) would cost" in capsys.readouterr().out
    (tmp_path / BASELINE).write_text(json.dumps({"eval_loss": 1.5}))  # this run's, from its first start
    assert attach_evaluate_before("auto", tmp_path, trainer, 100, resuming=True, trained_rows=1000) is None
    assert json.loads((tmp_path / BASELINE).read_text()) == {"eval_loss": 1.5}  # a resumed run keeps its own
    callback = attach_evaluate_before("auto", tmp_path, trainer, 100, resuming=False, trained_rows=1000)
    assert callback is not None and trainer.callbacks == [callback]


def test_the_sample_is_the_same_rows_in_every_run_and_every_row_below_its_size():
    assert sample_indices(SAMPLE_ROWS) is None  # every row: no sample
    rows = sample_indices(5000)
    assert rows == sample_indices(5000) and len(rows) == SAMPLE_ROWS == len(set(rows))
    assert rows == sorted(rows) and rows[-1] < 5000 and rows[-1] > 4000  # spread over the set, in its order
    assert sample_words({"rows": 512, "validation_rows": 5000}, "examples") == " on a sample of 512 of 5000 validation examples"
    assert sample_words({"rows": 64, "validation_rows": 64}) == "" and sample_words({"eval_loss": 1.0}) == ""


def test_with_persistent_workers_the_evaluations_after_a_sampled_baseline_read_every_row(tmp_path, monkeypatch):
    """transformers keeps an evaluation's DataLoader under "eval" when workers persist, even one built from a dataset
    passed in: without care the baseline's sample would be what every later evaluation reads."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from hf_gpu_train.finetune import evaluate_before

    monkeypatch.setattr(evaluate_before, "SAMPLE_ROWS", 8)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return {"input_ids": torch.arange(1, 6) + i % 7, "labels": torch.tensor(i % 2)}

    counted: list[int] = []

    class Count(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            counted.append(int(metrics["eval_rows"]))

    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=16, num_labels=2))
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             report_to="none", use_cpu=True, save_strategy="no", eval_strategy="steps", eval_steps=2,
                             dataloader_num_workers=1, dataloader_persistent_workers=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), eval_dataset=Rows(), callbacks=[Count()],
                      compute_metrics=lambda p: {"rows": len(p.label_ids)})
    callback = attach_evaluate_before(True, tmp_path, trainer, 20, resuming=False)
    trainer.train()
    trainer.evaluate()
    assert counted == [8, 20, 20]  # the sample before training, then every row at step 2 and after
    assert json.loads((tmp_path / BASELINE).read_text())["rows"] == 8 and callback.baseline["validation_rows"] == 20
