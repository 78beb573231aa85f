"""A disk that fills up while a checkpoint or the model is written: a message that says so, nothing else lost.

Without this the run ends in a traceback from deep inside ``torch.save`` or safetensors ("PytorchStreamWriter failed
writing file", "IoError ... StorageFull"), with a half-written ``checkpoint-N`` next to the good ones. Here the save
that failed on a full disk (``ENOSPC`` / ``EDQUOT``, however the writer wrapped it) becomes ``DiskFullError``, a usage
error (exit 2), naming the directory, the space free and what the save needs. The half-written checkpoint has no
completion marker, so the next run sets it aside (``incomplete-checkpoints/``) and resumes from the last complete
one; it is not moved at once, as the other ranks may still be writing their RNG states into it. The earlier
checkpoints and the config are never touched: the Trainer rotates old checkpoints only after a save succeeded.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

from ..errors import UsageError

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")
# torch.save's zip writer on a full disk can fail without the errno: "[enforce fail at inline_container.cc] ...
# unexpected pos 46906560 vs 46906448" or "PytorchStreamWriter failed writing file": a full disk when the space left
# is less than the save needs
WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed", "unexpected pos")
MERGED = "the adapter and the merged model"  # a save the size of the whole model, not of a checkpoint


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


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
    from ..finetune.checkpoints import checkpoints, is_complete

    complete = next((c for c in checkpoints(output_dir) if c != failed and is_complete(c)), None)
    if complete is not None:
        return folder_bytes(complete), f"the size of {complete.name}"
    return state_bytes(trainer), "the model's and the optimizer's tensors"


def disk_full_message(trainer, folder: Path, what: str, needed: tuple[int, str]) -> str:
    from ..finetune.checkpoints import checkpoints, is_complete

    output_dir = Path(trainer.args.output_dir)
    usage = shutil.disk_usage(_existing(folder))
    kept = [c.name for c in checkpoints(output_dir) if is_complete(c)]
    lines = [f"the disk holding {output_dir} is full: writing {what} to {folder} failed with {human(usage.free)} free of "
             f"{human(usage.total)}; it needs about {human(needed[0])} ({needed[1]})."]
    if folder.name.startswith("checkpoint-"):
        lines.append(f"The half-written {folder.name} has no completion marker: the next run sets it aside (delete it to "
                     "free its space now).")
    lines.append(f"Kept: {', '.join(kept) if kept else 'no complete checkpoint yet'}, and the config.")
    lines.append("Free space (or save_total_limit=1, or an output_dir on a larger disk) and run the same command again"
                 + (f": it resumes from {kept[0]}." if kept else "."))
    return " ".join(lines)


@contextlib.contextmanager
def saving_to(trainer, folder: Path, what: str):
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
        raise DiskFullError(disk_full_message(trainer, folder, "a checkpoint" if checkpoint else what, needed)) from error


def guard_saves(trainer) -> None:
    """Turn a full disk during ``_save_checkpoint`` or ``save_model`` into ``DiskFullError``."""
    def guarded(name: str, folder_of, what: str):
        original = getattr(trainer, name)

        def saving(*args, **kwargs):
            with saving_to(trainer, folder_of(args, kwargs), what):
                return original(*args, **kwargs)

        setattr(trainer, name, saving)

    guarded("_save_checkpoint", lambda a, kw: Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}",
            "a checkpoint")
    guarded("save_model", lambda a, kw: Path(kw.get("output_dir") or (a[0] if a and a[0] else trainer.args.output_dir)),
            "the model")
