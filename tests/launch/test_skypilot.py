"""The SkyPilot task (launch/skypilot.py) against SkyPilot's own schemas, vendored with their version in
tests/launch/schemas/skypilot_task.json (extract_skypilot_schema.py there says how, and why not a dependency), and its
run section executed by bash as SkyPilot would on each node."""

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import yaml

from hf_gpu_train.errors import UsageError
from hf_gpu_train.launch.skypilot import render_skypilot, skypilot_accelerator
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from tests.launching import executable

SCHEMAS = json.loads((Path(__file__).with_name("schemas") / "skypilot_task.json").read_text())


# sky/utils/validator.py: Draft 7 and SkyPilot's two enum keywords, the validator sky.Task.from_yaml_config uses
def _case_insensitive_enum(validator, enums, instance, schema):
    if instance.lower() not in [e.lower() for e in enums]:
        yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")


def _case_sensitive_enum(validator, enums, instance, schema):
    if instance not in enums:
        yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")


SkyValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, validators={
    "case_insensitive_enum": _case_insensitive_enum, "case_sensitive_enum": _case_sensitive_enum})


def sky_errors(task: dict) -> list[str]:
    """What sky.Task.from_yaml_config would refuse: the task schema (None values dropped first, as SkyPilot's
    validate_schema does), then the resources section against the resources schema."""
    found = [f"task {'/'.join(map(str, e.absolute_path))}: {e.message}"
             for e in SkyValidator(SCHEMAS["task"]).iter_errors({k: v for k, v in task.items() if v is not None})]
    resources = task.get("resources") or {}
    found += [f"resources {'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in SkyValidator(SCHEMAS["resources"]).iter_errors({k: v for k, v in resources.items() if v is not None})]
    return found


def render(plan, **kw):
    return yaml.safe_load(render_skypilot(plan, "launch_configs/x.yaml", job_name="job", **kw))


def test_the_schemas_are_skypilots_and_say_their_version():
    assert SCHEMAS["skypilot_version"] and SCHEMAS["task"]["additionalProperties"] is False
    SkyValidator.check_schema(SCHEMAS["task"])
    SkyValidator.check_schema(SCHEMAS["resources"])


@pytest.mark.parametrize(("name", "nodes", "accelerators"), [
    ("8x-h100-sxm", 1, "H100:8"), ("8x-h100-sxm", 4, "H100:8"), ("8x-a100-sxm-80gb", 2, "A100-80GB:8"),
    ("8x-v100-dgx1", 1, "V100-32GB:8"), ("1x-t4", 1, "T4:1"), ("1x-h200", 1, "H200:1"), ("2x-rtx4090", 1, "RTX4090:2"),
    ("4x-a100-pcie-nvlink-pairs", 1, "A100-80GB:4"), ("cpu-only", 1, None), ("cpu-only", 2, None),
])
def test_the_task_is_valid_against_skypilots_schema(machine, name, nodes, accelerators):
    options = PlanOptions(num_machines=nodes, main_process_ip="set-at-run") if nodes > 1 else PlanOptions()
    plan = make_plan(machine(name), options)
    task = render(plan)
    assert sky_errors(task) == []
    assert task["num_nodes"] == nodes and task["workdir"] == "."
    assert task["resources"].get("accelerators") == accelerators
    if accelerators is None:
        assert task["resources"] == {"cpus": f"{plan.processes_per_machine * int(plan.env_dict['OMP_NUM_THREADS'])}+"}
    assert task["envs"] == plan.env_dict
    assert "hf-gpu-train launch --config-file launch_configs/x.yaml" in task["run"]
    assert task["setup"].strip() == "pip install -e ."


def test_the_validator_rejects_a_broken_task(machine):
    task = render(make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="x")))
    assert sky_errors(task) == []
    assert any("num_nodes" in e and "'2' is not of type 'integer'" in e for e in sky_errors({**task, "num_nodes": "2"}))
    assert any("nodes" in e for e in sky_errors({**task, "nodes": 2}))  # additionalProperties: false
    assert any("gpus" in e for e in sky_errors({**task, "resources": {"gpus": "H100:8"}}))
    assert sky_errors({**task, "envs": {"1BAD": "x"}})
    assert sky_errors({**task, "run": ["a", "b"]})


def test_an_image_runs_the_task_in_that_container(machine):
    task = render(make_plan(machine("1x-t4")), image="ghcr.io/me/train:1")
    assert task["resources"]["image_id"] == "docker:ghcr.io/me/train:1" and sky_errors(task) == []


