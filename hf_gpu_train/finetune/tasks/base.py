"""What a fine-tuning task is to the run, and the registry of tasks (timm's ``register_model`` / ``create_model``).

A task says, in one module, how its data loads, how its model is built, how its rows are collated, how it is
evaluated and what it reports. The run (``finetune/run.py``), the config check, the plan scoping and ``tune`` ask the
task; none of them branches on its name. Adding a task (token classification, seq2seq) is adding a module that
subclasses ``Task`` and is decorated with ``@register_task``, then importing it in ``tasks/__init__.py``.

This module and the task modules import no torch at their top: the config check and ``hf-gpu-train tune``'s command
read a task before any training process exists. What a task needs of torch, transformers or timm it imports where it
builds (the imports inside the methods below are there for that start-up time).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import ConfigError


@dataclass
class Prepared:
    """What a task hands the run: the model, the processed splits, the collator, the tokenizer (or None), and the
    data's description (``label_names``, ``notes``, ``train``/``validation`` and what the task keeps beside them)."""

    model: Any
    train: Any
    validation: Any
    collator: Any
    processing_class: Any
    data: Any


class Task:
    """The defaults are a classifier's; a task overrides what differs."""

    name: ClassVar[str] = ""
    images: ClassVar[bool] = False  # inputs are images (timm models); else token sequences (transformers)
    classifier: ClassVar[bool] = True  # one label per example: accuracy and macro F1 from the logits
    methods: ClassVar[tuple[str, ...]] = ("full",)  # the fine-tuning methods it trains; the first is method=auto's
    packs: ClassVar[bool] = False  # its rows may be packed (padding-free), a setting tune can try
    rows_word: ClassVar[str] = "examples"  # what a validation row is called in the run's last line
    throughput_unit: ClassVar[str] = "tokens/s"  # what tune ranks candidates by
    evaluates_in_dataset_order: ClassVar[bool] = False  # the validation set is sorted (less padding): keep its order

    def check_config(self, cfg) -> None:
        """Refuse this task's bad keys before anything loads (a ConfigError naming the key and the fix)."""

    def default_learning_rate(self, cfg) -> float | None:
        """The rate when the config sets none and it need not wait for the model (None: ``learning_rate(model)``)."""
        return None

    def learning_rate(self, model) -> tuple[float, str]:
        """(rate, why) from the built model, for a config that leaves it to the model."""
        raise NotImplementedError

    def data_columns(self, cfg) -> dict[str, str]:
        """The columns every split must have, as {column: the config key that names it}."""
        return {cfg.label_column: "label_column"}

    def check_rows(self, dataset, cfg, split: str) -> None:
        """A look at every row that costs a pass (images opened); nothing by default."""

    def prepare(self, cfg, runtime, say) -> Prepared:
        """Model and data, in the order that is kind to whoever made a mistake (cheap checks first, then the model,
        then the passes over every row, once per machine)."""
        raise NotImplementedError

    def groups_by_length(self, packed: bool) -> bool:
        """Batches of rows of similar lengths (less padding); packed rows are all about max_length long."""
        return not self.images and not packed

    def confirm_model(self, model, cfg, precision: str) -> str | None:
        """A check of the model where it trains (device, precision), every rank alike: the line to print, or None."""
        return None

    def before_training(self, trainer, cfg, prepared: Prepared) -> Any:
        """Work before the first step (a causal LM's generation samples); what ``after_training`` gets back."""
        return None

    def final_metrics(self, metrics: dict) -> dict:
        """The final evaluation's metrics, with what the task derives from them (a causal LM's perplexity)."""
        return metrics

    def after_training(self, trainer, cfg, prepared: Prepared, runtime, started: Any, saving) -> None:
        """Work after the model is saved (generation samples after training, a merged adapter). ``saving`` is the
        context manager that turns a full disk into a message naming what was being written."""

    def planner_model(self, cfg) -> str:
        """The model as `hf-gpu-train config --model` takes it (a directory, a hub id or a timm name)."""
        return cfg.model


TASKS: dict[str, Task] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: the task becomes ``task=NAME`` in a config."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in TASKS and type(TASKS[cls.name]) is not cls:
        raise ValueError(f"task {cls.name!r} is registered twice ({type(TASKS[cls.name]).__name__}, {cls.__name__})")
    TASKS[cls.name] = cls()
    return cls


def task_names() -> tuple[str, ...]:
    return tuple(TASKS)


def task_for(name: str) -> Task:
    """The registered task, or a ConfigError naming the choices and the nearest one."""
    if name in TASKS:
        return TASKS[name]
    close = difflib.get_close_matches(str(name), TASKS, n=1)
    raise ConfigError(f"task={name!r}: use one of {', '.join(TASKS)}" + (f" (did you mean {close[0]!r}?)" if close else ""))
