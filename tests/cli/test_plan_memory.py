"""`hf-gpu-train plan-memory`: the planner table and plan, against the memory one process really has; --method
auto|full|lora|qlora on a Llama-3-8B config directory (no weights), as a user's local model directory."""

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load_machine
from tests.plan.test_peft_memory import LLAMA3_8B


def test_plan_memory_on_a_mig_box_plans_against_the_instance(capsys):
    box = load_machine("1x-a100-mig")
    largest = max(box.gpus[0].mig_instances, key=lambda m: m.memory_free_bytes)
    assert main(["plan-memory", "--machine", "1x-a100-mig", "--params", "1e9"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first == (f"1e+09 parameters: 1000.0M parameters; 1 MIG instance ({largest.uuid}) x "
                     f"{largest.memory_free_bytes / 2**30:.1f} GiB; bf16, adamw, seq 512, image 224")
    assert f"of {largest.memory_free_bytes / 2**30:.1f} GiB (8% kept as headroom)" in out


def test_plan_memory_on_whole_gpus_uses_the_free_memory_of_the_selection(capsys):
    assert main(["plan-memory", "--machine", "2x-a100-one-busy", "--params", "1e9", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    box = load_machine("2x-a100-one-busy")
    free = max(g.memory_free_bytes for g in box.gpus)  # the idle GPU, not the busy one
    assert f"1 GPU(s) x {free / 2**30:.1f} GiB" in out.splitlines()[0]


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama3-8b")
    config = {k: v for k, v in LLAMA3_8B.items() if k != "model_type"}
    LlamaConfig(architectures=["LlamaForCausalLM"], **config).save_pretrained(path)
    return str(path)


def row(out: str, name: str) -> list[str]:
    """The cells of a table row, split on the two-space column gaps."""
    line = next(line for line in out.splitlines() if line.startswith(name + "  "))
    return [cell.strip() for cell in line[len(name):].split("  ") if cell.strip()]


def test_auto_compares_every_method_and_recommends_lora_on_24gb_cards(llama3_dir, capsys):
    assert main(["plan-memory", "--machine", "2x-rtx4090", "--model", llama3_dir, "--seq-len", "2048", "--method", "auto"]) == 0
    out = capsys.readouterr().out
    assert row(out, "GiB per GPU") == ["full, DDP x2", "LoRA r16, DDP x2", "QLoRA r16, DDP x2", "full, FSDP x2"]
    # the totals of tests/launch: full 16 bytes/param + DDP buckets; LoRA 20.07 + 0.16 adapter buckets; QLoRA at micro-batch 2
    assert row(out, "total") == ["154.58", "20.23", "18.87", "67.27"]
    assert row(out, "frozen base weights") == ["14.96"]  # 2 bytes x 8,030,261,248
    assert row(out, "4-bit base weights (NF4)") == ["3.35"]  # 6,979,321,856 x 4.127 bits
    assert row(out, "at micro-batch") == ["1 (ckpt): does not fit", "1 (ckpt)", "2 (ckpt)", "1 (ckpt): does not fit"]
    assert "\nRecommended: LoRA r16, DDP x2: LoRA keeps the base in the compute dtype" in out
    assert "Plan: ddp, micro-batch 1 x accumulation 16 x 2 GPU(s) = 32 (target 32), gradient checkpointing on" in out


def test_qlora_alone_on_a_t4(llama3_dir, capsys):
    args = ["plan-memory", "--machine", "1x-t4", "--model", llama3_dir, "--seq-len", "1024", "--precision", "fp16", "--method", "qlora"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("fp16, adamw, seq 1024, image 224, LoRA r16")
    assert row(out, "single") == ["9.56", "11.182", "0", "1"]  # fixed GiB, activations per sample, largest without / with checkpointing
    assert "  4-bit base weights (NF4)       3.35 GiB" in out and "  unquantized weights (fp32)     3.92 GiB" in out
    assert main(args[:-1] + ["lora"]) == 1  # a 15 GiB bf16 base on a 15 GiB card
    assert "or --method auto to compare LoRA and QLoRA" in capsys.readouterr().out


def test_adapters_need_the_model_layers(capsys):
    assert main(["plan-memory", "--gpu-memory-gib", "24", "--params", "8e9", "--method", "lora"]) == 2
    assert "--method lora needs the model's linear layers: give --model" in capsys.readouterr().err
    assert main(["plan-memory", "--gpu-memory-gib", "24", "--params", "1e8", "--method", "auto", "--lora-rank", "0"]) == 2
    assert "--lora-rank 0: must be at least 1" in capsys.readouterr().err


def test_plan_memory_prints_the_levers_and_exits_0_when_they_make_it_fit(llama3_dir, capsys):
    """Full fine-tuning of Llama-3-8B at 8k tokens, 4 samples a step: on 141 GiB the plan (checkpointing its only
    lever) does not fit, the chunked head with checkpointing does, at micro-batch 1 (one 8k-token sample fills the
    GPU's matmuls). On 130 GiB no exact set fits at all: the optimizer in the backward (30 GiB of gradients freed),
    the one lever that changes the updates, makes the whole step one micro-batch."""
    assert main(["plan-memory", "--model", llama3_dir, "--gpu-memory-gib", "141", "--seq-len", "8192", "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "Does not fit even at micro-batch 1 with checkpointing" in out
    assert "Memory levers (full, 1 GPU" in out and "+ activation offloading" in out
    assert "+ optimizer step in the backward" in out
    assert "chunked_lm_loss=true gradient_checkpointing=true checkpoint_layers=all\n" in out  # exact: no clipping lost
    assert main(["plan-memory", "--model", llama3_dir, "--gpu-memory-gib", "130", "--seq-len", "8192", "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    recommended = next(line for line in out.splitlines() if line.startswith("Recommended levers:"))
    import re

    assert "gradient clipping off" in recommended
    assert int(re.search(r"micro-batch (\d+) fits", recommended).group(1)) >= 4  # the whole step, no accumulation
    assert "optimizer_in_backward=true" in out
    # the weights and Adam's states alone are 96 GiB: no lever fits 80, ZeRO-3 with the states in CPU memory does
    assert main(["plan-memory", "--model", llama3_dir, "--gpu-memory-gib", "80", "--seq-len", "8192", "--global-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "Recommended levers: nothing fits" in out and "Last resort: deepspeed-zero3-offload" in out
    assert "--strategy deepspeed-zero3" in out and "host memory" in out
    assert main(["plan-memory", "--model", llama3_dir, "--gpu-memory-gib", "8", "--seq-len", "8192", "--global-batch", "4"]) == 1
    assert "Last resort, DeepSpeed ZeRO-3 with CPU offload: does not fit either" in capsys.readouterr().out


def test_plan_memory_levers_recommend_a_config_line_for_lora(llama3_dir, capsys):
    assert main(["plan-memory", "--model", llama3_dir, "--gpu-memory-gib", "40", "--seq-len", "8192", "--method", "lora",
                 "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("Recommended levers:"))
    assert "micro-batch" in line
    assert "+ optimizer step in the backward" not in out  # full fine-tuning only
    assert "-m hf_gpu_train.finetune ... " in out and "chunked_lm_loss=true" in out


def test_plan_memory_and_config_recommend_the_same_levers_on_a_box_short_of_ram(llama3_dir, tmp_path, capsys):
    """Llama-3-8B full fine-tuning at 16k tokens on one H200: only offloading the activations (7.5 GiB of host memory)
    makes it fit. `config` checks that against the machine's RAM; plan-memory must too, or it recommends a set the
    other refuses. With the box's 256 GiB both take offloading; with 8 GiB both find nothing that fits."""
    from dataclasses import replace

    from hf_gpu_train.hardware.snapshot import save
    from hf_gpu_train.plan.decisions import PlanError
    from hf_gpu_train.plan.model_spec import from_config
    from hf_gpu_train.plan.planner import PlanOptions, make_plan

    args = ["--model", llama3_dir, "--seq-len", "16384", "--global-batch", "16"]
    assert main(["plan-memory", "--machine", "1x-h200", *args]) == 0
    assert "offload_activations=true" in capsys.readouterr().out
    box = load_machine("1x-h200")
    small = save(replace(box, host=replace(box.host, ram_total_bytes=8 * 2**30)), tmp_path / "small.json")
    main(["plan-memory", "--machine", str(small), *args])
    out = capsys.readouterr().out
    assert "offload_activations=true" not in out and "Recommended levers: nothing fits" in out
    with pytest.raises(PlanError):
        make_plan(load_machine(str(small)), PlanOptions(model=from_config(dict(LLAMA3_8B), name="llama-3-8b"), seq_len=16384,
                                                       global_batch=16))


def test_the_evaluation_of_a_language_model_is_counted_with_what_the_fine_tune_keeps(llama3_dir, capsys):
    """issue 36, evaluation's own memory: 2,000 rows of 2,048 tokens of Llama 3's 128,256-token vocabulary, bf16: a
    Trainer keeping the logits for its compute_metrics holds 2000 x 2048 x 128256 x 2 B, twice at the join: 1.9 TiB."""
    assert main(["plan-memory", "--machine", "1x-h200", "--model", llama3_dir, "--seq-len", "2048",
                 "--eval-rows", "2000"]) == 0
    out = capsys.readouterr().out
    assert "Evaluation of 2000 rows at seq 2048, vocabulary 128256 (bf16 logits):" in out
    expected = 2000 * 2048 * 128256 * 2 * 2 / 2**40
    assert f"compute_metrics: {expected:.1f} TiB at the end of each evaluation" in out
    assert "the fine-tune (-m hf_gpu_train.finetune) keeps the loss only (perplexity from it): 7.8 KiB" in out
    assert main(["plan-memory", "--machine", "1x-h200", "--params", "1e8", "--eval-rows", "0"]) == 2
