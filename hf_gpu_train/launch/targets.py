"""Where a plan runs: the launch targets of ``hf-gpu-train config --target NAME``, a registry.

Every target gets the accelerate YAML, NAME.env and NAME.plan.json ``config`` writes; a target adds its own files
(an sbatch, a Kubernetes manifest, a SkyPilot task) and the lines that say how to submit them. A target is a function
``(plan, yaml_path, script, settings) -> Rendered`` registered under its name with ``register_target``; the CLI's
``--target`` choices are the registered names, so a new scheduler is one module with its renderer and one
``register_target`` call at the end of this file. No torch here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..plan.planner import LaunchPlan
from .grace import Grace
from .kubeflow import DEFAULT_WORKDIR, checkpoint_mount_path, no_volume_warning, render_pytorchjob, render_trainjob
from .ray_job import RAY_ENTRY, RAY_SUFFIX, ray_submit_command, render_ray_runtime_env
from .render import run_args_text
from .skypilot import render_skypilot, setup_for
from .slurm import sbatch_file

__all__ = ["OPTIONS", "Rendered", "Target", "TargetSettings", "get_target", "job_name_for", "register_target", "target_names"]

# The options of `config` a target may read, by their flag; a target that reads none of one makes the flag an error.
OPTIONS = {"image": "--image", "workdir": "--workdir", "save_time_from": "--save-time-from", "time_limit": "--time-limit",
           "partition": "--partition", "checkpoint_volume": "--checkpoint-volume"}


@dataclass(frozen=True)
class TargetSettings:
    """What a target may need beyond the plan. ``output``: DIR/NAME, the prefix of every file written; ``project``:
    the directory the job runs in (where ``config`` ran), which the generated files' paths are relative to;
    ``run_args``: the run's own arguments (``--config NAME key=value``), the last words of every command;
    ``checkpoint_volume``: a PersistentVolumeClaim the checkpoints of a Kubernetes job go to."""

    output: Path
    job_name: str
    grace: Grace
    project: Path = field(default_factory=Path.cwd)
    image: str | None = None
    workdir: str | None = None
    time_limit: str | None = None
    partition: str | None = None
    save_time_from: str | None = None  # what the grace was measured from (grace_for), for a target to say
    checkpoint_volume: str | None = None
    min_machines: int | None = None  # the fewest nodes a SLURM job goes on with after a failure (None: all of them)
    run_args: tuple[str, ...] = ()

    def path(self, suffix: str) -> Path:
        return self.output.with_name(self.output.name + suffix)


@dataclass(frozen=True)
class Rendered:
    """The files a target writes, (path, text) each, and the lines ``config`` prints about them."""

    files: tuple[tuple[Path, str], ...] = ()
    lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """``render``: the target; ``reads``: the keys of OPTIONS it uses; ``needs_image``: a container target;
    ``main_node``: for a plan of several machines without ``--main-process-ip``, the address the scheduler gives
    machine rank 0, from the job's name (None: the user must give it)."""

    name: str
    render: Callable[[LaunchPlan, Path, str, TargetSettings], Rendered]
    help: str
    reads: frozenset[str] = frozenset()
    needs_image: bool = False
    main_node: Callable[[str], str] | None = None


_TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    if target.name in _TARGETS:
        raise ValueError(f"launch target {target.name!r} is registered already")
    unknown = set(target.reads) - set(OPTIONS)
    if unknown:
        raise ValueError(f"launch target {target.name!r} reads unknown options {sorted(unknown)}: known are {sorted(OPTIONS)}")
    _TARGETS[target.name] = target
    return target


def target_names() -> tuple[str, ...]:
    return tuple(_TARGETS)


def get_target(name: str) -> Target:
    if name not in _TARGETS:
        raise UsageError(f"--target {name}: not one of {', '.join(_TARGETS)}")
    return _TARGETS[name]


def job_name_for(name: str) -> str:
    """A Kubernetes object name (lower-case letters, digits and '-', from a letter; 40 characters at most, so that
    the pods' host names the operators derive from it stay under 63) from DIR/NAME's NAME."""
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    slug = re.sub(r"-{2,}", "-", slug)
    if not slug or not slug[0].isalpha():
        slug = f"hf-{slug}".rstrip("-")
    return slug[:40].rstrip("-")


