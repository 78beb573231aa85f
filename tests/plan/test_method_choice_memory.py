"""Which method the planner recommends, for real model shapes on the shipped machines, and why.

Llama-3-8B in bf16 at seq 2048 per GPU (tests/plan/test_peft_memory.py works the numbers by hand): full
fine-tuning needs 16 bytes per parameter (120 GiB) before activations; LoRA holds a 15 GiB bf16 base and
needs 20.07 GiB at micro-batch 1 with checkpointing; QLoRA 14.14 GiB.
"""

from dataclasses import replace

import pytest

from hf_gpu_train.plan.gpus import select_devices
from hf_gpu_train.plan.memory import GIB, TrainingShape, usable_bytes
from hf_gpu_train.plan.method_choice import recommend_method, useful_micro_batch
from hf_gpu_train.plan.model_spec import ModelSpec, from_config
from tests.plan.test_peft_memory import LLAMA3_8B, SMOLLM2_135M

BERT = ModelSpec(name="bert-base", params=109_482_240, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522,
                 largest_layer_params=7_087_872, layer_class="BertLayer")


@pytest.fixture(scope="module")
def llama3():
    return from_config(dict(LLAMA3_8B), name="llama-3-8b")


def on(machine_name, spec, seq_len=2048, precision="bf16", global_batch=32, prefer_full=False):
    from hf_gpu_train.hardware.snapshot import load_machine

    selection = select_devices(load_machine(machine_name), "all")
    shape = TrainingShape(seq_len=seq_len, precision=precision)
    return recommend_method(spec, selection.memory_free_bytes, len(selection.gpus), shape, global_batch, prefer_full=prefer_full)


def by_key(rec):
    return {c.key: c for c in rec.candidates}


def test_useful_micro_batch_is_four_samples_or_2048_tokens():
    assert useful_micro_batch(BERT, TrainingShape(seq_len=512), 32) == 4  # ceil(2048/512) = 4
    assert useful_micro_batch(BERT, TrainingShape(seq_len=1024), 32) == 2
    assert useful_micro_batch(BERT, TrainingShape(seq_len=4096), 32) == 1
    assert useful_micro_batch(BERT, TrainingShape(seq_len=128), 32) == 4  # 16 by tokens, capped at 4 samples
    assert useful_micro_batch(BERT, TrainingShape(seq_len=128), 3) == 3  # the whole per-GPU batch is smaller
    vision = ModelSpec(name="vit", params=10**7, activation_bytes_per_sample_fp32=10**8)
    assert useful_micro_batch(vision, TrainingShape(seq_len=4096), 32) == 4  # images are not tokens


def test_8b_on_24gb_cards_full_does_not_fit_lora_barely_does_qlora_does(llama3):
    rec = on("2x-rtx4090", llama3)
    c = by_key(rec)
    assert not c["full"].fits and not c["full-sharded"].fits  # 16 bytes/param: 120 GiB, or 60 GiB sharded over two
    assert c["full"].note.startswith("needs 154.6 GiB per GPU at micro-batch 1 with checkpointing (ddp)")
    assert rec.chosen.key == "lora"
    plan = rec.chosen.plan
    assert (plan.strategy, plan.micro_batch, plan.gradient_accumulation, plan.gradient_checkpointing) == ("ddp", 1, 16, True)
    assert plan.breakdown.total <= usable_bytes(24 * GIB)
    assert c["qlora"].largest_micro_batch == 2
    assert rec.reason.startswith("LoRA r16, DDP x2: LoRA keeps the base in the compute dtype")
    # twice the sequence: LoRA no longer fits at micro-batch 1 (24.16 GiB), QLoRA still does
    longer = on("2x-rtx4090", llama3, seq_len=4096)
    assert not by_key(longer)["lora"].fits and longer.chosen.key == "qlora"
    assert "the only adapter method that fits" in longer.reason


def test_8b_on_a_t4_only_qlora_and_only_at_1024_tokens(llama3):
    rec = on("1x-t4", llama3, seq_len=1024, precision="fp16")
    assert rec.chosen.key == "qlora" and rec.chosen.plan.gradient_checkpointing
    assert "LoRA r16, 1 GPU does not fit (needs" in rec.reason
    too_long = on("1x-t4", llama3, seq_len=2048, precision="fp16")
    assert too_long.chosen is None and too_long.reason.startswith("nothing fits in 15.0 GiB per GPU")


def test_8x_h100_prefers_lora_and_names_the_sharded_alternative(llama3):
    rec = on("8x-h100-sxm", llama3)
    assert rec.chosen.key == "lora" and rec.chosen.plan.strategy == "ddp"
    assert rec.reason.endswith("--prefer-full chooses it")
    full = on("8x-h100-sxm", llama3, prefer_full=True)
    assert full.chosen.key == "full-sharded" and full.chosen.plan.strategy == "fsdp-shard-grad-op"
    assert [c.key for c in full.candidates] == ["full", "full-sharded", "lora", "qlora"]


def test_full_first_where_it_fits(llama3):
    h200 = on("1x-h200", llama3)  # 140 GiB: full fine-tuning at micro-batch 1 x 2048 tokens with checkpointing
    assert h200.chosen.key == "full" and h200.chosen.plan.micro_batch == 1
    small = on("1x-t4", from_config(dict(SMOLLM2_135M), name="smollm2"), precision="fp16")
    assert small.chosen.key == "full"
    assert small.reason.startswith("full, 1 GPU: full fine-tuning fits with a whole model per GPU")


def test_a_useful_micro_batch_beats_an_earlier_method_that_barely_fits(llama3):
    # 20 GiB, seq 512 (useful: 4): LoRA fits only micro-batch 2, QLoRA reaches 7 -> QLoRA
    shape = TrainingShape(seq_len=512)
    rec = recommend_method(llama3, 20 * GIB, 1, shape, 32)
    c = by_key(rec)
    assert (c["lora"].largest_micro_batch, c["qlora"].largest_micro_batch) == (2, 7)
    assert rec.chosen.key == "qlora" and "LoRA r16, 1 GPU reaches only micro-batch 2" in rec.reason
    # 12 GiB: nothing reaches 4; the first that fits at all (QLoRA at 1) is chosen and said so
    tight = recommend_method(llama3, 12 * GIB, 1, shape, 32)
    assert tight.chosen.key == "qlora" and tight.chosen.largest_micro_batch == 1
    assert "this is the first that fits at all" in tight.reason


def test_adapters_only_for_causal_lms_with_known_layers():
    rec = recommend_method(BERT, 16 * GIB, 1, TrainingShape(seq_len=128), 32)
    assert rec.chosen.key == "full"
    assert not by_key(rec)["lora"].available and "causal LMs" in by_key(rec)["lora"].note
    bare = recommend_method(replace(BERT, causal_lm=True), 16 * GIB, 1, TrainingShape(seq_len=128), 32)
    assert "give --model" in by_key(bare)["qlora"].note
