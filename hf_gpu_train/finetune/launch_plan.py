"""The launch plan inside ``scripts/finetune.py``: found, its environment applied, its values used unless the
recipe or the command line set them, overrides said, and an override the planner predicts will not fit warned
about with its numbers, all before torch is imported or a model loaded. ``hf_gpu_train.plan.run_plan`` holds
the pieces (no torch); this module is the fine-tuning side's use of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from .config import FinetuneConfig
from .tasks.base import task_for

log = logging.getLogger("hf_gpu_train.finetune")


@dataclass(frozen=True)
class AppliedPlan:
    plan: object  # launch.run_plan_file.RunPlan
    resolution: object  # launch.plan_resolution.Resolution
    memory: object | None  # launch.plan_resolution.MemoryCheck
    lines: tuple[str, ...]  # what the run says about it first
    here: object | None = None  # hardware.profile.HardwareProfile: this machine, detected once for the plan and the run
    launched_strategy: str | None = None  # what the launch runs (launch/launched_strategy.py), read before the values applied

    def record(self, measured_peak_bytes: int | None, measured_what: str | None) -> dict:
        from ..plan.run_plan import plan_record

        return plan_record(self.plan, self.resolution, self.memory, measured_peak_bytes, measured_what)


def apply_launch_plan(cfg: FinetuneConfig, explicit_keys: frozenset, environ=None, recipe=None,
                      command_line_keys: frozenset = frozenset(), here=None, overrides=()) -> tuple[FinetuneConfig, AppliedPlan | None]:
    """``explicit_keys``: what the recipe file or the command line set; they win over the plan, except that values
    `hf-gpu-train tune` measured for this very recipe win over the recipe file's (never over the command line).
    ``here``: this machine's profile (None: detected now); a plan made for other hardware keeps its machine values.
    ``overrides``: the command line's key=value (with ``recipe``, the job tuned values are scoped to)."""
    from ..launch.launched_strategy import launched_strategy
    from ..levers.from_config import planned_levers_that_hold, shape_levers
    from ..plan.machine_match import detect_this_machine, scope_to_this_machine, unset_planned_variables
    from ..plan.run_plan import (
        APPLIED_KEYS,
        apply_run_environment,
        check_memory,
        load_run_plan,
        override_lines,
        resolve_with_plan,
    )
    from ..plan.run_plan_file import data_stamps, tuned_keys_for
    from .plan_scope import scope_to_this_run, strategy_difference

    environ = os.environ if environ is None else environ
    plan = load_run_plan(environ)
    if plan is None:
        return cfg, None
    not_applied: dict[str, tuple[object, str]] = {}  # key -> (the plan's value, why the run does not use it)
    data = data_stamps(dataclasses.asdict(cfg))
    planned, other_recipe = _noting(not_applied, plan, *tuned_for_this_recipe(plan, recipe, overrides, data),
                                    "tuned for another recipe")
    here = detect_this_machine() if here is None else here
    # before its variables reach this process
    plan, other_machine = _noting(not_applied, planned, *scope_to_this_machine(planned, here), "made for another machine")
    if plan is not planned:
        other_machine += unset_planned_variables(planned, plan, environ)
    lines = [f"launch plan {plan.path} ({plan.source})", *other_machine, *apply_run_environment(plan, environ).lines(),
             *other_recipe]
    # what tune measured for this job and the plan still holds (a plan made for another machine holds none of it)
    tuned_here = frozenset(k for k in tuned_keys_for(plan, recipe, overrides, data) if plan.value(k) is not None)
    # memory values made for another model, a longer sequence, or another strategy than this launch runs: not applied
    # (values tuned for this recipe stay, unless the strategy differs)
    launched = launched_strategy(environ, on_cpu=not here.gpus)
    why = "made for another strategy" if strategy_difference(plan, launched) else "made for another model or shape"
    plan, scoped = _noting(not_applied, plan, *scope_to_this_run(plan, cfg, tuned_here, launched), why)
    tuned_here = frozenset(k for k in tuned_here if plan.value(k) is not None)  # measured under another strategy: gone
    lines += scoped
    if "precision" in tuned_here:
        plan, scoped = _tuned_precision_over_the_yamls(plan)
        lines += scoped
    tuned = (tuned_here - command_line_keys) & explicit_keys
    lines += [f"{key}={plan.value(key)} measured by hf-gpu-train tune for this recipe, over the recipe's {getattr(cfg, key)}"
              for key in sorted(tuned) if plan.value(key) != getattr(cfg, key)]
    resolution = resolve_with_plan(plan, {k: getattr(cfg, k) for k in APPLIED_KEYS}, explicit_keys - tuned)
    values = dict(resolution.values)
    if values.get("precision") == "fp8":  # the plan allows it; this entry point trains in bf16 at most
        values["precision"] = "bf16"
        lines.append("the plan's fp8 is not supported by scripts/finetune.py: bf16")
    from_plan = {k for k in APPLIED_KEYS if plan.value(k) is not None and k not in explicit_keys - tuned}
    world = plan.launched.num_processes or plan.num_processes or 1
    for key, planned_value, why in planned_levers_that_hold(values, from_plan, cfg, world):
        not_applied.setdefault(key, (planned_value, why))
    cfg = dataclasses.replace(cfg, **{k: values[k] for k in APPLIED_KEYS if k in values}).validate()
    lines += [f"plan value overridden: {line}" for line in override_lines(resolution.overridden)]
    overridden = {o.key for o in resolution.overridden}
    applied = [f"{k}={values[k]}" for k in APPLIED_KEYS if plan.value(k) is not None and k not in overridden
               and k not in not_applied]
    lines.append(f"plan values applied: {', '.join(applied) if applied else 'none'}")
    for o in resolution.overridden:
        if o.key in APPLIED_KEYS:
            not_applied.setdefault(o.key, (o.plan_value, {"config": "your config", "launch": "the launch command"}.get(
                o.source, f"your {o.source}")))
    lines.append("plan values not applied: " + (", ".join(f"{k}={v} ({why})" for k, (v, why) in not_applied.items()) or "none"))
    vision = task_for(cfg.task).images
    memory = check_memory(plan, values, seq_len=None if vision else cfg.max_length, image_size=cfg.image_size if vision else None,
                          method=cfg.method, lora_rank=cfg.lora_r, levers=shape_levers(cfg))
    if memory is not None and memory.warning:
        log.warning("hf_gpu_train: %s", memory.warning)
    return cfg, AppliedPlan(plan, resolution, memory, tuple(lines), here, launched)


