"""The plan's values against the user's: explicit keys win, every override is reported, and an override the
planner predicts will not fit is a warning with its numbers, before any model is loaded.

Pure functions of a RunPlan and plain values: the fine-tuning entry point and anyone wiring
``attach_telemetry`` / ``enable_oom_recovery`` into their own script call them the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from .memory import GIB, TrainingShape, estimate, largest_micro_batch
from .run_plan_file import APPLIED_KEYS, Override, RunPlan

AUTO = "auto"  # a user value of "auto" asks for the decision: the plan's value is used, nothing is overridden


class Resolution(NamedTuple):
    """``values``: the user's values with the plan's applied (every key of ``user_values``, plus the plan's
    applied keys); ``overridden``: each plan value not used, with who chose otherwise."""

    values: dict
    overridden: tuple[Override, ...]


def resolve_with_plan(plan: RunPlan, user_values: Mapping[str, object], explicit_keys: Iterable[str],
                      world_size: int | None = None) -> Resolution:
    """Apply the plan's values to ``user_values`` (FinetuneConfig keys) except where the user was explicit.

    - A key in ``explicit_keys`` keeps the user's value; when it differs from the plan's (and is not "auto")
      it is reported as overridden (source "config").
    - A plan value of None (not decided: no --model) leaves the user's value alone, silently.
    - Launch flags that changed what the plan assumed are reported (source "launch"): a --mixed_precision the
      launcher was given is the run's precision unless the user set one; with another number of processes
      than planned (``world_size``, default the launcher's WORLD_SIZE) the micro-batch stays and
      global_batch_size becomes the requested global batch, so the accumulation is worked out again for the
      processes that really run.
    """
    explicit = set(explicit_keys)
    values = dict(user_values)
    overridden: list[Override] = []
    plan_values = {k: plan.value(k) for k in APPLIED_KEYS}
    launch = {o.key: o for o in plan.launch_overrides}
    world = world_size or plan.launched.num_processes or plan.num_processes
    if "precision" in launch:
        plan_values["precision"] = launch["precision"].user_value
    if plan.num_processes is not None and world != plan.num_processes and plan.memory is not None:
        plan_values["global_batch_size"] = plan.memory.global_batch_target
    overridden += launch.values()
    if plan.num_processes is not None and world != plan.num_processes and "num_processes" not in launch:
        overridden.append(Override("num_processes", plan.num_processes, world, "launch"))
    for key, planned in plan_values.items():
        if planned is None:
            continue
        if key in explicit and values.get(key) != AUTO:
            if values.get(key) != planned:
                overridden.append(Override(key, planned, values.get(key), "config"))
            continue
        values[key] = planned
    return Resolution(values, tuple(overridden))


def override_lines(overridden: Iterable[Override]) -> list[str]:
    """One line per override, for the run's first output: "per_device_train_batch_size=64 (your config) over the plan's 16"."""
    where = {"config": "your config", "launch": "the launch command", "environment": "your environment"}
    return [f"{o.key}={o.user_value} ({where.get(o.source, o.source)}) over the plan's {o.plan_value}" for o in overridden]


@dataclass(frozen=True)
class MemoryCheck:
    """The planner re-run for the values the run will use. Bytes are per process."""

    estimate_bytes: int
    usable_bytes: int
    device_memory_bytes: int
    fits: bool
    breakdown_bytes: tuple[tuple[str, int], ...]
    micro_batch: int
    gradient_checkpointing: bool
    precision: str
    seq_len: int
    image_size: int
    world_size: int
    strategy: str
    largest_micro_batch: int  # with this checkpointing setting
    largest_micro_batch_checkpointed: int
    warning: str | None  # set when it does not fit


def _planner_precision(precision: object, planned: str) -> str:
    text = str(precision) if precision not in (None, AUTO) else planned
    return {"fp8": "bf16", "no": "fp32"}.get(text, text)


def check_memory(plan: RunPlan, values: Mapping[str, object], world_size: int | None = None, seq_len: int | None = None,
                 image_size: int | None = None, method: str = "full", lora_rank: int | None = None,
                 levers: Mapping[str, object] | None = None) -> MemoryCheck | None:
    """Re-run the planner (``plan/memory.py``) for the plan's model with the run's micro-batch, checkpointing,
    precision, process count, sequence length and image size (None: the plan's), and the run's memory levers
    (``levers``: ``TrainingShape`` fields, ``levers.from_config.shape_levers``: the chunked head, which layers
    checkpointing covers, offloading, the optimizer in the backward). None when the plan has no memory plan (no
    --model). ``warning`` names the values, the estimate against the usable memory, and what fits."""
    m = plan.memory
    if m is None:
        return None
    world = world_size or plan.launched.num_processes or m.world_size
    micro = int(values.get("per_device_train_batch_size") or m.micro_batch)
    checkpointing = bool(values.get("gradient_checkpointing", m.gradient_checkpointing))
    precision = _planner_precision(values.get("precision"), m.precision)
    # the method the run trains with (LoRA's frozen base needs no gradients or optimizer states), not the plan's
    peft = {"method": method, **({"lora_rank": lora_rank} if lora_rank else {})} if method in ("lora", "qlora") else {}
    shape = TrainingShape(micro_batch=micro, seq_len=seq_len or m.seq_len, image_size=image_size or m.image_size,
                          precision=precision, optimizer=m.optimizer, gradient_checkpointing=checkpointing, num_gpus=world,
                          **dict(levers or {}), **peft)
    breakdown = estimate(m.model, shape, m.strategy)
    total = int(breakdown.total)
    fits = total <= m.usable_bytes
    largest = largest_micro_batch(m.model, shape, m.strategy, m.device_memory_bytes)
    largest_ckpt = largest_micro_batch(m.model, replace(shape, gradient_checkpointing=True), m.strategy, m.device_memory_bytes)
    check = MemoryCheck(
        estimate_bytes=total, usable_bytes=m.usable_bytes, device_memory_bytes=m.device_memory_bytes, fits=fits,
        breakdown_bytes=tuple((k, int(v)) for k, v in breakdown.rows()), micro_batch=micro, gradient_checkpointing=checkpointing,
        precision=precision, seq_len=shape.seq_len, image_size=shape.image_size, world_size=world, strategy=m.strategy,
        largest_micro_batch=largest, largest_micro_batch_checkpointed=largest_ckpt, warning=None)
    return check if fits else replace(check, warning=_warning(plan, check))


def _warning(plan: RunPlan, c: MemoryCheck) -> str:
    m = plan.memory
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in c.breakdown_bytes if value)
    if c.largest_micro_batch:
        fix = f"the largest micro-batch that fits is {c.largest_micro_batch}"
        if not c.gradient_checkpointing and c.largest_micro_batch_checkpointed > c.largest_micro_batch:
            fix += f" ({c.largest_micro_batch_checkpointed} with gradient_checkpointing=true)"
    elif c.largest_micro_batch_checkpointed:
        fix = f"not even micro-batch 1 fits without checkpointing; with gradient_checkpointing=true up to {c.largest_micro_batch_checkpointed}"
    else:
        fix = "not even micro-batch 1 with checkpointing fits"
    vision = bool(m.model.activation_bytes_per_sample_fp32) or not m.model.is_transformer_shaped
    shape = f"image {c.image_size}" if vision else f"seq {c.seq_len}"
    planned = f"micro-batch {m.micro_batch} {'with' if m.gradient_checkpointing else 'without'} gradient checkpointing"
    return (f"the planner predicts an out-of-memory: per_device_train_batch_size={c.micro_batch} with gradient_checkpointing="
            f"{str(c.gradient_checkpointing).lower()} ({c.precision}, {shape}, {c.world_size} process(es), {c.strategy}) needs "
            f"{c.estimate_bytes / GIB:.2f} GiB per {m.per} ({parts} GiB) against {c.usable_bytes / GIB:.2f} GiB usable of "
            f"{c.device_memory_bytes / GIB:.1f} GiB; {fix}; the plan chose {planned}")


