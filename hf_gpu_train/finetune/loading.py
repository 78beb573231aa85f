"""A recipe file and ``key=value`` overrides -> the run's config, resolved by its task.

The keys are the run's (``config.FinetuneConfig``) and each registered task's own (``TaskOptions`` in its folder):
a key of neither is an error naming the nearest valid key; a key of another task than the one the recipe names is an
error naming that task (it would change nothing). What depends on the task (``method=auto``, the default learning
rate, the memory levers a model of its kind can take, its own keys' checks) is the task's to resolve
(``Task.resolve``), here: ``config.py`` knows no task, and the tasks import the config at their top.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from ..errors import UsageError
from .config import RUN_KEYS, ConfigError, FinetuneConfig, coerce, key_types, yaml_value
from .recipe_names import resolve_recipe, shipped_files
from .tasks import TASKS, task_for

DEFAULT_TASK = FinetuneConfig.task


def _task_keys() -> dict[str, list[str]]:
    """Each task's own key -> the tasks that have it."""
    owners: dict[str, list[str]] = {}
    for name, task in TASKS.items():
        for key in key_types(task.options):
            owners.setdefault(key, []).append(name)
    return owners


def _unknown(key: str) -> ConfigError:
    known = [*RUN_KEYS, *_task_keys()]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(known)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _kind(key: str):
    """The type of ``key``: the run's key's, or the first task's that has it (tasks that share a key agree on it)."""
    run = key_types(FinetuneConfig)
    if key in run:
        return run[key]
    for task in TASKS.values():
        kinds = key_types(task.options)
        if key in kinds:
            return kinds[key]
    raise _unknown(key)


def recipe_file(value: str | Path) -> Path:
    """The recipe ``value`` means, as ``--config`` reads it: a file, or a shipped recipe's name (``minilm_text_demo``);
    anything else a ConfigError naming the value, the shipped names and the nearest one (``recipe_names``)."""
    try:
        return Path(resolve_recipe(str(value), option="config"))
    except UsageError as error:
        raise ConfigError(str(error)) from None


def read_config_values(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The values a recipe (a file, or a shipped recipe's name) and ``key=value`` overrides set, converted to the keys'
    types."""
    values: dict[str, Any] = {}
    if path is not None:
        path = recipe_file(path)
        try:
            data = yaml_value(path.read_text()) or {}
        except FileNotFoundError:  # gone since it was found
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold key: value pairs")
        for key, raw in data.items():
            values[key] = coerce(key, raw, _kind(key))
        values.update(shipped_files(path, values))  # a shipped recipe's data, wherever the package is installed
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep:
            raise ConfigError(f"override {item!r}: write key=value (e.g. learning_rate=3e-5)")
        values[key] = coerce(key, raw, _kind(key))
    return values


def config_from_values(values: dict[str, Any]) -> FinetuneConfig:
    """The run's keys to the config, the task's to its options; a key of another task is an error naming it."""
    task = task_for(values.get("task", DEFAULT_TASK))
    own = set(key_types(task.options))
    run = {k: v for k, v in values.items() if k in RUN_KEYS}
    options = {k: v for k, v in values.items() if k in own and k not in RUN_KEYS}
    other = sorted(set(values) - set(run) - set(options))
    if other:
        owners = _task_keys()
        named = [f"{k} (task={' or '.join(owners[k])})" if k in owners else k for k in other]
        raise ConfigError(f"{', '.join(named)}: not a key of task={task.name}: drop it, or set the task it belongs to")
    return FinetuneConfig(**run, options=task.options(**options))


def resolve(cfg: FinetuneConfig) -> FinetuneConfig:
    """The run's keys checked, then what depends on the task resolved by the task (``Task.resolve``)."""
    cfg.validate()
    task_for(cfg.task).resolve(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> FinetuneConfig:
    return resolve(config_from_values(read_config_values(path, overrides)))


def load_config_and_keys(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[FinetuneConfig, frozenset]:
    """The config, and the keys the recipe or the command line set (they win over a launch plan's values)."""
    values = read_config_values(path, overrides)
    return resolve(config_from_values(values)), frozenset(values)
