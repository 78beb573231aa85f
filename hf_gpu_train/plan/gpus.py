"""The GPUs of a launch: which ones are usable (below), and the best-connected N of them (first).

The best-connected N of the usable GPUs, and a one-line description of how a set of GPUs is linked.

Collectives run at the pace of the slowest link in the group, so a subset is judged by its worst pair
first: every pair NVLinked beats any pair without (more links per pair, then more in total), then the
tightest PCIe level over the pairs (PIX < PXB < PHB < NODE < SYS), then the fewest NUMA nodes. Index
order is only the last tie-break. A merely connected NVLink component is not enough: on a DGX-1 the
whole box is one NVLink component, yet GPUs 1-4 share no link.

Every subset is scored when there are at most ``MAX_SUBSETS`` of them (C(16, 8) = 12,870: any box up to
16 GPUs); beyond that the set is grown greedily from each GPU in turn, and the reason says so.

Which GPUs (or which MIG instance) a launch uses, and the reason for each one left out.

``--gpus`` is a count (``all`` or N, the best-connected N chosen from the topology) and ``--gpu-ids``
names GPUs by NVML index (PCI bus order, as nvidia-smi numbers them) or one MIG instance by UUID, so
"2" can never mean GPU 2. GPUs in MIG mode, with a pending MIG change, driving a display or busy with
another job are left out unless named; on a box of mixed models one model is used. A GPU in MIG mode
can still train one process on one of its instances (NCCL cannot join instances), and that plan must
use the instance's memory, not the GPU's: ``GpuSelection.memory_free_bytes`` gives the right one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import combinations
from math import comb

from ..errors import PlanError
from ..hardware.profile import GpuInfo, HardwareProfile, MigInstance

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


DEFAULT_BUSY_THRESHOLD_BYTES = 1 * 2**30


GIB = 2**30


@dataclass(frozen=True)
class GpuSelection:
    """The devices one launch uses. ``mig_instance`` set: one process on that instance of ``gpus[0]``."""

    gpus: tuple[GpuInfo, ...]
    reasons: tuple[str, ...]
    mig_instance: MigInstance | None = None

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @property
    def visible_devices(self) -> str | None:
        """accelerate's ``gpu_ids`` (it becomes CUDA_VISIBLE_DEVICES): NVML indices, or the MIG UUID."""
        if self.mig_instance is not None:
            return self.mig_instance.uuid
        return ",".join(str(g.index) for g in self.gpus) or None

    @property
    def memory_free_bytes(self) -> int | None:
        """Memory one process can use: the MIG instance's, else the smallest free memory of the GPUs."""
        if self.mig_instance is not None:
            return self.mig_instance.memory_free_bytes
        return min((g.memory_free_bytes for g in self.gpus), default=None)


def parse_gpu_count(spec: str | int | None) -> int | None:
    """``--gpus``: None for all, else a count >= 1. Anything that looks like indices is refused."""
    text = "all" if spec is None else str(spec).strip()
    if text in ("", "all"):
        return None
    if "," in text or ":" in text or text.startswith("MIG-"):
        indices = text.removeprefix("id:").strip(",")
        raise PlanError(f"--gpus {text!r} looks like GPU indices: pass --gpu-ids {indices} to use those GPUs; --gpus is a "
                        "count (--gpus 2: any two, chosen from the topology)")
    try:
        count = int(text)
    except ValueError:
        raise PlanError(f"--gpus {text!r}: give all or a count (--gpus 2); to name GPUs use --gpu-ids 0,3") from None
    if count == 0:
        raise PlanError("--gpus 0: --gpus is a count (how many GPUs) and needs at least 1; to use GPU 0, pass --gpu-ids 0")
    if count < 0:
        raise PlanError(f"--gpus {count}: a count of GPUs needs at least 1")
    return count


