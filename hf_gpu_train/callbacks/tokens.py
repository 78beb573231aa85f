"""Count the input tokens this process trains on, with no host sync and no collective per step.

Why not the Trainer's ``include_num_input_tokens_seen``: it gathers the count across processes and
calls ``.item()`` after every micro-step, a device sync and a collective in the hot loop. Here a
forward pre-hook adds ``attention_mask.sum()`` (non-padding tokens) into a tensor on the model's
device, or ``input_ids.numel()`` on the host when there is no 2-D mask (padding-free packed batches);
the caller reads it once per log step and reduces it across ranks then. The Trainer's own counter
is never read, so a user who turned it on is not counted twice.

Only training forwards count: forwards with autograd on. A trainer that generates (TRL's GRPO generates with the
model in training mode) or scores with a reference (DPO with a PEFT model disables the adapter for a second,
no-grad forward) runs other forwards through the same module; decode steps of a generation are counted apart, as
generated tokens. Packed rows (``position_ids`` restarting at every example, no mask) end with padding that
restarts at 0 as a pseudo-example of its own: that trailing segment, when it is all pad ids with no label, is not
counted (about 15% of a row for examples of 200-450 tokens at ``max_length`` 512).

The in-place OOM recovery (``oom/recovery.py``) may run one batch as several micro-batch forwards,
retry a micro-batch that failed, start a step again, or compute earlier micro-steps a second time. It numbers
the micro-batches it runs and voids the ones that will run again (``training.microbatch.CHUNKS``); each count
here carries that number, and only the ones still valid when the micro-step closes (``micro_step_done``) are
kept, so every sample counts once. Replayed micro-steps are not counted at all.
"""

from __future__ import annotations

from typing import Any

import torch

from ..oom.microbatch import CHUNKS, replaying


def packed_real_tokens(input_ids: torch.Tensor, position_ids: torch.Tensor, labels, pad_token_id) -> torch.Tensor:
    """Tokens of packed rows without the trailing padding segment, on the device (no host sync)."""
    rows, width = input_ids.shape
    has_labels = isinstance(labels, torch.Tensor) and labels.shape == input_ids.shape
    if (pad_token_id is None and not has_labels) or position_ids.shape != input_ids.shape:
        return torch.tensor(input_ids.numel(), device=input_ids.device)
    columns = torch.arange(width, device=input_ids.device)
    starts = torch.where(position_ids == 0, columns, torch.zeros_like(columns))
    last_start = starts.max(dim=1, keepdim=True).values  # the last segment of every row
    tail = columns >= last_start
    # the trailing segment is padding when it has no label (and is all pad ids, where the config names one)
    padding = torch.ones_like(tail) if pad_token_id is None else (input_ids == pad_token_id) | ~tail
    if has_labels:
        padding &= (labels == -100) | ~tail
    pad_tail = padding.all(dim=1)
    return (torch.full((rows,), width, device=input_ids.device) - torch.where(pad_tail, width - last_start[:, 0], 0)).sum()


class TokenCounter:
    def __init__(self) -> None:
        self._device_total: torch.Tensor | None = None  # committed non-padding counts, on the model's device
        self._host_total = 0  # committed counts known on the host (numel of unmasked input_ids)
        self._attempt: list[tuple[int, torch.Tensor | int]] = []  # this micro-step's counts, by micro-batch number
        self._handles: list[Any] = []
        self._in_outer = False  # a no-grad forward of the outer (PEFT) model is running: its base's hook stays quiet
        self.counted_any = False
        self.generated = 0  # decode steps' tokens of generations run through the model (host counts)

    def install(self, model: torch.nn.Module) -> TokenCounter:
        self._handles = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                         model.register_forward_hook(self._after_forward)]
        get_base = getattr(model, "get_base_model", None)
        base = get_base() if callable(get_base) else None
        if isinstance(base, torch.nn.Module) and base is not model:
            # a PEFT model generates through its base model's generate(), which never calls the PEFT model's forward
            self._handles.append(base.register_forward_pre_hook(self._before_base_forward, with_kwargs=True))
        return self

    def remove(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []

    def _after_forward(self, module, args, output):
        self._in_outer = False

    def _before_base_forward(self, module, args, kwargs):
        if torch.is_grad_enabled() or self._in_outer:
            return None
        self._count_generated(kwargs)
        return None

    def _count_generated(self, kwargs) -> None:
        ids = kwargs.get("input_ids")
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.24 passes it as ``cache``
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and cache is not None and ids.shape[1] == 1:
            self.generated += ids.shape[0]

    def _before_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        ids = ids if isinstance(ids, torch.Tensor) else None
        if not torch.is_grad_enabled():  # a generation's decode step, a reference model's pass, a probe
            self._count_generated(kwargs)
            self._in_outer = True  # the base model's hook (PEFT) must not count this forward again
            return None
        if not module.training or replaying():
            return None
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        lead = mask if mask is not None else ids
        if lead is None:
            return None
        positions = kwargs.get("position_ids")
        if mask is not None:
            count = mask.sum(dtype=torch.int64)
        elif isinstance(positions, torch.Tensor) and ids.dim() == 2:
            pad = getattr(getattr(module, "config", None), "pad_token_id", None)
            count = packed_real_tokens(ids, positions, kwargs.get("labels"), pad).to(torch.int64)
        else:
            count = ids.numel()
        self._attempt.append((CHUNKS.chunk, count))
        self.counted_any = True
        return None

    def micro_step_done(self) -> None:
        for chunk, count in self._attempt:
            if not CHUNKS.counts(chunk):
                continue
            if isinstance(count, int):
                self._host_total += count
            else:
                self._device_total = count if self._device_total is None else self._device_total + count
        self._attempt = []

    def take_generated(self) -> int:
        generated, self.generated = self.generated, 0
        return generated

    def take(self) -> int:
        """Tokens since the last take (this process). One device sync: call it at log steps only."""
        self.micro_step_done()
        total = self._host_total + (int(self._device_total.item()) if self._device_total is not None else 0)
        self._device_total, self._host_total = None, 0
        return total
