"""The memory planner: will it fit, with which micro-batch, accumulation and strategy?

Per GPU, for DDP, FSDP and DeepSpeed ZeRO-2/3: weights, gradients, optimizer states, fp32 master
weights under mixed precision, activations from the model's shape, the CUDA context and a headroom.
Unlike ``accelerate estimate-memory`` (batch size 1, no activations: accelerate #2512, #2910) it
counts activations, so it can pick a batch size. For LoRA and QLoRA (``TrainingShape.method``) the
frozen base, the adapters and their states come from ``peft_memory``.

Sources for the formulas:
- bytes per parameter of mixed-precision Adam training (16 with torch AMP: fp32 weights, fp32 grads,
  two fp32 moments; ZeRO paper, Rajbhandari et al. 2020, section 3);
- activations (``activations.py``): per transformer layer 34·s·h bytes per sample in 16-bit with fused
  attention (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1 without the 5·a·s²
  attention scores that SDPA/flash kernels do not store), Llama-family decoders counted tensor by tensor
  and checked against autograd; checkpointing keeps each layer's input and one layer's activations;
- DeepSpeed ZeRO (stage_1_and_2.py and stage3.py of DeepSpeed 0.19; compared with its own estimators in
  tests/plan/test_deepspeed_estimators.py): ZeRO keeps an fp32 copy of its master partition even in fp32 training,
  the optimizer step builds an fp32 gradient partition beside the master weights and moments (``zero_step_gradients``),
  and ZeRO-3 gathers one module at a time, so its largest gathered unit is the largest module (for an LLM the
  embedding or the output head) with its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .activations import activation_bytes
from .model_spec import ModelSpec, largest_parameter
from .peft_memory import estimate_peft
from .strategies import AUTO_CANDIDATES, DEEPSPEED, EVERYTHING, FSDP, MULTI_PROCESS, STRATEGIES, Strategy
from .training_shape import METHODS, TrainingShape

__all__ = ["BREAKDOWN_ROWS", "CUDA_CONTEXT_BYTES", "GIB", "HEADROOM_FRACTION", "METHODS", "OPTIMIZER_BYTES_PER_PARAM",
           "ZERO3_SUB_GROUP_SIZE", "MemoryBreakdown", "MemoryPlan", "TrainingShape", "activation_bytes", "estimate",
           "largest_micro_batch", "plan_memory", "usable_bytes", "zero_step_gradients"]

GIB = 2**30
CUDA_CONTEXT_BYTES = 512 * 2**20  # CUDA context + cuBLAS/cuDNN workspaces: 300-800 MiB in practice
HEADROOM_FRACTION = 0.08  # allocator fragmentation and transient buffers
# DeepSpeed's zero_optimization.sub_group_size default (elements), which the plan's configs leave as it is: ZeRO-3's step
# converts one sub-group of the partition's gradients to fp32 at a time (stage3.py _prepare_fp32_grad_for_sub_group)
ZERO3_SUB_GROUP_SIZE = 10**9

OPTIMIZER_BYTES_PER_PARAM = {
    "adamw": 8.0,  # two fp32 moments
    "adamw-8bit": 2.0,  # bitsandbytes: two 8-bit moments (+ small quantization state)
    "sgd": 4.0,  # momentum buffer
    "adafactor": 0.05,  # factored second moment (rows + columns), no momentum: ~1% of AdamW
}
# Every row a breakdown can have, in the order tables show them (full fine-tuning's rows, then LoRA/QLoRA's).
BREAKDOWN_ROWS = ("weights", "frozen base weights", "4-bit base weights (NF4)", "unquantized weights (fp32)",
                  "adapter weights (fp32)", "gradients", "adapter gradients", "optimizer states", "adapter optimizer states",
                  "fp32 master weights", "fp32 gradients at the step", "communication buffers", "gathered parameters",
                  "16-bit working copies", "activations", "CUDA context")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU. For LoRA/QLoRA ``weights`` is the frozen base (QLoRA: the part kept in fp32), and
    ``gradients`` and ``optimizer`` are the adapters'."""

    strategy: str
    weights: float
    gradients: float
    optimizer: float
    master_weights: float
    comm_buffers: float
    gathered_params: float
    activations: float
    context: float
    quantized_weights: float = 0.0  # QLoRA: NF4 codes and their quantization constants
    adapter_weights: float = 0.0  # LoRA/QLoRA: fp32 adapters
    working_copies: float = 0.0  # autocast's 16-bit adapter copies; QLoRA's dequantized layer and output-head copy
    # ZeRO's optimizer step: its fp32 gradient partition (zero_step_gradients) beyond the activations, which are freed
    # by then, so that the total is the larger of the backward's peak and the step's
    step_gradients: float = 0.0
    method: str = "full"

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.master_weights + self.comm_buffers
                + self.gathered_params + self.activations + self.context + self.quantized_weights
                + self.adapter_weights + self.working_copies + self.step_gradients)

    def rows(self) -> list[tuple[str, float]]:
        if self.method == "full":
            step = [("fp32 gradients at the step", self.step_gradients)] if self.step_gradients else []
            return [("weights", self.weights), ("gradients", self.gradients), ("optimizer states", self.optimizer),
                    ("fp32 master weights", self.master_weights), *step, ("communication buffers", self.comm_buffers),
                    ("gathered parameters", self.gathered_params), ("activations", self.activations),
                    ("CUDA context", self.context)]
        base = ([("frozen base weights", self.weights)] if self.method == "lora" else
                [("4-bit base weights (NF4)", self.quantized_weights), ("unquantized weights (fp32)", self.weights)])
        return base + [("adapter weights (fp32)", self.adapter_weights), ("adapter gradients", self.gradients),
                       ("adapter optimizer states", self.optimizer), ("communication buffers", self.comm_buffers),
                       ("16-bit working copies", self.working_copies), ("activations", self.activations),
                       ("CUDA context", self.context)]


