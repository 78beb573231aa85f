"""check-config findings about the selected GPUs: P2P settings, MIG instances, CPU affinity, pending MIG.

Each function reads the config's choices and the machine's facts and returns (level, message) pairs;
``lint.py`` wraps them into Findings. Kept apart from the generic config checks because each rule
mirrors a decision in ``decisions.py`` / ``gpu_selection.py`` / ``cpu_binding.py``: a config that
``hf-gpu-train config`` would write must lint clean, and one that throws bandwidth away must not.
"""

from __future__ import annotations

from ..hardware.profile import GpuInfo, GpuPair, HardwareProfile
from .cpu_binding import TASKSET, decide_cpu_binding
from .decisions import NCCL_P2P_LEVELS, nccl_path, p2p_level_cutoff, pairs_text

ERROR, WARNING = "error", "warning"
# Paths on which NCCL uses P2P by default whatever the CPU (beyond PXB its default depends on the CPU
# vendor), so cutting P2P there surely loses bandwidth.
SURE_P2P_PATHS = ("NVL", "PIX", "PXB")


def split_gpu_ids(raw: object) -> tuple[list[int], list[str], str | None]:
    """(NVML indices, MIG UUIDs, error) from accelerate's ``gpu_ids`` ("0,3", "MIG-...", "all")."""
    if raw in (None, "all", ""):
        return [], [], None
    entries = [x.strip() for x in str(raw).split(",") if x.strip()]
    migs = [e for e in entries if e.startswith("MIG-")]
    rest = [e for e in entries if not e.startswith("MIG-")]
    if not all(e.isdigit() for e in rest):
        return [], [], f"gpu_ids {raw!r} is not a comma-separated list of GPU indices or MIG UUIDs"
    return [int(e) for e in rest], migs, None


def mig_findings(profile: HardwareProfile, ids: list[int], mig_uuids: list[str], num_processes: int) -> list[tuple[str, str]]:
    found = []
    instances = {m.uuid: g for g in profile.gpus for m in (g.mig_instances or ())}
    for uuid in mig_uuids:
        if uuid not in instances:
            listed = ", ".join(instances) or "none recorded"
            found.append((ERROR, f"gpu_ids {uuid}: no such MIG instance on {profile.display_name} (instances: {listed})"))
    if mig_uuids and (len(mig_uuids) + len(ids) > 1 or num_processes > 1):
        found.append((ERROR, f"gpu_ids names MIG instances and num_processes is {num_processes}: NCCL cannot join MIG "
                      "instances, so train one process on one instance (num_processes 1, distributed_type NO, one UUID)"))
    for i in ids:
        gpu = next((g for g in profile.gpus if g.index == i), None)
        if gpu is not None and gpu.mig_enabled:
            first = (gpu.mig_instances or (None,))[0]
            fix = f"name one instance instead (gpu_ids: {first.uuid})" if first else "and it has no MIG instance"
            found.append((WARNING, f"gpu_ids {i} names GPU {i}, which is in MIG mode: CUDA sees its MIG instances, not the "
                          f"GPU; {fix}"))
    return found


def _nccl_cuts(level: str, pair: GpuPair) -> bool:
    path = nccl_path(pair)
    return level in NCCL_P2P_LEVELS and path is not None and NCCL_P2P_LEVELS.index(path) > NCCL_P2P_LEVELS.index(level)


def p2p_findings(pairs: list[GpuPair], env: dict[str, str]) -> list[tuple[str, str]]:
    """P2P on broken pairs (may hang) and P2P off on working pairs (bandwidth lost for nothing)."""
    disabled = env.get("NCCL_P2P_DISABLE") == "1"
    level = env.get("NCCL_P2P_LEVEL", "").upper() or None
    broken = [p for p in pairs if not p.p2p_ok]
    working = [p for p in pairs if p.p2p_ok]
    cutoff = p2p_level_cutoff(pairs)
    found = []
    if broken and not disabled:
        still_on = [p for p in broken if level is None or not _nccl_cuts(level, p)]
        if still_on and level is None:
            found.append((WARNING, f"P2P not supported between GPUs {pairs_text(broken, why=False)} but NCCL_P2P_DISABLE is "
                          "not set: NCCL collectives may hang"))
        elif still_on:
            found.append((WARNING, f"NCCL_P2P_LEVEL={level} keeps P2P on {pairs_text(still_on)}, where NVML reports it not "
                          "supported: NCCL collectives may hang" + (f"; use NCCL_P2P_LEVEL={cutoff}" if cutoff else "")))
    if disabled and working:
        if not broken:
            kind = "NVLink on" if all(p.nvlinks for p in working) else "OK on"
            found.append((WARNING, f"NCCL_P2P_DISABLE=1 but P2P works on every selected pair ({kind} "
                          f"{pairs_text(working, why=False)}): collectives lose that bandwidth for nothing; remove "
                          "NCCL_P2P_DISABLE"))
        elif cutoff:
            linked = "NVLinked " if cutoff == "NVL" else ""
            found.append((WARNING, f"NCCL_P2P_DISABLE=1 also stops P2P on the {linked}pairs {pairs_text(working, why=False)}, "
                          f"where it works: NCCL_P2P_LEVEL={cutoff} keeps it there and off the broken pairs"))
    elif level and not disabled:
        lost = [p for p in working if _nccl_cuts(level, p) and nccl_path(p) in SURE_P2P_PATHS]
        if lost:
            widest = cutoff or max((nccl_path(p) for p in working), key=NCCL_P2P_LEVELS.index)
            by_path = "; ".join(f"{pairs_text([p for p in lost if nccl_path(p) == path], why=False)} ({path})"
                                for path in dict.fromkeys(nccl_path(p) for p in lost))
            found.append((WARNING, f"NCCL_P2P_LEVEL={level} stops P2P on working pairs {by_path}: collectives lose that "
                          f"bandwidth for nothing; use NCCL_P2P_LEVEL={widest}"
                          + ("" if cutoff else " or leave it unset")))
    return found


def cpu_affinity_findings(profile: HardwareProfile, selected: list[GpuInfo], ids: list[int], enabled: bool) -> list[tuple[str, str]]:
    """accelerate's enable_cpu_affinity pins process i to NVML GPU i: wrong for gpu_ids other than 0..n-1."""
    if not enabled or not ids or ids == list(range(len(ids))):
        return []
    pinned = [g for g in profile.gpus if g.index < len(ids)]
    if [g.cpu_affinity for g in pinned] == [g.cpu_affinity for g in selected]:
        return []  # the wrong GPUs, but the same CPUs: no harm
    binding = decide_cpu_binding(profile, tuple(selected))
    fix = (f"launch under `{binding.command_prefix}`" if binding is not None and binding.method == TASKSET
           else "these GPUs need different CPU sets per process, which accelerate cannot give")
    return [(WARNING, "enable_cpu_affinity pins process i to the CPUs of NVML GPU i (accelerate ignores CUDA_VISIBLE_DEVICES "
             f"there), but gpu_ids is {','.join(map(str, ids))}: processes land next to GPUs "
             f"{','.join(str(g.index) for g in pinned)}; remove it and {fix}")]


def pending_mig_findings(selected: list[GpuInfo]) -> list[tuple[str, str]]:
    return [(WARNING, f"GPU {g.index} has a MIG mode change pending (MIG {'on' if g.mig_pending_enabled else 'off'} after the "
             "next reset): this config breaks at the next GPU reset or reboot; apply or undo the change first "
             "(`hf-gpu-train doctor` says how)") for g in selected if g.mig_change_pending]