def parse_gpu_ids(spec: str) -> list[int | str]:
    """``--gpu-ids``: NVML indices ("0,3") or MIG UUIDs ("MIG-..."), each named once."""
    text = str(spec).strip()
    entries = [x.strip() for x in text.split(",") if x.strip()]
    if not entries or not all(e.startswith("MIG-") or e.isdigit() for e in entries):
        raise PlanError(f"--gpu-ids {text!r}: give NVML indices (0,3), as nvidia-smi numbers the GPUs, or a MIG UUID (MIG-...)")
    wanted: list[int | str] = [e if e.startswith("MIG-") else int(e) for e in entries]
    twice = sorted({str(x) for x in wanted if wanted.count(x) > 1})
    if twice:
        raise PlanError(f"--gpu-ids {text!r}: GPU {', '.join(twice)} named twice")
    return wanted


def select_devices(
    profile: HardwareProfile,
    gpus: str | int | None = "all",
    gpu_ids: str | None = None,
    include_busy: bool = False,
    busy_threshold_bytes: int = DEFAULT_BUSY_THRESHOLD_BYTES,
) -> GpuSelection:
    count = parse_gpu_count(gpus)
    named = None if gpu_ids is None else parse_gpu_ids(gpu_ids)
    if count is not None and named is not None:
        raise PlanError(f"--gpus {gpus} and --gpu-ids {gpu_ids}: give a count (--gpus) or GPU indices (--gpu-ids), not both")
    if not profile.gpus:
        if count is not None or named is not None:
            flag = f"--gpus {gpus}" if count is not None else f"--gpu-ids {gpu_ids}"
            raise PlanError(f"{flag}: this machine has no GPU")
        return GpuSelection((), ("no GPU: processes run on the CPU",))
    if named is not None:
        return _named(profile, named, str(gpu_ids).strip(), busy_threshold_bytes)
    return _automatic(profile, count, include_busy, busy_threshold_bytes)


def _skip_reason(gpu: GpuInfo, include_busy: bool, threshold: int) -> str | None:
    i = gpu.index
    if gpu.mig_change_pending:
        now, then = ("on", "off") if gpu.mig_enabled else ("off", "on")
        return (f"MIG mode change pending ({now} now, {then} after the next GPU reset): a plan made now breaks at the next "
                f"reset or reboot; apply it (`sudo nvidia-smi -i {i} -r` with no process on the GPU) or undo it "
                f"(`sudo nvidia-smi -i {i} -mig {1 if gpu.mig_enabled else 0}`), then plan again")
    if gpu.mig_enabled:
        return (f"MIG mode on (NCCL cannot join MIG instances; one process on one instance: --gpu-ids {i}; "
                f"whole GPU: `sudo nvidia-smi -i {i} -mig 0`, then reset it)")
    if gpu.display_active:
        return "drives a display (slower and shares memory with the desktop); name it in --gpu-ids to use it"
    used = gpu.memory_used_bytes or 0
    if not include_busy and used >= threshold:
        return (f"{used / GIB:.1f} GiB held by other processes (threshold {threshold / GIB:.1f} GiB; --include-busy to use it)")
    return None


def _automatic(profile: HardwareProfile, count: int | None, include_busy: bool, threshold: int) -> GpuSelection:
    skipped = {g.index: why for g in profile.gpus if (why := _skip_reason(g, include_busy, threshold))}
    reasons = [f"skip GPU {i}: {why}" for i, why in skipped.items()]
    usable = [g for g in profile.gpus if g.index not in skipped]
    if not usable:
        return _mig_only(profile, count, skipped, threshold)
    group, left_out, mixed = _one_model(usable, count)
    if mixed:
        reasons.append(mixed)
    if count is None:
        summary = f"{len(group)} usable GPU(s): {','.join(str(g.index) for g in group)}"
        reasons.append(summary + (f"; {describe(profile, group)}" if len(group) > 1 else ""))
        return GpuSelection(tuple(group), tuple(reasons))
    if count > len(group):
        out = {**skipped, **left_out}
        nameable = sorted([g.index for g in group] + [i for i in out if not profile.gpu(i).mig_enabled])
        raise PlanError(f"--gpus {count}: only {len(group)} usable GPU(s) here ({','.join(str(g.index) for g in group)}); "
                        "left out: " + "; ".join(f"GPU {i} ({why})" for i, why in sorted(out.items()))
                        + f". To use them anyway name them: --gpu-ids {','.join(map(str, nameable))}")
    chosen, why = best_subset(profile, group, count)
    reasons.append(why)
    return GpuSelection(chosen, tuple(reasons))


