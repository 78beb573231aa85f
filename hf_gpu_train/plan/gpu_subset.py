"""The best-connected N of the usable GPUs, and a one-line description of how a set of GPUs is linked.

Collectives run at the pace of the slowest link in the group, so a subset is judged by its worst pair
first: every pair NVLinked beats any pair without (more links per pair, then more in total), then the
tightest PCIe level over the pairs (PIX < PXB < PHB < NODE < SYS), then the fewest NUMA nodes. Index
order is only the last tie-break. A merely connected NVLink component is not enough: on a DGX-1 the
whole box is one NVLink component, yet GPUs 1-4 share no link.

Every subset is scored when there are at most ``MAX_SUBSETS`` of them (C(16, 8) = 12,870: any box up to
16 GPUs); beyond that the set is grown greedily from each GPU in turn, and the reason says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from math import comb

from ..hardware.profile import GpuInfo, HardwareProfile

MAX_SUBSETS = 20_000
PCIE_RANK = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}
UNKNOWN_PCIE_RANK = 6
PCIE_WORDS = {
    "PIX": "one PCIe switch (PIX)",
    "PXB": "PCIe switches under one host bridge (PXB)",
    "PHB": "through a PCIe host bridge (PHB)",
    "NODE": "host bridges of one NUMA node (NODE)",
    "SYS": "across the CPU interconnect (SYS)",
}


def numa_key(gpu: GpuInfo) -> str | None:
    """Which CPU socket/NUMA node a GPU hangs off: NVML's NUMA node, else its CPU affinity mask
    (older drivers and most VMs give no NUMA node; the affinity mask still tells the sockets apart)."""
    if gpu.numa_node is not None:
        return f"NUMA node {gpu.numa_node}"
    return f"CPU affinity {gpu.cpu_affinity}" if gpu.cpu_affinity else None


@dataclass(frozen=True)
class _Links:
    """NVLinks and PCIe rank of every pair, looked up once (subsets are scored by the thousand)."""

    nvlinks: dict[tuple[int, int], int]
    pcie: dict[tuple[int, int], int]

    @classmethod
    def of(cls, profile: HardwareProfile) -> _Links:
        return cls({(p.a, p.b): p.nvlinks for p in profile.pairs},
                   {(p.a, p.b): PCIE_RANK.get(p.topology or "", UNKNOWN_PCIE_RANK) for p in profile.pairs})

    def score(self, gpus: tuple[GpuInfo, ...]) -> tuple:
        """Smaller is better. A fully NVLinked subset first, by (-min NVLinks, -total NVLinks, worst PCIe, NUMA nodes);
        any other by (worst PCIe level, NUMA nodes, -total NVLinks, total PCIe): a pair of bridged GPUs does not make
        a subset that crosses the CPU interconnect better than one behind a single switch. Indices break ties."""
        keys = [(a.index, b.index) if a.index < b.index else (b.index, a.index) for a, b in combinations(gpus, 2)]
        links = [self.nvlinks.get(k, 0) for k in keys]
        pcie = [self.pcie.get(k, UNKNOWN_PCIE_RANK) for k in keys]
        nodes = len({numa_key(g) for g in gpus})
        indices = [g.index for g in gpus]
        if min(links, default=0) > 0:
            return (0, -min(links), -sum(links), max(pcie, default=0), nodes, sum(pcie), indices)
        return (1, max(pcie, default=0), nodes, -sum(links), sum(pcie), 0, indices)


def best_subset(profile: HardwareProfile, usable: list[GpuInfo], count: int) -> tuple[tuple[GpuInfo, ...], str]:
    """(the best-connected ``count`` of ``usable``, the reason naming what makes it best)."""
    usable = sorted(usable, key=lambda g: g.index)
    if count >= len(usable):
        return tuple(usable), f"{describe(profile, usable)}; all {len(usable)} usable GPU(s)"
    if count == 1:
        return (usable[0],), f"GPU {usable[0].index}: the first usable GPU (one GPU needs no link)"
    links = _Links.of(profile)
    candidates = comb(len(usable), count)
    if candidates <= MAX_SUBSETS:
        chosen = min(combinations(usable, count), key=links.score)
        how = f"best-connected of {candidates} subsets of the {len(usable)} usable GPUs"
    else:
        chosen = _greedy(links, usable, count)
        how = f"grown greedily ({candidates} subsets are too many to try)"
    return chosen, f"{describe(profile, chosen)}; {how}"


def _greedy(links: _Links, usable: list[GpuInfo], count: int) -> tuple[GpuInfo, ...]:
    """Grow a set from each GPU in turn, adding the GPU that scores best, and keep the best set: seeding
    from one pair only would fill the first island it meets even when another island holds them all."""
    results = []
    for seed in usable:
        chosen: tuple[GpuInfo, ...] = (seed,)
        while len(chosen) < count:
            rest = [g for g in usable if g not in chosen]
            chosen = min((tuple(sorted(chosen + (g,), key=lambda x: x.index)) for g in rest), key=links.score)
        results.append(chosen)
    return min(results, key=links.score)


def describe(profile: HardwareProfile, gpus: list[GpuInfo] | tuple[GpuInfo, ...]) -> str:
    """ "GPUs 4,5,6,7: fully NVLinked (NV1-NV2 on every pair), through a PCIe host bridge (PHB), NUMA node 1" """
    head = f"GPUs {','.join(str(g.index) for g in gpus)}"
    if len(gpus) < 2:
        return head
    pairs = [profile.pair(a.index, b.index) for a, b in combinations(gpus, 2)]
    known = [p for p in pairs if p is not None]
    linked = [p for p in known if p.nvlinks]
    parts = []
    if linked and len(linked) == len(pairs):
        lo, hi = min(p.nvlinks for p in linked), max(p.nvlinks for p in linked)
        parts.append(f"fully NVLinked (NV{lo}{'' if lo == hi else f'-NV{hi}'} on every pair)")
    elif len(linked) > 3:
        lo, hi = min(p.nvlinks for p in linked), max(p.nvlinks for p in linked)
        parts.append(f"NVLink on {len(linked)} of {len(pairs)} pairs (NV{lo}{'' if lo == hi else f'-NV{hi}'})")
    elif linked:
        parts.append(f"NVLink on {len(linked)} of {len(pairs)} pairs ("
                     + ", ".join(f"{p.a}-{p.b} NV{p.nvlinks}" for p in linked) + ")")
    else:
        parts.append("no NVLink")
    levels = [p.topology for p in known if p.topology in PCIE_RANK]
    if levels:
        parts.append(PCIE_WORDS[max(levels, key=PCIE_RANK.__getitem__)])
    parts += [_numa_words(gpus)] if _numa_words(gpus) else []
    return f"{head}: " + ", ".join(parts)


def _numa_words(gpus: list[GpuInfo] | tuple[GpuInfo, ...]) -> str | None:
    """ "NUMA node 1", "NUMA nodes 0,1", or the CPU affinity masks when NVML gives no NUMA node id."""
    if all(g.numa_node is not None for g in gpus):
        nodes = sorted({g.numa_node for g in gpus})
        return f"NUMA node{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))}"
    masks = list(dict.fromkeys(g.cpu_affinity for g in gpus if g.cpu_affinity))
    if not masks:
        return None
    return f"CPU affinity {' / '.join(masks)} (NVML gives no NUMA node id)"
