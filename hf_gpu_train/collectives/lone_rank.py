"""A training process that believes it is alone while its launcher started several.

accelerate builds its state from the backend it is given. Under DeepSpeed on a machine without CUDA (DeepSpeed's CPU
accelerator), a Trainer whose ``TrainingArguments`` have neither ``use_cpu=True`` nor ``ddp_backend="gloo"`` gets no
backend: accelerate's ``_prepare_backend`` knows none for the CPU device, and its state then says process 0 of 1
(``state.py``: "No backend == no distributed training"). DeepSpeed still joins every process into its own group, so
its engine averages gradients over all of them, while the Trainer, reading accelerate's state, gives every rank the
whole dataset, the main process's saves and logs, and a batch size for one process. Nothing trains what was asked,
and nothing fails. The same picture comes from any launch whose ranks end up with a one-process state.

Nothing can mend ``TrainingArguments`` once they exist (the state is made then), so the toolkit's pieces
(``attach_watchdog``, ``attach_preemption``, ``attach_telemetry``, ``enable_oom_recovery``) refuse to start with the fix.
Every rank is in the same group and has the same kind of state, so every rank refuses alike: no collective (the
group's size is read, not exchanged).
"""

from __future__ import annotations

import os

from ..errors import UsageError
from .cpu_votes import several_processes


class LoneRank(UsageError):
    """A process of several whose Trainer sees one process."""


def check_not_alone(trainer, environ=None) -> None:
    """Raise ``LoneRank`` when this process is in a process group of several (torch.distributed's default group: in
    the trap above DeepSpeed made it) but ``trainer``'s accelerator sees one process."""
    accelerator = getattr(trainer, "accelerator", None)
    seen = getattr(getattr(accelerator, "state", None), "num_processes", None)
    joined = _group_size()
    if seen != 1 or joined <= 1:
        return
    environ = os.environ if environ is None else environ
    deepspeed = str(environ.get("ACCELERATE_USE_DEEPSPEED", "false")).lower() == "true"
    args = getattr(trainer, "args", None)
    raise LoneRank(
        f"this process is one of {joined} in its process group but this Trainer's accelerator sees 1: every rank would "
        "train as process 0 of 1 (the whole dataset, a batch for one process, every rank saving as the main process)"
        + (": under DeepSpeed on a machine without CUDA accelerate gets no process-group backend by itself; pass "
           "TrainingArguments(use_cpu=True) or TrainingArguments(ddp_backend='gloo')"
           if deepspeed else
           f": accelerate's state was made without a backend (ddp_backend={getattr(args, 'ddp_backend', None)!r}); pass "
           "TrainingArguments(ddp_backend='gloo') on CPU processes or 'nccl' on GPUs"))


def _group_size() -> int:
    """The default process group's size; 1 without a group of several (the votes' own test of one)."""
    dist = several_processes()
    return dist.get_world_size() if dist is not None else 1