def _one_model(usable: list[GpuInfo], count: int | None) -> tuple[list[GpuInfo], dict[int, str], str | None]:
    """(one model's GPUs, {left-out index: reason}, the reason) on a box of mixed models: DDP runs at the
    pace and memory of its slowest GPU. The biggest group for all GPUs; for a count, the strongest group
    that has enough."""
    groups: dict[tuple[str, int], list[GpuInfo]] = defaultdict(list)
    for g in usable:
        groups[(g.name, g.memory_total_bytes)].append(g)
    if len(groups) == 1:
        return usable, {}, None

    def strength(grp: list[GpuInfo]) -> tuple:
        return grp[0].memory_total_bytes, grp[0].compute_capability or (0, 0)

    fitting = [grp for grp in groups.values() if count is not None and len(grp) >= count]
    if fitting:
        best = max(fitting, key=lambda grp: (*strength(grp), len(grp)))
    else:
        best = max(groups.values(), key=lambda grp: (len(grp), *strength(grp)))
    others = [grp for grp in groups.values() if grp is not best]
    left_out = {g.index: f"{g.name}: another model than the {best[0].name} group; mixing models paces DDP at the slowest GPU"
                for grp in others for g in grp}
    reason = (f"mixed GPU models: using the largest matching group ({best[0].name} x{len(best)}), leaving out "
              + ", ".join(f"{grp[0].name} x{len(grp)} (GPU {','.join(str(g.index) for g in grp)})" for grp in others)
              + "; the slowest GPU would pace every DDP step")
    return best, left_out, reason


def _mig_only(profile: HardwareProfile, count: int | None, skipped: dict[int, str], threshold: int) -> GpuSelection:
    """No whole GPU is usable: one process on one MIG instance, if there is one."""
    mig = [g for g in profile.gpus if g.mig_enabled and not g.mig_change_pending]
    if not mig:
        raise PlanError("every GPU was skipped (" + "; ".join(f"skip GPU {i}: {why}" for i, why in skipped.items())
                        + "). Name GPUs with --gpu-ids 0,1 or pass --include-busy")
    ids = ",".join(str(g.index) for g in mig)
    if count is not None and count > 1:
        raise PlanError(f"--gpus {count}: no whole GPU is usable and GPU {ids} is in MIG mode: NCCL cannot join MIG instances, "
                        "so multi-process training over MIG is refused. Train one process on one instance (--gpus 1), or "
                        f"disable MIG for whole-GPU training (`sudo nvidia-smi -i {ids} -mig 0`, then reset)")
    # The MIG GPUs' own skip lines would only repeat what the instance line says.
    reasons = [f"skip GPU {i}: {why}" for i, why in skipped.items() if i not in {g.index for g in mig}]
    return _on_instance(mig, reasons, threshold)


