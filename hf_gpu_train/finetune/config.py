"""``FinetuneConfig``: the run's keys, every task's alike, and a task's own keys (``TaskOptions``, subclassed in each
task's folder); defaults in one place, each value checked before a model is loaded; the resolved config is written into
``output_dir`` (``finetune_config.yaml``, flat as a recipe). Reading a recipe file and ``key=value`` overrides, and the
task's resolution of what depends on it, are ``loading.py``'s: this module knows no task.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..levers.from_config import LeverKeys

METHODS = ("auto", "full", "lora", "qlora")  # auto: the task's first method (lora for causal-lm, full for the classifiers)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
STRATEGIES = ("auto", "no", "steps", "epoch")  # auto: every checkpoint_minutes of training, and at the end


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with only true/false as booleans: ``eval_strategy: no`` means "no", not False (YAML 1.1)."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def yaml_value(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


@dataclass(frozen=True)
class DataKeys:
    """Where a run's rows come from, how its validation split is found or carved, and how many rows it takes
    (``FinetuneConfig.data_keys``): what the data stages read of a run, every task's alike."""

    dataset: str | None = "builtin:python-docs"
    dataset_config: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    train_split: str = "train"
    validation_split: str | None = None
    validation_fraction: float = 0.2
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    seed: int = 42


@dataclass
class TaskOptions:
    """A task's own keys. Each task subclasses this in its folder (``tasks/<task>/options.py``); the loader
    (``loading.py``) routes a recipe's keys to the task it names, and the task's stages are given this object, not the
    whole config. The base holds none."""

    def check(self) -> None:
        """Refuse a bad value here, before anything loads (a ConfigError naming the key and the fix)."""


