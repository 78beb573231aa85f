"""The plan's fingerprint against the run's, compared once (plan/scope.py): a run that differs from what the plan was
made for in one dimension alone gets exactly that dimension's line and loses exactly that dimension's values; a plan
file in an older layout is read into the same fingerprint and scoped the same way."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.plan.run_plan_file import TUNED, Job, read_run_plan
from hf_gpu_train.plan.scope import MEMORY_KEYS, ModelId, Shape, hardware_record, plan_fingerprint, scope

RECIPE = {"path": "/recipes/mine.yaml", "sha256": "a" * 64}


@pytest.fixture(scope="module")
def t4_tuned(tmp_path_factory):
    """A 1x-t4 plan for a 1.1e8-parameter model, planned for LoRA at 512 tokens, whose torch_compile tune measured for
    one recipe (the plan's own, before tune: False)."""
    out = tmp_path_factory.mktemp("t4") / "t4"
    assert main(["config", "--machine", "1x-t4", "--params", "1.1e8", "--seq-len", "512", "--output", str(out)]) == 0
    path = out.with_suffix(".plan.json")
    doc = json.loads(path.read_text())
    doc["memory"]["planned_for"]["method"] = "lora"
    doc["values"]["torch_compile"] = {"value": True, "reason": "measured by hf-gpu-train tune"}
    doc[TUNED] = {"recipe": RECIPE, "overrides": ["max_length=512"], "keys": ["torch_compile"],
                  "replaced": {"torch_compile": {"value": False, "reason": "the plan's"}}}
    path.write_text(json.dumps(doc))
    return path


def older(path, tmp_path):
    """The same plan as an older hf-gpu-train wrote it: no method or LoRA rank planned for, no GPUs-used list, no
    levers, no settings."""
    doc = json.loads(path.read_text())
    for key in ("method", "lora_rank"):
        del doc["memory"]["planned_for"][key]
    del doc["hardware"]["used"], doc["memory"]["levers"], doc["settings"]
    doc["memory"]["planned_for"]["method"] = "lora"  # what this test's plan was made for (an older one: full)
    old = tmp_path / "old.plan.json"
    old.write_text(json.dumps(doc))
    (tmp_path / "old.env").write_text(path.with_name("t4.env").read_text())
    return old


def this_run(plan, **differing):
    """A run that is exactly what ``plan`` was made for, but for ``differing``."""
    same = plan_fingerprint(plan)
    run = dataclasses.replace(same, machine=hardware_record(load_machine("1x-t4")),
                              recipe=Job(RECIPE, {"max_length": "512"}, None, "mine.yaml"))
    return dataclasses.replace(run, **differing)


def memory_values(plan, keep=()):
    return {k for k in MEMORY_KEYS if plan.value(k) is not None and k not in keep}


CASES = {  # dimension: (what the run differs in, the line group, the values lost, why)
    "machine": (lambda p: {"machine": hardware_record(load_machine("2x-rtx4090"))}, "machine",
                lambda p: {k for k, v in p.values.items() if v.value is not None and k != "gradient_accumulation_steps"},
                "made for another machine"),
    "model": (lambda p: {"model": ModelId("other", "other", dataclasses.replace(p.memory.model, name="other", params=7 * 10**9))},
              "run", lambda p: memory_values(p, keep={"torch_compile"}), "made for another model or shape"),
    "shape": (lambda p: {"shape": Shape(4 * p.memory.seq_len, None, p.memory.optimizer, None)}, "run",
              lambda p: memory_values(p, keep={"torch_compile"}), "made for another model or shape"),
    "method": (lambda p: {"method": "full"}, "run", lambda p: memory_values(p, keep={"torch_compile"}),
               "made for another model or shape"),
    "strategy": (lambda p: {"strategy": "fsdp"}, "run", memory_values, "made for another strategy"),
    "recipe": (lambda p: {"recipe": Job({"path": "/recipes/other.yaml", "sha256": "b" * 64}, {}, None, "other.yaml")},
               "recipe", lambda p: {"torch_compile"}, "tuned for another recipe"),
}


@pytest.mark.parametrize("layout", ["new", "older"])
@pytest.mark.parametrize("dimension", CASES)
def test_one_dimension_differs_one_line_and_its_values_go(t4_tuned, tmp_path, dimension, layout):
    plan = read_run_plan(t4_tuned if layout == "new" else older(t4_tuned, tmp_path), "test")
    assert plan.value("per_device_train_batch_size") and plan.value("torch_compile") is True
    same = scope(plan, this_run(plan), load_machine("1x-t4"))
    assert same.plan is plan and same.differences == () and not any(same.lines.values()) and same.not_applied == {}
    assert same.tuned == {"torch_compile"}
    differing, group, lost, why = CASES[dimension]
    scoped = scope(plan, this_run(plan, **differing(plan)), load_machine("1x-t4"))
    assert {d.dimension for d in scoped.differences} == {dimension}
    assert {g for g, lines in scoped.lines.items() if lines} == {group} and len(scoped.lines[group]) == 1, scoped.lines
    assert set(scoped.not_applied) == lost(plan), scoped.not_applied
    assert {w for _, w in scoped.not_applied.values()} == {why}
    assert all(scoped.plan.value(k) != plan.value(k) for k in scoped.not_applied)
    untouched = {k for k in plan.values if k not in scoped.not_applied and k != "gradient_accumulation_steps"}
    assert all(scoped.plan.value(k) == plan.value(k) for k in untouched)


def test_the_older_layout_reads_into_the_same_fingerprint(t4_tuned, tmp_path):
    new, old = (plan_fingerprint(read_run_plan(p, "test")) for p in (t4_tuned, older(t4_tuned, tmp_path)))
    assert dataclasses.replace(old, machine=None) == dataclasses.replace(new, machine=None) and old.missing == frozenset()
    assert old.machine["gpus"] == new.machine["gpus"] == new.machine["used"] and "used" not in old.machine
    assert (new.method, new.strategy, new.shape.seq_len, new.recipe.overrides) == ("lora", "single", 512, {"max_length": "512"})
