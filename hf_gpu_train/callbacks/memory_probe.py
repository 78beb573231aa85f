"""torch's own view of GPU memory at a log step: allocated, reserved, peak, allocator retries, OOMs."""

from __future__ import annotations

import torch

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
