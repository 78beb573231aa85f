"""NAME.tune.json: the measurements of earlier `hf-gpu-train tune` runs, so a rerun reuses them.

A measurement holds for one machine, one software stack, one launch and one training job. The key is a hash of
all of them: the GPUs (model, memory, bus id), the driver, the host's CPU and cores; the versions of torch,
transformers, accelerate, timm and hf_gpu_train; the processes, GPUs and environment the launch gives them; every
FinetuneConfig value that changes speed or memory (model, data, lengths, sizes, task options; not the learning
rate, the epochs or the output directory) with the size and time of local data files; and the effective batch.
Inside one key, each candidate's result is kept by its own key. ``--fresh`` ignores the file (and replaces the
entry). No torch here: the fingerprint reads package versions from their metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from ..errors import UsageError
from ..plan.run_plan_file import FILE_KEYS, NOT_THE_JOB, file_stamp
from .results import TrialResult
from .writeback import backup

FORMAT = "hf_gpu_train.tune_cache"
VERSION = 1
SUFFIX = ".tune.json"
PACKAGES = ("torch", "transformers", "accelerate", "timm", "hf-gpu-train")

class TuneCacheError(UsageError):
    """NAME.tune.json is not ours or not readable: names the file and the fix."""


def cache_path_for(config_file: str | Path) -> Path:
    return Path(config_file).with_suffix(SUFFIX)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_fingerprint(profile) -> dict:
    """The hardware a measurement holds for (a HardwareProfile, live or from a snapshot)."""
    host = profile.host
    return {"gpus": [[g.name, g.memory_total_bytes, g.pci_bus_id] for g in profile.gpus], "driver": profile.driver_version,
            "cuda_driver": profile.cuda_driver_version, "cpu": host.cpu_model, "physical_cores": host.physical_cores,
            "logical_cores": host.logical_cores, "ram_bytes": host.ram_total_bytes}


def software_fingerprint() -> dict:
    return {name: _version(name) for name in PACKAGES}


def job_identity(values: Mapping[str, object]) -> dict:
    """The training job, in FinetuneConfig's words, without what does not change a step's speed or memory."""
    identity = {}
    for key, value in sorted(values.items()):
        if key in NOT_THE_JOB:  # the job, as tuned values are scoped (plan/run_plan_file.py)
            continue
        identity[key] = file_stamp(value) if key in FILE_KEYS else value
    return identity


def cache_key(parts: Mapping[str, object]) -> str:
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class TuneCache:
    """The file's entries: ``{key: {"identity": ..., "results": {candidate key: TrialResult dict}, ...}}``."""

    def __init__(self, path: Path, entries: dict | None = None):
        self.path = path
        self.entries = entries or {}

    @classmethod
    def load(cls, path: str | Path, fresh: bool = False, stamp: str = "") -> TuneCache:
        """The saved measurements. A file that is not JSON stops the command, or with ``fresh`` is kept as
        NAME.bak-STAMP and replaced; a JSON file of anyone else's always stops it."""

        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            if fresh:
                backup(path, stamp or "unreadable")
                return cls(path)
            raise TuneCacheError(f"{path}: not readable as JSON ({str(error).splitlines()[0]}): move it away, or pass --fresh "
                                 "to measure again (the file is then kept as a .bak and replaced)") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise TuneCacheError(f"{path} exists and was not written by hf-gpu-train tune: move it away (tune keeps its "
                                 "measurements in NAME.tune.json beside NAME.yaml)")
        return cls(path, doc.get("entries", {}) if doc.get("version") == VERSION else {})

    def results(self, key: str) -> dict[str, TrialResult]:
        entry = self.entries.get(key) or {}
        return {k: TrialResult.from_dict(v) for k, v in entry.get("results", {}).items()}

    def store(self, key: str, identity: Mapping, results: list[TrialResult], fresh: bool = False) -> None:
        """Keep every trial that ran (skipped ones are not measurements); ``fresh`` replaces the entry."""
        entry = {} if fresh else dict(self.entries.get(key) or {})
        kept = dict(entry.get("results", {}))
        for result in results:
            if result.ran and not result.from_cache:
                kept[result.candidate.key] = result.to_dict()
        self.entries[key] = {"identity": dict(identity), "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "results": kept}

    def save(self) -> Path:
        doc = {"format": FORMAT, "version": VERSION, "entries": self.entries}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
        return self.path
