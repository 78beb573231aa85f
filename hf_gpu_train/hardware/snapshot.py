"""Versioned JSON snapshots of a ``HardwareProfile``, and the shipped reference machines.

``hf-gpu-train detect --save box.json`` on a GPU node, then ``--machine box.json`` anywhere (a
login node has no GPU). Reference machines live in ``hardware/machines/*.json`` and are the
fixtures of the test suite too.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from difflib import get_close_matches
from functools import cache
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .profile import HardwareProfile

FORMAT = "hf_gpu_train.machine"
# Version 2 added the pending MIG mode and the MIG instances of each GPU; version 3 each GPU's health (ECC, retired
# pages, remapped rows, PCIe replays, NVLink errors, XIDs). Older versions still load: their missing fields take the
# dataclass defaults (None, "not recorded").
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MACHINES_DIR = Path(__file__).parent / "machines"


class SnapshotError(UsageError):
    """A snapshot file that cannot be read: the message names the file and what to do."""


def to_dict(profile: HardwareProfile) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "profile": _encode(profile)}


def to_json(profile: HardwareProfile) -> str:
    text = json.dumps(to_dict(profile), indent=2)
    # Short lists of numbers on one line ("compute_capability": [8, 0]), so a snapshot reads well.
    text = re.sub(r"\[\s*(-?\d+(?:\.\d+)?(?:,\s*-?\d+(?:\.\d+)?)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    # Small records of integers on one line too (an NVLink's error counters), or 18 links take 126 lines.
    return re.sub(r"\{\s*(\"\w+\": -?\d+(?:,\s*\"\w+\": -?\d+)*)\s*\}",
                  lambda m: "{" + ", ".join(x.strip() for x in m.group(1).split(",")) + "}", text) + "\n"


def from_dict(data: dict[str, Any], source: str = "snapshot") -> HardwareProfile:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapshotError(f"{source} is not an hf_gpu_train machine snapshot (no \"format\": \"{FORMAT}\"); "
                            "make one with `hf-gpu-train detect --save FILE`")
    version = data.get("version")
    if version not in READABLE_VERSIONS:
        raise SnapshotError(f"{source} has snapshot version {version!r}; this hf_gpu_train reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade hf_gpu_train or re-run "
                            "`hf-gpu-train detect --save` with this version")
    try:
        return _decode(HardwareProfile, data["profile"])
    except (KeyError, TypeError, ValueError) as error:
        raise SnapshotError(f"{source} is a damaged snapshot ({error}); re-create it with `hf-gpu-train detect --save`") from None


def save(profile: HardwareProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_json(profile))
    tmp.replace(path)  # atomic: a crash never leaves half a snapshot where a good one was
    return path


def load(path: str | Path) -> HardwareProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SnapshotError(f"machine file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SnapshotError(f"cannot read machine file {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise SnapshotError(f"machine file {path} is not valid JSON (line {error.lineno}: {error.msg})") from None
    return from_dict(data, source=str(path))


def reference_machine_names() -> list[str]:
    return sorted(p.stem for p in MACHINES_DIR.glob("*.json"))


@cache
def _load_reference(name: str) -> HardwareProfile:
    return load(MACHINES_DIR / f"{name}.json")


def load_machine(file_or_name: str) -> HardwareProfile:
    """A snapshot file path, or the name of a shipped reference machine."""
    path = Path(file_or_name)
    if path.suffix == ".json" or path.exists() or "/" in file_or_name:
        return load(path)
    if file_or_name in reference_machine_names():
        return _load_reference(file_or_name)

    close = get_close_matches(file_or_name, reference_machine_names(), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise SnapshotError(f"--machine {file_or_name!r} is neither a snapshot file nor a reference machine.{hint} "
                        "See `hf-gpu-train machines` for the names.")


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(kind: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in typing.get_args(kind) if a is not type(None)]
        return _decode(non_none[0], value)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        names = {f.name for f in dataclasses.fields(kind)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)} in {kind.__name__}")
        return kind(**{k: _decode(hints[k], v) for k, v in value.items()})
    if origin is tuple:
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value))
    if kind is float and isinstance(value, int):
        return float(value)
    return value
