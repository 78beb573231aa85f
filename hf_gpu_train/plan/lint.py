"""``hf-gpu-train check-config``: an accelerate config checked against a machine before a job waits in a queue."""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass, fields

from ..hardware.profile import HardwareProfile
from .decisions import DEFAULT_BUSY_THRESHOLD_BYTES, accelerate_uses_cpu
from .lint_gpus import cpu_affinity_findings, mig_findings, p2p_findings, pending_mig_findings, split_gpu_ids

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
    if not use_cpu and dist != "NO" and not mig_uuids and per_machine > len(usable):
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
    if dist in ("MULTI_GPU", "FSDP", "DEEPSPEED") and not profile.gpus and not use_cpu and num_processes > 1:
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
