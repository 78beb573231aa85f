"""A fourth task, added the way a user adds one (issue 37): ``task=token-classification`` (a tag per word: named
entities, parts of speech), its folder only: ``options.py`` (its keys), ``task.py`` (the task), ``model.py`` (data,
tokens aligned to words, the model). Importing this package registers it: the one registration line."""

from .task import TokenClassification

__all__ = ["TokenClassification"]
