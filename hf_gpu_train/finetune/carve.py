"""Carving a validation split out of the training data when none is given: per class, seeded, every class on both sides.

Why not ``datasets``' ``train_test_split(stratify_by_column=...)``: it sizes the validation set over the whole data
first and shares it among the classes after. With 4 rows of 2 classes at 20% it asks for 1 validation row for 2
classes and raises a ``datasets`` traceback; with classes of 100, 2 and 2 rows it silently leaves one rare class
out of validation. Here each class gives ``round(rows * validation_fraction)`` of its rows to validation, at least
1 and at most all but 1, so every class is trained on and measured. That needs 2 rows in every class; fewer is a
clear error naming the class and the way out. When keeping every class on both sides moves the split away from
``validation_fraction``, the plan carries a note saying so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ConfigError

MIN_ROWS_PER_CLASS = 2  # 1 to train on, 1 to validate with
NOTE_THRESHOLD = 0.02  # say so when the carved share is this far from validation_fraction


@dataclass(frozen=True)
class CarvePlan:
    validation_per_class: dict[str, int]  # class name -> validation rows
    total_rows: int
    note: str | None  # what the user should know (the split is not the fraction asked for), None when it is

    @property
    def validation_rows(self) -> int:
        return sum(self.validation_per_class.values())


def plan_carve(counts: dict[str, int], fraction: float, label_column: str) -> CarvePlan:
    """How many rows of each class go to validation; ConfigError when a class has too few rows to appear on both sides."""
    small = {name: n for name, n in counts.items() if 0 < n < MIN_ROWS_PER_CLASS}
    if small:
        name, rows = next(iter(small.items()))
        others = f" (and {len(small) - 1} more class(es))" if len(small) > 1 else ""
        raise ConfigError(
            f"label_column={label_column!r}: class {name!r} has {rows} row{'s' if rows != 1 else ''}{others}; carving a validation "
            f"split needs at least {MIN_ROWS_PER_CLASS} rows in every class (1 to train, 1 to validate): add rows, or give "
            "validation_file= (or validation_split=) so that nothing is carved")
    per_class = {name: min(n - 1, max(1, math.floor(n * fraction + 0.5))) for name, n in counts.items() if n > 0}
    total = sum(counts.values())
    carved = sum(per_class.values())
    note = None
    if abs(carved / total - fraction) > NOTE_THRESHOLD:
        note = (f"validation carved from the training data: {carved} of {total} rows ({carved / total:.0%}, not "
                f"validation_fraction={fraction:g}), so that each of the {len(per_class)} classes keeps at least 1 training "
                "and 1 validation row; give validation_file= for a validation set of your own")
    return CarvePlan(validation_per_class=per_class, total_rows=total, note=note)


def carve(ds, plan: CarvePlan, label_names: list[str], seed: int):
    """(train, validation) of ``ds`` (with an int ``labels`` column) by the plan; both shuffled with ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.asarray(ds["labels"])
    train_idx, val_idx = [], []
    for class_id, name in enumerate(label_names):
        rows = rng.permutation(np.flatnonzero(labels == class_id))
        take = plan.validation_per_class.get(name, 0)
        val_idx.append(rows[:take])
        train_idx.append(rows[take:])
    train = rng.permutation(np.concatenate(train_idx)) if train_idx else np.array([], dtype=int)
    validation = rng.permutation(np.concatenate(val_idx)) if val_idx else np.array([], dtype=int)
    return ds.select(train.tolist()), ds.select(validation.tolist())
