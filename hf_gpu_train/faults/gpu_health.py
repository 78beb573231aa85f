"""Which rank's GPU said what: GPU health events (``hardware/health.py``) named with the rank in the hang and
dead-rank summaries, so "rank 3 died" reads "rank 3 died on GPU 5, which reported XID 79 (fallen off the bus): drain
the node and replace the GPU" and nobody restarts the job onto the same broken GPU.

Two watchers, each reading NVML on its own node and deciding nothing for another rank (no collective, no store):
- in each training process, ``RankGpu``: a ``HealthWatch`` of the one GPU this rank trains on (found by PCI bus id,
  never by assuming NVML index == CUDA index), polled when the hang report is written: its events travel in the
  rank's hang state to rank 0's summary. The rank also leaves its GPU's NVML index and bus id in the launcher's
  progress folder (``gpu-<rank>.json``).
- in ``hf-gpu-train launch``, ``node_watch()``: a ``HealthWatch`` of every GPU on the node, from before the training
  processes start until they end. A rank that died cannot report anything; the launcher, still alive, polls once
  and names each event with the rank(s) whose ``gpu-<rank>.json`` point at that GPU.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ..hardware.backend import NvmlBackend, NvmlFailure
from ..hardware.health import HealthEvent, HealthWatch
from ..hardware.nvml import PynvmlBackend
from ..launch.rank_report import write_rank_gpu


def _open(backend: NvmlBackend | None) -> NvmlBackend | None:
    """An initialised backend (the real NVML when none is given), or None where NVML does not start."""
    if backend is None:
        backend = PynvmlBackend()
    try:
        backend.init()
    except NvmlFailure:
        return None
    return backend


class RankGpu:
    """This rank's GPU and its health since the rank started watching it.

    ``RankGpu.watch(bus_id)`` returns None on a CPU rank, without NVML, or when no GPU has that bus id. ``events()``
    polls once and returns every event seen so far as dicts (for the hang state, which is JSON)."""

    def __init__(self, index: int, bus_id: str, watch: HealthWatch):
        self.index, self.bus_id, self._watch = index, bus_id, watch

    @classmethod
    def watch(cls, bus_id: str | None, backend: NvmlBackend | None = None) -> RankGpu | None:
        if not bus_id:
            return None
        backend = _open(backend)
        if backend is None:
            return None
        with contextlib.suppress(NvmlFailure):
            for index in range(backend.device_count()):
                handle = backend.handle(index)
                if backend.pci_bus_id(handle) == bus_id:
                    return cls(index, bus_id, HealthWatch(backend, {index: handle}))
        return None

    def events(self) -> list[dict[str, Any]]:
        self._watch.poll()
        return [event.to_dict() for event in self._watch.seen]

    def describe(self) -> dict[str, Any]:
        return {"gpu": self.index, "bus_id": self.bus_id}

    def record(self, rank: int, environ=os.environ) -> None:
        """Leave this rank's GPU in the launcher's progress folder (nothing when not launched by hf-gpu-train)."""
        write_rank_gpu(rank, self.describe(), environ)


def node_watch(backend: NvmlBackend | None = None) -> HealthWatch | None:
    """A ``HealthWatch`` of every GPU on this node (the launcher's), None where NVML does not start."""
    backend = _open(backend)
    if backend is None:
        return None
    handles = {}
    with contextlib.suppress(NvmlFailure):
        for index in range(backend.device_count()):
            handles[index] = backend.handle(index)
    return HealthWatch(backend, handles) if handles else None


def named_events(events: list[HealthEvent] | list[dict], rank_gpus: dict[int, int]) -> list[str]:
    """One line per event, naming the rank(s) on that GPU: ``rank 1 (GPU 3): GPU 3: XID 79, ...: fix``."""
    lines = []
    for event in events:
        e = event.to_dict() if isinstance(event, HealthEvent) else event
        ranks = sorted(r for r, gpu in rank_gpus.items() if gpu == e["gpu"])
        who = f"rank {', '.join(map(str, ranks))} (GPU {e['gpu']})" if ranks else f"GPU {e['gpu']} (no rank recorded on it)"
        lines.append(f"{who}: {e['message']}; fix: {e['fix']}")
    return lines
