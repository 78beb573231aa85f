"""The launch plan inside ``scripts/finetune.py``: found, its environment applied, its values used unless the
recipe or the command line set them, overrides said, and an override the planner predicts will not fit warned
about with its numbers, all before torch is imported or a model loaded. ``hf_gpu_train.plan.run_plan`` holds
the pieces (no torch); this module is the fine-tuning side's use of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..launch.launched_strategy import launched_strategy
from ..levers.from_config import planned_levers_that_hold, shape_levers
from ..plan.machine_match import detect_this_machine, unset_planned_variables
from ..plan.run_plan import (
    APPLIED_KEYS,
    apply_run_environment,
    check_memory,
    load_run_plan,
    override_lines,
    plan_record,
    resolve_with_plan,
)
from ..plan.scope import plan_fingerprint, same_strategy, scope
from ..plan.strategies import deepspeed_name, fsdp_name
from .config import FinetuneConfig
from .loading import resolve
from .plan_scope import run_fingerprint
from .tasks.base import task_for

log = logging.getLogger("hf_gpu_train.finetune")


@dataclass(frozen=True)
class AppliedPlan:
    plan: object  # plan.run_plan_file.RunPlan
    resolution: object  # plan.resolution.Resolution
    memory: object | None  # plan.resolution.MemoryCheck
    lines: tuple[str, ...]  # what the run says about it first
    here: object | None = None  # hardware.profile.HardwareProfile: this machine, detected once for the plan and the run
    launched_strategy: str | None = None  # what the launch runs (launch/launched_strategy.py), read before the values applied

    def record(self, measured_peak_bytes: int | None, measured_what: str | None) -> dict:

        return plan_record(self.plan, self.resolution, self.memory, measured_peak_bytes, measured_what)


def apply_launch_plan(cfg: FinetuneConfig, explicit_keys: frozenset, environ=None, recipe=None,
                      command_line_keys: frozenset = frozenset(), here=None, overrides=()) -> tuple[FinetuneConfig, AppliedPlan | None]:
    """``explicit_keys``: what the recipe file or the command line set; they win over the plan, except that values
    `hf-gpu-train tune` measured for this very recipe win over the recipe file's (never over the command line).
    ``here``: this machine's profile (None: detected now); a plan made for other hardware keeps its machine values.
    ``overrides``: the command line's key=value (with ``recipe``, the job tuned values are scoped to)."""

    environ = os.environ if environ is None else environ
    loaded = load_run_plan(environ)
    if loaded is None:
        return cfg, None
    here = detect_this_machine() if here is None else here
    # what this run is, compared once with what the plan was made for: the plan as this run may apply it
    launched = launched_strategy(_with_the_plans_environment(loaded, environ), on_cpu=not here.gpus)
    scoped = scope(loaded, run_fingerprint(cfg, plan_fingerprint(loaded), here, launched, recipe, overrides), here)
    plan = scoped.plan
    lines = [f"launch plan {plan.path} ({plan.source})", *scoped.lines["machine"]]
    if scoped.differs("machine"):  # before its variables reach this process
        lines += unset_planned_variables(loaded, plan, environ)
    lines += [*apply_run_environment(plan, environ).lines(), *scoped.lines["recipe"], *scoped.lines["run"], *scoped.lines["tuned"]]
    cfg, resolution, values, said = _resolved(cfg, plan, explicit_keys, (scoped.tuned - command_line_keys) & explicit_keys,
                                              dict(scoped.not_applied))
    lines += said
    shape = task_for(cfg.task).planner_input(cfg)
    memory = check_memory(plan, values, seq_len=shape.seq_len, image_size=shape.image_size, method=cfg.method,
                          lora_rank=shape.lora_rank, levers=shape_levers(cfg.values()))
    if memory is not None and memory.warning:
        log.warning("hf_gpu_train: %s", memory.warning)
    return cfg, AppliedPlan(plan, resolution, memory, tuple(lines), here, launched)


