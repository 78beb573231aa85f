"""A disk that fills up while a checkpoint or the model is written: a message that says so, nothing else lost.

Without this the run ends in a traceback from deep inside ``torch.save`` or safetensors ("PytorchStreamWriter failed
writing file", "IoError ... StorageFull"), with a half-written ``checkpoint-N`` next to the good ones. Here the save
that failed on a full disk (``ENOSPC`` / ``EDQUOT``, however the writer wrapped it) becomes ``DiskFullError``, a usage
error (exit 2), naming the directory, the space free, what the save needs and the complete checkpoints kept.

``guard_saves`` also marks every checkpoint complete once every rank has written it, makes a resume in the middle of
an epoch take that epoch's sample order on several processes (``resume_epoch.py``), and makes
``train(resume_from_checkpoint=True)`` (or a path to a half-written checkpoint) set the half-written one aside
(``incomplete-checkpoints/``) and resume from the newest complete one (``checkpoint_marker.py``). The half-written
checkpoint is not moved at once, as the other ranks may still be writing their RNG states into it. The earlier
checkpoints are never touched: the Trainer rotates old checkpoints only after a save succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..collectives.control_flags import agree_on_control
from ..collectives.cpu_votes import lowest_and_highest, several_processes, wait_for_every_rank
from ..errors import UsageError
from ..launch.rank_report import write_resumes
from ..textfmt import human
from .background_save import BackgroundSaves, BackgroundWrite, attach_to_trainer, background_saves_wanted, staged, writers_vote
from .checkpoint_layout import check_resume
from .checkpoint_marker import begin_save, complete_checkpoints, resume_point, save_on_each_node, write_marker
from .resume_epoch import exact_mid_epoch_resume

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")
# torch.save's zip writer on a full disk can fail without the errno: "[enforce fail at inline_container.cc] ...
# unexpected pos 46906560 vs 46906448" or "PytorchStreamWriter failed writing file": a full disk when the space left
# is less than the save needs
WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed", "unexpected pos")
MERGED = "the adapter and the merged model"  # a save the size of the whole model, not of a checkpoint
_STEP = re.compile(r"checkpoint-(\d+)/?$")  # a checkpoint's step, from its folder's name


class DiskFullError(UsageError):
    """A save that ran out of disk space."""


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC or EDQUOT, raised as it is or wrapped by torch.save / safetensors (their message keeps the words)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
            return True
        if any(word in str(error) for word in NO_SPACE_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _writer_failed_for_space(error: BaseException, folder: Path, needed: int) -> bool:
    if not any(word in str(error) for word in WRITER_FAILURES):
        return False
    # what the save already wrote was space it had: a late I/O error with room left is not a full disk
    return shutil.disk_usage(_existing(folder)).free + folder_bytes(folder) < needed


def _existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def state_bytes(trainer) -> int:
    """What a checkpoint holds, counted from the tensors: the model's state, and the optimizer's."""
    import torch

    total = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values() if torch.is_tensor(t))
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        for values in optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in values.values() if torch.is_tensor(t))
    return total


def needed_bytes(trainer, output_dir: Path, failed: Path) -> tuple[int, str]:
    """(bytes, how they were counted) a save needs: the last complete checkpoint's size, else the state's tensors."""
    complete = next((c for c in complete_checkpoints(output_dir) if c != failed), None)
    if complete is not None:
        return folder_bytes(complete), f"the size of {complete.name}"
    return state_bytes(trainer), "the model's and the optimizer's tensors"


@dataclass(frozen=True)
class SaveWords:
    """How the message names what else survives and how to go on: anyone's Trainer (the default) or the fine-tuning
    entry point (``FINETUNE_WORDS``)."""

    kept_too: str = ""  # ", and the config"
    next_run: str = "a resume (train(resume_from_checkpoint=True))"  # who sets the half-written checkpoint aside
    again: str = "train again"
    resumes: str = "trainer.train(resume_from_checkpoint=True) resumes from {checkpoint}"


FINETUNE_WORDS = SaveWords(kept_too=", and the config", next_run="the next run", again="run the same command again",
                           resumes="it resumes from {checkpoint}")


def disk_full_message(trainer, folder: Path, what: str, needed: tuple[int, str], words: SaveWords = SaveWords()) -> str:
    output_dir = Path(trainer.args.output_dir)
    usage = shutil.disk_usage(_existing(folder))
    kept = [c.name for c in complete_checkpoints(output_dir) if c != folder]
    lines = [f"the disk holding {output_dir} is full: writing {what} to {folder} failed with {human(usage.free)} free of "
             f"{human(usage.total)}; it needs about {human(needed[0])} ({needed[1]})."]
    if folder.name.startswith("checkpoint-"):
        lines.append(f"The half-written {folder.name} has no completion marker: {words.next_run} sets it aside (delete "
                     "it to free its space now).")
    lines.append(f"Kept: {', '.join(kept) if kept else 'no complete checkpoint yet'}{words.kept_too}.")
    lines.append(f"Free space (or save_total_limit=1, or an output_dir on a larger disk) and {words.again}"
                 + (f": {words.resumes.format(checkpoint=kept[0])}." if kept else "."))
    return " ".join(lines)


@contextlib.contextmanager
def saving_to(trainer, folder: Path, what: str, words: SaveWords = SaveWords()):
    """A save into ``folder``: a full disk inside becomes ``DiskFullError`` (the half-written files stay where they are:
    the other ranks may still write theirs into it; a resume sets an incomplete checkpoint aside)."""
    try:
        yield
    except DiskFullError:  # save_model inside _save_checkpoint: said once
        raise
    except Exception as error:
        output_dir = Path(trainer.args.output_dir)
        needed = needed_bytes(trainer, output_dir, folder) if what != MERGED else (state_bytes(trainer), "the model's tensors")
        if not (is_disk_full(error) or _writer_failed_for_space(error, folder, needed[0])):
            raise
        checkpoint = folder.name.startswith("checkpoint-")  # save_model writes a checkpoint's weights too
        raise DiskFullError(disk_full_message(trainer, folder, "a checkpoint" if checkpoint else what, needed, words)) from error


@contextlib.contextmanager
def _rotation_deferred(defer: bool):
    """The Trainer deletes the checkpoints over ``save_total_limit`` at the end of its own ``_save_checkpoint``, before
    the other ranks have written theirs and the marker is set: a full disk after that would leave no complete checkpoint.
    Inside this block its rotation is recorded instead, and run by the caller once the new checkpoint is complete (an
    exception skips it: the older checkpoints stay)."""
    import transformers.trainer as hf_trainer

    rotations: list = []
    real = getattr(hf_trainer, "rotate_checkpoints", None)
    if not defer or real is None:
        yield rotations
        return
    hf_trainer.rotate_checkpoints = lambda *a, **kw: rotations.append(lambda: real(*a, **kw))
    try:
        yield rotations
    finally:
        hf_trainer.rotate_checkpoints = real


def _same_checkpoint_on_every_node(trainer, chosen) -> None:
    """``save_on_each_node=True``: each node chose the newest complete checkpoint of its own disk; a node killed between
    two nodes' markers may hold another step than the others. Every rank compares the step it resumes from (one
    all-reduce, on every rank: the resume argument is the command's), and different steps stop the run with the fix."""
    if not (trainer.args.save_on_each_node and isinstance(chosen, (str, Path)) and _STEP.search(str(chosen))):
        return
    step = int(_STEP.search(str(chosen)).group(1))
    lowest, highest = lowest_and_highest(step)
    if lowest != highest:
        raise UsageError(f"save_on_each_node=True and the nodes would resume from different checkpoints (steps {lowest} "
                         f"to {highest}: a node stopped between two nodes' saves). Resume every node from "
                         f"checkpoint-{lowest}: resume_from_checkpoint=<output_dir>/checkpoint-{lowest} (each node keeps "
                         "it), or remove the newer ones on the nodes that have them")


