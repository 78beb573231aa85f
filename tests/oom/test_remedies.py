from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_gpu_train.oom.remedies import planner_estimate


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


ARGS = SimpleNamespace(bf16=False, fp16=False, gradient_checkpointing=False)
INPUTS = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}


def test_the_estimate_follows_the_method_the_model_trains_with():
    assert "(full)" in planner_estimate(ARGS, tiny_llama(), INPUTS)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    text = planner_estimate(ARGS, lora, INPUTS)
    assert "(lora)" in text and "--method auto" in text


def test_the_estimate_counts_the_memory_levers_the_model_runs_with(monkeypatch):
    """Issue 19: an OOM message's planner estimate follows selective checkpointing, one layer in N and the optimizer in
    the backward as the model runs them."""
    from hf_gpu_train.levers import selective_checkpoint
    from hf_gpu_train.plan import memory

    shapes = []
    real = memory.estimate
    monkeypatch.setattr(memory, "estimate", lambda spec, shape, strategy: (shapes.append(shape), real(spec, shape, strategy))[1])
    selective = tiny_llama()
    selective_checkpoint.enable(selective)
    every = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    every.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=2)
    in_backward = tiny_llama()
    in_backward._hf_gpu_train_optimizer_in_backward = True
    for model in (tiny_llama(), selective, every, in_backward):
        assert planner_estimate(ARGS, model, INPUTS)
    assert [(s.gradient_checkpointing, s.checkpoint_layers, s.optimizer_in_backward) for s in shapes] == [
        (False, "all", False), (True, "selective", False), (True, "every-2", False), (False, "all", True)]
