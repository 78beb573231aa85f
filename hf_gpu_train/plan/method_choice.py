"""Full fine-tuning, LoRA, QLoRA or sharded full fine-tuning: which one, for this model on this machine, and why.

Each candidate is planned by the memory planner (largest micro-batch, checkpointing only when it buys a useful
micro-batch, accumulation up to the global batch); the recommendation is the first in an order of preference
that reaches a useful micro-batch, else the first that fits at all. Useful: 4 samples, or 2048 tokens for a
text model when that is fewer samples (a long sequence is a big micro-batch already), or the whole per-GPU
batch when that is smaller. What makes a micro-batch useful is the matmuls' size: a GEMM of T tokens against an
h x h bf16 weight does 2·T·h² FLOPs on 2·(2·T·h + h²) bytes, T·h/(2T + h) FLOP per byte, 1024 at T = 2048 and
h = 4096, far above the ~300 FLOP per byte where an H100 SXM stops waiting on memory (989 TFLOP/s dense bf16 over
3.35 TB/s, NVIDIA H100 datasheet). The order, and why:

1. full fine-tuning with a whole model per GPU (one GPU, or DDP over the machine's GPUs): every weight trains,
   the reference the others are measured against, nothing to merge, no extra dependency.
2. LoRA on a base in the compute dtype: trains about 0.5% of an LLM's parameters; on all linear layers it
   matches full fine-tuning on instruction tuning (QLoRA paper, Dettmers et al. 2023, section 4: "LoRA on all
   linear layers is needed to match full finetuning performance") but learns less than full fine-tuning on
   large domain shifts such as code and maths (Biderman et al. 2024, "LoRA Learns Less and Forgets Less").
3. QLoRA: LoRA on a base stored in 4-bit NF4; the paper matches 16-bit LoRA on its benchmarks (section 5), at
   the price of a dequantization in every forward and backward (slower steps) and of needing CUDA.
4. full fine-tuning sharded with FSDP over the machine's GPUs: full quality when no single GPU holds the model,
   at the price of all-gathers and reduce-scatters every step. With ``prefer_full`` it moves up to second
   place, ahead of LoRA and QLoRA: ask for it when full fine-tuning's quality is the point (a large domain shift).

LoRA and QLoRA are offered for causal LMs, the models the finetune adapts (``method=lora|qlora`` is for
``task=causal-lm``); they need the model's layers, so a bare ``--params N`` gets full fine-tuning only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .memory import GIB, MemoryBreakdown, MemoryPlan, TrainingShape, estimate, plan_memory, usable_bytes
from .model_spec import ModelSpec, adapter_shape, quantized_params
from .strategies import FSDP, replica_strategy, strategy_names

SHARDED_STRATEGIES = strategy_names(lambda s: s.family == FSDP and not s.offload)  # full-sharded: CPU offload left out
USEFUL_MICRO_BATCH = 4  # samples: the planner's threshold for paying checkpointing's recomputation
USEFUL_TOKENS = 2048  # tokens per micro-batch that fill a GPU's matmuls (module docstring)


def useful_micro_batch(spec: ModelSpec, shape: TrainingShape, per_gpu_target: int) -> int:
    """The smallest micro-batch worth planning for (module docstring)."""
    useful = USEFUL_MICRO_BATCH
    if spec.is_transformer_shaped and not spec.activation_bytes_per_sample_fp32:
        useful = min(useful, max(1, math.ceil(USEFUL_TOKENS / shape.seq_len)))
    return max(1, min(useful, per_gpu_target))


@dataclass(frozen=True)
class Candidate:
    key: str  # full | lora | qlora | full-sharded
    label: str
    method: str
    strategies: tuple[str, ...]
    plan: MemoryPlan | None  # None: not even micro-batch 1 with checkpointing fits, or not available
    breakdown: MemoryBreakdown | None  # at the plan's micro-batch; else at micro-batch 1 with checkpointing
    largest_micro_batch: int  # the best the planner found (with checkpointing when it needed it)
    useful: bool
    note: str  # what it needs when it does not fit, or why it is not a candidate
    available: bool = True  # False: not a candidate here (one GPU to shard over, not a causal LM, no layers known)

    @property
    def fits(self) -> bool:
        return self.plan is not None


@dataclass(frozen=True)
class MethodRecommendation:
    candidates: tuple[Candidate, ...]  # in the order of preference used
    chosen: Candidate | None
    reason: str
    useful_micro_batch: int


def _best_micro_batch(plan: MemoryPlan) -> int:
    return max(m for s, _, m in plan.candidates if s == plan.strategy)


def _candidate(key, label, method, strategies, spec, memory, world, shape, target, useful_at) -> Candidate:
    method_shape = replace(shape, method=method, num_gpus=world)
    plan = plan_memory(spec, memory, world, method_shape, target, strategies=strategies, min_micro_batch=useful_at)
    if plan is None:
        floor = estimate(spec, replace(method_shape, micro_batch=1, gradient_checkpointing=True), strategies[-1])
        note = (f"needs {floor.total / GIB:.1f} GiB per GPU at micro-batch 1 with checkpointing "
                f"({strategies[-1]}), {usable_bytes(memory) / GIB:.1f} GiB usable")
        return Candidate(key, label, method, strategies, None, floor, 0, False, note)
    best = _best_micro_batch(plan)
    note = f"{plan.strategy}: micro-batch up to {best}" + (" with gradient checkpointing" if plan.gradient_checkpointing else "")
    return Candidate(key, label, method, strategies, plan, plan.breakdown, best, best >= useful_at, note)


def _unavailable(key, label, method, why) -> Candidate:
    return Candidate(key, label, method, (), None, None, 0, False, why, available=False)


def recommend_method(spec: ModelSpec, gpu_memory_bytes: int, gpu_count: int, shape: TrainingShape, target_global_batch: int,
                     prefer_full: bool = False) -> MethodRecommendation:
    """Plan every candidate on ``gpu_count`` GPUs of ``gpu_memory_bytes`` each and choose one (module docstring)."""
    if target_global_batch < 1:
        raise ValueError("target_global_batch must be >= 1")
    n = max(1, gpu_count)
    useful_at = useful_micro_batch(spec, shape, math.ceil(target_global_batch / n))
    whole = (replica_strategy(n > 1),)
    where = "1 GPU" if n == 1 else f"DDP x{n}"
    args = (spec, gpu_memory_bytes, n, shape, target_global_batch, useful_at)
    full = _candidate("full", f"full, {where}", "full", whole, *args)
    sharded = (_candidate("full-sharded", f"full, FSDP x{n}", "full", SHARDED_STRATEGIES, *args) if n > 1 else
               _unavailable("full-sharded", "full, FSDP", "full", "one GPU: nothing to shard over"))
    rank = shape.lora_rank
    if not spec.causal_lm:
        why = "LoRA/QLoRA are offered for causal LMs (the finetune adapts task=causal-lm)"
        lora, qlora = _unavailable("lora", "LoRA", "lora", why), _unavailable("qlora", "QLoRA", "qlora", why)
    elif adapter_shape(spec) is None or quantized_params(spec) is None:
        why = "needs the model's layers: give --model (a directory or config.json), not --params"
        lora, qlora = _unavailable("lora", "LoRA", "lora", why), _unavailable("qlora", "QLoRA", "qlora", why)
    else:
        lora = _candidate("lora", f"LoRA r{rank}, {where}", "lora", whole, *args)
        qlora = _candidate("qlora", f"QLoRA r{rank}, {where}", "qlora", whole, *args)
    order = (full, sharded, lora, qlora) if prefer_full else (full, lora, qlora, sharded)
    chosen = next((c for c in order if c.useful), None) or next((c for c in order if c.fits), None)
    return MethodRecommendation(candidates=order, chosen=chosen, reason=_reason(order, chosen, gpu_memory_bytes, n, useful_at, prefer_full),
                                useful_micro_batch=useful_at)


def _reason(order, chosen, memory, n, useful_at, prefer_full) -> str:
    gpu = f"{memory / GIB:.1f} GiB"
    if chosen is None:
        return (f"nothing fits in {gpu} per GPU, not even micro-batch 1 with gradient checkpointing: more or larger GPUs, "
                "a shorter --seq-len, or a lighter --optimizer (adamw-8bit, adafactor)")
    ahead = order[:order.index(chosen)]
    passed = [f"{c.label} {'does not fit (' + c.note + ')' if not c.fits else 'reaches only micro-batch ' + str(c.largest_micro_batch)}"
              for c in ahead if c.available]
    lora = next(c for c in order if c.key == "lora")
    why = {
        "full": "full fine-tuning fits with a whole model per GPU: every weight trains, nothing to merge",
        "lora": "LoRA keeps the base in the compute dtype: no quantization error and no dequantization in every step, "
                "unlike QLoRA",
        "qlora": ("QLoRA's 4-bit base leaves room for a useful micro-batch where LoRA's 16-bit base does not" if lora.fits else
                  "QLoRA's 4-bit base is the smallest: the only adapter method that fits"),
        "full-sharded": ("full quality asked for (--prefer-full), and sharding over the GPUs makes it fit" if prefer_full else
                         "sharding the full model over the GPUs is what fits"),
    }[chosen.key]
    text = f"{chosen.label}: {why}; {chosen.note}"
    if not chosen.useful:
        text += f" (below the useful micro-batch {useful_at}: nothing reaches it, this is the first that fits at all)"
    if passed:
        text += ". Ahead of it in the order: " + "; ".join(passed)
    sharded = next(c for c in order if c.key == "full-sharded")
    if not prefer_full and chosen.key in ("lora", "qlora") and sharded.useful:
        text += f". Full fine-tuning sharded over the {n} GPUs fits too ({sharded.note}): --prefer-full chooses it"
    return text
