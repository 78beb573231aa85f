"""The plan against the user's values: explicit keys win and are reported, launch flags too, and an override the
planner predicts will not fit gets a warning with its numbers."""

import pytest

from hf_gpu_train.plan.document import render_plan_json
from hf_gpu_train.plan.memory import TrainingShape, estimate
from hf_gpu_train.plan.model_spec import ModelSpec
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.resolution import check_memory, memory_error_pct, override_lines, plan_record, resolve_with_plan
from hf_gpu_train.plan.run_plan_file import Override, read_run_plan

BERT = ModelSpec(name="bert-base", params=109_482_240, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522,
                 largest_layer_params=7_087_872, layer_class="BertLayer")
DEFAULTS = {"precision": "auto", "per_device_train_batch_size": 32, "global_batch_size": None, "gradient_checkpointing": False,
            "dataloader_num_workers": "auto", "learning_rate": 5e-5}


@pytest.fixture
def run_plan(tmp_path, machine):
    """2x RTX 4090, BERT at seq 512, global batch 96: the planner picks micro-batch 48, no accumulation."""
    def load(environ=None, global_batch=96, name="2x-rtx4090", model=BERT):
        plan = make_plan(machine(name), PlanOptions(model=model, seq_len=512, global_batch=global_batch))
        path = tmp_path / "box.plan.json"
        path.write_text(render_plan_json(plan, "hf-gpu-train config --output box", tmp_path / "box.yaml"))
        return read_run_plan(path, "test", environ or {"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"})
    return load


def test_unset_keys_take_the_plan_explicit_keys_win_and_are_reported(run_plan):
    plan = run_plan()
    assert (plan.value("per_device_train_batch_size"), plan.value("global_batch_size"), plan.value("dataloader_num_workers")) == (48, 96, 8)
    values, overridden = resolve_with_plan(plan, DEFAULTS, explicit_keys=set())
    assert values == {"precision": "bf16", "per_device_train_batch_size": 48, "global_batch_size": 96,
                      "gradient_checkpointing": False, "dataloader_num_workers": 8, "learning_rate": 5e-5}
    assert overridden == ()
    user = {**DEFAULTS, "per_device_train_batch_size": 64, "precision": "fp16", "dataloader_num_workers": 8}
    values, overridden = resolve_with_plan(plan, user, {"per_device_train_batch_size", "precision", "dataloader_num_workers"})
    assert (values["per_device_train_batch_size"], values["precision"], values["global_batch_size"]) == (64, "fp16", 96)
    assert overridden == (Override("precision", "bf16", "fp16", "config"), Override("per_device_train_batch_size", 48, 64, "config"))
    assert override_lines(overridden) == ["precision=fp16 (your config) over the plan's bf16",
                                          "per_device_train_batch_size=64 (your config) over the plan's 48"]


def test_auto_asks_for_the_plan(run_plan):
    values, overridden = resolve_with_plan(run_plan(), DEFAULTS, {"precision", "dataloader_num_workers"})
    assert (values["precision"], values["dataloader_num_workers"], overridden) == ("bf16", 8, ())


def test_no_memory_plan_leaves_the_users_batch_alone(tmp_path, machine):
    path = tmp_path / "p.plan.json"
    path.write_text(render_plan_json(make_plan(machine("2x-rtx4090")), "c", tmp_path / "p.yaml"))
    plan = read_run_plan(path, "test", {"WORLD_SIZE": "2"})
    values, overridden = resolve_with_plan(plan, DEFAULTS, {"per_device_train_batch_size"})
    assert values == {**DEFAULTS, "precision": "bf16", "dataloader_num_workers": 8} and overridden == ()
    assert check_memory(plan, values) is None


