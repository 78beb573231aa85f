"""Issue 17 through `scripts/finetune.py`, as a user meets it: a plan made for another machine, and a plan made for
another model, each given to a real run through HF_GPU_TRAIN_PLAN. The outcome is read from what the run resolved
(finetune_config.yaml), what it printed and what it recorded (run_summary.json), not from the plan code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_gpu_train.cli import main
from hf_gpu_train.finetune.config import FinetuneConfig
from hf_gpu_train.plan.machine_match import detect_this_machine
from hf_gpu_train.plan.scope import differences, hardware_record

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# a vision recipe that sets no batch, precision or workers: the keys a plan would fill
RECIPE = ["task=image-classification", "model=timm/test_resnet", "pretrained=false", "dataset=builtin:digits", "image_size=32",
          "max_train_samples=64", "max_eval_samples=32", "num_train_epochs=1", "learning_rate=1e-3", "telemetry=false"]


def run_finetune(plan_file: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "ACCELERATE_MIXED_PRECISION")}
    env["HF_GPU_TRAIN_PLAN"] = str(plan_file)
    run = subprocess.run([sys.executable, str(ROOT / "scripts/finetune.py"), *RECIPE, *extra, f"output_dir={out}"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    resolved = yaml.safe_load((out / "finetune_config.yaml").read_text())
    return run, resolved, json.loads((out / "run_summary.json").read_text())


def test_a_plan_for_an_h200_applies_none_of_its_machine_values_on_this_cpu(tmp_path):
    """Item 3: the 1x-h200 plan (bf16, 8 workers, threads for 32 cores, MiniLM's batch) on this CPU box trained in
    bf16 with 8 workers and the plan's global batch. Now: fp32, the recipe's batch, no worker processes, no threads
    variable, and one line naming what differs."""
    assert main(["config", "--machine", "1x-h200", "--model", "builtin:minilm", "--output", str(tmp_path / "h200")]) == 0
    plan = json.loads((tmp_path / "h200.plan.json").read_text())
    if not differences(plan["hardware"], detect_this_machine()):
        pytest.skip("this machine is the plan's 1x-h200")
    assert plan["values"]["precision"]["value"] == "bf16" and plan["values"]["dataloader_num_workers"]["value"] > 0
    run, resolved, summary = run_finetune(tmp_path / "h200.plan.json", tmp_path / "run")
    defaults = FinetuneConfig()
    assert "plan made for another machine (1x-h200: GPUs 1x NVIDIA H200" in run.stdout, run.stdout
    assert (resolved["per_device_train_batch_size"], resolved["global_batch_size"]) == (
        defaults.per_device_train_batch_size, defaults.global_batch_size)
    assert resolved["precision"] != "bf16" and resolved["dataloader_num_workers"] != plan["values"]["dataloader_num_workers"]["value"]
    assert "fp32" in run.stdout and "workers 0" in run.stdout  # the run's own line: what really trained
    assert "OMP_NUM_THREADS" not in run.stdout.split("plan made for another machine")[1].split("\n", 1)[1]  # not applied
    assert "plan values applied: none" in run.stdout
    assert summary["global_step"] == 64 // defaults.per_device_train_batch_size


def test_a_plan_for_minilm_on_this_machine_does_not_size_a_vision_run(tmp_path):
    """Item 1: a plan whose memory values were made for MiniLM (planned for a T4, recorded as this machine) given to
    a timm run: the recipe's batch, the line that says why, and a memory check about the model that trains."""
    assert main(["config", "--machine", "1x-t4", "--model", "builtin:minilm", "--global-batch", "128", "--output",
                 str(tmp_path / "t4")]) == 0
    path = tmp_path / "t4.plan.json"
    plan = json.loads(path.read_text())
    plan["hardware"] = hardware_record(detect_this_machine())  # as if this box were the machine it was made for
    path.write_text(json.dumps(plan))
    planned = plan["values"]["per_device_train_batch_size"]["value"]
    assert planned and planned != FinetuneConfig().per_device_train_batch_size
    run, resolved, summary = run_finetune(path, tmp_path / "run", "precision=fp32")
    assert resolved["per_device_train_batch_size"] == FinetuneConfig().per_device_train_batch_size
    assert f"per_device_train_batch_size={planned}" in run.stdout and "model " in run.stdout
    assert "-> timm/test_resnet" in run.stdout and "the recipe's values apply" in run.stdout
    assert summary["plan"]["memory"]["planned_for"]["model"] == "timm/test_resnet", run.stdout
