"""LaunchPlan -> files and commands: accelerate YAML, .env, launch command, torchrun, SLURM sbatch.

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
from .grace import GRACE_ENV, Grace, grace_for
from .rank_report import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER_ENV

__all__ = ["accelerate_command", "env_path_for", "launch_command", "parse_env", "render_env", "render_sbatch", "render_yaml",
           "torchrun_command"]


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


def launch_command(config_path: str | Path, script: str = "scripts/finetune.py") -> str:
    return f"hf-gpu-train launch --config-file {_q(config_path)} {script}"


def _q(path: str | Path) -> str:
    """A path as one shell word (a folder may hold spaces, quotes or parentheses). ``script`` stays as given: it may
    carry the script's own arguments."""
    return shlex.quote(str(path))


def _prefix(plan: LaunchPlan) -> str:
    """``taskset -c CPUS `` when the plan binds the processes that way, else ''."""
    binding = plan.cpu_binding
    return f"{binding.command_prefix} " if binding is not None and binding.command_prefix else ""


def _deepspeed_precision(plan: LaunchPlan | None) -> str:
    """`` --mixed_precision X`` beside a DeepSpeed config file: accelerate takes the precision from the command line
    only there (a YAML's, "no" included, is refused: deepspeed_config.py); else ''."""
    return f" --mixed_precision {plan.accelerate['mixed_precision']}" if plan is not None and plan.deepspeed_file else ""


def accelerate_command(config_path: str | Path, script: str = "scripts/finetune.py", plan: LaunchPlan | None = None) -> str:
    env = env_path_for(config_path)
    prefix = _prefix(plan) if plan is not None else ""
    return f"(set -a; . {_q(env)}; set +a; {prefix}accelerate launch --config_file {_q(config_path)}{_deepspeed_precision(plan)} {script})"


def torchrun_command(plan: LaunchPlan, script: str = "scripts/finetune.py", config_path: str | Path | None = None) -> str:
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
    return f"{env} {_prefix(plan)}" + " ".join(parts) + f" {script}"


