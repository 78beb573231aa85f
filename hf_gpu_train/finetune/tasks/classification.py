"""What the two classification tasks share: labelled examples from the same sources, checked, encoded and carved
into a validation split the same way (``finetune/data.py``), accuracy and macro F1 from the logits."""

from __future__ import annotations

import inspect
from pathlib import Path

from ...plan.evaluation_memory import evaluation_memory
from ..data import ClassificationData, OpenedData, open_classification_data, process_classification_data
from ..prepare_once import Prepared, data_key, prepare_once, world_size
from .base import Task, task_for


class ClassificationTask(Task):
    def method_refused(self, method: str) -> str:
        return (f"method={method!r}: LoRA and QLoRA are for task=causal-lm; classifiers train fully (method=full)")

    def open(self, cfg) -> OpenedData:
        """The data loaded and checked, no pass over the rows' contents yet (``data.open_classification_data``)."""
        return open_classification_data(cfg.data_keys(), self.data_columns(cfg), cfg.label_column)

    def processed(self, cfg, opened: OpenedData) -> ClassificationData:
        """The passes over every row (``data.process_classification_data``), this task's look at every row with them."""
        return process_classification_data(cfg.data_keys(), cfg.label_column, opened,
                                           lambda rows, split: self.check_rows(rows, cfg, split))

    def open_and_process(self, cfg, opened, key_parts: tuple, say, process=None):
        """The passes over every row (label encoding, the carve, then ``process(data) -> Prepared``: the task's own,
        such as tokenizing), once per machine; (what ``prepare_once`` returned, the run's ClassificationData), its
        notes said."""

        def processed() -> Prepared:
            data = self.processed(cfg, opened)
            return process(data) if process else Prepared(data.train, data.validation, {"notes": data.notes})

        raw = {"train": opened.train, "validation": opened.validation}
        folder = Path(inspect.getfile(type(self))).parent  # the task's own code prepares the rows too
        prepared = prepare_once(data_key(cfg.values(), raw, *key_parts, task_folder=folder), processed)
        notes = list(prepared.meta["notes"]) + ([f"data {prepared.how}"] if world_size() > 1 else [])
        data = ClassificationData(train=prepared.train, validation=prepared.validation, label_names=opened.label_names,
                                  source=opened.source, notes=notes)
        say(data.notes)
        return prepared, data

    def evaluation_line(self, model, cfg, rows: int, classes: int) -> str:
        """What its evaluation keeps: the class ids (``metrics.logits_to_class_ids``), not the logits."""
        return evaluation_memory(rows, 1, max(classes, 1), False, "class ids").reason()


def load_classification_data(cfg) -> ClassificationData:
    """A classification task's data for ``cfg``, loaded, checked and processed (no model, no cache)."""
    task = task_for(cfg.task)
    return task.processed(cfg, task.open(cfg))
