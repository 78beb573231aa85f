"""A run launched with a generated config applies its plan: values the recipe leaves open come from the plan,
an explicit key wins and is reported, and run_summary.json records the plan next to what the run used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launching import cpu_config, launch
from tests.scaling.finetune_cases import COMMON, text_case

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune.py"


def plan_batch(config: Path, micro: int, global_batch: int) -> None:
    """What `config --model` decides on a GPU box (the CPU planner decides no batch): micro-batch and global batch."""
    path = config.with_suffix(".plan.json")
    plan = json.loads(path.read_text())
    for key, value in (("per_device_train_batch_size", micro), ("global_batch_size", global_batch),
                       ("gradient_accumulation_steps", global_batch // (micro * 2)), ("gradient_checkpointing", False)):
        plan["values"][key] = {"value": value, "reason": f"test plan: {key}={value}"}
    path.write_text(json.dumps(plan))


def test_the_plan_fills_what_the_recipe_leaves_open_and_an_explicit_key_wins(tmp_path):
    case = text_case(tmp_path)
    config = cpu_config(tmp_path)
    plan_batch(config, micro=8, global_batch=16)
    out = tmp_path / "out"
    run = launch(config, SCRIPT, *case, *COMMON, "telemetry=false", "per_device_train_batch_size=4", f"output_dir={out}", timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"launch plan {config.with_suffix('.plan.json')}" in run.stdout
    assert "per_device_train_batch_size=4 (your config) over the plan's 8" in run.stdout
    assert "batch 4 x 2 x 2 = 16" in run.stdout  # the plan's global batch, the user's micro-batch: accumulation 2
    record = json.loads((out / "run_summary.json").read_text())["plan"]
    assert record["values"]["global_batch_size"] == {"plan": 16, "used": 16, "reason": "test plan: global_batch_size=16"}
    assert record["values"]["per_device_train_batch_size"]["used"] == 4
    assert [o["key"] for o in record["overridden"]] == ["per_device_train_batch_size"]


def test_values_tune_measured_for_a_recipe_win_over_that_recipe_not_over_the_command_line(tmp_path):
    from hf_gpu_train.plan.run_plan_file import TUNED, recipe_identity

    case = text_case(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("per_device_train_batch_size: 16\nglobal_batch_size: 16\n")
    config = cpu_config(tmp_path)
    plan_batch(config, micro=4, global_batch=16)
    path = config.with_suffix(".plan.json")
    plan = json.loads(path.read_text())
    # tune measured this job: the recipe with these key=value (output_dir and telemetry are not the job)
    plan[TUNED] = {"recipe": recipe_identity(recipe), "overrides": [*case, *COMMON], "keys": ["per_device_train_batch_size"]}
    path.write_text(json.dumps(plan))
    out = tmp_path / "out"
    run = launch(config, SCRIPT, "--config", str(recipe), *case, *COMMON, "telemetry=false", f"output_dir={out}", timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "per_device_train_batch_size=4 measured by hf-gpu-train tune for this recipe, over the recipe's 16" in run.stdout
    assert "batch 4 x 2 x 2 = 16" in run.stdout


def test_an_override_the_planner_predicts_will_not_fit_is_warned_about_before_the_model_loads(tmp_path):
    """In a child process (the plan's environment is applied to os.environ there): a T4 plan for MiniLM, the user's
    micro-batch far above what fits, no model loaded."""
    import subprocess
    import sys

    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "1x-t4", "--model", "builtin:minilm",
                           "--seq-len", "128", "--output", str(tmp_path / "t4")], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    child = ("import logging, sys, transformers; logging.basicConfig(level=logging.WARNING)\n"
             "from hf_gpu_train.finetune.loading import load_config_and_keys\n"
             "from hf_gpu_train.finetune.launch_plan import apply_launch_plan\n"
             "cfg, keys = load_config_and_keys(None, ['per_device_train_batch_size=4096', 'max_length=128'])\n"
             "from hf_gpu_train.hardware.snapshot import load_machine\n"
             "cfg, plan = apply_launch_plan(cfg, keys, here=load_machine('1x-t4'))\n"
             "print('USED', cfg.per_device_train_batch_size, 'MODELS', 'transformers.models.bert.modeling_bert' in sys.modules)\n")
    env = {**__import__("os").environ, "HF_GPU_TRAIN_PLAN": str(tmp_path / "t4.plan.json")}
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "USED 4096 MODELS False" in run.stdout  # the user's value wins; nothing loaded a model
    assert "the planner predicts an out-of-memory: per_device_train_batch_size=4096" in run.stderr
    assert "the largest micro-batch that fits is" in run.stderr and "the plan chose micro-batch 32" in run.stderr


def test_tuned_packing_reaches_the_run_and_the_recipe_is_known_by_its_text_wherever_it_is(tmp_path):
    from hf_gpu_train.finetune.launch_plan import apply_launch_plan
    from hf_gpu_train.finetune.loading import load_config_and_keys
    from hf_gpu_train.plan.run_plan_file import TUNED, recipe_identity

    config = cpu_config(tmp_path)
    recipe = tmp_path / "lm.yaml"
    recipe.write_text("task: causal-lm\nmodel: builtin:smollm2\npacking: auto\n")
    path = config.with_suffix(".plan.json")
    plan = json.loads(path.read_text())
    plan["values"]["packing"] = {"value": False, "reason": "measured by hf-gpu-train tune: padding was faster"}
    plan[TUNED] = {"recipe": recipe_identity(recipe), "keys": ["packing"]}
    path.write_text(json.dumps(plan))
    elsewhere = tmp_path / "copy" / "lm.yaml"  # the same recipe, read from another directory
    elsewhere.parent.mkdir()
    elsewhere.write_text(recipe.read_text())
    environ = {"HF_GPU_TRAIN_PLAN": str(path)}
    cfg, keys = load_config_and_keys(elsewhere, [])
    tuned, applied = apply_launch_plan(cfg, keys, environ=environ, recipe=elsewhere)
    assert cfg.packing == "auto" and tuned.packing is False
    assert any("packing=False measured by hf-gpu-train tune" in line for line in applied.lines)
    cfg, keys = load_config_and_keys(elsewhere, ["packing=true"])
    kept, _ = apply_launch_plan(cfg, keys, environ=environ, recipe=elsewhere, command_line_keys=frozenset({"packing"}))
    assert kept.packing is True  # the command line wins over a tuned value


def test_the_run_reads_its_config_and_plan_before_numpy_or_torch_is_imported():
    """OMP_NUM_THREADS and the NCCL variables from the plan count only if they are set before numpy (OpenBLAS sizes
    its pool once) and torch are imported: scripts/finetune.py reads the config and applies the plan first."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from hf_gpu_train.finetune.run import parse_args\n"
            "from hf_gpu_train.finetune.loading import load_config_and_keys\n"
            "from hf_gpu_train.finetune.launch_plan import apply_launch_plan\n"
            "recipe, overrides = parse_args(['--config', 'minilm_text_demo'])\n"
            "cfg, keys = load_config_and_keys(recipe, overrides)\n"
            "apply_launch_plan(cfg, keys, environ={})\n"
            "print([m for m in ('numpy', 'torch', 'transformers') if m in sys.modules])\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
