"""Memory levers (issue 19): peak memory and speed of each lever added in turn, torchtune-style, on the real
SmolLM2-135M-Instruct (the recipe recipes/smollm2_lora_demo.yaml: its chat rows, packed into rows of max_length).

Levers, each added to the ones above (the order of hf_gpu_train/launch/lever_table.py): the chunked LM head and loss
(``chunked_lm_loss``), the optimizer step in the backward (``optimizer_in_backward``, full fine-tuning only), selective
checkpointing (``checkpoint_layers=selective``), checkpointing every layer (``checkpoint_layers=all``, replacing it).
Activation offloading has nothing to offload on the CPU (the activations are in host memory): it is measured on a GPU by
scripts/gpu_check.py. Each arm is a fresh process (benchmarks/memory_levers_arm.py); the arms of one configuration run
back to back, in alternating order. Gradient clipping is off in every arm (the optimizer in the backward cannot clip),
so the arms differ by their levers only.

Measured: peak RSS of the training process (on the CPU: model, optimizer state, activations, logits, and what the
allocator keeps) and row capacity per second (steps x rows x max_length / seconds of train(): packed rows are
nearly full). Evaluation, checkpoints, telemetry and generation are off in every arm, so train() is the steps alone.

    python benchmarks/memory_levers.py [--steps 3] [--lengths 512 2048] [--methods lora full]
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
    "+ checkpointing every layer": ["chunked_lm_loss=true", "optimizer_in_backward=true", "gradient_checkpointing=true",
                                    "checkpoint_layers=all"],
}
QUIET = ["eval_strategy=no", "save_strategy=no", "telemetry=false", "generation_samples=0", "per_device_train_batch_size=1",
         "logging_steps=1", "resume=never", "max_eval_samples=4", "extra={max_grad_norm: 0}"]


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--methods", nargs="+", default=["lora", "full"])
    args = parser.parse_args()
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
