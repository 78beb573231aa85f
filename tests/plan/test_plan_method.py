"""`hf-gpu-train config --method lora|qlora` plans what the run trains, and the run's memory check follows the run's
method: an 8B LoRA recipe on a 24 GB card is planned (full fine-tuning does not fit), and a LoRA run on a plan is not
warned about with full fine-tuning's gradients and optimizer states."""

from dataclasses import replace

import pytest

from hf_gpu_train.plan.decisions import PlanError
from hf_gpu_train.plan.document import plan_document
from hf_gpu_train.plan.model_spec import from_config
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.resolution import check_memory
from hf_gpu_train.plan.run_plan_file import read_run_plan
from tests.plan.test_peft_memory import LLAMA3_8B


@pytest.fixture(scope="module")
def llama3():
    return from_config(dict(LLAMA3_8B), name="llama-3-8b")


def test_lora_and_qlora_plans_for_an_8b_model_on_a_24gb_card(machine, llama3):
    options = dict(gpus="1", model=llama3, seq_len=2048)
    full = make_plan(machine("2x-rtx4090"), PlanOptions(**options))  # only with ZeRO-3 in CPU memory (test_lever_plan.py)
    assert full.strategy == "deepspeed-zero3-offload" and "--method lora or qlora" in " ".join(full.memory.reasons)
    lora = make_plan(machine("2x-rtx4090"), PlanOptions(**options, method="lora"))
    qlora = make_plan(machine("2x-rtx4090"), PlanOptions(**options, method="qlora"))
    assert lora.memory.gradient_checkpointing and lora.memory.micro_batch >= 1
    # a 4-bit base leaves room for more: the levers it needs recompute less (one layer in two, or none)
    lora_base, qlora_base = lora.memory.breakdown, qlora.memory.breakdown
    assert qlora_base.quantized_weights + qlora_base.weights < lora_base.weights / 2
    policy = dict(qlora.memory.levers)["checkpoint_layers"]
    assert policy is None or policy == "all" or policy.startswith("every-")  # the selective policies are not for QLoRA
    from hf_gpu_train.plan.memory import TrainingShape, largest_micro_batch

    every_layer = TrainingShape(seq_len=2048, precision="bf16", gradient_checkpointing=True, chunked_loss=True)
    memory = lora.memory.gpu_memory_bytes
    assert largest_micro_batch(llama3, replace(every_layer, method="qlora"), "single", memory) > largest_micro_batch(
        llama3, replace(every_layer, method="lora"), "single", memory)  # with the same levers, the 4-bit base fits more
    with pytest.raises(PlanError, match="adapters train on one GPU, with DDP or under DeepSpeed ZeRO"):
        make_plan(machine("2x-rtx4090"), PlanOptions(**options, method="lora", strategy="fsdp"))


def test_the_run_is_checked_with_its_own_method(machine, llama3, tmp_path):
    plan = make_plan(machine("1x-h200"), PlanOptions(model=llama3, seq_len=2048, method="lora"))
    path = tmp_path / "box.plan.json"
    import json

    path.write_text(json.dumps(plan_document(plan, "hf-gpu-train config ...", "box.yaml")))
    (tmp_path / "box.env").write_text("")
    run_plan = read_run_plan(path, "test", {})
    assert run_plan.memory.method == "lora"
    values = {"per_device_train_batch_size": 4, "gradient_checkpointing": True, "precision": "bf16"}
    as_lora = check_memory(run_plan, values, seq_len=2048, method="lora", lora_rank=16)
    as_full = check_memory(run_plan, values, seq_len=2048)
    assert as_lora.fits and as_lora.warning is None
    assert not as_full.fits and "optimizer states" in as_full.warning  # what the run was wrongly warned about before


def test_a_deepspeed_config_leaves_accumulation_to_the_run(machine, tmp_path):
    """A fixed gradient_accumulation_steps in deepspeed_config is refused by transformers ("mismatches") in any run
    that derives another accumulation: left out, accelerate passes "auto" and the run's value is used."""
    from accelerate.commands.config.config_args import load_config_from_file

    from hf_gpu_train.launch.render import render_yaml

    plan = make_plan(machine("8x-h100-sxm"), PlanOptions(strategy="deepspeed-zero2"))
    ds = plan.accelerate["deepspeed_config"]
    assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds and ds["zero_stage"] == 2
    path = tmp_path / "ds.yaml"
    path.write_text(render_yaml(plan, "hf-gpu-train config --strategy deepspeed-zero2"))
    assert load_config_from_file(str(path)).deepspeed_config["zero_stage"] == 2  # accelerate's own loader takes it
