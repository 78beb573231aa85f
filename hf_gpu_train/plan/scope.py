"""What a plan's values were made for, against what this run is: one fingerprint each, compared once.

A plan is made for a machine, a model at a shape (a sequence length or an image size, and the optimizer and precision
its memory plan counts), a method and a strategy; `hf-gpu-train tune` measures values for one job (a recipe, its
command line, its data). A value is applied to nothing else without the run saying so. Each dimension that differs
takes away its own values, with its line:

    recipe               values tuned for another job (the plan's own from before tune apply instead)
    machine              every value (precision and workers are the machine's, the memory values its GPU's), its
                         variables, CPU binding and GPU ids
    model, shape, method the memory values, only where this run needs more than they were made for (values tuned
                         for this job stay: they were measured on what it trains)
    strategy             the memory values, tuned ones included (tune measured under the plan's strategy)

NAME.plan.json records each dimension where it always has: ``hardware`` (``hardware_record``),
``memory.planned_for`` (model fingerprint, sequence length, image size, optimizer, precision, method),
``memory.strategy`` (``strategy`` without a memory plan) and ``tuned`` (tune's job); ``plan_fingerprint`` reads them
into one ``Fingerprint``, and names the dimensions a plan written by an older hf-gpu-train does not record. No torch
here, nothing from finetune/: the run builds its own fingerprint (finetune/plan_scope.py) and calls ``scope``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..builtin_models import minilm_path
from ..hardware.profile import HardwareProfile
from .memory import usable_bytes
from .model_spec import BUILTIN_MODELS, ModelSpec, model_fingerprint
from .run_plan_file import APPLIED_KEYS, TUNED, Job, LaunchedAs, RunPlan, job_overrides, plan_before_tune
from .strategies import CPU_STRATEGIES, DEEPSPEED, FSDP, REPLICATED, STRATEGIES, family_of

# every value a run applies depends on the machine (precision and workers directly, the memory-derived ones on its GPU)
MACHINE_VALUES = APPLIED_KEYS
# the values a memory plan (or tune) decides for one model, sequence length, method and strategy
MEMORY_KEYS = ("per_device_train_batch_size", "global_batch_size", "gradient_checkpointing", "torch_compile", "packing",
               "chunked_lm_loss", "checkpoint_layers", "offload_activations", "optimizer_in_backward")
RUN_DIMENSIONS = ("model", "shape", "method")  # one line between them
HEAVIER = {"qlora": 0, "lora": 1, "full": 2}


@dataclass(frozen=True)
class ModelId:
    name: str  # as the plan records it, or as the run's config names it
    canonical: str  # ``canonical_name``: one name per model
    spec: ModelSpec | None = None  # the run's: read only where its name or image size is not the plan's
    unreadable: str | None = None  # the run's: why its config cannot be read here


@dataclass(frozen=True)
class Shape:
    seq_len: int | None  # the run's: None for an image task
    image_size: int | None  # the run's: None for a text task
    optimizer: str | None
    precision: str | None


@dataclass(frozen=True)
class Fingerprint:
    """What a plan was made for, or what a run is. A run's None: not compared (not known to the caller)."""

    machine: Mapping | None = None  # hardware_record
    model: ModelId | None = None
    shape: Shape | None = None
    method: str | None = None
    strategy: str | None = None
    recipe: Job | None = None  # run_plan_file.Job; the plan's: None when tune measured nothing
    missing: frozenset[str] = frozenset()  # the plan's: dimensions an older hf-gpu-train did not record


@dataclass(frozen=True)
class Difference:
    dimension: str  # machine | model | shape | method | strategy | recipe
    what: str  # in the run's line, e.g. "sequence length 128 -> 2048"
    planned: object = None
    run: object = None


@dataclass(frozen=True)
class Scoped:
    """The plan as this run may apply it, and what the run says about it."""

    plan: RunPlan
    differences: tuple[Difference, ...]
    lines: Mapping[str, tuple[str, ...]]  # by rule: "recipe", "machine", "run" (model, shape, method, strategy), "tuned"
    not_applied: Mapping[str, tuple[object, str]]  # key -> (the plan's value, why), in the order the rules took them
    tuned: frozenset[str] = frozenset()  # values tune measured for this very job that still apply

    def differs(self, dimension: str) -> bool:
        return any(d.dimension == dimension for d in self.differences)


