"""Issue 31: DeepSpeed ZeRO plans for CPU processes are the GPU configs, except what the device decides (fp32, DeepSpeed's
CPU accelerator, no ACCELERATE_USE_CPU, which would make accelerate skip DeepSpeed); check-config holds them; the
strategy a launch really runs is read right on a machine without a GPU; LoRA plans under ZeRO."""

from __future__ import annotations

import pytest

from hf_gpu_train.launch.launched_strategy import launched_strategy
from hf_gpu_train.plan.decisions import PlanError
from hf_gpu_train.plan.lint import lint
from hf_gpu_train.plan.model_spec import from_config
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from tests.plan.test_plan_method import LLAMA3_8B

STRATEGIES = ("deepspeed-zero2", "deepspeed-zero3", "deepspeed-zero2-offload", "deepspeed-zero3-offload")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cpu_plan_is_the_gpu_config_but_for_what_the_device_decides(machine, strategy):
    cpu = make_plan(machine("cpu-only"), PlanOptions(strategy=strategy, cpu_processes=2))
    gpu = make_plan(machine("8x-h100-sxm"), PlanOptions(strategy=strategy))
    assert cpu.strategy == gpu.strategy == strategy
    assert cpu.accelerate["distributed_type"] == "DEEPSPEED" and cpu.accelerate["use_cpu"] is False
    assert cpu.accelerate["deepspeed_config"] == gpu.accelerate["deepspeed_config"]
    assert cpu.deepspeed_file == gpu.deepspeed_file and (cpu.deepspeed_file is not None) == strategy.endswith("-offload")
    assert cpu.accelerate["mixed_precision"] == "no" and gpu.accelerate["mixed_precision"] == "bf16"
    env = cpu.env_dict
    assert env["DS_ACCELERATOR"] == "cpu" and "ACCELERATE_USE_CPU" not in env
    reason = next(s.reason for s in cpu.settings if s.key == "distributed_type")
    assert "TrainingArguments(use_cpu=True) or ddp_backend='gloo'" in reason


def test_sharding_needs_two_processes_and_adapters_shard_only_under_zero(machine, tmp_path):
    with pytest.raises(PlanError, match="deepspeed-zero3 shards over several processes; .* pass --num-processes 2 or more"):
        make_plan(machine("cpu-only"), PlanOptions(strategy="deepspeed-zero3", cpu_processes=1))
    assert make_plan(machine("cpu-only"), PlanOptions(strategy="deepspeed-zero3", method="lora", cpu_processes=2)).strategy == "deepspeed-zero3"
    with pytest.raises(PlanError, match="--method qlora with --strategy deepspeed-zero3"):
        make_plan(machine("cpu-only"), PlanOptions(strategy="deepspeed-zero3", method="qlora", cpu_processes=2))
    with pytest.raises(PlanError, match="--method lora with --strategy fsdp: adapters train on one GPU, with DDP or under DeepSpeed"):
        make_plan(machine("cpu-only"), PlanOptions(strategy="fsdp", method="lora", cpu_processes=2))


def test_lora_under_zero3_partitions_the_frozen_base_and_zero2_does_not(machine):
    llama = from_config(dict(LLAMA3_8B), name="llama-3-8b")
    options = dict(model=llama, seq_len=2048, method="lora")
    plans = {s: make_plan(machine("8x-h100-sxm"), PlanOptions(**options, strategy=s)) for s in ("ddp", "deepspeed-zero2", "deepspeed-zero3")}
    base = {s: p.memory.breakdown.weights for s, p in plans.items()}
    assert base["deepspeed-zero2"] == base["ddp"] == 2 * llama.params  # bf16, whole on every GPU
    assert base["deepspeed-zero3"] == pytest.approx(2 * llama.params / 8)
    adapters = plans["ddp"].memory.breakdown
    for strategy in ("deepspeed-zero2", "deepspeed-zero3"):
        zero = plans[strategy].memory.breakdown
        assert zero.gradients == pytest.approx(adapters.gradients / 8) and zero.optimizer == pytest.approx(adapters.optimizer / 8)
        assert zero.comm_buffers == 0
    assert plans["deepspeed-zero3"].memory.breakdown.gathered_params > 0 == plans["deepspeed-zero2"].memory.breakdown.gathered_params


def test_check_config_holds_a_cpu_zero_config_and_refuses_the_cpu_flag_beside_it(machine):
    plan = make_plan(machine("cpu-only"), PlanOptions(strategy="deepspeed-zero3", cpu_processes=2))
    assert [f.message for f in lint(plan.accelerate, machine("cpu-only"), plan.env_dict)] == []
    refused = lint(plan.accelerate, machine("cpu-only"), {**plan.env_dict, "ACCELERATE_USE_CPU": "1"})
    assert any("DEEPSPEED with ACCELERATE_USE_CPU set: accelerate then skips DeepSpeed and trains DDP" in f.message for f in refused)
    assert any("DS_ACCELERATOR=cpu but 8x-h100-sxm has GPUs" in f.message
               for f in lint(plan.accelerate, machine("8x-h100-sxm"), plan.env_dict))  # a CPU config on a GPU box
    gpu_config = make_plan(machine("8x-h100-sxm"), PlanOptions(strategy="deepspeed-zero3"))
    assert any("has 0 usable GPU(s)" in f.message for f in lint(gpu_config.accelerate, machine("cpu-only"), gpu_config.env_dict))


def test_the_launched_strategy_on_a_machine_without_a_gpu_is_deepspeeds_unless_the_cpu_flag_is_set():
    launch = {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    assert launched_strategy(launch, on_cpu=True) == "deepspeed-zero3"
    assert launched_strategy({**launch, "ACCELERATE_USE_CPU": "True"}, on_cpu=True) == "ddp"
