"""Batches for causal LMs: packed rows (no attention mask) or examples padded to the longest in the batch.

Both pass ``use_cache=False``: a model that builds a KV cache in its forward skips transformers' packed-sequence
detection (so packed examples would attend to each other), and a cache is wasted memory in training and evaluation.

Packed rows are padded to the longest row of the batch. The padding gets its own ``position_ids`` (0, 1, ...), so it
is a separate pseudo-example that no real token attends to, with labels -100. Rows of one batch all start at
position 0, so no pad ever continues an example.
"""

from __future__ import annotations

import torch

from .encode import IGNORE


def _width(rows, pad_to_multiple_of: int | None) -> int:
    longest = max(len(r["input_ids"]) for r in rows)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    return longest


class _RightPadded:
    """Rows right-padded to the longest (a multiple of ``pad_to_multiple_of``): ids with the pad token, labels ignored."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def _ids_and_labels(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        width = _width(rows, self.pad_to_multiple_of)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for r, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[r, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
            labels[r, :n] = torch.tensor(row["labels"], dtype=torch.long)
        return input_ids, labels


class PackedCollator(_RightPadded):
    """Packed rows (``input_ids``, ``labels``, ``position_ids``) -> a [rows, T] batch without attention mask."""

    packs_examples = True

    def __call__(self, rows: list[dict]) -> dict:
        input_ids, labels = self._ids_and_labels(rows)
        positions = torch.arange(input_ids.shape[1], dtype=torch.long).repeat(len(rows), 1)
        for r, row in enumerate(rows):
            n = len(row["input_ids"])
            positions[r, :n] = torch.tensor(row["position_ids"], dtype=torch.long)
            positions[r, n:] -= n  # the padding restarts at 0: a pseudo-example of its own
        return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "use_cache": False}


class PaddingCollator(_RightPadded):
    """Examples (``input_ids``, ``labels``) -> right-padded ``input_ids``, ``attention_mask``, ``labels``."""

    packs_examples = False

    def __call__(self, rows: list[dict]) -> dict:
        input_ids, labels = self._ids_and_labels(rows)
        mask = torch.zeros_like(input_ids)
        for r, row in enumerate(rows):
            mask[r, :len(row["input_ids"])] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "use_cache": False}
