"""The passes over every row (tokenizing, packing, the validation carve, label encoding), run once per machine.

Run on every rank at once, they cost N times the CPU, and the ranks reach their first collective minutes apart: on
a large dataset the fast ranks time out in NCCL while the slow one still tokenizes (the pattern behind many
"NCCL timeout" reports on accelerate's and TRL's trackers). Here, with several processes, the ranks of a machine
take a file lock on a cache entry named by everything the result depends on. The first to hold it builds the
datasets and saves them (``save_to_disk``); the others wait on the lock, not in a collective, so no collective
timeout runs while they wait, however long the data takes. They then load what was saved, memory-mapped, and every
rank waits on the rendezvous store (not in a collective) until all ranks of all machines are ready. All ranks read
the same saved files, so they train on identical datasets.

- Per machine, or once for all: the cache lives under ``$HF_GPU_TRAIN_CACHE`` (``hf_gpu_train/cache_dir.py``). On a
  filesystem the machines share, the lock is shared too and the data is prepared once; on local disks, once per
  machine. Both are correct.
- A builder that dies releases the lock (the kernel does), leaving no marker: the next rank builds it itself, and
  torchelastic ends the run for the dead rank anyway.
- A filesystem without locks (``ENOLCK``) prepares on every rank, as before, and says so.
- One process: nothing is cached (``datasets`` keeps its own cache for file-backed data); the result is the same.

The key holds the config's values that shape the data (every field but the training-only ones; files by path, size
and modification time), the raw splits' ``datasets`` fingerprints (their contents), the tokenizer as loaded (its
``datasets`` hash) and its files, the versions of this package, transformers, tokenizers and datasets, and this
package's source for the passes: a change to any of them is a new entry, never a stale one. A raw split whose
fingerprint ``datasets`` draws at random (a transform it cannot hash) gives each rank its own key: every rank then
prepares its own, which is still correct. Entries are not evicted: delete ``$HF_GPU_TRAIN_CACHE/prepared`` to free
the space.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.metadata as metadata
import itertools
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from .. import __version__
from ..cache_dir import cache_root
from ..process_group import launch_attempt, rendezvous_store
from .config import ConfigError

MARKER = "prepared.json"
# Fields that change how the model trains, never which rows it sees: left out of the key so that a new learning
# rate or batch size reuses the prepared data. A field missing here only costs a cache miss.
TRAINING_ONLY = frozenset({
    "pretrained", "pretrained_weights", "augmentation", "output_dir", "num_train_epochs", "max_steps",
    "per_device_train_batch_size", "per_device_eval_batch_size", "global_batch_size", "learning_rate", "weight_decay",
    "warmup_ratio", "lr_scheduler_type", "precision", "gradient_checkpointing", "checkpoint_layers", "offload_activations",
    "optimizer_in_backward", "torch_compile",
    "dataloader_num_workers", "eval_strategy", "eval_steps", "save_strategy", "save_steps", "checkpoint_minutes", "mtbf_hours", "background_saves",
    "save_total_limit", "logging_steps", "resume", "report_to", "allow_cpu", "telemetry", "oom_recovery", "watchdog",
    "extra", "method", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "merge_adapter",
    "generation_samples", "generation_max_new_tokens", "chunked_lm_loss", "evaluate_before",
})
# The modules whose code decides the prepared rows: their source is part of the key (with the task's folder's, whose
# code tokenizes, encodes or packs: ``_source_digest``).
PASSES = ("data.py", "carve.py", "prepare_once.py")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "added_tokens.json")


@dataclass
class Prepared:
    train: object  # datasets.Dataset
    validation: object
    meta: dict = field(default_factory=dict)  # JSON: what the passes found (notes, counts), saved beside the rows
    how: str = "prepared in this process"  # or "prepared once on this machine by rank N" / "loaded from ..."


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _stamp(path: Path) -> list | None:
    return [str(path), path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else None


def tokenizer_stamps(model_path: str | None, tokenizer=None) -> list:
    """The tokenizer as loaded (its hash: vocabulary, special tokens, chat template, whatever the run changed in it),
    and its files as they are now (size, modification time); a hub id stands for itself."""
    stamps: list = [model_path]
    if tokenizer is not None:
        from datasets.fingerprint import Hasher

        try:
            stamps.append(Hasher.hash(tokenizer))
        except Exception:  # noqa: BLE001 (a tokenizer dill cannot pickle: its files still count)
            stamps.append(repr(type(tokenizer)))
    if model_path and Path(model_path).is_dir():
        stamps += [s for s in (_stamp(Path(model_path) / name) for name in TOKENIZER_FILES) if s]
    return stamps


def _versions() -> dict:


    found = {"hf_gpu_train": __version__}
    for name in ("transformers", "tokenizers", "datasets"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _source_digest(task_folder: Path | None) -> str:
    """The code that prepares the rows: this folder's passes and every module of the task's own folder."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in PASSES:
        digest.update((here / name).read_bytes())
    for module in sorted(task_folder.glob("*.py")) if task_folder is not None else ():
        digest.update(module.read_bytes())
    return digest.hexdigest()[:16]


