"""Text classification's evaluation order: longest first, and the metrics of the unsorted order."""

import numpy as np
import pytest
from datasets import Dataset
from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer

from hf_gpu_train.finetune.builtin import minilm_path
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.tasks.classification import load_classification_data
from hf_gpu_train.finetune.tasks.text_classification.model import longest_first, tokenize
from tests.callbacks.tiny import tiny_args, tiny_bert

LENGTHS = [3, 9, 5, 9, 2, 7, 5, 12, 4, 9, 6, 11, 3, 8, 10, 5, 7, 2, 12, 6]


def rows(lengths):
    ids = [[1 + (i * 7 + j) % 97 for j in range(n)] for i, n in enumerate(lengths)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * n for n in lengths],
                              "labels": [(i * 5 + n) % 2 for i, n in enumerate(lengths)]})


def test_longest_first_keeps_every_row_with_its_label_and_ties_in_order():
    data = rows(LENGTHS)
    ordered = longest_first(data)
    lengths = [len(x) for x in ordered["input_ids"]]
    assert lengths == sorted(LENGTHS, reverse=True)
    assert sorted(zip(map(tuple, ordered["input_ids"]), ordered["labels"])) == sorted(zip(map(tuple, data["input_ids"]), data["labels"]))
    nines = [x for x in ordered["input_ids"] if len(x) == 9]
    assert nines == [x for x in data["input_ids"] if len(x) == 9]  # equal lengths keep the file's order


def test_the_entry_points_validation_is_longest_first_and_training_keeps_its_order(tmp_path):
    cfg = load_config(None, ["dataset=builtin:text", "max_train_samples=40", "max_eval_samples=24", "max_length=32",
                             f"output_dir={tmp_path}"])
    data = load_classification_data(cfg)
    train, validation = tokenize(cfg.options, data, AutoTokenizer.from_pretrained(minilm_path()))
    lengths = [len(x) for x in validation["input_ids"]]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) > 1
    assert sorted(validation["labels"]) == sorted(data.validation["labels"])
    assert train["labels"] == data.train["labels"]  # the training order is the sampler's business


def test_the_entry_points_trainer_evaluates_longest_first_with_less_padding_than_transformers_grouping(tmp_path):
    """Through the real factory: transformers 5 would group the evaluation by length at random (its eval sampler under
    group_by_length), which undoes the order; the factory's trainer reads it as it is."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from hf_gpu_train.finetune.run import prepared_for
    from hf_gpu_train.finetune.runtime import resolve_runtime
    from hf_gpu_train.finetune.trainer_factory import build_trainer

    cfg = load_config(None, ["dataset=builtin:text", "max_train_samples=40", "max_eval_samples=96", "max_length=64",
                             "per_device_train_batch_size=8", f"output_dir={tmp_path}"])
    runtime = resolve_runtime(cfg)
    p = prepared_for(cfg, runtime)
    model, train, validation, collator, tokenizer = p.model, p.train, p.validation, p.collator, p.processing_class
    trainer = build_trainer(cfg, runtime, model, train, validation, collator, tokenizer)
    widths = [batch["input_ids"].shape[1] for batch in trainer.get_eval_dataloader()]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) > 1
    assert sum(len(b["labels"]) for b in trainer.get_eval_dataloader()) == len(validation)  # every row, once
    grouped = LengthGroupedSampler(trainer.args.eval_batch_size, dataset=validation, model_input_name="input_ids")
    transformers_order = list(grouped)
    padded = sum(width * len(b["labels"]) for width, b in zip(widths, trainer.get_eval_dataloader()))
    theirs = sum(max(len(validation[i]["input_ids"]) for i in transformers_order[k:k + trainer.args.eval_batch_size])
                 * len(transformers_order[k:k + trainer.args.eval_batch_size])
                 for k in range(0, len(transformers_order), trainer.args.eval_batch_size))
    assert padded < theirs


def test_evaluation_of_the_sorted_set_reports_what_the_file_order_reports(tmp_path):
    """Accuracy, F1 and the loss (a per-example mean: each batch's mean counts once per example) do not depend on
    how the examples fall into batches; padding changes only rounding."""
    data = rows(LENGTHS)

    def metrics(p):
        predicted = np.argmax(p.predictions, axis=1)
        return {"accuracy": float((predicted == p.label_ids).mean()), "positives": int(predicted.sum())}

    def evaluate(dataset):
        trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, per_device_eval_batch_size=4), eval_dataset=dataset,
                          data_collator=DataCollatorWithPadding(AutoTokenizer.from_pretrained(minilm_path())),
                          compute_metrics=metrics)
        return trainer.evaluate()

    as_read, ordered = evaluate(data), evaluate(longest_first(data))
    assert ordered["eval_accuracy"] == as_read["eval_accuracy"] and ordered["eval_positives"] == as_read["eval_positives"]
    assert ordered["eval_loss"] == pytest.approx(as_read["eval_loss"], rel=1e-6)
