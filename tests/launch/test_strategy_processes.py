"""Issue 28, item 2: every command `hf-gpu-train config --strategy fsdp` prints launches FSDP. Each is run for real on 2
gloo processes through scripts/finetune.py (shard_probe.py adds one callback), and each rank reports what accelerate
runs and whether the model it trains is sharded: its parameters are DTensors holding about half of the weights. A
run launched without the strategy (the torchrun line as it was printed before) trains DDP and drops the plan's
memory values with one line saying why."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import ROOT, fake_slurm, free_port, hf_gpu_train, teardown_race_only
from tests.scaling.finetune_cases import text_case

PROBE = Path(__file__).with_name("shard_probe.py")
BIN = Path(sys.executable).parent  # accelerate, torchrun and hf-gpu-train of this environment
pytestmark = pytest.mark.slow
PLANNED_MICRO = 4  # what a plan for a GPU box decides; the CPU planner decides no batch, so the test writes one in


def fsdp_config(tmp_path: Path, recipe: Path, *multi_node: str, strategy: str = "fsdp") -> tuple[Path, str]:
    """(YAML, printed output) of `hf-gpu-train config --strategy fsdp` (or ``strategy``) naming the probe and its recipe
    as the script."""
    out = tmp_path / strategy
    made = hf_gpu_train("config", "--machine", "cpu-only", "--strategy", strategy, "--main-process-port", str(free_port()),
                        "--output", str(out), "--script", f"{PROBE} --config {recipe}", *multi_node)
    assert made.returncode == 0, made.stderr
    plan_path = out.with_suffix(".plan.json")
    plan = json.loads(plan_path.read_text())
    for key, value in (("per_device_train_batch_size", PLANNED_MICRO), ("global_batch_size", 2 * PLANNED_MICRO),
                       ("gradient_accumulation_steps", 1)):
        plan["values"][key] = {"value": value, "reason": f"test plan: {key}={value}"}
    plan_path.write_text(json.dumps(plan))
    return out.with_suffix(".yaml"), made.stdout


def recipe_for(tmp_path: Path) -> Path:
    keys = dict(arg.split("=", 1) for arg in text_case(tmp_path))
    keys.update(max_steps=2, logging_steps=1, eval_strategy="'no'", save_strategy="'no'", max_eval_samples=8, telemetry="false",
                watchdog="'off'", evaluate_before="false", output_dir=tmp_path / "out")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()))
    return recipe


def printed(stdout: str, start: str) -> str:
    lines = stdout.splitlines()
    return next(lines[i + 1].strip() for i, line in enumerate(lines) if line.startswith(start))


def environment(tmp_path: Path) -> dict:
    env = {**os.environ, "PROBE_OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}"}
    for key in [k for k in env if k.startswith(("ACCELERATE_", "FSDP_"))] + ["OMP_NUM_THREADS", "HF_GPU_TRAIN_PLAN"]:
        env.pop(key, None)
    return env


def without_strategy(torchrun_line: str) -> str:
    """The torchrun line as `hf-gpu-train config` printed it before: the plan's environment, none of accelerate's
    strategy variables."""
    kept = [t for t in shlex.split(torchrun_line) if not t.startswith(("ACCELERATE_USE_FSDP=", "FSDP_"))]
    return shlex.join(kept)


@pytest.mark.parametrize("how", ["hf-gpu-train launch", "accelerate launch", "torchrun", "sbatch", "torchrun without strategy"])
def test_every_printed_command_shards_the_model(tmp_path, how):
    recipe = recipe_for(tmp_path)
    env = environment(tmp_path)
    if how == "sbatch":
        config, _ = fsdp_config(tmp_path, recipe, "--num-processes", "1", "--num-machines", "2", "--main-process-ip", "127.0.0.1")
        command = ["bash", str(config.with_suffix(".sbatch"))]
        env = fake_slurm(tmp_path, env)
    else:
        config, stdout = fsdp_config(tmp_path, recipe, "--num-processes", "2")
        line = {"hf-gpu-train launch": printed(stdout, "Launch:"), "accelerate launch": printed(stdout, "or with plain accelerate:"),
                "torchrun": printed(stdout, "or with torchrun:")}.get(how) or without_strategy(printed(stdout, "or with torchrun:"))
        command = ["bash", "-c", line]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert run.returncode == 0 or teardown_race_only(run.stderr, [len(ranks) == 2]), run.stderr[-4000:]
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)], run.stderr[-3000:]
    out = run.stdout + run.stderr
    if how == "torchrun without strategy":  # DDP: whole weights on every rank, and the plan's micro-batch is not used
        for r in ranks:
            assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["dtensor_params"] == 0
            assert r["local_numel"] == r["global_numel"] and r["per_device_train_batch_size"] != PLANNED_MICRO
        lines = [line for line in out.splitlines() if "plan made for fsdp but this run is ddp" in line]
        assert len(lines) == 1, out[-4000:]
        assert f"per_device_train_batch_size={PLANNED_MICRO}" in lines[0] and "hf-gpu-train launch --config-file" in lines[0]
        assert "its launch environment named" not in out  # the Trainer's accelerator runs what the launch environment said
        assert (f"plan values not applied: per_device_train_batch_size={PLANNED_MICRO} (made for another strategy), "
                f"global_batch_size={2 * PLANNED_MICRO} (made for another strategy)") in out
        return
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.FSDP", r
        assert r["dtensor_params"] == r["params"] > 0, r  # every parameter sharded by fully_shard
        assert r["local_numel"] <= r["global_numel"] // 2 + r["params"], r  # each rank holds about half
        assert r["per_device_train_batch_size"] == PLANNED_MICRO  # the plan's, made for this strategy
    assert "made for another strategy" not in out and "this run is" not in out and "its launch environment named" not in out
    assert f"plan values applied: precision=fp32, per_device_train_batch_size={PLANNED_MICRO}" in out

