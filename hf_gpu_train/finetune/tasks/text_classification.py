"""``task=text-classification``: a transformers encoder with a new classification head, on one text column (or a
pair), tokenized once per machine and padded per batch (``finetune/text.py``)."""

from __future__ import annotations

from .base import Prepared, register_task
from .classification import ClassificationTask


@register_task
class TextClassification(ClassificationTask):
    name = "text-classification"
    evaluates_in_dataset_order = True  # its validation set is longest first (text.longest_first): little padding

    def learning_rate(self, model):
        from ..learning_rates import (
            text_learning_rate,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        return text_learning_rate(model)

    def data_columns(self, cfg) -> dict[str, str]:
        columns = {cfg.label_column: "label_column", cfg.text_column: "text_column"}
        if cfg.text_pair_column:
            columns[cfg.text_pair_column] = "text_pair_column"
        return columns

    def prepare(self, cfg, runtime, say) -> Prepared:
        from ..checkpoints import (
            check_label_map,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..data import (
            open_classification_data,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..learning_rates import (
            resolve_learning_rate,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..preflight import (
            check_text_model,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..prepare_once import (
            Prepared as PreparedRows,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..text import (  # lazy: the config reads this registry, and the finetune modules import the config
            load_text_model,
            resolve_model_path,
            text_collator,
            tokenize,
        )

        model_dir = check_text_model(cfg)
        opened = open_classification_data(cfg)
        if model_dir is not None:
            check_label_map(model_dir, opened.label_names, "model")  # warm start from one of our runs
        model, tokenizer = load_text_model(cfg, opened.label_names)
        chosen = resolve_learning_rate(cfg, model)
        if chosen:
            say([chosen])

        def tokenized(data) -> PreparedRows:
            return PreparedRows(*tokenize(cfg, data, tokenizer), {"notes": data.notes})

        prepared, data = self.open_and_process(cfg, opened, (resolve_model_path(cfg.model), tokenizer), say, tokenized)
        return Prepared(model, prepared.train, prepared.validation, text_collator(tokenizer, runtime.on_cuda), tokenizer, data)

    def planner_model(self, cfg) -> str:
        from ..text import resolve_model_path  # lazy: the config reads this registry, and the finetune modules import the config

        return resolve_model_path(cfg.model)
