"""Issue 19, lever 5: the DeepSpeed configs `hf-gpu-train config` writes go through the whole chain a GPU run takes,
here on the CPU: `hf-gpu-train launch`'s command line, accelerate's own launch parser and DeepSpeed environment, its
DeepSpeedPlugin, transformers' filling of every "auto" value from TrainingArguments and the model, and DeepSpeed's
own config parser (``deepspeed.runtime.config.DeepSpeedConfig``): what can be refused before it is refused here. The
engine itself trains on CPU processes (DeepSpeed's CPU accelerator, gloo) in tests/scaling/test_deepspeed_equivalence.py,
and on a GPU in scripts/gpu_check.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.cli.launch import build_launch
from hf_gpu_train.hardware.snapshot import load_machine

deepspeed = pytest.importorskip("deepspeed")
SCRIPT = str(Path(__file__).resolve().parents[2] / "scripts" / "finetune.py")


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama8b-config")
    LlamaConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8).save_pretrained(folder)
    return folder


def configure(tmp_path, machine, *options) -> Path:
    out = tmp_path / "box"
    assert main(["config", "--machine", machine, *options, "--output", str(out)]) == 0
    return out.with_suffix(".yaml")


def accelerate_environment(argv: list[str]) -> dict[str, str]:
    """The ACCELERATE_* environment `accelerate launch` gives the training processes for ``argv`` (its parser, its
    validation against the config file, its DeepSpeed launcher's environment), as launch_command() builds it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(argv)
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    assert args.use_deepspeed
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mixed_precision_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


def deepspeed_config_of_the_run(monkeypatch, yaml_path: Path, micro: int, accumulation: int, hidden_size: int):
    """(DeepSpeedConfig, the filled dict): what DeepSpeed would be initialised with in a run launched with this YAML
    by `hf-gpu-train launch`."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    launch = build_launch(["--config-file", str(yaml_path), SCRIPT], environ={}, here=load_machine("1x-h200"))
    argv = launch.cmd[launch.cmd.index("--config_file"):]
    environment = accelerate_environment(argv)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    launch_precision = environment["ACCELERATE_MIXED_PRECISION"]
    plugin.set_mixed_precision(launch_precision)  # as AcceleratorState does
    defaults = TrainingArguments(output_dir=str(yaml_path.parent / "out"), use_cpu=True)
    args = SimpleNamespace(**{k: getattr(defaults, k) for k in (
        "max_grad_norm", "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "save_on_each_node",
        "fp16_full_eval", "bf16_full_eval")}, world_size=1, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, fp16=launch_precision == "fp16", bf16=launch_precision == "bf16",
        get_warmup_steps=lambda steps: 0)
    filled = HfTrainerDeepSpeedConfig(plugin.deepspeed_config)
    filled.trainer_config_process(args)
    filled.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)), 100)
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(filled.config), filled.config


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero3_with_cpu_offload_names_deepspeeds_cpu_adam_and_parses(tmp_path, monkeypatch, llama8b, precision):
    """The last resort for Llama-3-8B full fine-tuning on one 24 GB card: ZeRO-3 with the optimizer and the parameters
    in CPU memory, stepped by DeepSpeed's CPU Adam (a client optimizer beside offloading is refused by DeepSpeed). In
    fp32 too: accelerate refuses the YAML's mixed_precision "no" beside the file as it refuses bf16."""
    yaml_path = configure(tmp_path, "2x-rtx4090", "--gpus", "1", "--model", str(llama8b), "--seq-len", "2048", "--global-batch", "16",
                          "--precision", precision)
    plan = json.loads(yaml_path.with_suffix(".plan.json").read_text())
    assert plan["strategy"]["value"] == "deepspeed-zero3-offload"
    ds_file = yaml_path.with_suffix(".deepspeed.json")
    assert ds_file.is_file() and str(ds_file) in yaml_path.read_text()
    micro, accumulation = plan["values"]["per_device_train_batch_size"]["value"], plan["values"]["gradient_accumulation_steps"]["value"]
    parsed, config = deepspeed_config_of_the_run(monkeypatch, yaml_path, micro, accumulation, 4096)
    zero = parsed.zero_config
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_param.device) == (3, "cpu", "cpu")
    assert parsed.optimizer_name == "adamw" and parsed.bfloat16_config.enabled == (precision == "bf16")
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (micro, accumulation)
    assert config["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096 and parsed.gradient_clipping == 1.0
    assert zero.gather_16bit_weights_on_model_save


def test_without_its_optimizer_section_deepspeed_would_refuse_the_trainers_optimizer():
    """What the YAML keys alone (the config before this file) gave DeepSpeed for the same plan: optimizer offloading and
    no optimizer of its own, so the engine refuses transformers' AdamW (engine.py: zero_force_ds_cpu_optimizer)."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    plugin = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu", zero3_init_flag=True)
    config = json.loads(json.dumps(plugin.deepspeed_config).replace('"auto"', "1"))
    parsed = DeepSpeedConfig(config)
    assert parsed.optimizer_name is None and parsed.zero_force_ds_cpu_optimizer
    assert parsed.zero_config.offload_optimizer.device == "cpu"  # the engine's condition for the refusal, all three


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_without_offload_parses_from_the_yaml_keys(tmp_path, monkeypatch, llama8b, stage):
    yaml_path = configure(tmp_path, "8x-h100-sxm", "--strategy", f"deepspeed-zero{stage}", "--model", str(llama8b),
                          "--seq-len", "2048", "--global-batch", "64")
    plan = json.loads(yaml_path.with_suffix(".plan.json").read_text())
    assert plan["strategy"]["value"] == f"deepspeed-zero{stage}"
    assert not yaml_path.with_suffix(".deepspeed.json").exists()
    micro, accumulation = plan["values"]["per_device_train_batch_size"]["value"], plan["values"]["gradient_accumulation_steps"]["value"]
    parsed, _ = deepspeed_config_of_the_run(monkeypatch, yaml_path, micro, accumulation, 4096)
    assert parsed.zero_config.stage == stage
    assert parsed.zero_config.offload_optimizer is None or parsed.zero_config.offload_optimizer.device == "none"
    assert parsed.bfloat16_config.enabled and parsed.train_micro_batch_size_per_gpu == micro


def test_a_missing_deepspeed_file_is_named_before_accelerate_starts(tmp_path, llama8b):
    from hf_gpu_train.errors import UsageError

    yaml_path = configure(tmp_path, "2x-rtx4090", "--gpus", "1", "--model", str(llama8b), "--seq-len", "2048")
    yaml_path.with_suffix(".deepspeed.json").unlink()
    with pytest.raises(UsageError, match="deepspeed_config_file .* does not exist"):
        build_launch(["--config-file", str(yaml_path), SCRIPT], environ={}, here=load_machine("2x-rtx4090"))


def test_the_sbatch_of_a_deepspeed_file_plan_passes_the_precision(tmp_path, llama8b):
    """Every node's accelerate launch would refuse the YAML's mixed_precision beside the DeepSpeed file."""
    out = tmp_path / "nodes"
    assert main(["config", "--machine", "2x-rtx4090", "--gpus", "1", "--num-machines", "2", "--main-process-ip", "10.0.0.1",
                 "--strategy", "deepspeed-zero3", "--model", str(llama8b), "--seq-len", "2048", "--output", str(out)]) == 0
    assert out.with_suffix(".deepspeed.json").is_file()
    assert "--mixed_precision bf16" in out.with_suffix(".sbatch").read_text()
