"""Evaluations of a Llama with a 32,000-token vocabulary (sequences of 64), in a process of its own: a set of SMALL rows,
then one of LARGE rows; prints how much more the second raised the process's resident memory above where it stood
before it than the first did, in MiB (the resident memory sampled every 5 ms during each evaluation: the process's
own peak counter never comes down, so it cannot tell two evaluations apart). ``python evaluation_probe.py SMALL LARGE
KEPT``, KEPT:
``logits`` (a compute_metrics reading the logits), ``ids`` (the same metric, the logits reduced to token ids by
preprocess_logits_for_metrics) or ``loss`` (no compute_metrics: the loss only, as scripts/finetune.py evaluates a causal
LM)."""

from __future__ import annotations

import sys
import tempfile
import threading

import psutil
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
    rises = []
    for rows in (small, large):
        data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,)), "labels": torch.randint(0, VOCAB, (SEQ,))} for _ in range(rows)]
        rises.append(rise_during(lambda data=data: trainer.evaluate(eval_dataset=data)))
    return rises[1] - rises[0]


def rise_during(work) -> float:
    """MiB the process's resident memory rose above its level before ``work`` while it ran."""
    process = psutil.Process()
    before = peak = process.memory_info().rss
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    peak = max(peak, process.memory_info().rss)
    return (peak - before) / 2**20

if __name__ == "__main__":
    print(f"{main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]):.1f}")
