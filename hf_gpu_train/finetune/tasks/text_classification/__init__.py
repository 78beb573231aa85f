"""``task=text-classification``: a transformers encoder with a new classification head, on one text column (or a pair),
tokenized once per machine and padded per batch. ``task.py`` (the task), ``options.py`` (its keys), ``model.py`` (the
model, the tokenizer and the tokenized splits)."""

from .task import TextClassification

__all__ = ["TextClassification"]
