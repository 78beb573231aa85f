"""A pip-installed package fine-tunes: the wheel holds the shipped recipes and their data, and from a working directory
outside the repository `hf-gpu-train finetune --config NAME` and `python -m hf_gpu_train.finetune --config NAME` train.
The wheel and its venv: the session's ``installed`` fixture (tests/installed_wheel.py); the lines `hf-gpu-train
config` prints and the files it writes, run from that install: tests/launch/test_installed_commands.py.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from hf_gpu_train.finetune.recipe_names import shipped_names
from tests.installed_wheel import TINY, run_in

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_wheel_holds_every_shipped_recipe_and_its_data(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert shipped_names() and all(f"hf_gpu_train/finetune/recipes/{n}.yaml" in names for n in shipped_names())
    assert {"hf_gpu_train/finetune/__main__.py", "hf_gpu_train/cli/finetune.py",
            "hf_gpu_train/finetune/recipes/data/python_docs_chat/train.jsonl",
            "hf_gpu_train/finetune/recipes/data/python_docs_chat/validation.jsonl"} <= names


def test_the_installed_package_is_the_wheels_and_its_recipes_find_their_data(installed, tmp_path):
    _, bin_dir = installed
    found = run_in(tmp_path, [str(bin_dir / "python"), "-c", "import hf_gpu_train, sys; from hf_gpu_train.finetune.run import parse_args; "
                              "from hf_gpu_train.finetune.loading import load_config; recipe, overrides = parse_args(['--config', "
                              "'smollm2_lora_demo']); cfg = load_config(recipe, overrides); print(hf_gpu_train.__file__); "
                              "print(cfg.train_file); print(cfg.validation_file)"])
    assert found.returncode == 0, found.stderr
    package, *data = (Path(line) for line in found.stdout.split())
    assert package.is_relative_to(bin_dir.parent) and not package.is_relative_to(ROOT)
    assert data and all(f.is_file() and f.is_relative_to(package.parent / "finetune" / "recipes" / "data") for f in data)


@pytest.mark.parametrize("how", ["hf-gpu-train finetune", "python -m hf_gpu_train.finetune"])
def test_a_shipped_recipe_trains_from_any_directory(installed, tmp_path, how):
    _, bin_dir = installed
    command = [str(bin_dir / "hf-gpu-train"), "finetune"] if how.startswith("hf-gpu-train") else \
        [str(bin_dir / "python"), "-m", "hf_gpu_train.finetune"]
    done = run_in(tmp_path, [*command, "--config", "minilm_text_demo", *TINY, "output_dir=out"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["global_step"] == 2
    assert "eval_accuracy" in json.loads((tmp_path / "out" / "eval_results.json").read_text())
    wrong = run_in(tmp_path, [*command, "--config", "minilm_txt_demo"])
    assert wrong.returncode == 2 and wrong.stderr.strip().count("\n") == 0
    assert "'minilm_txt_demo'" in wrong.stderr and "smollm2_lora_demo" in wrong.stderr and "nearest: minilm_text_demo" in wrong.stderr


@pytest.mark.parametrize("how", ["accelerate launch -m", "hf-gpu-train launch -m"])
def test_two_processes_train_the_installed_entry_point(installed, tmp_path, how):
    """The launch a user of the wheel writes: a CPU launch config of 2 processes (real gloo DDP), then the module."""
    from tests.launching import free_port

    _, bin_dir = installed
    made = run_in(tmp_path, [str(bin_dir / "hf-gpu-train"), "config", "--machine", "cpu-only", "--num-processes", "2",
                             "--main-process-port", str(free_port()), "--output", str(tmp_path / "cpu")])
    assert made.returncode == 0, made.stderr
    module = ["-m", "hf_gpu_train.finetune", "--config", "minilm_text_demo", *TINY, "output_dir=out"]
    if how.startswith("accelerate"):  # the printed plain-accelerate line, with this venv's accelerate
        command = ["bash", "-c", f"set -a; . {tmp_path / 'cpu.env'}; set +a; exec {bin_dir / 'python'} -m accelerate.commands.launch "
                                 f"--config_file {tmp_path / 'cpu.yaml'} " + " ".join(module)]
    else:
        command = [str(bin_dir / "hf-gpu-train"), "launch", "--config-file", str(tmp_path / "cpu.yaml"), *module]
    done = run_in(tmp_path, command)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CPU x2" in done.stdout  # one run of 2 processes, not two runs of one
    assert json.loads((tmp_path / "out" / "run_summary.json").read_text())["global_step"] == 2
