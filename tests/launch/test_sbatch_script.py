"""The generated sbatch, run by bash as SLURM runs it (a stand-in srun that runs the task with SLURM_NODEID=1, a
stand-in hf-gpu-train that records its arguments): every node's task gets exactly the launch the plan means, from a
folder whose name holds spaces, quotes and parentheses, with arguments that hold spaces; and the exit code that
says "preempted" makes the script requeue the job."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hf_gpu_train.launch.render import render_sbatch, render_yaml
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.run_plan_file import env_path_for

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "node": os.environ.get("SLURM_NODEID")}}) + "\\n")
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def job(tmp_path, machine):
    folder = tmp_path / "it's a (test) run"
    folder.mkdir()
    plan = make_plan(machine("cpu-only"), PlanOptions(num_machines=2, cpu_processes=1, main_process_ip="n1"))
    config = folder / "job.yaml"
    config.write_text(render_yaml(plan, "test"))
    env_path_for(config).write_text("OMP_NUM_THREADS=1\n")
    script = folder / "job.sbatch"
    script.write_text(render_sbatch(plan, config, "train it.py"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    executable(bindir / "srun", "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=1 exec \"$@\"\n")
    executable(bindir / "scontrol", "#!/bin/bash\necho \"$@\" >> \"$SCONTROL_RECORD\"\n[ \"$1\" = show ] && echo n1\nexit 0\n")
    executable(bindir / "recorder", RECORDER.format(python=sys.executable))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "HF_GPU_TRAIN": str(bindir / "recorder"),
           "RECORD": str(tmp_path / "record.jsonl"), "SCONTROL_RECORD": str(tmp_path / "scontrol.txt"),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_SUBMIT_DIR": str(folder)}
    return script, config, env, tmp_path


def run(script: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)


def test_every_task_gets_the_plans_launch_from_any_folder_and_the_arguments_as_given(job):
    script, config, env, tmp_path = job
    done = run(script, env, "--config", "my recipe.yaml", "extra={adam_epsilon: 1.0e-6}")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "record.jsonl").read_text())
    assert record["node"] == "1"
    assert record["argv"] == ["launch", "--config-file", str(config), "--num_machines", "2", "--num_processes", "2",
                              "--machine_rank", "1", "--main_process_ip", "n1", "--main_process_port", "29500",
                              "--rdzv_backend", "c10d", "--same_network", "train", "it.py", "--config", "my recipe.yaml",
                              "extra={adam_epsilon: 1.0e-6}"]  # --script is words, as in every printed command
    assert not (tmp_path / "scontrol.txt").read_text().startswith("requeue")


def test_exit_75_requeues_the_job_and_any_other_failure_does_not(job):
    script, _, env, tmp_path = job
    preempted = run(script, {**env, "EXIT_WITH": "75"})
    assert preempted.returncode == 75 and "requeueing job 42" in preempted.stdout
    assert "requeue 42" in (tmp_path / "scontrol.txt").read_text()
    (tmp_path / "scontrol.txt").unlink()
    failed = run(script, {**env, "EXIT_WITH": "1"})
    assert failed.returncode == 1 and "requeue" not in (tmp_path / "scontrol.txt").read_text()
