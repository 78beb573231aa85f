"""The strategy a training process was launched with, in the planner's words, read before torch as accelerate reads it.

A plan's micro-batch and accumulation are sized for its strategy: a micro-batch that fits beside sharded weights does
not fit beside a whole replica. What a process really runs is decided by its launcher's environment: accelerate builds
its state from ``ACCELERATE_USE_DEEPSPEED`` (DeepSpeed, on a GPU or on DeepSpeed's CPU accelerator, unless
``ACCELERATE_USE_CPU`` is set: accelerate's state skips DeepSpeed then and trains DDP)
and ``ACCELERATE_USE_FSDP`` (FSDP for several processes; on CPU processes finetune/fsdp.py shards as the launch asks),
and the FSDP or DeepSpeed settings from the variables beside them. Without them, several processes are DDP and one is
a single process. The run reads that before it applies the plan, and the Trainer's accelerator confirms it once it
exists (finetune/launch_plan.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..plan.strategies import deepspeed_name, fsdp_name, replica_strategy


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return str(environ.get(name, "false")).lower() in ("true", "1", "yes")


def _deepspeed_file(environ: Mapping[str, str]) -> dict:
    path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if not path or path == "none":
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}  # accelerate names an unreadable file itself when it builds the plugin
    return data if isinstance(data, dict) else {}


def deepspeed_launch(environ: Mapping[str, str]) -> tuple[int, bool] | None:
    """(ZeRO stage, optimizer offloaded) the launch asked DeepSpeed for: its config file's, else the variables
    (accelerate's default stage 2); None without DeepSpeed."""
    if not _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        return None
    zero = _deepspeed_file(environ).get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    stage = zero.get("stage")
    if not isinstance(stage, int):
        word = str(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        stage = int(word) if word.isdigit() else 2
    offload = zero.get("offload_optimizer") if "offload_optimizer" in zero else None
    device = (offload or {}).get("device") if isinstance(offload, dict) else environ.get(
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
    return stage, str(device).lower() not in ("none", "")


def launched_strategy(environ: Mapping[str, str], on_cpu: bool = False) -> str:
    """single | ddp | fsdp | fsdp-shard-grad-op | fsdp-offload | deepspeed-zeroN[-offload]: what this process's launch
    runs (``on_cpu``: no GPU here, or ACCELERATE_USE_CPU)."""
    world = str(environ.get("WORLD_SIZE", "1"))
    several = world.isdigit() and int(world) > 1
    cpu_flag = _flag(environ, "ACCELERATE_USE_CPU")
    on_cpu = on_cpu or cpu_flag
    deepspeed = deepspeed_launch(environ)
    if deepspeed is not None and not cpu_flag:
        stage, offload = deepspeed
        return deepspeed_name(stage, offload)
    if _flag(environ, "ACCELERATE_USE_FSDP") and (several or on_cpu):
        reshard = str(environ.get("FSDP_RESHARD_AFTER_FORWARD", "true")).lower()
        if reshard in ("no_shard", "3"):  # FSDP1's NO_SHARD replicates, as DDP does
            return replica_strategy(several)
        kept = reshard in ("false", "shard_grad_op", "2", "hybrid_shard_zero2", "5")  # gathered until the backward
        return fsdp_name(reshard_after_forward=not kept, offload=_flag(environ, "FSDP_OFFLOAD_PARAMS"))
    return replica_strategy(several)
