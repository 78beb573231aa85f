"""``hf-gpu-train launch``: accelerate launch with the plan applied (NAME.env, NAME.plan.json, CPU binding).

Everything before the script that starts with ``-`` is passed to `accelerate launch` as it is
(``--num_processes``, ``--gpu_ids``, ``--main_process_port``, ``--machine_rank``, ...), so the same command
line works with either tool. A flag that changes what the config says is printed with what it means for
the plan, and the training processes see it too (``RunPlan.launch_overrides``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import USAGE_ERROR_FILE_ENV, UsageError
from ..faults.gpu_health import named_events, node_watch
from ..finetune.loading import load_config_and_keys
from ..finetune.recipe_names import resolve_recipe
from ..launch.elastic import NNODES_OPTION, NodeRange, elastic_command, parse_node_range
from ..launch.grace import GRACE_ENV
from ..launch.rank_report import (
    HANG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    PREEMPTED_MARKER_ENV,
    PROGRESS_DIR_ENV,
    failure_line,
    read_hang_report,
    read_preempted,
    read_progress,
    read_rank_gpus,
    read_resumes,
    read_straggler,
    root_cause,
)
from ..launch.restarts import (
    ATTEMPT_ENV,
    DEFAULT_RESTARTS,
    REQUEUE_DIR_ENV,
    RESTART_OPTIONS,
    Outcome,
    RestartPolicy,
    record_verdict,
)
from ..launch.signals import SignalForwarder, ignore_warning_signals
from ..plan.accelerate_argv import CONFIG_FILE_OPTIONS, flatten, split_launch_argv
from ..plan.cpu_binding import TASKSET
from ..plan.machine_match import detect_this_machine
from ..plan.run_environment import binding_target
from ..plan.run_plan_file import (
    PLAN_ENV,
    accelerate_precision,
    data_stamps,
    env_path_for,
    generating_command,
    parse_env,
    plan_path_for,
    read_run_plan,
    tuned_keys_for,
)
from ..plan.scope import scope_to_this_machine
from . import example

USAGE = ("hf-gpu-train launch [--max-restarts N] [--nnodes MIN:MAX] [ACCELERATE_LAUNCH_OPTIONS] --config-file FILE SCRIPT "
         "[SCRIPT_ARGS ...]")
DESCRIPTION = ("Run `accelerate launch --config_file FILE [OPTIONS] SCRIPT ARGS` with FILE's .env (written by `hf-gpu-train "
               "config`) in the environment of every process (your own exported variables win, and are named), "
               "HF_GPU_TRAIN_PLAN naming FILE's .plan.json, and the plan's taskset CPU binding applied. Options before "
               "SCRIPT other than --config-file go to accelerate launch unchanged (e.g. --num_processes 2 --main_process_port "
               "29600); what they change against FILE is printed. A launch whose rank died starts again, resuming from the newest "
               "complete checkpoint, up to --max-restarts times (default 3 on one machine, 0 on several: the scheduler "
               "requeues there, 3 with --nnodes), never after a usage error, a stop signal or the same failure at the same step "
               "twice. --nnodes MIN:MAX: an elastic launch (torchrun's c10d rendezvous at --main_process_ip:--main_process_port, "
               "hosted by --machine_rank 0): after a failure the nodes that start again, at least MIN, go on as a group of "
               "their number, the global batch kept.")
HELP_FLAGS = ("-h", "--help")


def register(subparsers) -> argparse.ArgumentParser:
    # prefix_chars="+": argparse must not read accelerate's options; they are split by hand (plan/accelerate_argv.py)
    p = subparsers.add_parser("launch", help="accelerate launch with the config's .env and plan applied", usage=USAGE,
                              description=DESCRIPTION, prefix_chars="+", add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="accelerate launch options, --config-file FILE, SCRIPT and its arguments")
    return p


@dataclass(frozen=True)
class Launch:
    """The accelerate command, its environment, what to tell the user, and the CPUs to bind to (None: leave)."""

    cmd: list[str]
    env: dict[str, str]
    notes: tuple[str, ...]
    cpus: frozenset[int] | None = None
    machines: int = 1  # num_machines, as the YAML or --num_machines says (--nnodes: its most)
    nodes: NodeRange | None = None  # --nnodes MIN:MAX: an elastic launch (launch/elastic.py)
    join_timeout_s: float = 0.0  # an elastic launch: how long a closed rendezvous is joined again


def _flag_notes(settings: dict, config: dict, plan, config_name: str) -> list[str]:
    notes = []
    for key, value in settings.items():
        if key in config and str(config[key]).lower() != str(value).lower():
            notes.append(f"--{key} {value} overrides {config_name}'s {key}: {config[key]}")
    if plan is not None and plan.memory is not None and "num_processes" in settings and str(settings["num_processes"]) != str(plan.num_processes):
        notes.append(f"the plan's micro-batch {plan.memory.micro_batch} was planned for {plan.num_processes} process(es): the run "
                     f"keeps it, works the accumulation out again for the requested global batch {plan.memory.global_batch_target}, "
                     "and checks the memory for the processes that run")
    return notes


def _binding(plan, settings: dict) -> tuple[frozenset[int] | None, str | None]:
    """A taskset binding applied to this launcher is inherited by accelerate and every process it starts."""

    if plan is None or plan.cpu_binding is None or plan.cpu_binding.method != TASKSET or not hasattr(os, "sched_getaffinity"):
        return None, None
    if "gpu_ids" in settings and str(settings["gpu_ids"]) != str(plan.gpu_ids):
        return None, f"CPU binding not applied: --gpu_ids {settings['gpu_ids']} is not the planned {plan.gpu_ids}"
    target, note = binding_target(plan.cpu_binding, 0, set(os.sched_getaffinity(0)))
    return (frozenset(target) if target else None), note


def recipe_in(script_args: list[str]) -> str | None:
    """The ``--config RECIPE`` of scripts/finetune.py's arguments (None: none named)."""
    for i, arg in enumerate(script_args):
        if arg == "--config" and i + 1 < len(script_args):
            return script_args[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _as_the_run_reads(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """The recipe file and overrides the run will read (``finetune.run.parse_args``): a shipped recipe's name is its
    file; a recipe that cannot be found is left for the run to report."""

    if recipe is None:
        return None, overrides
    try:
        recipe = resolve_recipe(recipe)
    except UsageError:
        return recipe, overrides
    return recipe, overrides


def _data(recipe: str | None, overrides: list[str]) -> dict | None:
    """The run's model and data files as the run will stamp them (None: its config cannot be read; the run says why)."""


    try:
        cfg, _ = load_config_and_keys(recipe, overrides)
    except UsageError:
        return None
    return data_stamps(cfg.values())


def _tuned_precision(plan, script_args: list[str], settings: dict, config: dict) -> tuple[str, str] | None:
    """(accelerate precision, note) when `hf-gpu-train tune` measured another precision for this very recipe: the
    launcher passes it to this run only (NAME.yaml's mixed_precision reaches every recipe)."""

    recipe, overrides = _as_the_run_reads(recipe_in(script_args), [a for a in script_args if "=" in a and not a.startswith("-")])
    # plan.value None: a plan made for another machine, no tuned precision here
    if plan is None or "mixed_precision" in settings or plan.value("precision") is None \
            or "precision" not in tuned_keys_for(plan, recipe, overrides):
        return None
    if "precision" not in tuned_keys_for(plan, recipe, overrides, _data(recipe, overrides)):  # read the config only now
        return None
    if any(arg.startswith("precision=") for arg in script_args):  # the command line's precision always wins
        return None
    tuned = plan.value("precision")
    accelerate_value = accelerate_precision(tuned)
    if str(config.get("mixed_precision")) == accelerate_value:
        return None
    return accelerate_value, (f"--mixed_precision {accelerate_value}: measured by hf-gpu-train tune for {recipe or 'this run'} (this recipe "
                              f"only; {plan.config_file.name if plan.config_file else 'the YAML'} keeps "
                              f"mixed_precision: {config.get('mixed_precision')})")


def _deepspeed_file_precision(settings: dict, config: dict) -> tuple[str, str] | None:
    """A config naming a DeepSpeed config file: its mixed_precision goes on the command line (accelerate refuses a YAML's
    mixed_precision beside deepspeed_config_file, and reads the file's path from the directory the launch runs in)."""
    ds = config.get("deepspeed_config") or {}
    path = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    if not path:
        return None
    if not Path(path).is_file():
        raise UsageError(f"deepspeed_config_file {path} (in the accelerate config) does not exist from {Path.cwd()}: accelerate "
                         "reads it from the directory the launch runs in; launch from where `hf-gpu-train config` ran, or "
                         "write an absolute path there")
    if "mixed_precision" in settings or config.get("mixed_precision") is None:
        return None
    raw = config["mixed_precision"]
    value = "no" if raw is False else str(raw)  # "no" too (YAML may read an unquoted no as false): refused there like any other
    return value, (f"--mixed_precision {value} from the config on the command line: accelerate refuses a config file's "
                   "mixed_precision beside deepspeed_config_file")


def build_launch(argv: list[str], environ: Mapping[str, str] | None = None, here=None, nodes: NodeRange | None = None) -> Launch:
    """``here``: the machine the processes start on (None: detected now); a plan made for other hardware reaches
    them without its machine variables (threads, NCCL topology, devices) and CPU binding. ``nodes``: an elastic
    launch (torchrun with the variables accelerate would export, launch/elastic.py) instead of accelerate launch."""
    import yaml


    environ = os.environ if environ is None else environ
    parsed = split_launch_argv(argv)
    named = parsed.value(*CONFIG_FILE_OPTIONS)
    if not named:
        raise UsageError(f"--config-file FILE is required (written by `hf-gpu-train config --output DIR/NAME`): {USAGE}")
    config_file = Path(named)
    if not config_file.is_file():
        raise UsageError(f"--config-file {config_file} does not exist: write one with `hf-gpu-train config --output ...`")
    if parsed.script is None:
        raise UsageError(f"no training script after the options: {USAGE}")
    if not parsed.has("-m", "--module", "--no_python", "--no-python") and not Path(parsed.script).exists():
        raise UsageError(f"training script {parsed.script} does not exist")
    notes: list[str] = []
    env_file = env_path_for(config_file)
    planned_env = parse_env(env_file.read_text()) if env_file.is_file() else {}
    plan = None
    if plan_path_for(config_file).is_file():
        plan = read_run_plan(plan_path_for(config_file), "hf-gpu-train launch", {**planned_env, **environ})
        plan, other_machine = scope_to_this_machine(plan, detect_this_machine() if here is None else here)
        kept = {name for name, _, _ in plan.environment}
        planned_env = {k: v for k, v in planned_env.items() if k in kept}
        notes += other_machine
    notes += [f"keeping {k}={environ[k]} from your environment over {env_file.name}'s {v}"
              for k, v in planned_env.items() if k in environ and environ[k] != v]
    env = {**planned_env, **environ}
    if plan is not None:
        env[PLAN_ENV] = str(plan_path_for(config_file).absolute())
    elif (command := generating_command(config_file)) is not None:
        notes.append(f"no {plan_path_for(config_file).name} beside {config_file.name}: the run decides batch, accumulation and "
                     f"checkpointing itself; regenerate with `{command}` to carry the plan")
    try:
        config = yaml.safe_load(config_file.read_text()) or {}
    except yaml.YAMLError as error:
        raise UsageError(f"--config-file {config_file}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--config-file {config_file}: not an accelerate config (a YAML mapping of keys such as "
                         "distributed_type and num_processes): write one with `hf-gpu-train config --output ...`")
    settings = {k: v for k, v in parsed.settings().items() if k not in ("config_file",)}
    if config.get("enable_cpu_affinity") and "gpu_ids" in settings and str(settings["gpu_ids"]) != str(config.get("gpu_ids")):
        # accelerate pins process i to the CPUs of NVML GPU i of the YAML's plan, whatever --gpu_ids says
        raise UsageError(f"--gpu_ids {settings['gpu_ids']} with {config_file.name}, whose enable_cpu_affinity pins each process "
                         f"to the CPUs of GPUs {config.get('gpu_ids')}: the processes would run on the wrong socket. Write a "
                         f"config for those GPUs: `hf-gpu-train config --gpu-ids {settings['gpu_ids']} --output ...`")
    notes += _flag_notes(settings, config, plan, config_file.name)
    tuned_precision = _tuned_precision(plan, parsed.script_args, settings, config) or _deepspeed_file_precision(settings, config)
    if tuned_precision is not None:
        flag, note = tuned_precision
        settings_flags = ["--mixed_precision", flag]
        notes.append(note)
    else:
        settings_flags = []
    cpus, note = _binding(plan, settings)
    if note:
        notes.append(note)
    if nodes is not None:
        elastic_settings = {**settings, **({"mixed_precision": settings_flags[1]} if settings_flags else {})}
        cmd, launched, elastic_notes, join_timeout_s = elastic_command(
            nodes, config, elastic_settings, parsed.script, parsed.script_args, module=parsed.has("-m", "--module"),
            no_python=parsed.has("--no_python", "--no-python"))
        return Launch(cmd, {**env, **launched}, (*notes, *elastic_notes), cpus, nodes.most, nodes, join_timeout_s)
    # The accelerate of this interpreter, whatever PATH says; its launch command alone (accelerate_cli imports every
    # subcommand, estimate-memory's transformers among them: 5 s more before the first process starts)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
           *flatten(parsed.without(*CONFIG_FILE_OPTIONS)), *settings_flags, parsed.script, *parsed.script_args]
    try:
        machines = int(settings.get("num_machines", config.get("num_machines", 1)) or 1)
    except (TypeError, ValueError):
        machines = 1
    return Launch(cmd, env, tuple(notes), cpus, machines)


def run(args: argparse.Namespace) -> int:

    if split_launch_argv(args.argv).has(*HELP_FLAGS):

        print(f"usage: {USAGE}\n\n{DESCRIPTION}\n\n{example('launch')}")
        return 0
    max_restarts, argv = take_restarts(args.argv)
    nodes, argv = take_nnodes(argv)
    launch = build_launch(argv, nodes=nodes)
    if max_restarts is None:
        # several machines of a fixed number: a restart on one node waits for nodes that stopped; there the scheduler
        # requeues (the sbatch, the Kubernetes operator). --nnodes: the nodes that start again meet and go on
        max_restarts = DEFAULT_RESTARTS if launch.machines == 1 or launch.nodes is not None else 0
    for note in launch.notes:
        print(f"hf-gpu-train launch: {note}", file=sys.stderr)
    if launch.cpus:
        os.sched_setaffinity(0, launch.cpus)
        print("hf-gpu-train launch: bound to the plan's CPUs (its taskset binding); every process inherits it", file=sys.stderr)
    if os.environ.get(REQUEUE_DIR_ENV):  # the sbatch: the scheduler restarts the job, this node says whether
        outcome = launch_once(launch.cmd, launch.env)
        node = os.environ.get("SLURMD_NODENAME") or os.environ.get("SLURM_NODEID", "0")  # a step's node ids count within it
        line = record_verdict(outcome, max_restarts, Path(os.environ[REQUEUE_DIR_ENV]), node,
                              os.environ.get(ATTEMPT_ENV) or  # an sbatch of an earlier version: its job step's id
                              f"{os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('SLURM_STEP_ID', '0')}")
        if line:
            print(f"hf-gpu-train launch: {line}", file=sys.stderr, flush=True)
        return outcome.code
    policy = RestartPolicy(max_restarts)
    rejoining_since = None
    while True:
        outcome = launch_once(launch.cmd, launch.env)
        if launch.nodes is not None and outcome.rendezvous_closed:
            # the host's rendezvous was closed (its torchrun ending the start before, while its processes stop): not a
            # failure of the run; joined again for as long as a join may take (join_timeout)
            rejoining_since = rejoining_since or time.monotonic()
            waited = time.monotonic() - rejoining_since
            if waited < launch.join_timeout_s:
                print("hf-gpu-train launch: the rendezvous was closed (the host's torchrun still ending a start): joining "
                      "again", file=sys.stderr, flush=True)
                time.sleep(2)
                continue
            print(f"hf-gpu-train launch: the rendezvous stayed closed for {waited:.0f} s (join_timeout): the group ended "
                  "without this node, or the node hosting it (--machine_rank 0) is gone; if the run is not finished, the "
                  "scheduler must restart the job", file=sys.stderr)
            return outcome.code
        rejoining_since = None
        again, line = policy.restart_line(outcome)
        if line:
            print(f"hf-gpu-train launch: {line}", file=sys.stderr, flush=True)
        if not again:
            return outcome.code


def take_nnodes(argv: list[str]) -> tuple[NodeRange | None, list[str]]:
    """(``--nnodes MIN:MAX`` or None when not given, the argv without it): ours; accelerate has no such option."""
    parsed = split_launch_argv(argv)
    if not parsed.has(NNODES_OPTION):
        return None, list(argv)
    nodes = parse_node_range(parsed.value(NNODES_OPTION))
    return nodes, parsed.argv_without(NNODES_OPTION)


def take_restarts(argv: list[str]) -> tuple[int | None, list[str]]:
    """(``--max-restarts N`` or None when not given, the argv without it): ours, not accelerate's (``--max_restarts``
    too: torchelastic's would restart a usage error or the same crash until its limit)."""
    parsed = split_launch_argv(argv)
    value = parsed.value(*RESTART_OPTIONS)
    if value is None:
        return None, list(argv)
    try:
        count = int(value)
        if count < 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--max-restarts {value}: give a number of restarts (0: none; default {DEFAULT_RESTARTS})") from None
    return count, parsed.argv_without(*RESTART_OPTIONS)


def run_reporting_usage_errors(cmd: list[str], env: dict[str, str]) -> int:
    """``launch_once``'s exit code."""
    return launch_once(cmd, env).code


def launch_once(cmd: list[str], env: dict[str, str]) -> Outcome:
    """``_launch_once`` with every GPU of this node watched from before the processes start until they end: a rank
    that dies cannot say its GPU's XID, the launcher can (``faults/gpu_health.py``)."""
    health = node_watch()
    try:
        return _launch_once(cmd, env, health)
    finally:
        if health is not None:
            health.close()


def _launch_once(cmd: list[str], env: dict[str, str], health) -> Outcome:
    """Run the launcher with its stderr passed through as it comes. A training process that stops on a usage error
    (``scripts/finetune.py`` exits 2 with one line) writes that line to ``USAGE_ERROR_FILE``; from then on the stream
    goes through ``AfterUsageError``: the same line from other ranks and the launcher's own report of the failed worker
    (torchrun's ChildFailedError traceback and report box, accelerate's CalledProcessError) are dropped, everything else
    (another rank's own traceback) still reaches stderr; the one line is shown, and the exit code is 2, as for one
    process."""


    with tempfile.TemporaryDirectory(prefix="hf_gpu_train_launch_") as folder:
        marker = Path(folder) / "usage_error.txt"
        progress = Path(folder) / "progress"
        progress.mkdir()
        if env.get(GRACE_ENV) and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env:
            # torchrun SIGKILLs its workers 30 s after a SIGTERM reaches it: never before the grace the run was given
            env = {**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": env[GRACE_ENV]}
        # SIGUSR1/2 ignored by the launcher, and every stop signal forwarded to the training processes (signals.py)
        proc = subprocess.Popen(cmd, env={**env, USAGE_ERROR_FILE_ENV: str(marker), PROGRESS_DIR_ENV: str(progress)},
                                stderr=subprocess.PIPE, preexec_fn=ignore_warning_signals)
        shown = b""  # what the launcher printed (its root cause is read from it)
        written = b""  # what reached our stderr: the usage line may have been dropped as another rank's copy
        after: AfterUsageError | None = None
        with SignalForwarder(proc.pid, progress) as forwarder:
            while chunk := os.read(proc.stderr.fileno(), 65536):
                if after is None and marker.exists():
                    after = AfterUsageError(marker)
                passed = chunk if after is None else after.feed(chunk)
                _write(passed)
                shown = (shown + chunk)[-65536:]
                written = (written + passed)[-65536:]
            code = proc.wait()
        # exit 0: every process ended well at the last start, whatever saved-and-stopped before it (torchelastic stops
        # the processes, which save as for a stop signal, to take in a node that joined late)
        preempted = read_preempted(progress) if code != 0 else {}
        if preempted and not marker.exists():
            steps = ", ".join(f"rank {rank} {'at once' if step < 0 else f'after step {step}'}"
                              for rank, step in sorted(preempted.items()))
            kept = ("the newest complete checkpoint is kept" if min(preempted.values()) < 0 else  # a second signal, no grace left
                    "with a complete checkpoint")
            print(f"hf-gpu-train launch: the training processes stopped for a stop signal ({steps}) {kept}; run the same "
                  f"command again to resume (exit {PREEMPTED_EXIT_CODE})", file=sys.stderr)
            marker = env.get(PREEMPTED_MARKER_ENV)
            if marker:  # the sbatch requeues on it even when srun reports another node's code (launch/render.py)
                with contextlib.suppress(OSError):
                    Path(marker).write_text(steps + "\n")
            return Outcome(PREEMPTED_EXIT_CODE, preempted=True)
        if not marker.exists():
            hang = read_hang_report(progress)
            cause, reached = root_cause(shown.decode(errors="replace")), read_progress(progress)
            events = named_events(health.poll(), read_rank_gpus(progress)) if code and health else []
            line = failure_line(cause, reached, hang, events, read_straggler(progress)) if code else None
            if line:
                node = os.environ.get("SLURMD_NODENAME")  # several machines under SLURM: which one's ranks these are
                print(f"hf-gpu-train launch{f' on node {node}' if node else ''}: {line}", file=sys.stderr)
            steps = tuple(sorted((rank, int(p["step"])) for rank, p in reached.items() if isinstance(p.get("step"), int)))
            # a stop signal came (the processes did not end with 75: a script without preemption handling): the
            # scheduler wants the job gone, never restarted here
            return Outcome(HANG_EXIT_CODE if code and hang is not None else code, cause, steps,
                           preempted=bool(forwarder.received), resumes=read_resumes(progress),
                           rendezvous_closed=bool(code) and not reached and b"RendezvousClosedError" in shown)
        if after is not None:
            rest = after.flush()
            _write(rest)
            written += rest
        message = marker.read_text().strip().splitlines()[0]
        if message.encode() not in written:
            print(message, file=sys.stderr)
        print("hf-gpu-train launch: the training processes stopped on the usage error above (exit 2)", file=sys.stderr)
        return Outcome(2, usage_error=True)


def _write(data: bytes) -> None:
    if data:
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()


# the exceptions a launcher raises to report a worker that failed (the worker's own lines said why)
LAUNCHER_REPORTS = (b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError", b"subprocess.CalledProcessError")
BOX_EDGE = re.compile(rb"^=+$")


class AfterUsageError:
    """The launcher's stderr once a worker stopped on a usage error, line by line: drops the usage lines (every rank
    that stops on it prints it; one is shown), torchelastic's own log lines, and the launcher's report of the failed
    worker (a traceback ending in one of ``LAUNCHER_REPORTS``, and torchrun's ``====`` box after it); passes the rest,
    other ranks' tracebacks above all. A traceback is held until its exception line says whose it is."""

    def __init__(self, marker: Path):
        self.marker = marker
        self.partial = b""
        self.held: list[bytes] = []  # a traceback not yet ended
        self.in_box = False  # inside torchrun's report box (between its two ==== lines)
        self.after_report = False  # the line after a dropped report: a box may start there

    def _usage_lines(self) -> set[bytes]:
        try:
            return {line.strip().encode() for line in self.marker.read_text().splitlines() if line.strip()}
        except OSError:
            return set()

    def feed(self, chunk: bytes) -> bytes:
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        return b"".join(self._line(line + b"\n") for line in lines)

    def flush(self) -> bytes:
        out = self._line(self.partial) if self.partial else b""
        self.partial = b""
        out += b"".join(self.held)
        self.held = []
        return out

    def _line(self, line: bytes) -> bytes:
        text = line.rstrip(b"\r\n")
        if self.in_box:
            self.in_box = not BOX_EDGE.match(text)
            return b""
        if self.after_report:
            self.after_report = False
            if BOX_EDGE.match(text):
                self.in_box = True
                return b""
        if self.held:
            if text[:1] in (b" ", b"\t"):  # a frame of the traceback held
                self.held.append(line)
                return b""
            block, self.held = [*self.held, line], []
            if text.startswith(LAUNCHER_REPORTS):
                self.after_report = True
                return b""
            return b"".join(block)
        if text == b"Traceback (most recent call last):":
            self.held = [line]
            return b""
        if text.strip() in self._usage_lines() or b"torch/distributed/elastic/" in text:
            return b""
        return line
