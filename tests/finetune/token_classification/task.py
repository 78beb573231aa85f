"""``task=token-classification``: a transformers encoder with a tag per word, on JSON-lines files of words and tags;
its loss a mean over the tagged words (the first sub-token of each word carries its tag, the others -100)."""

from __future__ import annotations

from hf_gpu_train.finetune.tasks import Prepared, Task, register_task

from .options import TokenClassificationOptions


@register_task
class TokenClassification(Task):
    name = "token-classification"
    options = TokenClassificationOptions
    classifier = False  # its evaluation is its loss: no logits gathered
    rows_word = "sentences"

    def data_columns(self, cfg) -> dict[str, str]:
        return {cfg.tokens_column: "tokens_column", cfg.tags_column: "tags_column"}

    def prepare(self, cfg, runtime, say) -> Prepared:
        from .model import prepare_token_classification  # lazy: transformers and datasets

        return prepare_token_classification(cfg, runtime, say)