def estimate(spec: ModelSpec, shape: TrainingShape, strategy: str) -> MemoryBreakdown:
    """Bytes per GPU for one strategy (``shape.method`` full, lora or qlora)."""
    if shape.method not in METHODS:
        raise ValueError(f"unknown method {shape.method!r}; one of {METHODS}")
    opt = OPTIMIZER_BYTES_PER_PARAM[shape.optimizer]
    if shape.method != "full":
        parts = estimate_peft(spec, shape, strategy, opt)
        return MemoryBreakdown(strategy=strategy, context=CUDA_CONTEXT_BYTES, method=shape.method, **parts)
    P, N = float(spec.params), max(1, shape.num_gpus)
    w = 2.0 if shape.precision in ("bf16", "fp16") else 4.0
    layer = float(spec.largest_layer_params or P / max(1, spec.num_layers or 12))
    acts = activation_bytes(spec, shape)
    row = STRATEGIES.get(strategy)
    if row is None:
        raise ValueError(f"unknown strategy {strategy!r}; one of {MULTI_PROCESS}")
    offload = row.offload
    zero = dict(weights=0.0, gradients=0.0, optimizer=0.0, master_weights=0.0, comm_buffers=0.0, gathered_params=0.0)
    if row.replicated:
        # torch AMP keeps fp32 weights and grads; DDP's reducer keeps gradient buckets beside them. The optimizer in
        # backward (one process) frees each gradient as its parameter steps: two parameters' gradients at once
        grads = 4 * 2 * largest_parameter(spec) if shape.optimizer_in_backward and not row.several_processes else 4 * P
        parts = dict(zero, weights=4 * P, gradients=grads, optimizer=opt * P,
                     comm_buffers=4 * P if row.several_processes and N > 1 else 0.0)
    elif row.family == FSDP and row.shards != EVERYTHING:  # SHARD_GRAD_OP: the parameters gathered until the backward
        parts = dict(zero, weights=4 * P / N + w * P, gradients=4 * P / N, optimizer=opt * P / N, gathered_params=0.0)
    elif row.family == FSDP:
        parts = dict(zero, weights=4 * P / N, gradients=4 * P / N, optimizer=0.0 if offload else opt * P / N,
                     gathered_params=2 * layer * (w + 4))  # current + prefetched unit, params and their grads
        if offload:
            parts.update(weights=0.0, gradients=0.0)
    elif row.zero_stage == 2:
        # ZeRO keeps its fp32 master partition as a copy in every precision, an fp32 model's included (stage_1_and_2.py:
        # .clone(); stage3.py shares the partition only where a torch.device equals the accelerator's device name, a
        # str, which it never does): 4 bytes a parameter of the partition
        parts = dict(zero, weights=w * P, gradients=w * P / N, optimizer=0.0 if offload else opt * P / N,
                     master_weights=0.0 if offload else 4 * P / N, comm_buffers=2 * w * min(P, 5e8) / 4)
    else:  # ZeRO-3
        master = 4 * P / N  # a copy in every precision, as ZeRO-2's
        # with the optimizer offloaded, each gradient partition goes to the CPU as it is reduced: the GPU keeps the
        # reduce buckets (transformers sets reduce_bucket_size to hidden^2 elements; two in flight)
        grads = w * P / N
        if offload and spec.hidden_size:
            grads = min(grads, 2 * w * float(spec.hidden_size) ** 2)
        # ZeRO-3 fetches each module's parameters as the module runs (a prefetch bucket ahead), so its largest gathered
        # unit is the largest module with its whole gradient in the backward: for an LLM the embedding or the output
        # head (DeepSpeed's own estimate: 4 bytes a parameter of the largest layer); two decoder layers where larger
        parts = dict(zero, weights=0.0 if offload else w * P / N, gradients=grads,
                     optimizer=0.0 if offload else opt * P / N, master_weights=0.0 if offload else master,
                     gathered_params=max(2 * layer, 2 * largest_parameter(spec)) * w)
    parts["gradients"] += unsharded_head_gradient(spec, shape, row, w, N)
    parts["step_gradients"] = max(0.0, zero_step_gradients(spec, shape, strategy) - acts)
    return MemoryBreakdown(strategy=strategy, activations=acts, context=CUDA_CONTEXT_BYTES, **parts)


