"""``hf-gpu-train check-config``: an accelerate config checked against a machine before a job waits in a queue.

check-config findings about the selected GPUs: P2P settings, MIG instances, CPU affinity, pending MIG.

Each function reads the config's choices and the machine's facts and returns (level, message) pairs;
``lint`` wraps them into Findings. Kept apart from the generic config checks because each rule
mirrors a decision in ``decisions.py`` / ``gpus.py`` / ``cpu_binding.py``: a config that
``hf-gpu-train config`` would write must lint clean, and one that throws bandwidth away must not.

``hf-gpu-train check-config``'s findings about NAME.plan.json: what a run on the checked machine will not apply.

The run itself says the same in its first lines; check-config says it before a job waits in a queue.
"""

from __future__ import annotations

import difflib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from ..hardware.profile import GpuInfo, GpuPair, HardwareProfile
from .cpu_binding import TASKSET, decide_cpu_binding
from .decisions import DEFAULT_BUSY_THRESHOLD_BYTES, NCCL_P2P_LEVELS, accelerate_uses_cpu, nccl_path, p2p_level_cutoff, pairs_text
from .scope import differences

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    level: str
    message: str


def known_keys() -> set[str]:
    """Top-level keys accelerate's ClusterConfig accepts (its loader rejects any other)."""
    from accelerate.commands.config.config_args import ClusterConfig

    return {f.name for f in fields(ClusterConfig)}


def lint(config: dict, profile: HardwareProfile, env: dict[str, str] | None = None, mpirun_available: bool | None = None) -> list[Finding]:
    env = env or {}
    found: list[Finding] = []
    keys = known_keys()
    for key in config:
        if key not in keys:
            close = difflib.get_close_matches(key, sorted(keys), n=1)
            found.append(Finding(ERROR, f"unknown key {key!r}" + (f": did you mean {close[0]!r}?" if close else "")
                                 + " (accelerate's loader rejects it)"))
    dist = str(config.get("distributed_type", "NO"))
    num_processes = int(config.get("num_processes", 1) or 1)
    num_machines = int(config.get("num_machines", 1) or 1)
    per_machine = num_processes // num_machines if num_machines else num_processes
    use_cpu = bool(config.get("use_cpu")) or accelerate_uses_cpu(env)
    gpus = {g.index: g for g in profile.gpus}
    ids, mig_uuids, ids_error = split_gpu_ids(config.get("gpu_ids"))
    if ids_error:
        found.append(Finding(ERROR, ids_error))
    bad_ids = [i for i in ids if i not in gpus]
    if bad_ids:
        found.append(Finding(ERROR, f"gpu_ids {bad_ids} out of range: {profile.display_name} has GPUs {sorted(gpus) or 'none'}"))
    found += [Finding(level, msg) for level, msg in mig_findings(profile, ids, mig_uuids, num_processes)]
    mig_parents = [g for g in profile.gpus for m in (g.mig_instances or ()) if m.uuid in mig_uuids]
    selected = [gpus[i] for i in ids if i in gpus] + mig_parents or list(profile.gpus)
    usable = [g for g in selected if not g.mig_enabled]
    on_deepspeeds_cpu = dist == "DEEPSPEED" and not profile.gpus and env.get("DS_ACCELERATOR") == "cpu"  # CPU processes
    if not use_cpu and not on_deepspeeds_cpu and dist != "NO" and not mig_uuids and per_machine > len(usable):
        found.append(Finding(ERROR, f"num_processes {num_processes} ({per_machine} per machine) but {profile.display_name} has "
                             f"{len(usable)} usable GPU(s): lower num_processes or regenerate with `hf-gpu-train config`"))
    if num_machines > 1:
        if num_processes % num_machines:
            found.append(Finding(ERROR, f"num_processes {num_processes} is not divisible by num_machines {num_machines} "
                                 "(accelerate gives each node num_processes // num_machines; nodes must be homogeneous)"))
        if not config.get("main_process_ip"):
            found.append(Finding(ERROR, "multi-node config without main_process_ip: set it to machine rank 0's address"))
    if dist == "MULTI_CPU" and num_processes > 1 and not (mpirun_available if mpirun_available is not None else shutil.which("mpirun")):
        found.append(Finding(ERROR, f"MULTI_CPU with {num_processes} processes needs mpirun, which is not installed: accelerate "
                             "starts ONE process. Use `hf-gpu-train config` on this machine (MULTI_GPU + ACCELERATE_USE_CPU=1 "
                             "gives real gloo DDP)"))
    if env.get("DS_ACCELERATOR") == "cpu" and profile.gpus:
        found.append(Finding(WARNING, f"DS_ACCELERATOR=cpu but {profile.display_name} has GPUs: DeepSpeed would train on the "
                             "CPU in fp32; regenerate the config on this machine (`hf-gpu-train config`)"))
    if dist == "DEEPSPEED" and accelerate_uses_cpu(env):
        found.append(Finding(ERROR, "DEEPSPEED with ACCELERATE_USE_CPU set: accelerate then skips DeepSpeed and trains DDP (its "
                             "state turns DeepSpeed on only off the CPU flag); unset it: DeepSpeed runs on the CPU by itself "
                             "(DS_ACCELERATOR=cpu, gloo; `hf-gpu-train config --strategy deepspeed-zero3` writes that)"))
    if dist in ("MULTI_GPU", "FSDP") and not profile.gpus and not use_cpu and num_processes > 1:
        found.append(Finding(ERROR, f"{dist} with {num_processes} processes on a machine without GPUs starts independent "
                             "trainings that each think they are alone: set ACCELERATE_USE_CPU=1 in the .env (hf-gpu-train config does)"))
    mp = str(config.get("mixed_precision", "no"))
    if mp == "bf16" and not use_cpu:
        for g in selected:
            if not g.bf16_supported:
                found.append(Finding(ERROR, f"mixed_precision bf16 but GPU {g.index} ({g.name}, compute capability "
                                     f"{g.capability_str}) has no bf16: use fp16"))
    if mp == "fp8":
        for g in selected:
            if not g.fp8_supported:
                found.append(Finding(ERROR, f"mixed_precision fp8 but GPU {g.index} ({g.name}) has compute capability {g.capability_str} (< 8.9)"))
    if not use_cpu and len(selected) > 1 and num_processes > 1:
        sel = {g.index for g in selected[:per_machine]}
        pairs = [p for p in profile.pairs if p.a in sel and p.b in sel]
        found += [Finding(level, msg) for level, msg in p2p_findings(pairs, env)]
        if len({g.name for g in selected}) > 1:
            found.append(Finding(WARNING, "mixed GPU models: " + ", ".join(sorted({g.name for g in selected}))
                                 + "; the slowest paces every step"))
    if not use_cpu:
        found += [Finding(level, msg) for level, msg in
                  cpu_affinity_findings(profile, selected, ids, bool(config.get("enable_cpu_affinity")))
                  + pending_mig_findings(selected)]
    for g in selected:
        if (g.memory_used_bytes or 0) >= DEFAULT_BUSY_THRESHOLD_BYTES and not use_cpu:
            found.append(Finding(WARNING, f"GPU {g.index} is busy: {(g.memory_used_bytes or 0) / 2**30:.1f} GiB held by other processes"))
    return found


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