def _after_the_last_write(method, saves):
    """``method`` once the write in flight is complete and marked (every rank calls it alike)."""

    def once_written(*args, **kwargs):
        saves.drain()
        return method(*args, **kwargs)

    return once_written


def _raise_failed_write(trainer, write, words: SaveWords) -> None:
    """A background write failed on some rank (said at the step boundary every rank votes at): this rank's own error
    as a save's (a full disk: ``DiskFullError``), or, on the ranks whose write went well, which checkpoint failed."""
    if write.error is None:
        raise RuntimeError(f"hf_gpu_train: another rank's background write of {write.folder.name} failed (its error is "
                           "above, from that rank); the checkpoint has no completion marker and a resume sets it aside")
    with saving_to(trainer, write.folder, "a checkpoint", words):
        raise write.error


def _every_stateful_callback_named(trainer) -> None:
    """transformers' ``_save_checkpoint`` reads ``state.stateful_callbacks[name]`` for every stateful callback
    (``ExportableState``); a state resumed from a checkpoint written without one of them (a DeepSpeed run, where OOM
    recovery is off, resumed on one process, where it is on; a callback added since) lacks the name: KeyError at the
    first save. The callback's own state fills it in (the save overwrites it a moment later)."""
    from transformers.trainer_callback import ExportableState

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ExportableState):
            trainer.state.stateful_callbacks.setdefault(type(callback).__name__, callback.state())


