"""Take and put back the plain-data attributes of a Trainer: what a re-run of its own code would count twice.

A Trainer subclass keeps running tallies in ordinary attributes: TRL's ``_metrics`` (entropy and token accuracy
of every ``compute_loss`` call, filed under "train" or "eval") and ``_total_train_tokens``, a user's own counters.
When this package runs someone's ``compute_loss`` for a reason of its own (the loss-scaling probe) or runs a step
again (OOM recovery replaying micro-steps, every rank restarting a step), those tallies would count the extra
calls. This module copies every attribute made only of numbers, strings and containers of them, and puts them
back, without naming any of them: it works for trainers we have never seen. Tensors, modules, datasets and
other objects are left alone (they are the model and the data, not tallies), and so is every attribute that
transformers' own Trainer classes assign: those are the loop's state and switches (``model_accepts_loss_kwargs``,
which the loss guard sets part-way through the first step; put back on one rank only, it made that rank gather
item counts the others did not: a hang), not tallies of a subclass.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import sys
from collections.abc import Mapping

PLAIN = (int, float, str, bool, bytes, type(None))
MAX_ITEMS = 100_000  # a tally, not a dataset: larger containers are not copied


def _is_plain(value, budget: list[int]) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, Mapping):
        return all(_is_plain(k, budget) and _is_plain(v, budget) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_plain(v, budget) for v in value)
    return False


@functools.cache
def _assigned_by_library(cls: type) -> frozenset[str]:
    """``self.NAME = ...`` in the source modules of the classes in ``cls``'s MRO that transformers defines."""
    names: set[str] = set()
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        if module is None or not base.__module__.startswith("transformers."):
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"self\.(\w+)\s*(?::[^=]+)?=(?!=)", source))
    return frozenset(names)


def take(obj) -> dict:
    """A deep copy of each plain-data attribute of ``obj`` that is not transformers' own Trainer state."""
    saved = {}
    library = _assigned_by_library(type(obj))
    for name, value in vars(obj).items():
        if name in library or name.startswith("_hf_gpu_train"):
            continue
        if isinstance(value, PLAIN):
            saved[name] = value
        elif isinstance(value, (Mapping, list, tuple, set)) and _is_plain(value, [MAX_ITEMS]):
            saved[name] = copy.deepcopy(value)
    return saved


def put_back(obj, saved: dict) -> None:
    """Every attribute ``take`` copied gets its copied value again (a fresh copy, so ``saved`` can be reused)."""
    for name, value in saved.items():
        setattr(obj, name, value if isinstance(value, PLAIN) else copy.deepcopy(value))
