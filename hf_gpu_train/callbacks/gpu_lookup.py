"""Which NVML GPU does this process use? Matched by PCI bus id from the torch device, never by
assuming NVML index == CUDA index (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER reorder them)."""

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
