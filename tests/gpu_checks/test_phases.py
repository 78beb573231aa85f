"""scripts/gpu_check.py's `phases` section reads benchmarks/phases.py, whose figures come from phase_clock.py: here the
clock runs a real Trainer script in a process of its own, and each phase's items are checked against what the script
did (a sleep of known length in a callback, an evaluation between steps, the padded tokens of its batches), and
against the wall time they must add up to."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import phases  # noqa: E402

PROBE = """
import time
import datasets
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

folder, out = {folder!r}, {out!r}
BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, num_labels=2)).save_pretrained(folder)
model = BertForSequenceClassification.from_pretrained(folder)
lengths = [3, 5, 7, 4, 6, 8, 2, 9] * 3
rows = datasets.Dataset.from_dict({{"n": lengths}})
rows = rows.map(lambda r: {{"input_ids": list(range(1, r["n"] + 1)), "labels": r["n"] % 2}})

def collate(batch):  # padded to the batch's longest row
    longest = max(len(b["input_ids"]) for b in batch)
    ids = torch.tensor([b["input_ids"] + [0] * (longest - len(b["input_ids"])) for b in batch])
    return {{"input_ids": ids, "attention_mask": (ids > 0).long(), "labels": torch.tensor([b["labels"] for b in batch])}}

class Slow(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):  # an evaluation inside a callback, as evaluate_before's
        trainer.evaluate()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            time.sleep(0.5)

args = TrainingArguments(out, max_steps=6, per_device_train_batch_size=4, report_to="none", use_cpu=True,
                         eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=4, disable_tqdm=True,
                         logging_steps=100, remove_unused_columns=False, dataloader_num_workers=1,
                         dataloader_persistent_workers=True)
def metrics(prediction):  # each evaluation takes 0.3 s more than its forwards
    time.sleep(0.3)
    return {{}}

trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=collate, callbacks=[Slow()],
                  compute_metrics=metrics)
trainer.train()
trainer.evaluate()
trainer.save_model()
import os
os._exit(0)  # as a run of several processes ends (hf_gpu_train/fast_exit.py): no finally runs
"""


def test_the_clock_files_each_call_in_its_phase_and_the_items_add_up_to_the_wall_time(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(PROBE.format(folder=str(tmp_path / "model"), out=str(tmp_path / "out"))))
    record = tmp_path / "record.json"
    began = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phase_clock.py"), str(record), str(script)],
                          capture_output=True, text=True, cwd=tmp_path)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    clock = json.loads(record.read_text())
    assert clock["steps"] == 6
    # 6 batches of 4 rows in the Trainer's random order, each padded to its longest: between 6*4*2 and 6*4*9 tokens
    assert 48 < clock["padded_tokens"] < 6 * 4 * 9
    items = phases.items(clock, began, ended)
    assert abs(sum(items.values()) - (ended - began)) < 1e-6  # every second is in one item
    # and none twice: what is left unclocked in each phase is never below zero (nested calls are taken out of the
    # callback event that holds them)
    assert all(value >= -0.01 for value in items.values()), items
    assert 0.5 <= items["steps/callbacks: on_step_end"] < 0.5 + 0.3  # the sleep after step 2, counted once
    assert items["start/callbacks: on_train_begin"] < 0.3 <= items["start/evaluation"]  # the evaluation is its own item
    # at train begin; after step 3 (a step follows); after step 6, the last, and after train(): the end
    assert {k: clock["calls"].get(k) for k in ("start/evaluation", "steps/evaluation", "end/evaluation")} == {
        "start/evaluation": 1, "steps/evaluation": 1, "end/evaluation": 2}
    # checkpoints at step 4 and at the last step, 6 (their weights through save_model, nested), the final model after
    # train(): one in the steps, two saves of weights and one checkpoint after the last step
    saves = {k: v for k, v in clock["calls"].items() if "save" in k and "callbacks" not in k}
    assert saves == {"steps/checkpoint save (optimizer, scheduler, state)": 1,
                     "steps/model save (the final one's, and each checkpoint's weights)": 1,
                     "end/checkpoint save (optimizer, scheduler, state)": 1,
                     "end/model save (the final one's, and each checkpoint's weights)": 2}
    for key in ("start/model load", "start/data preparation (Dataset.map)", "start/Trainer.__init__",
                "start/training_step (forward, backward)", "steps/training_step (forward, backward)"):
        assert items[key] > 0, key
    # the DataLoader's worker processes (forked, ended by os._exit) never wrote their copy of the clock over it, and
    # the script's own os._exit was noted
    assert "script_returned" in clock and clock["script_returned"] >= clock["train_returned"]
    assert clock["calls"]["start/training_step (forward, backward)"] == 1
    assert clock["calls"]["steps/training_step (forward, backward)"] == 5
