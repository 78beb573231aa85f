"""NAME.plan.json: every decided value with its reason, written by `config`, read back by a training process."""

import json

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.plan.document import NO_GPU_MEMORY_PLAN, NO_MEMORY_PLAN, plan_document, render_plan_json
from hf_gpu_train.plan.memory import usable_bytes
from hf_gpu_train.plan.model_spec import ModelSpec
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.run_plan_file import RunPlanError, read_run_plan

BERT = ModelSpec(name="bert-base", params=109_482_240, num_layers=12, hidden_size=768, num_heads=12, vocab_size=30522,
                 largest_layer_params=7_087_872, layer_class="BertLayer")
LLAMA_3B = ModelSpec(name="llama-3b", params=3_212_749_824, num_layers=28, hidden_size=3072, num_heads=24,
                     vocab_size=128256, causal_lm=True, largest_layer_params=100_675_584, layer_class="LlamaDecoderLayer")


def write(tmp_path, plan, name="box"):
    path = tmp_path / f"{name}.plan.json"
    path.write_text(render_plan_json(plan, "hf-gpu-train config --output box", tmp_path / f"{name}.yaml"))
    return path


def test_a_memory_plan_travels_with_every_value_and_its_reason(tmp_path, machine):
    plan = make_plan(machine("4x-rtx3090-nvlink-pairs"), PlanOptions(model=BERT, seq_len=256, global_batch=96))
    run = read_run_plan(write(tmp_path, plan), "test")
    m = plan.memory
    assert {k: v.value for k, v in run.values.items()} == {
        "precision": "bf16", "per_device_train_batch_size": m.micro_batch, "gradient_accumulation_steps": m.gradient_accumulation,
        "global_batch_size": m.micro_batch * m.gradient_accumulation * 4, "gradient_checkpointing": m.gradient_checkpointing,
        "dataloader_num_workers": 7, "chunked_lm_loss": None, "checkpoint_layers": None, "offload_activations": None,
        "optimizer_in_backward": None}  # the levers: no chunked head for a classifier, none needed at micro-batch 24
    assert (m.micro_batch, m.gradient_accumulation, run.value("global_batch_size")) == (24, 1, 96)
    assert all(v.reason for v in run.values.values())
    assert run.values["global_batch_size"].reason == ("micro-batch x accumulation x 4 process(es), serving the requested "
                                                      "global batch 96")
    assert (run.strategy.value, run.num_processes, run.processes_per_machine, run.gpu_ids) == ("ddp", 4, 4, "0,1,2,3")
    assert run.memory.model == BERT and (run.memory.seq_len, run.memory.optimizer, run.memory.world_size) == (256, "adamw", 4)
    assert run.memory.estimate_bytes == int(m.breakdown.total) and run.memory.device_memory_bytes == m.gpu_memory_bytes
    assert run.memory.usable_bytes == int(usable_bytes(m.gpu_memory_bytes)) and run.memory.per == "GPU"
    assert dict(run.memory.breakdown_bytes)["activations"] == int(m.breakdown.activations)
    assert [(k, v) for k, v, _ in run.environment] == [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("NCCL_P2P_LEVEL", "NVL"),
                                                       ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
                                                       ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("OMP_NUM_THREADS", "8")]
    assert run.machine == "4x-rtx3090-nvlink-pairs" and run.command == "hf-gpu-train config --output box"
    assert run.config_file == tmp_path / "box.yaml" and run.memory_note is None


def test_without_a_model_the_batch_values_are_absent_with_the_reason(tmp_path, machine):
    run = read_run_plan(write(tmp_path, make_plan(machine("1x-h200"))), "test")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "global_batch_size", "gradient_checkpointing"):
        assert run.values[key].value is None and run.values[key].reason == NO_MEMORY_PLAN
    assert run.value("precision") == "bf16" and run.memory is None and run.memory_note == NO_MEMORY_PLAN


def test_cpu_plan_says_fp32_and_records_no_binding(tmp_path, machine):
    doc = plan_document(make_plan(machine("cpu-only")), "c", tmp_path / "cpu.yaml")
    assert doc["values"]["precision"]["value"] == "fp32" and doc["cpu_binding"] is None and doc["mig_instance"] is None
    assert doc["processes"] == {"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1, "per_machine": 2,
                                "machine_rank": 0, "gpu_ids": None}
    assert doc["files"] == {"accelerate_config": "cpu.yaml", "environment": "cpu.env"}


