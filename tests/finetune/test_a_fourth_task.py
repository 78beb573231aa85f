"""A fourth task, added as a user would (issue 37): ``tests/finetune/token_classification/`` holds all of it (its keys,
the task, its data and model), and importing it is the one registration line. Then the same entry point trains it,
its keys are routed to it (and refused for another task), the planner reads its shape, and the report tells its story:
nothing in the package names it."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.plan_scope import run_fingerprint
from hf_gpu_train.finetune.tasks import TASKS, task_for
from hf_gpu_train.plan.scope import Fingerprint

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "paris", "london", "anna", "bob"]
TAGS = {"paris": "LOC", "london": "LOC", "anna": "PER", "bob": "PER"}


@pytest.fixture
def registered():
    """The one registration line, and the registry as it was afterwards (other tests list the built-in tasks)."""
    before = dict(TASKS)
    import tests.finetune.token_classification  # noqa: F401  (registers task=token-classification)

    yield
    TASKS.clear()
    TASKS.update(before)
    sys.modules.pop("tests.finetune.token_classification.task", None)
    sys.modules.pop("tests.finetune.token_classification", None)


def rows(count: int, offset: int) -> list[dict]:
    found = []
    for i in range(offset, offset + count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 5)]
        found.append({"tokens": words, "tags": [TAGS.get(w, "O") for w in words]})
    return found


def write(path, data: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return str(path)


def test_a_fourth_task_trains_through_the_same_entry_point_with_its_own_keys(tmp_path, registered):
    from hf_gpu_train.finetune.run import main
    from hf_gpu_train.report.writer import render_report

    train, validation = write(tmp_path / "train.jsonl", rows(48, 0)), write(tmp_path / "validation.jsonl", rows(16, 100))
    out = tmp_path / "out"
    args = ["task=token-classification", f"train_file={train}", f"validation_file={validation}", "dataset=none",
            f"output_dir={out}", "max_steps=3", "per_device_train_batch_size=8", "max_length=32", "tags_column=tags",
            "evaluate_before=false", "logging_steps=1", "save_strategy=no"]
    assert main(args) == 0
    saved = yaml.safe_load((out / "finetune_config.yaml").read_text())
    assert saved["task"] == "token-classification" and saved["tags_column"] == "tags" and saved["max_length"] == 32
    assert "image_size" not in saved and "lora_r" not in saved  # the other tasks' keys are theirs
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] > 0
    render_report(out)
    assert "| task | token-classification |" in (out / "report.md").read_text()

    cfg = load_config(None, args)
    assert task_for(cfg.task).planner_input(cfg).seq_len == 32  # the planner's shape, from the task's own keys
    fingerprint = run_fingerprint(cfg, Fingerprint())
    assert fingerprint.shape.seq_len == 32 and fingerprint.method == "full"
    with pytest.raises(ConfigError, match=r"tags_column \(task=token-classification\): not a key of task=text-classification"):
        load_config(None, ["tags_column=tags"])
    with pytest.raises(ConfigError, match=r"image_size \(task=image-classification\): not a key of task=token-classification"):
        load_config(None, [*args, "image_size=32"])
