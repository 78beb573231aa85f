"""What this training process runs on, decided once: device, GPUs, precision, dataloader workers,
and the preflight that fails fast (GPU visible but CPU-only torch, more processes than GPUs, bf16
forced on a GPU without it). Reuses the doctor's checks and the launch plan's precision rule."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..doctor.checks import torch_install_command
from ..doctor.live_checks import RealTorchProbe
from ..hardware.detect import detect
from ..hardware.profile import GpuInfo, HardwareProfile
from ..plan.decisions import PlanError, accelerate_uses_cpu, decide_precision
from .config import ConfigError, FinetuneConfig


@dataclass(frozen=True)
class Runtime:
    on_cuda: bool
    gpus: tuple[GpuInfo, ...]  # the GPUs this job's processes can see, by bus id
    precision: str  # bf16 | fp16 | fp32
    precision_reason: str
    dataloader_workers: int
    local_world_size: int
    world_size: int
    profile: HardwareProfile


def _visible_gpus(profile: HardwareProfile) -> tuple[GpuInfo, ...]:
    import torch


    if not torch.cuda.is_available():
        return ()
    bus_ids = RealTorchProbe().cuda_bus_ids()
    return tuple(g for g in profile.gpus if g.pci_bus_id in bus_ids)


def resolve_runtime(cfg: FinetuneConfig, profile: HardwareProfile | None = None) -> Runtime:
    import torch

    profile = profile or detect()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    forced_cpu = accelerate_uses_cpu(os.environ) or cfg.allow_cpu
    if profile.gpus and torch.version.cuda is None and not forced_cpu:
        raise ConfigError(f"NVIDIA GPU(s) visible ({profile.gpus[0].name}) but torch {torch.__version__} is a CPU-only build: "
                          f"{torch_install_command(profile.cuda_driver_version)}  (or allow_cpu=true to train on the CPU)")
    on_cuda = torch.cuda.is_available() and not forced_cpu
    if profile.gpus and not on_cuda and not forced_cpu:
        raise ConfigError("NVIDIA GPU(s) visible through NVML but torch cannot use CUDA: run `hf-gpu-train doctor` for the fix "
                          "(or allow_cpu=true to train on the CPU on purpose)")
    if on_cuda and local_world > torch.cuda.device_count():
        raise ConfigError(f"{local_world} processes on this machine but only {torch.cuda.device_count()} GPU(s) visible: "
                          "lower num_processes in the launch config (hf-gpu-train check-config tells)")
    gpus = _visible_gpus(profile) if on_cuda else ()
    requested = cfg.precision
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if requested == "auto" and launched in ("bf16", "fp16"):
        requested = launched  # the launch config decided; still checked against the hardware below
    try:
        mixed, reason = decide_precision(gpus, requested)
    except PlanError as error:
        raise ConfigError(str(error)) from None
    precision = {"no": "fp32"}.get(mixed, mixed)
    if not on_cuda and precision == "bf16" and cfg.precision == "auto":
        precision, reason = "fp32", "CPU: fp32"
    workers = cfg.dataloader_num_workers
    if workers == "auto":
        cores = profile.host.physical_cores or os.cpu_count() or 1
        per_process = max(1, cores // max(1, local_world))
        # on the CPU the cores compute; on a GPU they feed it (one left for the main process)
        workers = min(8, max(1, per_process - 1)) if on_cuda else 0
    return Runtime(on_cuda=on_cuda, gpus=gpus, precision=precision, precision_reason=reason, dataloader_workers=int(workers),
                   local_world_size=local_world, world_size=world, profile=profile)
