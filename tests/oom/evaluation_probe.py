"""Evaluations of a Llama with a 32,000-token vocabulary (sequences of 64), in a process of its own: a set of SMALL rows,
then one of LARGE rows; prints how much the process's peak memory rose during the second, in MiB (the first set the
peak the second must pass). ``python evaluation_probe.py SMALL LARGE KEPT``, KEPT:
``logits`` (a compute_metrics reading the logits), ``ids`` (the same metric, the logits reduced to token ids by
preprocess_logits_for_metrics) or ``loss`` (no compute_metrics: the loss only, as scripts/finetune.py evaluates a causal
LM)."""

from __future__ import annotations

import resource
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ = 32000, 64


def accuracy(prediction):
    ids = prediction.predictions if prediction.predictions.ndim == 2 else prediction.predictions.argmax(-1)
    return {"accuracy": float((ids == prediction.label_ids).mean())}


def main(small: int, large: int, kept: str) -> float:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    args = TrainingArguments(tempfile.mkdtemp(), per_device_eval_batch_size=8, report_to="none", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, compute_metrics=None if kept == "loss" else accuracy,
                      preprocess_logits_for_metrics=(lambda logits, labels: logits.argmax(-1)) if kept == "ids" else None)
    peaks = []
    for rows in (small, large):
        data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,)), "labels": torch.randint(0, VOCAB, (SEQ,))} for _ in range(rows)]
        trainer.evaluate(eval_dataset=data)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return peaks[1] - peaks[0]


if __name__ == "__main__":
    print(f"{main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]):.1f}")
