"""Issue 41: what ZeRO-2, ZeRO-3 and FSDP train and evaluate against DDP on the same 2 CPU processes, for the shipped
BatchNorm vision recipe, with gradient clipping off and on, each strategy against itself (the same command twice), and
DDP against itself with max_grad_norm moved in its 7th digit (how much this run amplifies a 1e-7 change of the clip
factor).

    python benchmarks/strategy_agreement.py [--steps 6]

The issue's run: ``--config efficientnet_lite0_digits`` with ``per_device_train_batch_size=8``, ``max_steps=6``, seed 7,
augmentation off, AdamW's eps 1e-6, each strategy planned by ``hf-gpu-train config --strategy S`` and launched by
``hf-gpu-train launch``. Printed: the logged losses' largest relative difference, the saved weights' and running
statistics' largest absolute difference (the statistics' relative too), and the final evaluation's loss and accuracy
of each side. Deterministic: the figures are equalities, not timings (about 20 s a run on 2 cores)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch

sys.path.insert(0, str(ROOT))

NO_CLIP = "extra={adam_epsilon: 1.0e-6, max_grad_norm: 0.0}"
CLIP = "extra={adam_epsilon: 1.0e-6}"  # max_grad_norm 1.0, the Trainer's default
CLIP_MOVED = "extra={adam_epsilon: 1.0e-6, max_grad_norm: 1.0000001}"
AGAIN = " "  # the same arguments, a second run (a space more: another key, the same command)
ROWS = (  # (label, (strategy, extra), (strategy, extra))
    ("DDP against DDP, the same command twice", ("ddp", CLIP), ("ddp", CLIP + AGAIN)),
    ("ZeRO-2 against ZeRO-2, the same command twice", ("deepspeed-zero2", CLIP), ("deepspeed-zero2", CLIP + AGAIN)),
    ("ZeRO-2 against DDP, clipping off", ("deepspeed-zero2", NO_CLIP), ("ddp", NO_CLIP)),
    ("ZeRO-3 against DDP, clipping off", ("deepspeed-zero3", NO_CLIP), ("ddp", NO_CLIP)),
    ("FSDP against DDP, clipping off", ("fsdp", NO_CLIP), ("ddp", NO_CLIP)),
    ("ZeRO-2 against DDP, clipped at 1.0", ("deepspeed-zero2", CLIP), ("ddp", CLIP)),
    ("ZeRO-3 against DDP, clipped at 1.0", ("deepspeed-zero3", CLIP), ("ddp", CLIP)),
    ("DDP at max_grad_norm 1.0 against 1.0000001", ("ddp", CLIP), ("ddp", CLIP_MOVED)),
)


def train(config: str, out: Path, extra: str, steps: int) -> Path:
    run = launch(config, "-m", "hf_gpu_train.finetune", "--config", "efficientnet_lite0_digits", f"max_steps={steps}",
                 "logging_steps=1", "eval_strategy=no", "save_strategy=no", "seed=7", "evaluate_before=false",
                 "per_device_train_batch_size=8", "telemetry=false",
                 "augmentation={scale: [1.0, 1.0], ratio: [1.0, 1.0], hflip: 0.0, color_jitter: 0.0}", extra.strip(),
                 f"output_dir={out}")
    if run.returncode != 0:
        raise SystemExit(f"{out.name} failed:\n{run.stderr[-3000:]}")
    return out


def compare(a: Path, b: Path) -> str:
    from safetensors.torch import load_file

    def logged(out: Path, key: str) -> list[float]:
        return [h[key] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if key in h]

    losses = max(abs(x - y) / abs(y) for x, y in zip(logged(a, "loss"), logged(b, "loss")))
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    weights, statistics, relative = 0.0, 0.0, 0.0
    for key in wb:
        diff = (wa[key].double() - wb[key].double()).abs().max().item()
        if "running_" in key or "num_batches_tracked" in key:
            statistics = max(statistics, diff)
            relative = max(relative, diff / max(wb[key].double().abs().max().item(), 1e-30))
        else:
            weights = max(weights, diff)
    ea, eb = (json.loads((out / "all_results.json").read_text()) for out in (a, b))
    return (f"| {losses:.2g} | {weights:.2g} | {statistics:.2g} ({relative:.2g} relative) | "
            f"{ea['eval_loss']:.7g} / {eb['eval_loss']:.7g} | {ea['eval_accuracy']:.4f} / {eb['eval_accuracy']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        made = {strategy: cpu_config(folder, 2, strategy) for strategy in ("ddp", "deepspeed-zero2", "deepspeed-zero3", "fsdp")}
        runs = {}
        for _, *sides in ROWS:
            for strategy, extra in sides:
                key = (strategy, extra)
                if key not in runs:
                    runs[key] = train(made[strategy], folder / f"run{len(runs)}", extra, args.steps)
        print("| comparison | logged losses, max rel. diff | weights, max abs diff | running statistics, max abs diff | "
              "evaluation loss (first / second) | evaluation accuracy (first / second) |")
        print("|---|---|---|---|---|---|")
        for label, first, second in ROWS:
            print(f"| {label} {compare(runs[first], runs[second])}")


if __name__ == "__main__":
    main()
