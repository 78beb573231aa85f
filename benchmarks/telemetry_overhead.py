"""The same training with and without the telemetry callbacks, alternating in one invocation.

Prints the steps/s ratio (with / without). Goal: >= 0.99 on CPU and on a GPU. The model is the
shipped MiniLM on the built-in text set; the telemetry samples every second as in a real run and
logs every ``--logging-steps`` steps.

    python benchmarks/telemetry_overhead.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(out: str, steps: int, logging_steps: int, on_cuda: bool):
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from hf_gpu_train.finetune.builtin import minilm_path, text_dataset

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    data = text_dataset()["train"].map(lambda b: tokenizer(b["text"], truncation=True, max_length=64), batched=True)
    data = data.map(lambda b: {"labels": [int(x == "positive") for x in b["label"]]}, batched=True).remove_columns(["text", "label"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=32, logging_steps=logging_steps,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=not on_cuda,
                             bf16=on_cuda and torch.cuda.is_bf16_supported(including_emulation=False), seed=0)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithPadding(tokenizer))


def measure(rounds: int, steps: int, logging_steps: int) -> tuple[list[float], list[float], object]:
    import torch

    from hf_gpu_train.callbacks import attach_telemetry

    on_cuda = torch.cuda.is_available()
    plain, with_telemetry, last = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp, 5, logging_steps, on_cuda).train()  # warm-up: caches, allocator, kernels
        for r in range(rounds):
            for use in ((False, True) if r % 2 == 0 else (True, False)):
                trainer = build(f"{tmp}/{r}{use}", steps, logging_steps, on_cuda)
                if use:
                    last = attach_telemetry(trainer, write_report=False)
                result = trainer.train()
                (with_telemetry if use else plain).append(result.metrics["train_steps_per_second"])
    return plain, with_telemetry, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--logging-steps", type=int, default=10)
    args = parser.parse_args()
    import torch

    plain, telemetry, callback = measure(args.rounds, args.steps, args.logging_steps)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"MiniLM-L6, {args.steps} steps x {args.rounds} rounds (alternating), logging every {args.logging_steps}, {device}")
    print(f"steps/s without telemetry: {', '.join(f'{x:.2f}' for x in plain)} (median {statistics.median(plain):.3f})")
    print(f"steps/s with telemetry:    {', '.join(f'{x:.2f}' for x in telemetry)} (median {statistics.median(telemetry):.3f})")
    ratio = statistics.median(telemetry) / statistics.median(plain)
    print(f"ratio (with / without): {ratio:.3f} (goal >= 0.99: {'met' if ratio >= 0.99 else 'NOT met'})")
    if callback is not None and callback.last_verdict is not None:
        mfu = [r["metrics"].get("train/mfu_pct") for r in callback.records if r["metrics"].get("train/mfu_pct")]
        print(f"last verdict: {callback.last_verdict.line()}")
        print(f"MFU: {statistics.median(mfu):.1f}%" if mfu else "MFU: n/a (CPU or unknown GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
