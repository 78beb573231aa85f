"""Causal-LM fine-tuning through scripts/finetune.py scales as an equality: LoRA on 2 gloo DDP processes and under
DeepSpeed ZeRO-3 trains the adapter 1 process trains, and full fine-tuning with FSDP2 or ZeRO-2 on 2 processes
(configs from `hf-gpu-train config --strategy fsdp` or `deepspeed-zero2`) trains the model 1 process trains: the same
logged losses and gradient norms at every step, the same saved weights. Packed rows (best-fit decreasing, per-example position ids) and a loss normalised by the label
tokens of the whole global batch (transformers 5's num_items_in_batch), as shipped. Tolerances: equivalence.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_gpu_train.finetune.run import main
from hf_gpu_train.levers.activation_offload import TEST_CPU_MIN_BYTES_ENV
from tests.finetune.tasks.language_modeling.tiny import chat_case
from tests.launching import cpu_config, launch
from tests.scaling.equivalence import assert_same_params, assert_same_series
from tests.scaling.test_deepspeed_equivalence import deepspeed_config
from tests.scaling.test_fsdp_equivalence import fsdp_config

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune.py"
ROWS_PER_STEP = 4  # packed rows per optimizer step, over every process


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> list[str]:
    return chat_case(tmp_path_factory.mktemp("lm-scaling"), 48, 8, "max_length=160", "num_train_epochs=2", "learning_rate=1e-3",
                     "warmup_ratio=0", "logging_steps=1", "generation_samples=0", "extra={adam_epsilon: 1.0e-6}",
                     f"global_batch_size={ROWS_PER_STEP}")


def history(out: Path, key: str) -> list[float]:
    return [h[key] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if key in h]


def assert_same_training(got: Path, expected: Path, weights: str) -> None:
    assert len(history(expected, "loss")) >= 4  # several optimizer steps over several packed rows each
    assert_same_series("logged loss", history(got, "loss"), history(expected, "loss"))
    assert_same_series("gradient norm", history(got, "grad_norm"), history(expected, "grad_norm"))
    assert_same_params(load_file(got / weights), load_file(expected / weights))


# The memory levers on 2 processes (selective checkpointing, activation offloading and the chunked head, each rank's
# own) against one process without them: the levers are exact, and every rank applies the same ones.
LEVERS = ("gradient_checkpointing=true", "checkpoint_layers=selective", "offload_activations=true")


@pytest.mark.parametrize("method, weights, strategy, levers", [("lora", "adapter_model.safetensors", "ddp", ()),
                                                               ("full", "model.safetensors", "fsdp", ()),
                                                               ("lora", "adapter_model.safetensors", "ddp", LEVERS),
                                                               ("lora", "adapter_model.safetensors", "deepspeed-zero3", ()),
                                                               ("full", "model.safetensors", "deepspeed-zero2", ())],
                         ids=["lora-ddp", "full-fsdp", "lora-ddp-levers", "lora-zero3", "full-zero2"])
def test_two_processes_train_what_one_process_trains(tmp_path, case, method, weights, strategy, levers):
    arguments = [*case, f"method={method}"]
    one = tmp_path / "one"
    # against the levers, the one process also keeps the model's own head (full logits): the 2 processes' chunked head
    # (on by default) is then proven across processes too, not only against itself
    plain = ["chunked_lm_loss=false"] if levers else []
    assert main([*arguments, *plain, f"per_device_train_batch_size={ROWS_PER_STEP}", f"output_dir={one}"]) == 0
    config = {"ddp": cpu_config, "fsdp": fsdp_config}.get(strategy, lambda path: deepspeed_config(path, strategy))(tmp_path)
    two = tmp_path / "two"
    # with the levers, offloading takes its copy path on these CPU processes (saved tensors of 4 KiB and more: the tiny
    # model's), so the equality below covers copies out and back, not a message that there was nothing to do
    env = {TEST_CPU_MIN_BYTES_ENV: "4096"} if levers else None
    run = launch(config, SCRIPT, *arguments, *levers, f"per_device_train_batch_size={ROWS_PER_STEP // 2}", f"output_dir={two}",
                 timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "CPU x2" in run.stdout and "packed" in run.stdout
    if strategy.startswith("deepspeed"):  # DeepSpeed's engine trained it (the recovery steps aside for it, on each rank)
        assert run.stderr.count("OOM recovery is off for Trainer: DeepSpeed's engine") == 2, run.stderr[-3000:]
    if levers:
        assert "checkpointing: selective" in run.stdout and "go to pinned host memory" in run.stdout
        assert "LM head and loss: chunked" in run.stdout and "(checked on this model, on cpu)" in run.stdout
        assert json.loads((two / "run_summary.json").read_text())["offloaded_activation_bytes"] > 0
    assert_same_training(two, one, weights)
