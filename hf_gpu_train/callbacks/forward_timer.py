"""This rank's own forward time per window (``loop/forward_time_s``).

On CUDA a host clock around ``forward`` measures kernel *launches*, not the work (kernels run
asynchronously), so the time there comes from ``torch.cuda.Event`` pairs recorded on the stream and
read at log steps; on the CPU the work is synchronous and ``perf_counter`` is right. Training
forwards only (evaluation runs with the model in eval mode).
"""

from __future__ import annotations

import time
from typing import Any

import torch

MAX_OPEN_PAIRS = 1024  # fold finished event pairs beyond this, so a long logging interval holds little


class ForwardTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[Any, Any]] = []
        self._start: Any = None
        self._seconds = 0.0
        self._count = 0
        self._handles: list[Any] = []

    def install(self, model: torch.nn.Module) -> ForwardTimer:
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module, args) -> None:
        # training forwards only: not a reference model's pass (DPO), a generation's decode step (GRPO) or a probe
        if not module.training or not torch.is_grad_enabled():
            self._start = None
            return
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def _after(self, module, args, output) -> None:
        if not module.training or self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._start, end))
            if len(self._pairs) > MAX_OPEN_PAIRS:
                self._fold(finished_only=True)
        else:
            self._seconds += time.perf_counter() - self._start
        self._count += 1
        self._start = None

    def _fold(self, finished_only: bool) -> None:
        keep = []
        for start, end in self._pairs:
            if finished_only and not end.query():
                keep.append((start, end))
            else:
                self._seconds += start.elapsed_time(end) / 1000.0
        self._pairs = keep

    def take(self) -> tuple[float, int]:
        """(seconds in training forwards, forward calls) since the last take. On CUDA this waits for the
        last recorded forward to finish: call it at log steps only."""
        if self._pairs:
            self._pairs[-1][1].synchronize()
            self._fold(finished_only=False)
        out = (self._seconds, self._count)
        self._seconds, self._count = 0.0, 0
        return out
