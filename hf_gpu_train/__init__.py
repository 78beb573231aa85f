"""hf_gpu_train: fine-tuning with Hugging Face Trainer and Accelerate on NVIDIA GPUs that works the first time.

Hardware detection and the doctor never import torch at import time; the Trainer pieces
(``attach_telemetry``, ``enable_oom_recovery``, ``load_config``) are imported on first use.
"""
import importlib

__version__ = "0.1.0"

from .hardware.detect import detect  # noqa: E402
from .hardware.profile import GpuInfo, GpuPair, HardwareProfile, HostInfo  # noqa: E402
from .hardware.snapshot import load_machine  # noqa: E402

_LAZY = {
    "attach_telemetry": ("hf_gpu_train.callbacks", "attach_telemetry"),
    "TelemetryCallback": ("hf_gpu_train.callbacks", "TelemetryCallback"),
    "enable_oom_recovery": ("hf_gpu_train.oom", "enable_oom_recovery"),
    "guard_loss_scaling": ("hf_gpu_train.oom", "guard_loss_scaling"),
    "OOMFaultInjector": ("hf_gpu_train.oom", "OOMFaultInjector"),
    "attach_watchdog": ("hf_gpu_train.faults.watchdog", "attach_watchdog"),
    "attach_preemption": ("hf_gpu_train.faults.preemption", "attach_preemption"),
    "share_running_statistics": ("hf_gpu_train.collectives.running_statistics", "share_running_statistics"),
    "make_plan": ("hf_gpu_train.plan.planner", "make_plan"),
    "FinetuneConfig": ("hf_gpu_train.finetune.config", "FinetuneConfig"),
    "load_config": ("hf_gpu_train.finetune.loading", "load_config"),
}

__all__ = ["__version__", "detect", "load_machine", "HardwareProfile", "GpuInfo", "GpuPair", "HostInfo", *_LAZY]


def __getattr__(name):
    if name in _LAZY:

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hf_gpu_train' has no attribute {name!r}")
