"""A plain, well-written Trainer script, as an experienced user writes one: per-batch padding
(``DataCollatorWithPadding``), length grouping, transformers' default optimizer (fused AdamW), no evaluation or
saving until the end, then one evaluation, its metrics through ``evaluate`` as HF's guides do. The anchor of ``finetune_vs_reference.py``.

    python benchmarks/reference_plain_trainer.py OUT TRAIN_CSV VALIDATION_CSV EPOCHS BATCH MAX_LENGTH [static]

``PLAIN_MODEL=DIR``: that model folder instead of the shipped MiniLM (benchmarks/phases.py's nearly-free steps).

``static`` pads every example to MAX_LENGTH in preprocessing with the default collator, as HF's
``run_classification.py`` does (the second comparison line).
"""

import json
import os
import sys
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from hf_gpu_train.finetune.builtin import minilm_path  # noqa: E402

METRICS = Path(__file__).resolve().parent / "anchor_metrics"  # accuracy and macro F1 through evaluate, as HF's guides do


def main() -> None:
    out, train_csv, validation_csv = sys.argv[1], sys.argv[2], sys.argv[3]
    epochs, batch, max_length = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    static = len(sys.argv) > 7 and sys.argv[7] == "static"
    raw = load_dataset("csv", data_files={"train": train_csv, "validation": validation_csv})
    labels = sorted(set(raw["train"]["label"]))
    source = os.environ.get("PLAIN_MODEL") or minilm_path()  # benchmarks/phases.py: a tiny model, steps nearly free
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=len(labels))

    def preprocess(rows):
        encoded = tokenizer(rows["text"], truncation=True, max_length=max_length, padding="max_length" if static else False)
        encoded["labels"] = [labels.index(x) for x in rows["label"]]
        return encoded

    # every source column removed: datasets 5 keeps a replaced column's type (the string labels would stay strings)
    data = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)

    import evaluate

    metric = evaluate.load(str(METRICS))

    def compute_metrics(p):
        return metric.compute(predictions=np.argmax(p.predictions, axis=1).tolist(), references=p.label_ids.tolist())

    args = TrainingArguments(output_dir=out, num_train_epochs=epochs, per_device_train_batch_size=batch, per_device_eval_batch_size=2 * batch,
                             learning_rate=5e-5, weight_decay=0.01, warmup_steps=0.1, seed=42, eval_strategy="no", save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(), logging_steps=50,
                             bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),  # on a GPU, as a user would
                             train_sampling_strategy="random" if static else "group_by_length")
    trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["validation"],
                      data_collator=default_data_collator if static else DataCollatorWithPadding(tokenizer),
                      processing_class=tokenizer, compute_metrics=compute_metrics)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "run_summary.json").write_text(json.dumps({
        "wall_seconds": time.perf_counter() - START, "eval_accuracy": metrics["eval_accuracy"], "eval_f1": metrics["eval_f1"]}))


if __name__ == "__main__":
    main()
