"""OMP_NUM_THREADS and dataloader workers from the cores each process is bound to, not all the host's cores."""

from dataclasses import replace

import pytest

from hf_gpu_train.plan.planner import PlanOptions, make_plan

GIB = 2**30


def env(plan):
    return {k: (v, r) for k, v, r in plan.env}


def workers(plan):
    return next(s for s in plan.settings if s.key == "dataloader_num_workers")


def busy_gpu0(profile):
    return replace(profile, gpus=(replace(profile.gpus[0], memory_used_bytes=20 * GIB), *profile.gpus[1:]))


def test_four_processes_pinned_to_one_dgx1_socket_share_its_twenty_cores(machine):
    # GPUs 4-7 sit on socket 1 (CPUs 20-39 and their SMT siblings 60-79): 20 cores for 4 processes, not 40 / 4
    plan = make_plan(busy_gpu0(machine("8x-v100-dgx1")), PlanOptions(gpus="4"))
    assert plan.cpu_binding.command_prefix == "taskset -c 20-39,60-79"
    assert env(plan)["OMP_NUM_THREADS"] == ("5", "4 process(es) bound to CPUs 20-39,60-79 (20 physical cores): 5 each; "
                                            "torchrun would set 1")
    assert (workers(plan).value, plan.dataloader_workers) == (4, 4)


def test_two_processes_on_one_socket_of_the_pcie_switch_box(machine):
    plan = make_plan(machine("8x-a100-pcie-switches"), PlanOptions(gpu_ids="4,5"))
    assert env(plan)["OMP_NUM_THREADS"][0] == "14"  # 28 cores of socket 1 / 2, not 56 / 2
    assert workers(plan).value == 8  # 13 cores left per process, capped at 8


def test_each_socket_keeps_its_own_processes_under_accelerates_affinity(machine):
    plan = make_plan(machine("8x-h100-sxm"))
    assert plan.cpu_binding.method == "accelerate"
    assert env(plan)["OMP_NUM_THREADS"] == ("14", "4 process(es) bound to CPUs 0-55 (56 physical cores): 14 each; "
                                            "torchrun would set 1")


@pytest.mark.parametrize("name, threads, workers_", [("1x-t4", "4", 3), ("4x-rtx3090-nvlink-pairs", "8", 7), ("cpu-only", "1", 0)])
def test_unbound_processes_share_every_physical_core(machine, name, threads, workers_):
    plan = make_plan(machine(name))
    assert plan.cpu_binding is None
    assert env(plan)["OMP_NUM_THREADS"][0] == threads and workers(plan).value == workers_


def test_cpu_training_loads_data_in_the_main_process(machine):
    assert workers(make_plan(machine("cpu-only"))).reason == "CPU training: the cores compute; loading in the main process"
