"""The one interface through which hf_gpu_train asks NVML anything.

Two implementations: ``nvml.PynvmlBackend`` (the real library, the only module that imports
``pynvml``) and ``fake.FakeNvmlBackend`` (built from a snapshot, for tests and for planning on a
machine you are not on). Both raise ``NvmlFailure`` with a ``kind`` instead of pynvml's dynamically
generated exception classes, so no caller ever needs pynvml to handle an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .profile import MigInstance

T = TypeVar("T")

# Failure kinds, named after the NVML return codes they come from.
LIBRARY_NOT_FOUND = "library_not_found"
DRIVER_NOT_LOADED = "driver_not_loaded"
FUNCTION_NOT_FOUND = "function_not_found"
NOT_SUPPORTED = "not_supported"
NO_PERMISSION = "no_permission"
GPU_IS_LOST = "gpu_is_lost"
DRIVER_MISMATCH = "lib_rm_version_mismatch"
OTHER = "other"

# Per-field failures that simply mean "this GPU or driver does not tell": the field becomes None.
UNKNOWN_VALUE_KINDS = frozenset({NOT_SUPPORTED, FUNCTION_NOT_FOUND, NO_PERMISSION})

# What to tell the user when NVML cannot start, by failure kind.
INIT_FAILURE_CAUSES = {
    LIBRARY_NOT_FOUND: "NVML library (libnvidia-ml.so.1) not found: the NVIDIA driver is not installed",
    DRIVER_NOT_LOADED: "NVIDIA driver not loaded: the kernel module is missing or failed to load",
    DRIVER_MISMATCH: "NVML and the kernel driver have different versions: a driver update without a reboot",
    FUNCTION_NOT_FOUND: "the NVML library is too old for this query",
    NO_PERMISSION: "no permission to open /dev/nvidia*: add the user to the video group or fix device permissions",
    GPU_IS_LOST: "a GPU fell off the bus (Xid 79): reset the GPU or reboot",
}


class NvmlFailure(Exception):
    """An NVML call failed. ``kind`` is one of the constants above."""

    def __init__(self, kind: str, message: str = ""):
        super().__init__(message or kind)
        self.kind = kind


class HardwareError(RuntimeError):
    """NVML failed in a way that the user must fix; the message names the likely cause."""


class NvmlBackend(Protocol):
    """What detection needs from NVML. Handles are opaque; indices are NVML indices."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> Any: ...
    def name(self, handle: Any) -> str: ...
    def uuid(self, handle: Any) -> str: ...
    def pci_bus_id(self, handle: Any) -> str: ...
    def memory_info(self, handle: Any) -> tuple[int, int]: ...
    def compute_capability(self, handle: Any) -> tuple[int, int]: ...
    def power_limit_mw(self, handle: Any) -> int: ...
    def power_usage_mw(self, handle: Any) -> int: ...
    def mig_mode(self, handle: Any) -> tuple[bool, bool]: ...  # (enabled now, enabled after the next reset)
    def mig_devices(self, handle: Any) -> list[MigInstance]: ...
    def display_active(self, handle: Any) -> bool: ...
    def numa_node(self, handle: Any) -> int: ...
    def cpu_affinity(self, handle: Any) -> str: ...
    def compute_processes(self, handle: Any) -> list[tuple[int, int | None]]: ...
    def process_name(self, pid: int) -> str: ...
    def nvlink_remotes(self, handle: Any) -> list[tuple[str, bool]]: ...
    def topology_common_ancestor(self, h1: Any, h2: Any) -> int: ...
    def p2p_status(self, h1: Any, h2: Any, capability: str) -> int: ...
    def clock_event_reasons(self, handle: Any) -> int: ...
    def sm_clock_mhz(self, handle: Any) -> int: ...
    def sm_clock_max_mhz(self, handle: Any) -> int: ...
    def temperature_c(self, handle: Any) -> int: ...
    def utilization_pct(self, handle: Any) -> tuple[int, int]: ...
    def pcie_link(self, handle: Any) -> tuple[int, int]: ...
    # GPU health (hardware/health.py reads these; each may raise NOT_SUPPORTED / FUNCTION_NOT_FOUND)
    def ecc_error_count(self, handle: Any, uncorrected: bool, aggregate: bool) -> int: ...
    def retired_page_count(self, handle: Any, double_bit: bool) -> int: ...
    def retired_pages_pending(self, handle: Any) -> bool: ...
    def remapped_rows(self, handle: Any) -> tuple[int, int, bool, bool]: ...  # corrected, uncorrected, pending, failed
    def pcie_replay_count(self, handle: Any) -> int: ...
    def active_nvlinks(self, handle: Any) -> list[int]: ...
    def nvlink_error_counts(self, handle: Any, link: int) -> tuple[int, int, int, int]: ...  # replay, recovery, CRC flit, CRC data
    def xid_event_set(self) -> Any: ...  # an NVML event set (free it with free_event_set)
    def register_xid_events(self, handle: Any, event_set: Any) -> None: ...
    def next_xid_event(self, event_set: Any) -> tuple[int, int] | None: ...  # (NVML index, XID), None: none pending
    def free_event_set(self, event_set: Any) -> None: ...


def safe_query(fn: Callable[..., T], *args: Any, errors: list[str] | None = None) -> T | None:
    """Call one NVML query; the one place per-field NVML errors are turned into ``None``.

    NotSupported / FunctionNotFound / NoPermission mean "unknown here" and give ``None`` quietly.
    Any other NVML failure also gives ``None`` (one broken field must not cost the whole
    profile), but it is appended to ``errors`` so the profile can say what went wrong.
    """
    try:
        return fn(*args)
    except NvmlFailure as failure:
        if failure.kind not in UNKNOWN_VALUE_KINDS and errors is not None:
            errors.append(f"{getattr(fn, '__name__', 'query')}: {failure}")
        return None


def normalize_bus_id(bus_id: str | bytes) -> str:
    """PCI bus ids in one spelling: lower case, 4-digit domain (``0000:07:00.0``).

    NVML writes ``00000000:07:00.0``, sysfs ``0000:07:00.0``, torch gives the parts as integers.
    """
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode()
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, rest = parts
        text = f"{int(domain, 16):04x}:{bus}:{rest}"
    elif len(parts) == 2:
        text = f"0000:{text}"
    return text