def guard_saves(trainer, words: SaveWords = SaveWords(), before_marker: Callable[[Path], None] | None = None,
                background: bool | str | None = None) -> None:
    """For anyone's Trainer, before ``trainer.train()``: a full disk during ``_save_checkpoint`` or ``save_model``
    becomes ``DiskFullError``; every checkpoint is marked complete once every rank has written it (``before_marker``
    writes the caller's own files into it first, on the main process); ``train(resume_from_checkpoint=True)`` or a path
    to a half-written checkpoint resumes from the newest complete one (``checkpoint_marker.resume_point``).

    ``background`` (True / False; None or "auto": ``HF_GPU_TRAIN_BACKGROUND_SAVES`` where set, else on for a run on a
    GPU): the checkpoints ``train()`` writes are staged in host memory and written while training goes on, marked once
    every rank's write is done (``background_save.py``). Off for ``push_to_hub`` (the upload reads the folder at once).

    Waiting for every rank before the marker is a collective, so the control flags that decide a save are agreed
    across the ranks first (``collectives.control_flags.agree_on_control``): a save one rank's callback asked for alone is every
    rank's. A Trainer without that step is not waited for: its marker is written when the main process finished, and
    its checkpoints are written synchronously."""

    agreed = agree_on_control(trainer)
    save_on_each_node(trainer.args.save_on_each_node)  # each node marks its own copy (its local rank 0 writes it)
    saves = None
    on_gpu = getattr(trainer.args.device, "type", "cpu") == "cuda"
    if background_saves_wanted(background, on_gpu) and not trainer.args.push_to_hub and (agreed or several_processes() is None):
        saves = BackgroundSaves(lowest_and_highest, lambda write: _raise_failed_write(trainer, write, words),
                                write_vote=writers_vote if several_processes() is not None else None)
        attach_to_trainer(trainer, saves)
    trainer._hf_gpu_train_background_saves = saves
    training = [False]  # inside train(): a save there may go to the background

    def checkpoint_folder() -> Path:
        return Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"

    def guarded(name: str, folder_of, what: str, mark: bool = False):
        original = getattr(trainer, name)

        def saving(*args, **kwargs):
            folder = folder_of(args, kwargs)
            main = trainer.args.should_save  # global rank 0, or each node's local rank 0 with save_on_each_node
            step = trainer.state.global_step
            background = mark and saves is not None and training[0]  # alike on every rank
            if background:
                saves.drain(why=f"the save at step {step} came")
            began = time.monotonic()
            files: list = []
            if mark:
                _every_stateful_callback_named(trainer)
            with saving_to(trainer, folder, what, words):
                if mark and main:
                    begin_save(folder, step)
                with _rotation_deferred(mark) as rotations, (staged(files, saves.buffers) if background else contextlib.nullcontext()):
                    result = original(*args, **kwargs)

                def finish() -> None:
                    with saving_to(trainer, folder, what, words):  # after a background write: at a later step boundary
                        if mark and main and folder.is_dir():
                            write_marker(folder, step, before_marker)
                    for rotate in rotations:  # older checkpoints go only once this one is complete
                        rotate()

                if background:  # the writer thread marks it complete (then rotates) once every rank's write is done
                    write = BackgroundWrite(folder, step, files, finish, state=copy.deepcopy(trainer.state))
                    saves.begin(write, blocked_seconds=time.monotonic() - began)
                    return result
                if mark and agreed:
                    wait_for_every_rank()  # every rank's RNG state (and shards) written before the marker
                finish()
            return result

        setattr(trainer, name, saving)

    guarded("_save_checkpoint", lambda a, kw: checkpoint_folder(), "a checkpoint", mark=True)
    guarded("save_model", lambda a, kw: Path(kw.get("output_dir") or (a[0] if a and a[0] else trainer.args.output_dir)),
            "the model")
    train = trainer.train

    def train_from_a_complete_checkpoint(*args, **kwargs):
        if args:
            args = (resume_point(args[0], trainer.args.output_dir), *args[1:])
            _same_checkpoint_on_every_node(trainer, args[0])
        elif "resume_from_checkpoint" in kwargs:
            kwargs["resume_from_checkpoint"] = resume_point(kwargs["resume_from_checkpoint"], trainer.args.output_dir)
            _same_checkpoint_on_every_node(trainer, kwargs["resume_from_checkpoint"])
        resuming = args[0] if args else kwargs.get("resume_from_checkpoint")
        check_resume(trainer, resuming, trainer.args.world_size)  # a checkpoint this engine would get wrong: said
        if resuming:
            write_resumes()  # train(resume_from_checkpoint=...): started again, the script resumes (launch/restarts.py)
        if saves is None:
            return train(*args, **kwargs)
        training[0] = True
        try:
            result = train(*args, **kwargs)
        except BaseException:
            saves.wait_here()  # this rank alone: its write ends, unmarked (a resume sets the folder aside)
            raise
        finally:
            training[0] = False
        saves.drain()  # the last checkpoint (a stop signal's too) is on the disk and marked before train() returns
        return result

    trainer.train = train_from_a_complete_checkpoint
    if saves is not None:
        # the Trainer's end of training reads and deletes checkpoints before on_train_end: the best model loaded,
        # save_total_limit=1's cleanup of every checkpoint but the best. The last write is complete first
        for name in ("_finalize_training", "_load_best_model"):
            if callable(getattr(trainer, name, None)):
                setattr(trainer, name, _after_the_last_write(getattr(trainer, name), saves))
    trainer._hf_gpu_train_saves_guarded = True
    # a resume from any of these checkpoints reads the order the run never stopped reads: every epoch's order seeded by
    # the epoch, and a mid-epoch resume in its epoch's order
    from .sampler_order import seeded_samplers  # lazy: torch and transformers; guard_saves is imported before them

    seeded_samplers(trainer)
    exact_mid_epoch_resume(trainer)
