"""Pure decisions from a hardware profile and the user's options: precision, GPUs, NCCL settings.

Each returns its value with the reason, so the plan can print both. No I/O, no torch.
"""

from __future__ import annotations

import importlib.util

from ..errors import PlanError
from ..hardware.profile import GpuInfo, GpuPair, HardwareProfile
from .gpus import DEFAULT_BUSY_THRESHOLD_BYTES, select_devices

__all__ = ["PlanError", "DEFAULT_BUSY_THRESHOLD_BYTES", "accelerate_uses_cpu", "check_homogeneous", "decide_precision",
           "nccl_environment", "nccl_path", "p2p_level_cutoff", "select_gpus"]
FP8_BACKENDS = ("transformer_engine", "torchao", "msamp")


def accelerate_uses_cpu(env) -> bool:
    """Whether ``ACCELERATE_USE_CPU`` in this environment mapping asks accelerate for CPU processes."""
    return str(env.get("ACCELERATE_USE_CPU", "")).lower() in ("1", "true", "yes")


# -- precision --------------------------------------------------------------------------------

def decide_precision(gpus: tuple[GpuInfo, ...], requested: str = "auto", fp8_backend_installed: bool | None = None) -> tuple[str, str]:
    """(accelerate mixed_precision value, reason)."""
    if requested not in ("auto", "bf16", "fp16", "fp32", "fp8"):
        raise PlanError(f"--precision {requested!r} is not one of auto, bf16, fp16, fp32, fp8")
    if not gpus:
        if requested in ("auto", "fp32"):
            return "no", "no GPU: fp32 on the CPU (mixed precision brings nothing without tensor cores)"
        if requested == "bf16":
            return "bf16", "bf16 on the CPU as asked (fast only with AMX or AVX512-BF16)"
        raise PlanError(f"--precision {requested} needs a GPU and this machine has none: use --precision fp32")
    if requested == "fp32":
        return "no", "fp32 as asked"
    no_bf16 = [g for g in gpus if not g.bf16_supported]
    if requested == "bf16" and no_bf16:
        g = no_bf16[0]
        raise PlanError(f"bf16 requested but GPU {g.index} ({g.name}, compute capability {g.capability_str}) has no bf16 "
                        "support: use --precision fp16")
    if requested == "fp8":
        no_fp8 = [g for g in gpus if not g.fp8_supported]
        if no_fp8:
            g = no_fp8[0]
            raise PlanError(f"fp8 requested but GPU {g.index} ({g.name}, compute capability {g.capability_str}) has no fp8 "
                            "(needs 8.9 or newer): use --precision bf16")
        installed = fp8_backend_installed if fp8_backend_installed is not None else any(
            importlib.util.find_spec(m) is not None for m in FP8_BACKENDS)
        if not installed:
            raise PlanError("fp8 requested but no fp8 backend is installed (transformer-engine, torchao or ms-amp): "
                            "pip install torchao, or use --precision bf16")
        return "fp8", "fp8 as asked: every selected GPU has compute capability >= 8.9 and a backend is installed"
    if requested == "fp16":
        return "fp16", "fp16 as asked (needs loss scaling; bf16 is safer where supported)"
    if not no_bf16:
        caps = sorted({g.capability_str for g in gpus})
        return "bf16", f"every selected GPU has compute capability >= 8.0 ({', '.join(caps)}): bf16, no loss scaling"
    g = no_bf16[0]
    return "fp16", f"GPU {g.index} ({g.name}, compute capability {g.capability_str}) has no bf16: fp16 with loss scaling"


# -- GPU selection (gpus.py decides; these keep the whole-GPU view for callers) -----------

def select_gpus(
    profile: HardwareProfile,
    gpus: str | int | None = "all",
    include_busy: bool = False,
    busy_threshold_bytes: int = DEFAULT_BUSY_THRESHOLD_BYTES,
    gpu_ids: str | None = None,
) -> tuple[tuple[GpuInfo, ...], list[str]]:
    """(selected whole GPUs, reasons). A selection that is only a MIG instance is refused: its memory is the
    instance's, not the GPU's, so a caller sizing work by ``memory_total_bytes`` would plan too big
    (``make_plan`` and ``select_devices`` handle MIG)."""
    selection = select_devices(profile, gpus, gpu_ids, include_busy, busy_threshold_bytes)
    if selection.mig_instance is not None:
        m = selection.mig_instance
        raise PlanError(f"only a MIG instance is usable here ({m.uuid}, {m.profile}, {m.memory_free_bytes / 2**30:.1f} GiB free), "
                        f"not a whole GPU: plan it with `hf-gpu-train config`, or size the planner with "
                        f"--gpu-memory-gib {m.memory_free_bytes / 2**30:.1f}")
    return selection.gpus, list(selection.reasons)


def check_homogeneous(profile: HardwareProfile, gpus: tuple[GpuInfo, ...], other_nodes: tuple[HardwareProfile, ...],
                      gpu_spec: str, include_busy: bool, busy_threshold_bytes: int, gpu_ids: str | None = None) -> None:
    """Every node must bring the same GPUs: accelerate starts num_processes // num_machines
    processes on each node (accelerate #3894), so a smaller node over-subscribes, a mixed one is paced by the slowest."""
    mine = sorted(g.name for g in gpus)
    for node in other_nodes:
        try:
            theirs = sorted(g.name for g in select_gpus(node, gpu_spec, include_busy, busy_threshold_bytes, gpu_ids)[0])
        except PlanError as error:
            raise PlanError(f"node {node.display_name}: {error}") from None
        if theirs != mine:
            def summary(names):
                return ", ".join(f"{names.count(n)}x {n}" for n in sorted(set(names))) or "no GPU"

            raise PlanError(f"nodes must be homogeneous: {node.display_name} has {summary(theirs)} usable where "
                            f"{profile.display_name} has {summary(mine)}; accelerate starts the same number of processes "
                            "on every node (num_processes // num_machines). Use --gpus N or --gpu-ids to pick a common subset.")