def data_key(run_values: dict[str, object], raw_splits: dict[str, object], model_path: str | None, tokenizer=None,
             task_folder: Path | None = None, **extra) -> str:
    """The cache entry's name: a digest of all the data depends on (see the module's docstring). ``run_values``: the
    run's keys (``FinetuneConfig.values``); ``task_folder``: the folder of the task whose code prepares the rows."""
    values = {k: v for k, v in run_values.items() if k not in TRAINING_ONLY}
    values = {k: _stamp(Path(v).expanduser()) or v if k in ("train_file", "validation_file", "chat_template") and v else v
              for k, v in values.items()}
    parts = {"config": values, "splits": {name: getattr(ds, "_fingerprint", None) if ds is not None else None
                                          for name, ds in raw_splits.items()},
             "tokenizer": tokenizer_stamps(model_path, tokenizer), "versions": _versions(), "source": _source_digest(task_folder),
             **extra}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cache_dir() -> Path:

    return cache_root() / "prepared"


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _load(folder: Path, how: str) -> Prepared:
    from datasets import load_from_disk

    meta = json.loads((folder / MARKER).read_text())
    return Prepared(load_from_disk(str(folder / "train")), load_from_disk(str(folder / "validation")), meta["meta"], how)


def _save(prepared: Prepared, folder: Path) -> None:
    # a name no other machine can take on a shared filesystem (pids repeat across containers)
    staging = folder.parent / f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    prepared.train.save_to_disk(str(staging / "train"))
    prepared.validation.save_to_disk(str(staging / "validation"))
    (staging / MARKER).write_text(json.dumps({"meta": prepared.meta, "rank": int(os.environ.get("RANK", "0")),
                                              "time": time.time()}))
    try:
        staging.rename(folder)
    except OSError:  # another machine on a shared filesystem renamed its own first: the same rows
        shutil.rmtree(staging, ignore_errors=True)


NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)  # e.g. Lustre mounted without flock


def prepare_once(key: str, build: Callable[[], Prepared]) -> Prepared:
    """``build()`` on one rank of this machine, the others loading its result; ``build()`` itself with one process.
    Then every rank waits for all the others (machines without a shared cache prepare at their own pace) on the
    rendezvous store, never in a collective."""
    if world_size() < 2:
        return build()

    folder = cache_dir() / key
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(folder.parent / f"{key}.lock", "w")
    except OSError as error:
        raise ConfigError(f"cannot write the prepared-data cache in {folder.parent} ({error.strerror}): set "
                          "HF_GPU_TRAIN_CACHE to a writable directory (shared by the machines, ideally)") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another rank preparing: wait for it (no collective runs meanwhile)
        except OSError as error:
            if error.errno not in NO_LOCKS:
                raise
            prepared = build()
            prepared.how = f"prepared on every rank: the cache directory {folder.parent} cannot be locked ({error.strerror})"
            wait_for_every_rank(key)
            return prepared
        built = not _is_complete(folder)
        if built:
            _save(build(), folder)
    # loaded outside the lock: the ranks of a machine load at once
    rank = json.loads((folder / MARKER).read_text()).get("rank")
    prepared = _load(folder, f"prepared once on this machine by rank {rank}, saved to {folder}" if built else
                     f"loaded from {folder} (prepared once, by rank {rank})")
    wait_for_every_rank(key)
    return prepared


_waits = itertools.count()


def wait_for_every_rank(key: str | None = None) -> None:
    """Every rank posts that its data is ready and waits for all (``HF_GPU_TRAIN_PREPARE_TIMEOUT`` seconds, default
    a day: preparing a large dataset may take hours, and a rank that dies ends the launch anyway)."""


    store = rendezvous_store()
    if store is None:
        return
    # by count, not by cache key: machines may name the same data differently (local copies, other mtimes)
    prefix = f"hf_gpu_train/prepared/{launch_attempt()}/{next(_waits)}"
    store.set(f"{prefix}/{os.environ.get('RANK', '0')}", "1")
    seconds = float(os.environ.get("HF_GPU_TRAIN_PREPARE_TIMEOUT", "86400"))
    try:
        store.wait([f"{prefix}/{r}" for r in range(world_size())], timedelta(seconds=seconds))
    except RuntimeError as error:  # DistStoreError: the timeout
        raise ConfigError(f"not every rank had its data ready within {seconds:.0f} s ({str(error).splitlines()[0]}): "
                          "a machine still preparing? HF_GPU_TRAIN_PREPARE_TIMEOUT=SECONDS to wait longer") from None
