"""Real multi-process runs on this CPU: the generated plans start cooperating gloo processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import fake_slurm, free_port, hf_gpu_train, teardown_race_only

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("ddp_probe.py")
pytestmark = pytest.mark.slow


def read_ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def test_cpu_plan_through_the_printed_command_runs_real_ddp(tmp_path):
    cfg = tmp_path / "cpu"
    result = hf_gpu_train("config", "--machine", "cpu-only", "--num-processes", "2", "--main-process-port", str(free_port()),
                          "--output", str(cfg))
    assert result.returncode == 0, result.stderr
    printed = next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("hf-gpu-train launch"))
    assert printed == f"hf-gpu-train launch --config-file {cfg}.yaml -m hf_gpu_train.finetune"
    with open(f"{cfg}.env", "a") as f:
        f.write("PROBE_MARKER=from-env-file\n")
    env = {**os.environ, "PROBE_OUT": str(tmp_path)}
    env.pop("ACCELERATE_USE_CPU", None)
    run = hf_gpu_train("launch", "--config-file", f"{cfg}.yaml", str(PROBE), "--some", "arg", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = read_ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU" for r in ranks)
    assert ranks[0]["params"] == ranks[1]["params"]  # different init and data per rank, DDP kept them equal
    assert all(r["env"]["PROBE_MARKER"] == "from-env-file" and r["env"]["ACCELERATE_USE_CPU"] for r in ranks)
    assert all(r["env"]["OMP_NUM_THREADS"] == "1" for r in ranks)
    assert ranks[0]["argv"] == ["--some", "arg"]


def test_two_nodes_on_localhost_form_one_process_group(tmp_path):
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        cfg = tmp_path / f"node{rank}"
        made = hf_gpu_train("config", "--machine", "cpu-only", "--num-processes", "1", "--num-machines", "2",
                            "--machine-rank", str(rank), "--main-process-ip", "127.0.0.1", "--main-process-port", port,
                            "--output", str(cfg))
        assert made.returncode == 0, made.stderr
        env = {**os.environ, "PROBE_OUT": str(tmp_path)}
        procs.append(subprocess.Popen([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", f"{cfg}.yaml", str(PROBE)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    ranks_done = [(tmp_path / f"rank{r}.json").is_file() for r in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0] or teardown_race_only("".join(outputs), ranks_done), \
        outputs[0][-2000:] + outputs[1][-2000:]
    ranks = read_ranks(tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["params"] == ranks[1]["params"]
    assert all(r["env"]["ACCELERATE_USE_CPU"] for r in ranks)


def test_sbatch_script_with_faked_slurm_forms_one_process_group(tmp_path):
    cfg = tmp_path / "job"
    made = hf_gpu_train("config", "--machine", "cpu-only", "--num-processes", "1", "--num-machines", "2",
                        "--main-process-ip", "127.0.0.1", "--output", str(cfg), "--script", str(PROBE))
    assert made.returncode == 0, made.stderr
    env = {**fake_slurm(tmp_path, dict(os.environ)), "PROBE_OUT": str(tmp_path),
           "ACCELERATE": f"{sys.executable} -m accelerate.commands.accelerate_cli"}
    run = subprocess.run(["bash", f"{cfg}.sbatch"], env=env, capture_output=True, text=True, timeout=300)
    ranks_done = [(tmp_path / f"rank{r}.json").is_file() for r in (0, 1)]
    assert run.returncode == 0 or teardown_race_only(run.stderr, ranks_done), run.stderr[-3000:]
    ranks = read_ranks(tmp_path)
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["params"] == ranks[1]["params"]
