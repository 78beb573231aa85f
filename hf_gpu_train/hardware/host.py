"""Host facts (CPU, RAM, NUMA, /dev/shm, NVIDIA devices on the PCI bus) without NVML or torch.

Paths are parameters so tests can point them at a fake /proc and /sys.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from .profile import HostInfo

NVIDIA_PCI_VENDOR = "0x10de"
# PCI class 0x03 = display controller (VGA 0x0300, 3D controller 0x0302 for data-centre GPUs).
DISPLAY_CLASS_PREFIX = "0x03"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cpu_model(proc: Path = Path("/proc")) -> str | None:
    text = _read(proc / "cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return value.strip()
    return None


def physical_cores(proc: Path = Path("/proc")) -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; psutil's answer when that fails."""
    text = _read(proc / "cpuinfo")
    if text:
        cores = set()
        physical = core = None
        for line in text.splitlines() + [""]:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "physical id":
                physical = value.strip()
            elif key == "core id":
                core = value.strip()
            elif not line.strip():
                if core is not None:
                    cores.add((physical, core))
                physical = core = None
        if cores:
            return len(cores)
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except ImportError:
        return None


def numa_nodes(sys: Path = Path("/sys")) -> int | None:
    node_dir = sys / "devices/system/node"
    if not node_dir.is_dir():
        return None
    count = sum(1 for p in node_dir.iterdir() if p.name.startswith("node") and p.name[4:].isdigit())
    return count or None


def ram_total_bytes(proc: Path = Path("/proc")) -> int | None:
    for line in (_read(proc / "meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def shm_total_bytes(shm: Path = Path("/dev/shm")) -> int | None:
    try:
        return shutil.disk_usage(shm).total
    except OSError:
        return None


def nvidia_pci_devices(sys: Path = Path("/sys")) -> int | None:
    """NVIDIA display/3D controllers on the PCI bus, whatever the driver's state.

    This is what tells "no NVIDIA GPU in this box" apart from "a GPU is there but NVML fails".
    """
    devices = sys / "bus/pci/devices"
    if not devices.is_dir():
        return None
    count = 0
    for dev in devices.iterdir():
        vendor = (_read(dev / "vendor") or "").strip().lower()
        pci_class = (_read(dev / "class") or "").strip().lower()
        if vendor == NVIDIA_PCI_VENDOR and pci_class.startswith(DISPLAY_CLASS_PREFIX):
            count += 1
    return count


def infiniband_devices(sys: Path = Path("/sys")) -> tuple[str, ...]:
    ib = sys / "class/infiniband"
    if not ib.is_dir():
        return ()
    return tuple(sorted(p.name for p in ib.iterdir()))


def detect_host(proc: Path = Path("/proc"), sys: Path = Path("/sys"), shm: Path = Path("/dev/shm")) -> HostInfo:
    return HostInfo(
        hostname=socket.gethostname(),
        cpu_model=cpu_model(proc),
        physical_cores=physical_cores(proc),
        logical_cores=os.cpu_count(),
        numa_nodes=numa_nodes(sys),
        ram_total_bytes=ram_total_bytes(proc),
        shm_total_bytes=shm_total_bytes(shm),
        nvidia_pci_devices=nvidia_pci_devices(sys),
        infiniband_devices=infiniband_devices(sys),
    )