def zero_step_gradients(spec: ModelSpec, shape: TrainingShape, strategy: str) -> float:
    """The fp32 gradient partition DeepSpeed's optimizer step builds on the GPU beside the fp32 master weights and the
    moments, bytes per GPU: ZeRO-2 converts the whole partition's gradients (stage_1_and_2.py step:
    ``flat_grad_partition.to(fp32)``; in fp32 training the flattened copy), ZeRO-3 one sub-group at a time (stage3.py
    ``_prepare_fp32_grad_for_sub_group``). 0 where the optimizer steps on the CPU, for the other strategies and for
    adapters (their states are small). Measured on DeepSpeed 0.19.8 at the inner optimizer step (bf16, one process):
    ZeRO-2 holds 2 + 16 bytes a parameter, ZeRO-3 20, where the planner counted 2 + 14 and 16 without it. The
    activations are freed by then, so ``estimate`` counts what exceeds them: without it, Llama-3-8B under ZeRO-2 on
    2 x 80 GB "fit" at micro-batch 1 (72.8 GiB) while its step needs 15 GiB more than the 67.3 GiB of states."""
    row = STRATEGIES.get(strategy)
    if shape.method != "full" or row is None or row.offload or row.family != DEEPSPEED:
        return 0.0
    share = float(spec.params) / max(1, shape.num_gpus)
    return 4 * (share if row.zero_stage == 2 else min(share, ZERO3_SUB_GROUP_SIZE))


