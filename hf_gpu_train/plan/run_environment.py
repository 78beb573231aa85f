"""Put the plan's environment and CPU binding into this training process, early enough to matter.

Each variable is read once, at a moment: ``CUDA_DEVICE_ORDER`` / ``CUDA_VISIBLE_DEVICES`` when CUDA
initialises, ``NCCL_*`` when the process group is created, ``ACCELERATE_USE_CPU`` when accelerate's state is
made, ``OMP_NUM_THREADS`` when torch loads OpenMP. Setting one after its moment changes nothing and says
nothing, so a change that comes too late is an error naming the fix (call this first), never a silent no-op.

Who wins: a variable the user set (it is in the launcher's own environment with this value) is kept and
reported; one the launcher added itself (accelerate and torchrun set ``OMP_NUM_THREADS=1`` when it is unset)
gives way to the plan's value. Nothing here imports torch; it looks at modules already imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from ..hardware.profile import cpulist, parse_cpulist
from .cpu_binding import NONE, CpuBinding
from .run_plan_file import Override, RunPlan, RunPlanError

CALL_EARLY = ("call hf_gpu_train.plan.run_plan.apply_run_environment first thing in the training script, before torch.cuda, "
              "torch.distributed, Accelerator or TrainingArguments")


@dataclass(frozen=True)
class EnvironmentReport:
    """What ``apply_run_environment`` did. ``applied``: (variable, value) set from the plan; ``replaced``:
    (variable, launcher's value, plan value); ``kept``: the user's own values kept over the plan's."""

    applied: tuple[tuple[str, str], ...] = ()
    replaced: tuple[tuple[str, str, str], ...] = ()
    kept: tuple[Override, ...] = ()
    cpu_binding: str | None = None

    def lines(self) -> list[str]:
        """One line each, for the run's first output (rank 0)."""
        out = []
        if self.applied:
            out.append("environment from the plan (it did not reach this process): "
                       + ", ".join(f"{k}={v}" for k, v in self.applied))
        out += [f"{k}={plan} from the plan over {launched} set by the launcher" for k, launched, plan in self.replaced]
        out += [f"{o.key}={o.user_value} from your environment kept over the plan's {o.plan_value}" for o in self.kept]
        if self.cpu_binding:
            out.append(self.cpu_binding)
        return out


def _torch():
    return sys.modules.get("torch")


def _cuda_initialised() -> bool:
    torch = _torch()
    return bool(torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized())


def _process_group_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _accelerate_state_made() -> bool:
    state = sys.modules.get("accelerate.state")
    return bool(state is not None and getattr(state.PartialState, "_shared_state", None))


def read_too_late(name: str) -> str | None:
    """What already read ``name`` in this process, if anything did (None: setting it now still works)."""
    if name in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES") and _cuda_initialised():
        return "CUDA is already initialised"
    if name.startswith(("NCCL_", "TORCH_NCCL_")) and _process_group_initialised():
        return "the process group already exists"
    if name == "ACCELERATE_USE_CPU" and _accelerate_state_made():
        return "accelerate's state is already made"
    return None


def _set(name: str, value: str, environ: MutableMapping[str, str]) -> None:
    late = read_too_late(name) if environ is os.environ else None  # another process's environment: its own reads
    if late:
        raise RunPlanError(f"the plan sets {name}={value}, but {late}, so it would change nothing: {CALL_EARLY}")
    environ[name] = value
    torch = _torch()
    if name == "OMP_NUM_THREADS" and torch is not None and value.isdigit() and environ is os.environ:
        torch.set_num_threads(int(value))  # OpenMP read the variable when torch loaded; this reaches its pool


def apply_run_environment(plan: RunPlan, environ: MutableMapping[str, str] | None = None,
                          set_affinity: Callable[[set[int]], None] | None = None) -> EnvironmentReport:
    """Set the plan's environment (NAME.env) in ``environ`` (os.environ) and bind this process's CPUs.

    A variable already equal to the plan's is left alone; a missing one is set (``applied``); one the launcher
    added is replaced (``replaced``); one the user set is kept (``kept``, reported). Raises RunPlanError when a
    change comes after the moment its variable is read (see the module docstring)."""
    environ = os.environ if environ is None else environ
    launcher = plan.launcher_environ
    applied, replaced, kept = [], [], []
    for name, value, _reason in plan.environment:
        current = environ.get(name)
        if current == value:
            continue
        if current is None:
            _set(name, value, environ)
            applied.append((name, value))
        elif launcher is not None and launcher.get(name) != current:
            _set(name, value, environ)
            replaced.append((name, current, value))
        else:
            kept.append(Override(name, value, current, "environment"))
    # another process's environment (a dict) says nothing about binding this one's CPUs, unless a binder is given
    note = bind_process_cpus(plan, environ, set_affinity) if environ is os.environ or set_affinity else None
    return EnvironmentReport(tuple(applied), tuple(replaced), tuple(kept), note)


def binding_target(binding: CpuBinding | None, local_rank: int, available: set[int]) -> tuple[set[int] | None, str | None]:
    """(CPUs to bind to, note) for local process ``local_rank``; (None, None) when there is nothing to do
    (no binding, or already bound as planned, e.g. under the taskset prefix or accelerate's affinity)."""
    if binding is None or binding.method == NONE:
        return None, None
    if local_rank >= len(binding.cpus_by_process) or not binding.cpus_by_process[local_rank]:
        return None, None
    planned = set(parse_cpulist(binding.cpus_by_process[local_rank]))
    if available <= planned:
        return None, None
    target = planned & available
    if not target:
        return None, (f"CPU binding not applied: the plan's CPUs {binding.cpus_by_process[local_rank]} are not available to "
                      f"this process ({cpulist(sorted(available))}); was the plan made for another machine?")
    return target, f"bound local process {local_rank} to CPUs {cpulist(sorted(target))} (the plan's binding: {binding.method})"


def bind_process_cpus(plan: RunPlan, environ: Mapping[str, str] | None = None,
                      set_affinity: Callable[[set[int]], None] | None = None) -> str | None:
    """Bind this process (and the dataloader workers it will fork) to its planned CPUs when the launch did
    not (plain `accelerate launch` without the taskset prefix, torchrun). Returns a note, or None."""
    environ = os.environ if environ is None else environ
    if any(o.key == "gpu_ids" for o in plan.launch_overrides):
        return "CPU binding not applied: launched on other GPUs than the plan bound CPUs for"
    if not hasattr(os, "sched_getaffinity"):
        return None
    local = environ.get("LOCAL_RANK", "0")
    target, note = binding_target(plan.cpu_binding, int(local) if local.isdigit() else 0, set(os.sched_getaffinity(0)))
    if target:
        (set_affinity or (lambda cpus: os.sched_setaffinity(0, cpus)))(target)
    return note
