"""Recognise out-of-memory errors (and free what they held), and how a batch divides into samples: its layout (rows,
or a preference batch's pairs) slices it where the micro-batch policy's ranges say (``policy.py``)."""

from __future__ import annotations

import contextlib
import gc
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


def free_memory() -> None:
    """After an OOM, outside the ``except`` block that held the error (its traceback holds tensors: pytorch #18853)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def label_counts(inputs, shifted: bool = False) -> list[float] | None:
    """Labelled tokens per row (-100 ignored; ``shifted``: the positions after the first), or None without token labels."""
    labels = inputs.get("labels") if hasattr(inputs, "get") else None
    if not (isinstance(labels, torch.Tensor) and labels.dim() > 1):
        return None
    return [float(n) for n in (labels[:, 1:] if shifted else labels).ne(-100).flatten(1).sum(1).tolist()]


def loss_items(inputs: Mapping[str, Any], shifted: bool = False) -> int:
    """What a loss over these inputs averages over, read from the labels' shape: labelled tokens for token-level labels
    (-100 ignored; for a causal LM, ``shifted``, the positions after the first, as its loss reads them), samples
    otherwise. Weighs the losses of evaluation micro-batches before the training has asked the loss
    (``loss_scaling.probe_weighting``)."""
    counts = label_counts(inputs, shifted)
    return int(sum(counts)) if counts is not None else batch_size(inputs)


_REPLAYING = [0]


@contextlib.contextmanager
def replaying_micro_steps():
    """Marks forwards of micro-steps the OOM recovery computes a second time (their loss was already reported): the
    telemetry's token counter leaves them out, so a recovered step counts its tokens once."""
    _REPLAYING[0] += 1
    try:
        yield
    finally:
        _REPLAYING[0] -= 1


def replaying() -> bool:
    return _REPLAYING[0] > 0


class Rows:
    """A batch whose samples are its rows: the Trainer's, TRL's SFT, most custom collators."""

    def size(self, inputs: Mapping[str, Any]) -> int:
        return batch_size(inputs)

    def slice(self, inputs: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
        return slice_batch(inputs, start, stop)

    def take(self, inputs: Mapping[str, Any], samples: list[int]) -> dict[str, Any]:
        """The batch of these samples, in this order."""
        return _take_rows(inputs, batch_size(inputs), samples)

    def per_sample(self, per_row: list[float]) -> list[float]:
        """A figure per row (labelled tokens) as a figure per sample."""
        return list(per_row)


class Pairs(Rows):
    """A preference batch: the chosen completions' rows, then the rejected ones' in the same order (TRL's DPO collator;
    its loss pairs row i with row i + n). A sample is a pair: a micro-batch takes rows i:j of both halves, and tensors
    with one row per pair (precomputed reference log-probs) are sliced as they are."""

    def size(self, inputs: Mapping[str, Any]) -> int:
        rows = batch_size(inputs)
        if rows % 2:
            raise ValueError(f"a preference batch must hold chosen and rejected rows in two halves, got {rows} rows")
        return rows // 2

    def slice(self, inputs: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
        pairs = self.size(inputs)
        chunk = {}
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 2 * pairs:
                chunk[key] = torch.cat([value[start:stop], value[pairs + start:pairs + stop]])
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == pairs:
                chunk[key] = value[start:stop]
            elif isinstance(value, list) and len(value) == 2 * pairs:
                chunk[key] = value[start:stop] + value[pairs + start:pairs + stop]
            else:
                chunk[key] = value
        return chunk


    def take(self, inputs: Mapping[str, Any], samples: list[int]) -> dict[str, Any]:
        pairs = self.size(inputs)
        rows = [*samples, *(pairs + i for i in samples)]
        chunk = _take_rows(inputs, 2 * pairs, rows)
        # a tensor with one row per pair is told by its length in the inputs (in the chunk a pair-sized tensor of rows may
        # have as many rows as the inputs have pairs)
        return {k: (v[samples] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == pairs else chunk[k])
                for k, v in inputs.items()}

    def per_sample(self, per_row: list[float]) -> list[float]:
        pairs = len(per_row) // 2
        return [per_row[i] + per_row[pairs + i] for i in range(pairs)]


def _take_rows(inputs: Mapping[str, Any], rows: int, chosen: list[int]) -> dict[str, Any]:
    chunk = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            chunk[key] = value[chosen]
        elif isinstance(value, list) and len(value) == rows:
            chunk[key] = [value[i] for i in chosen]
        else:
            chunk[key] = value
    return chunk


PAIRED_TRAINERS = ("DPOTrainer", "CPOTrainer", "ORPOTrainer")  # TRL's trainers that concatenate chosen and rejected


def layout_for(trainer) -> Rows:
    """How this Trainer's batches divide into samples, by the trainer classes it is made from."""
    names = {cls.__name__ for cls in type(trainer).__mro__}
    return Pairs() if names & set(PAIRED_TRAINERS) else Rows()


class _ChunkLedger:
    """Which forwards of the current micro-step count: the OOM recovery numbers every micro-batch it runs and voids
    the ones that failed (their forward ran, or began, and will run again) or that a restart threw away; the
    telemetry's token counter tags each count with the number and leaves the voided ones out. Without the
    recovery every forward is micro-batch 0 and counts."""

    def __init__(self):
        self.chunk = 0
        self.void: set[int] = set()
        self.void_through = -1  # every micro-batch up to this number is void (a restart)

    def begin_micro_step(self) -> None:
        self.void.clear()

    def reset(self) -> None:
        self.void.clear()
        self.void_through = self.chunk - 1  # the current micro-batch number and later ones count

    def begin_chunk(self) -> None:
        self.chunk += 1

    def void_current(self) -> None:
        self.void.add(self.chunk)

    def void_all(self) -> None:
        self.void_through = self.chunk

    def counts(self, chunk: int) -> bool:
        return chunk > self.void_through and chunk not in self.void


CHUNKS = _ChunkLedger()
