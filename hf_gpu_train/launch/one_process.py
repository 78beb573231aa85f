"""``accelerate launch`` that runs the fine-tune as one process, said by the fine-tune's entry point in one line.

accelerate starts several processes through torchrun (``multi_gpu_launcher``) only for a multi-GPU, FSDP, DeepSpeed or
Megatron launch on a device; everything else goes to its ``simple_launcher``, which starts exactly one process whatever
``--num_processes`` says (accelerate 1.15, ``commands/launch.py``). On a machine without GPUs that is every launch
without ``--multi_gpu``: ``accelerate launch --num_processes 2 -m hf_gpu_train.finetune`` trains one process and says
nothing about the second (its defaults warning names only the values it filled in), and ``accelerate launch -m
hf_gpu_train.finetune`` trains one process by its default. The one process cannot be told from one asked for by what
accelerate gives it (``simple_launcher`` sets no ``WORLD_SIZE``), so the launcher's own command line and config (read in
/proc, as ``plan/discovery.py`` finds the plan) say what was asked. No torch here: this runs before the run starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from ..plan.accelerate_argv import accelerate_launch_args, split_launch_argv
from ..plan.discovery import find_launcher

__all__ = ["one_process_line"]

NUM_PROCESSES_OPTIONS = ("--num_processes", "--num-processes")
# a group of several started by torchrun (WORLD_SIZE) or by mpirun (accelerate's MULTI_CPU with a hostfile)
GROUP_SIZE_ENV = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
SEVERAL = ("for N processes on a machine without GPUs: hf-gpu-train config --num-processes N --output cpu, then "
           "hf-gpu-train launch --config-file cpu.yaml -m hf_gpu_train.finetune ... (gloo DDP)")


def _asked(proc: Path, launcher) -> tuple[int | None, str]:
    """(the processes the launcher was asked for, where that was said); (None, '') when nothing asked for a number."""
    try:
        raw = (proc / str(launcher.pid) / "cmdline").read_bytes()
    except OSError:
        raw = b""
    args = accelerate_launch_args([t.decode("utf-8", "replace") for t in raw.split(b"\0") if t]) or []
    given = split_launch_argv(args).value(*NUM_PROCESSES_OPTIONS)
    if given is not None:
        return (int(given), f"--num_processes {given}") if given.strip().isdigit() else (None, "")
    try:
        config = yaml.safe_load(launcher.config_file.read_text())
    except (OSError, yaml.YAMLError):
        return None, ""
    value = config.get("num_processes") if isinstance(config, dict) else None
    return (value, f"num_processes: {value} in {launcher.config_file}") if isinstance(value, int) else (None, "")


def one_process_line(environ: Mapping[str, str] | None = None, proc: Path = Path("/proc"), pid: int | None = None) -> str | None:
    """The line to print when this process was started alone by ``accelerate launch`` (its simple launcher) while more
    were asked for, or while nothing asked for a number (accelerate's default); None otherwise: not under accelerate
    launch, one of a group, or one process asked for."""
    environ = os.environ if environ is None else environ
    if any(str(environ.get(name, "")).strip() not in ("", "1") for name in GROUP_SIZE_ENV):
        return None
    launcher = find_launcher(proc, pid)
    if launcher is None:
        return None
    asked, where = _asked(proc, launcher)
    if asked == 1 or (asked is not None and asked < 1):
        return None
    if asked is None:
        return ("hf_gpu_train: one process: accelerate launch was given no --num_processes and started one, its default "
                f"without several GPUs; {SEVERAL}")
    return (f"hf_gpu_train: one process, not the {asked} asked for ({where}): without several GPUs accelerate launch runs its "
            f"simple launcher, which starts one process whatever --num_processes says; {SEVERAL}")
