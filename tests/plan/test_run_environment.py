"""The plan's environment and CPU binding inside a training process: who wins, and what is too late."""

import os
import sys
import types
from dataclasses import replace

import pytest

from hf_gpu_train.plan.cpu_binding import CpuBinding
from hf_gpu_train.plan.run_environment import apply_run_environment, binding_target, read_too_late
from hf_gpu_train.plan.run_plan_file import LaunchedAs, Override, PlanValue, RunPlan, RunPlanError


def plan(environment, launcher_environ=None, binding=None, gpu_ids=None, launched=LaunchedAs()):
    return RunPlan(path=None, config_file=None, source="test", machine="m", command="c", strategy=PlanValue("ddp", ""), values={},
                   num_processes=2, num_machines=1, processes_per_machine=2, gpu_ids=gpu_ids,
                   environment=tuple((k, v, "why") for k, v in environment.items()), memory=None, memory_note=None,
                   cpu_binding=binding, mig_instance=None, launched=launched, launcher_environ=launcher_environ)


def test_missing_variables_are_set_launcher_defaults_replaced_user_values_kept():
    env = {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "INFO", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    launcher = {"NCCL_DEBUG": "INFO"}  # the user exported NCCL_DEBUG; accelerate added OMP_NUM_THREADS=1 itself
    p = plan({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_P2P_DISABLE": "1", "OMP_NUM_THREADS": "12", "NCCL_DEBUG": "WARN"}, launcher)
    report = apply_run_environment(p, env, set_affinity=lambda cpus: pytest.fail("no binding planned"))
    assert env == {"OMP_NUM_THREADS": "12", "NCCL_DEBUG": "INFO", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_P2P_DISABLE": "1"}
    assert report.applied == (("NCCL_P2P_DISABLE", "1"),)
    assert report.replaced == (("OMP_NUM_THREADS", "1", "12"),)
    assert report.kept == (Override("NCCL_DEBUG", "WARN", "INFO", "environment"),)
    assert report.lines() == ["environment from the plan (it did not reach this process): NCCL_P2P_DISABLE=1",
                              "OMP_NUM_THREADS=12 from the plan over 1 set by the launcher",
                              "NCCL_DEBUG=INFO from your environment kept over the plan's WARN"]


def test_without_the_launchers_environment_a_set_value_counts_as_the_users():
    env = {"OMP_NUM_THREADS": "3"}
    report = apply_run_environment(plan({"OMP_NUM_THREADS": "12"}), env)
    assert env == {"OMP_NUM_THREADS": "3"} and report.kept == (Override("OMP_NUM_THREADS", "12", "3", "environment"),)


def test_a_change_after_cuda_initialised_is_an_error_not_a_silent_no_op(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert read_too_late("CUDA_DEVICE_ORDER") == "CUDA is already initialised" and read_too_late("NCCL_P2P_DISABLE") is None
    with pytest.raises(RunPlanError, match=r"^the plan sets CUDA_DEVICE_ORDER=PCI_BUS_ID, but CUDA is already initialised, so it "
                       r"would change nothing: call hf_gpu_train\.plan\.run_plan\.apply_run_environment first thing"):
        apply_run_environment(plan({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))
    assert apply_run_environment(plan({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).applied == ()
    other = {}  # another process's environment (a child's, a test's): what this process already read does not matter
    assert apply_run_environment(plan({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}), other).applied == (("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),)
    assert other == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_omp_threads_reach_an_already_loaded_torch(monkeypatch):
    calls = []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False), set_num_threads=calls.append)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    apply_run_environment(plan({"OMP_NUM_THREADS": "7"}), {})
    assert calls == []  # an environment that is not this process's: this process's threads stay
    monkeypatch.setenv("OMP_NUM_THREADS", "unset")  # registers the value to restore after the test (often: none)
    monkeypatch.delenv("OMP_NUM_THREADS")  # (delenv of a missing variable registers nothing: the 7 leaked into every
    apply_run_environment(plan({"OMP_NUM_THREADS": "7"}), os.environ)  # later test's processes, 7 threads on 2 cores)
    assert calls == [7]


TASKSET = CpuBinding("taskset", ("20-23", "20-23"), "why")


@pytest.mark.parametrize("binding, rank, available, expected", [
    (None, 0, set(range(8)), None),
    (CpuBinding("none", ("0-3", "4-7"), "why"), 1, set(range(8)), None),
    (TASKSET, 1, set(range(40)), {20, 21, 22, 23}),  # launched without the prefix: bind
    (TASKSET, 0, {20, 21, 22, 23}, None),  # under `taskset -c 20-23` already
    (CpuBinding("accelerate", ("0-3", "4-7"), "why"), 1, set(range(8)), {4, 5, 6, 7}),  # torchrun: no accelerate affinity
    (TASKSET, 0, {20, 21, 60, 61}, {20, 21}),  # a cgroup allows fewer: the planned ones it allows
])
def test_binding_target(binding, rank, available, expected):
    assert binding_target(binding, rank, available)[0] == expected


def test_binding_to_cpus_this_machine_does_not_offer_is_a_note():
    target, note = binding_target(TASKSET, 0, {0, 1})
    assert target is None and note == ("CPU binding not applied: the plan's CPUs 20-23 are not available to this process (0-1); "
                                       "was the plan made for another machine?")


def test_binding_is_applied_for_the_local_rank_unless_the_gpus_were_changed_at_launch():
    import os

    available = os.sched_getaffinity(0)
    cpus = min(available)
    bound = []
    p = plan({}, binding=CpuBinding("accelerate", ("999", str(cpus)), "why"))
    if available == {cpus}:
        pytest.skip("one CPU: already bound to anything that includes it")
    report = apply_run_environment(p, {"LOCAL_RANK": "1"}, set_affinity=bound.append)
    assert bound == [{cpus}] and report.cpu_binding == f"bound local process 1 to CPUs {cpus} (the plan's binding: accelerate)"
    moved = replace(p, gpu_ids="0,1", launched=LaunchedAs(gpu_ids="2,3"))
    report = apply_run_environment(moved, {"LOCAL_RANK": "1"}, set_affinity=bound.append)
    assert len(bound) == 1 and report.cpu_binding == "CPU binding not applied: launched on other GPUs than the plan bound CPUs for"


def test_another_processs_environment_does_not_bind_this_process(monkeypatch):
    import os

    available = os.sched_getaffinity(0)
    if len(available) == 1:
        pytest.skip("one CPU: already bound to anything that includes it")
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(cpus))
    p = plan({}, binding=CpuBinding("accelerate", (str(min(available)),), "why"))
    report = apply_run_environment(p, {"LOCAL_RANK": "0"})
    assert calls == [] and report.cpu_binding is None
    apply_run_environment(p, os.environ)  # this process's environment: bound as planned
    assert calls == [{min(available)}]
