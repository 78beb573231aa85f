"""The DeepSpeed config file of a ZeRO-Offload plan (NAME.deepspeed.json), beside the accelerate config that names it.

Why a file: accelerate's YAML keys for DeepSpeed (``zero_stage``, ``offload_optimizer_device``, ...) build a config
without an ``optimizer`` section. transformers' Trainer then hands DeepSpeed its own torch AdamW, and DeepSpeed refuses
a client optimizer beside optimizer offloading ("You are using ZeRO-Offload with a client provided optimizer ...",
``zero_force_ds_cpu_optimizer``, deepspeed/runtime/engine.py): the plan would fail at the first step. The file names
DeepSpeed's ``AdamW``, which under offloading is its ``DeepSpeedCPUAdam`` (a vectorised C++ step, several times
torch's on the CPU), and leaves every value the run decides as ``"auto"`` for transformers to fill from its
TrainingArguments (batch, accumulation, clipping, learning rate and betas, precision, bucket sizes from the model's
hidden size). accelerate reads the file's path relative to the directory the launch runs in, like every path given to
it; `hf-gpu-train config` writes the path as its ``--output`` names it.
"""

from __future__ import annotations

import json
from pathlib import Path

DEEPSPEED_FILE_PLACEHOLDER = "NAME.deepspeed.json"  # in LaunchPlan.accelerate until render_yaml knows the path
STEPS_PER_PRINT = 2**31 - 1  # DeepSpeed's own step log: the Trainer logs the run


def deepspeed_file_for(stage: int, offload_params: bool) -> dict:
    """The config file's contents for ZeRO ``stage`` with the optimizer (and, ``offload_params``, the parameters) in
    CPU memory."""
    zero: dict = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if stage == 3:
        zero.update({
            "offload_param": {"device": "cpu" if offload_params else "none", "pin_memory": True},
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,  # save_model writes a whole model, not shards
        })
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": zero,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }


def deepspeed_path_for(config_path: str | Path) -> Path:
    """NAME.yaml -> NAME.deepspeed.json."""
    return Path(config_path).with_suffix(".deepspeed.json")


def render_deepspeed_file(contents: dict) -> str:
    return json.dumps(contents, indent=2) + "\n"


def accelerate_keys(accelerate: dict, deepspeed_path: str | Path | None) -> dict:
    """The accelerate config with the DeepSpeed file's real path in place of the placeholder."""
    ds = accelerate.get("deepspeed_config") or {}
    if ds.get("deepspeed_config_file") != DEEPSPEED_FILE_PLACEHOLDER:
        return accelerate
    if deepspeed_path is None:
        raise ValueError("this plan's accelerate config names a DeepSpeed config file: give its path (NAME.deepspeed.json)")
    return {**accelerate, "deepspeed_config": {**ds, "deepspeed_config_file": str(deepspeed_path)}}