def _in_project(path: Path, settings: TargetSettings) -> str:
    """``path`` (one of the files of ``--output``) relative to the project directory, as the job sees it (a
    container's workdir, SkyPilot's synced one)."""
    full = path if path.is_absolute() else settings.project / path
    try:
        return full.resolve().relative_to(settings.project.resolve()).as_posix()
    except ValueError:
        raise UsageError(f"--output {settings.output}: outside {settings.project}, the project directory the job gets (the "
                         "image's workdir, SkyPilot's synced workdir): run `hf-gpu-train config` in the project and give "
                         "--output a path inside it, e.g. launch_configs/NAME") from None


def _script_in_project(script: str, settings: TargetSettings) -> str:
    path = Path(script)
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.resolve().relative_to(settings.project.resolve()).as_posix()
    except ValueError:
        return script  # a path the job's machine has (in the image, say): as given


def _check_scheduled_gpus(plan: LaunchPlan, target: str) -> None:
    """A scheduler hands a pod (a cloud node) its GPUs and the processes see them as 0..N-1: a plan of other GPU
    numbers, or of a MIG instance by its UUID, would name devices the job does not have."""
    gpu_ids = str(plan.accelerate.get("gpu_ids", ""))
    if plan.mig_instance is not None or gpu_ids.startswith("MIG-"):
        raise UsageError(f"--target {target} with a MIG instance ({gpu_ids}): the scheduler hands a job its devices and "
                         "this plan names one of another machine: plan whole GPUs (--gpus N) for this target")
    expected = ",".join(str(i) for i in range(plan.processes_per_machine))
    if plan.gpus and gpu_ids and gpu_ids != expected:
        raise UsageError(f"--target {target}: the plan uses GPUs {gpu_ids} of {plan.machine}, and a job's processes see "
                         f"the {plan.processes_per_machine} GPU(s) the scheduler gives them as {expected}: "
                         f"plan with --gpu-ids {expected}")


def _sbatch(plan: LaunchPlan, yaml_path: Path, script: str, settings: TargetSettings) -> Rendered:
    path = settings.path(".sbatch")
    text, line = sbatch_file(plan, yaml_path, script, path, time_limit=settings.time_limit, partition=settings.partition,
                             grace=settings.grace, run_args=settings.run_args, min_nodes=settings.min_machines)
    return Rendered(((path, text),), (line,))


def _accelerate(plan: LaunchPlan, yaml_path: Path, script: str, settings: TargetSettings) -> Rendered:
    if plan.accelerate["num_machines"] > 1:
        return _sbatch(plan, yaml_path, script, settings)
    given = [OPTIONS[key] for key in ("time_limit", "partition", "save_time_from") if getattr(settings, key) is not None]
    if given:
        raise UsageError(f"{' and '.join(given)}: for the SLURM sbatch, which --target accelerate writes for several "
                         "machines only: add --target slurm for one machine")
    return Rendered()


def _container_paths(plan: LaunchPlan, yaml_path: Path, script: str, settings: TargetSettings, target: str):
    _check_scheduled_gpus(plan, target)
    return _in_project(yaml_path, settings), _script_in_project(script, settings), settings.workdir or DEFAULT_WORKDIR


def _kubernetes(render, suffix: str, what: str, target: str):
    """A Kubernetes target: ``render`` (render_trainjob or render_pytorchjob) into NAME``suffix``."""

    def rendered(plan: LaunchPlan, yaml_path: Path, script: str, settings: TargetSettings) -> Rendered:
        config, script_in, workdir = _container_paths(plan, yaml_path, script, settings, target)
        path = settings.path(suffix)
        claim = settings.checkpoint_volume
        text = render(plan, config, script_in, image=settings.image, job_name=settings.job_name, grace=settings.grace,
                      workdir=workdir, path_hint=str(path), run_args=settings.run_args, checkpoint_claim=claim)
        storage = (f"  checkpoints: the PersistentVolumeClaim {claim} at {checkpoint_mount_path(workdir)} (every shipped "
                   "recipe's output_dir is under outputs/), which outlives the pod" if claim else
                   f"warning: {no_volume_warning(workdir)}")
        return Rendered(((path, text),), (
            f"On Kubernetes ({what}): kubectl apply -f {path}",
            f"  the image {settings.image} holds hf-gpu-train and this directory at {workdir}; grace {settings.grace.describe()}",
            storage,
        ))

    return rendered