def test_mig_instance_and_cpu_binding_are_exported(tmp_path, machine):
    box = machine("1x-a100-mig")
    plan = make_plan(box, PlanOptions(model=BERT))
    doc = plan_document(plan, "c", tmp_path / "mig.yaml")
    assert doc["mig_instance"]["uuid"] == plan.mig_instance.uuid and doc["processes"]["gpu_ids"] == plan.mig_instance.uuid
    assert doc["memory"]["per"] == "MIG instance" and doc["memory"]["device_memory_bytes"] == plan.mig_instance.memory_free_bytes
    from dataclasses import replace

    dgx1 = machine("8x-v100-dgx1")
    busy = replace(dgx1, gpus=(replace(dgx1.gpus[0], memory_used_bytes=20 * 2**30), *dgx1.gpus[1:]))
    run = read_run_plan(write(tmp_path, make_plan(busy, PlanOptions(gpus="4")), "dgx"), "test")
    assert run.cpu_binding.method == "taskset" and run.cpu_binding.cpus_by_process == ("20-39,60-79",) * 4
    assert run.cpu_binding.command_prefix == "taskset -c 20-39,60-79"


def test_fsdp_plan_records_the_planner_strategy(tmp_path, machine):
    plan = make_plan(machine("8x-a100-sxm-80gb"), PlanOptions(model=LLAMA_3B, seq_len=2048, strategy="fsdp"))
    run = read_run_plan(write(tmp_path, plan), "test")
    assert run.memory.strategy == plan.memory.strategy == plan.strategy and run.memory.strategy.startswith("fsdp")


def test_unreadable_newer_or_foreign_plans_name_the_file_and_the_fix(tmp_path, machine):
    path = write(tmp_path, make_plan(machine("1x-t4")))
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "version": 99}))
    with pytest.raises(RunPlanError, match=r"box\.plan\.json: plan version 99, and this hf-gpu-train \(0\.1\.0\) reads version 1: "
                       r"upgrade hf-gpu-train where the run starts, or regenerate the plan there with `hf-gpu-train config --output box`"):
        read_run_plan(path, "test")
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(RunPlanError, match=r"not a plan written by hf-gpu-train \(format 'something else'\)"):
        read_run_plan(path, "test")
    path.write_text("{broken")
    with pytest.raises(RunPlanError, match="not readable as JSON"):
        read_run_plan(path, "test")
    with pytest.raises(RunPlanError, match=r"nowhere\.plan\.json does not exist \(HF_GPU_TRAIN_PLAN=x\): write it with "
                       r"`hf-gpu-train config --output .*nowhere`, or unset HF_GPU_TRAIN_PLAN"):
        read_run_plan(tmp_path / "nowhere.plan.json", "HF_GPU_TRAIN_PLAN=x")


def test_the_environment_is_the_edited_env_file_with_the_plans_reasons(tmp_path, machine):
    assert main(["config", "--machine", "2x-rtx4090", "--output", str(tmp_path / "box")]) == 0
    with open(tmp_path / "box.env", "a") as f:
        f.write("NCCL_DEBUG=INFO\n")
    env = {k: (v, r) for k, v, r in read_run_plan(tmp_path / "box.plan.json", "test").environment}
    assert env["NCCL_DEBUG"] == ("INFO", "set in box.env")
    assert env["NCCL_P2P_DISABLE"][0] == "1" and env["NCCL_P2P_DISABLE"][1].startswith("NVML reports P2P not supported")
    (tmp_path / "box.env").unlink()  # gone: the plan's own copy
    assert "NCCL_DEBUG" not in {k for k, _, _ in read_run_plan(tmp_path / "box.plan.json", "test").environment}


def test_config_writes_the_plan_and_refuses_to_overwrite_it(tmp_path, capsys):
    out = tmp_path / "box"
    assert main(["config", "--machine", "1x-t4", "--params", "1.1e8", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"Wrote {out}.yaml, {out}.env, {out}.plan.json" in printed
    doc = json.loads((tmp_path / "box.plan.json").read_text())
    assert doc["format"] == "hf_gpu_train.run_plan" and doc["version"] == 1 and doc["memory"]["planned_for"]["model"]["params"] == 110_000_000
    assert doc["command"] == f"hf-gpu-train config --output {out}"  # under pytest; the real argv from the shell
    (tmp_path / "box.yaml").unlink()
    (tmp_path / "box.env").unlink()
    assert main(["config", "--machine", "1x-t4", "--output", str(out)]) == 2
    assert f"{out}.plan.json already exist(s): pass --force" in capsys.readouterr().err
    assert main(["config", "--machine", "1x-t4", "--output", str(tmp_path / "nomodel")]) == 0
    assert f"No memory plan: {NO_MEMORY_PLAN}." in capsys.readouterr().out


def test_a_cpu_plan_with_a_model_says_why_no_batch_was_planned(machine):
    from hf_gpu_train.plan.model_spec import ModelSpec
    from hf_gpu_train.plan.planner import PlanOptions, make_plan

    plan = make_plan(machine("cpu-only"), PlanOptions(cpu_processes=2, model=ModelSpec(name="m", params=10**6)))
    document = plan_document(plan, "hf-gpu-train config ...", "cpu.yaml")
    assert document["memory_note"] == NO_GPU_MEMORY_PLAN and "no GPU" in NO_GPU_MEMORY_PLAN
    assert document["values"]["per_device_train_batch_size"] == {"value": None, "reason": NO_GPU_MEMORY_PLAN}
