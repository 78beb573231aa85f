"""``hf-gpu-train plan-memory``: will the model fit? Micro-batch, accumulation, checkpointing, strategy, and with
``--method auto`` which of full fine-tuning, LoRA, QLoRA or sharded full fine-tuning to use."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from ..errors import UsageError
from ..hardware.peaks import peak_flops
from ..plan.evaluation_memory import JOIN_FACTOR, evaluation_memory
from ..plan.gpus import select_devices
from ..plan.lever_plan import host_room_per_process, last_resort_plan
from ..plan.lever_table import format_rows, host_memory_note, lever_table, pcie_bytes_per_second
from ..plan.memory import BREAKDOWN_ROWS, TrainingShape, estimate, largest_micro_batch, plan_memory, usable_bytes
from ..plan.method_choice import recommend_method, useful_micro_batch
from ..plan.model_spec import adapter_shape, quantized_params
from ..plan.strategies import AUTO_CANDIDATES, MULTI_PROCESS, STRATEGIES, replica_strategy
from ..textfmt import human, table
from .common import add_machine_argument, resolve_profile
from .config import add_planner_arguments, model_spec_from_args

METHOD_CHOICES = ("full", "lora", "qlora", "auto")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan-memory", help="per-GPU memory for full / LoRA / QLoRA, DDP / FSDP / ZeRO, and the batch that fits",
                              description="Estimate per-GPU memory (weights, gradients, optimizer states, master weights, "
                              "activations, CUDA context) and pick micro-batch, accumulation, checkpointing and strategy; "
                              "for LoRA and QLoRA the frozen base (16-bit or 4-bit NF4) and the adapters; with --method auto, "
                              "compare full fine-tuning, LoRA, QLoRA and sharded full fine-tuning and recommend one.")
    add_machine_argument(p)
    add_planner_arguments(p)
    p.add_argument("--gpus", type=int, help="number of GPUs (default: all usable on the machine)")
    p.add_argument("--gpu-memory-gib", type=float, help="memory per GPU instead of the machine's")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--method", default="full", choices=METHOD_CHOICES,
                   help="full fine-tuning (default), LoRA adapters on a 16-bit base, QLoRA adapters on a 4-bit NF4 base, "
                   "or auto: plan each and recommend one")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (adapters on every linear layer but the output head)")
    p.add_argument("--eval-rows", type=int, metavar="N",
                   help="rows of the evaluation set: what an evaluation keeps (a language model's logits: rows x seq x "
                   "vocabulary) and what the fine-tune keeps instead")
    p.add_argument("--prefer-full", action="store_true",
                   help="with --method auto: rank full fine-tuning sharded over the GPUs (FSDP) above LoRA and QLoRA")
    return p


def _devices(args) -> tuple[int, int, str, object]:
    """(memory per process in bytes, GPU count, what they are, the first GPU or None) from --gpu-memory-gib or the
    machine."""

    if args.gpu_memory_gib:
        return int(args.gpu_memory_gib * 2**30), args.gpus or 1, "GPU(s)", None
    profile, _ = resolve_profile(args)
    # the same selection as `config`: a MIG box plans one process against its instance's memory, not the GPU's
    selection = select_devices(profile, str(args.gpus) if args.gpus else "all")
    if not selection.gpus:
        raise UsageError("no GPU on this machine: pass --machine NAME_OR_FILE or --gpu-memory-gib")
    devices = "GPU(s)" if selection.mig_instance is None else f"MIG instance ({selection.mig_instance.uuid})"
    return selection.memory_free_bytes, len(selection.gpus), devices, selection.gpus[0]


def _check(args, spec) -> None:

    if args.lora_rank < 1:
        raise UsageError(f"--lora-rank {args.lora_rank}: must be at least 1 (16 is a good start)")
    if args.method in ("lora", "qlora") and (adapter_shape(spec) is None or quantized_params(spec) is None):
        raise UsageError(f"--method {args.method} needs the model's linear layers: give --model NAME_OR_PATH (a local directory "
                         "or config.json is enough, no weights are read) instead of --params")


def run(args: argparse.Namespace) -> int:

    spec = model_spec_from_args(args)
    if spec is None:
        raise UsageError("give --model NAME_OR_PATH or --params N")
    _check(args, spec)
    memory, count, devices, gpu = _devices(args)
    shape = TrainingShape(seq_len=args.seq_len, image_size=args.image_size, precision=args.precision,
                          optimizer=args.optimizer, num_gpus=count, method="full" if args.method == "auto" else args.method,
                          lora_rank=args.lora_rank)
    adapters = f", LoRA r{args.lora_rank}" if args.method != "full" else ""
    print(f"{spec.name}: {spec.params / 1e6:.1f}M parameters; {count} {devices} x {memory / 2**30:.1f} GiB; "
          f"{args.precision}, {args.optimizer}, seq {args.seq_len}, image {args.image_size}{adapters}")
    if args.eval_rows is not None:
        _print_evaluation(args, spec)
    if args.method == "auto":
        return _run_auto(args, spec, shape, memory, count)
    status, strategy = _run_one(args, spec, shape, memory, count)
    if spec.is_transformer_shaped and not spec.activation_bytes_per_sample_fp32:
        status = min(status, _print_levers(args, spec, shape, memory, count, gpu, strategy))  # 0: the plan or the levers fit
    elif status and shape.method == "full":
        status = _print_last_resort(args, spec, shape, memory, count, strategy)
    return status


def _print_evaluation(args, spec) -> None:
    """An evaluation's own memory (plan/evaluation_memory.py): a language model's logits kept for a compute_metrics,
    against what the fine-tune keeps (the loss)."""
    if args.eval_rows < 1:
        raise UsageError(f"--eval-rows {args.eval_rows}: the evaluation set's rows, at least 1")
    if not (spec.vocab_size and spec.causal_lm):
        print(f"\nEvaluation of {args.eval_rows} rows: a classifier's logits are one row of classes per example, small; "
              "the fine-tune (-m hf_gpu_train.finetune) keeps their class ids")
        return
    bytes_per_value = 4 if args.precision == "fp32" else 2
    logits = evaluation_memory(args.eval_rows, args.seq_len, spec.vocab_size, True, "the logits", bytes_per_value)
    loss = evaluation_memory(args.eval_rows, args.seq_len, spec.vocab_size, True, "the loss only", bytes_per_value)
    ids = 8.0 * args.eval_rows * args.seq_len * JOIN_FACTOR
    print(f"\nEvaluation of {args.eval_rows} rows at seq {args.seq_len}, vocabulary {spec.vocab_size} ({args.precision} logits):")
    print(f"  a Trainer keeping the logits for its compute_metrics: {human(logits.logits_bytes)} at the end of each "
          "evaluation (on the GPU until then, without eval_accumulation_steps)")
    print(f"  the fine-tune (-m hf_gpu_train.finetune) keeps the loss only (perplexity from it): {human(loss.kept_bytes)}")
    print(f"  in your own Trainer: preprocess_logits_for_metrics reducing the logits to what the metric reads (token ids: "
          f"{human(ids)}), and eval_accumulation_steps (predictions on the host)")


def _print_levers(args, spec, shape, memory, count, gpu, strategy) -> int:
    """The per-lever table and the recommended set (plan/lever_table.py), on the plan's strategy; 0 when the
    recommended set fits, 1 when nothing does."""


    per_gpu = math.ceil(args.global_batch / count)
    useful = useful_micro_batch(spec, shape, per_gpu)  # the threshold `config` plans the levers with (plan/lever_plan.py)
    peak = peak_flops(getattr(gpu, "name", None), args.precision) if gpu is not None else None
    pcie = pcie_bytes_per_second(getattr(gpu, "pcie_link_gen", None), getattr(gpu, "pcie_link_width", None))
    # offloading bounded by the host's RAM as `config` bounds it, so both commands recommend the same levers
    room = host_room_per_process(spec, shape, strategy, count, _host_ram(args), count)
    levers = lever_table(spec, shape, strategy, memory, useful, per_gpu_batch=per_gpu, peak_flops=peak, pcie_bytes_per_s=pcie,
                         host_bytes_per_process=room)
    print(f"\nMemory levers ({shape.method}, {strategy if count > 1 else '1 GPU'}; hf_gpu_train/plan/lever_table.py):")
    print(table(format_rows(levers)))
    for note in levers.notes:
        print(f"  {note}")
    print(f"Recommended levers: {levers.reason}")
    if levers.recommended is not None and levers.recommended.config():
        print(f"  -m hf_gpu_train.finetune ... {' '.join(levers.recommended.config())}")
    note = host_memory_note(levers)
    if note:
        print(f"  {note}")
    if levers.recommended is None and shape.method == "full":
        return _print_last_resort(args, spec, shape, memory, count, strategy)
    return 0 if levers.recommended is not None else 1


def _host_ram(args) -> int | None:
    """The machine's RAM from its snapshot or detection (None with --gpu-memory-gib: no machine named)."""
    if args.gpu_memory_gib:
        return None
    profile, _ = resolve_profile(args)
    return profile.host.ram_total_bytes


