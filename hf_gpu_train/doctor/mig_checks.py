"""MIG: a pending mode change, instances (one process each), MIG on with no instance at all.

A pending change is the trap: `nvidia-smi -i N -mig 1` only takes effect at the next GPU reset, so the
GPU still trains whole today and silently becomes MIG instances after a reboot (or the other way round).
"""

from __future__ import annotations

from ..hardware.profile import GpuInfo, HardwareProfile
from ..textfmt import gib
from .check import PASS, WARN, Check


def _pending(gpu: GpuInfo) -> str:
    now, then = ("on", "off") if gpu.mig_enabled else ("off", "on")
    becomes = "becomes MIG instances" if not gpu.mig_enabled else "becomes one whole GPU"
    works = "works whole" if not gpu.mig_enabled else "is split into MIG instances"
    return (f"GPU{gpu.index}: MIG mode change pending ({now} now, {then} after the next GPU reset): `nvidia-smi -mig` was run "
            f"but the GPU not reset, so the GPU {works} now and {becomes} at the next reset or reboot")


def _instances(gpu: GpuInfo) -> str:
    if gpu.mig_instances is None:
        return f"GPU{gpu.index}: MIG mode on (instances not recorded in this snapshot)"
    if not gpu.mig_instances:
        return f"GPU{gpu.index}: MIG mode on but no MIG instance exists: CUDA sees no device on this GPU"
    listed = ", ".join(f"{m.profile} {gib(m.memory_free_bytes)} ({m.uuid})" for m in gpu.mig_instances)
    return f"GPU{gpu.index}: MIG mode on with {len(gpu.mig_instances)} instance(s): {listed}"


def check_mig(profile: HardwareProfile) -> Check:
    pending = [g for g in profile.gpus if g.mig_change_pending]
    on = [g for g in profile.gpus if g.mig_enabled and not g.mig_change_pending]
    if not pending and not on:
        return Check("MIG", PASS, "MIG mode off on every GPU")
    details, fixes = [], []
    if pending:
        ids = ",".join(str(g.index) for g in pending)
        details += [_pending(g) for g in pending]
        undo = " ".join(f"`sudo nvidia-smi -i {g.index} -mig {1 if g.mig_enabled else 0}`" for g in pending)
        fixes.append(f"Apply it: stop every process on the GPU, then `sudo nvidia-smi -i {ids} -r` (or reboot; some VMs need "
                     f"the host to reset it); or undo it: {undo}. Then run `hf-gpu-train detect --save` again.")
    if on:
        ids = ",".join(str(g.index) for g in on)
        details += [_instances(g) for g in on]
        details.append("one process per instance (CUDA_VISIBLE_DEVICES=<MIG UUID>), NCCL cannot join instances")
        if any(g.mig_instances == () for g in on):
            fixes.append(f"Create an instance (`sudo nvidia-smi mig -cgi 9 -C -i {on[0].index}` makes a 3g one; "
                         "`nvidia-smi mig -lgip` lists the profiles).")
        fixes.append(f"One process on one instance: `hf-gpu-train config` plans it against the instance's memory. For "
                     f"whole-GPU or multi-GPU training: `sudo nvidia-smi -i {ids} -mig 0`, then reset the GPU.")
    return Check("MIG", WARN, "; ".join(details), " ".join(fixes))
