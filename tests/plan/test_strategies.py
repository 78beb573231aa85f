"""Issue 37: the strategies as one table (plan/strategies.py): every reader's tuple is the table's, the lookup names
what is valid, and a launch reads back into the rows' names."""

import pytest

from hf_gpu_train.launch.launched_strategy import launched_strategy
from hf_gpu_train.plan.planner import STRATEGY_CHOICES
from hf_gpu_train.plan.strategies import (
    AUTO_CANDIDATES,
    CPU_STRATEGIES,
    DEEPSPEED,
    MULTI_PROCESS,
    STRATEGIES,
    deepspeed_name,
    family_of,
    fsdp_name,
    replica_strategy,
    strategy,
    strategy_names,
)


def test_the_tuples_readers_used_to_spell_out_are_the_tables():
    assert STRATEGY_CHOICES == ("auto", "single", "ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3",
                                "deepspeed-zero2-offload", "deepspeed-zero3-offload")
    assert MULTI_PROCESS == ("ddp", "fsdp-shard-grad-op", "fsdp", "deepspeed-zero2", "deepspeed-zero3", "fsdp-offload",
                             "deepspeed-zero2-offload", "deepspeed-zero3-offload")
    assert AUTO_CANDIDATES == ("ddp", "fsdp-shard-grad-op", "fsdp", "fsdp-offload")
    assert strategy_names(lambda s: s.replicated) == ("single", "ddp")
    assert strategy_names(lambda s: "lora" in s.adapters and s.family == DEEPSPEED) == (
        "deepspeed-zero2", "deepspeed-zero3", "deepspeed-zero2-offload", "deepspeed-zero3-offload")
    assert strategy_names(lambda s: "qlora" in s.adapters) == ("single", "ddp")
    assert (replica_strategy(False), replica_strategy(True)) == ("single", "ddp")


def test_every_name_a_row_gives_is_a_row():
    for row in STRATEGIES.values():
        assert all(name in STRATEGIES for name in row.tries)
        assert row.base in STRATEGIES
        assert row.cpu_variant is None or row.cpu_variant in STRATEGIES or row.cpu_variant in CPU_STRATEGIES
        assert (row.zero_stage is not None) == (row.family == DEEPSPEED)
    for row in CPU_STRATEGIES.values():
        assert row.on_cpu and row.launched_as in STRATEGIES and STRATEGIES[row.launched_as].cpu_variant == row.name


def test_an_unknown_strategy_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown strategy 'zero2': one of single, ddp, .*deepspeed-zero3-offload, cpu, cpu-ddp"):
        strategy("zero2")
    assert strategy("cpu-fsdp").distributed_type == "FSDP"


def test_a_launch_reads_back_into_the_rows_names():
    assert fsdp_name(True, False) == "fsdp" and fsdp_name(False, False) == "fsdp-shard-grad-op"
    assert fsdp_name(True, True) == "fsdp-offload" and deepspeed_name(3, True) == "deepspeed-zero3-offload"
    assert deepspeed_name(1, False) == "deepspeed-zero1" and family_of("deepspeed-zero1") == DEEPSPEED  # no row, a family
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false", "WORLD_SIZE": "2"}
    assert launched_strategy(environ) == "fsdp-shard-grad-op"
    assert launched_strategy({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}) == "deepspeed-zero3"
