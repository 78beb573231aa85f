"""SLURM, in one place: the sbatch a plan runs as, SLURM's time-limit formats, partition names, and the file the
``slurm`` (and, for several machines, ``accelerate``) target of ``hf-gpu-train config --target`` writes.

One task per node; each runs ``hf-gpu-train launch`` (the plan's environment, stop signals forwarded to the training
processes, exit 75 when they stopped for one) with c10d rendezvous from SLURM's variables. Preemption: SLURM sends USR1
to the batch shell the grace before the time limit (``--signal=B:USR1@N``); the script passes it to the job step, every
rank saves a complete checkpoint and exits 75, and the script requeues the job, which resumes from that checkpoint
(docs/multi-node.md, docs/faults.md). No torch here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from .. import __version__
from ..errors import UsageError
from ..plan.planner import LaunchPlan
from ..plan.run_plan_file import PLAN_ENV, env_path_for, plan_path_for
from .grace import GRACE_ENV, Grace, grace_for
from .rank_report import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER_ENV
from .render import FINETUNE_ENTRY, binding_prefix, deepspeed_precision_flag, run_args_text, shell_word
from .restarts import ATTEMPT_ENV, DEFAULT_RESTARTS, REQUEUE_DIR_ENV

_SLURM_TIME = re.compile(r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?)"
                         r"|(?:(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)")
SLURM_TIME_FORMATS = "MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS"


def slurm_time_limit(value: str) -> int:
    """Seconds of a SLURM ``--time`` value (``sbatch(1)``: "minutes", "minutes:seconds", "hours:minutes:seconds",
    "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"); a UsageError naming the formats otherwise."""
    found = _SLURM_TIME.fullmatch(value.strip())
    problem = None if found else "not a SLURM time"
    if found and found["days"] is not None:
        parts = [int(found["days"]), int(found["dh"]), int(found["dm"] or 0), int(found["ds"] or 0)]
        if parts[1] > 23 or parts[2] > 59 or parts[3] > 59:
            problem = "hours above 23 or minutes or seconds above 59"
        seconds = ((parts[0] * 24 + parts[1]) * 60 + parts[2]) * 60 + parts[3]
    elif found:
        fields = [int(x) for x in (found["a"], found["b"], found["c"]) if x is not None]
        if len(fields) == 1:
            seconds = fields[0] * 60
        elif len(fields) == 2:
            seconds = fields[0] * 60 + fields[1]
            problem = "seconds above 59" if fields[1] > 59 else None
        else:
            seconds = (fields[0] * 60 + fields[1]) * 60 + fields[2]
            problem = "minutes or seconds above 59" if fields[1] > 59 or fields[2] > 59 else None
    if problem is None and seconds <= 0:
        problem = "no time at all"
    if problem is not None:
        raise UsageError(f"--time-limit {value!r}: {problem}; SLURM's formats are {SLURM_TIME_FORMATS} "
                         "(e.g. --time-limit 04:00:00 or --time-limit 2-00:00:00)")
    return seconds


def check_partition(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*", value):
        raise UsageError(f"--partition {value!r}: a SLURM partition name (letters, digits, '_', '.', '-'), or several "
                         "separated by commas (e.g. --partition gpu or --partition gpu,gpu-long)")
    return value


def render_sbatch(plan: LaunchPlan, config_path: str | Path, script: str = FINETUNE_ENTRY, job_name: str = "hf-gpu-train",
                  *, time_limit: str | None = None, partition: str | None = None, grace: Grace | None = None,
                  min_nodes: int | None = None) -> str:
    """One task per node; each runs ``hf-gpu-train launch`` (the plan's environment, stop signals forwarded to the
    training processes, exit 75 when they stopped for one) with c10d rendezvous from SLURM's variables.

    Preemption: SLURM sends USR1 to the batch shell ``grace.seconds`` before the time limit (``--signal=B:USR1@N``);
    the script passes it (and a TERM or USR2 it receives) to the job step, every rank saves a complete checkpoint
    and exits 75, and the script requeues the job (``--requeue``; ``--open-mode=append`` keeps one log), which
    resumes from that checkpoint. ``grace``: ``launch.grace.grace_for(plan)`` when not given.

    A rank that dies: each node's launcher says whether a restart can help (launch/restarts.py: never a usage error or
    the same failure twice, at most HF_GPU_TRAIN_MAX_RESTARTS times), and when one says so and none says no the script
    starts the training again in its allocation, on the nodes SLURM still counts usable, when there are at least
    ``min_nodes`` of them (default: all; fewer asks for ``--no-kill``, so that a node lost does not end the job), and
    requeues the job otherwise. The run resumes from its newest complete checkpoint, on fewer nodes with its global batch
    kept."""
    acc = plan.accelerate
    nodes = acc["num_machines"]
    least = nodes if min_nodes is None else min_nodes
    if not 1 <= least <= nodes:
        raise UsageError(f"--min-machines {least}: between 1 and --num-machines {nodes}")
    # a node lost ends the whole job unless --no-kill: asked for where the job may go on with fewer
    no_kill = "#SBATCH --no-kill\n" if least < nodes else ""
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
{no_kill}#SBATCH --signal=B:USR1@{grace.seconds}
{limits}# Preemption: USR1 reaches this script {grace.seconds} s before the time limit; it passes it (and a TERM or USR2) to
# every task; each rank finishes its step, saves a complete checkpoint and exits {PREEMPTED_EXIT_CODE}; this script then requeues
# the job, which resumes from that checkpoint. The warning comes {grace.describe()}
set -uo pipefail
# srun forwards USR1 to every task, but turns a TERM it receives into SIGKILL of every task (srun(1)): a stop signal to
# this shell goes on as USR1 (and one before srun starts, once it has). A TERM to every process of the job (a time limit,
# `scancel --full`) reaches srun too: then the tasks are killed at once and the next run resumes from the newest
# complete checkpoint.
STEP=""; ASKED=""; TERMED=""; REQUEUED=""
forward() {{ ASKED=$1; echo "hf-gpu-train: SIG$1 at $(date +%T): every rank finishes its step, saves a checkpoint and stops"; [ -n "$STEP" ] && kill -s USR1 "$STEP" 2>/dev/null; }}
trap 'forward USR1' USR1
trap 'forward USR2' USR2
trap 'TERMED=1; forward TERM' TERM
HERE=${{HF_GPU_TRAIN_DIR:-$SLURM_SUBMIT_DIR}}
cd "$HERE" || exit 1
set -a; . {shell_word(env_file)}; set +a
export {PLAN_ENV}={shell_word(plan_path_for(config_path))}
export {GRACE_ENV}=${{{GRACE_ENV}:-{grace.seconds}}}
# torchrun SIGKILLs its workers this long after a SIGTERM reaches it (30 s by default): the grace, not less
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{grace.seconds}}}
# each node's hf-gpu-train launch leaves this file when its processes stopped for a stop signal with a complete
# checkpoint: srun --kill-on-bad-exit may kill a node still exiting after another's 75, and srun's own code then says 137
export {PREEMPTED_MARKER_ENV}="$HERE/.hf-gpu-train-preempted-${{SLURM_JOB_ID:-0}}"
rm -f "${{{PREEMPTED_MARKER_ENV}}}"
# A rank that died: each node's launcher leaves here whether a restart can help (never after a usage error or the same
# failure at the same step twice; at most HF_GPU_TRAIN_MAX_RESTARTS, counted across requeues). When one says so and none
# says no, the training starts again in this allocation on the nodes SLURM still counts usable, at least
# HF_GPU_TRAIN_MIN_NODES of them (a run on fewer keeps its global batch); with fewer, the job is requeued.
export {REQUEUE_DIR_ENV}="$HERE/.hf-gpu-train-restarts-${{SLURM_JOB_ID:-0}}"
export HF_GPU_TRAIN_MAX_RESTARTS=${{HF_GPU_TRAIN_MAX_RESTARTS:-{DEFAULT_RESTARTS}}}
NODES_LEAST=${{HF_GPU_TRAIN_MIN_NODES:-{least}}}
mkdir -p "${{{REQUEUE_DIR_ENV}}}"
MAIN_PORT=${{HF_GPU_TRAIN_MAIN_PORT:-{acc.get('main_process_port', 29500)}}}
HF_GPU_TRAIN=${{HF_GPU_TRAIN:-hf-gpu-train}}
echo "hf-gpu-train: job ${{SLURM_JOB_ID:-}} on ${{SLURM_JOB_NODELIST:-}}, requeued ${{SLURM_RESTART_COUNT:-0}} time(s); the run resumes from its newest complete checkpoint"
# One task per node; each starts {per_node} process(es). SLURM_NODEID is the machine rank given to accelerate (with the c10d
# rendezvous torchelastic numbers the nodes in the order they join: global ranks need not follow node order).
# The arguments after this script's name go to the training script one by one (a value may hold spaces).
# At the very end torchelastic may report "Error waiting on exit barrier" when the agent hosting the
# rendezvous store leaves first (pytorch #69520): the workers have finished by then; check the metrics.
export HF_GPU_TRAIN_CONFIG_FILE={shell_word(config_path)} HF_GPU_TRAIN_SCRIPT={shlex.quote(script)} MAIN_PORT HF_GPU_TRAIN
usable_nodes() {{  # the job's nodes, in its order, less those SLURM says are down, drained or draining, failing or
    # not responding (a '*' after the state); fails when sinfo does
    local states bad
    states=$(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %T') || return 1
    bad=$(printf '%s\\n' "$states" | awk '{{s = $2; lost = (s ~ /\\*$/); sub(/[*~#%$@^!-]+$/, "", s)
        if (lost || s ~ /^(down|drain|drained|draining|fail|failing|not_responding|inval|powered_down|power_down|powering_down|reboot_issued)$/) print $1}}')
    scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vxF -f <(printf '%s\\n' $bad) || true  # none usable: no error
}}
requeue() {{  # the verdicts' folder is kept for the requeued job only when the requeue went through
    if scontrol requeue "${{SLURM_JOB_ID:-}}"; then REQUEUED=1; else echo "hf-gpu-train: scontrol requeue failed: submit this script again to resume"; fi
}}
failed_unjudged() {{  # no node's launcher left a verdict (all killed first, or the step could not start on a node SLURM
    # does not know is lost yet): requeued, at most HF_GPU_TRAIN_MAX_RESTARTS times, for SLURM to find the nodes again
    if [ "${{SLURM_RESTART_COUNT:-0}}" -lt "$HF_GPU_TRAIN_MAX_RESTARTS" ]; then
        echo "hf-gpu-train: exit $code and no node's launcher said whether a restart helps (killed before it could): requeueing job ${{SLURM_JOB_ID:-}}"
        requeue
    else
        echo "hf-gpu-train: exit $code, no node's launcher said whether a restart helps, and the job was requeued ${{SLURM_RESTART_COUNT:-0}} time(s) (HF_GPU_TRAIN_MAX_RESTARTS): not again; submit this script again to resume from the newest complete checkpoint"
    fi
}}
run_step() {{  # the training on the nodes of $1 (a comma list), $2 of them; the rest: the script's arguments
    local nodes=$1
    STARTS=$(( STARTS + 1 ))
    export HF_GPU_TRAIN_NODES=$2 MAIN_NODE=${{1%%,*}} {ATTEMPT_ENV}="${{SLURM_RESTART_COUNT:-0}}.$STARTS"
    case ",$1," in *",${{HF_GPU_TRAIN_MAIN_NODE:-}},"*) MAIN_NODE=$HF_GPU_TRAIN_MAIN_NODE ;; esac  # yours, while usable
    shift 2
    rm -f "${{{REQUEUE_DIR_ENV}}}"/*.restart "${{{REQUEUE_DIR_ENV}}}"/*.stop
    srun --nodes="$HF_GPU_TRAIN_NODES" --ntasks="$HF_GPU_TRAIN_NODES" --ntasks-per-node=1 --nodelist="$nodes" --kill-on-bad-exit=1 bash -c 'exec {binding_prefix(plan)}$HF_GPU_TRAIN launch --config-file "$HF_GPU_TRAIN_CONFIG_FILE" \\
        --max-restarts "$HF_GPU_TRAIN_MAX_RESTARTS" --num_machines "$HF_GPU_TRAIN_NODES" \\
        --num_processes "$(( HF_GPU_TRAIN_NODES * {per_node} ))" \\
        --machine_rank "$SLURM_NODEID" --main_process_ip "$MAIN_NODE" --main_process_port "$MAIN_PORT" \\
        --rdzv_backend c10d --same_network{deepspeed_precision_flag(plan)} \\
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
    STEP=""
}}
NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)
COUNT={nodes}; STARTS=0
while :; do
    run_step "$NODES" "$COUNT" "$@"
    if [ "$code" -eq {PREEMPTED_EXIT_CODE} ] || [ -e "${{{PREEMPTED_MARKER_ENV}}}" ]; then
        rm -f "${{{PREEMPTED_MARKER_ENV}}}"
        code={PREEMPTED_EXIT_CODE}
        echo "hf-gpu-train: stopped with a complete checkpoint: requeueing job ${{SLURM_JOB_ID:-}}"
        requeue
    elif [ "$code" -ne 0 ] && compgen -G "${{{REQUEUE_DIR_ENV}}}/*.restart" >/dev/null \
            && ! compgen -G "${{{REQUEUE_DIR_ENV}}}/*.stop" >/dev/null; then
        if ! USABLE=$(usable_nodes); then
            echo "hf-gpu-train: a rank failed (exit $code) and sinfo could not say which nodes are usable: requeueing job ${{SLURM_JOB_ID:-}}"
            requeue
            break
        fi
        NODES=$(printf '%s\\n' "$USABLE" | paste -sd, -)
        COUNT=$(printf '%s\\n' "$USABLE" | grep -c .)
        if [ "$COUNT" -ge "$NODES_LEAST" ] && [ -z "$ASKED" ]; then  # a stop signal, even one during this decision: requeue
            echo "hf-gpu-train: a rank failed (exit $code): starting again on $COUNT node(s) of the job ($NODES); the run resumes from its newest complete checkpoint"
            continue
        fi
        echo "hf-gpu-train: a rank failed (exit $code) and $COUNT of the job's nodes are usable (at least $NODES_LEAST wanted)${{ASKED:+, and a stop signal came}}: requeueing job ${{SLURM_JOB_ID:-}}; it resumes from its newest complete checkpoint"
        requeue
    elif [ "$code" -ne 0 ] && ! compgen -G "${{{REQUEUE_DIR_ENV}}}/*.stop" >/dev/null && [ -z "$TERMED" ]; then
        failed_unjudged
    elif [ -n "$TERMED" ]; then
        echo "hf-gpu-train: SIGTERM reached srun, which kills every task at once (exit $code): submit this script again to resume from the newest complete checkpoint; #SBATCH --signal=B:USR1@N warns N s before a time limit"
    fi
    break
done
# the verdicts' state is gone with the job once it ended for good: done, or a node said no (a SIGTERM may be SLURM
# requeueing it itself: kept)
if [ -z "$REQUEUED" ] && [ -z "$TERMED" ] && {{ [ "$code" -eq 0 ] || compgen -G "${{{REQUEUE_DIR_ENV}}}/*.stop" >/dev/null; }}; then
    rm -rf "${{{REQUEUE_DIR_ENV}}}"
fi
exit "$code"
"""


