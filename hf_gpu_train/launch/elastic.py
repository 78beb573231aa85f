"""``hf-gpu-train launch --nnodes MIN:MAX``: a launch that goes on with the nodes it has.

accelerate takes a whole number of machines (``--num_machines N``): every node must come back before a restarted
group trains again, so a job whose node died waits for the scheduler. An elastic launch is torchrun's, with torchelastic's
``c10d`` rendezvous between MIN and MAX nodes: each node's ``hf-gpu-train launch`` starts ``torchrun --nnodes MIN:MAX``
with the variables `accelerate launch` would give the processes for the YAML (``accelerate_env.py``: the strategy, the
precision), and after a failure starts it again (``restarts.py`` decides; a usage error or the same failure twice is
never restarted). The nodes that start again meet at the rendezvous: when MIN of them have joined and no more come
within ``last_call_timeout``, they train as a group of that size, resuming from the newest complete checkpoint on the
new number of processes (the global batch kept, accumulation adjusted, optimizer state resharded:
``faults/deepspeed_resharding.py``, FSDP through torch.distributed.checkpoint).

Where it does not hold, said in docs/faults.md: the rendezvous store lives in the launcher of the node given
``--machine_rank 0`` (``is_host``), at ``--main_process_ip``; if that node is the one lost, the others cannot meet
again and stop after ``join_timeout`` (torchelastic's c10d backend: an etcd rendezvous, or the scheduler, is needed
there). Checkpoints must be on storage every node reads (each node's own disk: refused on a count change,
``faults/checkpoint_layout.py``). No torch here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..errors import UsageError
from .accelerate_env import launch_environment

NNODES_OPTION = "--nnodes"
# torchelastic's defaults (join 600 s, last call 30 s) unless --rdzv_conf says otherwise
RENDEZVOUS_DEFAULTS = {"join_timeout": "600", "last_call_timeout": "30"}
# the accelerate launch options an elastic launch reads (by accelerate's key), or that change nothing under it (the
# rendezvous is always c10d: same_network's static address is not used); any other would be dropped unsaid
ELASTIC_SETTINGS = frozenset({"num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                              "mixed_precision", "gpu_ids", "rdzv_backend", "rdzv_conf", "same_network", "m", "module",
                              "no_python", "multi_gpu", "quiet", "q"})
# the accelerate config's sections whose variables accelerate_env.py does not write: refused, not dropped
UNCARRIED_SECTIONS = ("fp8_config", "parallelism_config", "megatron_lm_config", "tpu_env", "ipex_config", "mpirun_config")
CARRIED_KINDS = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED")


@dataclass(frozen=True)
class NodeRange:
    """How many nodes a launch may train on: at least ``least``, at most ``most``."""

    least: int
    most: int

    def __str__(self) -> str:
        return f"{self.least}:{self.most}"


def parse_node_range(value: str | None) -> NodeRange:
    """``MIN:MAX`` (or ``N``: exactly N, still elastic in which nodes) -> NodeRange; a UsageError naming the value."""
    if value is None:
        raise UsageError("--nnodes needs a value: MIN:MAX, the fewest and the most nodes to train on (e.g. --nnodes 2:4)")
    least, colon, most = value.partition(":")
    try:
        nodes = NodeRange(int(least), int(most if colon else least))
    except ValueError:
        nodes = None
    if nodes is None or nodes.least < 1 or nodes.most < nodes.least:
        raise UsageError(f"--nnodes {value}: give MIN:MAX, the fewest and the most nodes to train on (e.g. --nnodes 2:4; "
                         "the group goes on with as many as come back, at least MIN)")
    return nodes


def _number(settings: dict, config: dict, key: str, default: int) -> int:
    raw = settings.get(key, config.get(key, default))
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise UsageError(f"--{key} {raw}: not a number") from None


def rendezvous_conf(settings: dict, host: bool) -> dict[str, str]:
    """torchelastic's rendezvous settings: ``--rdzv_conf key=value,...`` over ``RENDEZVOUS_DEFAULTS``; ``is_host`` for
    the node that hosts the store unless given."""
    given = {}
    for part in filter(None, str(settings.get("rdzv_conf") or "").split(",")):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--rdzv_conf {settings['rdzv_conf']}: {part!r} is not key=value (e.g. --rdzv_conf "
                             "last_call_timeout=10,join_timeout=900)")
        given[key.strip()] = value.strip()
    conf = {**RENDEZVOUS_DEFAULTS, **given}
    for key in RENDEZVOUS_DEFAULTS:
        try:
            float(conf[key])
        except ValueError:
            raise UsageError(f"--rdzv_conf {key}={conf[key]}: seconds, a number (e.g. {key}={RENDEZVOUS_DEFAULTS[key]})") from None
    conf.setdefault("is_host", "1" if host else "0")
    return conf


def _check_carried(config: dict, nodes: NodeRange) -> None:
    """A config whose settings the torchrun line cannot carry is refused, naming the key."""
    kind = str(config.get("distributed_type", "NO"))
    if kind not in CARRIED_KINDS:
        raise UsageError(f"distributed_type {kind} with --nnodes {nodes}: an elastic launch carries {', '.join(CARRIED_KINDS)} "
                         "only; launch without --nnodes")
    dynamo = config.get("dynamo_config") or {}
    backend = str(dynamo.get("dynamo_backend", "NO")).upper() if isinstance(dynamo, dict) else "NO"
    if backend not in ("NO", "NONE"):
        raise UsageError(f"dynamo_backend {backend} with --nnodes {nodes}: the elastic launch does not pass accelerate's "
                         "dynamo variables on; drop dynamo_config from the config, or launch without --nnodes")
    for key in UNCARRIED_SECTIONS:
        if config.get(key):
            raise UsageError(f"{key} with --nnodes {nodes}: the elastic launch does not pass it on; drop it from the "
                             "config, or launch without --nnodes")


def elastic_command(nodes: NodeRange, config: dict, settings: dict, script: str, script_args: tuple[str, ...],
                    *, module: bool, no_python: bool) -> tuple[list[str], dict[str, str], list[str], float]:
    """(torchrun's command, the variables accelerate would export for ``config`` with ``settings`` applied, notes,
    the rendezvous's join timeout in seconds).

    ``config``: the accelerate YAML's keys; ``settings``: the launch options by accelerate's key. The processes per node
    are the YAML's ``num_processes / num_machines`` (``--num_processes``/``--num_machines`` on the command line win);
    the rendezvous is at ``--main_process_ip:--main_process_port``; ``--machine_rank 0`` hosts its store."""
    unread = sorted(set(settings) - ELASTIC_SETTINGS)
    if unread:
        raise UsageError(f"--{unread[0]} with --nnodes {nodes}: an elastic launch runs torchrun itself and would not pass it "
                         "on; put it in the accelerate config, or launch without --nnodes")
    if module and no_python:
        raise UsageError("-m and --no_python together: give one (accelerate refuses both too)")
    if str(settings.get("rdzv_backend", "c10d")) != "c10d":
        raise UsageError(f"--rdzv_backend {settings['rdzv_backend']} with --nnodes {nodes}: an elastic launch meets at "
                         "torchelastic's c10d rendezvous (drop --rdzv_backend)")
    machines = _number(settings, config, "num_machines", 1)
    processes = _number(settings, config, "num_processes", 1)
    if machines < 1 or processes < machines or processes % machines:
        raise UsageError(f"num_processes {processes} over num_machines {machines}: an elastic launch starts the same "
                         "number of processes on every node; give a multiple of the machines")
    per_node = processes // machines
    notes = []
    host = settings.get("main_process_ip", config.get("main_process_ip"))
    if host is None:
        if nodes.most > 1:
            raise UsageError(f"--nnodes {nodes} needs the rendezvous: --main_process_ip HOST (the node given "
                             "--machine_rank 0, which hosts it) and --main_process_port PORT, the same on every node")
        host = "127.0.0.1"
    port = _number(settings, config, "main_process_port", 29500)
    rank = _number(settings, config, "machine_rank", 0)
    if machines != nodes.most:
        notes.append(f"--nnodes {nodes}: {per_node} process(es) on each node, {nodes.least * per_node} to "
                     f"{nodes.most * per_node} in all (the config says {machines} machine(s) of {processes} processes)")
    notes.append(f"elastic launch: torchrun meets the other nodes at {host}:{port} (node {rank} "
                 f"{'hosts' if rank == 0 else 'joins'} the rendezvous); after a failure the nodes that start again train "
                 "as a group of their number, from the newest complete checkpoint")
    _check_carried(config, nodes)
    merged = {**config, **{k: settings[k] for k in ("mixed_precision", "gpu_ids") if k in settings}}
    try:
        env = launch_environment(merged, precision_on_command_line="mixed_precision" in settings)
    except ValueError as error:
        raise UsageError(f"--nnodes {nodes}: {error}") from None
    if merged.get("use_cpu") or merged.get("distributed_type") == "MULTI_CPU":
        env["ACCELERATE_USE_CPU"] = "1"  # the processes on the CPU (accelerate's multi-process launch exports nothing for it)
    gpu_ids = merged.get("gpu_ids")
    if gpu_ids not in (None, "all", ""):
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    conf = rendezvous_conf(settings, host=rank == 0)
    # the rendezvous's name: what every node's command shares (each node may have its own config file)
    run_id = f"hf-gpu-train-{host}-{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", run_id,
           "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
           "--max-restarts", "0"]  # restarts are hf-gpu-train launch's (restarts.py): a usage error is never restarted
    if module:
        cmd.append("--module")
    elif no_python:
        cmd.append("--no-python")
    return [*cmd, script, *script_args], env, notes, float(conf["join_timeout"])
