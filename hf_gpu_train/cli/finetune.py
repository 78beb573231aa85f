"""``hf-gpu-train finetune --config NAME_OR_PATH [key=value ...]``: the fine-tune of ``scripts/finetune.py``, in this
process, from an installed package. Several processes: ``hf-gpu-train launch`` or ``accelerate launch -m
hf_gpu_train.finetune`` (the same arguments). Nothing heavy is imported before ``run``: ``--help`` needs no torch."""

from __future__ import annotations

import argparse

from ..finetune.recipe_names import RECIPES_DIR, shipped_names
from ..finetune.run import main
from ..process_group import leave_process_group


def register(subparsers) -> argparse.ArgumentParser:

    p = subparsers.add_parser(
        "finetune", help="fine-tune with a shipped recipe or your own, in this one process",
        description="Fine-tune a transformers or timm model (text or image classification, causal LM with LoRA/QLoRA) "
        "with the Hugging Face Trainer, in this one process: the CPU, or one GPU. key=value after the recipe overrides it "
        "(any key of the config, e.g. max_steps=2 output_dir=out). For several processes (GPUs, nodes) launch the same "
        "arguments with `hf-gpu-train launch --config-file F.yaml -m hf_gpu_train.finetune --config ...` or "
        "`accelerate launch -m hf_gpu_train.finetune --config ...`.",
        epilog=f"shipped recipes ({RECIPES_DIR}):\n  " + "\n  ".join(shipped_names()))
    p.add_argument("--config", metavar="NAME_OR_PATH",
                   help="a shipped recipe's name (below) or a YAML recipe file; none: the default run (MiniLM, built-in text)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config values over the recipe's")
    return p


def run(args: argparse.Namespace) -> int:

    code = main([*(["--config", args.config] if args.config is not None else []), *args.overrides],
                prog="hf-gpu-train finetune")
    if code == 0:
        leave_process_group()  # as scripts/finetune.py's exit_process: Gloo's threads could otherwise abort the exit
    return code
