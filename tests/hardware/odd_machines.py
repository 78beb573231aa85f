"""Test-only machines: odd boxes written by scripts/build_reference_machines.py into tests/hardware/machines/.

They are real situations (MIG mode pending a reset, NVLinks without P2P in a VM) that decision tests
need but that nobody should plan a launch for, so they do not ship with the package.
"""

from __future__ import annotations

from pathlib import Path

from hf_gpu_train.hardware.profile import HardwareProfile
from hf_gpu_train.hardware.snapshot import load

TEST_MACHINES_DIR = Path(__file__).parent / "machines"


def odd_machine_names() -> list[str]:
    return sorted(p.stem for p in TEST_MACHINES_DIR.glob("*.json"))


def odd_machine(name: str) -> HardwareProfile:
    return load(TEST_MACHINES_DIR / f"{name}.json")
