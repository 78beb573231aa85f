"""What the two classification tasks share: labelled examples from the same sources, checked, encoded and carved
into a validation split the same way (``finetune/data.py``), accuracy and macro F1 from the logits."""

from __future__ import annotations

from .base import Task


class ClassificationTask(Task):
    def open_and_process(self, cfg, opened, key_parts: tuple, say, process=None):
        """The passes over every row (label encoding, the carve, then ``process(data) -> Prepared``: the task's own,
        such as tokenizing), once per machine; (what ``prepare_once`` returned, the run's ClassificationData), its
        notes said."""
        from ..data import (  # lazy: the config reads this registry, and the finetune modules import the config
            ClassificationData,
            process_classification_data,
        )
        from ..prepare_once import (  # lazy: the config reads this registry, and the finetune modules import the config
            Prepared,
            data_key,
            prepare_once,
            world_size,
        )

        def processed() -> Prepared:
            data = process_classification_data(cfg, opened)
            return process(data) if process else Prepared(data.train, data.validation, {"notes": data.notes})

        raw = {"train": opened.train, "validation": opened.validation}
        prepared = prepare_once(data_key(cfg, raw, *key_parts), processed)
        notes = list(prepared.meta["notes"]) + ([f"data {prepared.how}"] if world_size() > 1 else [])
        data = ClassificationData(train=prepared.train, validation=prepared.validation, label_names=opened.label_names,
                                  source=opened.source, notes=notes)
        say(data.notes)
        return prepared, data
