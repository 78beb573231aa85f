"""Where a short fine-tune's wall time goes, by phase: ``scripts/finetune.py`` as shipped against a plain Trainer script.

Each run is a process of its own, started and waited for here; inside it ``phase_clock.py`` notes when the first and
the last optimizer step end and clocks what both scripts call (the model load, ``Dataset.map``, the Trainer's
construction, its training steps, evaluations, saves and callbacks; neither script is changed). Phases: process start
to the end of the first optimizer step (imports, model load, data preparation, what runs before the first step: our
evaluation before training), the steps (the first step's end to the last's: the steps and what runs between them),
and the last step's end to the process's exit (the training's end, the final evaluation, saving, our report, the
interpreter's exit); then
each phase by item, ours beside the plain script's. Both scripts get the same data, epochs, batch, max_length and
learning rate; ours keeps every other default as shipped (the evaluation before training included).

Three shapes: ``minilm``, the default run (MiniLM-L6 on sentences of Python's reference manual in 5 classes,
``real_texts.py``); ``unseen``, MiniLM-L6 on a text set the project was never tuned on (docstring sentences of five
standard-library packages, ``unseen_texts.py``: 1,000 / 250 rows); ``tiny``, a nearly-free step: a BERT of width 16
and one layer with MiniLM's tokenizer on the default run's data, standing in for a fast GPU, where the fixed work is
most of the run. Alternating arms, ``--rounds`` rounds, medians.

    python benchmarks/phases.py [--rounds 1] [--epochs 4] [--shapes minilm unseen tiny]
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

import real_texts  # noqa: E402
import unseen_texts  # noqa: E402


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
    clock = json.loads(record.read_text())
    summary = json.loads((out / "run_summary.json").read_text())
    # the boundaries phase_clock.py files its items by: the first and the last optimizer step's ends
    phases = {"start": clock["first_step_end"] - began, "steps": clock["last_step_end"] - clock["first_step_end"],
              "end": ended - clock["last_step_end"]}
    return {"wall": ended - began, "to_first_step": phases["start"], "steps": phases["steps"], "after_last_step": phases["end"],
            "optimizer_steps": clock["steps"], "padded_tokens": clock.get("padded_tokens", 0), "accuracy": summary.get("eval_accuracy"), "items": items(clock, began, ended)}


def items(clock: dict, began: float, ended: float) -> dict[str, float]:
    """Each phase's seconds by what is in it (phase_clock.py's clocked calls), the unclocked rest named by where it is:
    the interpreter and the libraries both scripts import before the clock, the script's own imports and setup, the
    loop's data, optimizer and host work between steps, and what runs after the last step up to the script's end."""
    found = dict(clock["items"])
    found["start/interpreter, torch, transformers, datasets"] = clock["clock_installed"] - began
    bounds = {"start": (clock["clock_installed"], clock["first_step_end"]),
              "steps": (clock["first_step_end"], clock["last_step_end"]),
              "end": (clock["last_step_end"], clock.get("script_returned", ended))}
    rest = {"start": "script imports, arguments, tokenizer, plan, train() setup, first optimizer step (unclocked)",
            "steps": "data, optimizer, host between steps (unclocked)",
            "end": "training's end, report, summary, outputs (unclocked)"}
    for phase, (low, high) in bounds.items():
        clocked = sum(v for k, v in clock["items"].items() if k.startswith(phase + "/"))
        found[f"{phase}/{rest[phase]}"] = high - low - clocked
    found["end/interpreter exit"] = ended - clock.get("script_returned", ended)
    return found


def print_items(rows: list[dict]) -> None:
    """What is in each phase: seconds by item, ours beside the plain script's, items under 0.05 s in both left out."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        arms = {r["arm"]: r["items"] for r in rows if r["shape"] == shape}
        print(f"\n{shape}: what is in each phase (seconds)\n| phase | item | ours | plain |\n|---|---|---|---|")
        order = {"start": 0, "steps": 1, "end": 2}
        keys = sorted({k for found in arms.values() for k in found}, key=lambda k: (order[k.split("/")[0]], k))
        for key in keys:
            ours, plain = arms.get("ours", {}).get(key, 0.0), arms.get("plain", {}).get(key, 0.0)
            if max(abs(ours), abs(plain)) >= 0.05:
                phase, item = key.split("/", 1)
                print(f"| {phase} | {item} | {ours:.2f} | {plain:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--shapes", nargs="+", choices=("minilm", "unseen", "tiny"), default=["minilm", "unseen", "tiny"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shipped = real_texts.write(Path(tmp) / "data")
        texts = {"minilm": shipped, "tiny": shipped, "unseen": unseen_texts.write(Path(tmp) / "unseen")}
        for shape in args.shapes:
            model = tiny_model(Path(tmp) / "tiny") if shape == "tiny" else None
            data = texts[shape]
            found: dict[str, list[dict]] = {"ours": [], "plain": []}
            for r in range(args.rounds):
                for arm in (("ours", "plain") if r % 2 == 0 else ("plain", "ours")):
                    found[arm].append(run(arm, Path(tmp) / f"{shape}-{arm}-{r}", data, args, model))
            for arm, runs in found.items():
                keys = sorted({k for x in runs for k in x["items"]})
                rows.append({"shape": shape, "arm": arm, **{k: statistics.median(x[k] for x in runs) for k in runs[0]
                                                            if k not in ("accuracy", "items")},
                             "accuracy": statistics.median(x["accuracy"] for x in runs),
                             "items": {k: statistics.median(x["items"].get(k, 0.0) for x in runs) for k in keys}})
    print(f"{args.epochs} epochs, batch {args.batch}, max_length {args.max_length}, {args.rounds} round(s), medians, seconds")
    print("| shape | script | wall | start to the first step's end | first to last step | last step to exit | optimizer steps | padded tokens | accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        name = "scripts/finetune.py (defaults)" if row["arm"] == "ours" else "plain Trainer script"
        print(f"| {row['shape']} | {name} | {row['wall']:.1f} | {row['to_first_step']:.1f} | {row['steps']:.1f} | "
              f"{row['after_last_step']:.1f} | {row['optimizer_steps']:.0f} | {row['padded_tokens']:.0f} | {row['accuracy']:.4f} |")
    print_items(rows)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
