"""Issue 19: the memory levers `hf-gpu-train config` plans reach the run as plan values (scoped like the micro-batch
to the model and shape they were planned for), the run's memory check counts them, and a lever this run's own
choices rule out is dropped with its reason instead of failing the run."""

from __future__ import annotations

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.finetune.launch_plan import apply_launch_plan
from hf_gpu_train.finetune.loading import load_config_and_keys
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.plan.run_plan_file import PLAN_ENV, read_run_plan

SEQ = 16384  # Llama-3-8B full fine-tuning at 16k tokens on one H200 fits only with the levers (tests/levers/test_lever_plan.py)
RUN = ["task=causal-lm", "method=full", f"max_length={SEQ}", "train_file=unused.jsonl", "global_batch_size=16"]


@pytest.fixture(scope="module")
def llama8b_plan(tmp_path_factory):
    """(plan file, model directory): a config-only Llama-3-8B planned at 16k tokens on one H200."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama8b")
    LlamaConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=SEQ).save_pretrained(folder / "model")
    out = folder / "h200"
    assert main(["config", "--machine", "1x-h200", "--model", str(folder / "model"), "--seq-len", str(SEQ), "--global-batch", "16",
                 "--output", str(out)]) == 0
    return out.with_name("h200.plan.json"), folder / "model"


def applied(plan_file, model, *overrides):
    cfg, explicit = load_config_and_keys(None, [f"model={model}", *RUN, *overrides])
    return apply_launch_plan(cfg, explicit, environ={PLAN_ENV: str(plan_file), "WORLD_SIZE": "1"}, here=load_machine("1x-h200"))


def test_the_planned_levers_reach_the_run_and_its_memory_check_counts_them(llama8b_plan):
    plan_file, model = llama8b_plan
    plan = read_run_plan(plan_file, "test")
    assert (plan.value("chunked_lm_loss"), plan.value("offload_activations"), plan.value("gradient_checkpointing")) == (True, True, True)
    cfg, applied_plan = applied(plan_file, model)
    assert (cfg.chunked_lm_loss, cfg.gradient_checkpointing, cfg.offload_activations) == (True, True, True)
    assert cfg.per_device_train_batch_size == plan.value("per_device_train_batch_size")
    applied_line = next(line for line in applied_plan.lines if line.startswith("plan values applied:"))
    assert "chunked_lm_loss=True" in applied_line and "offload_activations=True" in applied_line
    assert applied_plan.memory.fits, applied_plan.memory  # counted with the levers: the same estimate the plan made
    assert applied_plan.memory.estimate_bytes == plan.memory.estimate_bytes


def test_without_the_levers_the_memory_check_warns(llama8b_plan):
    plan_file, model = llama8b_plan
    cfg, applied_plan = applied(plan_file, model, "chunked_lm_loss=false", "offload_activations=false")
    assert not cfg.offload_activations and cfg.chunked_lm_loss is False
    assert not applied_plan.memory.fits and "out-of-memory" in applied_plan.memory.warning
    assert any("offload_activations=False (your config) over the plan's True" in line for line in applied_plan.lines)


def test_a_planned_lever_this_run_rules_out_is_dropped_with_its_reason(llama8b_plan):
    plan_file, model = llama8b_plan
    cfg, applied_plan = applied(plan_file, model, "torch_compile=true")
    assert cfg.torch_compile and not cfg.offload_activations  # a compiled forward cannot carry the saved-tensor hooks
    assert "offload_activations=True (this run compiles the model (torch_compile))" in applied_plan.lines[-1]


@pytest.mark.parametrize("values, world, extra, dropped", [
    ({"gradient_checkpointing": False, "checkpoint_layers": "selective"}, 1, {}, ("checkpoint_layers", "checkpointing is off")),
    ({"optimizer_in_backward": True, "per_device_train_batch_size": 2, "global_batch_size": 8}, 1, {}, ("optimizer_in_backward", "accumulates")),
    ({"optimizer_in_backward": True, "per_device_train_batch_size": 4, "global_batch_size": 8}, 2, {}, ("optimizer_in_backward", "2 processes")),
    ({"optimizer_in_backward": True, "per_device_train_batch_size": 4, "global_batch_size": 4}, 1, {"max_grad_norm": 1.0},
     ("optimizer_in_backward", "clips gradients")),
    ({"optimizer_in_backward": True, "per_device_train_batch_size": 4, "global_batch_size": 4}, 1, {}, None),
    ({"gradient_checkpointing": True, "checkpoint_layers": "selective-lean"}, 1, {"method": "qlora"}, ("checkpoint_layers", "qlora")),
    ({"chunked_lm_loss": True, "precision": "fp16"}, 1, {}, ("chunked_lm_loss", "fp16")),
    ({"gradient_checkpointing": True, "checkpoint_layers": "selective"}, 1, {"attn_implementation": "flex_attention"},
     ("checkpoint_layers", "attn_implementation=flex_attention")),
    ({"gradient_checkpointing": True, "checkpoint_layers": "selective"}, 1, {"attn_implementation": "eager"}, None),
])
def test_which_planned_levers_hold(values, world, extra, dropped):
    from hf_gpu_train.levers.from_config import LeverKeys, planned_levers_that_hold

    extra = dict(extra)
    attention = extra.pop("attn_implementation", None)
    cfg = LeverKeys(method=extra.pop("method", "full"), max_grad_norm=extra.get("max_grad_norm"))
    before = dict(values)
    found = planned_levers_that_hold(values, set(values), cfg, world, attention)
    if dropped is None:
        assert found == [] and values == before
        return
    (key, planned, why), = found
    assert key == dropped[0] and planned == before[key] and dropped[1] in why
    assert values[key] in ("all", False, "auto")
    assert planned_levers_that_hold(dict(before), set(), cfg, world, attention) == []  # the user's own choice is never dropped


def test_the_planned_levers_do_not_reach_another_model(llama8b_plan, tmp_path):
    from transformers import LlamaConfig

    plan_file, _ = llama8b_plan
    other = tmp_path / "other"
    LlamaConfig(vocab_size=32_000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4).save_pretrained(other)
    cfg, applied_plan = applied(plan_file, other)
    assert not cfg.offload_activations and cfg.chunked_lm_loss == "auto"  # the recipe's own (defaults)
    not_applied = applied_plan.lines[-1]
    assert "offload_activations=True (made for another model or shape)" in not_applied
    assert "chunked_lm_loss=True (made for another model or shape)" in not_applied
