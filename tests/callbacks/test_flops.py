"""FLOPs per training token by what trains: full fine-tuning, LoRA-style adapters, a frozen backbone."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_gpu_train.callbacks.flops import dense_flops_per_token, transformer_flops_per_token
from tests.callbacks.tiny import tiny_bert


def linear_weights(model, trainable=None):
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
               and (trainable is None or m.weight.requires_grad == trainable))


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


class Adapted(torch.nn.Module):
    """A LoRA-style wrapper as peft builds it: the frozen base layer first, then the trainable A and B."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def with_adapters(model):
    model.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, Adapted(getattr(layer.self_attn, name)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer.mlp, name, Adapted(getattr(layer.mlp, name)))
    return model


def test_full_fine_tuning_is_six_per_weight_plus_attention():
    model = tiny_bert()
    layers, hidden = 2, 32
    assert transformer_flops_per_token(model, 16) == 6 * linear_weights(model) + 12 * layers * hidden * 16


def test_tied_lm_head_counts_as_a_matmul():
    model = tiny_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    flops, through = dense_flops_per_token(model)
    assert flops == 6 * linear_weights(model) and through and model.lm_head.weight.numel() == 128 * 32


def test_lora_is_six_per_trainable_and_four_per_frozen_weight():
    model = with_adapters(tiny_llama())
    flops, through = dense_flops_per_token(model)
    frozen, trainable = linear_weights(model, trainable=False), linear_weights(model, trainable=True)
    # no gradient is needed into the very first base layer (layer 0's q_proj: nothing trainable before it)
    first_base = model.model.layers[0].self_attn.q_proj.base_layer.weight.numel()
    first_a = model.model.layers[0].self_attn.q_proj.lora_A.weight.numel()
    assert flops == 6 * trainable + 4 * frozen - 2 * first_base - 2 * first_a
    assert through and flops == pytest.approx(6 * trainable + 4 * frozen, rel=0.05)


def test_frozen_backbone_with_a_trainable_head_needs_no_backward_through_it():
    model = tiny_bert()
    model.bert.requires_grad_(False)
    head = model.classifier.weight.numel()
    flops, through = dense_flops_per_token(model)
    assert flops == 2 * (linear_weights(model) - head) + 4 * head and not through
    assert transformer_flops_per_token(model, 16) == flops + 4 * 2 * 32 * 16
