"""A training process of several whose Trainer sees one (collectives/lone_rank.py): refused by the toolkit's pieces with
the fix, on every rank alike. The trap is real in the installed accelerate and transformers: under a DeepSpeed launch
on CPU processes, TrainingArguments without use_cpu or ddp_backend give each rank a one-process state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_gpu_train.collectives.lone_rank import LoneRank, check_not_alone
from tests.launching import ROOT, free_port, hf_gpu_train

PROBE = Path(__file__).with_name("lone_rank_probe.py")


def trainer_seeing(processes: int) -> SimpleNamespace:
    return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(num_processes=processes)),
                           args=SimpleNamespace(ddp_backend=None))


def test_a_rank_that_sees_one_process_of_several_is_refused_with_the_fix(monkeypatch):
    import hf_gpu_train.collectives.lone_rank as lone_rank

    monkeypatch.setattr(lone_rank, "_group_size", lambda: 2)
    with pytest.raises(LoneRank, match=r"TrainingArguments\(use_cpu=True\) or TrainingArguments\(ddp_backend='gloo'\)"):
        check_not_alone(trainer_seeing(1), {"ACCELERATE_USE_DEEPSPEED": "true"})
    with pytest.raises(LoneRank, match="accelerate's state was made without a backend"):
        check_not_alone(trainer_seeing(1), {})
    check_not_alone(trainer_seeing(2), {})
    check_not_alone(SimpleNamespace(), {})  # a Trainer-like object without an accelerator: nothing to compare
    monkeypatch.setattr(lone_rank, "_group_size", lambda: 1)
    check_not_alone(trainer_seeing(1), {"WORLD_SIZE": "2"})  # a process alone in no group of several: not refused


@pytest.mark.slow
def test_under_a_cpu_deepspeed_launch_plain_training_arguments_are_refused_and_the_named_fix_works(tmp_path):
    out = tmp_path / "cfg"
    made = hf_gpu_train("config", "--machine", "cpu-only", "--num-processes", "2", "--strategy", "deepspeed-zero2",
                        "--main-process-port", str(free_port()), "--output", str(out))
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # use_cpu=True, the other fix, is scripts/finetune.py's own, in every DeepSpeed run of tests/scaling
    for mode in ("plain", "gloo"):
        folder = tmp_path / mode
        folder.mkdir()
        run = subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", f"{out}.yaml", str(PROBE),
                              str(folder), mode], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        seen = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        assert all(s["deepspeed"] for s in seen)
        if mode == "plain":
            assert [s["num_processes"] for s in seen] == [1, 1]  # each rank a process 0 of 1
            assert all("TrainingArguments(use_cpu=True)" in s["refused"] for s in seen)  # and both refused
        else:  # the fix the message names
            assert [s["num_processes"] for s in seen] == [2, 2] and not any("refused" in s for s in seen)
