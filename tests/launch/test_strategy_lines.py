"""Issue 28, item 2: the printed launch lines carry the plan's strategy. torchrun reads no accelerate config, so its line
carries the variables `accelerate launch` would export for the YAML (accelerate builds its FSDP and DeepSpeed plugins
from them); the sbatch's per-node `accelerate launch` starts each node's processes itself (torchrun), for DeepSpeed too.
Checked here by building accelerate's own plugins from the printed environment (DeepSpeed cannot train on this CPU
machine); tests/launch/test_strategy_processes.py launches the FSDP lines for real."""

from __future__ import annotations

import os
import shlex
from unittest import mock

import pytest

from hf_gpu_train.launch.render import render_yaml, torchrun_command
from hf_gpu_train.launch.slurm import render_sbatch
from hf_gpu_train.plan.deepspeed_config import deepspeed_path_for, render_deepspeed_file
from hf_gpu_train.plan.model_spec import ModelSpec
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from tests.conftest import REFERENCE_MACHINES


def line_environment(line: str) -> dict[str, str]:
    """The VAR=value words before the command of a printed line."""
    env = {}
    for word in shlex.split(line):
        name, eq, value = word.partition("=")
        if not eq or not name.replace("_", "").isalnum():
            break
        env[name] = value
    return env


def test_the_torchrun_line_of_an_fsdp_plan_builds_accelerates_fsdp_plugin(machine):
    from accelerate.utils import FullyShardedDataParallelPlugin

    plan = make_plan(machine("cpu-only"), PlanOptions(strategy="fsdp", cpu_processes=2))
    env = line_environment(torchrun_command(plan, "train.py", "cfg/box.yaml"))
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["ACCELERATE_USE_CPU"] == "1"
    assert env["HF_GPU_TRAIN_PLAN"] == "cfg/box.plan.json" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = FullyShardedDataParallelPlugin()  # as accelerate builds it in each process
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert str(plugin.state_dict_type) == "StateDictType.SHARDED_STATE_DICT" and type(plugin.cpu_offload).__name__ == "OffloadPolicy"  # no CPUOffloadPolicy


def test_the_torchrun_line_of_a_gpu_fsdp_plan_keeps_its_sharding_mode_and_layer_class(machine):
    spec = ModelSpec(name="m", params=int(3e9), num_layers=24, hidden_size=2560, layer_class="LlamaDecoderLayer")
    plan = make_plan(machine("2x-rtx4090"), PlanOptions(strategy="fsdp", model=spec, seq_len=1024))
    acc = plan.accelerate["fsdp_config"]
    env = line_environment(torchrun_command(plan, "train.py", "cfg/box.yaml"))
    assert env["CUDA_VISIBLE_DEVICES"] == plan.accelerate["gpu_ids"] and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == str(acc["fsdp_reshard_after_forward"]).lower()
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert env["FSDP_OFFLOAD_PARAMS"] == str(acc["fsdp_offload_params"]).lower()
    assert env["FSDP_ACTIVATION_CHECKPOINTING"] == str(acc["fsdp_activation_checkpointing"]).lower()


def test_the_torchrun_line_of_a_ddp_plan_names_no_strategy(machine):
    env = line_environment(torchrun_command(make_plan(machine("2x-rtx4090")), "train.py", "cfg/box.yaml"))
    assert not [k for k in env if k.startswith(("ACCELERATE_USE_", "FSDP_", "ACCELERATE_DEEPSPEED"))], env


def test_the_torchrun_line_of_a_zero3_plan_builds_accelerates_deepspeed_plugin(machine):
    from accelerate.utils import DeepSpeedPlugin

    plan = make_plan(machine("2x-rtx4090"), PlanOptions(strategy="deepspeed-zero3"))
    env = line_environment(torchrun_command(plan, "train.py", "cfg/box.yaml"))
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 3 and plugin.zero3_init_flag is True
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "none"


def test_the_torchrun_line_of_a_zero_offload_plan_names_its_deepspeed_file(machine, tmp_path):
    from accelerate.utils import DeepSpeedPlugin

    spec = ModelSpec(name="big", params=int(8e9), num_layers=40, hidden_size=5120)
    plan = make_plan(machine("2x-rtx4090"), PlanOptions(strategy="deepspeed-zero3", model=spec, seq_len=512))
    assert plan.strategy == "deepspeed-zero3-offload" and plan.deepspeed_file is not None
    config = tmp_path / "box.yaml"
    deepspeed_path_for(config).write_text(render_deepspeed_file(plan.deepspeed_file))
    config.write_text(render_yaml(plan, "test", deepspeed_path_for(config)))
    env = line_environment(torchrun_command(plan, "train.py", config))
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(deepspeed_path_for(config))
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    with mock.patch.dict(os.environ, env, clear=True):
        plugin = DeepSpeedPlugin()  # reads the file, and refuses accelerate fields it ignores beside it
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and plugin.deepspeed_config["optimizer"]


