"""What a fine-tuning task is to the run, and the registry of tasks (timm's ``register_model`` / ``create_model``).

A task says, in its own folder, what its keys are (``options.py``: a ``TaskOptions`` dataclass), how its data loads,
how its model is built, how its rows are collated, how it is evaluated and what it reports, and it resolves what
depends on it: ``method=auto``, the default learning rate, the memory levers a model of its kind can take, the
planner's input shape. The run (``finetune/run.py``), the config loader, the plan scoping and ``tune`` ask the task;
none of them branches on its name or its modality. Adding a task (token classification, audio) is a folder with a
``Task`` subclass decorated with ``@register_task``, and one line importing it in ``tasks/__init__.py``.

A task's ``task.py`` and ``options.py`` import no torch: the config loader and ``hf-gpu-train tune``'s command read a
task before any training process exists. What it needs of torch, transformers or timm is in its other modules, which
import at their top; ``task.py`` reaches them from the methods that build (one marked import each).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from ...errors import ConfigError
from ...levers.from_config import check_levers
from ..config import TaskOptions

LORA_RANK = 16  # the planner's adapter rank for a run that trains none (it plans full fine-tuning then)


class PlannerInput(NamedTuple):
    """What the memory planner reads of a run (``hf-gpu-train config``'s ``--seq-len``, ``--image-size``, ``--method``,
    ``--lora-rank``): the task's to say, from its keys."""

    seq_len: int | None
    image_size: int | None
    method: str
    lora_rank: int = LORA_RANK


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
    """The defaults are a classifier's of token sequences; a task overrides what differs."""

    name: ClassVar[str] = ""
    options: ClassVar[type[TaskOptions]] = TaskOptions  # the task's own keys
    layered: ClassVar[bool] = True  # a stack of transformer layers: checkpoint_layers' policies apply (timm: every block)
    classifier: ClassVar[bool] = True  # one label per example: accuracy and macro F1 from the logits
    methods: ClassVar[tuple[str, ...]] = ("full",)  # the fine-tuning methods it trains; the first is method=auto's
    packs: ClassVar[bool] = False  # its rows may be packed (padding-free), a setting tune can try
    rows_word: ClassVar[str] = "examples"  # what a validation row is called in the run's last line
    throughput_unit: ClassVar[str] = "tokens/s"  # what tune ranks candidates by
    evaluates_in_dataset_order: ClassVar[bool] = False  # the validation set is sorted (less padding): keep its order

    def resolve(self, cfg) -> None:
        """What depends on the task, resolved in ``cfg`` before anything loads (``loading.resolve``): ``method=auto`` as
        the task's first method, a method it does not train refused, its keys against the run's (``check_config``), the
        memory levers against a model of its kind, and the learning rate when none is set and the model need not be
        built for it. The run record then holds what trains."""
        if cfg.method == "auto":
            cfg.method = self.methods[0]
        if cfg.method not in self.methods:
            raise ConfigError(self.method_refused(cfg.method))
        self.check_config(cfg)
        check_levers(cfg.lever_keys(), layered=self.layered, attention=self.attention(cfg))
        if cfg.learning_rate is None:  # a pretrained classifier's stays None until its model is built (learning_rates.py)
            cfg.learning_rate = self.default_learning_rate(cfg)

    def method_refused(self, method: str) -> str:
        return f"method={method!r}: task={self.name} trains with {', '.join(self.methods)}"

    def attention(self, cfg) -> str | None:
        """The attention kernel the model runs (what the selective checkpointing policies must keep); None: the default."""
        return None

    def planner_input(self, cfg) -> PlannerInput:
        """What the memory planner reads of this run."""
        return PlannerInput(seq_len=cfg.max_length, image_size=None, method="full")

    def check_config(self, cfg) -> None:
        """Refuse this task's keys against the run's before anything loads (a ConfigError naming the key and the fix);
        each key alone is checked by its options (``TaskOptions.check``)."""

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
        return not packed

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

    def evaluation_line(self, model, cfg, rows: int, classes: int) -> str | None:
        """What its evaluation keeps of each batch, said at the start (``plan/evaluation_memory.py``); None: nothing said."""
        return None

    def planner_model_here(self, cfg) -> tuple[str | None, str | None]:
        """(the model as the planner reads it here, before anything is downloaded or converted; None and why not)."""
        return cfg.model, None

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
