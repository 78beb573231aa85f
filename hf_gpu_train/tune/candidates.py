"""What `hf-gpu-train tune` may try for one recipe on one launch config, and what the planner rules out.

Pure data and arithmetic, no torch: the CLI builds the space (and prints it for ``--machine``), the trial
processes receive it as JSON. Every candidate keeps the effective batch of the run it tunes: the micro-batch
takes only values that divide the samples each process contributes to an optimizer step, and the accumulation
makes up the rest, so ``micro x accumulation x processes`` is the same global batch for every candidate (and,
because the length-grouped sampler groups over that global batch, every candidate trains on the same batches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace

from ..finetune.tasks.base import task_for

AXES = ("micro_batch", "checkpointing", "offload", "workers", "precision", "packing", "compile")
# Packing is asked for by name (--axes ...,packing): a step of N packed rows and a step of N padded examples train on
# different batches (a packed row holds several examples), so the two layouts do not keep the run's effective batch.
DEFAULT_AXES = tuple(axis for axis in AXES if axis != "packing")
PACKING_NOTE = ("packing: kept at the run's own ({value}): a step of N packed rows holds several times the examples of a "
                "step of N padded ones, so the other layout trains on other batches; --axes ...,packing measures it anyway "
                "(by tokens/s)")
# Checkpointing policies, cheapest recomputation first (plan/lever_table.py), each keeping less than the one before:
# selective keeps every matmul's output, one layer in two recomputes half the layers, lean selective recomputes the
# widening matmuls of every layer (not attention), every layer recomputes the whole forward.
POLICIES_BY_COST = ("selective", "every-2", "selective-lean", "all")
OFFLOAD_CPU_NOTE = "offload: not tried on the CPU (the activations are in host memory already)"
# On a GPU the 16-bit formats run on tensor cores; a plan that chose bf16 may also run fp16 (same speed class,
# needs loss scaling). fp16 hardware without bf16 (compute capability 7.x) has one valid fast format; the CPU
# trains in fp32 (bf16 without AMX falls back to slow reference kernels: REFERENCE.md, TRL section).
PRECISION_OPTIONS = {"bf16": ("bf16", "fp16"), "fp16": ("fp16",), "fp32": ("fp32",), "fp8": ("bf16", "fp16")}
MAX_WORKERS = 16
# Measured on this project's 2-core CPU: torch.compile of a 2-layer BERT took 279 s before its first step, for a
# few steps' worth of gain. The compile axis is a GPU axis.
CPU_COMPILE_NOTE = ("torch.compile is tried on CUDA only: on the CPU compiling took minutes (279 s for a 2-layer BERT on "
                    "this project's 2-core machine), more than any tuning budget")


@dataclass(frozen=True)
class Candidate:
    """One setting of every tuned key. ``micro_batch x accumulation`` is what one process contributes to an
    optimizer step; ``packing`` is None where the task has no packing."""

    micro_batch: int
    accumulation: int
    gradient_checkpointing: bool
    dataloader_num_workers: int
    precision: str
    torch_compile: bool = False
    packing: bool | str | None = None
    checkpoint_layers: str = "all"  # with gradient_checkpointing: all | every-N | selective (finetune config's key)
    offload_activations: bool = False
    # another strategy than the launch config's own, measured in a launch of its own config (tune's strategy round,
    # strategies.py); None: the config's own strategy
    strategy: str | None = None

    @property
    def key(self) -> str:
        """Stable text key (cache, de-duplication); the levers appear only when they are not the default."""
        packing = "-" if self.packing is None else str(self.packing).lower()
        levers = (f"|{self.checkpoint_layers}" if self.gradient_checkpointing and self.checkpoint_layers != "all" else "") + (
            "|offload" if self.offload_activations else "") + (f"|{self.strategy}" if self.strategy else "")
        return (f"mb{self.micro_batch}xga{self.accumulation}|ckpt{int(self.gradient_checkpointing)}|w{self.dataloader_num_workers}"
                f"|{self.precision}|compile{int(self.torch_compile)}|pack{packing}{levers}")

    @property
    def checkpointing(self) -> str:
        """off, or the policy: all, every-N, selective."""
        return self.checkpoint_layers if self.gradient_checkpointing else "off"

    def describe(self) -> str:
        policy = {"off": "off", "all": "on"}.get(self.checkpointing, self.checkpointing)
        parts = [f"micro-batch {self.micro_batch} x {self.accumulation}", f"checkpointing {policy}"]
        if self.offload_activations:
            parts.append("activation offloading")
        parts += [f"{self.dataloader_num_workers} worker(s)", self.precision]
        if self.torch_compile:
            parts.append("torch.compile")
        if self.packing is not None:
            parts.append({True: "packing", False: "no packing"}.get(self.packing, f"packing {self.packing}"))
        if self.strategy:
            parts.append(self.strategy)
        return ", ".join(parts)

    def config_values(self, world_size: int) -> dict:
        """The FinetuneConfig values of this candidate: the global batch is stated, so the run derives exactly
        this accumulation."""
        values = {"per_device_train_batch_size": self.micro_batch,
                  "global_batch_size": self.micro_batch * self.accumulation * world_size,
                  "gradient_checkpointing": self.gradient_checkpointing,
                  "dataloader_num_workers": self.dataloader_num_workers,
                  "precision": self.precision, "torch_compile": self.torch_compile,
                  "checkpoint_layers": self.checkpoint_layers if self.gradient_checkpointing else "all",
                  "offload_activations": self.offload_activations}
        if self.packing is not None:
            values["packing"] = self.packing
        return values

    def with_checkpointing(self, policy: str) -> Candidate:
        """This candidate with checkpointing ``policy`` (off, all, every-N, selective)."""
        if policy == "off":
            return replace(self, gradient_checkpointing=False, checkpoint_layers="all")
        return replace(self, gradient_checkpointing=True, checkpoint_layers=policy)

    def with_micro_batch(self, micro_batch: int) -> Candidate:
        """Another micro-batch with the accumulation that keeps this candidate's samples per process."""
        per_process = self.micro_batch * self.accumulation
        if per_process % micro_batch:
            raise ValueError(f"micro-batch {micro_batch} does not divide {per_process} samples per process")
        return replace(self, micro_batch=micro_batch, accumulation=per_process // micro_batch)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Candidate:
        return cls(**data)


@dataclass(frozen=True)
class PlannerVerdict:
    """The memory planner's estimate (bytes per process) for one micro-batch, checkpointing and precision."""

    micro_batch: int
    gradient_checkpointing: bool
    precision: str
    estimate_bytes: int
    usable_bytes: int
    fits: bool
    checkpoint_layers: str = "all"
    offload_activations: bool = False

    @property
    def lookup(self) -> tuple:
        return (self.micro_batch, self.gradient_checkpointing and self.checkpoint_layers, self.offload_activations, self.precision)


@dataclass(frozen=True)
class CandidateSpace:
    """The options of every axis, first option = the run's own setting, and the planner's verdicts."""

    base: Candidate
    world_size: int
    micro_batches: tuple[int, ...]  # every micro-batch that keeps the effective batch, ascending
    checkpointing: tuple[bool, ...]
    workers: tuple[int, ...]
    precisions: tuple[str, ...]
    compile: tuple[bool, ...]
    packing: tuple[bool | str | None, ...]
    metric: str  # "tokens/s" (text: tokens are counted) or "samples/s"
    on_cuda: bool
    verdicts: tuple[PlannerVerdict, ...] = ()  # empty: no memory plan, nothing pruned
    notes: tuple[str, ...] = field(default=())  # why an axis is fixed or narrowed
    policies: tuple[str, ...] = ("all",)  # the checkpointing policies tried where checkpointing is on, the run's first
    offload: tuple[bool, ...] = (False,)
    memory_budget_bytes: int | None = None  # --memory-budget-gib: a trial whose peak is above it does not fit
    optimizer_in_backward: bool = False  # the run's own (not an axis): it rules out accumulation, compile and fp16

    @property
    def samples_per_process(self) -> int:
        return self.base.micro_batch * self.base.accumulation

    @property
    def effective_batch(self) -> int:
        return self.samples_per_process * self.world_size

    def verdict(self, candidate: Candidate) -> PlannerVerdict | None:
        wanted = (candidate.micro_batch, candidate.gradient_checkpointing and candidate.checkpoint_layers,
                  candidate.offload_activations, candidate.precision)
        return next((v for v in self.verdicts if v.lookup == wanted), None)

    def planner_allows(self, candidate: Candidate) -> bool:
        """False when the planner has a verdict and it says this does not fit, or when the run would refuse the
        combination (``runnable``)."""
        found = self.verdict(candidate)
        return runnable(candidate, self.base, self.optimizer_in_backward) is None and (found is None or found.fits)

    def pruned(self) -> list[PlannerVerdict]:
        return [v for v in self.verdicts if not v.fits]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["base"] = self.base.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> CandidateSpace:
        tuples = {k: tuple(data[k]) for k in ("micro_batches", "checkpointing", "workers", "precisions", "compile", "packing", "notes",
                                              "policies", "offload") if k in data}
        return cls(base=Candidate.from_dict(data["base"]), world_size=data["world_size"], metric=data["metric"],
                   on_cuda=data["on_cuda"], verdicts=tuple(PlannerVerdict(**v) for v in data["verdicts"]),
                   memory_budget_bytes=data.get("memory_budget_bytes"),
                   optimizer_in_backward=bool(data.get("optimizer_in_backward", False)), **tuples)


@dataclass(frozen=True)
class TuneInputs:
    """What the space is built from: the run's values after the launch plan (FinetuneConfig keys), the keys the
    tune command line fixed, the plan's own suggestions, and the launch."""

    values: Mapping[str, object]
    fixed: frozenset[str]
    task: str
    world_size: int
    on_cuda: bool
    planned_micro_batch: int | None  # the planner's micro-batch (None: no memory plan)
    planned_workers: int | None
    axes: tuple[str, ...] = DEFAULT_AXES
    layered: bool = False  # a transformers model: selective and one-in-N checkpointing apply (timm: every block only)
    memory_budget_bytes: int | None = None


def runnable(candidate: Candidate, base: Candidate, optimizer_in_backward: bool = False) -> str | None:
    """Why the run would refuse this candidate's combination (levers/from_config.check_levers, and
    levers/optimizer_in_backward.attach for a run that steps in the backward), or None."""
    if candidate.torch_compile and candidate.offload_activations:
        return "torch.compile beside activation offloading (its hooks would sit inside the compiled forward)"
    if optimizer_in_backward and candidate.accumulation > 1:
        return "accumulation with optimizer_in_backward (each micro-batch's backward would step the parameters)"
    if optimizer_in_backward and candidate.torch_compile:
        return "torch.compile with optimizer_in_backward (a compiled backward makes every gradient at once)"
    if optimizer_in_backward and candidate.precision == "fp16":
        return "fp16 with optimizer_in_backward (the loss scaler must see every gradient before a step)"
    return None


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def samples_per_process(values: Mapping[str, object], world_size: int) -> int:
    """What one process contributes to an optimizer step: the global batch over the processes (rounded up, as
    the run rounds it), or the micro-batch when no global batch is set (accumulation 1)."""
    micro = int(values["per_device_train_batch_size"])
    global_batch = values.get("global_batch_size")
    if not global_batch:
        return micro
    return -(-int(global_batch) // world_size)


def _options(first, others, open_axis: bool) -> tuple:
    found = [first]
    for option in others if open_axis else ():
        if option not in found:
            found.append(option)
    return tuple(found)


def plan_space(inputs: TuneInputs, memory_check: Callable[[dict], object | None] | None = None) -> CandidateSpace:
    """The candidates for ``inputs``. ``memory_check(values)`` is the planner for a dict of FinetuneConfig values
    (``plan.resolution.check_memory`` bound to the plan: an object with ``fits``, ``estimate_bytes`` and
    ``usable_bytes``, or None without a memory plan)."""
    v, fixed, notes = inputs.values, inputs.fixed, []

    def open_axis(axis: str, *keys: str) -> bool:
        if axis not in inputs.axes:
            notes.append(f"{axis}: not tuned (--axes)")
            return False
        held = [k for k in keys if k in fixed]
        if held:
            notes.append(f"{axis}: kept at {', '.join(f'{k}={v.get(k)}' for k in held)} (set on the command line)")
            return False
        return True

    per_process = samples_per_process(v, inputs.world_size)
    if open_axis("micro_batch", "per_device_train_batch_size"):
        rungs = divisors(per_process)
        start = inputs.planned_micro_batch or int(v["per_device_train_batch_size"])
        start = max(r for r in rungs if r <= max(1, start))
        if not v.get("global_batch_size"):
            notes.append(f"micro_batch: at most {per_process} (no global_batch_size: the micro-batch is the whole step; "
                         "set global_batch_size to let tune try larger micro-batches with the same effective batch)")
    else:
        start = int(v["per_device_train_batch_size"])
        rungs = (start,)
        per_process = start * -(-per_process // start)
    precision = str(v.get("precision") or "auto")
    precision = {"fp8": "bf16"}.get(precision, precision)
    base = Candidate(micro_batch=start, accumulation=per_process // start, gradient_checkpointing=bool(v.get("gradient_checkpointing")),
                     dataloader_num_workers=_base_workers(v, inputs, notes), precision=precision,
                     torch_compile=bool(v.get("torch_compile")), packing=v.get("packing") if task_for(inputs.task).packs else None)
    base = replace(base, checkpoint_layers=str(v.get("checkpoint_layers") or "all") if base.gradient_checkpointing else "all",
                   offload_activations=bool(v.get("offload_activations")))
    checkpointing_open = open_axis("checkpointing", "gradient_checkpointing", "checkpoint_layers")
    checkpointing = _options(base.gradient_checkpointing, (not base.gradient_checkpointing,), checkpointing_open)
    policies = _options(base.checkpoint_layers, _policy_options(inputs, notes), checkpointing_open)
    offload = _offload_options(base, inputs, notes, open_axis("offload", "offload_activations"))
    workers = _options(base.dataloader_num_workers, _worker_options(base.dataloader_num_workers, inputs.planned_workers),
                       open_axis("workers", "dataloader_num_workers"))
    precisions = _options(precision, PRECISION_OPTIONS.get(precision, ()), open_axis("precision", "precision"))
    if len(precisions) == 1 and "precision" in inputs.axes and "precision" not in fixed:
        notes.append(f"precision: {precision} is the only fast one here" if precision != "auto" else
                     "precision: auto (the launch decides): not tuned")
    compile_open = open_axis("compile", "torch_compile")
    if compile_open and not inputs.on_cuda:
        notes.append(f"compile: {CPU_COMPILE_NOTE}")
    compile_options = _options(base.torch_compile, (not base.torch_compile,), compile_open and inputs.on_cuda)
    packing = (None,)
    if base.packing is not None and "packing" not in inputs.axes:
        packing = (base.packing,)
        notes.append(PACKING_NOTE.format(value=base.packing))
    elif base.packing is not None:  # packed rows where the model's attention allows (auto, true), or padded examples
        packing = _options(base.packing, (False,) if base.packing in (True, "auto") else ("auto",), open_axis("packing", "packing"))
    verdicts = _verdicts(rungs, checkpointing, policies, offload, precisions, memory_check)
    if memory_check is not None and not verdicts:
        notes.append("memory: the plan has no memory model (`hf-gpu-train config` without --model): the planner prunes nothing")
    if inputs.memory_budget_bytes:
        notes.append(f"memory: a candidate fits when its measured peak is at most {inputs.memory_budget_bytes / 2**30:.2f} GiB "
                     "(--memory-budget-gib)" + ("" if inputs.on_cuda else ": the training process's peak resident memory on the CPU"))
    metric = task_for(inputs.task).throughput_unit
    return CandidateSpace(base=base, world_size=inputs.world_size, micro_batches=rungs, checkpointing=checkpointing,
                          workers=workers, precisions=precisions, compile=compile_options, packing=packing, metric=metric,
                          on_cuda=inputs.on_cuda, verdicts=verdicts, notes=tuple(notes), policies=policies, offload=offload,
                          memory_budget_bytes=inputs.memory_budget_bytes,
                          optimizer_in_backward=bool(v.get("optimizer_in_backward")))


def _policy_options(inputs: TuneInputs, notes: list) -> tuple[str, ...]:
    """The checkpointing policies worth measuring: every one for a transformers model (QLoRA: not selective, whose
    policy does not cover bitsandbytes' matmul), every block for timm's."""
    if not inputs.layered:
        notes.append("checkpointing: every block only (selective and one-in-N checkpointing are for transformers models)")
        return ("all",)
    if inputs.values.get("method") == "qlora":
        return tuple(p for p in POLICIES_BY_COST if not p.startswith("selective"))
    return POLICIES_BY_COST


def _offload_options(base: Candidate, inputs: TuneInputs, notes: list, open_axis: bool) -> tuple[bool, ...]:
    if open_axis and not inputs.on_cuda:
        notes.append(OFFLOAD_CPU_NOTE)
        return (base.offload_activations,)
    if open_axis and inputs.values.get("torch_compile"):
        notes.append("offload: not tried beside torch_compile (its hooks would sit inside the compiled forward)")
        return (base.offload_activations,)
    return _options(base.offload_activations, (not base.offload_activations,), open_axis)


def _base_workers(values: Mapping[str, object], inputs: TuneInputs, notes: list) -> int:
    raw = values.get("dataloader_num_workers")
    if isinstance(raw, int):
        return raw
    if inputs.planned_workers is not None:
        return inputs.planned_workers
    notes.append("workers: no plan value and dataloader_num_workers=auto: starting from 0")
    return 0


def _worker_options(base: int, planned: int | None) -> tuple[int, ...]:
    """0, the planned count and twice it; with a plan of 0 (the CPU), 0 and 2."""
    planned = base if planned is None else planned
    if planned == 0:
        return (0, 2)
    return tuple(sorted({0, planned, min(MAX_WORKERS, 2 * planned)}, reverse=True))


def _verdicts(rungs, checkpointing, policies, offload, precisions, memory_check) -> tuple[PlannerVerdict, ...]:
    if memory_check is None:
        return ()
    found = []
    settings = [(ckpt, policy) for ckpt in checkpointing for policy in (policies if ckpt else ("all",))]
    for precision in precisions:
        for (ckpt, policy), offloaded in ((c, o) for c in settings for o in offload):
            for micro in rungs:
                check = memory_check({"per_device_train_batch_size": micro, "gradient_checkpointing": ckpt, "precision": precision,
                                      "checkpoint_layers": policy, "offload_activations": offloaded})
                if check is None:
                    return ()
                found.append(PlannerVerdict(micro, ckpt, precision, int(check.estimate_bytes), int(check.usable_bytes),
                                            bool(check.fits), policy, offloaded))
    return tuple(found)
