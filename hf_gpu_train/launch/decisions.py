"""Pure decisions from a hardware profile and the user's options: precision, GPUs, NCCL settings.

Each returns its value with the reason, so the plan can print both. No I/O, no torch.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict

from ..errors import UsageError
from ..hardware.profile import GpuInfo, HardwareProfile

DEFAULT_BUSY_THRESHOLD_BYTES = 1 * 2**30
FP8_BACKENDS = ("transformer_engine", "torchao", "msamp")


def accelerate_uses_cpu(env) -> bool:
    """Whether ``ACCELERATE_USE_CPU`` in this environment mapping asks accelerate for CPU processes."""
    return str(env.get("ACCELERATE_USE_CPU", "")).lower() in ("1", "true", "yes")


class PlanError(UsageError):
    """The hardware cannot honour what was asked: the message names the GPU and the alternative."""


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


# -- GPU selection -----------------------------------------------------------------------------

def _parse_gpus(spec: str) -> int | list[int] | None:
    spec = str(spec).strip()
    if spec in ("", "all"):
        return None
    if "," in spec or spec.startswith("id:"):
        try:
            return [int(x) for x in spec.removeprefix("id:").split(",") if x.strip()]
        except ValueError:
            raise PlanError(f"--gpus {spec!r}: give all, a count (2) or NVML indices (0,3)") from None
    try:
        count = int(spec)
    except ValueError:
        raise PlanError(f"--gpus {spec!r}: give all, a count (2) or NVML indices (0,3)") from None
    if count < 1:
        raise PlanError(f"--gpus {count}: at least 1")
    return count


def nvlink_islands(profile: HardwareProfile, gpus: list[GpuInfo]) -> list[list[GpuInfo]]:
    """Groups of GPUs joined by NVLink (connected components), largest first."""
    index = {g.index: g for g in gpus}
    seen: set[int] = set()
    islands = []
    for g in gpus:
        if g.index in seen:
            continue
        stack, island = [g.index], []
        seen.add(g.index)
        while stack:
            cur = stack.pop()
            island.append(index[cur])
            for other in index:
                pair = profile.pair(cur, other) if other != cur else None
                if pair and pair.nvlinks and other not in seen:
                    seen.add(other)
                    stack.append(other)
        islands.append(sorted(island, key=lambda x: x.index))
    return sorted(islands, key=lambda isl: (-len(isl), isl[0].index))


def select_gpus(
    profile: HardwareProfile,
    gpus: str = "all",
    include_busy: bool = False,
    busy_threshold_bytes: int = DEFAULT_BUSY_THRESHOLD_BYTES,
) -> tuple[tuple[GpuInfo, ...], list[str]]:
    """(selected GPUs, reasons). Skips MIG, display and busy GPUs unless named or --include-busy."""
    wanted = _parse_gpus(gpus)
    reasons: list[str] = []
    if not profile.gpus:
        if wanted not in (None,):
            raise PlanError(f"--gpus {gpus}: this machine has no GPU")
        return (), ["no GPU: processes run on the CPU"]
    if isinstance(wanted, list):
        known = {g.index for g in profile.gpus}
        unknown = [i for i in wanted if i not in known]
        if unknown:
            raise PlanError(f"--gpus {gpus}: no GPU {unknown} here (NVML indices {sorted(known)})")
        chosen = tuple(profile.gpu(i) for i in wanted)
        reasons.append(f"GPUs {','.join(map(str, wanted))} as asked")
        for g in chosen:
            if g.mig_enabled:
                reasons.append(f"GPU {g.index} is in MIG mode: CUDA sees its MIG instances, not the whole GPU")
            if (g.memory_used_bytes or 0) >= busy_threshold_bytes:
                reasons.append(f"GPU {g.index} already has {(g.memory_used_bytes or 0) / 2**30:.1f} GiB in use by other processes")
        if len({g.name for g in chosen}) > 1:
            reasons.append("mixed GPU models: the slowest GPU paces every DDP step")
        return chosen, reasons

    usable = []
    for g in profile.gpus:
        if g.mig_enabled:
            reasons.append(f"skip GPU {g.index}: MIG mode on (NCCL cannot span MIG instances; `nvidia-smi -i {g.index} -mig 0`)")
        elif g.display_active:
            reasons.append(f"skip GPU {g.index}: drives a display (slower and shares memory with the desktop); name it in --gpus to use it")
        elif not include_busy and (g.memory_used_bytes or 0) >= busy_threshold_bytes:
            reasons.append(f"skip GPU {g.index}: {(g.memory_used_bytes or 0) / 2**30:.1f} GiB held by other processes "
                           f"(threshold {busy_threshold_bytes / 2**30:.1f} GiB; --include-busy to use it)")
        else:
            usable.append(g)
    if not usable:
        raise PlanError("every GPU was skipped (" + "; ".join(reasons) + "). Name GPUs with --gpus 0,1 or pass --include-busy")
    groups: dict[tuple[str, int], list[GpuInfo]] = defaultdict(list)
    for g in usable:
        groups[(g.name, g.memory_total_bytes)].append(g)
    if len(groups) > 1:
        best = max(groups.values(), key=lambda grp: (len(grp), grp[0].memory_total_bytes, grp[0].compute_capability or (0, 0)))
        others = [f"{grp[0].name} x{len(grp)}" for grp in groups.values() if grp is not best]
        reasons.append(f"mixed GPU models: using the largest matching group ({best[0].name} x{len(best)}), leaving out "
                       f"{', '.join(others)}; the slowest GPU would pace every DDP step")
        usable = best
    if wanted is None:
        reasons.append(f"{len(usable)} usable GPU(s): {','.join(str(g.index) for g in usable)}")
        return tuple(usable), reasons
    if wanted > len(usable):
        raise PlanError(f"--gpus {wanted}: only {len(usable)} usable GPU(s) here ({', '.join(str(g.index) for g in usable)})")
    chosen = _prefer_close(profile, usable, wanted, reasons)
    return tuple(chosen), reasons


def _prefer_close(profile: HardwareProfile, usable: list[GpuInfo], count: int, reasons: list[str]) -> list[GpuInfo]:
    """Fewer GPUs than usable: one NVLink island if one holds them all, else one NUMA node."""
    islands = [isl for isl in nvlink_islands(profile, usable) if len(isl) >= count and len(isl) > 1]
    if islands and count > 1:
        island = min(islands, key=lambda isl: (len(isl), isl[0].index))  # the tightest island that fits
        chosen = island[:count]
        if len(island) < len(usable):
            reasons.append(f"{count} GPU(s) from one NVLink island ({','.join(str(g.index) for g in island)})")
        return chosen
    by_numa: dict[int | None, list[GpuInfo]] = defaultdict(list)
    for g in usable:
        by_numa[g.numa_node].append(g)
    fitting = [grp for node, grp in sorted(by_numa.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)) if len(grp) >= count]
    if fitting and len(by_numa) > 1:
        reasons.append(f"{count} GPU(s) from NUMA node {fitting[0][0].numa_node} (no cross-socket traffic)")
        return fitting[0][:count]
    return usable[:count]


def check_homogeneous(profile: HardwareProfile, gpus: tuple[GpuInfo, ...], other_nodes: tuple[HardwareProfile, ...],
                      gpu_spec: str, include_busy: bool, busy_threshold_bytes: int) -> None:
    """Every node must bring the same GPUs: accelerate starts num_processes // num_machines
    processes on each node (accelerate #3894), so a smaller node over-subscribes, a mixed one is paced by the slowest."""
    mine = sorted(g.name for g in gpus)
    for node in other_nodes:
        try:
            theirs = sorted(g.name for g in select_gpus(node, gpu_spec, include_busy, busy_threshold_bytes)[0])
        except PlanError as error:
            raise PlanError(f"node {node.display_name}: {error}") from None
        if theirs != mine:
            def summary(names):
                return ", ".join(f"{names.count(n)}x {n}" for n in sorted(set(names))) or "no GPU"

            raise PlanError(f"nodes must be homogeneous: {node.display_name} has {summary(theirs)} usable where "
                            f"{profile.display_name} has {summary(mine)}; accelerate starts the same number of processes "
                            "on every node (num_processes // num_machines). Use --gpus to pick a common subset.")


# -- NCCL --------------------------------------------------------------------------------------

def nccl_environment(
    profile: HardwareProfile,
    gpus: tuple[GpuInfo, ...],
    num_machines: int = 1,
    debug: bool = False,
) -> list[tuple[str, str, str]]:
    """(variable, value, reason) for the training processes, from the real topology."""
    env: list[tuple[str, str, str]] = []
    if not gpus:
        return env
    env.append(("CUDA_DEVICE_ORDER", "PCI_BUS_ID", "gpu_ids are NVML indices (PCI order); CUDA's default order is fastest-first"))
    pairs = [profile.pair(a.index, b.index) for i, a in enumerate(gpus) for b in gpus[i + 1:]]
    pairs = [p for p in pairs if p is not None]
    no_p2p = [p for p in pairs if not p.p2p_ok]
    if no_p2p:
        what = "; ".join(f"{p.a}-{p.b} ({p.p2p_read if p.p2p_read != 'OK' else p.p2p_write})" for p in no_p2p)
        nvlinked_ok = [p for p in pairs if p.nvlinks and p.p2p_ok]
        if nvlinked_ok and all(p.nvlinks == 0 for p in no_p2p):
            env.append(("NCCL_P2P_LEVEL", "NVL", f"P2P not supported on PCIe pairs {what}, but NVLinked pairs "
                        f"{', '.join(f'{p.a}-{p.b}' for p in nvlinked_ok)} keep P2P over NVLink"))
        else:
            env.append(("NCCL_P2P_DISABLE", "1", f"NVML reports P2P not supported for {what}: collectives hang with P2P on "
                        "(nccl-tests #117, NVIDIA/nccl #1127)"))
    if num_machines > 1:
        if not profile.host.infiniband_devices:
            env.append(("NCCL_IB_DISABLE", "1", "multi-node without InfiniBand devices on this machine: NCCL uses TCP sockets"))
        env.append(("NCCL_SOCKET_IFNAME", "^docker,lo,veth", "keep NCCL's bootstrap off docker bridges and loopback"))
    if debug:
        env += [("NCCL_DEBUG", "INFO", "--debug-nccl"), ("NCCL_DEBUG_SUBSYS", "INIT,P2P,NET", "--debug-nccl"),
                ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "--debug-nccl: flight recorder dump when a collective times out"),
                ("TORCH_DISTRIBUTED_DEBUG", "DETAIL", "--debug-nccl: name mismatched collectives")]
    return env