# environment variables the planner derives from the machine (threads from its cores, NCCL from its topology,
# devices from its GPUs); the others (ACCELERATE_USE_CPU, NCCL_DEBUG, ...) follow the launch config, not the box
MACHINE_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE",
                     "NCCL_IB_DISABLE")
MEMORY_TOLERANCE = 0.03  # drivers and ECC modes report a few percent apart for the same model


def hardware_record(profile: HardwareProfile, used=None) -> dict:
    """What NAME.plan.json records of the machine it was planned for: every GPU, the GPUs the plan uses (``used``:
    GpuInfo, None: all), and the CPU cores."""
    def gpus(items):
        return [{"name": g.name, "memory_bytes": g.memory_total_bytes} for g in items]

    return {"gpus": gpus(profile.gpus), "used": gpus(profile.gpus if used is None else used),
            "cpu_cores": profile.host.logical_cores}


def _gpus_text(gpus: list[tuple[str, int]]) -> str:
    if not gpus:
        return "no GPU"
    counts = Counter(gpus)
    return " + ".join(f"{n}x {name} ({memory / 2**30:.0f} GiB)" for (name, memory), n in counts.items())


def _same_model(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return a[0] == b[0] and abs(a[1] - b[1]) <= MEMORY_TOLERANCE * max(a[1], b[1], 1)


def _holds(ours: list[tuple[str, int]], needed: list[tuple[str, int]]) -> bool:
    """Whether this machine's GPUs include one of the same model for every GPU the plan uses."""
    free = list(ours)
    for gpu in needed:
        match = next((i for i, g in enumerate(free) if _same_model(g, gpu)), None)
        if match is None:
            return False
        free.pop(match)
    return True


def differences(recorded: Mapping, here: HardwareProfile | Mapping) -> list[str]:
    """What differs between the machine a plan records and this one (its profile or its ``hardware_record``; []: it
    holds here). This machine matches when it has a GPU of the same model for every GPU the plan uses: a scheduler or a
    container that shows a job only its own GPUs (Slurm's ConstrainDevices, docker --gpus) is still the machine the
    plan was made for."""
    def pairs(items):
        return [(str(g.get("name")), int(g.get("memory_bytes") or 0)) for g in items or ()]

    here = here if isinstance(here, Mapping) else hardware_record(here)
    found = []
    whole, used = pairs(recorded.get("gpus")), pairs(recorded.get("used", recorded.get("gpus")))
    ours = pairs(here.get("gpus"))
    if not _holds(ours, used) or (not whole and ours):
        found.append(f"GPUs {_gpus_text(used if used else whole)} -> {_gpus_text(ours)}")
    cores, our_cores = recorded.get("cpu_cores"), here.get("cpu_cores")
    if cores and our_cores and int(cores) != our_cores:
        found.append(f"CPU cores {cores} -> {our_cores}")
    return found


def canonical_name(name: str) -> str:
    """One name per model: the builtin names as the planner resolves them, timm names with their prefix, local
    directories as absolute paths."""
    if name == "builtin:minilm":

        name = minilm_path()
    name = BUILTIN_MODELS.get(name, name)
    return str(Path(name).resolve()) if Path(name).exists() else name


def planned_strategy(strategy: str | None) -> str | None:
    """A plan's strategy in the words of ``launch.launched_strategy`` (the CPU plans' cpu, cpu-ddp, cpu-fsdp)."""
    row = CPU_STRATEGIES.get(strategy or "")
    return row.launched_as if row is not None else strategy


def same_strategy(planned: str | None, launched: str | None) -> bool:
    """Whether values sized for ``planned`` hold for ``launched`` (unknown: they do; single and ddp alike: one process
    of a DDP plan is not another strategy, the whole model is on every process)."""
    planned = planned_strategy(planned)
    if planned is None or launched is None:
        return True
    return planned == launched or family_of(planned) == family_of(launched) == REPLICATED


def why_launched(launched: str, planned: str) -> str:
    """What in the launch made it ``launched`` instead of ``planned``, for the run's one line."""
    planned_family, launched_family = family_of(planned_strategy(planned)), family_of(launched)
    if planned_family == FSDP and launched_family != FSDP:
        return "accelerate was launched without ACCELERATE_USE_FSDP"
    if planned_family == DEEPSPEED and launched_family != DEEPSPEED:
        return ("accelerate was launched without ACCELERATE_USE_DEEPSPEED" if launched_family == REPLICATED
                else "accelerate was launched for FSDP")
    return "the launch's FSDP or DeepSpeed settings are not the plan's"


def plan_fingerprint(plan: RunPlan) -> Fingerprint:
    """What the plan was made for, read from where NAME.plan.json records each dimension (any version of it)."""
    doc, m = plan.document or {}, plan.memory
    tuned = doc.get(TUNED)
    missing = set()
    if plan.document is not None and not isinstance(doc.get("hardware"), Mapping):
        missing.add("machine")
    if plan.document is not None and m is not None and not ((doc.get("memory") or {}).get("planned_for") or {}).get("fingerprint"):
        missing.add("model")
    return Fingerprint(
        machine=doc.get("hardware") if isinstance(doc.get("hardware"), Mapping) else None,
        model=None if m is None else ModelId(m.model.name, canonical_name(m.model.name), m.model),
        shape=None if m is None else Shape(m.seq_len, m.image_size, m.optimizer, m.precision),
        method=None if m is None else m.method, strategy=m.strategy if m is not None else plan.strategy.value,
        recipe=Job.measured(tuned) if isinstance(tuned, Mapping) and tuned.get("keys") else None,
        missing=frozenset(missing))


def _count(value) -> str:
    if isinstance(value, int) and value >= 10**9:
        return f"{value / 1e9:.1f}B"
    if isinstance(value, int) and value >= 10**6:
        return f"{value / 1e6:.1f}M"
    return str(value)


def _run_differences(planned: Fingerprint, run: Fingerprint) -> list[Difference]:
    """Where this run needs more than the plan's memory values were made for. A run that needs less (a shorter
    sequence, a smaller image, LoRA where the plan was for full fine-tuning) keeps them: the plan's micro-batch is a
    bound that still fits."""
    found = []
    p, r = planned.model, run.model
    if p is not None and r is not None and p.canonical != r.canonical:
        if r.spec is None:
            found.append(Difference("model", f"model {p.name} -> {r.name} (its config cannot be read here: {r.unreadable})"))
        elif model_fingerprint(p.spec) != model_fingerprint(r.spec):
            ours, theirs = model_fingerprint(r.spec), model_fingerprint(p.spec)
            detail = ", ".join(f"{k} {_count(theirs[k])} -> {_count(ours[k])}" for k in ours if ours[k] != theirs[k])
            found.append(Difference("model", f"model {p.name} -> {r.name} ({detail})"))
    ps, rs = planned.shape, run.shape
    if ps is not None and rs is not None:
        if rs.image_size and ps.image_size and rs.image_size > ps.image_size:
            found.append(Difference("shape", f"image size {ps.image_size} -> {rs.image_size}"))
        if rs.seq_len and ps.seq_len and rs.seq_len > ps.seq_len:
            found.append(Difference("shape", f"sequence length {ps.seq_len} -> {rs.seq_len}"))
    if planned.method is not None and run.method is not None and HEAVIER.get(run.method, 2) > HEAVIER.get(planned.method, 2):
        found.append(Difference("method", f"method {planned.method} -> {run.method}"))
    if ps is not None and rs is not None:
        if rs.optimizer is not None and ps.optimizer != rs.optimizer:
            found.append(Difference("shape", f"optimizer {ps.optimizer} -> {rs.optimizer}"))
        if rs.precision == "fp32" and ps.precision in ("bf16", "fp16"):  # activations at twice the bytes
            found.append(Difference("shape", f"precision {ps.precision} -> fp32"))
    return found


def compare(planned: Fingerprint, run: Fingerprint) -> tuple[Difference, ...]:
    """Every dimension in which ``run`` is not what the plan was made for (a dimension the run leaves None, or the
    plan does not record, is not compared)."""
    found = []
    if planned.recipe is not None and run.recipe is not None and not planned.recipe.measures(run.recipe):
        found.append(Difference("recipe", "recipe", planned.recipe, run.recipe))
    if planned.machine is not None and run.machine is not None:
        found += [Difference("machine", what) for what in differences(planned.machine, run.machine)]
    if "model" not in planned.missing:
        found += _run_differences(planned, run)
    if not same_strategy(planned.strategy, run.strategy):
        found.append(Difference("strategy", f"strategy {planned.strategy} -> {run.strategy}",
                                planned_strategy(planned.strategy), run.strategy))
    return tuple(found)


@dataclass
class _Draft:
    """The plan's values as the rules leave them: the plan is rewritten from it once, at the end."""

    plan: RunPlan
    values: dict = field(default_factory=dict)
    memory: object = None
    launched: LaunchedAs | None = None
    other_machine: bool = False
    not_applied: dict = field(default_factory=dict)

    def value(self, key: str) -> object:
        item = self.values.get(key)
        return None if item is None else item.value

    def set_values(self, values: Mapping, why: str) -> None:
        """``values`` from now on; each value they take away or replace noted with ``why``."""
        for key in APPLIED_KEYS:
            if self.value(key) is not None and self.value(key) != (values[key].value if key in values else None):
                self.not_applied.setdefault(key, (self.value(key), why))
        self.values = dict(values)

    def rewritten(self) -> RunPlan:
        plan = self.plan
        if (self.values, self.memory, self.launched, self.other_machine) == (dict(plan.values), plan.memory, plan.launched, False):
            return plan
        machine = {} if not self.other_machine else {
            "environment": _machine_free_environment(plan), "cpu_binding": None, "gpu_ids": None, "mig_instance": None}
        return dataclasses.replace(plan, values=self.values, memory=self.memory, launched=self.launched, **machine)


def _planned_variables(plan: RunPlan) -> dict[str, str]:
    """The machine variables as the planner wrote them (NAME.env edited to another value is the user's: it stays)."""
    return {e["name"]: str(e["value"]) for e in (plan.document or {}).get("environment", ()) if e.get("name") in MACHINE_VARIABLES}


def _machine_free_environment(plan: RunPlan) -> tuple:
    planned = _planned_variables(plan)
    return tuple(e for e in plan.environment if planned.get(e[0]) != e[1])


def _memory_here(memory, here: HardwareProfile | None):
    """The plan's memory plan checked against this machine's GPU (its smallest free memory); None without a GPU."""
    if memory is None or here is None or not here.gpus:
        return None
    free = min(g.memory_free_bytes for g in here.gpus)
    return dataclasses.replace(memory, device_memory_bytes=free, usable_bytes=int(usable_bytes(free)), per="GPU",
                               global_batch_target=None)


def _other_recipe(draft: _Draft, run: Job) -> list[str]:
    plan = draft.plan
    measured = plan.document[TUNED]
    measured_for = (measured.get("recipe") or {}).get("path") or "a run without a recipe file"
    keys = ", ".join(f"{k}={plan.value(k)}" for k in measured["keys"])

    def job(recipe_name, keyed) -> str:
        return f"{recipe_name}{''.join(f' {k}={v}' for k, v in keyed.items())}"

    draft.set_values(plan_before_tune(plan).values, "tuned for another recipe")
    return [f"plan values hf-gpu-train tune measured for {job(measured_for, job_overrides(measured.get('overrides')))} "
            f"not applied ({keys}): this run trains {job(run.named or 'no recipe file', run.overrides)}, so the plan's values "
            "from before tune apply"]


def _other_machine(draft: _Draft, found: list[str], here: HardwareProfile | None) -> list[str]:
    plan = draft.plan
    dropped = [f"{k}={draft.value(k)}" for k in MACHINE_VALUES if draft.value(k) is not None]
    kept = set(_machine_free_environment(plan))
    dropped += [f"{k}={v}" for k, v, r in plan.environment if (k, v, r) not in kept]
    if plan.cpu_binding is not None and plan.cpu_binding.cpus_by_process:
        dropped.append("CPU binding")
    draft.set_values({k: v for k, v in draft.values.items() if k not in MACHINE_VALUES}, "made for another machine")
    draft.memory, draft.other_machine = _memory_here(draft.memory, here), True
    yaml = plan.config_file.name if plan.config_file else "the launch config"
    return [f"plan made for another machine ({plan.machine}: {'; '.join(found)}): its machine values not applied "
            f"({', '.join(dropped) or 'none decided'}); the recipe's values and this machine's defaults apply "
            f"({yaml}'s own num_processes and gpu_ids reach accelerate as they are). Plan this machine with "
            "`hf-gpu-train config --output ...` here"]


def _repointed(memory, planned: Fingerprint, run: Fingerprint):
    """The memory plan re-pointed at this run's model and shape, so the memory check estimates what really trains
    (None: this run's model cannot be read here)."""
    same_name = run.model is None or run.model.canonical == planned.model.canonical
    spec = None if run.model is None else run.model.spec
    shape = run.shape or Shape(None, None, None, None)
    image_size = shape.image_size or memory.image_size
    if spec is None and not (same_name and image_size == memory.image_size):
        return None
    return dataclasses.replace(memory, model=spec or memory.model, method=run.method or memory.method, global_batch_target=None,
                               seq_len=shape.seq_len or memory.seq_len, image_size=image_size)


def _other_run(draft: _Draft, found: tuple[Difference, ...], planned: Fingerprint, run: Fingerprint, keep: frozenset) -> list[str]:
    """Memory values made for another model, a longer sequence, a heavier method or another strategy than this run's:
    not applied (values tuned for this job stay, unless the strategy differs)."""
    strategy = next(((d.planned, d.run) for d in found if d.dimension == "strategy"), None)
    why = [d.what for d in found if d.dimension in RUN_DIMENSIONS]
    memory = draft.memory
    if memory is not None and "model" in planned.missing and run.model is not None:
        why, memory = [f"{draft.plan.path.name} records no fingerprint of the model they were made for (an older "
                       f"hf-gpu-train): regenerate it with `{draft.plan.command}`"], None
    elif memory is None or not why:
        why = []
    elif why:
        memory = _repointed(memory, planned, run)
    if not why and strategy is None:
        return []
    if strategy is not None and memory is not None:
        memory = dataclasses.replace(memory, strategy=strategy[1]) if strategy[1] in STRATEGIES else None
    return _without_memory_values(draft, memory, why, frozenset() if strategy else keep, strategy)


def _without_memory_values(draft: _Draft, memory, why: list[str], keep: frozenset, strategy: tuple[str, str] | None) -> list[str]:
    """The plan without its memory-derived values (but ``keep``: measured for this run), ``memory`` as its memory
    plan, and the line that says so (``strategy``: (planned, launched) when the run was launched with another)."""
    dropped = [k for k in MEMORY_KEYS if draft.value(k) is not None and k not in keep]
    checked = "" if memory is not None else "; memory not checked"
    if strategy is not None:
        planned, launched = strategy
        if draft.value("gradient_accumulation_steps") is not None:
            dropped.append("gradient_accumulation_steps")
        shown = ", ".join(f"{k}={draft.value(k)}" for k in dropped) or "none decided"
        yaml = draft.plan.config_file or "NAME.yaml"
        line = (f"plan made for {planned} but this run is {launched} ({why_launched(launched, planned)}): its memory values "
                f"are not applied ({shown}){'; it was also made for another run: ' + '; '.join(why) if why else ''}; the "
                f"recipe's values apply{checked}. To run the plan's strategy, launch with `hf-gpu-train launch --config-file "
                f"{yaml} SCRIPT`, `accelerate launch --config_file {yaml} SCRIPT`, or the torchrun line `hf-gpu-train config` "
                "prints (it carries accelerate's strategy variables)")
    elif not dropped and keep:
        line = (f"the plan's memory plan was made for another run ({'; '.join(why)}): the values hf-gpu-train tune measured "
                f"for this recipe apply{checked or ', and the memory check estimates what this run trains'}")
    else:
        shown = ", ".join(f"{k}={draft.value(k)}" for k in dropped) or "none decided"
        line = f"plan values made for another run not applied ({shown}): {'; '.join(why)}; the recipe's values apply{checked}"
    draft.set_values({k: v for k, v in draft.values.items() if k not in dropped},
                     "made for another strategy" if strategy else "made for another model or shape")
    draft.memory = memory
    return [line]


def _tuned_precision_over_the_yamls(draft: _Draft) -> list[str]:
    """A precision tune measured for this recipe wins over NAME.yaml's own mixed_precision (which `accelerate launch`
    exports to every run, and which tune no longer rewrites): only a --mixed_precision other than the YAML's is the
    user's choice."""
    plan = draft.plan
    launched, yamls = plan.launched.mixed_precision, plan_before_tune(plan).value("precision")
    if launched is None or launched != yamls or launched == draft.value("precision"):
        return []
    draft.launched = LaunchedAs(plan.launched.num_processes, None, plan.launched.gpu_ids)
    return [f"precision={draft.value('precision')} measured by hf-gpu-train tune for this recipe, over "
            f"{plan.config_file.name if plan.config_file else 'the YAML'}'s mixed_precision ({launched})"]


def scope(plan: RunPlan, run: Fingerprint, here: HardwareProfile | None = None) -> Scoped:
    """The plan as a run that is ``run`` may apply it: one comparison, each differing dimension's values taken away
    with its line, the plan rewritten once (the very plan when nothing differs). ``here``: this machine, for the
    memory check of a plan made for another."""
    planned = plan_fingerprint(plan)
    found = compare(planned, run)
    dimensions = {d.dimension for d in found}
    draft = _Draft(plan, dict(plan.values), plan.memory, plan.launched)
    lines: dict[str, list[str]] = {"recipe": [], "machine": [], "run": [], "tuned": []}
    if "recipe" in dimensions:
        lines["recipe"] = _other_recipe(draft, run.recipe)
    if "machine" in dimensions:
        lines["machine"] = _other_machine(draft, [d.what for d in found if d.dimension == "machine"], here)
    elif "machine" in planned.missing and run.machine is not None:
        lines["machine"] = [f"{plan.path.name} records no machine (written by an older hf-gpu-train): its machine values are "
                            f"applied unchecked; regenerate it with `{plan.command}` to have them checked"]
    same_job = planned.recipe is not None and run.recipe is not None and "recipe" not in dimensions
    tuned = frozenset(k for k in (plan.document or {}).get(TUNED, {}).get("keys", ()) if k in APPLIED_KEYS) if same_job else frozenset()
    tuned = frozenset(k for k in tuned if draft.value(k) is not None)
    lines["run"] = _other_run(draft, found, planned, run, tuned)
    tuned = frozenset(k for k in tuned if draft.value(k) is not None)  # measured under another strategy: gone
    if "precision" in tuned:
        lines["tuned"] = _tuned_precision_over_the_yamls(draft)
    return Scoped(draft.rewritten(), found, {k: tuple(v) for k, v in lines.items()}, dict(draft.not_applied), tuned)


def scope_to_this_machine(plan, here: HardwareProfile) -> tuple[object, list[str]]:
    """(plan, lines): the plan as a run on ``here`` may apply it, the machine compared alone (``scope.scope``): on the
    hardware it records, unchanged; elsewhere without its machine values, variables, CPU binding and GPU ids, and one
    line names what differs. A plan that records no hardware (written before it did) is applied as before, and says so."""
    scoped = scope(plan, Fingerprint(machine=hardware_record(here)), here)
    return scoped.plan, list(scoped.lines["machine"])
