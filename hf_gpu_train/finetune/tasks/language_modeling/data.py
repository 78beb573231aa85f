"""The raw rows of a causal-LM run: loaded, split, their form recognised, before any model is loaded.

Three forms, recognised from the columns of the train split in this order (the first that is there wins):

- chat: ``messages_column`` (default ``messages``), a list of ``{"role", "content"}`` per row, rendered with the
  tokenizer's chat template; the loss is on the assistant turns;
- prompt + completion: ``prompt_column`` and ``completion_column`` (strings, or lists of messages: then the
  conversation is ``prompt + completion`` and the loss is on the completion's messages);
- plain text: ``text_column``; the loss is on every token.

The sources are the classification task's (``finetune/data.py``): files (csv, json, jsonl, parquet), a local
``datasets`` directory or a hub id. A validation split is taken from the data when it has one, else carved at
random (seeded): language-model rows have no classes to stratify by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import ConfigError, DataKeys
from ...data import find_splits, load_raw
from .options import CausalLMOptions

CHAT, PROMPT_COMPLETION, TEXT = "messages", "prompt-completion", "text"


@dataclass(frozen=True)
class Form:
    kind: str  # CHAT | PROMPT_COMPLETION | TEXT
    columns: tuple[str, ...]  # the columns it reads, in the config's names
    conversational: bool = False  # prompt + completion given as lists of messages

    @property
    def uses_chat_template(self) -> bool:
        return self.kind == CHAT or self.conversational

    def describe(self) -> str:
        names = " + ".join(self.columns)
        return f"{'conversational ' if self.conversational else ''}{self.kind} data ({names})"


@dataclass
class CausalLMData:
    """What the entry point reads from a prepared run (the classification data's shape: ``label_names`` is empty)."""

    train: object  # datasets.Dataset of raw rows (after sampling)
    validation: object
    form: Form
    source: str
    label_names: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    generation_prompts: list = field(default_factory=list)  # generation.Prompt, from the validation rows
    model_path: str | None = None  # the directory or hub id the base model came from (the QLoRA merge reloads it)


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def detect_form(ds, options: CausalLMOptions, split: str) -> Form:
    """The form of ``ds`` from its columns; a ConfigError naming the columns it has and the three forms."""
    columns = ds.column_names
    first = ds[0] if len(ds) else {}
    if options.messages_column in columns:
        if not _is_messages(first.get(options.messages_column)):
            raise ConfigError(f"messages_column={options.messages_column!r} in the {split} split does not hold lists of "
                              "{'role': ..., 'content': ...} messages: fix the data, or point messages_column at such a column")
        return Form(CHAT, (options.messages_column,))
    if options.prompt_column in columns and options.completion_column in columns:
        conversational = _is_messages(first.get(options.prompt_column)) and _is_messages(first.get(options.completion_column))
        return Form(PROMPT_COMPLETION, (options.prompt_column, options.completion_column), conversational)
    if options.text_column in columns:
        return Form(TEXT, (options.text_column,))
    raise ConfigError(
        f"no usable text column in the {split} split (its columns: {columns}): a causal LM trains on chat "
        f"{options.messages_column!r} (messages_column=NAME), {options.prompt_column!r} + {options.completion_column!r} "
        f"(prompt_column=, completion_column=) or plain {options.text_column!r} (text_column=NAME)")


def _carve(ds, fraction: float, seed: int):
    if len(ds) < 2:
        raise ConfigError(f"the train split has {len(ds)} row(s): carving a validation split needs at least 2; "
                          "add rows or give validation_file=")
    parts = ds.train_test_split(test_size=max(1, round(len(ds) * fraction)), seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def _sample(ds, limit: int | None, seed: int):
    if not limit or limit >= len(ds):
        return ds
    return ds.shuffle(seed=seed).select(range(limit))


def open_causal_lm_data(keys: DataKeys, options: CausalLMOptions) -> CausalLMData:
    """Load, split and sample the rows and recognise their form: no pass over the rows' contents."""

    raw, source = load_raw(keys)
    train, validation, needs_carve = find_splits(raw, keys)
    if len(train) == 0:
        raise ConfigError("the train split is empty")
    form = detect_form(train, options, "train")
    notes = []
    if needs_carve:
        train, validation = _carve(train, keys.validation_fraction, keys.seed)
        notes.append(f"validation carved from the training data at random: {len(validation)} of "
                     f"{len(train) + len(validation)} rows (validation_fraction={keys.validation_fraction:g})")
    elif len(validation) == 0:
        raise ConfigError("the validation split is empty: give rows, or validation_split=none to carve one")
    else:
        other = detect_form(validation, options, "validation")
        if other != form:
            raise ConfigError(f"the train split holds {form.describe()} but the validation split {other.describe()}: "
                              "give both in the same form")
    train = _sample(train, keys.max_train_samples, keys.seed)
    validation = _sample(validation, keys.max_eval_samples, keys.seed)
    return CausalLMData(train=train, validation=validation, form=form, source=source, notes=notes)
