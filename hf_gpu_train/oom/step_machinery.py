"""What the in-place training step and prediction step share, made once per Trainer: whether recovery can run under
this Trainer's accelerator (one process, or DDP), the gradient reducer (``grad_sync.py``) and the ballots
(``lockstep.py``). Both are made at their first use (the ballots only with several processes) and taken off when
training ends: a later Trainer on the same model must not carry the gradient hooks, nor the gates on the collectives.
"""

from __future__ import annotations

import logging

import torch

from .grad_sync import BUCKET_BYTES, GradientReducer
from .lockstep import Lockstep, install_gates, remove_gates

log = logging.getLogger("hf_gpu_train.oom")
SUPPORTED_DISTRIBUTED = ("NO", "MULTI_GPU", "MULTI_CPU")


class StepMachinery:
    """The reducer and the ballots of one Trainer's recovery, and whether it runs there at all."""

    def __init__(self, trainer, bucket_bytes: int = BUCKET_BYTES):
        self.trainer = trainer
        self.bucket_bytes = bucket_bytes
        self.reducer: GradientReducer | None = None
        self.lockstep: Lockstep | None = None  # the ballots that keep every rank in the same collectives (several processes)
        self.overlapped_buckets = 0  # gradient buckets reduced while backward still ran (DDP's overlap), over the runs
        self._warned: set[str] = set()

    def several_processes(self) -> bool:
        return self.trainer.accelerator.num_processes > 1

    def supported(self, model, training: bool = True) -> bool:
        """One process or DDP (said once where not: FSDP's and DeepSpeed's collectives run inside forward and
        backward); in training on several processes, a model DDP wraps."""
        accelerator = self.trainer.accelerator
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)).upper()
        if getattr(self.trainer, "is_fsdp_enabled", False):
            kind = "FSDP"
        elif getattr(self.trainer, "is_deepspeed_enabled", False):
            kind = "DEEPSPEED"
        if kind not in SUPPORTED_DISTRIBUTED:
            self._warn_once("unsupported", "OOM recovery is off under %s: its collectives run inside forward and backward "
                            "(single process and DDP are supported)", kind)
            return False
        if training and self.several_processes() and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._warn_once("not-ddp", "OOM recovery is off: %d processes but the model is not wrapped in DDP (%s)",
                            accelerator.num_processes, type(model).__name__)
            return False
        return True

    def reducer_for(self, model) -> GradientReducer:
        if self.reducer is None:
            accelerator = self.trainer.accelerator
            self.reducer = GradientReducer(model.parameters(), accelerator.num_processes, accelerator.device,
                                           bucket_bytes=self.bucket_bytes)
            if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
                log.warning("OOM recovery: this model has BatchNorm layers; after an OOM each micro-batch is normalised "
                            "with its own statistics, so a split step is close to, not equal to, the whole batch's")
        return self.reducer

    def lockstep_for(self, reducer) -> Lockstep:
        if self.lockstep is None:
            install_gates()
            self.lockstep = Lockstep(num_params=len(reducer.params))
        return self.lockstep

    def close(self) -> None:
        """Take the gradient hooks off the parameters and the gates off the collectives."""
        if self.reducer is not None:
            self.reducer.remove()
            self.overlapped_buckets += self.reducer.launched_in_backward
            self.reducer = None
        if self.lockstep is not None:
            self.lockstep.close()
            self.lockstep = None
            remove_gates()

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
