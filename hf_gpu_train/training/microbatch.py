"""Recognise out-of-memory errors and split a batch into micro-batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

OOM_MARKERS = (
    "out of memory",  # CUDA: "CUDA out of memory. Tried to allocate ..."
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN picks no algorithm when its workspace cannot be allocated
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDA error: out of memory",
)


def is_oom_error(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in OOM_MARKERS)


def batch_size(inputs: Mapping[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("cannot find the batch dimension: no tensor in the inputs")


def split_batch(inputs: Mapping[str, Any], micro: int) -> list[dict[str, Any]]:
    """Slices of at most ``micro`` samples; tensors (and lists) with the batch as first dimension are
    sliced, anything else is passed to every slice as it is."""
    size = batch_size(inputs)
    chunks = []
    for start in range(0, size, micro):
        stop = min(size, start + micro)
        chunk = {}
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
                chunk[key] = value[start:stop]
            elif isinstance(value, list) and len(value) == size:
                chunk[key] = value[start:stop]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks
