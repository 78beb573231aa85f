"""Finding the plan from inside a training process: HF_GPU_TRAIN_PLAN, or the `accelerate launch` parent in /proc.

The /proc tree here is a fake one built in tmp_path (stat, cmdline, environ, cwd per process); the real one is
used by the launch tests in test_run_plan_processes.py.
"""

import os

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.plan.discovery import find_launcher, load_run_plan
from hf_gpu_train.plan.run_plan_file import RunPlanError

WORKER = 500


FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # several GPUs


def fake_process(proc, pid, ppid, cmdline, cwd=None, environ=None, comm="python3"):
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")
    if environ is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    if cwd is not None:
        os.symlink(cwd, d / "cwd")


def tree(tmp_path, launcher_cmdline, cwd, launcher_env=None, wrapper=False):
    """worker 500 <- (wrapper 450 <-) launcher 400 <- shell 300 <- init 1."""
    proc = tmp_path / "proc"
    fake_process(proc, 300, 1, ["bash"])
    fake_process(proc, 400, 300, launcher_cmdline, cwd, launcher_env if launcher_env is not None else {"PATH": "/usr/bin"})
    if wrapper:
        fake_process(proc, 450, 400, ["bash", "-c", "python train.py"], comm="bash (x)")
    fake_process(proc, WORKER, 450 if wrapper else 400, ["python", "train.py"])
    return proc


@pytest.fixture
def configs(tmp_path):
    d = tmp_path / "cfg"
    assert main(["config", "--machine", "2x-rtx4090", "--output", str(d / "box")]) == 0
    return d


def test_plan_named_by_the_environment(tmp_path, configs):
    plan = load_run_plan({"HF_GPU_TRAIN_PLAN": str(configs / "box.plan.json"), "WORLD_SIZE": "2"}, proc=tmp_path / "none", pid=WORKER)
    assert plan.path == configs / "box.plan.json" and plan.source == f"HF_GPU_TRAIN_PLAN={configs / 'box.plan.json'}"
    assert plan.launched.num_processes == 2 and plan.launch_overrides == ()


def test_plain_accelerate_launch_parent_names_the_config_relative_to_its_cwd(tmp_path, configs):
    proc = tree(tmp_path, ["/venv/bin/python3", "/venv/bin/accelerate", "launch", "--num_processes", "2", "--config_file",
                           "cfg/box.yaml", "train.py", "--config_file", "other.yaml"], tmp_path, {"OMP_NUM_THREADS": "4"})
    launcher = find_launcher(proc, WORKER)
    assert (launcher.pid, launcher.config_file, launcher.environ) == (400, tmp_path / "cfg/box.yaml", {"OMP_NUM_THREADS": "4"})
    plan = load_run_plan({"WORLD_SIZE": "2"}, proc=proc, pid=WORKER)
    assert plan.path == configs / "box.plan.json"
    assert plan.source == f"accelerate launch --config_file {tmp_path / 'cfg/box.yaml'} (process 400)"
    assert plan.launcher_environ == {"OMP_NUM_THREADS": "4"}
    assert dict((k, v) for k, v, _ in plan.environment)["NCCL_P2P_DISABLE"] == "1"


def test_a_wrapper_between_launcher_and_worker_and_hf_gpu_train_launchs_own_form(tmp_path, configs):
    proc = tree(tmp_path, ["/usr/bin/python3", "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file",
                           str(configs / "box.yaml"), "train.py"], "/", wrapper=True)
    assert load_run_plan({}, proc=proc, pid=WORKER).path == configs / "box.plan.json"


def test_a_launcher_that_is_pid_1_as_in_a_container(tmp_path, configs):
    proc = tmp_path / "proc"
    fake_process(proc, 1, 0, ["accelerate", "launch", "--config_file", str(configs / "box.yaml"), "t.py"], "/")
    fake_process(proc, 7, 1, ["python", "t.py"])
    assert find_launcher(proc, 7).pid == 1 and load_run_plan({}, proc=proc, pid=7).path == configs / "box.plan.json"


def test_the_scripts_own_config_option_is_not_the_launch_config(tmp_path, configs):
    home = tmp_path / "home"
    (home / ".cache/huggingface/accelerate").mkdir(parents=True)
    os.symlink(configs / "box.yaml", home / ".cache/huggingface/accelerate/default_config.yaml")
    os.symlink(configs / "box.plan.json", home / ".cache/huggingface/accelerate/default_config.plan.json")
    proc = tree(tmp_path, ["accelerate", "launch", "train.py", "--config_file", str(configs / "nope.yaml")], "/", {"HOME": str(home)})
    assert find_launcher(proc, WORKER).config_file == home / ".cache/huggingface/accelerate/default_config.yaml"
    assert load_run_plan({}, proc=proc, pid=WORKER).machine == "2x-rtx4090"


def test_someone_elses_config_or_no_launcher_means_no_plan(tmp_path, configs):
    (tmp_path / "theirs.yaml").write_text("distributed_type: NO\nnum_processes: 1\n")
    proc = tree(tmp_path, ["accelerate", "launch", "--config_file", "theirs.yaml", "t.py"], tmp_path)
    assert load_run_plan({}, proc=proc, pid=WORKER) is None
    other = tmp_path / "other"
    other.mkdir()
    assert load_run_plan({}, proc=tree(other, ["torchrun", "--nproc-per-node=2", "t.py"], tmp_path), pid=WORKER) is None
    assert load_run_plan({}, proc=tmp_path / "no-proc", pid=WORKER) is None


def test_our_config_without_its_env_and_plan_stops_with_the_fix(tmp_path, configs):
    (configs / "box.env").unlink()
    (configs / "box.plan.json").unlink()
    proc = tree(tmp_path, ["accelerate", "launch", "--config_file", str(configs / "box.yaml"), "t.py"], tmp_path)
    with pytest.raises(RunPlanError) as info:
        load_run_plan({}, proc=proc, pid=WORKER)
    assert str(info.value) == (f"{configs / 'box.yaml'} was written by hf-gpu-train, but neither box.plan.json nor box.env is "
                               "beside it, so its environment (NCCL settings, CUDA_DEVICE_ORDER) cannot reach this run: copy "
                               f"them next to box.yaml, or regenerate all three with `hf-gpu-train config --output {configs / 'box'}`")


def test_our_older_config_with_only_its_env_still_gets_the_environment(tmp_path, configs):
    (configs / "box.plan.json").unlink()
    proc = tree(tmp_path, ["accelerate", "launch", "--config_file", str(configs / "box.yaml"), "t.py"], tmp_path)
    plan = load_run_plan({"WORLD_SIZE": "2"}, proc=proc, pid=WORKER)
    assert plan.document is None and plan.values == {} and plan.launch_overrides == ()
    assert dict((k, v) for k, v, _ in plan.environment) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_P2P_DISABLE": "1",
                                                            "OMP_NUM_THREADS": "12", **FLIGHT_RECORDER}
    assert plan.memory_note.startswith("no box.plan.json beside box.yaml (written by an older hf-gpu-train)")
