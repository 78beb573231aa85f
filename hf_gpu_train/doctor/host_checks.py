"""Host checks: shared memory for dataloader workers, free disk where the run will write."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..hardware.profile import HardwareProfile
from ..textfmt import gib
from .check import FAIL, PASS, WARN, Check

MIN_SHM_BYTES = 2**30
MIN_FREE_DISK_BYTES = 10 * 2**30


def check_shm(profile: HardwareProfile) -> Check:
    size = profile.host.shm_total_bytes
    if size is None:
        return Check("/dev/shm", WARN, "no /dev/shm found", "Dataloader workers pass batches through /dev/shm: "
                     "mount it (docker: --shm-size=8g or --ipc=host), or set dataloader_num_workers=0.")
    if size < MIN_SHM_BYTES:
        return Check("/dev/shm", WARN, f"/dev/shm is {gib(size, 2)}; dataloader workers need at least 1 GiB "
                     "(bus error / 'DataLoader worker killed' otherwise)",
                     "docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory on /dev/shm.")
    return Check("/dev/shm", PASS, f"{gib(size)}")


def check_disk(output_dir: str | Path, min_free_bytes: int = MIN_FREE_DISK_BYTES) -> Check:
    path = Path(output_dir).resolve()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as error:
        return Check("disk", FAIL, f"cannot read free space of {path}: {error}", "Choose a writable --output-dir.")
    if free < min_free_bytes:
        return Check("disk", WARN, f"{gib(free)} free in {probe}: checkpoints of a large model may not fit",
                     f"Free space, or point output_dir at a larger disk (want >= {gib(min_free_bytes, 0)}).")
    return Check("disk", PASS, f"{gib(free)} free in {probe}")
