"""The variables `accelerate launch` gives the training processes for a launch config, for the lines that start them
without it (torchrun).

`accelerate launch --config_file NAME.yaml` turns the YAML's strategy into environment variables (``ACCELERATE_USE_FSDP``
and ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED`` and ``ACCELERATE_DEEPSPEED_*``, the precision)
and each process's ``Accelerator`` builds its FSDP or DeepSpeed plugin from them. A torchrun line reads no YAML: without
those variables its processes train plain DDP, whatever the plan was sized for. So the torchrun line carries them,
derived from the same accelerate dict the YAML is written from.

Derived here, not by calling accelerate's launch code (``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``): that
imports torch, and `hf-gpu-train config` must not (it plans on login nodes, from snapshots). accelerate's own code is
the oracle instead: tests/launch/test_strategy_lines.py runs it on the YAML of every reference machine and strategy and
requires the same variables and values, so an accelerate that exports something new fails a test, not a run.
Mirrors accelerate 1.16 (``accelerate/utils/launch.py``).
"""

from __future__ import annotations

# `accelerate launch` exports these for every FSDP launch, from its parser's defaults when the YAML does not say (the
# plugin's own defaults when a variable is absent differ: use_orig_params and sync_module_states False, min_num_params 0)
FSDP_LAUNCH_DEFAULTS = {
    "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false", "FSDP_MIN_NUM_PARAMS": "100000000", "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}
FSDP_NAMES = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP"}  # the one key named otherwise
# the YAML's deepspeed_config keys and the variables accelerate exports for them (None: read by the launcher only)
DEEPSPEED_NAMES = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE", "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING", "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "deepspeed_multinode_launcher": None,
    "deepspeed_hostfile": None, "deepspeed_exclusion_filter": None, "deepspeed_inclusion_filter": None,
}
LOWERED = ("ACCELERATE_GRADIENT_CLIPPING", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
           "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_ZERO3_INIT",
           "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")


def _word(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def launch_environment(accelerate: dict, precision_on_command_line: bool = False) -> dict[str, str]:
    """The variables `accelerate launch --config_file` exports for ``accelerate`` (the YAML's keys, a DeepSpeed file's
    real path in place), ``ACCELERATE_MIXED_PRECISION`` last. ``precision_on_command_line``: the launch passes
    ``--mixed_precision`` (beside a DeepSpeed config file: deepspeed_config.py), so accelerate does not count the YAML's
    among the DeepSpeed fields it read. Raises ValueError for a strategy key this mapping does not know."""
    kind = accelerate.get("distributed_type", "NO")
    env: dict[str, str] = {}
    if accelerate.get("debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if kind == "DEEPSPEED":
        ds = dict(accelerate.get("deepspeed_config") or {})
        fields = sorted(ds) + ([] if precision_on_command_line else ["mixed_precision"])
        env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields).lower()
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        for key, value in ds.items():
            if key not in DEEPSPEED_NAMES:
                raise ValueError(f"deepspeed_config key {key!r}: unknown to the torchrun line's environment "
                                 "(hf_gpu_train/launch/accelerate_env.py); add what accelerate exports for it")
            name = DEEPSPEED_NAMES[key]
            if name is not None and value is not None:
                env[name] = _word(value).lower() if name in LOWERED else _word(value)
    elif kind in ("FSDP", "MULTI_GPU", "MEGATRON_LM"):
        if kind == "MEGATRON_LM":
            raise ValueError("distributed_type MEGATRON_LM: the torchrun line cannot carry it; launch with accelerate launch")
        if kind == "FSDP":
            env["ACCELERATE_USE_FSDP"] = "true"
            fsdp = {**FSDP_LAUNCH_DEFAULTS}
            for key, value in (accelerate.get("fsdp_config") or {}).items():
                if value is None:
                    continue
                name = FSDP_NAMES.get(key, key.upper() if key.startswith("fsdp_") else f"FSDP_{key.upper()}")
                fsdp[name] = _word(value)
            if fsdp["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true" and fsdp["FSDP_SYNC_MODULE_STATES"] != "true":
                raise ValueError("fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true (accelerate refuses it)")
            env.update(fsdp)
    else:  # one process (accelerate's simple launcher): no strategy
        return {"ACCELERATE_MIXED_PRECISION": _word(accelerate.get("mixed_precision", "no"))}
    # no ACCELERATE_CPU_AFFINITY: accelerate 1.16 exports it for --enable_cpu_affinity only, never for a YAML's
    # enable_cpu_affinity (its parser's default False keeps the config's value out), and this line does what it does
    env["ACCELERATE_MIXED_PRECISION"] = _word(accelerate.get("mixed_precision", "no"))
    return env
