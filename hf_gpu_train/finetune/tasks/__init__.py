"""The fine-tuning tasks, one folder each, registered by name (``base.register_task``); ``task_for(cfg.task)``.

Built in: ``text_classification``, ``image_classification``, ``language_modeling`` (``causal-lm``). A new task is a
new folder here, imported below: one line."""

# isort: off
# each folder registers its task; in this order a config error lists them (the default task first)
from . import text_classification  # noqa: F401
from . import image_classification  # noqa: F401
from . import language_modeling  # noqa: F401

# isort: on
from .base import TASKS, PlannerInput, Prepared, Task, register_task, task_for, task_names

__all__ = ["TASKS", "PlannerInput", "Prepared", "Task", "register_task", "task_for", "task_names"]
