"""Issue 19: `hf-gpu-train config` plans the memory levers (plan/lever_plan.py): a model that fits nowhere without
them gets the levers that make it fit, a cheaper set replaces checkpointing every layer where it reaches the useful
micro-batch, sharded strategies get only what they can run, and DeepSpeed ZeRO-3 with CPU offload is the last resort
where nothing else fits, checked against the host's RAM."""

from dataclasses import replace

import pytest

from hf_gpu_train.plan.decisions import PlanError
from hf_gpu_train.plan.document import plan_document
from hf_gpu_train.plan.lever_plan import host_bytes_per_process, plan_with_levers
from hf_gpu_train.plan.lever_table import lever_table
from hf_gpu_train.plan.memory import estimate, plan_memory, usable_bytes
from hf_gpu_train.plan.model_spec import from_config
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.training_shape import TrainingShape
from tests.plan.test_peft_memory import LLAMA3_8B

H200 = int(140.4 * 2**30)


@pytest.fixture(scope="module")
def llama3():
    return from_config(dict(LLAMA3_8B), name="llama-3-8b")


def test_a_context_that_fits_nowhere_without_levers_is_planned_with_them(machine, llama3):
    shape = TrainingShape(seq_len=16384, precision="bf16")
    assert plan_memory(llama3, H200, 1, shape, 16, strategies=("single",)) is None  # not even micro-batch 1 with checkpointing
    plan = make_plan(machine("1x-h200"), PlanOptions(model=llama3, seq_len=16384, global_batch=16))
    m = plan.memory
    assert plan.strategy == "single" and m.micro_batch >= 1 and m.effective_batch == 16
    levers = dict(m.levers)
    assert levers["chunked_lm_loss"] is True and levers["offload_activations"] is True and m.gradient_checkpointing
    counted = replace(shape, micro_batch=m.micro_batch, chunked_loss=True, gradient_checkpointing=True,
                      checkpoint_layers=levers["checkpoint_layers"], offload_activations=True)
    assert m.breakdown.total == estimate(llama3, counted, "single").total <= usable_bytes(H200)
    assert m.host_bytes > 0 and any("host memory" in r for r in m.reasons)
    values = plan_document(plan, "hf-gpu-train config ...", "box.yaml")["values"]
    assert {k: values[k]["value"] for k in levers} == levers and all(values[k]["reason"] for k in levers)
    assert "activation offloading" in values["offload_activations"]["reason"] or "pinned host" in values["offload_activations"]["reason"]


def test_selective_checkpointing_replaces_every_layer_where_it_reaches_the_useful_micro_batch(machine, llama3):
    """At 2048 tokens one sample fills the GPU's matmuls (method_choice.useful_micro_batch): selective checkpointing
    reaches it for a few percent where checkpointing every layer recomputes a third of the step."""
    plan = make_plan(machine("1x-h200"), PlanOptions(model=llama3, seq_len=2048, global_batch=16))
    levers = dict(plan.memory.levers)
    assert levers["checkpoint_layers"] == "selective" and levers["chunked_lm_loss"] is True
    assert levers["offload_activations"] is None and levers["optimizer_in_backward"] is None
    table = lever_table(llama3, TrainingShape(seq_len=2048, precision="bf16"), "single", H200, 1, per_gpu_batch=16)
    every_layer = [s for label, s in table.rows if label == "+ checkpointing every layer"][0]
    assert table.recommended.cost < every_layer.cost


def test_a_plan_that_needs_no_lever_records_none(machine):
    from hf_gpu_train.plan.model_spec import ModelSpec

    bert = ModelSpec(name="bert-base", params=109_482_240, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522,
                     largest_layer_params=7_087_872, layer_class="BertLayer")
    plan = make_plan(machine("1x-h200"), PlanOptions(model=bert, seq_len=128, global_batch=32))
    assert dict(plan.memory.levers) == {"chunked_lm_loss": None, "checkpoint_layers": None, "offload_activations": None,
                                        "optimizer_in_backward": None}  # none needed: each the run's own
    assert not plan.memory.gradient_checkpointing and plan.memory.micro_batch == 32


def test_sharded_strategies_get_only_the_levers_they_run(machine, llama3):
    plan = make_plan(machine("8x-h100-sxm"), PlanOptions(model=llama3, seq_len=8192, global_batch=64))
    assert plan.strategy.startswith("fsdp")
    levers = dict(plan.memory.levers)
    assert levers["checkpoint_layers"] in (None, "all") and not levers["offload_activations"] and not levers["optimizer_in_backward"]
    assert plan.accelerate["fsdp_config"]["fsdp_activation_checkpointing"] == plan.memory.gradient_checkpointing


