"""A disk that fills up while a checkpoint or the model is written: a message that says so, nothing else lost.

Without this the run ends in a traceback from deep inside ``torch.save`` or safetensors ("PytorchStreamWriter failed
writing file", "IoError ... StorageFull"), with a half-written ``checkpoint-N`` next to the good ones. Here the save
that failed on a full disk (``ENOSPC`` / ``EDQUOT``, however the writer wrapped it) becomes ``DiskFullError``, a usage
error (exit 2), naming the directory, the space free and what the save needs. The half-written checkpoint is set
aside at once (``incomplete-checkpoints/``, as a resume would), so that the rotation never counts it and the next run
resumes from the last complete one; the earlier checkpoints and the config are never touched. The Trainer rotates
old checkpoints only after a save succeeded, so a failed save deletes nothing.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from ..errors import UsageError

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded", "QuotaExceeded")


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


def _needed(trainer, output_dir: Path, failed: Path) -> str:
    from ..finetune.checkpoints import checkpoints, is_complete

    complete = next((c for c in checkpoints(output_dir) if c != failed and is_complete(c)), None)
    if complete is not None:
        return f"about {human(folder_bytes(complete))}, the size of {complete.name}"
    return f"about {human(state_bytes(trainer))} (the model's and the optimizer's tensors)"


def disk_full_message(trainer, folder: Path, what: str, set_aside: Path | None) -> str:
    from ..finetune.checkpoints import checkpoints, is_complete

    output_dir = Path(trainer.args.output_dir)
    usage = shutil.disk_usage(folder if folder.exists() else output_dir if output_dir.exists() else output_dir.parent)
    kept = [c.name for c in checkpoints(output_dir) if is_complete(c)]
    lines = [f"the disk holding {output_dir} is full: writing {what} to {folder} failed with {human(usage.free)} free of "
             f"{human(usage.total)}; it needs {_needed(trainer, output_dir, folder)}."]
    if set_aside is not None:
        lines.append(f"The half-written {folder.name} was set aside as {set_aside} (delete it to free its space).")
    lines.append(f"Kept: {', '.join(kept) if kept else 'no complete checkpoint yet'}, and the config.")
    lines.append("Free space (or save_total_limit=1, or an output_dir on a larger disk) and run the same command again"
                 + (f": it resumes from {kept[0]}." if kept else "."))
    return " ".join(lines)


def _set_aside(folder: Path) -> Path | None:
    """Move a half-written checkpoint out of the Trainer's namespace (main process; a rename needs no space)."""
    import time

    from ..finetune.checkpoints import SET_ASIDE_DIR, is_main_process

    if not folder.is_dir() or not is_main_process():
        return None
    aside = folder.parent / SET_ASIDE_DIR
    try:
        aside.mkdir(exist_ok=True)
        target = aside / f"{folder.name}.{int(time.time() * 1000)}"
        folder.rename(target)
        return target
    except OSError:  # not even a directory entry fits: the next run's resume sets it aside
        return None


def guard_saves(trainer) -> None:
    """Turn a full disk during ``_save_checkpoint`` or ``save_model`` into ``DiskFullError``."""
    def guarded(name: str, folder_of, what: str):
        original = getattr(trainer, name)

        def saving(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except DiskFullError:  # save_model inside _save_checkpoint: said once
                raise
            except Exception as error:
                if not is_disk_full(error):
                    raise
                folder = folder_of(args, kwargs)
                checkpoint = folder.name.startswith("checkpoint-")  # save_model writes a checkpoint's weights too
                set_aside = _set_aside(folder) if checkpoint else None
                raise DiskFullError(disk_full_message(trainer, folder, "a checkpoint" if checkpoint else what,
                                                      set_aside)) from error

        setattr(trainer, name, saving)

    guarded("_save_checkpoint", lambda a, kw: Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}",
            "a checkpoint")
    guarded("save_model", lambda a, kw: Path(kw.get("output_dir") or (a[0] if a and a[0] else trainer.args.output_dir)),
            "the model")
