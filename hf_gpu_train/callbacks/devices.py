"""This process's GPU, as NVML and torch see it.

Which NVML GPU does this process use? Matched by PCI bus id from the torch device, never by
assuming NVML index == CUDA index (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER reorder them).

torch's own view of GPU memory at a log step: allocated, reserved, peak, allocator retries, OOMs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hardware.backend import NvmlBackend, NvmlFailure, normalize_bus_id


def model_device(model: torch.nn.Module | None) -> torch.device:
    if model is None:
        return torch.device("cpu")
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def torch_bus_id(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    return normalize_bus_id(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")


def nvml_handles_for(backend: NvmlBackend, bus_ids: list[str]) -> dict[int, Any]:
    """{NVML index: handle} for the GPUs with these bus ids (an initialised backend)."""
    wanted = set(bus_ids)
    found: dict[int, Any] = {}
    try:
        for index in range(backend.device_count()):
            handle = backend.handle(index)
            if backend.pci_bus_id(handle) in wanted:
                found[index] = handle
    except NvmlFailure:
        pass
    return found


GIB = 2**30


def cuda_memory(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats(device)
    allocated = torch.cuda.memory_allocated(device) / GIB
    reserved = torch.cuda.memory_reserved(device) / GIB
    return {
        "torch/mem_allocated_gib": allocated,
        "torch/mem_reserved_gib": reserved,
        "torch/mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "torch/reserved_minus_allocated_gib": reserved - allocated,
        "torch/alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "torch/ooms": float(stats.get("num_ooms", 0)),
    }


def device_peak(device: torch.device) -> tuple[int | None, int | None]:
    """(peak bytes, device bytes): torch's peak reserved plus what torch does not hold (the CUDA context, other
    processes) as seen now, against the device's total: comparable with the planner's estimate, which counts the
    context. None on the CPU."""
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return int(torch.cuda.max_memory_reserved(device) + outside_torch), int(total)
