"""Recognise out-of-memory errors and cut a batch into micro-batches."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Only allocation failures count. cuDNN's CUDNN_STATUS_NOT_SUPPORTED also appears when no algorithm fits
# its workspace, but far more often for non-contiguous inputs or unsupported shapes: a different bug that
# a smaller micro-batch would hide, so it surfaces as itself.
OOM_MARKERS = (
    "out of memory",  # CUDA: "CUDA out of memory. Tried to allocate ...", "CUDA error: out of memory"
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
)


def is_oom_error(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    distributed_error = getattr(torch.distributed, "DistBackendError", None)
    if distributed_error is not None and isinstance(error, distributed_error):
        return False  # NCCL's "Cuda failure 'out of memory'": the communicator is broken; a retry on it would hang
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in OOM_MARKERS)


def describe_oom(error: BaseException) -> str:
    """One line to keep from the error, so the exception (and the tensors its traceback holds) can go."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def batch_size(inputs: Mapping[str, Any]) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("cannot find the batch dimension: no tensor in the inputs")


def slice_batch(inputs: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Samples ``start:stop``: tensors (and lists) with the batch as first dimension are sliced, anything
    else is passed as it is."""
    size = batch_size(inputs)
    chunk = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
            chunk[key] = value[start:stop]
        elif isinstance(value, list) and len(value) == size:
            chunk[key] = value[start:stop]
        else:
            chunk[key] = value
    return chunk


def split_batch(inputs: Mapping[str, Any], micro: int) -> list[dict[str, Any]]:
    """Slices of at most ``micro`` samples."""
    size = batch_size(inputs)
    return [slice_batch(inputs, start, min(size, start + micro)) for start in range(0, size, micro)]


def loss_items(inputs: Mapping[str, Any]) -> int:
    """What a loss over these inputs averages over: labelled tokens for token-level labels (-100 ignored),
    samples otherwise. Weighs the losses of evaluation micro-batches."""
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() > 1:
        return int(labels.ne(-100).sum())
    return batch_size(inputs)
