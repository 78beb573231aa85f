"""Memory levers (issue 19): peak memory and speed of each lever added in turn, torchtune-style, on the real
SmolLM2-135M-Instruct (the shipped recipe smollm2_lora_demo: its chat rows, packed into rows of max_length).

Levers, each added to the ones above (the order of hf_gpu_train/plan/lever_table.py): the chunked LM head and loss
(``chunked_lm_loss``), the optimizer step in the backward (``optimizer_in_backward``, full fine-tuning only), selective
checkpointing (``checkpoint_layers=selective``), lean selective checkpointing (``selective-lean``, replacing it),
checkpointing every layer (``checkpoint_layers=all``, replacing that).
Activation offloading has nothing to offload on the CPU (the activations are in host memory): it is measured on a GPU by
scripts/gpu_check.py. Each arm is a fresh process (benchmarks/memory_levers_arm.py); the arms of one configuration run
back to back, in alternating order. Gradient clipping is off in every arm (the optimizer in the backward cannot clip),
so the arms differ by their levers only.

Measured: peak RSS of the training process (on the CPU: model, optimizer state, activations, logits, and what the
allocator keeps) and row capacity per second (steps x rows x max_length / seconds of train(): packed rows are
nearly full). Evaluation, checkpoints, telemetry and generation are off in every arm, so train() is the steps alone.

    python benchmarks/memory_levers.py [--steps 3] [--lengths 512 2048] [--methods lora full]
    python benchmarks/memory_levers.py --context-budget-gib 4   # the longest context in 4 GiB, ours against TRL

The second form: the longest ``max_length`` (one packed row of that many tokens per step, LoRA, one optimizer step) whose
training process stays within a fixed memory budget, ours with every exact lever that saves memory here (the chunked
head, checkpointing every layer; offloading on a GPU; and, a second series, ``release_memory`` too) against TRL 1.16's
leanest ``SFTTrainer`` (its fused LM head,
packing, gradient checkpointing; its activation offloading on a GPU only: on the CPU it does not start). Lengths double
from the first, then halving the gap between the longest that fits and the first that does not (to 12.5%). Memory is
the process's peak RSS (``ru_maxrss``: loading included) on the CPU, torch's peak reserved on a GPU. Each ``ours`` side is
compared with each TRL side measured: ``trl`` is TRL as it ships, ``trl-release`` TRL with the allocator setting of ours'
``release_memory`` (on the CPU glibc's fixed mmap threshold), so that what the allocator holds and what the trainer keeps
are told apart: ``--context-sides trl-release ours-release``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEVERS = {  # cumulative: each arm has the levers of the arms above it
    "none": ["chunked_lm_loss=false"],
    "+ chunked LM head and loss": ["chunked_lm_loss=true"],
    "+ optimizer step in the backward": ["chunked_lm_loss=true", "optimizer_in_backward=true"],
    "+ selective checkpointing": ["chunked_lm_loss=true", "optimizer_in_backward=true", "gradient_checkpointing=true",
                                  "checkpoint_layers=selective"],
    "+ lean selective checkpointing": ["chunked_lm_loss=true", "optimizer_in_backward=true", "gradient_checkpointing=true",
                                       "checkpoint_layers=selective-lean"],
    "+ checkpointing every layer": ["chunked_lm_loss=true", "optimizer_in_backward=true", "gradient_checkpointing=true",
                                    "checkpoint_layers=all"],
}
QUIET = ["eval_strategy=no", "save_strategy=no", "telemetry=false", "generation_samples=0", "per_device_train_batch_size=1",
         "logging_steps=1", "resume=never", "max_eval_samples=4", "extra={max_grad_norm: 0}",
         "watchdog=off"]  # a step of 16k tokens on 2 CPU cores takes longer than the watchdog's first-step floor (600 s)


def levers_for(method: str) -> dict[str, list[str]]:
    """The arms a method has: the optimizer in the backward is for full fine-tuning (an adapter's gradients are small)."""
    if method == "full":
        return LEVERS
    return {name: [v for v in values if v != "optimizer_in_backward=true"] for name, values in LEVERS.items()
            if name != "+ optimizer step in the backward"}


def arm(tmp: Path, name: str, overrides: list[str]) -> dict:
    out = tmp / f"{name}.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_levers_arm.py"), str(out), *overrides,
                          f"output_dir={tmp / name}"], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


OURS_LEANEST = ["chunked_lm_loss=true", "gradient_checkpointing=true", "checkpoint_layers=all"]


def ours_at(tmp: Path, length: int, release: bool = False) -> dict:
    """ours' peak and time for one step of one packed row of ``length`` tokens, LoRA, every memory-saving lever (with
    ``release``: also release_memory, the allocator giving freed memory back at once)."""
    import torch

    levers = OURS_LEANEST + (["offload_activations=true"] if torch.cuda.is_available() else []) + (
        ["release_memory=true"] if release else [])
    overrides = ["method=lora", f"max_length={length}", "max_steps=1", *QUIET, *levers]
    result = arm(tmp, f"ours-context-{length}-{int(release)}", overrides)
    peak = result["cuda_peak_reserved"] if torch.cuda.is_available() else result["peak_rss_bytes"]
    return {"fits_bytes": peak, "seconds": result["train_seconds"]}


def ours_releasing_at(tmp: Path, length: int) -> dict:
    return ours_at(tmp, length, release=True)



