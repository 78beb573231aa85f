"""Issue 28, item 2: a plan's memory values were sized for its strategy (a micro-batch for sharded memory). A run launched
with another strategy (a torchrun line without accelerate's FSDP variables trains DDP) applies none of them, and one
line says which, why, and how to launch the plan's strategy."""

from __future__ import annotations

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.finetune.builtin import minilm_path
from hf_gpu_train.finetune.launch_plan import apply_launch_plan
from hf_gpu_train.finetune.loading import load_config_and_keys
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.launch.render import torchrun_command
from hf_gpu_train.plan.run_plan_file import PLAN_ENV, read_run_plan
from tests.launch.test_strategy_lines import line_environment


@pytest.fixture(scope="module")
def fsdp_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "box"
    assert main(["config", "--machine", "2x-rtx4090", "--strategy", "fsdp", "--model", minilm_path(), "--output", str(out)]) == 0
    return out.with_suffix(".plan.json")


def applied(plan_file, environ):
    cfg, explicit = load_config_and_keys(None, ["model=builtin:minilm"])
    return apply_launch_plan(cfg, explicit, environ={PLAN_ENV: str(plan_file), **environ}, here=load_machine("2x-rtx4090"))


def printed_torchrun_environment(plan_file) -> dict:
    """What the printed torchrun line puts in each process's environment (torchrun adds WORLD_SIZE)."""
    from hf_gpu_train.plan.model_spec import resolve_model
    from hf_gpu_train.plan.planner import PlanOptions, make_plan

    plan = make_plan(load_machine("2x-rtx4090"), PlanOptions(strategy="fsdp", model=resolve_model(minilm_path())))
    env = line_environment(torchrun_command(plan, "train.py", plan_file.with_suffix("").with_suffix(".yaml")))
    return {**env, "WORLD_SIZE": "2"}


def test_a_ddp_launch_of_an_fsdp_plan_applies_none_of_its_memory_values(fsdp_plan):
    plan = read_run_plan(fsdp_plan, "test")
    planned = plan.strategy.value
    micro = plan.value("per_device_train_batch_size")
    assert planned.startswith("fsdp") and micro
    cfg, applied_plan = applied(fsdp_plan, {"WORLD_SIZE": "2"})  # torchrun without the strategy: DDP
    defaults, _ = load_config_and_keys(None, ["model=builtin:minilm"])
    assert cfg.per_device_train_batch_size == defaults.per_device_train_batch_size != micro
    assert cfg.precision == "bf16"  # the machine's values still apply
    said = [line for line in applied_plan.lines if "this run is" in line]
    assert len(said) == 1, applied_plan.lines
    assert said[0].startswith(f"plan made for {planned} but this run is ddp (accelerate was launched without ACCELERATE_USE_FSDP)")
    assert f"per_device_train_batch_size={micro}" in said[0]
    assert f"gradient_accumulation_steps={plan.value('gradient_accumulation_steps')}" in said[0]
    assert f"hf-gpu-train launch --config-file {fsdp_plan.with_suffix('').with_suffix('.yaml')}" in said[0]
    assert f"plan values not applied: per_device_train_batch_size={micro} (made for another strategy)" in "\n".join(applied_plan.lines)
    assert applied_plan.launched_strategy == "ddp"
    assert applied_plan.memory is not None and applied_plan.memory.strategy == "ddp"  # the check estimates what runs


def test_the_printed_torchrun_line_launches_the_plans_strategy_and_its_values_apply(fsdp_plan):
    plan = read_run_plan(fsdp_plan, "test")
    cfg, applied_plan = applied(fsdp_plan, printed_torchrun_environment(fsdp_plan))
    assert applied_plan.launched_strategy == plan.strategy.value
    assert cfg.per_device_train_batch_size == plan.value("per_device_train_batch_size")
    assert not any("this run is" in line or "another strategy" in line for line in applied_plan.lines), applied_plan.lines
    assert "plan values not applied: none" in applied_plan.lines


def test_a_single_process_of_a_ddp_plan_is_not_another_strategy(tmp_path):
    """One process of a DDP plan replicates the model as DDP does: the process count has its own note."""
    out = tmp_path / "ddp"
    assert main(["config", "--machine", "2x-rtx4090", "--model", minilm_path(), "--output", str(out)]) == 0
    plan = read_run_plan(out.with_suffix(".plan.json"), "test")
    assert plan.strategy.value == "ddp"
    cfg, applied_plan = applied(out.with_suffix(".plan.json"), {})
    assert cfg.per_device_train_batch_size == plan.value("per_device_train_batch_size")
    assert not any("this run is" in line for line in applied_plan.lines)


def test_the_trainers_accelerator_confirms_the_strategy_the_plan_was_scoped_for():
    """The launched strategy is read from the environment before the Trainer exists (the micro-batch goes into its
    arguments); once its accelerator does, what it runs is compared, and a difference is said."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from hf_gpu_train.finetune.launch_plan import AppliedPlan, confirm_launched_strategy, strategy_of_state

    fsdp2 = SimpleNamespace(fsdp_version=2, reshard_after_forward=False, cpu_offload=None)
    state = SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=fsdp2)
    assert strategy_of_state(state) == "fsdp-shard-grad-op"
    zero3 = SimpleNamespace(zero_stage=3, deepspeed_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert strategy_of_state(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=zero3)) == \
        "deepspeed-zero3-offload"
    applied = AppliedPlan(plan=None, resolution=None, memory=None, lines=(), launched_strategy="fsdp-shard-grad-op")
    assert confirm_launched_strategy(applied, state) is None
    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU)
    line = confirm_launched_strategy(applied, ddp)
    assert line.startswith("accelerate runs ddp, not the fsdp-shard-grad-op its launch environment named")
    assert "hf-gpu-train launch --config-file" in line