def memory_error_pct(estimate_bytes: int, measured_bytes: int) -> float:
    """(measured - estimate) / estimate in percent: positive when the run used more than the planner said."""
    return round(100.0 * (measured_bytes - estimate_bytes) / estimate_bytes, 1)


def plan_record(plan: RunPlan, resolution: Resolution | None = None, memory: MemoryCheck | None = None,
                measured_peak_bytes: int | None = None, measured_what: str | None = None) -> dict:
    """The plan a run ran with, JSON-ready, for run_summary.json and the report: the plan's values and reasons,
    the values used, every override, and the memory estimate next to the measured peak (error in percent)."""
    used = resolution.values if resolution else {}
    record: dict = {
        "file": str(plan.path), "found_by": plan.source, "machine": plan.machine, "command": plan.command,
        "strategy": plan.strategy.value, "num_processes": plan.num_processes,
        "values": {k: {"plan": v.value, "used": used.get(k, v.value), "reason": v.reason} for k, v in plan.values.items()},
        "overridden": [o._asdict() for o in (resolution.overridden if resolution else plan.launch_overrides)],
        "memory": None,
        "memory_note": plan.memory_note,
    }
    if plan.memory is not None:
        estimate_bytes = memory.estimate_bytes if memory else plan.memory.estimate_bytes
        record["memory"] = {
            "planned_for": {"model": plan.memory.model.name, "seq_len": plan.memory.seq_len, "image_size": plan.memory.image_size,
                            "optimizer": plan.memory.optimizer, "strategy": plan.memory.strategy},
            "plan_estimate_bytes": plan.memory.estimate_bytes,
            "estimate_bytes": estimate_bytes,  # for the values used (the plan's own estimate when nothing changed)
            "usable_bytes": plan.memory.usable_bytes,
            "device_memory_bytes": plan.memory.device_memory_bytes,
            "fits": memory.fits if memory else True,
            "measured_peak_bytes": measured_peak_bytes,
            "measured": measured_what,
            "error_pct": None if measured_peak_bytes is None else memory_error_pct(estimate_bytes, measured_peak_bytes),
        }
    return record