def test_launch_flags_are_overrides_and_the_global_batch_is_kept_for_the_processes_that_run(run_plan):
    plan = run_plan({"WORLD_SIZE": "3", "ACCELERATE_MIXED_PRECISION": "fp16"})
    assert plan.launch_overrides == (Override("num_processes", 2, 3, "launch"), Override("precision", "bf16", "fp16", "launch"))
    values, overridden = resolve_with_plan(plan, DEFAULTS, set())
    assert (values["precision"], values["per_device_train_batch_size"], values["global_batch_size"]) == ("fp16", 48, 96)
    assert overridden == plan.launch_overrides
    # 48 x 3 processes is 144 per step: one step of accumulation, the finetune side rounds 96 up to 144 and says so
    values, overridden = resolve_with_plan(plan, {**DEFAULTS, "precision": "bf16"}, {"precision"})
    assert values["precision"] == "bf16" and Override("precision", "fp16", "bf16", "config") in overridden


def test_an_override_the_planner_says_will_not_fit_is_a_warning_with_its_numbers(run_plan):
    plan = run_plan()
    values, _ = resolve_with_plan(plan, {**DEFAULTS, "per_device_train_batch_size": 200}, {"per_device_train_batch_size"})
    check = check_memory(plan, values)
    expected = estimate(BERT, TrainingShape(micro_batch=200, seq_len=512, precision="bf16", num_gpus=2), "ddp")
    assert not check.fits and check.estimate_bytes == int(expected.total)
    assert (check.largest_micro_batch, check.largest_micro_batch_checkpointed) == (130, 919)
    assert check.warning == (
        "the planner predicts an out-of-memory: per_device_train_batch_size=200 with gradient_checkpointing=false (bf16, seq 512, "
        "2 process(es), ddp) needs 32.42 GiB per GPU (weights 0.41, gradients 0.41, optimizer states 0.82, communication buffers "
        "0.41, activations 29.88, CUDA context 0.50 GiB) against 22.07 GiB usable of 24.0 GiB; the largest micro-batch that fits "
        "is 130 (919 with gradient_checkpointing=true); the plan chose micro-batch 48 without gradient checkpointing")
    fits = check_memory(plan, {**values, "gradient_checkpointing": True})
    assert fits.fits and fits.warning is None and fits.estimate_bytes < check.estimate_bytes
    assert check_memory(plan, {**values, "per_device_train_batch_size": 48}).estimate_bytes == plan.memory.estimate_bytes


def test_a_longer_sequence_than_planned_is_checked_too(run_plan):
    plan = run_plan()
    values, _ = resolve_with_plan(plan, DEFAULTS, set())
    assert check_memory(plan, values, seq_len=128).fits
    assert not check_memory(plan, values, seq_len=4096).fits


def test_the_record_puts_the_plan_next_to_what_was_measured(run_plan):
    plan = run_plan()
    resolution = resolve_with_plan(plan, {**DEFAULTS, "per_device_train_batch_size": 16}, {"per_device_train_batch_size"})
    check = check_memory(plan, resolution.values)
    measured = int(check.estimate_bytes * 0.9)
    record = plan_record(plan, resolution, check, measured, "torch.cuda.max_memory_reserved + CUDA context")
    assert record["values"]["per_device_train_batch_size"] == {"plan": 48, "used": 16, "reason": plan.values["per_device_train_batch_size"].reason}
    assert record["overridden"] == [{"key": "per_device_train_batch_size", "plan_value": 48, "user_value": 16, "source": "config"}]
    assert record["memory"]["estimate_bytes"] == check.estimate_bytes and record["memory"]["plan_estimate_bytes"] == plan.memory.estimate_bytes
    assert record["memory"]["error_pct"] == -10.0 and record["memory"]["measured_peak_bytes"] == measured
    assert record["memory"]["planned_for"] == {"model": "bert-base", "seq_len": 512, "image_size": 224, "optimizer": "adamw",
                                               "strategy": "ddp"}
    import json

    json.dumps(record)  # JSON-ready for run_summary.json


def test_memory_error_pct():
    assert memory_error_pct(1000, 1234) == 23.4 and memory_error_pct(1000, 900) == -10.0
