"""The text model's cheap check, run before the data is read: a wrong ``model=`` costs a second, not a pass over the data.

A local model directory must exist and hold a ``config.json``; a hub id can only be checked by loading it. (The
vision counterpart is ``pretrained.resolve_vision_weights``: the timm name exists, the starting weights can exist.)
"""

from __future__ import annotations

from pathlib import Path

from .config import ConfigError, FinetuneConfig
from .text import resolve_model_path


def check_text_model(cfg: FinetuneConfig) -> Path | None:
    """The local model directory, checked; None for a hub id."""

    path = Path(resolve_model_path(cfg.model))  # raises for a local path that does not exist
    if not path.exists():
        return None  # a hub id
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ConfigError(f"model={cfg.model!r}: {path} holds no config.json, so it is not a transformers model directory: give "
                          "the directory save_pretrained() wrote (config.json, weights, tokenizer) or a hub id")
    return path

