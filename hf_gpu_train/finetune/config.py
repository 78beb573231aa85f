"""``FinetuneConfig``: one dataclass, YAML file plus ``key=value`` overrides, defaults in one place.

Unknown keys are errors naming the nearest valid key; every value is checked before a model is
loaded; the resolved config is written into ``output_dir`` (``finetune_config.yaml``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, UsageError  # noqa: F401 (ConfigError: the finetune names it from here)
from ..levers.from_config import check_levers
from .learning_rates import FINETUNE_LEARNING_RATE  # noqa: F401 - the reference rate, imported from here by callers
from .recipe_names import shipped_files
from .tasks.base import task_for

METHODS = ("auto", "full", "lora", "qlora")  # auto: the task's first method (lora for causal-lm, full for the classifiers)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
STRATEGIES = ("auto", "no", "steps", "epoch")  # auto: every checkpoint_minutes of training, and at the end
# learning_rate when the user sets none. A classifier's depends on the model it trains (finetune/learning_rates.py,
# resolved once the model is built). Training from random weights (pretrained=false) needs far larger steps: 1e-3 is
# Adam's own default step size (Kingma & Ba 2015; torch.optim.AdamW's default). Measured on scikit-learn digits with
# EfficientNet-Lite0 from scratch (recipes/efficientnet_lite0_digits.yaml): see docs/finetuning.md.
SCRATCH_LEARNING_RATE = 1e-3


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with only true/false as booleans: ``eval_strategy: no`` means "no", not False (YAML 1.1)."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


@dataclass
class FinetuneConfig:
    # what to train
    task: str = "text-classification"
    model: str = "builtin:minilm"  # local HF dir, hub id, timm name (timm/NAME), builtin:minilm, builtin:efficientnet_lite0
    pretrained: bool = True  # vision: start from pretrained weights (hub, pretrained_weights or builtin); false: from scratch
    pretrained_weights: str | None = None  # vision: a local .safetensors/.pth file with the timm model's pretrained weights
    # data
    dataset: str | None = "builtin:python-docs"  # builtin:python-docs, builtin:text, builtin:digits, a hub id, a local dataset dir, or imagefolder:DIR
    dataset_config: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    train_split: str = "train"
    validation_split: str | None = None  # None: "validation" or "test" if present, else carved
    validation_fraction: float = 0.2
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    image_column: str = "image"
    max_length: int = 128
    image_size: int = 224
    augmentation: dict[str, Any] = field(default_factory=dict)  # vision: timm create_transform kwargs for training
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    # evaluate the model as loaded before training, for the comparison the run ends with (baseline_results.json):
    # auto: when the validation set has at most 4,000 rows, and at most a quarter of the rows the training processes (or
    # 256), and the model is not sharded (finetune/evaluate_before.py)
    evaluate_before: bool | str = "auto"
    # schedule
    output_dir: str = "outputs/run"
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int | None = None
    global_batch_size: int | None = None  # gradient accumulation is derived from it
    learning_rate: float | None = None  # None: by the model (finetune/learning_rates.py), the method (causal-lm), or from scratch
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
    checkpoint_minutes: float = 30.0  # auto: evaluate and save a checkpoint every this many minutes of training
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
    # causal language models (task=causal-lm; hf_gpu_train/finetune/causal_lm/)
    method: str = "auto"  # auto (lora for causal-lm, full otherwise) | full | lora | qlora (4-bit NF4 base, CUDA only)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0  # peft's default; 0 skips the dropout copy of every adapted layer's input
    lora_target_modules: str = "all-linear"  # every linear layer but the output head, or names: q_proj,v_proj
    merge_adapter: bool = False  # also save the base model with the adapter merged in, in output_dir/merged
    messages_column: str = "messages"  # chat data: a list of {role, content}, rendered with the tokenizer's chat template
    prompt_column: str = "prompt"  # prompt + completion data; plain text data uses text_column
    completion_column: str = "completion"
    completion_only_loss: bool = True  # loss on the completion / assistant turns only; false: on every token
    chat_template: str | None = None  # a Jinja file replacing (or supplying) the tokenizer's chat template
    packing: bool | str = "auto"  # auto: padding-free packing where the model's attention keeps examples apart
    chunked_lm_loss: bool | str = "auto"  # auto: the LM head and loss in chunks of labelled rows where exact (lm_head_loss.py);
    # liger | cce: Liger's or Cut Cross-Entropy's fused kernel instead, on CUDA, when installed
    attn_implementation: str | None = None  # None: transformers' default (sdpa); eager, flash_attention_2, ...
    generation_samples: int = 3  # held-out prompts generated before and after training (0: none)
    generation_max_new_tokens: int = 64

    def validate(self) -> FinetuneConfig:
        def bad(key: str, fix: str) -> ConfigError:
            return ConfigError(f"{key}={getattr(self, key)!r}: {fix}")

        task = task_for(self.task)
        if self.precision not in PRECISIONS:
            raise bad("precision", f"use one of {', '.join(PRECISIONS)}")
        for key in ("per_device_train_batch_size", "max_length", "image_size", "logging_steps"):
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
        self._check_pretrained()
        self._check_method()
        self._check_memory_levers()
        if self.learning_rate is None:  # a pretrained classifier's stays None until its model is built (learning_rates.py)
            if self.trains_from_scratch:
                self.learning_rate = SCRATCH_LEARNING_RATE
            else:
                self.learning_rate = task.default_learning_rate(self)
        if not 0 <= self.warmup_ratio < 1:
            raise bad("warmup_ratio", "must be in [0, 1)")
        for key in ("eval_strategy", "save_strategy"):
            if getattr(self, key) not in STRATEGIES:
                raise bad(key, f"use one of {', '.join(STRATEGIES)}")
        if self.save_strategy == "steps" and not self.save_steps:
            raise bad("save_steps", "save_strategy=steps needs save_steps")
        if self.eval_strategy == "steps" and not self.eval_steps:
            raise bad("eval_steps", "eval_strategy=steps needs eval_steps")
        if self.checkpoint_minutes <= 0:
            raise bad("checkpoint_minutes", "must be positive (save_strategy=no to save no checkpoint)")
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
        return self

    @property
    def trains_from_scratch(self) -> bool:
        return task_for(self.task).images and not self.pretrained

    def _check_method(self) -> None:
        """``method=auto`` is resolved here (the task's first method), so the run record holds what trains; then the
        task's own keys (``tasks/``)."""
        task = task_for(self.task)
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r}: use one of {', '.join(METHODS)}")
        if self.method == "auto":
            self.method = task.methods[0]
        if self.method not in task.methods:
            raise ConfigError(f"method={self.method!r}: LoRA and QLoRA are for task=causal-lm; classifiers train fully "
                              "(method=full)" if task.classifier else
                              f"method={self.method!r}: task={self.task} trains with {', '.join(task.methods)}")
        task.check_config(self)

    def _check_memory_levers(self) -> None:

        check_levers(self, images=task_for(self.task).images)

    def _check_pretrained(self) -> None:
        vision = task_for(self.task).images
        if not self.pretrained and not vision:
            raise ConfigError("pretrained=false: text models always start from the weights in model= (a directory or hub id); "
                              "remove pretrained=false")
        if self.pretrained_weights is None:
            return
        if not vision:
            raise ConfigError(f"pretrained_weights={self.pretrained_weights!r} is for task=image-classification (timm models); "
                              "text models load their weights from model=DIR")
        if not self.pretrained:
            raise ConfigError(f"pretrained_weights={self.pretrained_weights!r} with pretrained=false: drop pretrained=false to "
                              "fine-tune from that file, or drop pretrained_weights to train from scratch")
        if not Path(self.pretrained_weights).expanduser().is_file():
            raise ConfigError(f"pretrained_weights={self.pretrained_weights!r} does not exist: give the path of a .safetensors "
                              "or .pth file, or pretrained=false to train from scratch")