def _print_last_resort(args, spec, shape, memory, count, strategy) -> int:
    """DeepSpeed ZeRO-3 with the optimizer and parameters in CPU memory, where no lever makes it fit (plan/lever_plan.py)."""

    ram = _host_ram(args)
    plan = last_resort_plan(spec, memory, count, shape, args.global_batch, (strategy,), ram, count)
    if plan is None:
        print("Last resort, DeepSpeed ZeRO-3 with CPU offload: does not fit either" + (" (or the host's RAM cannot hold it)" if ram else ""))
        return 1
    print(f"\nLast resort: {plan.strategy} (`hf-gpu-train config --strategy {STRATEGIES[plan.strategy].base} ...`)")
    _print_plan(plan, count, args.global_batch, memory)
    for reason in plan.reasons[1:]:
        print(f"  {reason}")
    return 0


def _run_one(args, spec, shape, memory, count) -> tuple[int, str]:
    """(exit status, the strategy the levers are planned on: the plan's, or the last tried when nothing fits)"""


    rows = [["Strategy", "Fixed (GiB)", "Act./sample (GiB)", "Max micro-batch", "With checkpointing"]]
    if shape.method == "full":
        strategies = (replica_strategy(False),) if count == 1 else MULTI_PROCESS
    else:
        strategies = (replica_strategy(count > 1),)  # adapters on a whole base per GPU
    for strategy in strategies:
        fixed = estimate(spec, shape, strategy)
        rows.append([strategy if count > 1 else "single", f"{(fixed.total - fixed.activations) / 2**30:.2f}",
                     f"{fixed.activations / 2**30:.3f}", largest_micro_batch(spec, shape, strategy, memory),
                     largest_micro_batch(spec, replace(shape, gradient_checkpointing=True), strategy, memory)])
    print(table(rows))
    if shape.method != "full":
        order = strategies
    else:
        order = (replica_strategy(False),) if count == 1 else AUTO_CANDIDATES
    plan = plan_memory(spec, memory, count, shape, args.global_batch, strategies=order)
    if plan is None:
        print("\nDoes not fit even at micro-batch 1 with checkpointing: more GPUs, a lighter optimizer, a shorter sequence"
              + (", or --method auto to compare LoRA and QLoRA" if shape.method != "qlora" and spec.causal_lm else "")
              + "; or the memory levers below.")
        return 1, order[-1]
    _print_plan(plan, count, args.global_batch, memory)
    return 0, plan.strategy


