"""`hf-gpu-train tune` without trials: the command line, the dry plan for a snapshot, and the usage errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.cli.tune import split_tune_argv
from tests.tune.test_candidates import planned_t4, t4_model


def test_tune_options_come_from_before_the_script_and_the_scripts_arguments_stay_its_own():
    own, rest = split_tune_argv(["--budget-s", "30", "--num_processes", "2", "--fresh", "--same_network", "--config-file", "b.yaml",
                                 "--axes=micro_batch", "scripts/finetune.py", "--config", "r.yaml", "--budget-s", "5"])
    assert own == ["--budget-s", "30", "--fresh", "--axes=micro_batch"]
    assert rest == ["--num_processes", "2", "--same_network", "--config-file", "b.yaml", "scripts/finetune.py", "--config",
                    "r.yaml", "--budget-s", "5"]


def test_the_dry_plan_for_a_snapshot_lists_the_candidates_and_why_some_are_skipped_without_torch(tmp_path):
    config = planned_t4(tmp_path)
    code = ("import sys; from hf_gpu_train.cli import main; "
            f"rc = main(['tune', '--machine', '1x-t4', '--config-file', {str(config)!r}, 'scripts/finetune.py', {t4_model(tmp_path)!r}, 'max_length=512', "
            "'global_batch_size=64']); "
            "assert 'torch' not in sys.modules, 'tune imported torch'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "Candidates for t4.yaml on 1x-t4: 1 process(es), effective batch 64, compared by tokens/s" in out
    assert re.search(r"micro-batch +1, 2, 4, 8, 16, 32, 64\n", out) and re.search(r"precision +fp16\n", out)
    assert re.search(r"checkpointing +off, on, selective, every-2, selective-lean\n", out)  # a transformers model: every policy
    assert re.search(r"activation offloading +off, on\n", out)  # a T4 snapshot: CUDA
    assert "skipped (the planner says it does not fit): micro-batch 64, checkpointing off, fp16" in out
    assert not (tmp_path / "t4.tune.json").exists()  # nothing measured, nothing written
    assert json.loads((tmp_path / "t4.plan.json").read_text()).get("tuned") is None


@pytest.mark.parametrize(("args", "message"), [
    (["--config-file", "missing.yaml", "scripts/finetune.py"], "--config-file missing.yaml does not exist"),
    (["--config-file", "{cfg}", "train.py"], "train.py: tune measures hf_gpu_train's fine-tuning"),
    (["--axes", "micro_batch,speed", "--config-file", "{cfg}", "scripts/finetune.py"], "--axes micro_batch,speed: use names from"),
    (["--config-file", "{cfg}"], "--config-file NAME.yaml and the training script are required"),
    (["--config-file", "{two}", "scripts/finetune.py"], "launches 2 machines: tune on one"),
])
def test_usage_errors_name_the_value_and_the_fix(tmp_path, capsys, args, message):
    assert main(["config", "--machine", "cpu-only", "--output", str(tmp_path / "cpu")]) == 0
    assert main(["config", "--machine", "cpu-only", "--num-machines", "2", "--main-process-ip", "10.0.0.1",
                 "--output", str(tmp_path / "two")]) == 0
    capsys.readouterr()
    argv = [a.format(cfg=tmp_path / "cpu.yaml", two=tmp_path / "two.yaml") for a in args]
    assert main(["tune", "--dry-run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_config_without_its_plan_says_how_to_get_one(tmp_path, capsys):
    assert main(["config", "--machine", "cpu-only", "--output", str(tmp_path / "cpu")]) == 0
    (tmp_path / "cpu.plan.json").unlink()
    capsys.readouterr()
    assert main(["tune", "--config-file", str(tmp_path / "cpu.yaml"), "scripts/finetune.py"]) == 2
    assert "cpu.plan.json does not exist: tune writes its winner into the plan" in capsys.readouterr().err


def test_the_installed_entry_point_is_the_same_script_to_tune():
    from hf_gpu_train.tune.job import TuneError, parse_script_args

    for script in ("scripts/finetune.py", "hf_gpu_train.finetune", "hf_gpu_train.finetune.run"):
        assert parse_script_args(script, ["--config", "minilm_text_demo", "max_steps=3"])[1] == ["max_steps=3"]
    with pytest.raises(TuneError, match="train.py: tune measures"):
        parse_script_args("train.py", [])
