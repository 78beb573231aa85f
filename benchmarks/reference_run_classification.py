"""A plain Trainer script written the way HF's ``examples/pytorch/text-classification/run_classification.py``
does it: pad every example to max_length in preprocessing (``padding="max_length"``), the default data
collator, default dataloader settings. Same model and data as our default run. Used only by
``finetune_vs_reference.py``; metrics through our offline evaluate module (the hub one needs network).

    python benchmarks/reference_run_classification.py OUTPUT_DIR EPOCHS BATCH MAX_LENGTH TRAIN_SAMPLES
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments, default_data_collator  # noqa: E402

from hf_gpu_train.finetune.builtin import minilm_path, text_dataset  # noqa: E402
from hf_gpu_train.finetune.metrics import classification_metric  # noqa: E402


def main() -> None:
    out, epochs, batch, max_length, samples = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    raw = text_dataset()
    labels = sorted(set(raw["train"]["label"]))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=len(labels))

    def preprocess(batch):
        result = tokenizer(batch["text"], padding="max_length", max_length=max_length, truncation=True)
        result["label"] = [labels.index(x) for x in batch["label"]]
        return result

    train = raw["train"].select(range(samples)).map(preprocess, batched=True, remove_columns=["text"])
    evaluation = raw["validation"].map(preprocess, batched=True, remove_columns=["text"])

    def compute_metrics(p):
        return classification_metric().compute(predictions=np.argmax(p.predictions, axis=1).tolist(), references=p.label_ids.tolist())

    args = TrainingArguments(output_dir=out, num_train_epochs=epochs, per_device_train_batch_size=batch, learning_rate=5e-5,
                             weight_decay=0.01, warmup_steps=0.1, seed=42, eval_strategy="no", save_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=50)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation, data_collator=default_data_collator,
                      processing_class=tokenizer, compute_metrics=compute_metrics)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "run_summary.json").write_text(json.dumps({
        "train_seconds": seconds, "train_samples_per_second": result.metrics["train_samples_per_second"],
        "eval_accuracy": metrics["eval_accuracy"], "eval_f1": metrics["eval_f1"]}))


if __name__ == "__main__":
    main()
