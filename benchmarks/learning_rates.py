"""The default learning rate by model family against the one-number default it replaced (5e-5 for every classifier).

    python benchmarks/learning_rates.py                 # all four cases, two arms each: ~25-35 min on 2 CPU cores
    python benchmarks/learning_rates.py --cases shapes  # one case

Each case runs ``scripts/finetune.py`` twice, the same config, once with ``learning_rate=5e-5`` and once with
``learning_rate`` left to the model (``hf_gpu_train/finetune/learning_rates.py``), and prints validation accuracy and
macro F1 after training next to the untrained head's (``baseline_results.json``):

- ``python-docs``: MiniLM-L6 (width 384) on the default run's real text (the default config: 3 epochs).
- ``digits``: EfficientNet-Lite0 (ImageNet weights, BatchNorm) on scikit-learn's digits
  (the shipped recipe ``efficientnet_lite0_digits`` with its learning rate removed).
- ``shapes``: the same model on a second image set made here: 64x64 pictures of a circle, a square or a triangle of
  random size, position, rotation and colour on a noisy background of another colour (120 per class, seeded), written
  as an ``imagefolder:`` directory; 3 epochs at batch 32.
- ``shapes-defaults``: the same folder as a new user would run it, the model and the folder and nothing else (224x224,
  timm's default augmentation, batch 32, 3 epochs).

Accuracy, not time, is the figure: the arms of one case train the same steps on the same data.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_DEFAULT = 5e-5
SHAPES = ("circle", "square", "triangle")


def write_shapes(folder: Path, per_class: int = 120, size: int = 64, seed: int = 0) -> Path:
    """An image folder of three shapes (one sub-directory per class), every picture drawn from a seeded generator."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    for shape in SHAPES:
        (folder / shape).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            background = tuple(rng.randrange(0, 256) for _ in range(3))
            image = Image.new("RGB", (size, size), background)
            pixels = image.load()
            for _ in range(size * size // 6):  # speckle noise: the shape is not the only edge in the picture
                x, y = rng.randrange(size), rng.randrange(size)
                pixels[x, y] = tuple(min(255, max(0, c + rng.randint(-60, 60))) for c in background)
            colour = tuple((c + rng.randrange(80, 176)) % 256 for c in background)
            radius = rng.uniform(size * 0.15, size * 0.35)
            cx, cy = rng.uniform(radius, size - radius), rng.uniform(radius, size - radius)
            draw = ImageDraw.Draw(image)
            if shape == "circle":
                draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=colour)
            else:
                corners = 4 if shape == "square" else 3
                turn = rng.uniform(0, 2 * math.pi)
                draw.polygon([(cx + radius * math.cos(turn + 2 * math.pi * k / corners),
                               cy + radius * math.sin(turn + 2 * math.pi * k / corners)) for k in range(corners)], fill=colour)
            image.save(folder / shape / f"{index:04d}.png")
    return folder


def cases(work: Path) -> dict[str, list[str]]:
    vision = ["task=image-classification", "model=builtin:efficientnet_lite0", "num_train_epochs=3", "weight_decay=0.05",
              "augmentation={scale: [0.7, 1.0], hflip: 0.0}"]
    return {
        "python-docs": [],
        "digits": [*vision, "dataset=builtin:digits", "image_size=64", "per_device_train_batch_size=64"],
        "shapes": [*vision, f"dataset=imagefolder:{work / 'shapes'}", "image_size=64", "per_device_train_batch_size=32"],
        # what a new user types: the model and the folder, every other value the toolkit's (224x224, batch 32, timm's
        # default augmentation, 3 epochs)
        "shapes-defaults": ["task=image-classification", "model=builtin:efficientnet_lite0", f"dataset=imagefolder:{work / 'shapes'}"],
    }


def run(overrides: list[str], output_dir: Path) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune.py"), *overrides, f"output_dir={output_dir}",
                           "telemetry=false", "save_strategy=no"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"finetune failed ({' '.join(overrides)}):\n{done.stderr[-3000:]}")
    chosen = next((line.split("hf_gpu_train: ", 1)[1] for line in done.stdout.splitlines() if "learning_rate=" in line
                   and "default for" in line), None)
    config = (output_dir / "finetune_config.yaml").read_text()
    rate = next(float(line.split(":", 1)[1]) for line in config.splitlines() if line.startswith("learning_rate:"))
    return {"learning_rate": rate, "why": chosen, **json.loads((output_dir / "eval_results.json").read_text()),
            "before": json.loads((output_dir / "baseline_results.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = ["python-docs", "digits", "shapes", "shapes-defaults"]
    parser.add_argument("--cases", nargs="+", default=names, choices=names)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_shapes(work / "shapes")
        table = []
        for name in args.cases:
            overrides = cases(work)[name]
            old = run([*overrides, f"learning_rate={OLD_DEFAULT}"], work / f"{name}-old")
            new = run(overrides, work / f"{name}-new")
            table.append((name, old, new))
            print(f"{name}: 5e-5 -> accuracy {old['eval_accuracy']:.3f}; default {new['learning_rate']:g} -> accuracy "
                  f"{new['eval_accuracy']:.3f} ({new['why']})", flush=True)
    print("\n| case | untrained head | lr 5e-5 (old default) | default lr | accuracy / macro F1 at the default |")
    print("|---|---|---|---|---|")
    for name, old, new in table:
        print(f"| {name} | {new['before']['eval_accuracy']:.3f} | {old['eval_accuracy']:.3f} / {old['eval_f1']:.3f} | "
              f"{new['learning_rate']:g} | {new['eval_accuracy']:.3f} / {new['eval_f1']:.3f} |")


if __name__ == "__main__":
    main()
