"""The fine-tuning run's checkpoints: the label map written into each before its completion marker, and checked on
resume and warm start. The marker and the resume from the last complete checkpoint live in
``faults/checkpoint_marker.py`` (anyone's Trainer gets them through ``guard_saves``); this run installs them the same
way (``run.finetune``: ``guard_saves(trainer, FINETUNE_WORDS, before_marker=label_map_writer(...))``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..faults.checkpoint_marker import (  # noqa: F401 (the names this run's modules and tests use)
    COMPLETE_MARKER,
    SET_ASIDE_DIR,
    checkpoints,
    is_complete,
    is_main_process,
    last_complete_checkpoint,
)
from .config import ConfigError

LABEL_MAP = "label_map.json"


def label_map_writer(label_names: list[str]):
    """What the run adds to each checkpoint before its marker: the labels it was trained with."""
    def write(checkpoint: Path) -> None:
        (checkpoint / LABEL_MAP).write_text(json.dumps(label_names))

    return write


def check_label_map(folder: str | Path, label_names: list[str], what: str) -> None:
    """A saved label map that differs from this data's labels is an error, not a silent remap."""
    path = Path(folder) / LABEL_MAP
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    if saved != label_names:
        raise ConfigError(f"{what} {folder} was trained with labels {saved}, this data has {label_names}: "
                          "use another output_dir (or resume=never with a new one), or start from the base model")


def write_label_map(output_dir: str | Path, label_names: list[str]) -> None:
    if is_main_process():
        path = Path(output_dir) / LABEL_MAP
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(label_names))