# -- NCCL --------------------------------------------------------------------------------------

# NCCL_P2P_LEVEL values, nearest first (NCCL env docs): P2P is used for paths up to the level.
NCCL_P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
# nvidia-smi's NODE (host bridges of one NUMA node) is NCCL's PHB ("same NUMA node, through the CPU").
_NCCL_PATH_OF_TOPOLOGY = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS"}


def nccl_path(pair: GpuPair) -> str | None:
    """The pair's path in NCCL_P2P_LEVEL words: NVL over NVLink, else its PCIe level; None when unknown."""
    return "NVL" if pair.nvlinks else _NCCL_PATH_OF_TOPOLOGY.get(pair.topology or "")


def p2p_level_cutoff(pairs: list[GpuPair]) -> str | None:
    """The NCCL_P2P_LEVEL that keeps P2P on every working pair and off every broken one, if the broken
    pairs all lie beyond the working ones (e.g. NVL on bridged 3090s, PXB on a box whose P2P stops at the
    socket); None when no level separates them or nothing works."""
    paths = [(nccl_path(p), p.p2p_ok) for p in pairs]
    if any(path is None for path, _ in paths):
        return None
    ok = [NCCL_P2P_LEVELS.index(path) for path, works in paths if works]
    bad = [NCCL_P2P_LEVELS.index(path) for path, works in paths if not works]
    if not ok or not bad or min(bad) <= max(ok):
        return None
    return NCCL_P2P_LEVELS[max(ok)]


def pairs_text(pairs: list[GpuPair], limit: int = 6, why: bool = True) -> str:
    """Pairs grouped by NVML's reason: "0-4, 0-5, 0-6, 0-7, 1-4, 1-5 and 10 more (IOH topology not supported)"."""
    groups: dict[str | None, list[GpuPair]] = {}
    for p in pairs:
        groups.setdefault(p.p2p_problem if why else None, []).append(p)
    texts = []
    for problem, group in groups.items():
        names = ", ".join(f"{p.a}-{p.b}" for p in group[:limit]) + (f" and {len(group) - limit} more" if len(group) > limit else "")
        texts.append(names + (f" ({problem})" if problem else ""))
    return "; ".join(texts)


def nccl_environment(
    profile: HardwareProfile,
    gpus: tuple[GpuInfo, ...],
    num_machines: int = 1,
    debug: bool = False,
    device_order: bool = True,
) -> list[tuple[str, str, str]]:
    """(variable, value, reason) for the training processes, from the real topology. ``device_order``
    off for a MIG instance: it is named by UUID, no index order to fix."""
    env: list[tuple[str, str, str]] = []
    if not gpus:
        return env
    if device_order:
        env.append(("CUDA_DEVICE_ORDER", "PCI_BUS_ID", "gpu_ids are NVML indices (PCI order); CUDA's default order is fastest-first"))
    pairs = [profile.pair(a.index, b.index) for i, a in enumerate(gpus) for b in gpus[i + 1:]]
    pairs = [p for p in pairs if p is not None]
    no_p2p = [p for p in pairs if not p.p2p_ok]
    if no_p2p:
        ok = [p for p in pairs if p.p2p_ok]
        level = p2p_level_cutoff(pairs)
        if level == "NVL":
            env.append(("NCCL_P2P_LEVEL", "NVL", f"P2P not supported on PCIe pairs {pairs_text(no_p2p)}, but NVLinked pairs "
                        f"{pairs_text(ok, why=False)} keep P2P over NVLink"))
        elif level:
            env.append(("NCCL_P2P_LEVEL", level, f"P2P not supported on {pairs_text(no_p2p)}, all farther than {level}; "
                        f"the pairs up to {level} keep P2P ({pairs_text(ok, why=False)})"))
        else:
            reason = (f"NVML reports P2P not supported for {pairs_text(no_p2p)}: collectives hang with P2P on "
                      "(nccl-tests #117, NVIDIA/nccl #1127)")
            linked = [p for p in no_p2p if p.nvlinks]
            if linked:
                reason += (f"; NVLinks are active on {pairs_text(linked, why=False)} but unused without P2P: "
                           "`hf-gpu-train doctor` names the likely cause (fabric manager, VM P2P)")
            env.append(("NCCL_P2P_DISABLE", "1", reason))
    if num_machines > 1:
        if not profile.host.infiniband_devices:
            env.append(("NCCL_IB_DISABLE", "1", "multi-node without InfiniBand devices on this machine: NCCL uses TCP sockets"))
        env.append(("NCCL_SOCKET_IFNAME", "^docker,lo,veth", "keep NCCL's bootstrap off docker bridges and loopback"))
    if len(gpus) * num_machines > 1:
        # PyTorch's flight recorder: each rank keeps its last collectives; a timeout dumps them (scripts/finetune.py
        # points the dump at output_dir/nccl-trace-rank-N), so a hang that the watchdog does not end names the collective
        env += [("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", "flight recorder: the last 2000 collectives of each rank, for a hang's "
                 "post-mortem (torch's `python -m torch.distributed.flight_recorder.fr_trace`)"),
                ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "flight recorder: dump every rank's record when a collective times out")]
    if debug:
        env += [("NCCL_DEBUG", "INFO", "--debug-nccl"), ("NCCL_DEBUG_SUBSYS", "INIT,P2P,NET", "--debug-nccl"),
                ("TORCH_DISTRIBUTED_DEBUG", "DETAIL", "--debug-nccl: name mismatched collectives")]
    return env
