"""LaunchPlan -> files and commands: accelerate YAML, .env, launch command, torchrun (SLURM's sbatch: ``slurm.py``).

accelerate's YAML loader rejects unknown keys, so the environment (NCCL settings, ACCELERATE_USE_CPU)
lives in a ``.env`` beside the YAML, and ``hf-gpu-train launch`` applies it. The decided values the run
applies (batch, accumulation, checkpointing, workers) travel in NAME.plan.json (``plan_document``).
A CPU binding accelerate cannot apply (``taskset``) is a prefix of every command that starts the
processes: ``hf-gpu-train launch`` applies it itself.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from .. import __version__
from ..plan.deepspeed_config import DEEPSPEED_FILE_PLACEHOLDER, accelerate_keys, deepspeed_path_for
from ..plan.planner import LaunchPlan
from ..plan.run_plan_file import GENERATED_MARK, PLAN_ENV, env_path_for, parse_env, plan_path_for
from .accelerate_env import launch_environment

__all__ = ["FINETUNE_ENTRY", "accelerate_command", "binding_prefix", "deepspeed_precision_flag", "env_path_for", "launch_command",
           "parse_env", "render_env", "render_yaml", "run_args_text", "script_words", "shell_word", "torchrun_command"]

# The fine-tune as every printed command and manifest names it: the installed package's module, which a pip install
# and a clone (its package installed, `pip install -e .`) both have; scripts/finetune.py is in a clone only.
# `accelerate launch -m`, `hf-gpu-train launch -m` and `torchrun -m` all take it.
FINETUNE_ENTRY = "-m hf_gpu_train.finetune"


def render_yaml(plan: LaunchPlan, command: str, deepspeed_path: str | Path | None = None) -> str:
    """The accelerate YAML; ``deepspeed_path``: where NAME.deepspeed.json is written, for a plan that needs one."""

    header = [
        f"# accelerate config for {plan.machine}, {GENERATED_MARK} {__version__}",
        f"# by: {command}",
        f"# strategy: {plan.strategy}; environment for the training processes: the .env file beside this one; "
        "every decided value, machine-readable: the .plan.json file beside this one",
    ]
    for s in plan.settings:
        header.append(f"#   {s.key} = {s.value}: {s.reason}")
    body = yaml.safe_dump(accelerate_keys(plan.accelerate, deepspeed_path), sort_keys=True, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def render_env(plan: LaunchPlan) -> str:
    lines = [f"# environment for the training processes on {plan.machine} (hf-gpu-train {__version__})",
             "# applied by `hf-gpu-train launch`; by hand: set -a; . THIS_FILE; set +a"]
    for key, value, reason in plan.env:
        lines.append(f"# {reason}")
        lines.append(f"{key}={shlex.quote(str(value))}")
    return "\n".join(lines) + "\n"


def script_words(script: str) -> list[str]:
    """``script`` (the training script or ``-m MODULE``, perhaps with arguments of its own) as the words a shell makes of
    it in a printed command: ``-m hf_gpu_train.finetune`` is two words, ``'train it.py'`` one."""
    return shlex.split(script)


def run_args_text(run_args: tuple[str, ...] | list[str] = ()) -> str:
    """The run's own arguments (``--config NAME key=value``) as they end a printed command: '' or ' WORD...'."""
    return "".join(f" {shlex.quote(a)}" for a in run_args)


def launch_command(config_path: str | Path, script: str = FINETUNE_ENTRY, run_args: tuple[str, ...] | list[str] = ()) -> str:
    return f"hf-gpu-train launch --config-file {shell_word(config_path)} {script}{run_args_text(run_args)}"


def shell_word(path: str | Path) -> str:
    """A path as one shell word (a folder may hold spaces, quotes or parentheses). ``script`` stays as given: it may
    carry the script's own arguments."""
    return shlex.quote(str(path))


def binding_prefix(plan: LaunchPlan) -> str:
    """``taskset -c CPUS `` when the plan binds the processes that way, else ''."""
    binding = plan.cpu_binding
    return f"{binding.command_prefix} " if binding is not None and binding.command_prefix else ""


def deepspeed_precision_flag(plan: LaunchPlan | None) -> str:
    """`` --mixed_precision X`` beside a DeepSpeed config file: accelerate takes the precision from the command line
    only there (a YAML's, "no" included, is refused: deepspeed_config.py); else ''."""
    return f" --mixed_precision {plan.accelerate['mixed_precision']}" if plan is not None and plan.deepspeed_file else ""


def accelerate_command(config_path: str | Path, script: str = FINETUNE_ENTRY, plan: LaunchPlan | None = None,
                       run_args: tuple[str, ...] | list[str] = ()) -> str:
    env = env_path_for(config_path)
    prefix = binding_prefix(plan) if plan is not None else ""
    return (f"(set -a; . {shell_word(env)}; set +a; {prefix}accelerate launch --config_file {shell_word(config_path)}"
            f"{deepspeed_precision_flag(plan)} {script}{run_args_text(run_args)})")


def torchrun_command(plan: LaunchPlan, script: str = FINETUNE_ENTRY, config_path: str | Path | None = None,
                     run_args: tuple[str, ...] | list[str] = ()) -> str:
    """torchrun reads no accelerate config: the environment, where the plan is (HF_GPU_TRAIN_PLAN, given
    ``config_path``), and the variables `accelerate launch` would export for the YAML (its strategy: FSDP or DeepSpeed
    and their settings, then the precision; accelerate_env.py) go on the command line."""

    acc = plan.accelerate
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env_dict.items())
    if config_path is not None:
        env += f" {PLAN_ENV}={shlex.quote(str(plan_path_for(config_path)))}"
    if "gpu_ids" in acc:
        env = f"CUDA_VISIBLE_DEVICES={acc['gpu_ids']} " + env
    deepspeed_path = None if plan.deepspeed_file is None else (
        deepspeed_path_for(config_path) if config_path is not None else DEEPSPEED_FILE_PLACEHOLDER)
    launched = launch_environment(accelerate_keys(acc, deepspeed_path), precision_on_command_line=plan.deepspeed_file is not None)
    env += "".join(f" {k}={shlex.quote(v)}" for k, v in launched.items() if k not in plan.env_dict)
    parts = [f"torchrun --nnodes={acc['num_machines']} --nproc-per-node={plan.processes_per_machine}"]
    if acc["num_machines"] > 1:
        if acc.get("rdzv_backend") == "c10d":
            parts.append(f"--rdzv-backend=c10d --rdzv-endpoint={acc['main_process_ip']}:{acc['main_process_port']}")
        else:
            parts.append(f"--node-rank={acc['machine_rank']} --master-addr={acc['main_process_ip']} --master-port={acc['main_process_port']}")
    elif "main_process_port" in acc:  # the port the plan chose (torchrun's own default is 29500)
        parts.append(f"--master-port={acc['main_process_port']}")
    return f"{env} {binding_prefix(plan)}" + " ".join(parts) + f" {script}{run_args_text(run_args)}"