def sbatch_file(plan: LaunchPlan, yaml_path: Path, script: str, path: Path, *, time_limit: str | None = None,
                partition: str | None = None, grace: Grace, run_args: tuple[str, ...] | list[str] = (),
                min_nodes: int | None = None) -> tuple[str, str]:
    """(the sbatch's text, the line ``config`` prints about it) for ``path``; a time limit too short for the grace is a
    usage error, said before anything is written. ``run_args``: the run's arguments, after the script's name in the
    printed line (the sbatch passes its own arguments on to the run)."""
    if time_limit is not None and slurm_time_limit(time_limit) <= 2 * grace.seconds:
        # the warning would come at (or before) the start: every requeued job would stop again before a step
        raise UsageError(f"--time-limit {time_limit}: the job needs {grace.seconds} s of warning before "
                         f"its limit to save a checkpoint ({grace.describe()}), which leaves too little of "
                         f"{slurm_time_limit(time_limit)} s to train: ask for more than "
                         f"{2 * grace.seconds} s, or measure the save (--save-time-from OUTPUT_DIR)")
    text = render_sbatch(plan, yaml_path, script, time_limit=time_limit, partition=partition, grace=grace, min_nodes=min_nodes)
    return text, (f"On SLURM: sbatch {shell_word(path)}{run_args_text(run_args)}  (one task per node, c10d rendezvous; "
                  f"grace {grace.describe()})")
