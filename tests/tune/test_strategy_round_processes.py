"""Tune's strategy round for real: a ZeRO-2 config of 2 CPU processes (DeepSpeed's CPU accelerator over gloo) measured
against DDP and ZeRO-3, each in a launch of its own config, on the scaling tests' tiny BERT. Each candidate must have
run its own strategy (the Trainer's accelerator says which; DeepSpeed's step-aside line of the OOM recovery appears in
the DeepSpeed launches only), the table lists each with its measured figures, and the fastest that fits goes into its
own config, which launches its strategy."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from hf_gpu_train.plan.run_plan_file import read_run_plan
from hf_gpu_train.tune.results import TrialResult
from tests.launching import ROOT, cpu_config
from tests.tune.test_tune_processes import text_case_with_rows

pytestmark = pytest.mark.slow

DEEPSPEED_LINE = "OOM recovery is off for Trainer: DeepSpeed's engine"
MARK = "hf-gpu-train tune: strategy round: "


def test_ddp_zero2_and_zero3_are_measured_each_in_its_own_launch_and_the_fastest_is_what_its_config_launches(tmp_path):
    case = text_case_with_rows(tmp_path, 320)  # 20 steps an epoch: warm-up and measured steps inside one
    config = cpu_config(tmp_path, 2, "z2", "--strategy", "deepspeed-zero2")
    argv = ["tune", "--strategies", "ddp,deepspeed-zero3", "--measure-steps", "10", "--config-file", str(config),
            "scripts/finetune.py", *case, "global_batch_size=16", "per_device_train_batch_size=4"]
    code = (f"import sys; from hf_gpu_train.cli import main; rc = main({argv!r}); "
            "assert 'torch' not in sys.modules, 'the tune command imported torch'; sys.exit(rc)")
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # one stream: each launch's lines in order
    seconds = time.perf_counter() - started
    out = run.stdout
    assert run.returncode == 0, out[-5000:]

    # each launch ran its strategy: the Trainer's accelerator said so, and only DeepSpeed's launches stepped aside
    segments = dict(re.findall(rf"{re.escape(MARK)}([a-z0-9-]+),(.*?)(?={re.escape(MARK)}|\n#  )", out, flags=re.S))
    assert list(segments) == ["deepspeed-zero2", "ddp", "deepspeed-zero3"], list(segments)
    assert segments["deepspeed-zero2"].count(DEEPSPEED_LINE) == 2 and segments["deepspeed-zero3"].count(DEEPSPEED_LINE) == 2
    assert DEEPSPEED_LINE not in segments["ddp"]
    trials = [TrialResult.from_dict(t) for t in json.loads(config.with_suffix(".plan.json").read_text())["tuned"]["trials"]]
    assert [(t.candidate.strategy, t.launched_strategy, t.status) for t in trials] == [
        (None, "deepspeed-zero2", "ok"), ("ddp", "ddp", "ok"), ("deepspeed-zero3", "deepspeed-zero3", "ok")]
    assert all((t.candidate.micro_batch, t.candidate.accumulation, t.measured_steps) == (4, 2, 10) for t in trials)
    assert all(t.tokens_per_s > 0 and len(t.peak_by_rank_bytes) == 2 and min(t.peak_by_rank_bytes) > 0 for t in trials)

    # the table: each strategy with its measured figures
    table = out[out.index("\n#  strategy"):].strip().splitlines()
    print("\n".join(table), f"\n({seconds:.0f} s in all)")  # with -s: the table and the pick
    rows = {line.split()[1]: line.split() for line in table[2:5]}
    assert set(rows) == {"deepspeed-zero2", "ddp", "deepspeed-zero3"}
    for strategy, trial in zip(("deepspeed-zero2", "ddp", "deepspeed-zero3"), trials):
        assert f"{trial.tokens_per_s:,.1f}" in rows[strategy] and rows[strategy][-1] == "ok"
        assert f"{trial.peak_by_rank_bytes[0] / 2**30:.2f}/{trial.peak_by_rank_bytes[1] / 2**30:.2f}" in rows[strategy]

    # the fastest that fits won (DDP by far on 2 processes of a tiny model: no partitioned step, no gathered weights);
    # its config launches DDP with the measured values, and z2.yaml still launches ZeRO-2, as config wrote it
    fastest = max(trials, key=lambda t: t.tokens_per_s)
    assert fastest.candidate.strategy == "ddp", out[-3000:]
    ddp = tmp_path / "z2.strategies" / "ddp.yaml"
    assert f"Next: hf-gpu-train launch --config-file {ddp} scripts/finetune.py" in out
    assert yaml.safe_load(ddp.read_text())["distributed_type"] == "MULTI_GPU"
    theirs = read_run_plan(ddp.with_suffix(".plan.json"), "test")
    assert theirs.strategy.value == "cpu-ddp" and theirs.value("per_device_train_batch_size") == 4
    assert theirs.value("global_batch_size") == 16
    assert yaml.safe_load(config.read_text())["distributed_type"] == "DEEPSPEED"
    assert read_run_plan(config.with_suffix(".plan.json"), "test").strategy.value == "deepspeed-zero2"
    assert "strategy round: ddp is the fastest that fits, not z2.yaml's own deepspeed-zero2" in out
