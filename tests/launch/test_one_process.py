"""Issue 38, item 5: `accelerate launch -m hf_gpu_train.finetune` on a machine without GPUs runs one process (its
simple launcher, whatever --num_processes says) and said nothing about it; the entry point now says so in one line
(launch/one_process.py), read from the launcher's command line and config in a fake /proc here (the real one: a
launch of the installed wheel, tests/launch/test_installed_commands.py)."""

from __future__ import annotations

import pytest

from hf_gpu_train.launch.one_process import one_process_line
from tests.plan.test_plan_discovery import WORKER, tree

ACCELERATE = ["/venv/bin/python3", "/venv/bin/accelerate", "launch"]
MODULE = ["-m", "hf_gpu_train.finetune", "--config", "minilm_text_demo"]


def line_for(tmp_path, launcher_args, environ=None):
    proc = tree(tmp_path, [*ACCELERATE, *launcher_args, *MODULE], tmp_path, {"HOME": str(tmp_path / "home")})
    return one_process_line({} if environ is None else environ, proc=proc, pid=WORKER)


@pytest.mark.parametrize("flag", ["--num_processes", "--num-processes"])
def test_several_asked_and_one_started_is_said_with_the_number_and_the_fix(tmp_path, flag):
    line = line_for(tmp_path, [flag, "2"])
    assert line.startswith("hf_gpu_train: one process, not the 2 asked for (--num_processes 2)") and "\n" not in line
    assert "simple launcher" in line and "hf-gpu-train config --num-processes N" in line
    assert "hf-gpu-train launch --config-file cpu.yaml -m hf_gpu_train.finetune" in line


def test_nothing_asked_is_accelerates_default_of_one_said_too(tmp_path):
    line = line_for(tmp_path, [])
    assert line.startswith("hf_gpu_train: one process: accelerate launch was given no --num_processes and started one")


def test_a_config_asking_for_several_is_named(tmp_path):
    (tmp_path / "box.yaml").write_text("distributed_type: 'NO'\nnum_processes: 4\n")
    line = line_for(tmp_path, ["--config_file", "box.yaml"])
    assert f"not the 4 asked for (num_processes: 4 in {tmp_path / 'box.yaml'})" in line


def test_one_asked_for_a_group_or_no_accelerate_says_nothing(tmp_path):
    assert line_for(tmp_path / "a", ["--num_processes", "1"]) is None  # asked for one, got one
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "one.yaml").write_text("num_processes: 1\n")
    assert line_for(tmp_path / "b", ["--config_file", "one.yaml"]) is None
    assert line_for(tmp_path / "c", ["--num_processes", "2"], {"WORLD_SIZE": "2"}) is None  # torchrun's workers
    assert line_for(tmp_path / "d", ["--num_processes", "2"], {"OMPI_COMM_WORLD_SIZE": "2"}) is None  # mpirun's
    proc = tree(tmp_path / "e", ["python", "-m", "hf_gpu_train.finetune"], tmp_path)  # no accelerate launch at all
    assert one_process_line({}, proc=proc, pid=WORKER) is None
