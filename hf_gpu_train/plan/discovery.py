"""Where is this training process's plan? From HF_GPU_TRAIN_PLAN, or from the `accelerate launch` that started it.

``hf-gpu-train launch`` (and the printed torchrun and sbatch commands) set HF_GPU_TRAIN_PLAN. Plain
``accelerate launch --config_file box.yaml script.py`` exports nothing that names the config, but it is
always the parent of the training processes (accelerate 1.15, ``commands/launch.py``: ``simple_launcher``
Popens the one process; ``multi_gpu_launcher`` and ``deepspeed_launcher`` run torchrun in-process, whose
agent Popens the workers; checked with a probe of /proc/PPID/cmdline for both), so its command line and
working directory in /proc name the config, and its environment tells the user's variables from the
ones the launcher added. No torch, no accelerate import: this runs before anything initialises CUDA/NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .accelerate_argv import CONFIG_FILE_OPTIONS, accelerate_launch_args, split_launch_argv
from .run_plan_file import (
    PLAN_ENV,
    RunPlan,
    RunPlanError,
    env_path_for,
    generating_command,
    plan_from_env_file,
    plan_path_for,
    read_run_plan,
)

MAX_ANCESTORS = 3  # the worker's parent is the launcher; a wrapper (srun's bash -c, uv run) may add a level or two


@dataclass(frozen=True)
class Launcher:
    """An `accelerate launch` process found among this process's ancestors."""

    pid: int
    config_file: Path  # absolute
    environ: Mapping[str, str] | None = field(default=None, repr=False)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:  # gone, or hidden (hidepid, another user's process)
        return None


def _parent(proc: Path, pid: int) -> int | None:
    stat = _read(proc / str(pid) / "stat")
    if not stat:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
    fields = stat.rsplit(b")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _environ(proc: Path, pid: int) -> dict[str, str] | None:
    raw = _read(proc / str(pid) / "environ")
    if raw is None:
        return None
    pairs = (item.decode("utf-8", "replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, sep, v in pairs if sep}


def default_accelerate_config(environ: Mapping[str, str]) -> Path:
    """accelerate's default config path (``commands/config/config_args.py``) in the launcher's environment."""
    home = environ.get("HOME") or os.path.expanduser("~")
    cache = environ.get("XDG_CACHE_HOME", os.path.join(home, ".cache"))
    root = environ.get("HF_HOME", os.path.join(cache, "huggingface"))
    return Path(root.replace("~", home, 1) if root.startswith("~") else root) / "accelerate" / "default_config.yaml"


def find_launcher(proc: Path = Path("/proc"), pid: int | None = None) -> Launcher | None:
    """The nearest ancestor running `accelerate launch`, with its config file made absolute from its cwd."""
    current = os.getpid() if pid is None else pid
    for _ in range(MAX_ANCESTORS):
        parent = _parent(proc, current)
        if parent is None or parent < 1:  # pid 1 is examined: in a container the launcher often is pid 1
            return None
        raw = _read(proc / str(parent) / "cmdline")
        args = accelerate_launch_args([t.decode("utf-8", "replace") for t in raw.split(b"\0") if t]) if raw else None
        if args is not None:
            env = _environ(proc, parent)
            named = split_launch_argv(args).value(*CONFIG_FILE_OPTIONS)
            config = Path(named) if named else default_accelerate_config(env or os.environ)
            if not config.is_absolute():
                try:
                    config = Path(os.readlink(proc / str(parent) / "cwd")) / config
                except OSError:
                    config = Path.cwd() / config  # the workers start in the launcher's directory
            return Launcher(parent, config, env)
        current = parent
    return None


def load_run_plan(environ: Mapping[str, str] | None = None, proc: Path = Path("/proc"), pid: int | None = None) -> RunPlan | None:
    """The plan this process was launched with, or None when it was not launched from one of our configs.

    1. ``HF_GPU_TRAIN_PLAN`` names NAME.plan.json (relative paths from the working directory);
    2. else the `accelerate launch` among this process's ancestors names its ``--config_file`` (or accelerate's
       default config); when that YAML was written by `hf-gpu-train config`, NAME.plan.json beside it is the plan.
    Raises RunPlanError (a UsageError: exit 2, one line with the fix) when the plan file is unreadable, or when
    the YAML is ours but neither its .plan.json nor its .env is beside it, so its environment cannot reach the
    run. A YAML of ours with only its .env gives a plan with the environment and no values (the note says so).
    """
    environ = os.environ if environ is None else environ
    launcher = find_launcher(proc, pid)
    launcher_environ = launcher.environ if launcher else None
    named = environ.get(PLAN_ENV)
    if named:
        return read_run_plan(Path(named).absolute(), f"{PLAN_ENV}={named}", environ, launcher_environ)
    if launcher is None:
        return None
    config = launcher.config_file
    command = generating_command(config)
    if command is None:  # not ours (or not there): accelerate reads it, we have nothing to add
        return None
    source = f"accelerate launch --config_file {config} (process {launcher.pid})"
    if plan_path_for(config).is_file():
        return read_run_plan(plan_path_for(config), source, environ, launcher_environ)
    if env_path_for(config).is_file():
        return plan_from_env_file(config, command, source, environ, launcher_environ)
    raise RunPlanError(f"{config} was written by hf-gpu-train, but neither {plan_path_for(config).name} nor "
                       f"{env_path_for(config).name} is beside it, so its environment (NCCL settings, CUDA_DEVICE_ORDER) "
                       f"cannot reach this run: copy them next to {config.name}, or regenerate all three with `{command}`")
