"""The last word when even one sample does not fit: this run's remedies, most effective first, with the
memory planner's estimate (an estimate is a bonus: it never hides the real error)."""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..plan.training_shape import TrainingShape


class OutOfMemoryAtMicroBatchOne(UsageError):
    """Even one sample does not fit: the message lists this run's remedies, most effective first."""


def remedies(args, model, inputs, failure: str | None) -> str:
    steps = []
    if not (args.bf16 or args.fp16):
        steps.append("mixed precision: precision=bf16 (compute capability >= 8.0) or fp16")
    if not args.gradient_checkpointing:
        steps.append("gradient_checkpointing=true (recompute activations in backward)")
    steps.append("a shorter max_length (text) or a smaller image_size (vision)")
    if "adafactor" not in str(args.optim) and "8bit" not in str(args.optim):
        steps.append("a lighter optimizer: Adafactor (optim=adafactor) or 8-bit AdamW (optim=adamw_bnb_8bit)")
    steps.append("shard the model: `hf-gpu-train config --strategy fsdp` (or deepspeed-zero3) and launch with that config")
    lines = [f"out of memory even at micro-batch 1 ({failure or 'on another rank'}). For this run, in order:"]
    lines += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
    estimate = planner_estimate(args, model, inputs)
    if estimate:
        lines.append(f"Memory planner: {estimate}")
    return "\n".join(lines)


def planner_estimate(args, model, inputs) -> str | None:
    from ..plan.memory import estimate  # lazy: looked up when called, so a replacement (a test's) is seen
    from ..plan.model_spec import ModelSpec, from_config

    try:
        inner = getattr(model, "module", model)
        config = getattr(inner, "config", None)
        method = _peft_method(inner)
        if config is not None and hasattr(config, "to_dict"):
            spec = from_config(config, name="this model")
        else:
            spec = ModelSpec(name="this model", params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
        seq = int(inputs["input_ids"].shape[1]) if "input_ids" in inputs else 512
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        base = getattr(inner, "get_base_model", lambda: inner)()
        chunked = hasattr(base, "_hf_gpu_train_chunked_loss")
        checkpointing = bool(args.gradient_checkpointing or getattr(base, "is_activation_checkpointing", False))
        shape = TrainingShape(micro_batch=1, seq_len=seq, precision=precision, method=method, gradient_checkpointing=checkpointing,
                              checkpoint_layers=_checkpoint_layers(base), chunked_loss=chunked,
                              offload_activations=hasattr(base, "_hf_gpu_train_offloads_activations"),
                              optimizer_in_backward=hasattr(base, "_hf_gpu_train_optimizer_in_backward"))
        breakdown = estimate(spec, shape, "single")
        total = f"{breakdown.total / 2**30:.1f} GiB per GPU at micro-batch 1 ({method})"
        if torch.cuda.is_available():
            total += f" of {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB"
        return total + " (run `hf-gpu-train plan-memory --model PATH --method auto` for each method and strategy)"
    except (ImportError, AttributeError, TypeError, ValueError, KeyError, RuntimeError):
        return None


def _checkpoint_layers(model) -> str:
    """The checkpointing policy the model runs with: selective (marked by levers/selective_checkpoint.py), one
    layer in N (transformers' every_n_layers: some layers checkpointed), or all."""
    marked = getattr(model, "_hf_gpu_train_checkpoint_layers", None)
    if marked in ("selective", "selective-lean"):
        return marked
    flags = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    done = sum(flags)
    if not flags or not done or done == len(flags):
        return "all"
    return f"every-{max(2, round(len(flags) / done))}"


def _peft_method(model) -> str:
    """lora for a peft model, qlora when its base is 4-bit (bitsandbytes), else full."""
    if not hasattr(model, "peft_config"):
        return "full"
    quantized = getattr(getattr(model, "config", None), "quantization_config", None)
    return "qlora" if quantized is not None else "lora"
