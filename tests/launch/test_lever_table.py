"""Issue 19: the per-lever table (launch/lever_table.py) and how the planner counts each lever (the table through
`hf-gpu-train plan-memory`: tests/cli/test_plan_memory.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_gpu_train.launch.activations import activation_bytes, offloaded_bytes
from hf_gpu_train.launch.lever_table import GIB, lever_table, recommended_config
from hf_gpu_train.launch.memory import estimate, largest_parameter
from hf_gpu_train.launch.model_spec import ModelSpec
from hf_gpu_train.launch.training_shape import TrainingShape

LLAMA_1B = ModelSpec(name="llama-1b", params=1_236_000_000, num_layers=16, hidden_size=2048, num_heads=32, vocab_size=128256,
                     causal_lm=True, num_kv_heads=8, head_dim=64, intermediate_size=8192, gated_mlp=True)
BERT = ModelSpec(name="bert-base", params=110_000_000, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522)


@pytest.mark.parametrize("spec,method", [(LLAMA_1B, "full"), (LLAMA_1B, "lora"), (BERT, "full")])
def test_each_lever_takes_memory_off_and_none_puts_it_back(spec, method):
    shape = TrainingShape(seq_len=2048, precision="bf16", method=method)
    if method == "lora":
        spec = replace(spec, adapted_linears=7 * 16, adapted_in_features=16 * (2048 * 5 + 2048 + 8192),
                       adapted_out_features=16 * (2048 + 512 * 2 + 2048 + 8192 * 2 + 2048))
    table = lever_table(spec, shape, "single", 80 * GIB, useful_micro_batch=4)
    totals = [row.total_bytes for row in table.rows]
    assert totals == sorted(totals, reverse=True) and totals[-1] < totals[0]
    levers = [row.lever for row in table.rows]
    assert ("+ chunked LM head and loss" in levers) == spec.causal_lm
    assert ("+ optimizer step in the backward" in levers) == (method == "full")
    micro = [row.largest_micro_batch for row in table.rows]
    assert micro == sorted(micro)


def test_the_recommendation_is_the_fewest_levers_that_reach_the_useful_micro_batch():
    shape = TrainingShape(seq_len=4096, precision="bf16", method="full")
    roomy = lever_table(LLAMA_1B, shape, "single", 640 * GIB, useful_micro_batch=1)
    assert roomy.recommended == 0 and recommended_config(roomy) == []
    tight = lever_table(LLAMA_1B, shape, "single", 40 * GIB, useful_micro_batch=4)
    i = tight.recommended
    assert tight.rows[i].largest_micro_batch >= 4
    assert all(row.largest_micro_batch < 4 for row in tight.rows[:i])
    assert "gradient_checkpointing=true" in recommended_config(tight) or "chunked_lm_loss=true" in recommended_config(tight)
    hopeless = lever_table(LLAMA_1B, shape, "single", 4 * GIB, useful_micro_batch=4)
    assert hopeless.recommended is None and "nothing fits" in hopeless.reason


def test_without_the_useful_micro_batch_the_set_reaching_the_largest_one_is_recommended():
    shape = TrainingShape(seq_len=8192, precision="bf16", method="full")
    table = lever_table(LLAMA_1B, shape, "single", 24 * GIB, useful_micro_batch=8, peak_flops=989e12, pcie_bytes_per_s=50e9)
    best = max(row.largest_micro_batch for row in table.rows)
    assert 1 <= best < 8
    assert table.rows[table.recommended].largest_micro_batch == best
    assert "below the useful 8" in table.reason


def test_offloading_cost_is_hidden_behind_compute_or_counted_as_the_excess():
    shape = TrainingShape(seq_len=2048, precision="bf16", method="full")
    fast = lever_table(LLAMA_1B, shape, "single", 80 * GIB, useful_micro_batch=4, peak_flops=989e12, pcie_bytes_per_s=50e9)
    slow = lever_table(LLAMA_1B, shape, "single", 80 * GIB, useful_micro_batch=4, peak_flops=989e12, pcie_bytes_per_s=1e9)
    fast_row, slow_row = fast.rows[-1], slow.rows[-1]
    assert fast_row.lever == "+ activation offloading"
    moved = fast_row.offloaded_bytes
    compute = 6 * LLAMA_1B.params * 4 * 2048 / (989e12 * 0.4)
    assert 2 * moved / 50e9 < compute and fast_row.cost_fraction == 0 and fast_row.cost.startswith("hidden")
    assert slow_row.cost_fraction == pytest.approx((2 * moved / 1e9 - compute) / compute)


def test_offloading_keeps_two_layers_on_the_gpu_and_the_rest_on_the_host():
    for checkpointing in (False, True):
        shape = TrainingShape(micro_batch=2, seq_len=2048, precision="bf16", gradient_checkpointing=checkpointing)
        offloaded = replace(shape, offload_activations=True)
        assert activation_bytes(LLAMA_1B, offloaded) + offloaded_bytes(LLAMA_1B, offloaded) == activation_bytes(LLAMA_1B, shape)
        assert offloaded_bytes(LLAMA_1B, offloaded) > 0
    plain = TrainingShape(micro_batch=2, seq_len=2048, precision="bf16")
    from hf_gpu_train.launch.activations import activation_terms

    full, kept = activation_terms(LLAMA_1B, plain), activation_terms(LLAMA_1B, replace(plain, offload_activations=True))
    assert kept["layers"] == full["layers"] * 2 / LLAMA_1B.num_layers


def test_the_optimizer_in_backward_holds_two_parameters_gradients():
    shape = TrainingShape(micro_batch=1, seq_len=512, precision="bf16", method="full")
    plain, in_backward = estimate(LLAMA_1B, shape, "single"), estimate(LLAMA_1B, replace(shape, optimizer_in_backward=True), "single")
    assert plain.gradients == 4 * LLAMA_1B.params
    assert in_backward.gradients == 8 * largest_parameter(LLAMA_1B) == 8 * 128256 * 2048  # the embedding is the largest
    assert estimate(LLAMA_1B, replace(shape, optimizer_in_backward=True, num_gpus=2), "ddp").gradients == 4 * LLAMA_1B.params
