"""``hf-gpu-train plan-memory``: will the model fit? Micro-batch, accumulation, checkpointing, strategy."""

from __future__ import annotations

import argparse

from .common import add_machine_argument, resolve_profile
from .config import add_planner_arguments, model_spec_from_args


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan-memory", help="per-GPU memory for DDP / FSDP / ZeRO and the batch that fits",
                              description="Estimate per-GPU memory (weights, gradients, optimizer states, master weights, "
                              "activations, CUDA context) and pick micro-batch, accumulation, checkpointing and strategy.")
    add_machine_argument(p)
    add_planner_arguments(p)
    p.add_argument("--gpus", type=int, help="number of GPUs (default: all usable on the machine)")
    p.add_argument("--gpu-memory-gib", type=float, help="memory per GPU instead of the machine's")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    return p


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ..errors import UsageError
    from ..launch.gpu_selection import select_devices
    from ..launch.memory import STRATEGIES, TrainingShape, estimate, largest_micro_batch, plan_memory
    from ..textfmt import table

    spec = model_spec_from_args(args)
    if spec is None:
        raise UsageError("give --model NAME_OR_PATH or --params N")
    devices = "GPU(s)"
    if args.gpu_memory_gib:
        memory, count = int(args.gpu_memory_gib * 2**30), args.gpus or 1
    else:
        profile, _ = resolve_profile(args)
        # the same selection as `config`: a MIG box plans one process against its instance's memory, not the GPU's
        selection = select_devices(profile, str(args.gpus) if args.gpus else "all")
        if not selection.gpus:
            raise UsageError("no GPU on this machine: pass --machine NAME_OR_FILE or --gpu-memory-gib")
        memory, count = selection.memory_free_bytes, len(selection.gpus)
        if selection.mig_instance is not None:
            devices = f"MIG instance ({selection.mig_instance.uuid})"
    shape = TrainingShape(seq_len=args.seq_len, image_size=args.image_size, precision=args.precision,
                          optimizer=args.optimizer, num_gpus=count)
    print(f"{spec.name}: {spec.params / 1e6:.1f}M parameters; {count} {devices} x {memory / 2**30:.1f} GiB; "
          f"{args.precision}, {args.optimizer}, seq {args.seq_len}, image {args.image_size}")
    rows = [["Strategy", "Fixed (GiB)", "Act./sample (GiB)", "Max micro-batch", "With checkpointing"]]
    for strategy in STRATEGIES:
        if count == 1 and strategy != "ddp":
            continue
        fixed = estimate(spec, shape, strategy)
        rows.append([strategy if count > 1 else "single", f"{(fixed.total - fixed.activations) / 2**30:.2f}",
                     f"{fixed.activations / 2**30:.3f}", largest_micro_batch(spec, shape, strategy, memory),
                     largest_micro_batch(spec, replace(shape, gradient_checkpointing=True), strategy, memory)])
    print(table(rows))
    order = ("single",) if count == 1 else ("ddp", "fsdp-shard-grad-op", "fsdp", "fsdp-offload")
    plan = plan_memory(spec, memory, count, shape, args.global_batch, strategies=order)
    if plan is None:
        print("\nDoes not fit even at micro-batch 1 with checkpointing: more GPUs, a lighter optimizer, or a shorter sequence.")
        return 1
    print(f"\nPlan: {plan.strategy}, micro-batch {plan.micro_batch} x accumulation {plan.gradient_accumulation} x {count} GPU(s) "
          f"= {plan.effective_batch} (target {args.global_batch}), gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}")
    for name, value in plan.breakdown.rows():
        print(f"  {name:<22} {value / 2**30:8.2f} GiB")
    print(f"  {'total':<22} {plan.breakdown.total / 2**30:8.2f} GiB of {memory / 2**30:.1f} GiB (8% kept as headroom)")
    return 0