def _noting(not_applied: dict, before, after, lines: list, why: str) -> tuple[object, list]:
    """(after, lines): ``before`` scoped by one rule, each value the rule took away or replaced noted with ``why``."""
    from ..plan.run_plan import APPLIED_KEYS

    for key in APPLIED_KEYS:
        if before.value(key) is not None and before.value(key) != after.value(key):
            not_applied.setdefault(key, (before.value(key), why))
    return after, lines


def tuned_for_this_recipe(plan, recipe, overrides=(), data=None) -> tuple[object, list[str]]:
    """Values `hf-gpu-train tune` measured are scoped to the job (recipe text and command line) they were measured for:
    any other job gets the plan as `hf-gpu-train config` wrote it, and one line says which values were left out and why."""
    from ..plan.run_plan_file import TUNED, job_overrides, plan_before_tune, tuned_keys_for

    measured = (plan.document or {}).get(TUNED)
    if not isinstance(measured, dict) or not measured.get("keys") or tuned_keys_for(plan, recipe, overrides, data):
        return plan, []
    measured_for = (measured.get("recipe") or {}).get("path") or "a run without a recipe file"
    keys = ", ".join(f"{k}={plan.value(k)}" for k in measured["keys"])

    def job(recipe_name, keyed) -> str:
        return f"{recipe_name}{''.join(f' {k}={v}' for k, v in keyed.items())}"

    before = plan_before_tune(plan)
    return before, [f"plan values hf-gpu-train tune measured for {job(measured_for, job_overrides(measured.get('overrides')))} "
                    f"not applied ({keys}): this run trains {job(recipe or 'no recipe file', job_overrides(overrides))}, so "
                    "the plan's values from before tune apply"]


def _tuned_precision_over_the_yamls(plan) -> tuple[object, list[str]]:
    """A precision tune measured for this recipe wins over NAME.yaml's own mixed_precision (which `accelerate launch`
    exports to every run, and which tune no longer rewrites): only a --mixed_precision other than the YAML's is the
    user's choice."""
    from ..plan.run_plan_file import LaunchedAs, plan_before_tune

    launched, yamls = plan.launched.mixed_precision, plan_before_tune(plan).value("precision")
    if launched is None or launched != yamls or launched == plan.value("precision"):
        return plan, []
    return dataclasses.replace(plan, launched=LaunchedAs(plan.launched.num_processes, None, plan.launched.gpu_ids)), [
        f"precision={plan.value('precision')} measured by hf-gpu-train tune for this recipe, over "
        f"{plan.config_file.name if plan.config_file else 'the YAML'}'s mixed_precision ({launched})"]


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
        return ("fsdp" if reshard else "fsdp-shard-grad-op") + ("-offload" if offload else "")
    if kind == "DEEPSPEED":
        plugin = state.deepspeed_plugin
        zero = (plugin.deepspeed_config or {}).get("zero_optimization") or {}
        device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
        return f"deepspeed-zero{plugin.zero_stage}" + ("-offload" if device not in ("none", "") else "")
    if kind == "NO":
        return "single"
    return "ddp" if kind.startswith("MULTI_") else None


def confirm_launched_strategy(applied: AppliedPlan | None, state) -> str | None:
    """The strategy the plan was scoped for was read from the launch's environment, before the Trainer existed; once
    its accelerator does, what it runs is compared with it. A line when they differ (the plan's memory values were kept
    or dropped for the wrong strategy), else None."""
    from ..launch.launched_strategy import same_strategy

    if applied is None or applied.launched_strategy is None:
        return None
    runs = strategy_of_state(state)
    if runs is None or same_strategy(applied.launched_strategy, runs):
        return None
    return (f"accelerate runs {runs}, not the {applied.launched_strategy} its launch environment named when the plan was "
            f"applied: the plan's memory values were kept or dropped for {applied.launched_strategy}; set this run's "
            "per_device_train_batch_size and gradient_checkpointing yourself, or launch with `hf-gpu-train launch "
            "--config-file NAME.yaml SCRIPT`")
