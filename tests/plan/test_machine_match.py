"""Issue 17, item 3: a plan records the machine it was made for, and a run (or `hf-gpu-train launch`) on other
hardware applies none of its machine-derived values, saying what differs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.cli.launch import build_launch
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.plan.run_plan_file import read_run_plan
from hf_gpu_train.plan.scope import differences, hardware_record, scope_to_this_machine


@pytest.fixture(scope="module")
def dgx1_plan(tmp_path_factory):
    """8x V100 (NVLink cube, CPU binding per socket), planned for a 1.1e8-parameter model."""
    out = tmp_path_factory.mktemp("dgx1")
    assert main(["config", "--machine", "8x-v100-dgx1", "--params", "1.1e8", "--output", str(out / "d")]) == 0
    return out / "d.plan.json"


def test_the_plan_records_the_whole_machine_it_was_made_for(dgx1_plan):
    doc = json.loads(dgx1_plan.read_text())
    dgx1 = load_machine("8x-v100-dgx1")
    assert doc["hardware"] == hardware_record(dgx1)
    assert len(doc["hardware"]["gpus"]) == 8 and doc["hardware"]["cpu_cores"] == dgx1.host.logical_cores
    assert doc["memory"]["planned_for"]["fingerprint"]["params"] == 110_000_000


def test_the_same_hardware_matches_and_any_difference_is_named():
    dgx1 = load_machine("8x-v100-dgx1")
    recorded = hardware_record(dgx1)
    assert differences(recorded, dgx1) == []
    # the same model reported a little apart (another driver, ECC) is the same machine
    nudged = replace(dgx1, gpus=tuple(replace(g, memory_total_bytes=int(g.memory_total_bytes * 0.99)) for g in dgx1.gpus))
    assert differences(recorded, nudged) == []
    fewer = replace(dgx1, gpus=dgx1.gpus[:4])
    assert differences(recorded, fewer) == ["GPUs 8x Tesla V100-SXM2-32GB (32 GiB) -> 4x Tesla V100-SXM2-32GB (32 GiB)"]
    assert differences(recorded, load_machine("cpu-only")) == [
        "GPUs 8x Tesla V100-SXM2-32GB (32 GiB) -> no GPU", f"CPU cores {dgx1.host.logical_cores} -> 2"]
    other_cores = replace(dgx1, host=replace(dgx1.host, logical_cores=16))
    assert differences(recorded, other_cores) == [f"CPU cores {dgx1.host.logical_cores} -> 16"]


def test_on_other_hardware_every_machine_value_is_dropped_and_the_users_own_variables_stay(dgx1_plan):
    env_file = dgx1_plan.with_name("d.env")
    original = env_file.read_text()
    try:
        env_file.write_text(original + "WANDB_PROJECT=mine\n")
        plan = read_run_plan(dgx1_plan, "test")
        assert plan.value("per_device_train_batch_size") and plan.cpu_binding is not None
        same, lines = scope_to_this_machine(plan, load_machine("8x-v100-dgx1"))
        assert same is plan and lines == []
        scoped, (line,) = scope_to_this_machine(plan, load_machine("2x-rtx4090"))
    finally:
        env_file.write_text(original)
    assert all(scoped.value(k) is None for k in ("precision", "dataloader_num_workers", "per_device_train_batch_size",
                                                 "global_batch_size", "gradient_checkpointing"))
    names = {name for name, _, _ in scoped.environment}
    assert "OMP_NUM_THREADS" not in names and "WANDB_PROJECT" in names  # the planner's threads out, the user's line in
    assert scoped.cpu_binding is None and scoped.gpu_ids is None
    assert scoped.memory is not None and scoped.memory.device_memory_bytes < 25 * 2**30  # checked against a 4090
    assert line.startswith("plan made for another machine (8x-v100-dgx1: GPUs 8x Tesla V100-SXM2-32GB (32 GiB) -> 2x "
                           "NVIDIA GeForce RTX 4090") and "CPU binding" in line and "OMP_NUM_THREADS=" in line


def test_a_plan_from_before_the_record_is_applied_as_before_and_says_so(dgx1_plan, tmp_path):
    doc = json.loads(dgx1_plan.read_text())
    del doc["hardware"]
    old = tmp_path / "old.plan.json"
    old.write_text(json.dumps(doc))
    (tmp_path / "old.env").write_text(dgx1_plan.with_name("d.env").read_text())
    plan = read_run_plan(old, "test")
    scoped, (line,) = scope_to_this_machine(plan, load_machine("cpu-only"))
    assert scoped is plan and "records no machine" in line and "regenerate it with `hf-gpu-train config" in line


def test_launch_on_other_hardware_passes_neither_the_threads_nor_the_binding(dgx1_plan, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    config = str(dgx1_plan.with_name("d.yaml"))
    planned = build_launch(["--config-file", config, str(script)], environ={}, here=load_machine("8x-v100-dgx1"))
    assert "OMP_NUM_THREADS" in planned.env and not any("another machine" in n for n in planned.notes)
    elsewhere = build_launch(["--config-file", config, str(script)], environ={}, here=load_machine("cpu-only"))
    assert "OMP_NUM_THREADS" not in elsewhere.env and elsewhere.cpus is None
    assert any(n.startswith("plan made for another machine (8x-v100-dgx1") for n in elsewhere.notes)


def test_check_config_warns_about_another_machine_and_a_plan_without_fingerprint(dgx1_plan, tmp_path, capsys):
    config = dgx1_plan.with_name("d.yaml")
    assert main(["check-config", str(config), "--machine", "8x-v100-dgx1"]) == 0
    assert "another machine" not in capsys.readouterr().out
    main(["check-config", str(config), "--machine", "2x-rtx4090"])
    assert "d.plan.json was made for another machine (8x-v100-dgx1" in capsys.readouterr().out
    doc = json.loads(dgx1_plan.read_text())
    del doc["memory"]["planned_for"]["fingerprint"]
    for suffix in (".yaml", ".env"):
        (tmp_path / f"old{suffix}").write_text(dgx1_plan.with_name(f"d{suffix}").read_text())
    (tmp_path / "old.plan.json").write_text(json.dumps(doc))
    assert main(["check-config", str(tmp_path / "old.yaml"), "--machine", "8x-v100-dgx1"]) == 0
    out = capsys.readouterr().out
    assert "old.plan.json records no fingerprint of the model" in out and "never its micro-batch" in out


def test_a_plan_for_some_gpus_holds_where_a_scheduler_shows_only_those(tmp_path):
    """Slurm's ConstrainDevices and docker --gpus show a job only its GPUs: a plan for 4 of the 8 GPUs still holds
    there, and on the whole machine; not on 4 GPUs of another model, nor on fewer than it uses."""
    assert main(["config", "--machine", "8x-v100-dgx1", "--gpus", "4", "--output", str(tmp_path / "four")]) == 0
    recorded = json.loads((tmp_path / "four.plan.json").read_text())["hardware"]
    assert len(recorded["used"]) == 4 and len(recorded["gpus"]) == 8
    dgx1 = load_machine("8x-v100-dgx1")
    assert differences(recorded, dgx1) == []
    assert differences(recorded, replace(dgx1, gpus=dgx1.gpus[4:])) == []
    assert differences(recorded, replace(dgx1, gpus=dgx1.gpus[:3])) != []
    assert differences(recorded, load_machine("2x-rtx4090")) != []
