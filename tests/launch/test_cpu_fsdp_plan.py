import pytest

from hf_gpu_train.plan.decisions import PlanError
from hf_gpu_train.plan.planner import PlanOptions, make_plan


def test_fsdp_on_cpu_processes_is_a_real_fsdp_config_with_gloo(machine):
    plan = make_plan(machine("cpu-only"), PlanOptions(strategy="fsdp", cpu_processes=2))
    assert plan.strategy == "cpu-fsdp"
    acc = plan.accelerate
    assert acc["distributed_type"] == "FSDP" and acc["use_cpu"] is True and acc["num_processes"] == 2
    assert acc["fsdp_config"]["fsdp_version"] == 2 and acc["fsdp_config"]["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert plan.env_dict["ACCELERATE_USE_CPU"] == "1"
    assert "accelerate itself turns FSDP on CPU processes into DDP" in next(s.reason for s in plan.settings if s.key == "distributed_type")


def test_fsdp_needs_two_processes_or_a_gpu(machine):
    with pytest.raises(PlanError, match="--strategy fsdp shards over several processes; .* pass --num-processes 2 or more"):
        make_plan(machine("cpu-only"), PlanOptions(strategy="fsdp", cpu_processes=1))
