"""Checkpoints that can be trusted, in anyone's Trainer: a completion marker written once every rank has finished
writing a checkpoint, and a resume that never picks a half-written one.

``transformers.trainer_utils.get_last_checkpoint`` takes the highest-numbered ``checkpoint-N`` whether or not its save
finished; a run that was killed, or whose disk filled up, mid-save would resume from half a checkpoint and fail in
safetensors or torch.load (or load a model without its optimizer state). Here a save (``mark_saves``, installed by
``disk_full.guard_saves``; the fine-tuning entry point installs it too) first leaves ``SAVING`` in the folder, and
once every rank has written its part, the main process writes what the caller adds (the fine-tuning run's label map),
then ``COMPLETE_MARKER``, then removes ``SAVING``.

A checkpoint is half-written when ``SAVING`` is still there, when ``trainer_state.json`` (the Trainer writes it last)
is missing, or when it has no marker in an output_dir whose other checkpoints have one. A checkpoint of a run that
never wrote markers (a Trainer that had no ``guard_saves`` then) is trusted when the Trainer finished it
(``trainer_state.json``), as the Trainer itself would. A half-written checkpoint is moved (never deleted), on the main
process, into ``output_dir/incomplete-checkpoints/``, outside the ``checkpoint-*`` names the Trainer's rotation
(``save_total_limit``) counts and deletes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("hf_gpu_train.checkpoints")

COMPLETE_MARKER = "hf_gpu_train_complete.json"
SAVING = "hf_gpu_train_saving.json"  # there from the start of a save until its marker is written
SET_ASIDE_DIR = "incomplete-checkpoints"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


_EACH_NODE = [False]  # save_on_each_node: every node's local rank 0 writes a checkpoint of its own (guard_saves sets it)


def save_on_each_node(on: bool) -> None:
    """Checkpoints are written on every node (``TrainingArguments.save_on_each_node``): each node's local rank 0 marks
    and sets aside the checkpoints of its own output_dir, not global rank 0 only (whose disk the other nodes do not see)."""
    _EACH_NODE[0] = bool(on)


def is_main_process() -> bool:
    """The process that writes this node's output_dir: global rank 0, or each node's local rank 0 under
    ``save_on_each_node``."""
    return os.environ.get("LOCAL_RANK" if _EACH_NODE[0] else "RANK", "0") == "0"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-N directories, newest (highest N) first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True)


def is_complete(checkpoint: Path) -> bool:
    """Marked complete: every rank wrote its part, then the marker was written."""
    return ((checkpoint / COMPLETE_MARKER).is_file() and (checkpoint / "trainer_state.json").is_file()
            and not (checkpoint / SAVING).exists())


def writes_markers(output_dir: str | Path) -> bool:
    """Whether the run in ``output_dir`` marks its checkpoints: one of them is marked complete. (Only complete ones
    count: they are never moved, so every rank answers alike while the main process sets half-written ones aside.)"""
    return any(is_complete(c) for c in checkpoints(output_dir))


def is_half_written(checkpoint: Path, marked: bool | None = None) -> bool:
    """``marked``: whether its output_dir's run writes markers (``writes_markers``; computed when None)."""
    if (checkpoint / SAVING).exists() or not (checkpoint / "trainer_state.json").is_file():
        return True
    if marked is None:
        marked = writes_markers(checkpoint.parent)
    return marked and not (checkpoint / COMPLETE_MARKER).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The checkpoints a resume may take, newest first."""
    marked = writes_markers(output_dir)
    return [c for c in checkpoints(output_dir) if not is_half_written(c, marked)]


def set_aside(checkpoint: Path) -> Path:
    """Move a half-written checkpoint out of the Trainer's sight (never delete it: the user decides)."""
    aside = checkpoint.parent / SET_ASIDE_DIR
    aside.mkdir(exist_ok=True)
    target = aside / f"{checkpoint.name}.{int(time.time() * 1000)}"
    try:
        checkpoint.rename(target)
    except FileNotFoundError:  # another node's writer moved it first (save_on_each_node on a shared filesystem)
        pass
    return target


def last_complete_checkpoint(output_dir: str | Path, set_aside_incomplete: bool = True,
                             moved: list[tuple[Path, Path]] | None = None) -> Path | None:
    """The newest checkpoint a resume may take. Newer half-written ones are moved (never deleted) on the main process
    into ``output_dir/incomplete-checkpoints/``; ``moved`` collects (from, to) of each. Every rank reaches the same
    answer from the files alone (a rank that lists the folder after the main process moved one simply does not see
    it): no collective."""
    marked = writes_markers(output_dir)
    for checkpoint in checkpoints(output_dir):
        if not is_half_written(checkpoint, marked):
            return checkpoint
        if set_aside_incomplete and is_main_process():
            target = set_aside(checkpoint)
            if moved is not None:
                moved.append((checkpoint, target))
    return None


