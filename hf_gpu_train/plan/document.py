"""LaunchPlan -> NAME.plan.json: every value `hf-gpu-train config` decided, with its reason, for the run to read.

The YAML carries what accelerate reads and the .env what the processes need in their environment; the
batch, accumulation, checkpointing and workers used to exist only as header comments, so every training
process decided them again. This document carries all of it, versioned, next to NAME.yaml and NAME.env.
A value the plan could not decide (no ``--model``: no memory plan) is ``null`` with the reason, never a
guess. ``run_plan_file.read_run_plan`` is the reading side.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from .checkpoint_interval import staging_bytes
from .lever_plan import LEVER_KEYS, lever_settings, levers_apply
from .memory import HEADROOM_FRACTION, usable_bytes
from .model_spec import model_fingerprint
from .planner import LaunchPlan
from .run_plan_file import FORMAT, VERSION, finetune_precision, plan_path_for

__all__ = ["NO_GPU_MEMORY_PLAN", "NO_MEMORY_PLAN", "no_memory_plan", "plan_document", "plan_path_for", "render_plan_json"]
NO_MEMORY_PLAN = ("no --model (or --params) given to `hf-gpu-train config`: no memory plan, so no micro-batch, "
                  "accumulation or checkpointing was decided; the run keeps its own. Pass --model to plan them")
NO_GPU_MEMORY_PLAN = ("no GPU: the memory planner plans GPU memory, so no micro-batch, accumulation or checkpointing was "
                      "decided for CPU processes; the run keeps its own")


def no_memory_plan(plan: LaunchPlan) -> str:
    """Why the plan decided no batch: no model given, or no GPU to plan memory for."""
    return NO_MEMORY_PLAN if plan.gpus or plan.options.model is None else NO_GPU_MEMORY_PLAN


def _value(value, reason: str) -> dict:
    return {"value": value, "reason": reason}


def _setting_reason(plan: LaunchPlan, key: str) -> str:
    return next((s.reason for s in plan.settings if s.key == key), "")


def _batch_values(plan: LaunchPlan) -> dict:
    m = plan.memory

    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "global_batch_size", "gradient_checkpointing",
            *LEVER_KEYS)
    if m is None:
        return {k: _value(None, no_memory_plan(plan)) for k in keys}
    target = plan.options.global_batch
    served = (f"the requested global batch {target}" if m.effective_batch == target else
              f"the requested global batch {target}, rounded up to {m.effective_batch} (a whole micro-batch on every process)")
    return {
        "per_device_train_batch_size": _value(m.micro_batch, _setting_reason(plan, "per_device_train_batch_size")),
        "gradient_accumulation_steps": _value(m.gradient_accumulation, _setting_reason(plan, "gradient_accumulation_steps")),
        "global_batch_size": _value(m.effective_batch, f"micro-batch x accumulation x {plan.accelerate['num_processes']} "
                                    f"process(es), serving {served}"),
        "gradient_checkpointing": _value(m.gradient_checkpointing, _setting_reason(plan, "gradient_checkpointing")),
        **_lever_values(plan),
    }


def _lever_values(plan: LaunchPlan) -> dict:

    decided = {key: _value(value, reason) for key, value, reason in lever_settings(plan.memory)}
    if plan.options.model is not None and levers_apply(plan.options.model):
        why = (f"no lever planned for {plan.strategy}: it does not fit a whole model per GPU, so the planner counts only "
               "what that strategy runs (checkpointing through its own setting): the run's own")
    else:
        why = ("the planner counts memory levers for transformer models it models layer by layer; this one's activations "
               "are measured as a whole: the run's own")
    return {key: decided.get(key, _value(None, why)) for key in LEVER_KEYS}


def _memory(plan: LaunchPlan) -> dict | None:
    m = plan.memory
    if m is None:
        return None
    o = plan.options
    return {
        "planned_for": {
            "model": asdict(o.model) if o.model else None,
            "fingerprint": model_fingerprint(o.model) if o.model else None,
            "seq_len": o.seq_len,
            "image_size": o.image_size,
            "optimizer": o.optimizer,
            "method": o.method,
            "lora_rank": o.lora_rank,
            "precision": {"no": "fp32", "fp8": "bf16"}.get(plan.accelerate["mixed_precision"], plan.accelerate["mixed_precision"]),
            "world_size": plan.accelerate["num_processes"],
            "global_batch_target": o.global_batch,
        },
        "per": "MIG instance" if plan.mig_instance is not None else "GPU",
        "strategy": m.strategy,
        "micro_batch": m.micro_batch,
        "gradient_checkpointing": m.gradient_checkpointing,
        "estimate_bytes": int(m.breakdown.total),
        "breakdown_bytes": {name: int(value) for name, value in m.breakdown.rows()},
        "device_memory_bytes": m.gpu_memory_bytes,
        "usable_bytes": int(usable_bytes(m.gpu_memory_bytes)),
        "headroom_fraction": HEADROOM_FRACTION,
        "reasons": list(m.reasons),
        "levers": dict(m.levers),
        "host_bytes": int(m.host_bytes),
        # a background save's staging buffers on a writing process (on a GPU, by default): host memory for the run
        "checkpoint_staging_bytes": int(staging_bytes(m.breakdown, plan.accelerate["num_processes"])),
    }


def plan_document(plan: LaunchPlan, command: str, config_file: str | Path) -> dict:
    """The JSON-ready document for the plan whose accelerate config is written to ``config_file``."""
    acc = plan.accelerate
    config = Path(config_file)
    binding = plan.cpu_binding
    return {
        "format": FORMAT,
        "version": VERSION,
        "generated_by": f"hf-gpu-train {__version__}",
        "command": command,
        "machine": plan.machine,
        "hardware": plan.hardware,
        "files": {"accelerate_config": config.name, "environment": config.with_suffix(".env").name},
        "strategy": _value(plan.strategy, _setting_reason(plan, "distributed_type")),
        "processes": {
            "distributed_type": acc["distributed_type"],
            "num_processes": acc["num_processes"],
            "num_machines": acc["num_machines"],
            "per_machine": plan.processes_per_machine,
            "machine_rank": acc["machine_rank"],
            "gpu_ids": acc.get("gpu_ids"),
        },
        "values": {
            "precision": _value(finetune_precision(acc["mixed_precision"]), _setting_reason(plan, "mixed_precision")),
            **_batch_values(plan),
            "dataloader_num_workers": _value(plan.dataloader_workers, _setting_reason(plan, "dataloader_num_workers")),
        },
        "memory": _memory(plan),
        "memory_note": None if plan.memory else no_memory_plan(plan),
        "cpu_binding": None if binding is None else {
            "method": binding.method, "cpus_by_process": list(binding.cpus_by_process),
            "command_prefix": binding.command_prefix, "reason": binding.reason},
        "mig_instance": None if plan.mig_instance is None else asdict(plan.mig_instance),
        "environment": [{"name": k, "value": v, "reason": r} for k, v, r in plan.env],
        "settings": [{"key": s.key, "value": s.value, "reason": s.reason} for s in plan.settings],
    }


def render_plan_json(plan: LaunchPlan, command: str, config_file: str | Path) -> str:
    return json.dumps(plan_document(plan, command, config_file), indent=2) + "\n"