_trainjob = _kubernetes(render_trainjob, ".trainjob.yaml", "Kubeflow Trainer v2, runtime torch-distributed", "kubeflow")
_pytorchjob = _kubernetes(render_pytorchjob, ".pytorchjob.yaml", "Kubeflow training-operator v1", "pytorchjob")


def _skypilot(plan: LaunchPlan, yaml_path: Path, script: str, settings: TargetSettings) -> Rendered:
    _check_scheduled_gpus(plan, "skypilot")
    config, script = _in_project(yaml_path, settings), _script_in_project(script, settings)
    path = settings.path(".sky.yaml")
    workdir = settings.workdir or "."
    text = render_skypilot(plan, config, script, job_name=settings.job_name, workdir=workdir, image=settings.image,
                           path_hint=str(path), run_args=settings.run_args, setup=setup_for(settings.project))
    return Rendered(((path, text),), (f"On SkyPilot (from {workdir}, synced to every node): sky launch -c {settings.job_name} {path}",))


def _ray(plan: LaunchPlan, yaml_path: Path, script: str, settings: TargetSettings) -> Rendered:
    """NAME.ray.yaml and the ``ray job submit`` line (launch/ray_job.py): Ray hands each worker its GPU, as a scheduler
    does, and its entrypoint is the fine-tune as Ray Train workers, not ``--script``."""
    _check_scheduled_gpus(plan, "ray")
    if script != "scripts/finetune.py" and script.split() != ["-m", "hf_gpu_train.finetune"]:
        raise UsageError(f"--script {script}: --target ray runs the fine-tune as Ray Train workers (python -m {RAY_ENTRY}), "
                         "not a script of its own: leave --script out")
    path = settings.path(RAY_SUFFIX)
    runtime_env = _in_project(path, settings)  # as `ray job submit` is run: from the project, which it uploads
    text = render_ray_runtime_env(plan, _in_project(yaml_path, settings), runtime_env)
    return Rendered(((path, text),), (
        f"On Ray (from {settings.project}, uploaded as the job's working directory): {ray_submit_command(plan, runtime_env)}"
        f"{run_args_text(settings.run_args)}",
        ("  " if settings.run_args else "  then the fine-tune's --config NAME key=value...; ")
        + "Ray places the workers and makes the process group (ray job submit needs ray[default])",
    ))


SKYPILOT_MAIN_NODE = "set-at-run-from-SKYPILOT_NODE_IPS"  # the YAML's main_process_ip; the run passes the real one
RAY_MAIN_NODE = "made-by-ray"  # Ray Train makes the process group: the YAML's main_process_ip is not read

register_target(Target("accelerate", _accelerate, "the accelerate YAML, .env and plan (and a SLURM sbatch for several machines)",
                       reads=frozenset({"time_limit", "partition", "save_time_from"})))
register_target(Target("slurm", _sbatch, "a SLURM sbatch, also for one machine",
                       reads=frozenset({"time_limit", "partition", "save_time_from"})))
register_target(Target("kubeflow", _trainjob, "a Kubeflow Trainer v2 TrainJob (runtime torch-distributed)",
                       reads=frozenset({"image", "workdir", "save_time_from", "checkpoint_volume"}), needs_image=True,
                       main_node=lambda job: f"{job}-node-0-0.{job}"))  # torch.go: PET_MASTER_ADDR
register_target(Target("pytorchjob", _pytorchjob, "a Kubeflow training-operator PyTorchJob (kubeflow.org/v1)",
                       reads=frozenset({"image", "workdir", "save_time_from", "checkpoint_volume"}), needs_image=True,
                       main_node=lambda job: f"{job}-master-0"))  # envvar.go: MASTER_ADDR, the Master's service
register_target(Target("skypilot", _skypilot, "a SkyPilot task YAML (sky launch)", reads=frozenset({"image", "workdir"}),
                       main_node=lambda job: SKYPILOT_MAIN_NODE))
register_target(Target("ray", _ray, "a Ray job: NAME.ray.yaml (runtime_env) and the ray job submit line (Ray Train)",
                       main_node=lambda job: RAY_MAIN_NODE))
