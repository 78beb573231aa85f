"""Issue 19: the per-lever table and the recommended set (plan/lever_table.py), and how the planner counts each
lever (the table through `hf-gpu-train plan-memory`: tests/cli/test_plan_memory.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_gpu_train.plan.activations import activation_bytes, activation_terms, offloaded_bytes
from hf_gpu_train.plan.lever_table import GIB, lever_table
from hf_gpu_train.plan.memory import estimate
from hf_gpu_train.plan.model_spec import ModelSpec, largest_parameter
from hf_gpu_train.plan.training_shape import TrainingShape

LLAMA_1B = ModelSpec(name="llama-1b", params=1_236_000_000, num_layers=16, hidden_size=2048, num_heads=32, vocab_size=128256,
                     causal_lm=True, num_kv_heads=8, head_dim=64, intermediate_size=8192, gated_mlp=True)
BERT = ModelSpec(name="bert-base", params=110_000_000, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522)
H100 = dict(peak_flops=989e12, pcie_bytes_per_s=50e9)


def with_adapters(spec):
    return replace(spec, adapted_linears=7 * 16, adapted_in_features=16 * (2048 * 5 + 2048 + 8192),
                   adapted_out_features=16 * (2048 + 512 * 2 + 2048 + 8192 * 2 + 2048))


@pytest.mark.parametrize("spec,method", [(LLAMA_1B, "full"), (with_adapters(LLAMA_1B), "lora"), (BERT, "full")])
def test_each_lever_takes_memory_off_and_none_puts_it_back(spec, method):
    table = lever_table(spec, TrainingShape(seq_len=2048, precision="bf16", method=method), "single", 80 * GIB,
                        useful_micro_batch=4, **H100)
    totals = [s.total_bytes for _, s in table.rows]
    assert totals == sorted(totals, reverse=True) and totals[-1] < totals[0]
    labels = [label for label, _ in table.rows]
    assert ("+ chunked LM head and loss" in labels) == spec.causal_lm
    assert ("+ optimizer step in the backward" in labels) == (method == "full")
    micro = [s.largest_micro_batch for _, s in table.rows]
    assert micro == sorted(micro)


def test_the_recommendation_is_the_cheapest_exact_set_that_reaches_the_useful_micro_batch():
    shape = TrainingShape(seq_len=4096, precision="bf16", method="full")
    roomy = lever_table(LLAMA_1B, shape, "single", 640 * GIB, useful_micro_batch=1, **H100)
    assert roomy.recommended.names == [] and roomy.recommended.config() == []
    tight = lever_table(LLAMA_1B, shape, "single", 32 * GIB, useful_micro_batch=4, **H100)
    chosen = tight.recommended
    assert chosen.largest_micro_batch >= 4 and chosen.exact
    every = [replace(shape, micro_batch=4, chunked_loss=c, gradient_checkpointing=p is not None, checkpoint_layers=p or "all",
                     offload_activations=o) for c in (False, True) for p in (None, "selective", "selective-lean", "every-2", "all")
             for o in (False, True)]
    from hf_gpu_train.plan.lever_table import _Costs, _evaluate

    costs = _Costs(LLAMA_1B, shape, 4 * 4096, H100["peak_flops"], H100["pcie_bytes_per_s"])
    reaching = [s for s in (_evaluate(LLAMA_1B, x, "single", 32 * GIB, costs) for x in every) if s.largest_micro_batch >= 4]
    assert reaching and chosen.cost == min(s.cost for s in reaching)
    hopeless = lever_table(LLAMA_1B, shape, "single", 4 * GIB, useful_micro_batch=4, **H100)
    assert hopeless.recommended is None and "nothing fits" in hopeless.reason


def test_the_optimizer_in_the_backward_is_a_last_resort_and_needs_one_micro_batch_per_step():
    shape = TrainingShape(seq_len=8192, precision="bf16", method="full")
    table = lever_table(LLAMA_1B, shape, "single", 24 * GIB, useful_micro_batch=4, **H100)
    if table.recommended is not None and table.recommended.shape.optimizer_in_backward:
        assert not any(s.exact and s.largest_micro_batch >= 4 for _, s in table.rows)
        assert "gradient clipping off" in table.reason
    accumulating = lever_table(LLAMA_1B, shape, "single", 24 * GIB, useful_micro_batch=4, per_gpu_batch=32, **H100)
    assert any("needs the step's 32 samples per GPU in one micro-batch" in note for note in accumulating.notes)
    assert accumulating.recommended is None or not accumulating.recommended.shape.optimizer_in_backward


def test_offloading_costs_its_copies_back_in_the_backward_always():
    shape = TrainingShape(seq_len=2048, precision="bf16", method="full", gradient_checkpointing=True)
    fast = lever_table(LLAMA_1B, shape, "single", 80 * GIB, useful_micro_batch=4, peak_flops=989e12, pcie_bytes_per_s=50e9)
    slow = lever_table(LLAMA_1B, shape, "single", 80 * GIB, useful_micro_batch=4, peak_flops=989e12, pcie_bytes_per_s=5e9)
    (label, quick), (_, sluggish) = fast.rows[-2], slow.rows[-2]
    assert label == "+ activation offloading"
    compute = 6 * LLAMA_1B.params * 4 * 2048 / (989e12 * 0.4)
    recompute = 2 / 6
    for s, pcie in ((quick, 50e9), (sluggish, 5e9)):
        copy = s.offloaded_bytes / pcie
        assert s.cost == pytest.approx(recompute + (max(0, copy - compute * recompute) + copy) / compute)
    assert sluggish.cost > quick.cost > recompute


def test_offloading_keeps_two_layers_on_the_gpu_and_the_rest_on_the_host():
    for checkpointing in (False, True):
        shape = TrainingShape(micro_batch=2, seq_len=2048, precision="bf16", gradient_checkpointing=checkpointing)
        offloaded = replace(shape, offload_activations=True)
        assert activation_bytes(LLAMA_1B, offloaded) + offloaded_bytes(LLAMA_1B, offloaded) == activation_bytes(LLAMA_1B, shape)
        assert offloaded_bytes(LLAMA_1B, offloaded) > 0
    plain = TrainingShape(micro_batch=2, seq_len=2048, precision="bf16")
    full, kept = activation_terms(LLAMA_1B, plain), activation_terms(LLAMA_1B, replace(plain, offload_activations=True))
    assert kept["layers"] == full["layers"] * 2 / LLAMA_1B.num_layers


def test_the_optimizer_in_backward_holds_two_parameters_gradients():
    shape = TrainingShape(micro_batch=1, seq_len=512, precision="bf16", method="full")
    plain, in_backward = estimate(LLAMA_1B, shape, "single"), estimate(LLAMA_1B, replace(shape, optimizer_in_backward=True), "single")
    assert plain.gradients == 4 * LLAMA_1B.params
    assert in_backward.gradients == 8 * largest_parameter(LLAMA_1B) == 8 * 128256 * 2048  # the embedding is the largest
    assert estimate(LLAMA_1B, replace(shape, optimizer_in_backward=True, num_gpus=2), "ddp").gradients == 4 * LLAMA_1B.params
