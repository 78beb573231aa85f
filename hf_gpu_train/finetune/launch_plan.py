"""The launch plan inside ``scripts/finetune.py``: found, its environment applied, its values used unless the
recipe or the command line set them, overrides said, and an override the planner predicts will not fit warned
about with its numbers, all before torch is imported or a model loaded. ``hf_gpu_train.launch.run_plan`` holds
the pieces (no torch); this module is the fine-tuning side's use of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from .config import FinetuneConfig

log = logging.getLogger("hf_gpu_train.finetune")


@dataclass(frozen=True)
class AppliedPlan:
    plan: object  # launch.run_plan_file.RunPlan
    resolution: object  # launch.plan_resolution.Resolution
    memory: object | None  # launch.plan_resolution.MemoryCheck
    lines: tuple[str, ...]  # what the run says about it first
    here: object | None = None  # hardware.profile.HardwareProfile: this machine, detected once for the plan and the run

    def record(self, measured_peak_bytes: int | None, measured_what: str | None) -> dict:
        from ..launch.run_plan import plan_record

        return plan_record(self.plan, self.resolution, self.memory, measured_peak_bytes, measured_what)


def apply_launch_plan(cfg: FinetuneConfig, explicit_keys: frozenset, environ=None, recipe=None,
                      command_line_keys: frozenset = frozenset(), here=None, overrides=()) -> tuple[FinetuneConfig, AppliedPlan | None]:
    """``explicit_keys``: what the recipe file or the command line set; they win over the plan, except that values
    `hf-gpu-train tune` measured for this very recipe win over the recipe file's (never over the command line).
    ``here``: this machine's profile (None: detected now); a plan made for other hardware keeps its machine values.
    ``overrides``: the command line's key=value (with ``recipe``, the job tuned values are scoped to)."""
    from ..launch.machine_match import detect_this_machine, scope_to_this_machine, unset_planned_variables
    from ..launch.run_plan import (
        APPLIED_KEYS,
        apply_run_environment,
        check_memory,
        load_run_plan,
        override_lines,
        resolve_with_plan,
    )
    from ..launch.run_plan_file import data_stamps, tuned_keys_for
    from .memory_levers import planned_levers_that_hold, shape_levers
    from .plan_scope import scope_to_this_run

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
    # memory values made for another model, or a longer sequence: not applied (values tuned for this recipe stay)
    plan, scoped = _noting(not_applied, plan, *scope_to_this_run(plan, cfg, tuned_here), "made for another model or shape")
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
    vision = cfg.task == "image-classification"
    memory = check_memory(plan, values, seq_len=None if vision else cfg.max_length, image_size=cfg.image_size if vision else None,
                          method=cfg.method, lora_rank=cfg.lora_r, levers=shape_levers(cfg))
    if memory is not None and memory.warning:
        log.warning("hf_gpu_train: %s", memory.warning)
    return cfg, AppliedPlan(plan, resolution, memory, tuple(lines), here)


def _noting(not_applied: dict, before, after, lines: list, why: str) -> tuple[object, list]:
    """(after, lines): ``before`` scoped by one rule, each value the rule took away or replaced noted with ``why``."""
    from ..launch.run_plan import APPLIED_KEYS

    for key in APPLIED_KEYS:
        if before.value(key) is not None and before.value(key) != after.value(key):
            not_applied.setdefault(key, (before.value(key), why))
    return after, lines


def tuned_for_this_recipe(plan, recipe, overrides=(), data=None) -> tuple[object, list[str]]:
    """Values `hf-gpu-train tune` measured are scoped to the job (recipe text and command line) they were measured for:
    any other job gets the plan as `hf-gpu-train config` wrote it, and one line says which values were left out and why."""
    from ..launch.run_plan_file import TUNED, job_overrides, plan_before_tune, tuned_keys_for

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
    from ..launch.run_plan_file import LaunchedAs, plan_before_tune

    launched, yamls = plan.launched.mixed_precision, plan_before_tune(plan).value("precision")
    if launched is None or launched != yamls or launched == plan.value("precision"):
        return plan, []
    return dataclasses.replace(plan, launched=LaunchedAs(plan.launched.num_processes, None, plan.launched.gpu_ids)), [
        f"precision={plan.value('precision')} measured by hf-gpu-train tune for this recipe, over "
        f"{plan.config_file.name if plan.config_file else 'the YAML'}'s mixed_precision ({launched})"]
