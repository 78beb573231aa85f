"""``task=text-classification``: a transformers encoder with a new classification head, on one text column (or a
pair), tokenized once per machine and padded per batch (``model.py``)."""

from __future__ import annotations

from ...checkpoints import check_label_map
from ...learning_rates import resolve_learning_rate, text_learning_rate
from ...prepare_once import Prepared as PreparedRows
from ..base import Prepared, register_task
from ..classification import ClassificationTask
from ..model_dirs import check_text_model, resolve_model_path
from .model import load_text_model, text_collator, tokenize
from .options import TextClassificationOptions


@register_task
class TextClassification(ClassificationTask):
    name = "text-classification"
    options = TextClassificationOptions
    evaluates_in_dataset_order = True  # its validation set is longest first (model.longest_first): little padding

    def learning_rate(self, model):
        return text_learning_rate(model)

    def data_columns(self, cfg) -> dict[str, str]:
        columns = {cfg.label_column: "label_column", cfg.text_column: "text_column"}
        if cfg.text_pair_column:
            columns[cfg.text_pair_column] = "text_pair_column"
        return columns

    def prepare(self, cfg, runtime, say) -> Prepared:
        model_dir = check_text_model(cfg.model)
        opened = self.open(cfg)
        if model_dir is not None:
            check_label_map(model_dir, opened.label_names, "model")  # warm start from one of our runs
        model, tokenizer = load_text_model(cfg.model, opened.label_names)
        cfg.learning_rate, chosen = resolve_learning_rate(cfg.learning_rate, model, self.learning_rate)
        if chosen:
            say([chosen])

        def tokenized(data) -> PreparedRows:
            return PreparedRows(*tokenize(cfg.options, data, tokenizer), {"notes": data.notes})

        prepared, data = self.open_and_process(cfg, opened, (resolve_model_path(cfg.model), tokenizer), say, tokenized)
        return Prepared(model, prepared.train, prepared.validation, text_collator(tokenizer, runtime.on_cuda), tokenizer, data)

    def planner_model(self, cfg) -> str:
        return resolve_model_path(cfg.model)
