"""Refuse to train on the CPU by accident: a GPU visible through NVML while the model sits on the CPU."""

from __future__ import annotations

from transformers import TrainerCallback

from ..errors import UsageError
from ..hardware.backend import NvmlBackend
from ..hardware.detect import detect
from ..hardware.host import HostInfo
from .devices import model_device


class TrainingOnCpuByAccident(UsageError):
    pass


class CpuByAccidentGuard(TrainerCallback):
    """At train begin: NVML sees a GPU but the model's parameters are on the CPU -> error with the fix.
    Opt out with ``allow_cpu=True`` (or ``allow_cpu=true`` in a finetune config)."""

    def __init__(self, allow_cpu: bool = False, backend: NvmlBackend | None = None):
        self.allow_cpu = allow_cpu
        self.backend = backend

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.allow_cpu or model_device(model).type != "cpu":
            return control

        profile = detect(self.backend, host=HostInfo(hostname="-")) if self.backend else detect()
        if profile.gpus:
            g = profile.gpus[0]
            raise TrainingOnCpuByAccident(
                f"{len(profile.gpus)} GPU(s) visible ({g.name}) but the model is on the CPU: this run would train on the CPU. "
                "Check `hf-gpu-train doctor` (CPU-only torch? CUDA_VISIBLE_DEVICES? use_cpu=True in TrainingArguments?), "
                "or opt out with allow_cpu=True if you mean it")
        return control
