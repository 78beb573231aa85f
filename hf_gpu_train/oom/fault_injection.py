"""A fault injector that raises a real ``torch.OutOfMemoryError`` when a micro-batch is too large.

Usable on the CPU, so recovery is tested without a GPU::

    injector = OOMFaultInjector(max_batch=4)                     # any batch above 4 samples "does not fit"
    injector = OOMFaultInjector(max_batch=4, rank=1, phase="backward")   # only on rank 1, during backward
    injector.install(model)

``phase="forward"`` raises from a forward pre-hook of the model; ``phase="backward"`` raises from a
gradient hook on the output of the model's first layer with trainable weights, i.e. late in
``loss.backward()``, after the later layers have already added their gradients (as a real OOM part-way
through backward leaves them); when that output needs no gradient, from the model's output. ``times`` limits how
many OOMs it raises (None: every time the batch is too large); ``start_after`` lets that many training
forwards pass first (an OOM in the middle of a run, e.g. on a long batch).
"""

from __future__ import annotations

import os

import torch

from .microbatch import batch_size


class OOMFaultInjector:
    def __init__(self, max_batch: int, rank: int | None = None, phase: str = "forward", times: int | None = None,
                 eval_too: bool = False, start_after: int = 0):
        if phase not in ("forward", "backward"):
            raise ValueError("phase must be 'forward' or 'backward'")
        self.max_batch = max_batch
        self.rank = rank
        self.phase = phase
        self.times = times
        self.eval_too = eval_too
        self.raised = 0
        self.start_after = start_after  # training forwards that pass before the injector arms (an OOM mid-run)
        self._forwards = 0
        self._handles = []

    def _armed(self, module: torch.nn.Module) -> bool:
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return False
        if self.times is not None and self.raised >= self.times:
            return False
        if self.start_after and self._forwards <= self.start_after:  # counted before this check: the first start_after pass
            return False
        return module.training or self.eval_too

    def _error(self, size: int) -> torch.OutOfMemoryError:
        self.raised += 1
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by OOMFaultInjector: batch {size} > {self.max_batch}, "
            f"phase {self.phase})")

    def install(self, model: torch.nn.Module) -> OOMFaultInjector:
        armed_size: list[int | None] = [None]  # the batch size of the forward in progress, when it must fail in backward

        def fail_in_backward(tensor: torch.Tensor, size: int) -> bool:
            if not (isinstance(tensor, torch.Tensor) and tensor.requires_grad):
                return False
            injector = self

            def fail(grad):
                raise injector._error(size)

            tensor.register_hook(fail)
            armed_size[0] = None
            return True

        def pre_forward(module, args, kwargs):
            size = _size(args, kwargs)
            if module.training:
                self._forwards += 1
            armed_size[0] = None
            if size is None or size <= self.max_batch or not self._armed(module):
                return None
            if self.phase == "forward":
                raise self._error(size)
            armed_size[0] = size
            return None

        def first_layer_output(module, args, output):
            if armed_size[0] is not None:
                fail_in_backward(_first_tensor(output), armed_size[0])

        def model_output(module, args, kwargs, output):
            if armed_size[0] is not None:  # the first layer's output needed no gradient
                fail_in_backward(_first_tensor(output), armed_size[0])
            armed_size[0] = None

        self._handles = [model.register_forward_pre_hook(pre_forward, with_kwargs=True),
                         model.register_forward_hook(model_output, with_kwargs=True)]
        first = _first_trainable_layer(model)
        if self.phase == "backward" and first is not None and first is not model:
            self._handles.append(first.register_forward_hook(first_layer_output))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _first_trainable_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            return module
    return None


def _size(args, kwargs) -> int | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, dict):
            try:
                return batch_size(value)
            except ValueError:
                continue
    return None


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "values"):
        for key in ("logits", "loss"):
            value = output.get(key) if hasattr(output, "get") else None
            if isinstance(value, torch.Tensor):
                return value
        for value in output.values():
            if isinstance(value, torch.Tensor):
                return value
    if isinstance(output, (tuple, list)):
        for value in output:
            if isinstance(value, torch.Tensor):
                return value
    return None