def test_a_multi_node_deepspeed_sbatch_starts_each_nodes_processes_itself(machine, tmp_path):
    """The sbatch runs one `accelerate launch` per node; with DeepSpeed's default multi-node launcher (pdsh) each of them
    would start the whole job over ssh from a hostfile instead."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    plan = make_plan(machine("8x-h100-sxm"), PlanOptions(strategy="deepspeed-zero2", num_machines=2, main_process_ip="node0"))
    config = tmp_path / "box.yaml"
    config.write_text(render_yaml(plan, "test"))
    script = render_sbatch(plan, config)
    srun = script.split("bash -c '", 1)[1].split("\n    ", 1)[0]
    assert '$HF_GPU_TRAIN launch --config-file "$HF_GPU_TRAIN_CONFIG_FILE"' in srun and f"HF_GPU_TRAIN_CONFIG_FILE={config} " in script
    argv = ["--config_file", str(config), "--num_machines", "2", "--num_processes", "16", "--machine_rank", "1",
            "--main_process_ip", "node0", "--main_process_port", "0", "--rdzv_backend", "c10d", "--same_network", "train.py"]
    with mock.patch.dict(os.environ, {}, clear=True):
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
        args.deepspeed_fields_from_accelerate_config = "zero_stage"
        cmd, env = prepare_deepspeed_cmd_env(args)
    assert cmd is None, cmd  # torchrun on this node (accelerate's "standard" launcher), not `deepspeed --hostfile`
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"


def accelerates_own_environment(config) -> dict[str, str]:
    """What `accelerate launch --config_file CONFIG` exports, by accelerate's own launch code (the oracle)."""
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    acc = yaml.safe_load(config.read_text())
    file = bool((acc.get("deepspeed_config") or {}).get("deepspeed_config_file"))
    argv = ["--config_file", str(config), *(["--mixed_precision", acc["mixed_precision"]] if file else []), "x.py"]
    with mock.patch.dict(os.environ, {}, clear=True):
        args, defaults, precision_from_config = _validate_launch_command(launch_command_parser().parse_args(argv))
        args.main_process_port = 0
        if args.use_deepspeed:
            args.deepspeed_fields_from_accelerate_config = ",".join(list(defaults.deepspeed_config)
                                                                    + (["mixed_precision"] if precision_from_config else []))
            _, env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            env = prepare_multi_gpu_env(args)
        else:
            return {"ACCELERATE_MIXED_PRECISION": args.mixed_precision}
    dynamo_off = env.get("ACCELERATE_DYNAMO_BACKEND") == "NO"
    return {k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")
            and not (dynamo_off and k.startswith("ACCELERATE_DYNAMO_"))}


STRATEGIES = [("auto", None), ("fsdp", None), ("fsdp", 3e9), ("deepspeed-zero2", None), ("deepspeed-zero3", 8e9),
              ("fsdp", "2-node"), ("deepspeed-zero3", "2-node")]


@pytest.mark.parametrize("name", REFERENCE_MACHINES)
def test_the_torchrun_environment_is_what_accelerate_launch_exports(machine, tmp_path, name):
    from hf_gpu_train.launch.accelerate_env import launch_environment
    from hf_gpu_train.plan.decisions import PlanError
    from hf_gpu_train.plan.deepspeed_config import accelerate_keys

    checked = 0
    for strategy, extra in STRATEGIES:
        options = PlanOptions(strategy=strategy, cpu_processes=2)
        if isinstance(extra, float):
            options = PlanOptions(strategy=strategy, model=ModelSpec(name="m", params=int(extra), num_layers=40, hidden_size=5120,
                                                                     layer_class="LlamaDecoderLayer"), seq_len=512)
        elif extra == "2-node":
            options = PlanOptions(strategy=strategy, cpu_processes=1, num_machines=2, main_process_ip="node0")
        try:
            plan = make_plan(machine(name), options)
        except PlanError:
            continue  # not a plan this machine makes (DeepSpeed without GPUs, a MIG instance, too big)
        config = tmp_path / f"{checked}.yaml"
        path = deepspeed_path_for(config) if plan.deepspeed_file is not None else None
        config.write_text(render_yaml(plan, "test", path))
        ours = launch_environment(accelerate_keys(plan.accelerate, path), precision_on_command_line=path is not None)
        assert ours == accelerates_own_environment(config), (strategy, extra, plan.strategy)
        checked += 1
    assert checked
