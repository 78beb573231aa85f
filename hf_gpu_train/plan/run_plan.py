"""The plan inside a training process: one small API, no torch import.

`hf-gpu-train config` writes NAME.plan.json beside NAME.yaml and NAME.env; a training process calls,
first thing (before torch.cuda, torch.distributed, Accelerator or TrainingArguments)::

    from hf_gpu_train.plan.run_plan import (load_run_plan, apply_run_environment, resolve_with_plan,
                                              check_memory, plan_record)

    plan = load_run_plan()                     # RunPlan | None; RunPlanError (exit 2) with the fix
    if plan is not None:
        report = apply_run_environment(plan)   # .env into os.environ (+ CPU binding); report.lines()
        values, overridden = resolve_with_plan(plan, user_values, explicit_keys)
        check = check_memory(plan, values, seq_len=..., image_size=...)   # check.warning when it will not fit
        ...
        summary["plan"] = plan_record(plan, resolution, check, measured_peak_bytes, "torch max_memory_reserved")

See each function's docstring; the module layout: ``run_plan_file`` (the file and its dataclasses),
``discovery`` (where the plan is), ``run_environment`` (environment and CPU binding),
``resolution`` (values, overrides, memory check, record).
"""

from __future__ import annotations

from .discovery import find_launcher, load_run_plan
from .resolution import MemoryCheck, Resolution, check_memory, memory_error_pct, override_lines, plan_record, resolve_with_plan
from .run_environment import EnvironmentReport, apply_run_environment, bind_process_cpus
from .run_plan_file import (
    APPLIED_KEYS,
    PLAN_ENV,
    LaunchedAs,
    Override,
    PlannedMemory,
    PlanValue,
    RunPlan,
    RunPlanError,
    read_run_plan,
)

__all__ = [
    "APPLIED_KEYS", "PLAN_ENV", "EnvironmentReport", "LaunchedAs", "MemoryCheck", "Override", "PlanValue", "PlannedMemory",
    "Resolution", "RunPlan", "RunPlanError", "apply_run_environment", "bind_process_cpus", "check_memory", "find_launcher",
    "load_run_plan", "memory_error_pct", "override_lines", "plan_record", "read_run_plan", "resolve_with_plan",
]
