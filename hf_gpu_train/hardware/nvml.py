"""The real NVML backend: the only module in hf_gpu_train that imports ``pynvml``.

``pynvml`` comes from the ``nvidia-ml-py`` package (the PyPI package named ``pynvml`` is a
deprecated wrapper that warns on import). Every pynvml error is translated into ``NvmlFailure``
here, so callers never see pynvml's dynamically generated exception classes.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

from .backend import (
    DRIVER_MISMATCH,
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
    NOT_SUPPORTED,
    OTHER,
    NvmlFailure,
    normalize_bus_id,
)
from .profile import MigInstance, cpulist

# NVML return codes (nvml.h nvmlReturn_t) mapped to our failure kinds.
_KIND_BY_CODE = {
    3: NOT_SUPPORTED,
    4: NO_PERMISSION,
    9: DRIVER_NOT_LOADED,
    12: LIBRARY_NOT_FOUND,
    13: FUNCTION_NOT_FOUND,
    15: GPU_IS_LOST,
    18: DRIVER_MISMATCH,
}

# nvmlReturn_t codes that mean "no device in this slot" when walking MIG device or NVLink slots.
_EMPTY_SLOT_CODES = (2, 6)  # INVALID_ARGUMENT, NOT_FOUND
# nvmlAffinityScope_t: NVML_AFFINITY_SCOPE_NODE asks for NUMA nodes (not sockets).
_AFFINITY_SCOPE_NODE = 0
_NODE_SET_WORDS = 4  # 64-bit words in the NUMA node mask: up to 256 nodes

# P2P capability indices. Written as literals: pynvml defines NVML_P2P_CAPS_INDEX_READ as ``0,``
# (a tuple, by a stray comma in nvidia-ml-py 13.x), which NVML would reject.
_P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3, "prop": 4}


def _failure(error: Exception) -> NvmlFailure:
    """The ``NvmlFailure`` for one pynvml.NVMLError (its ``value`` is the nvmlReturn_t code)."""
    return NvmlFailure(_KIND_BY_CODE.get(getattr(error, "value", None), OTHER), str(error))


def _translating(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn any pynvml.NVMLError raised by ``method`` into an ``NvmlFailure``."""

    @functools.wraps(method)
    def wrapper(self: PynvmlBackend, *args: Any) -> Any:
        try:
            return method(self, *args)
        except self._pynvml.NVMLError as error:
            raise _failure(error) from None

    return wrapper


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class PynvmlBackend:
    """NVML through nvidia-ml-py. Construction never fails; ``init()`` may raise NvmlFailure."""

    def __init__(self) -> None:
        self._pynvml: Any = None
        self._xid_indices: dict[Any, int] = {}  # a registered handle's address -> its NVML index

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as error:  # the package itself is missing, not the driver
            raise NvmlFailure(LIBRARY_NOT_FOUND, f"nvidia-ml-py is not installed ({error})") from None
        self._pynvml = pynvml
        self._init()

    @_translating
    def _init(self) -> None:
        self._pynvml.nvmlInit()

    @_translating
    def shutdown(self) -> None:
        self._pynvml.nvmlShutdown()

    @_translating
    def driver_version(self) -> str:
        return _text(self._pynvml.nvmlSystemGetDriverVersion())

    @_translating
    def cuda_driver_version(self) -> int:
        return int(self._pynvml.nvmlSystemGetCudaDriverVersion_v2())

    @_translating
    def device_count(self) -> int:
        return int(self._pynvml.nvmlDeviceGetCount())

    @_translating
    def handle(self, index: int) -> Any:
        return self._pynvml.nvmlDeviceGetHandleByIndex(index)

    @_translating
    def name(self, handle: Any) -> str:
        return _text(self._pynvml.nvmlDeviceGetName(handle))

    @_translating
    def uuid(self, handle: Any) -> str:
        return _text(self._pynvml.nvmlDeviceGetUUID(handle))

    @_translating
    def pci_bus_id(self, handle: Any) -> str:
        return normalize_bus_id(self._pynvml.nvmlDeviceGetPciInfo(handle).busId)

    @_translating
    def memory_info(self, handle: Any) -> tuple[int, int]:
        info = self._pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.used)

    @_translating
    def compute_capability(self, handle: Any) -> tuple[int, int]:
        major, minor = self._pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)

    @_translating
    def power_limit_mw(self, handle: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetEnforcedPowerLimit(handle))

    @_translating
    def power_usage_mw(self, handle: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetPowerUsage(handle))

    @_translating
    def mig_mode(self, handle: Any) -> tuple[bool, bool]:
        """(MIG on now, MIG on after the next GPU reset): they differ after `nvidia-smi -mig` until the reset."""
        current, pending = self._pynvml.nvmlDeviceGetMigMode(handle)
        enable = self._pynvml.NVML_DEVICE_MIG_ENABLE
        return current == enable, pending == enable

    @_translating
    def mig_devices(self, handle: Any) -> list[MigInstance]:
        """The MIG devices of a GPU in MIG mode: empty slots (NotFound / InvalidArgument) are skipped."""
        nv = self._pynvml
        instances = []
        for slot in range(int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nv.NVMLError as error:
                if getattr(error, "value", None) in _EMPTY_SLOT_CODES:
                    continue
                raise
            memory = nv.nvmlDeviceGetMemoryInfo(mig)
            instances.append(MigInstance(
                index=slot, uuid=_text(nv.nvmlDeviceGetUUID(mig)), name=_text(nv.nvmlDeviceGetName(mig)),
                memory_total_bytes=int(memory.total), memory_used_bytes=int(memory.used),
                gpu_instance_id=self._optional(nv.nvmlDeviceGetGpuInstanceId, mig),
                compute_instance_id=self._optional(nv.nvmlDeviceGetComputeInstanceId, mig)))
        return instances

    def _optional(self, query: Callable[..., Any], *args: Any) -> int | None:
        """A secondary integer field: None when this driver cannot say."""
        try:
            return int(query(*args))
        except self._pynvml.NVMLError:
            return None

    @_translating
    def display_active(self, handle: Any) -> bool:
        return bool(self._pynvml.nvmlDeviceGetDisplayActive(handle))

    @_translating
    def numa_node(self, handle: Any) -> int:
        """The CPU NUMA node closest to the GPU (``nvidia-smi topo -m``'s "NUMA Affinity").

        From ``nvmlDeviceGetMemoryAffinity`` with node scope. Not ``nvmlDeviceGetNumaNodeId``: that is
        the GPU's own NUMA id on platforms where GPU memory is a NUMA node (Grace Hopper), "N/A" on
        x86 ("GPU NUMA ID" in topo -m). Older drivers lack the query (FunctionNotFound -> unknown), and a
        GPU close to several nodes has no single one (NotSupported -> unknown): decisions then use the
        CPU affinity mask instead.
        """
        nv = self._pynvml
        words = nv.nvmlDeviceGetMemoryAffinity(handle, _NODE_SET_WORDS, _AFFINITY_SCOPE_NODE)
        nodes = [w * 64 + bit for w, mask in enumerate(words) for bit in range(64) if (int(mask) >> bit) & 1]
        if len(nodes) != 1:
            raise NvmlFailure(NOT_SUPPORTED, f"GPU memory affinity spans NUMA nodes {nodes or 'none'}")
        return nodes[0]

    @_translating
    def cpu_affinity(self, handle: Any) -> str:
        words = max(1, ((os.cpu_count() or 64) + 63) // 64)
        masks = self._pynvml.nvmlDeviceGetCpuAffinity(handle, words)
        return cpulist([w * 64 + bit for w, mask in enumerate(masks) for bit in range(64) if (int(mask) >> bit) & 1])

    @_translating
    def compute_processes(self, handle: Any) -> list[tuple[int, int | None]]:
        procs = self._pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]

    @_translating
    def process_name(self, pid: int) -> str:
        return _text(self._pynvml.nvmlSystemGetProcessName(pid))

    def nvlink_remotes(self, handle: Any) -> list[tuple[str, bool]]:
        """(remote PCI bus id, remote is an NVSwitch) for each active NVLink of this GPU."""
        nv = self._pynvml
        remotes: list[tuple[str, bool]] = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                bus_id = normalize_bus_id(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except nv.NVMLError as error:
                if getattr(error, "value", None) in (3, 2):  # NotSupported / InvalidArgument: no more links
                    break
                raise _failure(error) from None
            try:
                is_switch = nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH
            except nv.NVMLError:  # older drivers: no device type query, links then go GPU to GPU
                is_switch = False
            remotes.append((bus_id, is_switch))
        return remotes

    @_translating
    def topology_common_ancestor(self, h1: Any, h2: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetTopologyCommonAncestor(h1, h2))

    @_translating
    def p2p_status(self, h1: Any, h2: Any, capability: str) -> int:
        return int(self._pynvml.nvmlDeviceGetP2PStatus(h1, h2, _P2P_CAPS[capability]))

    @_translating
    def clock_event_reasons(self, handle: Any) -> int:
        nv = self._pynvml
        query = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if query is not None:
            try:
                return int(query(handle))
            except nv.NVMLError_FunctionNotFound:  # older driver: fall back to the old name
                pass
        return int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle))

    @_translating
    def sm_clock_mhz(self, handle: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetClockInfo(handle, self._pynvml.NVML_CLOCK_SM))

    @_translating
    def sm_clock_max_mhz(self, handle: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetMaxClockInfo(handle, self._pynvml.NVML_CLOCK_SM))

    @_translating
    def temperature_c(self, handle: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetTemperature(handle, self._pynvml.NVML_TEMPERATURE_GPU))

    @_translating
    def utilization_pct(self, handle: Any) -> tuple[int, int]:
        rates = self._pynvml.nvmlDeviceGetUtilizationRates(handle)
        return int(rates.gpu), int(rates.memory)

    @_translating
    def pcie_link(self, handle: Any) -> tuple[int, int]:
        nv = self._pynvml
        return int(nv.nvmlDeviceGetCurrPcieLinkGeneration(handle)), int(nv.nvmlDeviceGetCurrPcieLinkWidth(handle))

    # -- GPU health (hardware/health.py) ------------------------------------------------------
    @_translating
    def ecc_error_count(self, handle: Any, uncorrected: bool, aggregate: bool) -> int:
        """Total ECC errors: corrected (single-bit) or uncorrected (double-bit), since the driver loaded (volatile) or
        over the board's life (aggregate). NotSupported on boards without ECC or with ECC off (GeForce)."""
        nv = self._pynvml
        error_type = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED if uncorrected else nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
        counter = nv.NVML_AGGREGATE_ECC if aggregate else nv.NVML_VOLATILE_ECC
        return int(nv.nvmlDeviceGetTotalEccErrors(handle, error_type, counter))

    @_translating
    def retired_page_count(self, handle: Any, double_bit: bool) -> int:
        """Pages retired for a double-bit error or for repeated single-bit errors (before Ampere; Ampere and later
        remap rows instead and answer NotSupported)."""
        nv = self._pynvml
        cause = (nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR if double_bit
                 else nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        return len(nv.nvmlDeviceGetRetiredPages(handle, cause))

    @_translating
    def retired_pages_pending(self, handle: Any) -> bool:
        return int(self._pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == self._pynvml.NVML_FEATURE_ENABLED

    @_translating
    def remapped_rows(self, handle: Any) -> tuple[int, int, bool, bool]:
        corrected, uncorrected, pending, failed = self._pynvml.nvmlDeviceGetRemappedRows(handle)
        return int(corrected), int(uncorrected), bool(pending), bool(failed)

    @_translating
    def pcie_replay_count(self, handle: Any) -> int:
        return int(self._pynvml.nvmlDeviceGetPcieReplayCounter(handle))

    def active_nvlinks(self, handle: Any) -> list[int]:
        """The NVLinks that are up; NotSupported on a GPU without NVLink (the first link already refuses)."""
        nv = self._pynvml
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) == nv.NVML_FEATURE_ENABLED:
                    links.append(link)
            except nv.NVMLError as error:
                if getattr(error, "value", None) in (3, 2) and link > 0:  # no more links
                    break
                raise _failure(error) from None
        return links

    @_translating
    def nvlink_error_counts(self, handle: Any, link: int) -> tuple[int, int, int, int]:
        nv = self._pynvml
        return tuple(int(nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)) for counter in (
            nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY, nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            nv.NVML_NVLINK_ERROR_DL_CRC_DATA))

    @_translating
    def xid_event_set(self) -> Any:
        return self._pynvml.nvmlEventSetCreate()

    @_translating
    def register_xid_events(self, handle: Any, event_set: Any) -> None:
        self._pynvml.nvmlDeviceRegisterEvents(handle, self._pynvml.nvmlEventTypeXidCriticalError, event_set)
        try:  # its index now, while the GPU answers: after an XID 79 (off the bus) it may not
            self._xid_indices[_handle_key(handle)] = int(self._pynvml.nvmlDeviceGetIndex(handle))
        except self._pynvml.NVMLError:
            pass

    def next_xid_event(self, event_set: Any) -> tuple[int, int] | None:
        """The next XID the driver queued on ``event_set`` as (NVML index, XID), without waiting (timeout 0): None
        when nothing is pending (NVML's Timeout)."""
        nv = self._pynvml
        try:
            data = nv.nvmlEventSetWait_v2(event_set, 0)
            if data.eventType != nv.nvmlEventTypeXidCriticalError:
                return None
            index = self._xid_indices.get(_handle_key(data.device))
            return (int(nv.nvmlDeviceGetIndex(data.device)) if index is None else index), int(data.eventData)
        except nv.NVMLError as error:
            if getattr(error, "value", None) == nv.NVML_ERROR_TIMEOUT:
                return None
            raise _failure(error) from None

    @_translating
    def free_event_set(self, event_set: Any) -> None:
        self._pynvml.nvmlEventSetFree(event_set)


def _handle_key(handle: Any) -> Any:
    """A device handle by the address it points to (an event's ``device`` is a new ctypes object for the same GPU)."""
    if isinstance(handle, (ctypes._Pointer, ctypes.c_void_p)):
        return ctypes.cast(handle, ctypes.c_void_p).value
    try:
        hash(handle)
        return handle
    except TypeError:
        return id(handle)