_FIELDS = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
_HINTS = typing.get_type_hints(FinetuneConfig)


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(_FIELDS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(_FIELDS)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _coerce(key: str, raw: Any) -> Any:
    """A YAML or command-line value converted to the field's type."""
    kind = _HINTS[key]
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
            parsed = _yaml(text) if text else text
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> FinetuneConfig:
    return FinetuneConfig(**read_config_values(path, overrides)).validate()


def load_config_and_keys(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[FinetuneConfig, frozenset]:
    """The config, and the keys the recipe or the command line set (they win over a launch plan's values)."""
    values = read_config_values(path, overrides)
    return FinetuneConfig(**values).validate(), frozenset(values)


def read_config_values(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The values a recipe file and ``key=value`` overrides set, converted to the fields' types."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = _yaml(path.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist (see recipes/ for examples)") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold key: value pairs")
        for key, raw in data.items():
            if key not in _FIELDS:
                raise _unknown(key)
            values[key] = _coerce(key, raw)
        values.update(shipped_files(path, values))  # a shipped recipe's data, wherever the package is installed
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep:
            raise ConfigError(f"override {item!r}: write key=value (e.g. learning_rate=3e-5)")
        if key not in _FIELDS:
            raise _unknown(key)
        values[key] = _coerce(key, raw)
    return values


def save_resolved(config: FinetuneConfig, output_dir: str | Path) -> Path:
    path = Path(output_dir) / "finetune_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# resolved hf_gpu_train finetune config of this run\n" + yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    return path
