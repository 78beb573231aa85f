"""A DeepSpeed launch known before the Trainer exists (finetune/deepspeed_env.py): the ZeRO stage from accelerate's
exported environment, and under ZeRO-3 the config transformers' ``from_pretrained`` reads to load the model
partitioned (``zero.Init``) instead of whole on every process."""

from __future__ import annotations

import json

import pytest

from hf_gpu_train.finetune.deepspeed_env import hold_zero3_init, zero_stage_requested
from hf_gpu_train.plan.deepspeed_config import deepspeed_file_for


def test_the_stage_comes_from_the_file_then_the_yaml_key_then_accelerates_default(tmp_path):
    assert zero_stage_requested({}) is None
    assert zero_stage_requested({"ACCELERATE_USE_DEEPSPEED": "true"}) == 2
    assert zero_stage_requested({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}) == 3
    file = tmp_path / "ds.json"
    file.write_text(json.dumps(deepspeed_file_for(3, offload_params=False)))
    assert zero_stage_requested({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                 "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(file)}) == 3


@pytest.fixture
def zero3_launch(monkeypatch, tmp_path):
    pytest.importorskip("deepspeed")
    from transformers.integrations import unset_hf_deepspeed_config

    file = tmp_path / "ds.json"
    file.write_text(json.dumps(deepspeed_file_for(3, offload_params=True)))
    for key, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(file)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", raising=False)
    yield
    unset_hf_deepspeed_config()


def test_under_a_zero3_launch_transformers_loads_partitioned(zero3_launch, monkeypatch):
    """What from_pretrained asks before it wraps the load in deepspeed.zero.Init (modeling_utils: is_deepspeed_zero3_enabled),
    with accelerate's batch placeholders filled so DeepSpeed's parser takes the config."""
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    held = hold_zero3_init("bf16")
    assert held is not None and is_deepspeed_zero3_enabled()
    config = deepspeed_config()
    assert config["train_micro_batch_size_per_gpu"] == 1 and config["zero_optimization"]["stage"] == 3
    # the run's precision, not the file's "auto": zero.Init partitions the weights in it (and DeepSpeed never casts them)
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert hold_zero3_init("fp32") is not None and deepspeed_config()["bf16"]["enabled"] is False
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")  # the launch config turned zero3_init_flag off
    assert hold_zero3_init("bf16") is None


def test_without_deepspeed_nothing_is_held(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert hold_zero3_init() is None


def test_a_deepspeed_optimizer_section_is_said_and_refuses_another_optim(tmp_path):
    """A ZeRO-Offload plan's file names DeepSpeed's AdamW: it steps every trainable parameter as one group (weight
    decay on norms and biases too, unlike the Trainer's AdamW groups), and a run's optim= would be ignored."""

    from hf_gpu_train.finetune.config import ConfigError
    from hf_gpu_train.finetune.deepspeed_env import deepspeed_optimizer_line

    file = tmp_path / "ds.json"
    file.write_text(json.dumps(deepspeed_file_for(3, offload_params=True)))
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(file)}
    line = deepspeed_optimizer_line({}, 0.01, environ)
    assert "DeepSpeed's AdamW" in line and "norms and biases too" in line
    with pytest.raises(ConfigError, match="optim: adafactor.*names its own optimizer"):
        deepspeed_optimizer_line({"optim": "adafactor"}, 0.01, environ)
    without = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}  # YAML keys: no optimizer section
    assert deepspeed_optimizer_line({"optim": "adafactor"}, 0.01, without) is None
