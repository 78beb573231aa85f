"""Small votes every rank takes together on the CPU: one all-reduce of a few integers on a gloo group, never a GPU
synchronisation. Every rank must call a vote at the same point of its code: only where every rank arrives, whatever
it decided.

With one process (or no process group) each vote returns this rank's own value, without a collective.
"""

from __future__ import annotations

from .wait_clock import waiting

CPU_GROUP: list = []  # the gloo group of the votes, made once (the preflight gives it the run's timeout afterwards)


def several_processes():
    """``torch.distributed`` when this process is one of a process group of several, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def cpu_group(dist, timeout=None):
    """None (the default group) where it takes CPU tensors, else a gloo group over every rank, made on first use: in
    the preflight (``timeout``: its short one, then the run's), or at every rank's first step's flags (the collective
    ``new_group`` is safe there: every rank reaches it in the same order)."""
    if dist.get_backend() == "gloo":
        return None
    if not CPU_GROUP:
        CPU_GROUP.append(dist.new_group(backend="gloo", **({"timeout": timeout} if timeout is not None else {})))
    return CPU_GROUP[0]


def any_rank(mine: bool) -> bool:
    """True on every rank when it is true on any (one all-reduce on the CPU; every rank must call it at the same
    point: only where every rank arrives whatever it decided)."""
    import torch

    dist = several_processes()
    if dist is None:
        return bool(mine)
    votes = torch.tensor([int(bool(mine))], dtype=torch.int32)
    with waiting():
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=cpu_group(dist))
    return bool(votes.item())


def lowest_and_highest(value: int, group=None) -> tuple[int, int]:
    """(the lowest, the highest) of ``value`` over every rank (one all-reduce on the CPU; every rank must call it at the
    same point). ``group``: a gloo group of the caller's own (None: the votes' group)."""
    import torch

    dist = several_processes()
    if dist is None:
        return value, value
    both = torch.tensor([-int(value), int(value)], dtype=torch.int64)
    with waiting():
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=cpu_group(dist) if group is None else group)
    return -int(both[0]), int(both[1])


def wait_for_every_rank() -> None:
    """A barrier on the CPU (a gloo all-reduce of one integer), for a step every rank takes on an agreed decision."""
    import torch

    dist = several_processes()
    if dist is not None:
        with waiting():
            dist.all_reduce(torch.zeros(1, dtype=torch.int32), group=cpu_group(dist))
