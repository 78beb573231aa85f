"""``scripts/finetune.py`` with every default on, against a plain, well-written Trainer script, side by side.

Data: real short texts (sentences of Python's reference manual in 5 sections: benchmarks/real_texts.py).
Same model (the shipped MiniLM-L6), epochs, batch, max_length, learning rate and seed. Ours runs exactly as a
user gets it (telemetry, OOM recovery, evaluation and checkpoints on their defaults); the anchor
(benchmarks/reference_plain_trainer.py) pads per batch, groups by length, uses transformers' default optimizer and
evaluates once at the end. Second line: the same anchor padding every example to max_length, as HF's
run_classification.py does. Runs alternate; each figure is the wall time of the whole process (start to the
final evaluation and saved model), and the ratio is ours / anchor. Goal: <= 1.0 at equal accuracy.

On a shared 2-core machine one pair of runs differs by up to +-10% from the next for no reason of its own, so the
ratio is the median over rounds, printed with every round's figures; the static-padding line (about half our speed)
needs one round, not all of them.

    python benchmarks/finetune_vs_reference.py [--rounds 6] [--static-rounds 1] [--epochs 4] [--batch 32] [--max-length 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_texts import write  # noqa: E402


def timed(cmd: list[str], out: Path) -> dict:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((out / "run_summary.json").read_text())
    return {"wall_seconds": time.perf_counter() - start, "eval_accuracy": summary["eval_accuracy"], "eval_f1": summary["eval_f1"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--static-rounds", type=int, default=1, help="rounds that also run the static-padding script")
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=96)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"ours": [], "plain": [], "static": []}
    with tempfile.TemporaryDirectory() as tmp:
        train_csv, validation_csv = write(Path(tmp) / "data")
        for r in range(args.rounds):
            order = ("ours", "plain", "static") if r % 2 == 0 else ("static", "plain", "ours")
            for arm in (a for a in order if a != "static" or r < args.static_rounds):
                out = Path(tmp) / f"{arm}{r}"
                if arm == "ours":
                    cmd = [sys.executable, "scripts/finetune.py", f"output_dir={out}", f"train_file={train_csv}",
                           f"validation_file={validation_csv}", f"num_train_epochs={args.epochs}",
                           f"per_device_train_batch_size={args.batch}", f"max_length={args.max_length}",
                           "learning_rate=5e-5", "evaluate_before=false"]  # the plain script's rate; it evaluates no untrained model
                else:
                    cmd = [sys.executable, "benchmarks/reference_plain_trainer.py", str(out), str(train_csv), str(validation_csv),
                           str(args.epochs), str(args.batch), str(args.max_length)] + (["static"] if arm == "static" else [])
                runs[arm].append(timed(cmd, out))
    print(f"MiniLM-L6 on Python reference-manual sentences (5 classes), {args.epochs} epochs, batch {args.batch}, "
          f"max_length {args.max_length}, CPU, {args.rounds} round(s), alternating")
    print(f"{'':<40} {'wall s':>8} {'accuracy':>9} {'macro F1':>9}  (medians)")
    names = {"ours": "scripts/finetune.py, defaults (2 pinned)", "plain": "plain Trainer (dynamic padding, grouped)",
             "static": "run_classification style (static pad)"}
    runs = {arm: rows for arm, rows in runs.items() if rows}  # --static-rounds 0: no static arm
    for arm, rows in runs.items():
        print(f"{names[arm]:<40} {statistics.median(r['wall_seconds'] for r in rows):>8.1f} "
              f"{statistics.median(r['eval_accuracy'] for r in rows):>9.4f} {statistics.median(r['eval_f1'] for r in rows):>9.4f}")
    for arm, rows in runs.items():
        print(f"  {arm} wall s per round: {[round(r['wall_seconds'], 1) for r in rows]}")
    for anchor in ("plain", "static"):
        ratios = [o["wall_seconds"] / a["wall_seconds"] for o, a in zip(runs["ours"], runs.get(anchor, []))]
        if not ratios:
            continue
        print(f"wall time ours / {names[anchor]}: {statistics.median(ratios):.3f} (per round {[round(x, 3) for x in ratios]})"
              + (" goal <= 1.0" if anchor == "plain" else ""))
    gap = statistics.median(r["eval_accuracy"] for r in runs["ours"]) - statistics.median(r["eval_accuracy"] for r in runs["plain"])
    print(f"accuracy ours - plain: {gap:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