def _resolved(cfg: FinetuneConfig, plan, explicit_keys: frozenset, tuned: frozenset, not_applied: dict):
    """(cfg, resolution, values, lines): the scoped plan's values resolved against the run's own (``explicit_keys`` win,
    but not over ``tuned``: measured by tune for this recipe), the levers this run rules out dropped, and the two lines
    "plan values applied" and "plan values not applied" (``not_applied``: key -> (the plan's value, why), so far)."""

    own = cfg.values()
    applied_keys = [k for k in APPLIED_KEYS if k in own]  # a plan's key of another task's (packing) is not this run's
    lines = [f"{key}={plan.value(key)} measured by hf-gpu-train tune for this recipe, over the recipe's {own[key]}"
             for key in sorted(tuned) if key in own and plan.value(key) != own[key]]
    resolution = resolve_with_plan(plan, {k: own[k] for k in applied_keys}, explicit_keys - tuned)
    values = dict(resolution.values)
    if values.get("precision") == "fp8":  # the plan allows it; this entry point trains in bf16 at most
        values["precision"] = "bf16"
        lines.append("the plan's fp8 is not supported by scripts/finetune.py: bf16")
    from_plan = {k for k in applied_keys if plan.value(k) is not None and k not in explicit_keys - tuned}
    world = plan.launched.num_processes or plan.num_processes or 1
    for key, planned_value, why in planned_levers_that_hold(values, from_plan, cfg.lever_keys(), world,
                                                            task_for(cfg.task).attention(cfg)):
        not_applied.setdefault(key, (planned_value, why))
    cfg = resolve(cfg.with_values(**{k: values[k] for k in applied_keys if k in values}))
    lines += [f"plan value overridden: {line}" for line in override_lines(resolution.overridden)]
    overridden = {o.key for o in resolution.overridden}
    applied = [f"{k}={values[k]}" for k in applied_keys if plan.value(k) is not None and k not in overridden
               and k not in not_applied]
    lines.append(f"plan values applied: {', '.join(applied) if applied else 'none'}")
    for o in resolution.overridden:
        if o.key in applied_keys:
            not_applied.setdefault(o.key, (o.plan_value, {"config": "your config", "launch": "the launch command"}.get(
                o.source, f"your {o.source}")))
    lines.append("plan values not applied: " + (", ".join(f"{k}={v} ({why})" for k, (v, why) in not_applied.items()) or "none"))
    return cfg, resolution, values, lines


def _with_the_plans_environment(plan, environ) -> dict:
    """A copy of ``environ`` as the plan's environment will leave it: the launched strategy is read from it
    (ACCELERATE_USE_CPU may come from NAME.env) before the plan, scoped, reaches this process."""

    trial = dict(environ)
    apply_run_environment(plan, trial)
    return trial


def strategy_of_state(state) -> str | None:
    """What accelerate's state runs, in the planner's words (launch/launched_strategy.py); None: something else."""
    kind = str(getattr(state.distributed_type, "value", state.distributed_type))
    if kind == "FSDP":
        plugin = state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) == 2:
            reshard = plugin.reshard_after_forward is not False
            offload = type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
        else:
            reshard = "SHARD_GRAD_OP" not in str(plugin.sharding_strategy)
            offload = bool(getattr(plugin.cpu_offload, "offload_params", False))
        return fsdp_name(reshard, offload)
    if kind == "DEEPSPEED":
        plugin = state.deepspeed_plugin
        zero = (plugin.deepspeed_config or {}).get("zero_optimization") or {}
        device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
        return deepspeed_name(plugin.zero_stage, device not in ("none", ""))
    if kind == "NO":
        return "single"
    return "ddp" if kind.startswith("MULTI_") else None


def confirm_launched_strategy(applied: AppliedPlan | None, state) -> str | None:
    """The strategy the plan was scoped for was read from the launch's environment, before the Trainer existed; once
    its accelerator does, what it runs is compared with it. A line when they differ (the plan's memory values were kept
    or dropped for the wrong strategy), else None."""

    if applied is None or applied.launched_strategy is None:
        return None
    runs = strategy_of_state(state)
    if runs is None or same_strategy(applied.launched_strategy, runs):
        return None
    return (f"accelerate runs {runs}, not the {applied.launched_strategy} its launch environment named when the plan was "
            f"applied: the plan's memory values were kept or dropped for {applied.launched_strategy}; set this run's "
            "per_device_train_batch_size and gradient_checkpointing yourself, or launch with `hf-gpu-train launch "
            "--config-file NAME.yaml SCRIPT`")