def _on_instance(gpus: list[GpuInfo], reasons: list[str], threshold: int) -> GpuSelection:
    ids = ",".join(str(g.index) for g in gpus)
    instances = [(g, m) for g in gpus for m in (g.mig_instances or ())]
    if not instances:
        if any(g.mig_instances is None for g in gpus):
            raise PlanError(f"GPU {ids} is in MIG mode but this snapshot does not list its MIG instances (made before snapshot "
                            "version 2): re-run `hf-gpu-train detect --save` with this hf_gpu_train")
        raise PlanError(f"no MIG instance on GPU {ids}: MIG mode is on but no instance exists, so CUDA sees no device. Create "
                        f"one (`sudo nvidia-smi mig -cgi 9 -C -i {gpus[0].index}` makes a 3g instance; `nvidia-smi mig -lgip` "
                        f"lists the profiles) or disable MIG (`sudo nvidia-smi -i {ids} -mig 0`, then reset)")
    free = [(g, m) for g, m in instances if (m.memory_used_bytes or 0) < threshold]
    if not free:
        raise PlanError(f"every MIG instance on GPU {ids} holds more than {threshold / GIB:.1f} GiB of other processes: "
                        "free one, or pass --include-busy")
    gpu, instance = max(free, key=lambda gm: (gm[1].memory_free_bytes, -gm[0].index, -gm[1].index))
    reasons.append(f"GPU {gpu.index} is in MIG mode: one process on MIG instance {instance.uuid} ({instance.profile}, "
                   f"{instance.memory_free_bytes / GIB:.1f} GiB free), the largest of {len(instances)} instance(s); NCCL "
                   "cannot join MIG instances, so one process and no NCCL")
    return GpuSelection((gpu,), tuple(reasons), instance)


def _named(profile: HardwareProfile, named: list[int | str], spec: str, threshold: int) -> GpuSelection:
    uuids = [x for x in named if isinstance(x, str)]
    if uuids:
        return _named_instance(profile, uuids, len(named), spec)
    known = {g.index for g in profile.gpus}
    unknown = [i for i in named if i not in known]
    if unknown:
        raise PlanError(f"--gpu-ids {spec}: no GPU {unknown} here (NVML indices {sorted(known)})")
    chosen = tuple(profile.gpu(i) for i in named)  # type: ignore[arg-type]
    mig = [g for g in chosen if g.mig_enabled and not g.mig_change_pending]
    if mig and len(chosen) > 1:
        ids = ",".join(str(g.index) for g in mig)
        raise PlanError(f"--gpu-ids {spec}: GPU {ids} is in MIG mode and NCCL cannot join MIG instances, so multi-process "
                        f"training over MIG is refused: use --gpu-ids {mig[0].index} for one process on one instance, or "
                        f"disable MIG (`sudo nvidia-smi -i {ids} -mig 0`, then reset)")
    if mig:
        return _on_instance(mig, [f"GPU {mig[0].index} as asked (--gpu-ids)"], threshold)
    head = describe(profile, chosen) if len(chosen) > 1 else f"GPU {chosen[0].index}"
    reasons = [f"{head}; as asked (--gpu-ids)"]
    for g in chosen:
        if g.mig_change_pending:
            reasons.append(f"GPU {g.index} turns MIG {'on' if g.mig_pending_enabled else 'off'} at the next reset "
                           "(`nvidia-smi -mig` was run, the reset not): this plan breaks then")
        if (g.memory_used_bytes or 0) >= threshold:
            reasons.append(f"GPU {g.index} already has {(g.memory_used_bytes or 0) / GIB:.1f} GiB in use by other processes")
    if len({g.name for g in chosen}) > 1:
        reasons.append("mixed GPU models: the slowest GPU paces every DDP step")
    return GpuSelection(chosen, tuple(reasons))


def _named_instance(profile: HardwareProfile, uuids: list[str], named: int, spec: str) -> GpuSelection:
    if named > 1:
        raise PlanError(f"--gpu-ids {spec}: NCCL cannot join MIG instances, so multi-process training over MIG is refused; "
                        "name one MIG instance (one process)")
    found = [(g, m) for g in profile.gpus for m in (g.mig_instances or ()) if m.uuid == uuids[0]]
    if not found:
        listed = [m.uuid for g in profile.gpus for m in (g.mig_instances or ())]
        raise PlanError(f"--gpu-ids {spec}: no MIG instance {uuids[0]} here"
                        + (f" (instances: {', '.join(listed)})" if listed else " (no GPU lists MIG instances)"))
    gpu, instance = found[0]
    return GpuSelection((gpu,), (f"MIG instance {instance.uuid} of GPU {gpu.index} ({instance.profile}, "
                                 f"{instance.memory_free_bytes / GIB:.1f} GiB free) as asked; one process, no NCCL",), instance)
