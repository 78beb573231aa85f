"""This run's fingerprint, in the words of the plan's (``plan/scope.py``): the machine it is on, the model, shape and
method its config trains, the strategy its launch runs, and the job (recipe, command line, data) tune would know it
by. Built once, before torch is imported, and compared once with what the plan was made for.

`hf-gpu-train config --model X` plans the micro-batch, the global batch and checkpointing for X at X's sequence
length (or image size) and method. A launch config serves many recipes, so a run often trains something else: then
those values are not applied (the recipe's own are kept), the run says which and why in one line, and the memory
check speaks about the model this run trains, not the plan's. Machine-derived values (precision, NCCL, threads)
still apply: they belong to the machine, not the model.
"""

from __future__ import annotations

from ..plan.model_spec import resolve_model
from ..plan.run_plan_file import Job, data_stamps
from ..plan.scope import Fingerprint, ModelId, Shape, canonical_name, hardware_record, plan_fingerprint, scope
from .config import FinetuneConfig
from .tasks.base import PlannerInput, task_for

OPTIMIZER = "adamw"  # scripts/finetune.py trains with AdamW (two fp32 moments per parameter)


def run_model_spec(cfg: FinetuneConfig):
    """The planner's spec of the model this run trains (its config on the meta device; timm's census), or None with
    the reason when it cannot be read here. Best effort: whatever goes wrong reading it is said, never raised."""

    name, why_not = task_for(cfg.task).planner_model_here(cfg)
    if name is None:
        return None, why_not
    try:
        return resolve_model(name, task_for(cfg.task).planner_input(cfg).image_size), None
    except Exception as error:  # noqa: BLE001 (any model's own code runs here; the run must not die of a check)
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _model(cfg: FinetuneConfig, planned: Fingerprint, shape: PlannerInput) -> ModelId:
    """The model this run trains; its config is read (slow) only where the plan's memory values were made for another
    name, or, for an image model, at another image size (timm's activations are measured at one)."""
    canonical = canonical_name(cfg.model)
    p = planned.model
    if p is None or (p.canonical == canonical and not (shape.image_size and shape.image_size != planned.shape.image_size)):
        return ModelId(cfg.model, canonical)
    spec, why_not = run_model_spec(cfg)
    return ModelId(cfg.model, canonical, spec, why_not)


def run_fingerprint(cfg: FinetuneConfig, planned: Fingerprint, here=None, strategy: str | None = None, recipe=None,
                    overrides=None) -> Fingerprint:
    """What this run is, for comparing with ``planned`` (``plan_fingerprint``). ``here``: this machine's profile,
    ``strategy``: what its launch runs (``launch.launched_strategy``), ``recipe`` and ``overrides``: its job; each None:
    that dimension is not compared."""
    shape = task_for(cfg.task).planner_input(cfg)
    job = None if overrides is None else Job.of_run(recipe, overrides, data_stamps(cfg.values()))
    return Fingerprint(machine=None if here is None else hardware_record(here), model=_model(cfg, planned, shape),
                       shape=Shape(shape.seq_len, shape.image_size, OPTIMIZER, cfg.precision),
                       method=shape.method, strategy=strategy, recipe=job)


def scope_to_this_run(plan, cfg: FinetuneConfig):
    """(plan, lines): the plan without the memory values made for another model, a longer sequence, a larger image or
    a heavier method than ``cfg``'s, its memory plan re-pointed at what ``cfg`` trains (tune starts from it)."""
    scoped = scope(plan, run_fingerprint(cfg, plan_fingerprint(plan)))
    return scoped.plan, list(scoped.lines["run"])
