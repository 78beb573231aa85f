"""Everything `hf-gpu-train tune` knows before any trial: the launch config and its plan, the recipe and its
overrides, the processes, the candidate space and the cache key. No torch: the CLI builds it in a fraction of a
second, and ``--machine`` / ``--dry-run`` stop here.

Which keys are tuned: every axis except the keys set on the tune command line (``key=value`` after the recipe),
which the user fixed. The recipe's own values are where the search starts when the plan has none.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UsageError
from ..finetune.loading import load_config_and_keys, read_config_values
from ..finetune.plan_scope import scope_to_this_run
from ..finetune.run import parse_args
from ..finetune.tasks.base import task_for
from ..hardware.detect import detect
from ..levers.from_config import shape_levers
from ..plan.decisions import accelerate_uses_cpu
from ..plan.machine_match import detect_this_machine
from ..plan.memory import usable_bytes
from ..plan.resolution import check_memory, resolve_with_plan
from ..plan.run_plan_file import APPLIED_KEYS, plan_before_tune, plan_path_for, read_run_plan
from ..plan.scope import scope_to_this_machine
from . import hooks
from .cache import cache_key, job_identity, machine_fingerprint, software_fingerprint
from .candidates import DEFAULT_AXES, CandidateSpace, TuneInputs, plan_space
from .strategies import own_strategy, parse_strategies, shards


class TuneError(UsageError):
    """A tune command that cannot run as given: names the value and the fix."""


@dataclass(frozen=True)
class TuneJob:
    config_file: Path
    plan: object  # launch.run_plan_file.RunPlan
    recipe: str | None
    overrides: tuple[str, ...]
    recipe_keys: frozenset[str]  # keys the recipe file sets
    fixed: frozenset[str]  # keys set on the tune command line
    values: Mapping[str, object]  # every FinetuneConfig value, with the plan's applied
    world_size: int
    space: CandidateSpace
    cache_key: str
    identity: Mapping[str, object]
    machine: str
    notes: tuple[str, ...] = ()  # plan values this job does not start from, and why
    own_strategy: str = "single"  # the strategy the config launches, in the planner's words
    strategies: tuple[str, ...] = ()  # --strategies: the others the strategy round measures, in order (strategies.py)
    shape: Mapping[str, object] = dataclasses.field(default_factory=dict)  # what the memory check needs beside the values

    @property
    def searches(self) -> bool:
        """Whether the search runs (trials of one shared model: DDP or one process), or only the strategy round."""
        return not shards(self.own_strategy)

    def memory_check(self, candidate_values: Mapping[str, object], strategy: str | None = None):
        """The planner's check of these values (``plan.resolution.check_memory``) under the config's strategy, or under
        ``strategy`` (the memory planner's name: ddp, fsdp-shard-grad-op, deepspeed-zero3, ...); None without a memory
        plan."""
        return _memory_check(self.plan, self.values, self.world_size, self.shape, candidate_values, strategy)


def _memory_check(plan, values: Mapping[str, object], world: int, shape: Mapping[str, object],
                  candidate_values: Mapping[str, object], strategy: str | None = None):
    if plan.memory is None:
        return None
    if strategy is not None:
        plan = replace(plan, memory=replace(plan.memory, strategy=strategy))
    merged = {**values, **candidate_values}
    return check_memory(plan, merged, world_size=world, levers=shape_levers(merged), **shape)


def parse_script_args(script: str, script_args: list[str]) -> tuple[str | None, list[str]]:
    """``--config recipe.yaml key=value ...`` of scripts/finetune.py (or ``-m hf_gpu_train.finetune``, the same run)."""

    if Path(script).name != "finetune.py" and script not in ("hf_gpu_train.finetune", "hf_gpu_train.finetune.run"):
        raise TuneError(f"{script}: tune measures hf_gpu_train's fine-tuning (scripts/finetune.py and its recipe); for "
                        "another training script, tune the same recipe through scripts/finetune.py")
    try:
        return parse_args(script_args)
    except SystemExit:
        raise TuneError(f"the arguments after {script} are scripts/finetune.py's: --config RECIPE.yaml key=value ...") from None


def world_size_of(plan, launch_settings: Mapping[str, object]) -> int:
    raw = launch_settings.get("num_processes") or plan.num_processes or 1
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise TuneError(f"--num_processes {raw}: give a whole number") from None


def _on_cuda(plan, profile) -> bool:

    if profile is not None:
        return bool(profile.gpus)
    return plan.gpu_ids is not None and not accelerate_uses_cpu({name: value for name, value, _ in plan.environment})


def _for_machine(plan, profile):
    """The plan with its memory model moved to a snapshot's GPU (a dry plan for another machine)."""

    if plan.memory is None or not profile.gpus:
        return plan
    device = min(g.memory_total_bytes for g in profile.gpus)
    return replace(plan, memory=replace(plan.memory, device_memory_bytes=device, usable_bytes=int(usable_bytes(device))))


def load_job(config_file: str, script: str, script_args: list[str], launch_settings: Mapping[str, object],
             axes: tuple[str, ...] = DEFAULT_AXES, profile=None, environ: Mapping[str, str] | None = None,
             memory_budget_bytes: int | None = None, strategies: str | None = None) -> TuneJob:
    """Read and check everything; ``profile``: a snapshot for a dry plan (None: this machine, detected);
    ``memory_budget_bytes``: a candidate fits only when its measured peak stays under it (--memory-budget-gib);
    ``strategies``: --strategies as given (None: the config's own strategy only)."""

    environ = os.environ if environ is None else environ
    if hooks.problem(environ):
        raise TuneError(hooks.problem(environ))
    path = Path(config_file)
    if not path.is_file():
        raise TuneError(f"--config-file {path} does not exist: write one with `hf-gpu-train config --output ...`")
    if not plan_path_for(path).is_file():
        raise TuneError(f"{plan_path_for(path)} does not exist: tune writes its winner into the plan beside {path.name}; "
                        "regenerate the config with `hf-gpu-train config --output ...`")
    plan = plan_before_tune(read_run_plan(plan_path_for(path), "hf-gpu-train tune"))
    if plan.num_machines > 1:
        raise TuneError(f"{path.name} launches {plan.num_machines} machines: tune on one (a config written with "
                        "--num-machines 1 for the same GPUs) and use its plan's values on every node")
    own = own_strategy(plan)
    others = parse_strategies(strategies, own, world_size_of(plan, launch_settings), path.name)
    if shards(own) and not others:
        # trials share one loaded model: a model FSDP already sharded keeps the first trial's wrapping and precision,
        # and the OOM recovery (which keeps a trial's ranks together) steps aside under FSDP and DeepSpeed
        raise TuneError(f"{path.name} shards the model ({plan.strategy.value}): tune searches with trials on one shared model "
                        "with DDP or one process; tune a DDP config of the same GPUs (`hf-gpu-train config --strategy ddp`), "
                        "then use its micro-batch in the sharded run, or measure this strategy against others at the plan's "
                        "values, one launch each, with --strategies (e.g. --strategies ddp,deepspeed-zero2)")
    if shards(own):
        axes = ()  # one launch of this config measures one trial: the strategy round only
    recipe, overrides = parse_script_args(script, script_args)
    cfg, explicit = load_config_and_keys(recipe, overrides)
    plan, scoped = _scoped_to_this_job(plan, cfg, profile)
    recipe_keys = frozenset(read_config_values(recipe, ())) if recipe else frozenset()
    fixed = frozenset(read_config_values(None, overrides))
    world = world_size_of(plan, launch_settings)
    if profile is not None:
        plan = _for_machine(plan, profile)
    run_values = cfg.values()
    resolution = resolve_with_plan(plan, {k: run_values[k] for k in APPLIED_KEYS if k in run_values}, explicit,
                                   world_size=world)
    values = {**run_values, **{k: v for k, v in resolution.values.items() if k in run_values}}
    task = task_for(cfg.task)
    planner = task.planner_input(cfg)
    shape = {"seq_len": planner.seq_len, "image_size": planner.image_size, "method": cfg.method, "lora_rank": planner.lora_rank}

    def memory_check(candidate_values: dict):
        return _memory_check(plan, values, world, shape, candidate_values)

    planned_micro = None if "per_device_train_batch_size" in fixed else plan.value("per_device_train_batch_size")
    inputs = TuneInputs(values=values, fixed=fixed, task=cfg.task, world_size=world, on_cuda=_on_cuda(plan, profile),
                        layered=task.layered, memory_budget_bytes=memory_budget_bytes,
                        planned_micro_batch=planned_micro, planned_workers=plan.value("dataloader_num_workers"), axes=axes)
    space = plan_space(inputs, memory_check if plan.memory is not None else None)
    if shards(own):
        space = replace(space, notes=(f"{own} shards the model: no search (its trials would share one wrapped model); the "
                                      "strategy round measures the plan's values under each strategy, one launch each",))
    if profile is None:

        profile = detect()
    identity = job_identity(values)
    key = cache_key({"machine": machine_fingerprint(profile), "software": software_fingerprint(),
                     "launch": {"world_size": world, "gpu_ids": launch_settings.get("gpu_ids") or plan.gpu_ids,
                                "environment": sorted((k, v) for k, v, _ in plan.environment)},
                     "job": identity, "effective_batch": space.effective_batch,
                     "test": hooks.cache_key_part(environ)})  # a trial hook and its settings ({} without one)
    return TuneJob(config_file=path, plan=plan, recipe=recipe, overrides=tuple(overrides), recipe_keys=recipe_keys, fixed=fixed,
                   values=values, world_size=world, space=space, cache_key=key, identity=identity,
                   machine=profile.name or profile.host.hostname, notes=tuple(scoped), own_strategy=own, strategies=others,
                   shape=shape)


def _scoped_to_this_job(plan, cfg, profile):
    """The plan as the run tune measures would apply it: without machine values made for other hardware, and
    without memory values made for another model or a shorter sequence (tune would start from them, and record them
    as measured)."""

    plan, on_another_machine = scope_to_this_machine(plan, profile if profile is not None else detect_this_machine())
    plan, for_another_run = scope_to_this_run(plan, cfg)
    return plan, [*on_another_machine, *for_another_run]


def recipe_wins(job: TuneJob, keys: tuple[str, ...]) -> list[str]:
    """Tuned keys that the recipe file sets itself: at launch the tuned values win over them while the recipe's text is
    unchanged (``run_plan_file.tuned_keys_for``); the command line's key=value always wins."""
    return sorted(k for k in keys if k in job.recipe_keys and k not in job.fixed)
