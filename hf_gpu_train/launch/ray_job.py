"""LaunchPlan -> a Ray job: the job's ``runtime_env`` (NAME.ray.yaml: the plan's environment for the job's driver and
every Ray Train worker) and the ``ray job submit`` line whose entrypoint runs the fine-tune on Ray Train
(``python -m hf_gpu_train.finetune.ray_train``) with the plan's ScalingConfig: a worker per planned process, a GPU each
where the plan has GPUs, the plan's threads per process as each worker's CPUs.

Ray hands each worker its GPU and makes the process group, so what accelerate launch or torchrun take from the plan for
that (``CUDA_VISIBLE_DEVICES``, the rendezvous, a ``taskset`` binding) is not in the environment: a plan of a GPU subset
or a MIG instance is for a machine, not for a cluster that assigns GPUs (``targets._check_scheduled_gpus``). No torch and
no ray here: the renderer runs where ``hf-gpu-train config`` runs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..plan.deepspeed_config import accelerate_keys, deepspeed_path_for
from ..plan.planner import LaunchPlan
from ..plan.run_plan_file import GENERATED_MARK, PLAN_ENV, plan_path_for
from ..plan.strategies import strategy
from .accelerate_env import launch_environment

RAY_ENTRY = "hf_gpu_train.finetune.ray_train"  # named, not imported: launch/ sits below finetune/
# Ray Train 2.60 sends every print of a worker to its logger and, since a worker's sys.stdout is Ray's log file and not
# sys.__stdout__, to the original print as well: each line of the run twice, and what a library prints into a captured
# stdout (datasets hashing a function through dill disassembles it) leaks into the log
# (ray/train/v2/_internal/logging/patch_print.py). Ray still collects what the run prints.
QUIET_PRINT = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
QUIET_PRINT_REASON = "Ray Train 2.60 would print each line of a worker twice (its print patch); Ray still collects the output"
RAY_SUFFIX = ".ray.yaml"


@dataclass(frozen=True)
class RayScaling:
    """``ray.train.ScalingConfig`` from the plan, with why."""

    num_workers: int
    use_gpu: bool
    cpus_per_worker: int
    machines: int

    def resources_per_worker(self) -> dict:
        return {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}

    def describe(self) -> str:
        per_machine = self.num_workers // self.machines
        return (f"num_workers={self.num_workers} (the plan's processes: {self.machines} machine(s) x {per_machine}), "
                f"use_gpu={self.use_gpu}, resources_per_worker={json.dumps(self.resources_per_worker())} "
                "(CPU: the plan's threads per process)")


def ray_scaling(plan: LaunchPlan) -> RayScaling:
    threads = str(plan.env_dict.get("OMP_NUM_THREADS", "1"))
    return RayScaling(num_workers=plan.accelerate["num_processes"], use_gpu=bool(plan.gpus),
                      cpus_per_worker=max(1, int(threads)) if threads.isdigit() else 1, machines=plan.accelerate["num_machines"])


def ray_environment(plan: LaunchPlan, config_path: str | Path) -> list[tuple[str, str, str]]:
    """(name, value, reason) of every variable the job's processes get: the plan's, what ``accelerate launch`` would
    export for its strategy and precision (as the torchrun line carries them), where the plan is, and Ray's print.
    ``config_path``: NAME.yaml as the job sees it (relative to its working directory); the plan is beside it."""
    env = [(key, str(value), reason) for key, value, reason in plan.env if key != "CUDA_VISIBLE_DEVICES"]
    names = {key for key, _, _ in env}
    deepspeed_path = deepspeed_path_for(config_path) if plan.deepspeed_file is not None else None
    launched = launch_environment(accelerate_keys(plan.accelerate, deepspeed_path),
                                  precision_on_command_line=plan.deepspeed_file is not None)
    env += [(key, value, f"what accelerate launch exports for the plan's {plan.strategy} and precision")
            for key, value in launched.items() if key not in names]
    env.append((PLAN_ENV, plan_path_for(config_path).as_posix(), "the plan the training processes apply (relative to the job's working directory)"))
    env += [(key, value, QUIET_PRINT_REASON) for key, value in QUIET_PRINT.items()]
    return env


def ray_entrypoint(plan: LaunchPlan) -> str:
    """What ``ray job submit -- ...`` runs (the fine-tune's ``--config NAME key=value...`` go after it)."""
    scaling = ray_scaling(plan)
    return (f"python -m {RAY_ENTRY} --num-workers {scaling.num_workers} --cpus-per-worker {scaling.cpus_per_worker}"
            + (" --use-gpu" if scaling.use_gpu else ""))


def _run_under_ray(name: str) -> bool:
    """Whether this project has run the strategy under Ray Train: replicated processes (DDP on GPUs, gloo DDP on CPU
    processes) and one GPU; the others, one CPU process included, go through accelerate's variables untried."""
    row = strategy(name)
    return row.replicated and (row.several_processes or not row.on_cpu)


def ray_submit_command(plan: LaunchPlan, runtime_env_path: str | Path) -> str:
    return (f"ray job submit --working-dir . --runtime-env {shlex.quote(Path(runtime_env_path).as_posix())} -- "
            f"{ray_entrypoint(plan)}")


def render_ray_runtime_env(plan: LaunchPlan, config_path: str | Path, runtime_env_path: str | Path) -> str:
    """NAME.ray.yaml, for ``ray job submit --runtime-env``: ``env_vars`` (each with its reason), and in its header the
    submit line and the ScalingConfig. ``config_path``: NAME.yaml as the job sees it (relative to its working
    directory); ``runtime_env_path``: this file, as the submit line names it."""
    scaling = ray_scaling(plan)
    header = [
        f"# Ray job runtime_env for {plan.machine} ({plan.strategy}), {GENERATED_MARK} {__version__}",
        "# Submit from the project directory (ray job submit uploads it as the job's working directory, leaving out what",
        "# its .gitignore names: the plan below must be uploaded); add the fine-tune's --config NAME key=value... at the end:",
        f"#   {ray_submit_command(plan, runtime_env_path)}",
        f"# ScalingConfig: {scaling.describe()}",
        f"# The cluster: {scaling.machines} node(s)" + (f" of {scaling.num_workers // scaling.machines} GPU(s)" if scaling.use_gpu
                                                      else "") + "; Ray places the workers and makes the process group "
        + ("(NCCL)" if scaling.use_gpu else "(gloo)"),
    ]
    if plan.cpu_binding is not None:
        header.append(f"# Not applied under Ray: the plan's CPU binding ({plan.cpu_binding.method}); Ray places the workers")
    if not _run_under_ray(plan.strategy):
        header.append(f"# {plan.strategy}: through accelerate's variables below, as under torchrun; this project has run DDP "
                      "under Ray Train, not yet this strategy")
    lines = [*header, "env_vars:"]
    for key, value, reason in ray_environment(plan, config_path):
        lines += [f"  # {reason}", f"  {key}: {json.dumps(value)}"]
    return "\n".join(lines) + "\n"


def runtime_env_path_for(config_path: str | Path) -> Path:
    """NAME.ray.yaml beside NAME.yaml."""
    path = Path(config_path)
    return path.with_name(path.stem + RAY_SUFFIX)