def render_sbatch(plan: LaunchPlan, config_path: str | Path, script: str = "scripts/finetune.py", job_name: str = "hf-gpu-train",
                  *, time_limit: str | None = None, partition: str | None = None, grace: Grace | None = None) -> str:
    """One task per node; each runs ``hf-gpu-train launch`` (the plan's environment, stop signals forwarded to the
    training processes, exit 75 when they stopped for one) with c10d rendezvous from SLURM's variables.

    Preemption: SLURM sends USR1 to the batch shell ``grace.seconds`` before the time limit (``--signal=B:USR1@N``);
    the script passes it (and a TERM or USR2 it receives) to the job step, every rank saves a complete checkpoint
    and exits 75, and the script requeues the job (``--requeue``; ``--open-mode=append`` keeps one log), which
    resumes from that checkpoint. ``grace``: ``launch.grace.grace_for(plan)`` when not given."""
    acc = plan.accelerate
    nodes = acc["num_machines"]
    per_node = plan.processes_per_machine
    grace = grace or grace_for(plan)
    gres = f"#SBATCH --gpus-per-node={per_node}\n" if "gpu_ids" in acc else ""
    limits = (f"#SBATCH --time={time_limit}\n" if time_limit else "") + (f"#SBATCH --partition={partition}\n" if partition else "")
    env_file = env_path_for(config_path)
    return f"""#!/bin/bash
# SLURM job for {plan.machine} x{nodes} nodes, generated by hf-gpu-train {__version__}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gres}#SBATCH --cpus-per-task={max(1, int(plan.env_dict.get('OMP_NUM_THREADS', '1')) * per_node)}
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@{grace.seconds}
{limits}# Preemption: USR1 reaches this script {grace.seconds} s before the time limit; it passes it (and a TERM or USR2) to
# every task; each rank finishes its step, saves a complete checkpoint and exits {PREEMPTED_EXIT_CODE}; this script then requeues
# the job, which resumes from that checkpoint. The warning comes {grace.describe()}
set -uo pipefail
# srun forwards USR1 to every task, but turns a TERM it receives into SIGKILL of every task (srun(1)): a stop signal to
# this shell goes on as USR1 (and one before srun starts, once it has). A TERM to every process of the job (a time limit,
# `scancel --full`) reaches srun too: then the tasks are killed at once and the next run resumes from the newest
# complete checkpoint.
STEP=""; ASKED=""; TERMED=""
forward() {{ ASKED=$1; echo "hf-gpu-train: SIG$1 at $(date +%T): every rank finishes its step, saves a checkpoint and stops"; [ -n "$STEP" ] && kill -s USR1 "$STEP" 2>/dev/null; }}
trap 'forward USR1' USR1
trap 'forward USR2' USR2
trap 'TERMED=1; forward TERM' TERM
HERE=${{HF_GPU_TRAIN_DIR:-$SLURM_SUBMIT_DIR}}
cd "$HERE" || exit 1
set -a; . {_q(env_file)}; set +a
export {PLAN_ENV}={_q(plan_path_for(config_path))}
export {GRACE_ENV}=${{{GRACE_ENV}:-{grace.seconds}}}
# torchrun SIGKILLs its workers this long after a SIGTERM reaches it (30 s by default): the grace, not less
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{grace.seconds}}}
# each node's hf-gpu-train launch leaves this file when its processes stopped for a stop signal with a complete
# checkpoint: srun --kill-on-bad-exit may kill a node still exiting after another's 75, and srun's own code then says 137
export {PREEMPTED_MARKER_ENV}="$HERE/.hf-gpu-train-preempted-${{SLURM_JOB_ID:-0}}"
rm -f "${{{PREEMPTED_MARKER_ENV}}}"
MAIN_NODE=${{HF_GPU_TRAIN_MAIN_NODE:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}
MAIN_PORT=${{HF_GPU_TRAIN_MAIN_PORT:-{acc.get('main_process_port', 29500)}}}
HF_GPU_TRAIN=${{HF_GPU_TRAIN:-hf-gpu-train}}
echo "hf-gpu-train: job ${{SLURM_JOB_ID:-}} on ${{SLURM_JOB_NODELIST:-}}, requeued ${{SLURM_RESTART_COUNT:-0}} time(s); the run resumes from its newest complete checkpoint"
# One task per node; each starts {per_node} process(es). SLURM_NODEID is the machine rank given to accelerate (with the c10d
# rendezvous torchelastic numbers the nodes in the order they join: global ranks need not follow node order).
# The arguments after this script's name go to the training script one by one (a value may hold spaces).
# At the very end torchelastic may report "Error waiting on exit barrier" when the agent hosting the
# rendezvous store leaves first (pytorch #69520): the workers have finished by then; check the metrics.
export HF_GPU_TRAIN_CONFIG_FILE={_q(config_path)} HF_GPU_TRAIN_SCRIPT={shlex.quote(script)} MAIN_NODE MAIN_PORT HF_GPU_TRAIN
srun --kill-on-bad-exit=1 bash -c 'exec {_prefix(plan)}$HF_GPU_TRAIN launch --config-file "$HF_GPU_TRAIN_CONFIG_FILE" \\
    --num_machines {nodes} --num_processes {acc['num_processes']} \\
    --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_NODE" --main_process_port "$MAIN_PORT" \\
    --rdzv_backend c10d --same_network{_deepspeed_precision(plan)} \\
    $HF_GPU_TRAIN_SCRIPT "$@"' hf-gpu-train "$@" &
STEP=$!
[ -n "$ASKED" ] && kill -s USR1 "$STEP" 2>/dev/null
code=""
while [ -z "$code" ]; do
    wait "$STEP"; status=$?
    if [ "$status" -gt 128 ] && kill -0 "$STEP" 2>/dev/null; then continue; fi  # a trapped signal interrupted the wait
    if [ "$status" -gt 128 ]; then  # srun ended as the signal came: its own status, where bash still has it
        wait "$STEP" 2>/dev/null; again=$?
        if [ "$again" -ge 0 ] && [ "$again" -le 255 ] && [ "$again" -ne 127 ]; then status=$again; fi
    fi
    code=$status
done
if [ "$code" -eq {PREEMPTED_EXIT_CODE} ] || [ -e "${{{PREEMPTED_MARKER_ENV}}}" ]; then
    rm -f "${{{PREEMPTED_MARKER_ENV}}}"
    code={PREEMPTED_EXIT_CODE}
    echo "hf-gpu-train: stopped with a complete checkpoint: requeueing job ${{SLURM_JOB_ID:-}}"
    scontrol requeue "${{SLURM_JOB_ID:-}}" || echo "hf-gpu-train: scontrol requeue failed: submit this script again to resume"
elif [ -n "$TERMED" ]; then
    echo "hf-gpu-train: SIGTERM reached srun, which kills every task at once (exit $code): submit this script again to resume from the newest complete checkpoint; #SBATCH --signal=B:USR1@N warns N s before a time limit"
fi
exit "$code"
"""
