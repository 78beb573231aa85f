"""``hf-gpu-train check-config``: an accelerate config checked against a machine before a job waits in a queue."""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass, fields

from ..hardware.profile import HardwareProfile
from .decisions import DEFAULT_BUSY_THRESHOLD_BYTES, accelerate_uses_cpu

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
    ids_raw = config.get("gpu_ids")
    ids: list[int] = []
    if ids_raw not in (None, "all", ""):
        try:
            ids = [int(x) for x in str(ids_raw).split(",") if x.strip()]
        except ValueError:
            found.append(Finding(ERROR, f"gpu_ids {ids_raw!r} is not a comma-separated list of GPU indices"))
    bad_ids = [i for i in ids if i not in gpus]
    if bad_ids:
        found.append(Finding(ERROR, f"gpu_ids {bad_ids} out of range: {profile.display_name} has GPUs {sorted(gpus) or 'none'}"))
    selected = [gpus[i] for i in ids if i in gpus] or list(profile.gpus)
    usable = [g for g in selected if not g.mig_enabled]
    if not use_cpu and dist != "NO" and per_machine > len(usable):
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
        no_p2p = [p for p in profile.pairs if p.a in sel and p.b in sel and not p.p2p_ok]
        if no_p2p and env.get("NCCL_P2P_DISABLE") != "1" and env.get("NCCL_P2P_LEVEL") not in ("NVL", "LOC"):
            found.append(Finding(WARNING, "P2P not supported between GPUs " + ", ".join(f"{p.a}-{p.b}" for p in no_p2p)
                                 + " but NCCL_P2P_DISABLE is not set: NCCL collectives may hang"))
        if len({g.name for g in selected}) > 1:
            found.append(Finding(WARNING, "mixed GPU models: " + ", ".join(sorted({g.name for g in selected}))
                                 + "; the slowest paces every step"))
    for g in selected:
        if (g.memory_used_bytes or 0) >= DEFAULT_BUSY_THRESHOLD_BYTES and not use_cpu:
            found.append(Finding(WARNING, f"GPU {g.index} is busy: {(g.memory_used_bytes or 0) / 2**30:.1f} GiB held by other processes"))
    return found
