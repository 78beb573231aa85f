"""Where a short fine-tune's wall time goes, by phase: ``scripts/finetune.py`` as shipped against a plain Trainer script.

Issue 40's first slice, the measurement. Each run is a process of its own, started and waited for here; inside it
``phase_clock.py`` notes when the first and the last optimizer step end (a torch optimizer-step hook: neither script is
changed). Phases: process start to the end of the first optimizer step (imports, model load, data preparation, what
runs before the first step: our evaluation before training), the steps (first step's end to the last's), and the last
step's end to the process's exit (the final evaluation, saving, our report). Both scripts get the same data (real
sentences of Python's reference manual in 5 classes, ``real_texts.py``), epochs, batch, max_length and learning rate;
ours keeps every other default as shipped (the evaluation before training included).

Two shapes: MiniLM-L6 (the shipped model) and a nearly-free step: a BERT of width 16 and one layer with MiniLM's
tokenizer, standing in for a fast GPU, where the steps take little and the fixed work is most of the run. Alternating
arms, ``--rounds`` rounds, medians.

    python benchmarks/phases.py [--rounds 1] [--epochs 4] [--shapes minilm tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from real_texts import write  # noqa: E402


def tiny_model(folder: Path) -> Path:
    """A one-layer BERT of width 16 with MiniLM's tokenizer and vocabulary, saved where both scripts can load it."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from hf_gpu_train.finetune.builtin import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=512, num_labels=5)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(arm: str, out: Path, data: tuple[Path, Path], args, model: Path | None) -> dict:
    record = out.with_suffix(".phases.json")
    if arm == "ours":
        script = [str(ROOT / "scripts" / "finetune.py"), f"output_dir={out}", f"train_file={data[0]}",
                  f"validation_file={data[1]}", f"num_train_epochs={args.epochs}", f"per_device_train_batch_size={args.batch}",
                  f"max_length={args.max_length}", "learning_rate=5e-5"] + ([f"model={model}"] if model else [])
    else:
        script = [str(ROOT / "benchmarks" / "reference_plain_trainer.py"), str(out), str(data[0]), str(data[1]),
                  str(args.epochs), str(args.batch), str(args.max_length)]
    env = {**os.environ, **({"PLAIN_MODEL": str(model)} if model else {})}
    began = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phase_clock.py"), str(record), *script], cwd=ROOT,
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{arm}: exit {done.returncode}\n{done.stderr[-3000:]}")
    steps = json.loads(record.read_text())
    summary = json.loads((out / "run_summary.json").read_text())
    return {"wall": ended - began, "to_first_step": steps["first_step_end"] - began,
            "steps": steps["last_step_end"] - steps["first_step_end"], "after_last_step": ended - steps["last_step_end"],
            "optimizer_steps": steps["steps"], "accuracy": summary.get("eval_accuracy")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--shapes", nargs="+", choices=("minilm", "tiny"), default=["minilm", "tiny"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = write(Path(tmp) / "data")
        for shape in args.shapes:
            model = tiny_model(Path(tmp) / "tiny") if shape == "tiny" else None
            found: dict[str, list[dict]] = {"ours": [], "plain": []}
            for r in range(args.rounds):
                for arm in (("ours", "plain") if r % 2 == 0 else ("plain", "ours")):
                    found[arm].append(run(arm, Path(tmp) / f"{shape}-{arm}-{r}", data, args, model))
            for arm, runs in found.items():
                rows.append({"shape": shape, "arm": arm, **{k: statistics.median(x[k] for x in runs) for k in runs[0]
                                                            if k != "accuracy"},
                             "accuracy": statistics.median(x["accuracy"] for x in runs)})
    print(f"{args.epochs} epochs, batch {args.batch}, max_length {args.max_length}, {args.rounds} round(s), medians, seconds")
    print("| shape | script | wall | start to first step | steps | last step to exit | optimizer steps | accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        name = "scripts/finetune.py (defaults)" if row["arm"] == "ours" else "plain Trainer script"
        print(f"| {row['shape']} | {name} | {row['wall']:.1f} | {row['to_first_step']:.1f} | {row['steps']:.1f} | "
              f"{row['after_last_step']:.1f} | {row['optimizer_steps']:.0f} | {row['accuracy']:.4f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