def _was_set_aside(path: Path) -> bool:
    folder = path.parent / SET_ASIDE_DIR
    return folder.is_dir() and any(p.name.startswith(f"{path.name}.") for p in folder.iterdir())


def resume_point(resume, output_dir: str | Path):
    """What ``Trainer.train(resume_from_checkpoint=resume)`` should load: ``True`` becomes the newest complete checkpoint
    in ``output_dir``, and a path to a half-written checkpoint the newest complete one beside it; each half-written one
    passed over is set aside, said in one line on the main process. Anything else is returned as it is. No complete
    checkpoint: ``ValueError``, as the Trainer's own ``resume_from_checkpoint=True`` with none."""
    if resume is True:
        folder = Path(output_dir)
    elif isinstance(resume, (str, os.PathLike)) and _CHECKPOINT.match(Path(resume).name) and (
            (Path(resume).is_dir() and is_half_written(Path(resume))) or (not Path(resume).exists() and _was_set_aside(Path(resume)))):
        folder = Path(resume).parent
    else:
        if isinstance(resume, (str, os.PathLike)) and _CHECKPOINT.match(Path(resume).name) and Path(resume).is_dir():
            say_an_inexact_resume(Path(resume))
        return resume
    moved: list[tuple[Path, Path]] = []
    if resume is not True and Path(resume).is_dir() and is_main_process():
        moved.append((Path(resume), set_aside(Path(resume))))
    found = last_complete_checkpoint(folder, moved=moved)
    asked = "the newest checkpoint" if resume is True else f"{resume}"
    if moved:
        what = "; ".join(f"{source.name} is half-written (no completion marker), set aside to {target}" for source, target in moved)
        if found is not None:
            log.warning("hf_gpu_train: %s; resuming from %s, the newest complete checkpoint", what, found)
        else:
            log.warning("hf_gpu_train: %s", what)
    if found is None:
        raise ValueError(f"no complete checkpoint in {folder} to resume from ({asked} was asked for; half-written ones "
                         f"are set aside in {folder / SET_ASIDE_DIR}): train without resume_from_checkpoint to start over")
    say_an_inexact_resume(found)
    return str(found)


def say_an_inexact_resume(checkpoint: Path) -> None:
    """A checkpoint that holds the model only (``save_only_model=True``): the resume is said not to be exact, and why."""
    missing = missing_for_an_exact_resume(checkpoint)
    if missing and is_main_process():
        log.warning("hf_gpu_train: resuming from %s, which holds the model but not %s (saved with save_only_model=True?): "
                    "the run goes on with them afresh, not exactly where it stopped. Checkpoints for exact resumes: "
                    "save_only_model=False (a stop signal's checkpoint always holds them)", Path(checkpoint).name,
                    " nor ".join(missing))


def missing_for_an_exact_resume(checkpoint: Path) -> list[str]:
    """What a checkpoint lacks for the Trainer to continue the run exactly (``save_only_model=True`` leaves them out):
    the optimizer's state, the learning-rate scheduler's, the random state. DeepSpeed keeps its optimizer's partitions
    in ``global_step*/``."""
    try:
        names = [p.name for p in Path(checkpoint).iterdir()]
    except OSError:
        return []
    deepspeed = any(name.startswith("global_step") for name in names)
    missing = []
    if not deepspeed and not any(name.startswith("optimizer") for name in names):
        missing.append("the optimizer's state")
    if "scheduler.pt" not in names and not deepspeed:
        missing.append("the learning-rate scheduler's")
    if not any(name.startswith("rng_state") for name in names):
        missing.append("the random state")
    return missing


def write_marker(checkpoint: Path, step: int, before: Callable[[Path], None] | None = None) -> None:
    """``before(checkpoint)`` writes what the caller adds (it must be there when the marker is), then the marker."""
    if before is not None:
        before(checkpoint)
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps({"global_step": step, "time": time.time()}))
    (checkpoint / SAVING).unlink(missing_ok=True)


def begin_save(checkpoint: Path, step: int) -> None:
    """On the main process before a save writes anything: the folder is half-written until ``write_marker``."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / COMPLETE_MARKER).unlink(missing_ok=True)  # a save into an existing folder makes it half-written again
    (checkpoint / SAVING).write_text(json.dumps({"global_step": step, "time": time.time()}))
