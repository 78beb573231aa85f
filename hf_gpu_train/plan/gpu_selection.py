"""Which GPUs (or which MIG instance) a launch uses, and the reason for each one left out.

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

from ..errors import PlanError
from ..hardware.profile import GpuInfo, HardwareProfile, MigInstance
from .gpu_subset import best_subset, describe

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
