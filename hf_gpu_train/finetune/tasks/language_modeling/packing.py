"""Padding-free packing: tokenized examples packed into rows of at most ``max_length`` tokens, each example with
its own ``position_ids`` (0, 1, 2, ... restarting at every example), no attention mask.

Why rows of ``max_length`` and not one long row per batch (``DataCollatorWithFlattening``): with SDPA or eager
attention transformers builds a block-diagonal mask from the restarting ``position_ids``, of size rows x T x T,
and computes attention over all of it; a batch flattened into one row of B x T tokens costs B times the mask memory
and the attention work. A batch of rows also splits along its first dimension, which the in-place OOM recovery
(``oom/recovery.py``) does: each row holds whole examples, so its micro-batches stay exact. (A single packed row,
``per_device_train_batch_size=1``, cannot be split: the recovery then stops with its remedies.)

Rows are filled best-fit-decreasing (longest example first, into the fullest row it still fits), once, over the
tokenized split: rows come out nearly full, so little is padded, and the same rows serve every epoch and any number
of processes. ``per_device_train_batch_size`` then counts rows.

Whether attention keeps examples apart is proven, not assumed: ``packing_support`` runs the model on two packed
examples and checks that changing the first does not change the logits of the second. (It does not, for Llama with
sdpa and eager attention, as long as ``use_cache=False``: with a cache, transformers skips the packed-sequence
detection and the second example attends to the first; the collators pass ``use_cache=False``.
tests/finetune/tasks/language_modeling/test_packing.py proves each packed example's logits equal the example's alone.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .encode import IGNORE
from .model_probe import agreed, probe_tokens, why_not_runnable

# attention implementations whose transformers mask follows restarting position_ids in a batch of several rows. Not
# flash-attention: transformers 5.24 finds packed sequences for its varlen kernel only in a batch of one row
# (``_is_packed_sequence``); in [rows, T] batches without a mask it attends across examples.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``; each length must be <= capacity.

    Bins are kept by free space (a sorted list of the free-space values that have bins, at most ``capacity`` of them),
    so each placement is a bisection: O(n log capacity) for n examples."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free_values: list[int] = []  # sorted free-space values that have at least one bin
    bins_with: dict[int, list[int]] = {}  # free space -> bins with exactly that much
    bins: list[list[int]] = []
    for i in order:
        need = lengths[i]
        if need > capacity:
            raise ValueError(f"example {i} has {need} tokens, more than the row capacity {capacity}")
        k = bisect.bisect_left(free_values, need)
        if k < len(free_values):
            free = free_values[k]
            target = bins_with[free].pop()
            if not bins_with[free]:
                del bins_with[free]
                free_values.pop(k)
        else:
            free, target = capacity, len(bins)
            bins.append([])
        bins[target].append(i)
        left = free - need
        if left > 0:
            if left not in bins_with:
                bisect.insort(free_values, left)
                bins_with[left] = []
            bins_with[left].append(target)
    return bins


@dataclass(frozen=True)
class PackingReport:
    examples: int
    rows: int
    tokens: int
    capacity: int

    @property
    def fill(self) -> float:
        return self.tokens / (self.rows * self.capacity) if self.rows else 0.0

    def note(self, split: str) -> str:
        return (f"packed {self.examples} {split} examples into {self.rows} rows of up to {self.capacity} tokens "
                f"({self.fill:.1%} filled, {self.tokens} tokens)")


def list_column(ds, name: str):
    """A list column as one pyarrow ListArray (its flat values and offsets), without a Python object per row."""
    return ds.data.column(name).combine_chunks()


def lengths_of(ds, name: str = "input_ids") -> list[int]:
    import pyarrow.compute as pc

    return pc.list_value_length(list_column(ds, name)).to_pylist()


def pack_dataset(ds, capacity: int):
    """(dataset of packed rows: ``input_ids``, ``labels``, ``position_ids``; PackingReport).

    Each example's first label becomes -100: in a row it would be the target of the previous example's last token.
    Vectorised over the flat token arrays (100k examples of 46M tokens in seconds, not a Python loop per token)."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset
    from datasets.fingerprint import generate_random_fingerprint

    lengths = lengths_of(ds)
    bins = best_fit_decreasing(lengths, capacity)
    order = np.fromiter((i for members in bins for i in members), dtype=np.int64, count=len(lengths))
    ids = list_column(ds, "input_ids").take(pa.array(order)).flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    labels = list_column(ds, "labels").take(pa.array(order)).flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    ordered = np.asarray(lengths, dtype=np.int64)[order]
    starts = np.concatenate([[0], np.cumsum(ordered)[:-1]])  # where each example begins in the flat arrays
    labels[starts] = IGNORE
    positions = np.arange(len(ids), dtype=np.int64) - np.repeat(starts, ordered)
    row_tokens = np.fromiter((sum(lengths[i] for i in members) for members in bins), dtype=np.int64, count=len(bins))
    offsets = pa.array(np.concatenate([[0], np.cumsum(row_tokens)]).astype(np.int32))
    table = pa.table({name: pa.ListArray.from_arrays(offsets, pa.array(values))
                      for name, values in (("input_ids", ids), ("labels", labels), ("position_ids", positions))})
    report = PackingReport(examples=len(lengths), rows=len(bins), tokens=int(row_tokens.sum()), capacity=capacity)
    return Dataset(table, fingerprint=generate_random_fingerprint()), report  # not hashed: nothing maps it


