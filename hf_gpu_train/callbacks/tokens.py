"""Count the input tokens this process trains on, with no host sync and no collective per step.

Why not the Trainer's ``include_num_input_tokens_seen``: it gathers the count across processes and
calls ``.item()`` after every micro-step, a device sync and a collective in the hot loop. Here a
forward pre-hook adds ``attention_mask.sum()`` (non-padding tokens) into a tensor on the model's
device, or ``input_ids.numel()`` on the host when there is no 2-D mask (padding-free packed batches);
the caller reads it once per log step and reduces it across ranks then. The Trainer's own counter
is never read, so a user who turned it on is not counted twice.

The in-place OOM recovery (``training/oom.py``) may run one batch as several micro-batch forwards,
and after an OOM retries the *same* batch from its first row. Chunks are views of the batch, so a
chunk that starts at the batch's first row (same ``data_ptr``) means a new attempt: the count of the
failed attempt is dropped, and the batch counts once. ``micro_step_done`` closes a micro-step.
"""

from __future__ import annotations

from typing import Any

import torch


class TokenCounter:
    def __init__(self) -> None:
        self._device_total: torch.Tensor | None = None  # committed non-padding counts, on the model's device
        self._host_total = 0  # committed counts known on the host (numel of unmasked input_ids)
        self._attempt: list[torch.Tensor] = []  # this micro-step's counts since its latest (re)start
        self._attempt_host = 0
        self._first_ptr: int | None = None
        self._handle: Any = None
        self.counted_any = False

    def install(self, model: torch.nn.Module) -> TokenCounter:
        self._handle = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        return self

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _before_forward(self, module, args, kwargs):
        if not module.training:
            return None
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids")
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        ids = ids if isinstance(ids, torch.Tensor) else None
        lead = mask if mask is not None else ids
        if lead is None:
            return None
        ptr = lead.data_ptr()
        if self._first_ptr is None:
            self._first_ptr = ptr
        elif ptr == self._first_ptr:  # the batch again from its first row: a retry, the earlier attempt does not count
            self._attempt, self._attempt_host = [], 0
        if mask is not None:
            self._attempt.append(mask.sum(dtype=torch.int64))
        else:
            self._attempt_host += ids.numel()
        self.counted_any = True
        return None

    def micro_step_done(self) -> None:
        for count in self._attempt:
            self._device_total = count if self._device_total is None else self._device_total + count
        self._host_total += self._attempt_host
        self._attempt, self._attempt_host, self._first_ptr = [], 0, None

    def take(self) -> int:
        """Tokens since the last take (this process). One device sync: call it at log steps only."""
        self.micro_step_done()
        total = self._host_total + (int(self._device_total.item()) if self._device_total is not None else 0)
        self._device_total, self._host_total = None, 0
        return total
