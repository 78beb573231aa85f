"""Checkpoints that can be trusted: a marker written after the Trainer finished saving, resume
from the last complete one, and the label map checked on resume and warm start.

``transformers.trainer_utils.get_last_checkpoint`` takes the highest-numbered ``checkpoint-N``
whether or not its save finished; a run killed mid-save would then resume from half a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from transformers import TrainerCallback

from .config import ConfigError

COMPLETE_MARKER = "hf_gpu_train_complete.json"
# Outside the Trainer's ``checkpoint-*`` namespace: its rotation (save_total_limit) globs ``checkpoint-*`` in
# output_dir, so a set-aside copy named ``checkpoint-N.something`` there would be counted, and deleted, or make
# the Trainer delete a complete checkpoint instead.
SET_ASIDE_DIR = "incomplete-checkpoints"
LABEL_MAP = "label_map.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-N directories, newest (highest N) first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True)


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / COMPLETE_MARKER).is_file() and (checkpoint / "trainer_state.json").is_file()


def last_complete_checkpoint(output_dir: str | Path, set_aside_incomplete: bool = True) -> Path | None:
    """The newest complete checkpoint. Newer incomplete ones are moved (never deleted) on the main process into
    ``output_dir/incomplete-checkpoints/``, where the Trainer's checkpoint rotation does not see them."""
    for checkpoint in checkpoints(output_dir):
        if is_complete(checkpoint):
            return checkpoint
        if set_aside_incomplete and is_main_process():
            aside = checkpoint.parent / SET_ASIDE_DIR
            aside.mkdir(exist_ok=True)
            checkpoint.rename(aside / f"{checkpoint.name}.{int(time.time() * 1000)}")
    return None


class CompleteCheckpointMarker(TrainerCallback):
    """Writes the marker after ``Trainer._save_checkpoint`` has written everything else."""

    def __init__(self, label_names: list[str]):
        self.label_names = label_names

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                (checkpoint / LABEL_MAP).write_text(json.dumps(self.label_names))
                (checkpoint / COMPLETE_MARKER).write_text(json.dumps({"global_step": state.global_step, "time": time.time()}))
        return control


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
