"""Build a ``HardwareProfile`` from an NVML backend and the host, never importing torch.

NVML missing, driver not loaded, a function the driver lacks, a query the GPU does not support:
each gives a CPU-only or partial profile with the reason recorded (``nvml_error`` or ``notes``),
never an exception. CUDA is never initialised here: NVML talks to the driver, not to the runtime.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations
from typing import Any

from .backend import INIT_FAILURE_CAUSES, NvmlBackend, NvmlFailure, safe_query
from .health import XidListener, read_health
from .host import detect_host
from .nvml import PynvmlBackend
from .profile import (
    P2P_STATUS_NAMES,
    TOPOLOGY_LEVELS,
    GpuInfo,
    GpuPair,
    GpuProcess,
    HardwareProfile,
    HostInfo,
    clock_event_reason_names,
)


def cuda_version_string(value: int | None) -> str | None:
    """NVML's integer CUDA driver version (12020) as ``12.2``."""
    if value is None:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


def default_backend() -> NvmlBackend:

    return PynvmlBackend()


def detect(backend: NvmlBackend | None = None, host: HostInfo | None = None) -> HardwareProfile:
    """Detect this machine (or whatever ``backend`` describes)."""
    backend = backend if backend is not None else default_backend()
    host = host if host is not None else detect_host()
    try:
        backend.init()
    except NvmlFailure as failure:
        cause = INIT_FAILURE_CAUSES.get(failure.kind, "NVML failed to initialise")
        return HardwareProfile(host=host, nvml_error=f"{cause} ({failure})")
    try:
        return _detect_initialised(backend, host)
    finally:
        try:
            backend.shutdown()
        except NvmlFailure:
            pass


def _detect_initialised(backend: NvmlBackend, host: HostInfo) -> HardwareProfile:
    errors: list[str] = []
    count = safe_query(backend.device_count, errors=errors)
    if count is None:
        return HardwareProfile(
            host=host,
            driver_version=safe_query(backend.driver_version, errors=errors),
            nvml_error="NVML started but could not count GPUs: " + "; ".join(errors or ["not supported"]),
        )
    handles: list[Any] = []
    gpus: list[GpuInfo] = []
    links: list[list[tuple[str, bool]]] = []
    for index in range(count):
        handle = safe_query(backend.handle, index, errors=errors)
        if handle is None:
            errors.append(f"GPU {index}: no handle, skipped (is it lost? check dmesg for Xid errors)")
            continue
        gpu, gpu_links = _detect_gpu(backend, index, handle, errors)
        handles.append(handle)
        gpus.append(gpu)
        links.append(gpu_links)
    pairs = _detect_pairs(backend, gpus, handles, links, errors)
    gpus = _with_health(backend, gpus, handles)
    return HardwareProfile(
        host=host,
        gpus=tuple(gpus),
        pairs=tuple(pairs),
        driver_version=safe_query(backend.driver_version, errors=errors),
        cuda_driver_version=cuda_version_string(safe_query(backend.cuda_driver_version, errors=errors)),
        notes=tuple(errors),
    )


