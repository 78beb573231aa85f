"""Checks that run work on the GPUs: the small win and the P2P copy.

The torch side sits behind ``TorchProbe`` so the decision logic is tested on a CPU machine with a
fake probe; the real probe runs in ``tests`` marked ``gpu`` and in ``scripts/gpu_check.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from ..hardware.backend import normalize_bus_id
from ..hardware.profile import GpuInfo, HardwareProfile
from .checks import FAIL, PASS, SKIP, Check


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str


class TorchProbe(Protocol):
    def cuda_bus_ids(self) -> list[str]: ...
    def small_win(self, cuda_index: int, precision: str) -> ProbeResult: ...
    def p2p_copy(self, src: int, dst: int) -> ProbeResult: ...


def best_precision(gpu: GpuInfo) -> str:
    return "bf16" if gpu.bf16_supported else "fp16"


class RealTorchProbe:
    """Runs one forward and backward of a small MLP on a given CUDA device."""

    def cuda_bus_ids(self) -> list[str]:
        import torch

        ids = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            ids.append(normalize_bus_id(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"))
        return ids

    def small_win(self, cuda_index: int, precision: str) -> ProbeResult:
        import torch

        device = torch.device("cuda", cuda_index)
        start = time.perf_counter()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(device)
        x = torch.randn(64, 512, device=device)
        y = torch.randint(0, 10, (64,), device=device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.cuda.synchronize(device)
        elapsed_ms = (time.perf_counter() - start) * 1000
        misplaced = [n for n, p in model.named_parameters() if p.device != device or p.grad is None or p.grad.device != device]
        if misplaced:
            return ProbeResult(False, f"parameters or gradients not on {device}: {misplaced}")
        if not torch.isfinite(loss) or not all(torch.isfinite(p.grad).all() for p in model.parameters()):
            return ProbeResult(False, f"non-finite loss or gradients in {precision}")
        return ProbeResult(True, f"{precision} loss {loss.item():.3f}, {elapsed_ms:.0f} ms")

    def p2p_copy(self, src: int, dst: int) -> ProbeResult:
        import torch

        reference = torch.arange(1 << 22, dtype=torch.float32, device=f"cuda:{src}")
        there = reference.to(f"cuda:{dst}")
        back = there.to(f"cuda:{src}")
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        peer = torch.cuda.can_device_access_peer(src, dst)
        if not torch.equal(there.cpu(), reference.cpu()) or not torch.equal(back, reference):
            return ProbeResult(False, f"data changed in the copy cuda:{src} <-> cuda:{dst} (peer access {peer})")
        return ProbeResult(True, f"16 MiB copied both ways intact (peer access {peer})")


def _cuda_index_by_nvml(profile: HardwareProfile, probe: TorchProbe) -> dict[int, int]:
    """NVML index -> CUDA index, matched by PCI bus id (the two orders differ unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID; CUDA_VISIBLE_DEVICES hides some)."""
    cuda_ids = probe.cuda_bus_ids()
    return {g.index: cuda_ids.index(g.pci_bus_id) for g in profile.gpus if g.pci_bus_id in cuda_ids}


def small_win_checks(profile: HardwareProfile, probe: TorchProbe) -> list[Check]:
    mapping = _cuda_index_by_nvml(profile, probe)
    checks = []
    for gpu in profile.gpus:
        name = f"small win GPU{gpu.index}"
        if gpu.index not in mapping:
            checks.append(Check(name, SKIP, f"{gpu.name} ({gpu.pci_bus_id}) not visible to CUDA (CUDA_VISIBLE_DEVICES or MIG)"))
            continue
        results = []
        for precision in ("fp32", best_precision(gpu)):
            try:
                results.append(probe.small_win(mapping[gpu.index], precision))
            except Exception as error:  # any CUDA failure here is the finding itself
                results.append(ProbeResult(False, f"{precision}: {type(error).__name__}: {error}"))
        ok = all(r.ok for r in results)
        detail = f"cuda:{mapping[gpu.index]}: " + "; ".join(r.detail for r in results)
        checks.append(Check(name, PASS if ok else FAIL, detail, None if ok else
                            "The GPU cannot train: check `dmesg | grep -i xid`, the driver/torch checks above, and ECC errors "
                            "(`nvidia-smi -q -d ECC`)."))
    return checks


def p2p_copy_checks(profile: HardwareProfile, probe: TorchProbe) -> list[Check]:
    mapping = _cuda_index_by_nvml(profile, probe)
    checks = []
    for pair in profile.pairs:
        name = f"P2P copy GPU{pair.a}<->GPU{pair.b}"
        if pair.a not in mapping or pair.b not in mapping:
            checks.append(Check(name, SKIP, "one of the GPUs is not visible to CUDA"))
            continue
        try:
            result = probe.p2p_copy(mapping[pair.a], mapping[pair.b])
        except Exception as error:  # a hang-free failure of the copy is the finding
            result = ProbeResult(False, f"{type(error).__name__}: {error}")
        checks.append(Check(name, PASS if result.ok else FAIL, result.detail, None if result.ok else
                            "Some boards corrupt P2P copies: train with NCCL_P2P_DISABLE=1 (hf-gpu-train config sets it "
                            "from the topology) and check the BIOS (ACS / IOMMU settings)."))
    return checks