@pytest.mark.parametrize(("nvml", "gib", "sky"), [
    ("NVIDIA H100 80GB HBM3", 80, "H100"), ("NVIDIA H200", 141, "H200"), ("NVIDIA GH200 480GB", 96, "GH200"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100"), ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"), ("NVIDIA A100 80GB PCIe", 80, "A100-80GB"),
    ("Tesla V100-SXM2-16GB", 16, "V100"), ("Tesla V100-SXM2-32GB", 32, "V100-32GB"), ("NVIDIA A10G", 24, "A10G"),
    ("NVIDIA A10", 24, "A10"), ("NVIDIA L4", 24, "L4"), ("NVIDIA L40S", 48, "L40S"), ("NVIDIA L40", 48, "L40"),
    ("Tesla T4", 15, "T4"), ("NVIDIA GeForce RTX 3090", 24, "RTX3090"), ("NVIDIA RTX A6000", 48, "A6000"),
    ("NVIDIA B200", 180, "B200"),
])
def test_nvml_names_map_to_skypilots_names(nvml, gib, sky):
    assert skypilot_accelerator(nvml, gib * 2**30) == (sky, True)


def test_an_unknown_gpu_keeps_its_name_without_the_vendor_and_says_so():
    assert skypilot_accelerator("NVIDIA RTX 6000 Ada Generation", 48 * 2**30) == ("RTX6000AdaGeneration", False)


def test_a_plan_of_two_gpu_models_is_refused(machine):
    box = machine("mixed-a100-rtx3090")
    plan = make_plan(box)
    mixed = replace(plan, gpus=tuple(box.gpus))
    with pytest.raises(UsageError, match="one GPU model a node.*--gpu-ids"):
        render_skypilot(mixed, "x.yaml", job_name="job")


@pytest.fixture
def fake_launcher(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "hf-gpu-train", '#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    return bin_dir


@pytest.mark.parametrize(("name", "gpus_per_node", "processes"), [("8x-h100-sxm", "8", "24"), ("cpu-only", "0", "6")])
def test_the_run_takes_rank_main_node_and_processes_from_skypilot(machine, fake_launcher, name, gpus_per_node, processes):
    plan = make_plan(machine(name), PlanOptions(num_machines=3, main_process_ip="set-at-run", main_process_port=29600))
    task = render(plan)
    env = {"PATH": f"{fake_launcher}:{os.environ['PATH']}", "SKYPILOT_NODE_RANK": "2", "SKYPILOT_NUM_NODES": "3",
           "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8\n10.0.0.9", "SKYPILOT_NUM_GPUS_PER_NODE": gpus_per_node}
    out = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.splitlines() == ["launch", "--config-file", "launch_configs/x.yaml", "--num_machines", "3",
                                       "--num_processes", processes, "--machine_rank", "2", "--main_process_ip", "10.0.0.7",
                                       "--main_process_port", "29600", "-m", "hf_gpu_train.finetune"]


def test_one_node_runs_the_config_as_it_is(machine, fake_launcher):
    task = render(make_plan(machine("1x-t4")))
    out = subprocess.run(["bash", "-c", task["run"]], env={"PATH": f"{fake_launcher}:{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.splitlines() == ["launch", "--config-file", "launch_configs/x.yaml", "-m", "hf_gpu_train.finetune"]


@pytest.mark.parametrize("nodes", [1, 3])
def test_the_runs_arguments_are_the_last_words_of_run(machine, fake_launcher, nodes):
    """Issue 38, item 5: the run section trained the default run whatever the user wanted; the run's arguments (what
    `config ... -- ARGS` was given) end it, each one word however it is spelled, and the header says where they are."""
    options = PlanOptions(num_machines=nodes, main_process_ip="set-at-run") if nodes > 1 else PlanOptions()
    run_args = ["--config", "minilm_text_demo", "learning_rate=3e-5", "run_name=it's mine"]
    text = render_skypilot(make_plan(machine("1x-t4"), options), "launch_configs/x.yaml", job_name="job", run_args=run_args)
    task = yaml.safe_load(text)
    assert sky_errors(task) == []
    env = {"PATH": f"{fake_launcher}:{os.environ['PATH']}", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": str(nodes),
           "SKYPILOT_NODE_IPS": "10.0.0.7", "SKYPILOT_NUM_GPUS_PER_NODE": "1"}
    out = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.splitlines()[-6:] == ["-m", "hf_gpu_train.finetune", *run_args]
    assert "# The run's arguments: --config minilm_text_demo learning_rate=3e-5 'run_name=it'\"'\"'s mine'" in text


def test_without_arguments_the_header_says_the_run_is_the_default_one_and_where_they_go(machine):
    text = render_skypilot(make_plan(machine("1x-t4")), "launch_configs/x.yaml", job_name="job")
    assert "none given, so it trains the default run: add --config NAME key=value at the end of run" in text


def test_setup_installs_the_package_a_pip_user_has_and_a_clone_installs_itself(tmp_path):
    from hf_gpu_train import __version__
    from hf_gpu_train.launch.skypilot import setup_for

    assert setup_for(Path(__file__).resolve().parents[2]) == "pip install -e ."  # this clone
    assert setup_for(tmp_path) == f"pip install 'hf-gpu-train=={__version__}'"  # a pip user's directory: no pyproject.toml
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "my-project"\n')
    assert setup_for(tmp_path) == f"pip install 'hf-gpu-train=={__version__}'"  # a project of theirs, not this package