@dataclass
class FinetuneConfig:
    """The run's keys, every task's alike; the task's own keys are ``options`` (a ``TaskOptions`` of the task's class),
    also read as attributes (``cfg.max_length``: the record of a run and a user's script read them so). A recipe writes
    both flat, ``key: value``."""

    # what to train
    task: str = "text-classification"
    model: str = "builtin:minilm"  # local HF dir, hub id, timm name (timm/NAME), builtin:minilm, builtin:efficientnet_lite0
    method: str = "auto"  # auto: the task's first method (lora for causal-lm, full for the classifiers) | full | lora | qlora
    # data
    dataset: str | None = "builtin:python-docs"  # builtin:python-docs, builtin:text, builtin:digits, a hub id, a local dataset dir, or imagefolder:DIR
    dataset_config: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    train_split: str = "train"
    validation_split: str | None = None  # None: "validation" or "test" if present, else carved
    validation_fraction: float = 0.2
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    # evaluate the model as loaded before training, for the comparison the run ends with (baseline_results.json):
    # on a seeded sample of 512 rows above 512; auto: when those rows are at most a quarter of the rows the training
    # processes (or 256), and the model is not sharded (finetune/evaluate_before.py)
    evaluate_before: bool | str = "auto"
    # schedule
    output_dir: str = "outputs/run"
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int | None = None
    global_batch_size: int | None = None  # gradient accumulation is derived from it
    learning_rate: float | None = None  # None: the task's (by the model, the method, or from scratch)
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "linear"
    # speed and safety
    precision: str = "auto"
    gradient_checkpointing: bool = False
    # memory levers (levers/from_config.py): which layers checkpointing covers and what they keep (all | every-N
    # | selective | selective-lean), saved activations in pinned host memory, the optimizer step inside the backward
    # (full, 1 process), freed memory given back at once (the allocator: levers/release_memory.py)
    checkpoint_layers: str = "all"
    offload_activations: bool = False
    optimizer_in_backward: bool = False
    release_memory: bool = False
    torch_compile: bool = False
    dataloader_num_workers: int | str = "auto"
    seed: int = 42
    # evaluation, checkpoints, logging
    eval_strategy: str = "auto"
    eval_steps: int | None = None
    save_strategy: str = "auto"
    save_steps: int | None = None
    # save_strategy=auto: a checkpoint every this many minutes of training; auto: the interval that minimises saving
    # plus lost work (plan/checkpoint_interval.py), from a save's measured cost and mtbf_hours (None: the default for
    # the run's GPU count)
    checkpoint_minutes: float | str = "auto"
    mtbf_hours: float | None = None
    # checkpoints staged in host memory and written while training goes on (faults/background_save.py): auto (on a
    # GPU; a CPU run's cores are all training), true, false (the Trainer's synchronous save)
    background_saves: bool | str = "auto"
    save_total_limit: int | None = 2
    logging_steps: int = 10
    resume: str = "auto"  # auto | never | PATH to a checkpoint
    report_to: str = "none"
    allow_cpu: bool = False  # train on the CPU although a GPU is visible
    telemetry: bool = True
    oom_recovery: bool = True
    # a rank without progress for this long ends the run with every rank's stacks (faults/watchdog.py): auto (10 x
    # the step time, at least 120 s; 600 s for the first step, evaluations and saves), seconds, or off
    watchdog: float | str = "auto"
    # SIGTERM / SIGUSR1 / SIGUSR2 (a scheduler's time limit, preemption or eviction): every rank stops at the next step
    # boundary, saves a complete checkpoint and exits 75; the same command resumes (faults/preemption.py)
    preemption: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # passed to TrainingArguments as they are
    # the task's own keys (tasks/<task>/options.py), set by the loader (loading.py)
    options: TaskOptions = field(default_factory=TaskOptions)

    # -- the task's keys, read and written as attributes ---------------------------------------------------------------
    def __getattr__(self, name: str):
        """Only for names that are not the run's own: a key of the task's options."""
        options = self.__dict__.get("options")
        if options is not None and not name.startswith("__") and name in _field_names(options):
            return getattr(options, name)
        raise AttributeError(f"{name!r} is not a key of task={self.__dict__.get('task')!r} (nor of every task)")

    def __setattr__(self, name: str, value) -> None:
        options = self.__dict__.get("options")
        if name not in RUN_KEYS and name != "options" and options is not None and name in _field_names(options):
            setattr(options, name, value)
        else:
            object.__setattr__(self, name, value)

    def values(self) -> dict[str, Any]:
        """Every key, flat, as a recipe writes them: the run's, then the task's."""
        run = {key: getattr(self, key) for key in RUN_KEYS}
        return {**run, **{key: getattr(self.options, key) for key in _field_names(self.options)}}

    def with_values(self, **values) -> FinetuneConfig:
        """A copy with ``values`` (the run's keys and the task's) replaced; not resolved again (``loading.resolve``)."""
        run = {k: v for k, v in values.items() if k in RUN_KEYS}
        own = {k: v for k, v in values.items() if k not in RUN_KEYS}
        unknown = set(own) - set(_field_names(self.options))
        if unknown:
            raise ConfigError(f"{', '.join(sorted(unknown))}: not a key of task={self.task!r}")
        return dataclasses.replace(self, **run, options=dataclasses.replace(self.options, **own))

    def data_keys(self) -> DataKeys:
        """Where this run's rows come from and how many it takes (the data stages' view)."""
        return DataKeys(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DataKeys)})

    def lever_keys(self) -> LeverKeys:
        """What the memory levers read of this run (``levers/from_config.py``)."""
        return LeverKeys(self.gradient_checkpointing, self.checkpoint_layers, self.offload_activations,
                         self.optimizer_in_backward, self.torch_compile, self.release_memory, self.method,
                         self.extra.get("max_grad_norm"))

    def validate(self) -> FinetuneConfig:
        """The run's own keys, every task alike (the task's keys and what depends on the task: ``Task.resolve``)."""
        def bad(key: str, fix: str) -> ConfigError:
            return ConfigError(f"{key}={getattr(self, key)!r}: {fix}")

        if self.precision not in PRECISIONS:
            raise bad("precision", f"use one of {', '.join(PRECISIONS)}")
        if self.method not in METHODS:
            raise bad("method", f"use one of {', '.join(METHODS)}")
        for key in ("per_device_train_batch_size", "logging_steps"):
            if getattr(self, key) < 1:
                raise bad(key, "must be at least 1")
        if self.evaluate_before not in (True, False, "auto"):
            raise bad("evaluate_before", "use auto, true or false")
        if self.per_device_eval_batch_size is not None and self.per_device_eval_batch_size < 1:
            raise bad("per_device_eval_batch_size", "must be at least 1")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise bad("global_batch_size", "must be at least 1 (or leave it out)")
        if self.max_steps == 0 or self.max_steps < -1:
            raise bad("max_steps", "use a positive number of steps, or -1 to train for num_train_epochs")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise bad("num_train_epochs", "must be positive (or set max_steps)")
        if not 0 < self.validation_fraction < 1:
            raise bad("validation_fraction", "must be between 0 and 1")
        if self.learning_rate is not None and self.learning_rate <= 0:
            raise bad("learning_rate", "must be positive")
        if not 0 <= self.warmup_ratio < 1:
            raise bad("warmup_ratio", "must be in [0, 1)")
        for key in ("eval_strategy", "save_strategy"):
            if getattr(self, key) not in STRATEGIES:
                raise bad(key, f"use one of {', '.join(STRATEGIES)}")
        if self.save_strategy == "steps" and not self.save_steps:
            raise bad("save_steps", "save_strategy=steps needs save_steps")
        if self.eval_strategy == "steps" and not self.eval_steps:
            raise bad("eval_steps", "eval_strategy=steps needs eval_steps")
        if isinstance(self.checkpoint_minutes, str) and self.checkpoint_minutes != "auto":
            raise bad("checkpoint_minutes", "use auto or a number of minutes")
        if not isinstance(self.checkpoint_minutes, str) and self.checkpoint_minutes <= 0:
            raise bad("checkpoint_minutes", "must be positive (save_strategy=no to save no checkpoint)")
        if isinstance(self.background_saves, str) and self.background_saves != "auto":
            raise bad("background_saves", "use auto, true or false")
        if self.mtbf_hours is not None and self.mtbf_hours <= 0:
            raise bad("mtbf_hours", "must be a positive number of hours between failures (or unset: the default)")
        if isinstance(self.watchdog, str) and self.watchdog not in ("auto", "off"):
            raise bad("watchdog", "use auto, off or a number of seconds")
        if isinstance(self.watchdog, float) and self.watchdog <= 0:
            raise bad("watchdog", "must be > 0 seconds (or off)")
        if isinstance(self.dataloader_num_workers, str) and self.dataloader_num_workers != "auto":
            raise bad("dataloader_num_workers", "use auto or a number")
        if isinstance(self.dataloader_num_workers, int) and self.dataloader_num_workers < 0:
            raise bad("dataloader_num_workers", "must be >= 0")
        if self.dataset is None and self.train_file is None:
            raise ConfigError("no data: set dataset (e.g. builtin:text) or train_file")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise bad("resume", "use auto, never, or the path of a checkpoint directory that exists")
        self.options.check()
        return self


