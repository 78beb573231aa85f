"""The doctor: the preflight a careful engineer runs on a new box, in that order."""

from __future__ import annotations

from pathlib import Path

from ..hardware.profile import HardwareProfile, SoftwareInfo
from .checks import FAIL, Check, check_disk, check_driver, check_shm, gpu_checks, skipped, stack_checks
from .health_checks import HEALTH_CHECK_NAMES, health_checks
from .live_checks import TorchProbe, p2p_copy_checks, small_win_checks

LIVE_ONLY = "live check: run `hf-gpu-train doctor` on the machine itself"


def run_checks(
    profile: HardwareProfile,
    software: SoftwareInfo | None,
    probe: TorchProbe | None,
    live: bool,
    output_dir: str | Path = ".",
) -> list[Check]:
    """All checks in order. ``live=False`` (a snapshot) skips what needs the machine itself."""
    driver = check_driver(profile)
    checks = [driver]
    driver_broken = driver.status == FAIL
    if driver_broken:
        why = "fix the driver first (see above) before anything that needs the GPU"
        checks += [skipped(n, why) for n in ("gpus", "GPU models", "other processes", "MIG", "NVLink P2P", "idle clocks",
                                              *HEALTH_CHECK_NAMES, "torch stack", "small win")]
    else:
        if profile.gpus:
            checks += gpu_checks(profile) + health_checks(profile)
        if software is not None:
            checks += stack_checks(profile, software)
        else:
            checks.append(skipped("torch stack", LIVE_ONLY + " (or save the snapshot with --software)"))
        if profile.gpus:
            if live and probe is not None and software is not None and software.cuda_available:
                checks += small_win_checks(profile, probe)
                checks += p2p_copy_checks(profile, probe)
            else:
                why = LIVE_ONLY if not live else "torch cannot use CUDA (see above)"
                checks.append(skipped("small win", why))
                if len(profile.gpus) > 1:
                    checks.append(skipped("P2P copy", why))
    checks.append(check_shm(profile))
    checks.append(check_disk(output_dir) if live else skipped("disk", LIVE_ONLY))
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


__all__ = ["run_checks", "exit_code"]