def _detect_gpu(backend: NvmlBackend, index: int, handle: Any, errors: list[str]) -> tuple[GpuInfo, list[tuple[str, bool]]]:
    def q(fn, *args):
        return safe_query(fn, *args, errors=errors)

    memory = q(backend.memory_info, handle) or (0, None)
    power_mw = q(backend.power_limit_mw, handle)
    processes = []
    for pid, used in q(backend.compute_processes, handle) or []:
        processes.append(GpuProcess(pid=pid, name=q(backend.process_name, pid), used_memory_bytes=used))
    utilization = q(backend.utilization_pct, handle)
    pcie = q(backend.pcie_link, handle)
    remotes = q(backend.nvlink_remotes, handle) or []
    mig_now, mig_pending = q(backend.mig_mode, handle) or (None, None)
    # Only a GPU in MIG mode has MIG devices; None (not ()) when the driver cannot list them.
    mig_devices = q(backend.mig_devices, handle) if mig_now else None
    gpu = GpuInfo(
        index=index,
        name=q(backend.name, handle) or f"GPU {index}",
        uuid=q(backend.uuid, handle) or "",
        pci_bus_id=q(backend.pci_bus_id, handle) or "",
        memory_total_bytes=memory[0],
        memory_used_bytes=memory[1],
        compute_capability=q(backend.compute_capability, handle),
        power_limit_w=None if power_mw is None else power_mw / 1000.0,
        mig_enabled=mig_now,
        mig_pending_enabled=mig_pending,
        mig_instances=None if mig_devices is None else tuple(mig_devices),
        display_active=q(backend.display_active, handle),
        numa_node=q(backend.numa_node, handle),
        cpu_affinity=q(backend.cpu_affinity, handle),
        processes=tuple(processes),
        nvswitch_links=sum(1 for _, is_switch in remotes if is_switch),
        clock_event_reasons=clock_event_reason_names(q(backend.clock_event_reasons, handle)),
        sm_clock_mhz=q(backend.sm_clock_mhz, handle),
        sm_clock_max_mhz=q(backend.sm_clock_max_mhz, handle),
        temperature_c=q(backend.temperature_c, handle),
        utilization_pct=None if utilization is None else utilization[0],
        pcie_link_gen=None if pcie is None else pcie[0],
        pcie_link_width=None if pcie is None else pcie[1],
    )
    return gpu, remotes


def _with_health(backend: NvmlBackend, gpus: list[GpuInfo], handles: list[Any]) -> list[GpuInfo]:
    """Each GPU with its health reading (None when NVML tells nothing of it): ECC, retired pages, remapped rows,
    PCIe replays, NVLink errors, and the XIDs the driver queued while we listened."""
    listener = XidListener(backend, {gpu.index: handle for gpu, handle in zip(gpus, handles)})
    xids: dict[int, list[int]] = {index: [] for index in listener.registered}
    for index, xid in listener.drain():
        xids.setdefault(index, []).append(xid)
    listener.close()
    out = []
    for gpu, handle in zip(gpus, handles):
        health = read_health(backend, handle)
        health = replace(health, xids=tuple(xids[gpu.index]) if gpu.index in xids else None)
        out.append(replace(gpu, health=health if health.known else None))
    return out


def nvlinks_between(a: GpuInfo, a_remotes: list[tuple[str, bool]], b: GpuInfo) -> int:
    """Active NVLinks joining two GPUs: direct links (bridges, NVLink meshes) plus, when both
    sit on an NVSwitch fabric, the switch links (``nvidia-smi topo -m`` prints NV18 for every
    pair on an 8x H100 HGX board, NV12 on an 8x A100 one)."""
    direct = sum(1 for bus_id, is_switch in a_remotes if not is_switch and bus_id == b.pci_bus_id)
    switched = min(a.nvswitch_links, b.nvswitch_links) if a.nvswitch_links and b.nvswitch_links else 0
    return direct + switched


def _p2p_name(code: int | None) -> str | None:
    return None if code is None else P2P_STATUS_NAMES.get(code, f"status {code}")


def _detect_pairs(backend, gpus, handles, links, errors) -> list[GpuPair]:
    pairs = []
    for (i, a), (j, b) in combinations(enumerate(gpus), 2):
        level = safe_query(backend.topology_common_ancestor, handles[i], handles[j], errors=errors)
        pairs.append(
            GpuPair(
                a=a.index,
                b=b.index,
                topology=None if level is None else TOPOLOGY_LEVELS.get(level, f"level {level}"),
                nvlinks=nvlinks_between(a, links[i], b),
                p2p_read=_p2p_name(safe_query(backend.p2p_status, handles[i], handles[j], "read", errors=errors)),
                p2p_write=_p2p_name(safe_query(backend.p2p_status, handles[i], handles[j], "write", errors=errors)),
            )
        )
    return pairs
