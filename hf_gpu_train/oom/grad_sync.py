"""Gradient averaging for the OOM recovery under DDP: DDP's overlap, with a state this package owns.

DDP's reducer all-reduces gradient buckets while backward is still running. A rank that runs out of
memory in forward never starts that backward, one that fails in backward stops half-way, and the other
ranks wait forever in the bucket all-reduces they already launched. Which buckets fired is private to
DDP's C++ reducer, so a failing rank cannot finish DDP's round for it. The recovery therefore runs
forward and backward under ``no_sync`` and averages gradients with this class:

- buckets are fixed once, from the trainable parameters in reverse order (the order backward produces
  gradients, as DDP does), ~25 MiB each and one dtype each: identical on every rank, whatever each rank
  computed (never built from ``p.grad is not None``, which differs between ranks that used different
  parameters);
- during the armed backward (the last one of an optimizer step) a post-accumulate-grad hook per parameter
  counts what is ready and launches a bucket's all-reduce asynchronously as soon as it and every bucket
  before it are complete: communication overlaps the rest of backward, in the same order on every rank;
- ``finish`` launches the buckets still pending (a rank that failed sends what it has, or zeros), then
  one small ballot (``lockstep.py``, on a gloo group of its own) carries every rank's vote: failed, cannot fit even
  one sample, a hook fired twice (reentrant checkpointing), the micro-batch it can run, and which parameters it
  gave a gradient to;
- only when no rank failed are the averaged gradients written into ``.grad`` (a parameter no rank used
  keeps ``grad=None``, as DDP leaves it); otherwise ``.grad`` stays as this rank computed it, so a rank
  that did not fail need not compute again, only reduce again.

Cost against plain DDP: the same bucketed, overlapped all-reduces, one copy of each gradient into its
bucket, and one small CPU all-reduce per micro-step (the ballot).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..collectives.wrappers import broadcast_from_rank_0, raw
from .lockstep import COST, END, Outcome

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
Vote = Outcome  # what a round's ballot decided (lockstep.py)


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    positions: list[int]  # index of each parameter in GradientReducer.params
    numel: int
    flat: torch.Tensor | None = None
    work: object | None = None
    ready: int = 0


class GradientReducer:
    def __init__(self, params: Iterable[torch.Tensor], world_size: int, device: torch.device, group=None,
                 bucket_bytes: int = BUCKET_BYTES):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = world_size
        self._share = 1.0 / world_size  # exact for a power of two: the average is bit for bit the sum's halving
        self.device = device
        self.group = group
        self.grad_events = 0  # every accumulation into a .grad, armed or not: did a backward touch the gradients?
        self.launched_in_backward = 0  # buckets whose all-reduce left while backward was still running (the overlap)
        self.overlap = True
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = _make_buckets(self.params, bucket_bytes)
        self._bucket_of = [0] * len(self.params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.positions:
                self._bucket_of[i] = b
        self._fired = [False] * len(self.params)
        self._next = 0
        self._armed = False
        self._open = False
        self._waited = False  # this round's buckets were launched and waited for (finish), not yet applied or dropped
        self._stale = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- one round: (arm, backward,) finish, then apply or discard ---------------------------------
    def _open_round(self) -> None:
        if self._open:
            return
        self._waited = False
        self._fired = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None
        self._next = 0
        self._stale = False
        self._open = True

    def arm(self) -> None:
        """The next backward is the last of this optimizer step: launch buckets as they fill."""
        self._open_round()
        self._armed = self.overlap

    def _on_grad(self, param: torch.Tensor) -> None:
        self.grad_events += 1
        if not self._armed:
            return
        began = time.perf_counter()
        try:
            self._count_ready(param)
        finally:
            COST.hook_s += time.perf_counter() - began

    def _count_ready(self, param: torch.Tensor) -> None:
        i = self._position[id(param)]
        if self._fired[i]:  # a second accumulation in one backward (reentrant checkpointing, shared weights)
            if self._bucket_of[i] < self._next:
                self._stale = True
            return
        self._fired[i] = True
        self.buckets[self._bucket_of[i]].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self._next)
            self.launched_in_backward += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.flat is None:  # allocated once and kept, as DDP keeps its buckets
            bucket.flat = torch.empty(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
        flat = bucket.flat
        offset = 0
        for p in bucket.params:
            view = flat[offset:offset + p.numel()]
            grad = p.grad
            if grad is None:
                view.zero_()
            else:
                if grad.data_ptr() == view.data_ptr():  # last round's average, accumulated into in place: keep it apart
                    grad = p.grad = grad.clone()
                # each rank's share of the average on its way in (one pass, as a copy would be): the bucket's sum is then
                # the average itself, and apply() hands it to .grad without another pass
                torch.mul(grad.reshape(-1), self._share, out=view)
            offset += p.numel()
        bucket.work = raw.all_reduce(flat, group=self.group, async_op=True)
        self._next = b + 1

    def launch_pending(self) -> None:
        """Launch every bucket not launched yet this round (a rank that failed sends what it has, or zeros): each rank
        launches each bucket exactly once per round, so the bucket all-reduces pair up whatever each rank computed."""
        self._open_round()
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)

    @property
    def stale(self) -> bool:
        return self._stale

    def used(self) -> list[bool]:
        return [p.grad is not None for p in self.params]

    def wait(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._open = False
        self._waited = True

    def complete_round(self) -> None:
        """End a round that will not be applied: every bucket launched once and waited for, then dropped. A rank whose
        ballot was the end of its micro-step has launched and waited already (``finish``); one stopped at a collective
        of the step launches what it has not, so each bucket's all-reduce pairs up once per round on every rank."""
        if not self._waited:
            self.launch_pending()
            self.wait()
        self.discard()

    def finish(self, lockstep, failed: bool = False, fatal: bool = False) -> Vote:
        """Launch what is pending, vote (``lockstep.py``: a ballot at the end of the micro-step), wait for every
        all-reduce. Every rank calls it once per round."""
        self.launch_pending()
        outcome = lockstep.ballot(END, failed=failed, fatal=fatal, stale=self._stale, used=self.used())
        self.wait()
        return outcome

    def apply(self, vote: Vote) -> None:
        """Hand the averages to ``.grad`` as views of the bucket (DDP's ``gradient_as_bucket_view``: no copy, measured
        ~50 ms a step for SmolLM2-135M on 2 CPU cores); a parameter no rank used keeps ``grad=None``. The next round
        copies out of a view accumulated into (``_launch``) before it writes the bucket."""
        began = time.perf_counter()
        with torch.no_grad():
            for bucket in self.buckets:
                offset = 0
                for p, i in zip(bucket.params, bucket.positions):
                    view = bucket.flat[offset:offset + p.numel()].view(p.shape)
                    offset += p.numel()
                    if not vote.used[i]:
                        continue
                    if p.is_contiguous():
                        p.grad = view
                    else:  # the parameter's own memory format (channels_last), as AccumulateGrad would make it
                        if p.grad is None:
                            p.grad = torch.empty_like(p)
                        p.grad.copy_(view)
        self.discard()
        COST.apply_s += time.perf_counter() - began

    def discard(self) -> None:
        for bucket in self.buckets:
            bucket.work = None
        self._waited = False


def _make_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    current: _Bucket | None = None
    size = 0
    for i in reversed(range(len(params))):  # backward produces the last layers' gradients first
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if current is not None and (size + nbytes > bucket_bytes or p.dtype != current.params[0].dtype
                                    or p.device != current.params[0].device):
            buckets.append(current)
            current, size = None, 0
        if current is None:
            current = _Bucket(params=[], positions=[], numel=0)
        current.params.append(p)
        current.positions.append(i)
        current.numel += p.numel()
        size += nbytes
    if current is not None:
        buckets.append(current)
    return buckets


def broadcast_buffers(model: torch.nn.Module, group=None) -> None:
    """DDP's buffer sync (rank 0's BatchNorm statistics, position ids ...) as one broadcast per dtype."""
    if not getattr(model, "broadcast_buffers", True):
        return
    broadcast_from_rank_0(list(getattr(model, "modules_buffers", None) or getattr(model, "module", model).buffers()), group)