WARNING = "warning"


def plan_findings(plan_path: Path, profile: HardwareProfile) -> list[tuple[str, str]]:
    """(level, message) for the plan beside a config; [] when there is none or nothing to say."""

    try:
        doc = json.loads(plan_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []  # a missing or broken plan: the run names the file and the fix (run_plan_file)
    if not isinstance(doc, Mapping):
        return []
    fix = f"regenerate it with `{doc.get('command') or 'hf-gpu-train config --output ...'}`"
    found = []
    memory = doc.get("memory")
    if isinstance(memory, Mapping) and not (memory.get("planned_for") or {}).get("fingerprint"):
        found.append((WARNING, f"{plan_path.name} records no fingerprint of the model its memory plan was made for (written "
                               f"by an older hf-gpu-train): runs apply its environment, never its micro-batch, global batch "
                               f"or checkpointing; {fix}"))
    hardware = doc.get("hardware")
    if not isinstance(hardware, Mapping):
        found.append((WARNING, f"{plan_path.name} records no machine (written by an older hf-gpu-train): runs apply its "
                               f"machine values unchecked; {fix}"))
    elif differs := differences(hardware, profile):
        found.append((WARNING, f"{plan_path.name} was made for another machine ({doc.get('machine')}: {'; '.join(differs)}): "
                               f"a run on {profile.display_name} applies none of its machine values (precision, workers, "
                               f"threads, CPU binding, GPU ids, micro-batch); plan this machine with `hf-gpu-train config`"))
    return found