def unsharded_head_gradient(spec: ModelSpec, shape: TrainingShape, row: Strategy, w: float, N: int) -> float:
    """The chunked LM head's weight gradient beyond what the strategy counts for it: the head computes it in its
    forward into a whole fp32 buffer (vocabulary x hidden) on every process, held until the backward hands it to the
    sharding (finetune/tasks/language_modeling/lm_head_loss.py). One GPU and DDP count every gradient whole already; FSDP and ZeRO-2
    count 1/N of it (Llama-3-8B's head on 8 GPUs: 1.7 GiB more per GPU); ZeRO-3 never gets the chunked head."""
    if not (shape.chunked_loss and spec.causal_lm and spec.vocab_size and spec.hidden_size and shape.method == "full"):
        return 0.0
    if row.replicated or row.zero_stage == 3:
        return 0.0
    counted = (0.0 if row.offload else 4 / N) if row.family == FSDP else w / N  # FSDP's fp32 shard, ZeRO-2's 16-bit one
    return (4 - counted) * float(spec.vocab_size) * float(spec.hidden_size)


def usable_bytes(gpu_memory_bytes: int) -> float:
    return gpu_memory_bytes * (1 - HEADROOM_FRACTION)


def largest_micro_batch(spec: ModelSpec, shape: TrainingShape, strategy: str, gpu_memory_bytes: int, limit: int = 4096) -> int:
    """The largest micro-batch that fits (0: not even one sample)."""
    budget = usable_bytes(gpu_memory_bytes)

    def fits(b: int) -> bool:
        return estimate(spec, replace(shape, micro_batch=b), strategy).total <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # largest lo that fits, smallest hi that does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class MemoryPlan:
    strategy: str
    micro_batch: int
    gradient_accumulation: int
    gradient_checkpointing: bool
    effective_batch: int
    breakdown: MemoryBreakdown
    gpu_memory_bytes: int
    reasons: tuple[str, ...] = ()
    candidates: tuple[tuple[str, bool, int], ...] = field(default=())  # (strategy, checkpointing, max micro-batch)
    # the memory levers the plan counts (lever_plan.LEVER_KEYS -> FinetuneConfig value; None: the run's own), their
    # names, and the host memory the plan puts there (offloaded activations, an offloading strategy's states), bytes
    levers: tuple[tuple[str, object], ...] = ()
    lever_names: tuple[str, ...] = ()
    host_bytes: float = 0.0


def plan_memory(
    spec: ModelSpec,
    gpu_memory_bytes: int,
    world_size: int,
    shape: TrainingShape,
    target_global_batch: int,
    strategies: tuple[str, ...] = AUTO_CANDIDATES,
    min_micro_batch: int = 4,
) -> MemoryPlan | None:
    """The cheapest strategy (in the given order) that fits, the largest micro-batch up to what the
    target global batch needs, and checkpointing only when it buys a useful micro-batch."""
    if target_global_batch < 1:
        raise ValueError("target_global_batch must be >= 1")
    per_gpu_target = math.ceil(target_global_batch / world_size)
    candidates = []
    for strategy in strategies:
        plain = largest_micro_batch(spec, replace(shape, gradient_checkpointing=False), strategy, gpu_memory_bytes)
        candidates.append((strategy, False, plain))
        checkpointing = False
        best = plain
        if plain < min(min_micro_batch, per_gpu_target):
            ckpt = largest_micro_batch(spec, replace(shape, gradient_checkpointing=True), strategy, gpu_memory_bytes)
            candidates.append((strategy, True, ckpt))
            if ckpt > plain:
                best, checkpointing = ckpt, True
        if best == 0:
            continue
        accumulation = math.ceil(per_gpu_target / best)
        micro = math.ceil(per_gpu_target / accumulation)
        chosen = replace(shape, micro_batch=micro, gradient_checkpointing=checkpointing)
        reasons = [f"{strategy}: up to micro-batch {best}" + (" with gradient checkpointing" if checkpointing else "")
                   + f" fits in {gpu_memory_bytes / GIB:.1f} GiB"]
        if strategy != strategies[0]:
            reasons.append(f"cheaper strategies do not fit: {', '.join(s for s in strategies[:strategies.index(strategy)])}")
        return MemoryPlan(strategy=strategy, micro_batch=micro, gradient_accumulation=accumulation,
                          gradient_checkpointing=checkpointing, effective_batch=micro * accumulation * world_size,
                          breakdown=estimate(spec, chosen, strategy), gpu_memory_bytes=gpu_memory_bytes,
                          reasons=tuple(reasons), candidates=tuple(candidates))
    return None