@dataclass(frozen=True)
class PackingVerdict:
    supported: bool
    reason: str


def _base(model):
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def packing_support(model, pad_token_id: int) -> PackingVerdict:
    """Can this model train on packed rows? The attention implementation must follow restarting ``position_ids``, and,
    where running the model is cheap, it is run: two examples packed in one row, then the first replaced by other
    tokens; the second example's logits must not move (within 1e-3 of their scale: exact zeros in the softmax make
    them equal in practice, while an example that sees its neighbour moves by far more)."""
    import torch

    from .collate import PackedCollator

    base = _base(model)
    implementation = getattr(base.config, "_attn_implementation", None) or "eager"
    if implementation not in PACKING_ATTENTION:
        return PackingVerdict(False, f"attn_implementation={implementation!r} is not known to keep packed examples apart in a "
                                     "batch of several rows")
    not_runnable = why_not_runnable(base)
    if not_runnable:
        return PackingVerdict(True, f"{implementation} attention with restarting position_ids ({not_runnable}, so not run)")
    device = base.get_input_embeddings().weight.device
    vocab = base.get_input_embeddings().num_embeddings
    first, other, second = (probe_tokens(vocab, n, offset) for offset, n in ((11, 5), (23, 5), (37, 6)))
    collate = PackedCollator(pad_token_id)
    rows = [{"input_ids": a + second, "labels": a + second, "position_ids": list(range(5)) + list(range(6))} for a in (first, other)]
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            # two rows per batch, as training sees them: some kernels keep examples apart in a batch of one row only
            logits = [base(**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in collate([row, row]).items()
                              if k != "labels"}).logits[0, 5:].float() for row in rows]
    except (TypeError, ValueError, RuntimeError) as error:  # a model that takes no position_ids, or cannot run here
        return PackingVerdict(False, f"the model cannot run packed rows ({type(error).__name__}: {str(error).splitlines()[0]})")
    finally:
        base.train(was_training)
    moved = float((logits[0] - logits[1]).abs().max())
    scale = max(1.0, float(logits[0].abs().max()))
    if moved > 1e-3 * scale:
        return PackingVerdict(False, f"with attn_implementation={implementation!r} a packed example's logits change with the "
                                     f"example before it (by {moved:.3g}): attention crosses example boundaries")
    return PackingVerdict(True, f"{implementation} attention keeps packed examples apart (checked on this model)")


def agreed_packing_support(model, pad_token_id: int) -> PackingVerdict:
    """``packing_support`` as every rank must take it: the same on all. Ranks see different things (under FSDP's
    rank-0-only loading only local rank 0 holds real weights and can run the check; the others see ``meta`` weights),
    and a rank that packs while another pads runs another number of steps: a hang. Any rank's refusal is everyone's."""

    verdict = packing_support(model, pad_token_id)
    return PackingVerdict(*agreed(verdict.supported, verdict.reason, "every rank pads"))
