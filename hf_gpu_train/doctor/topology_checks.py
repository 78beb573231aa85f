"""Checks of how the GPUs fit together: one model or several, NVLinks that P2P cannot use."""

from __future__ import annotations

from collections import Counter

from ..hardware.profile import HardwareProfile
from .check import PASS, WARN, Check

NVLINK_WITHOUT_P2P_CAUSES = (
    "likely causes: on NVSwitch systems (HGX/DGX) the NVIDIA fabric manager is not running or its version differs "
    "from the driver's; in a virtual machine the hypervisor does not pass GPU peer-to-peer through (or the GPUs "
    "are not in one P2P group); a driver problem (a driver update without a reboot, Xid errors in dmesg)"
)
NVLINK_WITHOUT_P2P_FIX = (
    "HGX/DGX: `systemctl status nvidia-fabricmanager` (start it; its version must equal the driver's, "
    "`nvidia-smi -q | grep -i fabric`). VM: ask the provider for a P2P-enabled (NVLink) instance type or enable P2P "
    "in the hypervisor's passthrough settings. Then check `nvidia-smi topo -p2p r` shows OK and `nvidia-smi nvlink -s` "
    "shows the links up; rerun `hf-gpu-train detect --save`. Until then `hf-gpu-train config` sets NCCL_P2P_DISABLE=1."
)


def check_gpu_models(profile: HardwareProfile) -> Check:
    """Mixed models: DDP runs every step at the slowest GPU's pace and the smallest GPU's memory."""
    counts = Counter(g.name for g in profile.gpus)
    if len(counts) <= 1:
        return Check("GPU models", PASS, ", ".join(f"{n}x {name}" for name, n in counts.items()) or "no GPU")
    listed = ", ".join(f"{name} (GPU {','.join(str(g.index) for g in profile.gpus if g.name == name)})" for name in counts)
    return Check("GPU models", WARN, f"mixed GPU models: {listed}; one DDP job runs at the pace and memory of its slowest GPU",
                 "`hf-gpu-train config` uses the largest group of one model; to choose, name GPUs with --gpu-ids (one model "
                 "per job), or run one job per model.")


def check_nvlink_p2p(profile: HardwareProfile) -> Check:
    """NVLinks up but P2P reported unsupported: the links carry nothing, NCCL goes through host memory."""
    linked = [p for p in profile.pairs if p.nvlinks]
    if not linked:
        return Check("NVLink P2P", PASS, "no NVLink between these GPUs")
    broken = [p for p in linked if not p.p2p_ok]
    if not broken:
        return Check("NVLink P2P", PASS, f"P2P works on all {len(linked)} NVLinked pair(s)")
    by_reason: dict[str, list[str]] = {}
    for p in broken:
        by_reason.setdefault(p.p2p_problem or "unknown", []).append(f"{p.a}-{p.b}")
    pairs = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
    return Check("NVLink P2P", WARN, f"NVLinks active but P2P reported unsupported on {pairs}: NCCL then moves data through "
                 f"host memory at PCIe speed and the NVLinks carry nothing; {NVLINK_WITHOUT_P2P_CAUSES}", NVLINK_WITHOUT_P2P_FIX)
