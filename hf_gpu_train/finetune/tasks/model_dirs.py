"""Where a transformers model comes from (the text classifier's and the causal LM's): a shipped name
(``builtin:minilm``), a local directory or a hub id; and the cheap check, run before the data is read: a wrong
``model=`` costs a second, not a pass over the data.

A local model directory must exist and hold a ``config.json``; a hub id can only be checked by loading it. (The
vision counterpart is ``image_classification/pretrained.resolve_vision_weights``: the timm name exists, the starting
weights can exist.)
"""

from __future__ import annotations

from pathlib import Path

from ..builtin import minilm_path
from ..config import ConfigError


def resolve_model_path(name: str) -> str:
    if name == "builtin:minilm":
        return minilm_path()
    looks_local = name.startswith(("/", ".", "~")) or Path(name).suffix in (".json",) or name.count("/") > 1
    if looks_local and not Path(name).expanduser().exists():
        raise ConfigError(f"model={name!r} does not exist: give a local model directory (with config.json) or a hub id")
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def check_text_model(model: str) -> Path | None:
    """The local model directory, checked; None for a hub id."""

    path = Path(resolve_model_path(model))  # raises for a local path that does not exist
    if not path.exists():
        return None  # a hub id
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(f"model={model!r}: {path} holds no config.json, so it is not a transformers model directory: give "
                          "the directory save_pretrained() wrote (config.json, weights, tokenizer) or a hub id")
    return path

