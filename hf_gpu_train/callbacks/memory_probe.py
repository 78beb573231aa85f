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