def test_zero3_with_cpu_offload_is_the_last_resort_and_the_host_must_hold_it(machine, llama3):
    box = machine("2x-rtx4090")
    plan = make_plan(box, PlanOptions(gpus="1", model=llama3, seq_len=2048, global_batch=16))
    assert plan.strategy == "deepspeed-zero3-offload" and plan.accelerate["distributed_type"] == "DEEPSPEED"
    zero = plan.deepspeed_file["zero_optimization"]  # the file the YAML names (test_deepspeed_config.py parses it)
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["offload_param"]["device"]) == (3, "cpu", "cpu")
    assert plan.deepspeed_file["optimizer"]["type"] == "AdamW"  # DeepSpeed's CPU Adam steps the offloaded states
    host = host_bytes_per_process(llama3, TrainingShape(precision="bf16"), "deepspeed-zero3-offload", 1)
    assert host == llama3.params * 18  # fp32 master, two fp32 moments, fp32 gradients, the 16-bit parameters
    reasons = " ".join(plan.memory.reasons)
    assert "nothing else fits" in reasons and f"host memory {host / 2**30:.1f} GiB" in reasons and "--method lora" in reasons
    small = replace(box, host=replace(box.host, ram_total_bytes=64 * 2**30))
    with pytest.raises(PlanError, match="--method lora or qlora"):
        make_plan(small, PlanOptions(gpus="1", model=llama3, seq_len=2048, global_batch=16))
    with pytest.raises(PlanError, match="does not fit"):  # asked for one GPU without DeepSpeed: no last resort
        make_plan(box, PlanOptions(gpus="1", model=llama3, seq_len=2048, global_batch=16, strategy="ddp"))


def test_the_optimizer_in_the_backward_is_planned_only_for_a_step_of_one_micro_batch(llama3):
    """Full fine-tuning whose gradients are what does not fit: the optimizer in the backward, only when the whole
    step is one micro-batch (with accumulation it would step on a partial gradient)."""
    shape = TrainingShape(seq_len=512, precision="bf16")
    memory = int(130 * 2**30)  # 8B x 16 bytes does not fit; without the full gradients (4 bytes a parameter) it does
    alone = plan_with_levers(llama3, memory, 1, shape, 1, ("single",), last_resort=False)
    assert alone is not None and dict(alone.levers)["optimizer_in_backward"] is True and alone.gradient_accumulation == 1
    eight = plan_with_levers(llama3, memory, 1, shape, 8, ("single",), last_resort=False)
    assert (eight.micro_batch, eight.gradient_accumulation, dict(eight.levers)["optimizer_in_backward"]) == (8, 1, True)
    # 4096 samples a step do not fit in one micro-batch even with it, and accumulating would step on partial gradients
    assert plan_with_levers(llama3, memory, 1, shape, 4096, ("single",), last_resort=False) is None


def test_a_host_too_small_for_the_cheapest_offloading_gets_a_set_that_offloads_less(machine, llama3):
    """Review of issue 19: the host-memory check used to reject the strategy when the recommended set offloaded more than
    the host holds; now sets that fit the host compete (LoRA at 16k tokens on one 24 GB card, 16 GiB of RAM)."""
    box = machine("2x-rtx4090")
    small = replace(box, host=replace(box.host, ram_total_bytes=16 * 2**30))
    options = PlanOptions(gpus="1", model=llama3, seq_len=16384, global_batch=16, method="lora")
    roomy = make_plan(box, options).memory
    tight = make_plan(small, options).memory
    assert roomy.host_bytes > 16 * 2**30 * 0.8  # what it chose on a roomy host would not fit this one
    assert tight.micro_batch >= 1 and tight.host_bytes <= 16 * 2**30 * 0.8


def test_a_model_whose_head_does_more_than_a_matmul_is_not_planned_with_the_chunked_head(machine):
    """Review of issue 19: Gemma-2 soft-caps its logits; the run refuses chunked_lm_loss=true for it, so the plan must
    not count on it."""
    gemma = from_config({"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
                         "final_logit_softcapping": 30.0}, name="gemma-2-2b")
    assert "final_logit_softcapping" in gemma.lm_head_extras
    plan = make_plan(machine("1x-h200"), PlanOptions(model=gemma, seq_len=8192, global_batch=16))
    assert dict(plan.memory.levers)["chunked_lm_loss"] is None