def _print_plan(plan, count, global_batch, memory) -> None:
    print(f"\nPlan: {plan.strategy}, micro-batch {plan.micro_batch} x accumulation {plan.gradient_accumulation} x {count} GPU(s) "
          f"= {plan.effective_batch} (target {global_batch}), gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}")
    for name, value in plan.breakdown.rows():
        print(f"  {name:<26} {value / 2**30:8.2f} GiB")
    print(f"  {'total':<26} {plan.breakdown.total / 2**30:8.2f} GiB of {memory / 2**30:.1f} GiB (8% kept as headroom)")


def _run_auto(args, spec, shape, memory, count) -> int:

    rec = recommend_method(spec, memory, count, shape, args.global_batch, prefer_full=args.prefer_full)
    shown = [c for c in rec.candidates if c.available]
    rows = [["GiB per GPU"] + [c.label for c in shown]]
    for name in BREAKDOWN_ROWS:
        values = [dict(c.breakdown.rows()).get(name) for c in shown]
        if any(values):
            rows.append([name] + ["" if v is None else f"{v / 2**30:.2f}" for v in values])
    rows.append(["total"] + [f"{c.breakdown.total / 2**30:.2f}" for c in shown])
    rows.append(["at micro-batch"] + [(f"{c.plan.micro_batch}" + (" (ckpt)" if c.plan.gradient_checkpointing else ""))
                                      if c.fits else "1 (ckpt): does not fit" for c in shown])
    rows.append(["largest micro-batch"] + [c.largest_micro_batch for c in shown])
    print(f"\nCandidates, in the order of preference{' (--prefer-full)' if args.prefer_full else ''}; useful micro-batch: "
          f"{rec.useful_micro_batch} ({usable_bytes(memory) / 2**30:.1f} GiB usable per GPU):")
    print(table(rows))
    for c in rec.candidates:
        if not c.available:
            print(f"  {c.label}: not a candidate: {c.note}")
    print(f"\nRecommended: {rec.reason}")
    if rec.chosen is None:
        return 1
    _print_plan(rec.chosen.plan, count, args.global_batch, memory)
    return 0
