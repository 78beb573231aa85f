"""Issue 38, item 5: what `hf-gpu-train config` prints and writes works for a pip user with no clone, tried as a user
would: the wheel installed in a fresh venv (tests/installed_wheel.py), an empty directory, `config` with the run's
arguments after `--`, then each printed line (hf-gpu-train launch, plain accelerate, torchrun, the sbatch), the
SkyPilot task's run section and the Kubernetes manifests' container command run as they stand. Before: every one
named scripts/finetune.py (not in a pip install), the manifests mounted nothing that outlives the pod, and `accelerate
launch --num_processes 2 -m hf_gpu_train.finetune` trained one process without a word.

The two "pods": the manifest's container command (parsed out of the YAML) run twice, each time in a fresh copy of
the image's working directory, the only thing the two share being the directory standing for the
PersistentVolumeClaim, linked where the manifest mounts it. The first is stopped by SIGTERM (Kubernetes' stop
signal, to the container's PID 1) once a checkpoint is complete and exits 75; the second resumes from the newest
complete checkpoint on the volume and finishes the run.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hf_gpu_train.faults.checkpoint_marker import complete_checkpoints
from hf_gpu_train.launch.rank_report import PREEMPTED_EXIT_CODE
from tests.installed_wheel import TINY, run_in, user_env
from tests.launching import executable, free_port

pytestmark = pytest.mark.slow
RECIPE = ["--config", "minilm_text_demo"]


def config(bin_dir: Path, project: Path, *argv: str) -> str:
    """`hf-gpu-train config` of this machine's CPU plan (one process, a free port) from the wheel, in ``project``."""
    made = run_in(project, ["hf-gpu-train", "config", "--machine", "cpu-only", "--num-processes", "1", "--main-process-port",
                            str(free_port()), *argv], bin_dir)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    return made.stdout


def printed(out: str, heading: str) -> str:
    lines = out.splitlines()
    return lines[lines.index(heading) + 1].strip()


def trained(out_dir: Path, steps: int = 2) -> None:
    assert json.loads((out_dir / "run_summary.json").read_text())["global_step"] == steps