def _field_names(options) -> tuple[str, ...]:
    """The keys of a config dataclass or of one of its objects."""
    return tuple(f.name for f in dataclasses.fields(options))


RUN_KEYS = tuple(f.name for f in dataclasses.fields(FinetuneConfig) if f.name != "options")


def key_types(cls) -> dict[str, Any]:
    """The type of each key of a config dataclass (the run's, or a task's options)."""
    return {name: kind for name, kind in typing.get_type_hints(cls).items() if name in _field_names(cls)}


def coerce(key: str, raw: Any, kind) -> Any:
    """A YAML or command-line value converted to the key's type."""
    is_union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    options = [a for a in typing.get_args(kind) if a is not type(None)] if is_union else [kind]
    nullable = is_union and type(None) in typing.get_args(kind)
    if raw is None and nullable:  # YAML's null: finetune_config.yaml holds them
        return None
    if isinstance(raw, str):
        text = raw.strip()
        if text.lower() in ("none", "null", "~") and nullable:
            return None
        if str in options and not any(o in (int, float, bool) for o in options):
            return text
        try:
            parsed = yaml_value(text) if text else text
        except yaml.YAMLError:
            parsed = text
        raw = text if parsed is None else parsed
    for option in options:
        if option is bool and isinstance(raw, bool):
            return raw
        if option is int and isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if option is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if option is float and isinstance(raw, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(raw)
            except ValueError:
                pass
        if option is str and raw is not None and not isinstance(raw, (dict, list)):
            return str(raw)
        if typing.get_origin(option) is dict and isinstance(raw, dict):
            return raw
    raise ConfigError(f"{key}={raw!r}: expected {' or '.join(getattr(o, '__name__', str(o)) for o in options)}")


def save_resolved(config: FinetuneConfig, output_dir: str | Path) -> Path:
    path = Path(output_dir) / "finetune_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# resolved hf_gpu_train finetune config of this run\n" + yaml.safe_dump(config.values(), sort_keys=False))
    return path
