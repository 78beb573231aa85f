"""The causal-LM config keys, the method checks made before a model loads, LoRA targets and perplexity."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.tasks.language_modeling.methods import apply_method, check_method, target_modules
from hf_gpu_train.finetune.tasks.language_modeling.outputs import with_perplexity
from hf_gpu_train.finetune.tasks.language_modeling.task import ADAPTER_LEARNING_RATE, CAUSAL_LM_FULL_LEARNING_RATE
from tests.finetune.tasks.language_modeling.tiny import tiny_llama

LM = ["task=causal-lm", "model=builtin:smollm2"]


def test_method_and_learning_rate_resolve_per_task():
    assert load_config(None, LM).method == "lora" and load_config(None, LM).learning_rate == ADAPTER_LEARNING_RATE
    assert load_config(None, [*LM, "method=full"]).learning_rate == CAUSAL_LM_FULL_LEARNING_RATE
    assert load_config(None, [*LM, "learning_rate=1e-5"]).learning_rate == 1e-5
    classifier = load_config()
    assert classifier.method == "full" and classifier.learning_rate is None  # by the model: finetune/learning_rates.py
    assert load_config(None, [*LM, "packing=false"]).packing is False and load_config(None, [*LM, "packing=true"]).packing is True


@pytest.mark.parametrize("overrides, message", [
    (["method=lora"], "method='lora': LoRA and QLoRA are for task=causal-lm"),
    ([*LM, "method=adapters"], "method='adapters': use one of auto, full, lora, qlora"),
    (["task=causal-lm"], "model='builtin:minilm': task=causal-lm needs a causal language model: model=builtin:smollm2"),
    ([*LM, "lora_r=0"], "lora_r=0: must be at least 1"),
    ([*LM, "lora_dropout=1.0"], r"lora_dropout=1.0: must be in \[0, 1\)"),
    ([*LM, "method=full", "merge_adapter=true"], "merge_adapter=True: method=full trains the model itself"),
    ([*LM, "packing=sometimes"], "packing='sometimes': use auto, true or false"),
    ([*LM, "generation_samples=-1"], "generation_samples=-1"),
    ([*LM, "chat_template=/no/such.jinja"], "chat_template='/no/such.jinja': give the path of a Jinja chat template"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_qlora_without_cuda_and_missing_packages_are_refused_with_the_install_command(monkeypatch):
    cpu = SimpleNamespace(on_cuda=False)
    with pytest.raises(ConfigError, match="method=qlora needs an NVIDIA GPU with CUDA .* use method=lora on this machine"):
        check_method(load_config(None, [*LM, "method=qlora"]).method, cpu)
    check_method(load_config(None, LM).method, cpu)  # LoRA runs anywhere
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("peft", "bitsandbytes") else real(name, *a))
    with pytest.raises(ConfigError, match=r"method=lora needs the peft package: pip install -e '\.\[llm\]'"):
        check_method(load_config(None, LM).method, cpu)
    check_method(load_config(None, [*LM, "method=full"]).method, cpu)


def applied(model, cfg):
    return apply_method(model, cfg.options, cfg.method, cfg.gradient_checkpointing)


def test_lora_targets_every_linear_layer_but_the_head_by_default():
    assert target_modules("all-linear") == "all-linear" and target_modules("q_proj, v_proj") == ["q_proj", "v_proj"]
    model = applied(tiny_llama(300), load_config(None, [*LM, "lora_r=4"]))
    adapted = {name.split(".lora_A")[0].split(".")[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(("lora_" in name) == p.requires_grad for name, p in model.named_parameters())
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 32


def test_perplexity_is_exp_of_the_eval_loss():
    assert with_perplexity({"eval_loss": 2.5, "epoch": 1.0}) == {"eval_loss": 2.5, "epoch": 1.0, "eval_perplexity": math.exp(2.5)}
    assert with_perplexity({"eval_loss": 1e4})["eval_perplexity"] == math.inf
    assert with_perplexity({"epoch": 1.0}) == {"epoch": 1.0}


def test_lora_with_gradient_checkpointing_gives_the_adapters_the_gradients_they_get_without_it():
    import torch

    def adapter_grads(checkpointing: bool) -> dict:
        model = applied(tiny_llama(300), load_config(None, [*LM, f"gradient_checkpointing={str(checkpointing).lower()}"]))
        if checkpointing:
            model.gradient_checkpointing_enable()  # what the Trainer does for gradient_checkpointing=true
        model.train()
        ids = torch.arange(3, 19).unsqueeze(0)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = adapter_grads(False), adapter_grads(True)
    assert plain.keys() == checkpointed.keys() and len(plain) == 2 * 7 * 2  # A and B, 7 linears, 2 layers
    for name, grad in plain.items():
        assert torch.allclose(checkpointed[name], grad, atol=1e-7), name
    assert all(float(g.abs().sum()) > 0 for n, g in plain.items() if "lora_B" in n)  # A's is zero while B starts at zero
