"""The memory plan of a launch, with its memory levers: what `hf-gpu-train config` records for the run to apply.

The order, and why:

1. The planner's strategies as before (``memory.plan_memory``: the cheapest that fits, checkpointing only for a useful
   micro-batch). When one fits, the levers are chosen on it: the cheapest exact set (``lever_table``) that reaches a
   useful micro-batch, and among equally cheap ones the set reaching the larger micro-batch (fewer accumulation
   passes). The chunked LM head is free, so a causal LM gets it wherever it lets the micro-batch grow; selective
   checkpointing replaces checkpointing every layer where it reaches the same micro-batch for less recomputation.
2. When no strategy fits, the levers on each strategy in the same order: offloading and the optimizer in the backward
   make room that checkpointing cannot (long contexts on one GPU, a full fine-tune whose gradients do not fit).
3. The last resort: DeepSpeed ZeRO-3 with its optimizer and parameters in CPU memory (``deepspeed-zero3-offload``),
   also on one GPU, where FSDP has nothing left to shard. The GPU then holds the gathered layers, gradient buckets and
   activations; the host holds the fp32 master weights, the optimizer states, the gradients and the 16-bit
   parameters, checked against the machine's RAM when the snapshot knows it. Slow (the optimizer steps on the CPU)
   but it trains what otherwise does not fit at all.

Every value comes with its reason; the levers are values of the plan (``LEVER_KEYS``) that ``scripts/finetune.py``
applies (``levers/from_config.py``), scoped like the micro-batch to the model and shape they were planned for. Planned
here beside the planner, applied in ``levers/``: the planner never imports what runs in a Trainer.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .lever_table import lever_table
from .memory import GIB, OPTIMIZER_BYTES_PER_PARAM, MemoryPlan, estimate, plan_memory
from .method_choice import useful_micro_batch
from .model_spec import ModelSpec
from .strategies import ALL_LEVERS, DEEPSPEED, EVERYTHING, FSDP, STRATEGIES, strategy_names
from .training_shape import TrainingShape

LEVER_KEYS = ALL_LEVERS
# ZeRO-3 with its optimizer and parameters in CPU memory: the least on a GPU, also on one GPU (module docstring)
LAST_RESORT = strategy_names(lambda s: s.family == DEEPSPEED and s.shards == EVERYTHING and s.offload)[0]
HOST_FRACTION = 0.8  # of the host's RAM an offloading plan may count on: the data loaders and the OS need the rest


def levers_apply(spec: ModelSpec) -> bool:
    """Whether the planner counts the levers for this model: a transformer whose activations it models layer by layer
    (timm's measured census has no layers to checkpoint selectively or a head to chunk)."""
    return spec.is_transformer_shaped and not spec.activation_bytes_per_sample_fp32


def host_bytes_per_process(spec: ModelSpec, shape: TrainingShape, strategy: str, world: int) -> float:
    """Host memory one process holds for a strategy that offloads to the CPU: FSDP's fp32 parameters, gradients and
    optimizer states (its step runs there), ZeRO-3's fp32 master weights, optimizer states, fp32 gradients and its
    16-bit parameter copy (ZeRO-Offload, Ren et al. 2021, section 4); 0 for the others."""
    row = STRATEGIES.get(strategy)
    if row is None or not row.offload or shape.method != "full":
        return 0.0
    share = float(spec.params) / max(1, world)
    optimizer = OPTIMIZER_BYTES_PER_PARAM[shape.optimizer]
    if row.family == FSDP:
        return share * (4 + 4 + optimizer)
    half = 2.0 if shape.precision in ("bf16", "fp16") else 0.0
    return share * (4 + optimizer + 4 + half)


def plan_with_levers(spec: ModelSpec, gpu_memory_bytes: int, world: int, shape: TrainingShape, global_batch: int,
                     strategies: tuple[str, ...], *, last_resort: bool = True, peak_flops: float | None = None,
                     pcie_bytes_per_s: float | None = None, host_ram_bytes: int | None = None,
                     processes_per_machine: int = 1) -> MemoryPlan | None:
    """The memory plan for ``shape`` (no levers in it) over ``strategies`` (module docstring); None when nothing fits,
    not even with every lever and ZeRO-3's CPU offload."""
    base = replace(shape, chunked_loss=False, gradient_checkpointing=False, checkpoint_layers="all", offload_activations=False,
                   optimizer_in_backward=False)
    host = _HostCheck(spec, base, world, host_ram_bytes, processes_per_machine)
    allowed = tuple(s for s in strategies if host.fits(s))
    plain = plan_memory(spec, gpu_memory_bytes, world, base, global_batch, strategies=allowed) if allowed else None
    if not levers_apply(spec):
        return plain or _last_resort(spec, gpu_memory_bytes, world, base, global_batch, strategies, last_resort, host)
    table_args = dict(peak_flops=peak_flops, pcie_bytes_per_s=pcie_bytes_per_s)
    for strategy in (plain.strategy,) if plain else allowed:
        chosen = _with_levers(spec, gpu_memory_bytes, world, base, global_batch, strategy, plain, host, table_args)
        if chosen is not None:
            return chosen
    return _last_resort(spec, gpu_memory_bytes, world, base, global_batch, strategies, last_resort, host)


def host_room_per_process(spec: ModelSpec, shape: TrainingShape, strategy: str, world: int, host_ram_bytes: int | None,
                          processes_per_machine: int) -> float | None:
    """What offloaded activations may take of the host per process beside the strategy's own: the bound `config`
    plans the levers under, for ``plan-memory`` to print the same recommendation (None: the RAM is unknown)."""
    base = replace(shape, chunked_loss=False, gradient_checkpointing=False, checkpoint_layers="all", offload_activations=False,
                   optimizer_in_backward=False)
    return _HostCheck(spec, base, world, host_ram_bytes, processes_per_machine).room_per_process(strategy)


class _HostCheck:
    """Host memory against what an offloading plan puts there (unknown RAM: not checked, said in the reasons)."""

    def __init__(self, spec, shape, world, ram, per_machine):
        self.spec, self.shape, self.world, self.ram, self.per_machine = spec, shape, world, ram, per_machine

    def needs(self, strategy: str, activations: float = 0.0) -> float:
        return (host_bytes_per_process(self.spec, self.shape, strategy, self.world) + activations) * self.per_machine

    def fits(self, strategy: str, activations: float = 0.0) -> bool:
        return self.ram is None or self.needs(strategy, activations) <= self.ram * HOST_FRACTION

    def room_per_process(self, strategy: str) -> float | None:
        """What offloaded activations may take of the host per process beside the strategy's own (None: unknown)."""
        if self.ram is None:
            return None
        return max(0.0, self.ram * HOST_FRACTION / self.per_machine - host_bytes_per_process(self.spec, self.shape, strategy, self.world))

    def reason(self, strategy: str, activations: float = 0.0) -> str | None:
        need = self.needs(strategy, activations)
        if not need:
            return None
        known = f"of {self.ram / GIB:.0f} GiB RAM" if self.ram else "(the machine's RAM is not in the snapshot: not checked)"
        return f"host memory {need / GIB:.1f} GiB over {self.per_machine} process(es) {known}"


def _with_levers(spec, memory, world, shape, global_batch, strategy, plain, host, table_args) -> MemoryPlan | None:
    per_gpu = math.ceil(global_batch / world)
    useful = useful_micro_batch(spec, shape, per_gpu)  # 4 samples, or 2048 tokens when fewer: method_choice.py
    table = lever_table(spec, shape, strategy, memory, useful, per_gpu_batch=per_gpu,
                        host_bytes_per_process=host.room_per_process(strategy), **table_args)
    chosen = table.recommended
    if chosen is None or (plain is None and chosen.largest_micro_batch < 1):
        return None
    best = chosen.largest_micro_batch
    accumulation = math.ceil(per_gpu / best)
    micro = math.ceil(per_gpu / accumulation)
    levers = replace(chosen.shape, micro_batch=micro)
    reasons = list(plain.reasons if plain is not None else [f"{strategy}: fits only with memory levers"])
    reasons.append(f"levers: {table.reason}")
    extra = host.reason(strategy, chosen.offloaded_bytes)
    if extra:
        reasons.append(extra)
    values = chosen.values()
    if not levers.gradient_checkpointing:
        values["checkpoint_layers"] = None
    return MemoryPlan(strategy=strategy, micro_batch=micro, gradient_accumulation=accumulation,
                      gradient_checkpointing=levers.gradient_checkpointing, effective_batch=micro * accumulation * world,
                      breakdown=estimate(spec, levers, strategy), gpu_memory_bytes=memory, reasons=tuple(reasons),
                      candidates=plain.candidates if plain is not None else (), levers=tuple(values.items()),
                      lever_names=tuple(chosen.names), host_bytes=host.needs(strategy, chosen.offloaded_bytes))


def last_resort_plan(spec: ModelSpec, gpu_memory_bytes: int, world: int, shape: TrainingShape, global_batch: int,
                     tried: tuple[str, ...], host_ram_bytes: int | None = None, processes_per_machine: int = 1) -> MemoryPlan | None:
    """ZeRO-3 with CPU offload for what ``tried`` cannot fit, with its reasons (None: full fine-tuning does not fit that
    way either, or the host cannot hold it)."""
    host = _HostCheck(spec, shape, world, host_ram_bytes, processes_per_machine)
    return _last_resort(spec, gpu_memory_bytes, world, shape, global_batch, tried, True, host)


def _last_resort(spec, memory, world, shape, global_batch, strategies, allowed: bool, host) -> MemoryPlan | None:
    if not allowed or shape.method != "full" or LAST_RESORT in strategies or not host.fits(LAST_RESORT):
        return None
    plan = plan_memory(spec, memory, world, shape, global_batch, strategies=(LAST_RESORT,))
    if plan is None:
        return None
    reasons = (*plan.reasons, f"nothing else fits ({', '.join(strategies)}, with every memory lever): ZeRO-3 keeps the "
               "optimizer and the parameters in CPU memory and steps there (slow, but it trains)", host.reason(LAST_RESORT),
               "a causal LM trains on the GPU alone with --method lora or qlora (`hf-gpu-train plan-memory --method auto` "
               "compares them)" if spec.causal_lm else None)
    return replace(plan, reasons=tuple(r for r in reasons if r), host_bytes=host.needs(LAST_RESORT))


LEVER_WHY = {
    "chunked_lm_loss": "the LM head and loss in chunks of labelled rows: no full logits (exact, free)",
    "checkpoint_layers": "which layers gradient checkpointing covers and what they keep",
    "offload_activations": "saved activations in pinned host memory, copied back for the backward",
    "optimizer_in_backward": "each parameter stepped as its gradient is ready (gradient clipping off)",
}


def lever_settings(plan: MemoryPlan | None) -> list[tuple[str, object, str]]:
    """(key, value, reason) for each lever the plan decided (none when the planner does not count levers for the
    model); a value of None leaves the run's own."""
    if plan is None or not plan.levers:
        return []
    chosen = ", ".join(plan.lever_names) or "none needed"
    rows = []
    for key, value in plan.levers:
        if value is None:
            reason = f"not needed for the planned micro-batch: the run's own (the lever: {LEVER_WHY[key]})"
        else:
            reason = f"{LEVER_WHY[key]}; the plan's levers: {chosen}"
        rows.append((key, value, reason))
    return rows
