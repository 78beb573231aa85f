"""``torch.distributed``'s collectives with wrappers of ours around them, and the collectives as torch defines them.

Two pieces of the toolkit watch the collectives anyone's code issues: the OOM recovery's ballots (``oom/lockstep.py``:
every rank passes one before a collective inside a recovered step) and the watchdog (``faults/watchdog.py``: which
collective a rank waits in, and how many it entered). Both wrap the same functions the same way, so the wrapping is
here, below both. Accelerate, TRL and most code look the collectives up on ``torch.distributed`` at call time, so they
reach the wrappers; one bound at import time (``from torch.distributed import all_reduce``) does not.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from .wait_clock import waiting

GATED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
         "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
         "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "all_reduce_coalesced",
         "all_gather_coalesced", "monitored_barrier")
# the collectives as torch defines them: this package's own (gradient buckets, ballots) never pass a wrapper
raw = SimpleNamespace(**{name: getattr(dist, name) for name in GATED if hasattr(dist, name)})


def on_default_group(kwargs) -> bool:
    """Whether a collective call runs on the default group (a sub-group's collective is not every rank's)."""
    return kwargs.get("group") in (None, dist.group.WORLD)


def wrap_collectives(mark: str, wrap) -> None:
    """Put ``wrap(name, collective)`` around each of ``torch.distributed``'s collectives not carrying ``mark`` yet
    (idempotent). The wrapper keeps the collective as ``__wrapped__``: it can be taken off again. Accelerate, TRL and
    most code look the collectives up on ``torch.distributed`` at call time, so they reach the wrapper."""
    for name in GATED:
        current = getattr(dist, name, None)
        if current is not None and not getattr(current, mark, False):
            wrapper = wrap(name, current)
            wrapper.__name__, wrapper.__wrapped__ = name, current
            setattr(wrapper, mark, True)
            setattr(dist, name, wrapper)


def unwrap_collectives(mark: str) -> None:
    """Take the wrappers carrying ``mark`` off again (each where it is outermost: one put on later stays)."""
    for name in GATED:
        current = getattr(dist, name, None)
        if getattr(current, mark, False):
            setattr(dist, name, current.__wrapped__)


def broadcast_from_rank_0(tensors: list, group=None) -> None:
    """Every rank's ``tensors`` become rank 0's: one broadcast per (device, dtype), in place, through the unwrapped
    collective (ours, not the training's: outside the OOM recovery's gate and the watchdog's count)."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            with waiting():  # a rank that arrives first waits here for the last: not its own work (arrivals.py)
                raw.broadcast(flat, src=0, group=group)
            offset = 0
            for tensor in same:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
