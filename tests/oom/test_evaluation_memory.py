"""An evaluation's own memory (issue 36): the predictions a Trainer keeps for its compute_metrics pile up over the set;
the guard ``enable_oom_recovery`` installs projects them at the first batch and says so, with the fix, before they are
spent; what the fine-tune keeps (the loss of a causal LM, a classifier's class ids) stays flat with the set."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_gpu_train.oom import enable_oom_recovery
from hf_gpu_train.oom import evaluation_memory as guard_module

PROBE = Path(__file__).with_name("evaluation_probe.py")
VOCAB, SEQ, ROWS = 32000, 64, 24


def llama_trainer(tmp_path, rows: int = ROWS, **kw):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,)), "labels": torch.randint(0, VOCAB, (SEQ,))} for _ in range(rows)]
    args = TrainingArguments(str(tmp_path), per_device_eval_batch_size=8, report_to="none", use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, eval_dataset=data, **kw)


def test_the_predictions_an_evaluation_will_keep_are_projected_at_its_first_batch_and_said_with_the_fix(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(guard_module, "HOST_SHARE", 1e-6)  # this machine's RAM holds 24 rows easily: any size is "too much"
    trainer = llama_trainer(tmp_path, compute_metrics=lambda p: {"n": float(p.predictions.shape[0])})
    recovery = enable_oom_recovery(trainer)
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train.oom"):
        metrics = trainer.evaluate()
        trainer.evaluate()
    guard = trainer._hf_gpu_train_evaluation_guard
    assert guard.projected_bytes == ROWS * SEQ * VOCAB * 4 * 2  # fp32 logits of every row, twice at the join
    said = [r.getMessage() for r in caplog.records if "this evaluation keeps its predictions" in r.getMessage()]
    assert len(said) == 1 and "preprocess_logits_for_metrics" in said[0] and f"for {ROWS} rows" in said[0]
    assert metrics["eval_n"] == ROWS and recovery is not None  # the evaluation itself is untouched


def test_an_evaluation_of_the_loss_only_is_not_projected(tmp_path, caplog):
    trainer = llama_trainer(tmp_path)  # no compute_metrics: the Trainer keeps the loss only
    enable_oom_recovery(trainer)
    trainer.evaluate()
    assert trainer._hf_gpu_train_evaluation_guard.projected_bytes is None


def peak_rise_mib(small: int, large: int, kept: str) -> float:
    done = subprocess.run([sys.executable, str(PROBE), str(small), str(large), kept], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kept_logits_grow_with_the_set_and_what_the_fine_tune_keeps_stays_flat():
    """Peak memory of one evaluation, 8 rows against 64, measured in processes of their own (a Llama with a 32,000-token
    vocabulary, sequences of 64): the logits kept for a compute_metrics grow by about the guard's projection
    (56 rows x 64 x 32000 x 4 B x 2 = 875 MiB); the loss only (scripts/finetune.py's causal LM) and token ids
    (preprocess_logits_for_metrics) stay flat."""
    growth = {kept: peak_rise_mib(8, 64, kept) for kept in ("logits", "loss", "ids")}
    projected = 56 * SEQ * VOCAB * 4 * 2 / 2**20
    assert 0.6 * projected < growth["logits"] < 1.4 * projected, f"kept logits grew by {growth['logits']:.0f} MiB"
    assert growth["loss"] < 32 and growth["ids"] < 32, f"loss only: +{growth['loss']:.0f} MiB, ids: +{growth['ids']:.0f} MiB"
