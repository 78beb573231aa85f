"""What checkpoints cost and what failures lose, measured in a plain Trainer (issue 38, item 2): each save's blocked
time, a restart from a checkpoint older than the progress the run had made counted as lost work, and the report's
section from the record."""

from __future__ import annotations

import json

from hf_gpu_train.faults.checkpoint_costs import PROGRESS_FILE, CheckpointCosts
from hf_gpu_train.report.story import CHECKPOINTING_RECORD, story
from tests.faults.test_background_save import plain_trainer


def test_saves_are_timed_and_a_restart_from_an_older_checkpoint_counts_the_steps_lost(tmp_path):
    out = tmp_path / "out"
    first = plain_trainer(out, max_steps=5, save_steps=2)
    costs = CheckpointCosts()
    first.add_callback(costs)
    first.train()  # as if killed after step 5: the newest checkpoint is step 4
    assert len(costs.blocked_s) == len(list(out.glob("checkpoint-*"))) and all(s > 0 for s in costs.blocked_s)
    assert json.loads((out / PROGRESS_FILE).read_text())["step"] == 5

    again = plain_trainer(out, max_steps=6, save_steps=2)
    again.add_callback(CheckpointCosts())
    again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    record = json.loads((out / CHECKPOINTING_RECORD).read_text())
    assert [(e["from_step"], e["resumed_at"], e["steps"]) for e in record["lost"]] == [(5, 4, 1)]
    assert record["saves"] == 1 and record["lost"][0]["seconds"] > 0
    lines, _ = story(out)
    text = "\n".join(lines)
    assert "## Checkpoints" in text and "lost to failures: 1 steps" in text and "step 5 -> 4" in text


def test_a_run_that_resumes_where_it_stopped_lost_nothing(tmp_path):
    out = tmp_path / "out"
    first = plain_trainer(out, max_steps=4, save_steps=2)
    first.add_callback(CheckpointCosts())
    first.train()
    again = plain_trainer(out, max_steps=6, save_steps=2)
    again.add_callback(CheckpointCosts())
    again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    record = json.loads((out / CHECKPOINTING_RECORD).read_text())
    assert record["lost"] == [] and "lost to failures: nothing" in "\n".join(story(out)[0])