def trl_at(tmp: Path, length: int, release: bool = False) -> dict:
    """TRL's leanest SFTTrainer for one step of one packed row of ``length`` tokens (benchmarks/sft_vs_trl_arm.py); with
    ``release``: the allocator setting of ours' release_memory too (like for like with ours' second series)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sft_vs_trl import run_spec

    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import parse_args
    from hf_gpu_train.finetune.tasks.language_modeling import smollm2

    recipe, files = parse_args(["--config", "smollm2_lora_demo"])  # the shipped recipe (its data files: the config loader finds them)
    cfg = load_config(recipe, files)
    on_cuda = torch.cuda.is_available()
    options = {"packing": True, **({"activation_offloading": True} if on_cuda else {})}  # checkpointing: TRL's default
    spec = {"mode": "train", "arm": "trl", "out": str(tmp / f"trl-context-{length}"), "model_path": str(smollm2.ensure_converted()),
            "train_file": str(cfg.train_file), "validation_file": str(cfg.validation_file), "recipe": recipe,
            "trl": dict(seed=cfg.seed, num_train_epochs=1, max_steps=1, learning_rate=cfg.learning_rate, lr_scheduler_type="linear",
                        warmup_ratio=0.0, weight_decay=cfg.weight_decay, max_length=length, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                        lora_dropout=cfg.lora_dropout, lora_target_modules=cfg.lora_target_modules, batch=1, options=options),
            "release_memory": release}
    result = run_spec(spec, tmp, f"trl-context-{length}-{int(release)}")
    return {"fits_bytes": result["cuda_peak_reserved"] if on_cuda else result["ru_maxrss"], "seconds": result["train_seconds"]}


def trl_releasing_at(tmp: Path, length: int) -> dict:
    return trl_at(tmp, length, release=True)


SIDES = {"trl": (trl_at, "TRL leanest (fused head, packing, ckpt)"), "ours": (ours_at, "ours (chunked head, ckpt every layer)"),
         "ours-release": (ours_releasing_at, "ours (+ release_memory)"),
         "trl-release": (trl_releasing_at, "TRL leanest (+ the same allocator setting)")}
BISECT_TO = 1.125  # bisect until the first length over the budget is within 12.5% of the longest that fits


def longest_context(measure, tmp: Path, budget: int, lengths: list[int], name: str) -> tuple[int | None, int | None]:
    """(the longest length whose peak stays within ``budget``, the shortest seen over it): the ladder, then halving the
    gap (to multiples of 128 tokens) until it is within ``BISECT_TO``."""
    fits, fails = None, None

    def step(length: int) -> bool:
        r = measure(tmp, length)
        ok = r["fits_bytes"] <= budget
        print(f"| {name} | {length} | {r['fits_bytes'] / 2**30:.2f} GiB | {'fits' if ok else 'over'} | {r['seconds']:.0f} s |",
              flush=True)
        return ok

    for length in lengths:
        if not step(length):
            fails = length
            break
        fits = length
    while fits is not None and fails is not None and fails > fits * BISECT_TO:
        middle = (fits + fails) // 2 // 128 * 128
        if middle in (fits, fails):
            break
        if step(middle):
            fits = middle
        else:
            fails = middle
    return fits, fails


def context_in_budget(args) -> int:
    budget = int(args.context_budget_gib * 2**30)
    print(f"The longest context in {args.context_budget_gib:g} GiB (peak RSS of the training process on the CPU, torch's peak "
          "reserved on a GPU, for both): LoRA on SmolLM2-135M, one packed row per step, one step")
    print("| trainer | max_length | peak | within the budget | train s |")
    print("|---|---|---|---|---|")
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.context_sides:
            measure, name = SIDES[side]
            found[side] = longest_context(measure, Path(tmp), budget, args.context_lengths, name)
    for side in [s for s in found if s.startswith("ours")]:
        ours, ours_over = found[side]
        for against in [s for s in found if s.startswith("trl")]:
            trl, trl_over = found[against]
            ratio = "-" if not trl or not ours else f"{ours / trl:.2f}x"
            bounds = "" if not (trl and ours and trl_over) else f"; between {ours / trl_over:.2f}x and {(ours_over or ours) / trl:.2f}x"
            met = "MET   " if trl and ours and ours / trl >= 2 else "MISSED"
            print(f"{met} longest context in {args.context_budget_gib:g} GiB: {SIDES[side][1]} {ours} (over at {ours_over}), "
                  f"{SIDES[against][1]} {trl} (over at {trl_over}): {ratio}{bounds} (goal: >= 2x)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--methods", nargs="+", default=["lora", "full"])
    parser.add_argument("--context-budget-gib", type=float, help="instead of the table: the longest context in this budget")
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--context-sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    args = parser.parse_args()
    if args.context_budget_gib:
        return context_in_budget(args)
    print("| method | max_length | levers | peak RSS | change | row tokens/s | speed |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, method in enumerate(args.methods):
            for length in args.lengths:
                common = [f"method={method}", f"max_length={length}", f"max_steps={args.steps}", *QUIET]
                levers = levers_for(method)
                order = list(levers) if i % 2 == 0 else list(reversed(levers))
                results = {}
                for lever in order:
                    name = f"{method}-{length}-{list(levers).index(lever)}"
                    results[lever] = arm(Path(tmp), name, [*common, *levers[lever]])
                base = results["none"]
                for lever in levers:
                    r = results[lever]
                    speed = r["steps"] * length / r["train_seconds"]
                    base_speed = base["steps"] * length / base["train_seconds"]
                    print(f"| {method} | {length} | {lever} | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                          f"{r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}x | {speed:.0f} | {speed / base_speed:.2f}x |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
