"""A Ray job from a plan (issue 30, part 3): ``hf-gpu-train config --target ray`` writes NAME.ray.yaml (the job's
runtime_env) and prints the ``ray job submit`` line, which Ray's own command-line parser reads; and the line runs: its entrypoint, run the way Ray's job supervisor runs it, fine-tunes
on a real local Ray cluster with the plan applied in the workers."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_gpu_train.cli import main as cli
from hf_gpu_train.launch.ray_job import (
    QUIET_PRINT,
    RAY_ENTRY,
    ray_environment,
    ray_scaling,
    ray_submit_command,
    render_ray_runtime_env,
    runtime_env_path_for,
)
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.run_plan_file import PLAN_ENV
from tests.ray_cluster import local_ray, needs_ray
from tests.scaling.finetune_cases import text_case


@pytest.mark.parametrize(("name", "options", "workers", "cpus", "gpu"), [
    ("cpu-only", PlanOptions(), 2, 1, False),
    ("8x-h100-sxm", PlanOptions(), 8, 14, True),
    ("8x-h100-sxm", PlanOptions(num_machines=2, main_process_ip="node0"), 16, 14, True),
])
def test_the_scaling_config_is_the_plans_processes_gpus_and_threads(machine, name, options, workers, cpus, gpu):
    plan = make_plan(machine(name), options)
    scaling = ray_scaling(plan)
    assert (scaling.num_workers, scaling.cpus_per_worker, scaling.use_gpu) == (workers, cpus, gpu)
    assert scaling.resources_per_worker() == {"CPU": cpus, **({"GPU": 1} if gpu else {})}
    line = ray_submit_command(plan, "launch_configs/box.ray.yaml")
    assert line.endswith(f"-- python -m {RAY_ENTRY} --num-workers {workers} --cpus-per-worker {cpus}" + (" --use-gpu" if gpu else ""))


def test_the_runtime_env_carries_the_plans_environment_and_leaves_the_gpus_to_ray(machine):
    plan = make_plan(machine("2x-rtx4090"))
    text = render_ray_runtime_env(plan, "launch_configs/box.yaml", "launch_configs/box.ray.yaml")
    env = yaml.safe_load(text)["env_vars"]
    assert all(isinstance(v, str) for v in env.values())  # what Ray's runtime_env accepts
    assert env["NCCL_P2P_DISABLE"] == "1" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env[PLAN_ENV] == "launch_configs/box.plan.json" and env.items() >= QUIET_PRINT.items()
    assert "CUDA_VISIBLE_DEVICES" not in env  # Ray hands each worker its GPU
    for key, _, reason in ray_environment(plan, "launch_configs/box.yaml"):  # each with its reason, above it
        assert f"  # {reason}\n  {key}: " in text
    assert "ray job submit --working-dir . --runtime-env launch_configs/box.ray.yaml" in text
    assert runtime_env_path_for("launch_configs/box.yaml") == Path("launch_configs/box.ray.yaml")


def test_a_strategy_not_yet_run_under_ray_says_so_and_carries_acceleratess_variables(machine):
    plan = make_plan(machine("8x-h100-sxm"), PlanOptions(strategy="fsdp"))
    text = render_ray_runtime_env(plan, "launch_configs/box.yaml", "launch_configs/box.ray.yaml")
    assert yaml.safe_load(text)["env_vars"]["ACCELERATE_USE_FSDP"] == "true"
    assert "not yet this strategy" in text and "Not applied under Ray: the plan's CPU binding" in text


@needs_ray
def test_rays_own_command_line_reads_the_submit_line(machine, tmp_path):
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.dashboard.modules.job.cli import submit

    plan = make_plan(machine("8x-h100-sxm"))
    runtime_env = tmp_path / "box.ray.yaml"
    runtime_env.write_text(render_ray_runtime_env(plan, "launch_configs/box.yaml", runtime_env))
    params = submit.make_context("submit", shlex.split(ray_submit_command(plan, runtime_env))[3:]).params
    assert params["entrypoint"][:3] == ("python", "-m", RAY_ENTRY) and params["working_dir"] == "."
    parsed = parse_runtime_env_args(params["runtime_env"], params["runtime_env_json"], params["working_dir"])
    assert parsed["env_vars"]["OMP_NUM_THREADS"] == "14" and parsed["working_dir"] == "."


# ---- the line runs


@pytest.fixture(scope="module")
def cluster():
    with local_ray(num_cpus=2) as address:
        yield address


def run_as_ray_job(line: str, extra: list[str], project: Path, address: str) -> subprocess.CompletedProcess:
    """What ``ray job submit`` makes of ``line`` (with ``extra`` after it) on the cluster at ``address``, without the
    dashboard's job server (ray[default], not installed): Ray's own command line parses the line and Ray's own parser
    reads its runtime_env; the entrypoint runs as the job supervisor runs it (ray/dashboard/modules/job/job_supervisor.py:
    a shell command, the runtime_env's variables in its environment, the runtime_env as the job's through
    RAY_JOB_CONFIG_JSON_ENV_VAR, so every worker gets it too, and RAY_ADDRESS naming the cluster). Not done: the upload
    of the working directory; the job runs in the project directory itself."""
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.dashboard.modules.job.cli import submit

    argv = shlex.split(line)
    assert argv[:3] == ["ray", "job", "submit"]
    params = submit.make_context("submit", argv[3:]).params
    with_dir = parse_runtime_env_args(params["runtime_env"], params["runtime_env_json"], params["working_dir"])
    assert with_dir.pop("working_dir") == "."
    env = {**os.environ, **with_dir["env_vars"], "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": with_dir}),
           "RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # this venv's python
    entrypoint = " ".join([*map(shlex.quote, params["entrypoint"]), *map(shlex.quote, extra)])
    return subprocess.run(entrypoint, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=600)


def submit_line(printed: str) -> str:
    """The ``ray job submit`` line ``config --target ray`` printed."""
    (line,) = [text.split(": ", 1)[1] for text in printed.splitlines() if text.startswith("On Ray (from ")]
    return line


def test_config_target_ray_writes_the_runtime_env_and_prints_the_submit_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli(["config", "--machine", "8x-h100-sxm", "--output", "launch_configs/box", "--target", "ray"]) == 0
    line = submit_line(capsys.readouterr().out)
    assert line == ("ray job submit --working-dir . --runtime-env launch_configs/box.ray.yaml -- "
                    f"python -m {RAY_ENTRY} --num-workers 8 --cpus-per-worker 14 --use-gpu")
    env = yaml.safe_load((tmp_path / "launch_configs" / "box.ray.yaml").read_text())["env_vars"]
    assert env[PLAN_ENV] == "launch_configs/box.plan.json" and (tmp_path / env[PLAN_ENV]).is_file()
    # several machines need no --main-process-ip: Ray makes the group
    assert cli(["config", "--machine", "8x-h100-sxm", "--output", "launch_configs/two", "--target", "ray", "--num-machines", "2"]) == 0
    assert "--num-workers 16 " in submit_line(capsys.readouterr().out)


@pytest.mark.parametrize(("argv", "says"), [
    (["--script", "train.py"], "--target ray runs the fine-tune as Ray Train workers"),
    (["--gpu-ids", "2,3"], "plan with --gpu-ids 0,1"),  # Ray hands the workers their GPUs, numbered from 0
    (["--image", "ghcr.io/you/train:1"], "--target ray has no use for it"),
])
def test_config_target_ray_refuses_what_ray_cannot_use(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    assert cli(["config", "--machine", "8x-h100-sxm", "--output", "launch_configs/box", "--target", "ray", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and not (tmp_path / "launch_configs").exists()


@pytest.mark.slow
@needs_ray
def test_the_printed_ray_job_submit_line_fine_tunes_on_the_cluster_with_the_plan_applied(cluster, tmp_path, monkeypatch,
                                                                                          capsys):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    monkeypatch.chdir(project)
    case = text_case(project / "data")
    assert cli(["config", "--output", "launch_configs/box", "--target", "ray"]) == 0  # this machine: 2 CPU processes, gloo
    line = submit_line(capsys.readouterr().out)
    assert "--num-workers 2" in line
    # output_dir relative: the workers write into the job's working directory, not into Ray's directory of their own
    done = run_as_ray_job(line, [*case, "num_train_epochs=1", "max_steps=2", "eval_strategy=no",
                                 "save_strategy=no", "max_eval_samples=8", "telemetry=false", "output_dir=outputs/run"],
                          project, cluster)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out = project / "outputs" / "run"
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["global_step"] == 2 and "plan" in summary  # the plan reached the workers (HF_GPU_TRAIN_PLAN) and was applied
    assert json.loads((out / "hf_gpu_train_run.json").read_text())["processes"] == 2
    assert "hf_gpu_train: ray: 2 worker(s) finished" in done.stdout
