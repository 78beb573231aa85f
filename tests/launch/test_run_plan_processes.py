"""Real gloo processes: the plan reaches them under plain `accelerate launch`, and `hf-gpu-train launch` passes
accelerate's own flags through (checked by what each process sees)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import ROOT, cpu_config, free_port, hf_gpu_train, teardown_race_only

PROBE = Path(__file__).with_name("plan_probe.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")  # the console script users type
pytestmark = pytest.mark.slow


def read_ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def clean_env(tmp_path, **extra) -> dict:
    env = {**os.environ, "PROBE_OUT": str(tmp_path), "PYTHONPATH": str(ROOT), **extra}
    for key in ("ACCELERATE_USE_CPU", "OMP_NUM_THREADS", "HF_GPU_TRAIN_PLAN"):
        env.pop(key, None)
    return env


def test_plain_accelerate_launch_finds_and_applies_the_plan(tmp_path):
    cfg = cpu_config(tmp_path, 2)
    with open(cfg.with_suffix(".env"), "a") as f:  # an edited .env: the processes must get the edit
        f.write("PROBE_MARKER=from-env-file\nOMP_NUM_THREADS=2\n")
    # the README's plain form, without sourcing the .env: before plans travelled, two lone processes
    run = subprocess.run([str(ACCELERATE), "launch", "--config_file", cfg.name, str(PROBE)], cwd=tmp_path,
                         env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    ranks = read_ranks(tmp_path)
    assert run.returncode == 0 or teardown_race_only(run.stderr, [len(ranks) == 2]), run.stderr[-3000:]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["world_size"], r["distributed_type"], r["all_reduce"]) == (2, "DistributedType.MULTI_CPU", 3.0)
        assert r["env"]["ACCELERATE_USE_CPU"] == "1" and r["env"]["PROBE_MARKER"] == "from-env-file"
        assert r["plan"]["source"].startswith(f"accelerate launch --config_file {cfg} (process ")
        assert ["ACCELERATE_USE_CPU", "1"] in r["plan"]["applied"] and ["PROBE_MARKER", "from-env-file"] in r["plan"]["applied"]
        assert r["plan"]["replaced"] == [["OMP_NUM_THREADS", "1", "2"]]  # accelerate's own default gave way to the plan
        assert r["env"]["OMP_NUM_THREADS"] == "2" and r["torch_threads"] == 2
        assert r["plan"]["launch_overrides"] == [] and r["plan"]["precision"] == "fp32"


def test_our_yaml_without_its_env_and_plan_stops_with_the_fix(tmp_path):
    cfg = cpu_config(tmp_path, 1)
    cfg.with_suffix(".env").unlink()
    cfg.with_suffix(".plan.json").unlink()
    run = subprocess.run([str(ACCELERATE), "launch", "--config_file", str(cfg), str(PROBE)], cwd=tmp_path,
                         env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and read_ranks(tmp_path) == []
    assert (f"probe: error: {cfg} was written by hf-gpu-train, but neither cpu.plan.json nor cpu.env is beside it, so its "
            "environment (NCCL settings, CUDA_DEVICE_ORDER) cannot reach this run: copy them next to cpu.yaml, or regenerate "
            "all three with `hf-gpu-train config --machine cpu-only --num-processes 1 --main-process-port ") in run.stderr


def test_launch_passes_accelerates_flags_through(tmp_path):
    planned_port, port = free_port(), free_port()
    out = tmp_path / "three"
    made = hf_gpu_train("config", "--machine", "cpu-only", "--num-processes", "3", "--main-process-port", str(planned_port),
                        "--output", str(out))
    assert made.returncode == 0, made.stderr
    run = hf_gpu_train("launch", "--num_processes", "2", "--config-file", f"{out}.yaml", "--main_process_port", str(port),
                       str(PROBE), cwd=ROOT, env=clean_env(tmp_path), timeout=300)
    ranks = read_ranks(tmp_path)
    assert run.returncode == 0 or teardown_race_only(run.stderr, [len(ranks) == 2]), run.stderr[-3000:]
    assert "hf-gpu-train launch: --num_processes 2 overrides three.yaml's num_processes: 3\n" in run.stderr
    assert f"hf-gpu-train launch: --main_process_port {port} overrides three.yaml's main_process_port: {planned_port}\n" in run.stderr
    assert [r["rank"] for r in ranks] == [0, 1]  # the file says 3: the flag won
    for r in ranks:
        assert (r["world_size"], r["all_reduce"], r["env"]["MASTER_PORT"]) == (2, 3.0, str(port))
        assert r["plan"]["source"] == f"HF_GPU_TRAIN_PLAN={out}.plan.json"
        assert r["plan"]["launch_overrides"] == [["num_processes", 3, 2, "launch"]]
        assert r["plan"]["applied"] == [] and r["env"]["ACCELERATE_USE_CPU"] == "1"  # the launcher applied the .env