@pytest.mark.parametrize("heading", ["Launch:", "or with plain accelerate:", "or with torchrun:"])
def test_each_printed_launch_line_trains_from_the_wheel_in_an_empty_directory(installed, tmp_path, heading):
    _, bin_dir = installed
    out = config(bin_dir, tmp_path, "--output", "cpu", "--", *RECIPE, *TINY, "output_dir=out")
    line = printed(out, heading)
    assert "scripts/finetune.py" not in out and line.rstrip(")").endswith(" ".join(["-m hf_gpu_train.finetune", *RECIPE, *TINY,
                                                                                    "output_dir=out"]))
    done = run_in(tmp_path, ["bash", "-c", line], bin_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trained(tmp_path / "out")
    assert "hf_gpu_train: one process" not in done.stdout  # one process asked for, one run: nothing to say


def test_the_printed_sbatch_line_trains_from_the_wheel(installed, tmp_path):
    """`sbatch NAME.sbatch ARGS` under a one-node stand-in for srun and scontrol: the job's step is the wheel's
    hf-gpu-train launch (the sbatch's default launcher, found on the PATH)."""
    _, bin_dir = installed
    out = config(bin_dir, tmp_path, "--output", "cpu", "--target", "slurm", "--", *RECIPE, *TINY, "output_dir=out")
    line = next(line for line in out.splitlines() if line.startswith("On SLURM: sbatch"))
    words = line.removeprefix("On SLURM: ").split("  (")[0]
    slurm = tmp_path.parent / f"{tmp_path.name}-slurm"
    slurm.mkdir()
    executable(slurm / "srun", '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n')
    executable(slurm / "scontrol", "#!/bin/bash\necho localhost\n")
    executable(slurm / "sbatch", '#!/bin/bash\nexec bash "$@"\n')  # the batch script, here and now
    done = run_in(tmp_path, ["bash", "-c", f"PATH={slurm}:$PATH; {words}"], bin_dir, SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp_path),
                  SLURM_JOB_NODELIST="localhost", HF_GPU_TRAIN_MAIN_NODE="127.0.0.1", HF_GPU_TRAIN_MAIN_PORT=str(free_port()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trained(tmp_path / "out")


def test_the_skypilot_tasks_run_section_trains_the_runs_arguments(installed, tmp_path):
    """The run section as SkyPilot runs it in the synced workdir (this directory), after setup installed the package."""
    _, bin_dir = installed
    config(bin_dir, tmp_path, "--output", "cpu", "--target", "skypilot", "--", *RECIPE, *TINY, "output_dir=out")
    task = yaml.safe_load((tmp_path / "cpu.sky.yaml").read_text())
    assert task["setup"].startswith("pip install 'hf-gpu-train==")  # no pyproject.toml here: `pip install -e .` would fail
    done = run_in(tmp_path, ["bash", "-c", task["run"]], bin_dir, **task["envs"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trained(tmp_path / "out")


def test_accelerate_launch_of_two_processes_without_gpus_says_it_runs_one(installed, tmp_path):
    _, bin_dir = installed
    done = run_in(tmp_path, ["accelerate", "launch", "--num_processes", "2", "-m", "hf_gpu_train.finetune", *RECIPE, *TINY,
                             "output_dir=out"], bin_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("hf_gpu_train: one process")]
    assert len(said) == 1 and "not the 2 asked for (--num_processes 2)" in said[0]
    assert "CPU x1" in done.stdout
    trained(tmp_path / "out")


# a run long enough to stop in the middle: a checkpoint every 2 steps
POD_RUN = [*RECIPE, "max_steps=6", "save_strategy=steps", "save_steps=2", "max_train_samples=24", "max_eval_samples=8",
           "per_device_train_batch_size=4", "per_device_eval_batch_size=8", "max_length=32", "evaluate_before=false",
           "eval_strategy=no"]


def _container(job: dict) -> tuple[dict, list[dict], list[dict]]:
    """(the training container, the pod's volumes, the container's mounts) of the manifest's first pod."""
    if job["kind"] == "TrainJob":
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod = patch["template"]["spec"]["template"]["spec"]
        return job["spec"]["trainer"], pod["volumes"], pod["containers"][0]["volumeMounts"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return pod["containers"][0], pod["volumes"], pod["containers"][0]["volumeMounts"]


def _start_pod(image: Path, workdir: Path, volume: Path, job: dict, bin_dir: Path) -> subprocess.Popen:
    """A fresh pod: the image's working directory copied anew (nothing of an earlier pod's), the claim's volume linked
    where the manifest mounts it, the container's command with its args and env."""
    container, volumes, mounts = _container(job)
    claims = {v["name"] for v in volumes if "persistentVolumeClaim" in v}
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(image, workdir)
    for mount in mounts:
        if mount["name"] in claims:
            target = Path(mount["mountPath"])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(volume, target_is_directory=True)
    env = user_env(bin_dir, **{e["name"]: e["value"] for e in container["env"]})
    return subprocess.Popen(container["command"] + container["args"], cwd="/", env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize(("target", "suffix"), [("kubeflow", ".trainjob.yaml"), ("pytorchjob", ".pytorchjob.yaml")])
def test_two_pods_sharing_only_the_checkpoint_volume_resume_the_run(installed, tmp_path, target, suffix):
    _, bin_dir = installed
    image = tmp_path / "project"  # what `COPY . /workspace` puts in the image: the directory config ran in
    image.mkdir()
    workdir, volume = tmp_path / "workspace", tmp_path / "claim"
    volume.mkdir()
    out = config(bin_dir, image, "--output", "launch_configs/cpu", "--target", target, "--image", "me/train:1",
                 "--workdir", str(workdir), "--checkpoint-volume", "train-ckpt", "--", *POD_RUN)
    assert "warning:" not in out
    job = yaml.safe_load((image / f"launch_configs/cpu{suffix}").read_text())
    output_dir = volume / "minilm_text_demo"  # outputs/minilm_text_demo, the recipe's, under the mount

    first = _start_pod(image, workdir, volume, job, bin_dir)
    deadline = time.monotonic() + 300
    while not complete_checkpoints(output_dir) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)  # an eviction: SIGTERM to the container's PID 1, the launcher
    log = first.communicate(timeout=300)[0]
    assert first.returncode == PREEMPTED_EXIT_CODE, log[-4000:]
    newest = [c.name for c in complete_checkpoints(output_dir)][:1]  # newest first
    assert newest and newest != ["checkpoint-6"], log[-4000:]  # stopped before the end, with a complete checkpoint

    second = _start_pod(image, workdir, volume, job, bin_dir)  # the first pod's filesystem is gone, the claim is not
    log = second.communicate(timeout=600)[0]
    assert second.returncode == 0, log[-4000:]
    assert f"resuming from outputs/minilm_text_demo/{newest[0]}" in log, log[-4000:]  # output_dir as the recipe writes it
    trained(output_dir, 6)  # the run's steps in all: the second pod went on from the first pod's checkpoint, not from 0
