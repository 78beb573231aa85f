"""Our entry point against a plain run_classification.py-style Trainer script, side by side.

Same model (the shipped MiniLM), data (built-in text set), epochs, batch, learning rate and seed;
ours pads per batch and groups by length, the reference pads to max_length. Runs alternate; the
figure is the ratio of training samples/s. Goal: >= 1.3 on CPU with equal accuracy.

    python benchmarks/finetune_vs_reference.py [--rounds 1] [--train-samples 1000] [--epochs 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], out: Path) -> dict:
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads((out / "run_summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--train-samples", type=int, default=1000)
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            out_ours, out_ref = Path(tmp) / f"ours{r}", Path(tmp) / f"ref{r}"
            ours.append(run([sys.executable, "scripts/finetune.py", f"output_dir={out_ours}", f"num_train_epochs={args.epochs}",
                             f"per_device_train_batch_size={args.batch}", f"max_length={args.max_length}",
                             f"max_train_samples={args.train_samples}", "eval_strategy=no", "save_strategy=no",
                             "telemetry=false", "oom_recovery=false"], out_ours))
            theirs.append(run([sys.executable, "benchmarks/reference_run_classification.py", str(out_ref), str(args.epochs),
                               str(args.batch), str(args.max_length), str(args.train_samples)], out_ref))
    print(f"MiniLM-L6, built-in text set, {args.train_samples} train samples, {args.epochs} epoch(s), batch {args.batch}, "
          f"max_length {args.max_length}, CPU, {args.rounds} round(s)")
    print(f"{'':<28} {'samples/s':>10} {'accuracy':>9} {'macro F1':>9}")
    for name, rows in (("hf_gpu_train finetune.py", ours), ("run_classification style", theirs)):
        print(f"{name:<28} {statistics.median(r['train_samples_per_second'] for r in rows):>10.1f} "
              f"{statistics.median(r['eval_accuracy'] for r in rows):>9.4f} {statistics.median(r['eval_f1'] for r in rows):>9.4f}")
    ratio = statistics.median(o["train_samples_per_second"] / t["train_samples_per_second"] for o, t in zip(ours, theirs))
    gap = abs(statistics.median(r["eval_accuracy"] for r in ours) - statistics.median(r["eval_accuracy"] for r in theirs))
    print(f"samples/s ratio (ours / reference): {ratio:.2f} (goal >= 1.3: {'met' if ratio >= 1.3 else 'NOT met'}); "
          f"accuracy difference {gap:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
