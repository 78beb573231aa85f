"""GPU choice on real topologies, counts vs indices, MIG instances, CPU binding: decisions on snapshots."""

from dataclasses import replace

import pytest

from hf_gpu_train.plan.decisions import PlanError, select_gpus
from hf_gpu_train.plan.model_spec import ModelSpec
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from tests.hardware.odd_machines import odd_machine

GIB = 2**30
# A 3B decoder (Llama-3.2-3B shape): 16 bytes/param of AdamW state alone is 45 GiB
LLAMA_3B = ModelSpec(name="llama-3b", params=3_212_749_824, num_layers=28, hidden_size=3072, num_heads=24,
                     vocab_size=128256, causal_lm=True, largest_layer_params=100_675_584, layer_class="LlamaDecoderLayer")


def busy(profile, *indices):
    """The same machine with another job holding 20 GiB on the given GPUs."""
    return replace(profile, gpus=tuple(replace(g, memory_used_bytes=20 * GIB) if g.index in indices else g
                                       for g in profile.gpus))


def ids(gpus):
    return [g.index for g in gpus]


# -- best-connected subsets ---------------------------------------------------------------------

def test_dgx1_with_one_busy_gpu_gives_four_a_fully_nvlinked_quad_on_one_socket(machine):
    chosen, reasons = select_gpus(busy(machine("8x-v100-dgx1"), 0), "4")
    assert ids(chosen) == [4, 5, 6, 7]  # not 1,2,3,4 (index order; 1-4 have no NVLink and cross the sockets)
    assert reasons[-1].startswith("GPUs 4,5,6,7: fully NVLinked (NV1-NV2 on every pair)")
    assert "NUMA node 1" in reasons[-1]


def test_dgx1_two_gpus_are_a_pair_with_the_most_nvlinks(machine):
    chosen, reasons = select_gpus(machine("8x-v100-dgx1"), "2")
    assert ids(chosen) == [2, 3]  # NV2 and one PCIe switch; 0,1 is only NV1
    assert reasons[-1].startswith("GPUs 2,3: fully NVLinked (NV2 on every pair), one PCIe switch (PIX), NUMA node 0")
    assert ids(select_gpus(busy(machine("8x-v100-dgx1"), 2), "2")[0]) == [6, 7]  # the other NV2 + PIX pair


def test_dgx1_three_gpus_stay_inside_one_quad(machine):
    chosen, _ = select_gpus(machine("8x-v100-dgx1"), "3")
    assert ids(chosen) == [0, 2, 3]  # NV1/NV2/NV2: the most links of any fully linked triple on socket 0


def test_pcie_switch_box_two_gpus_share_a_switch(machine):
    box = machine("8x-a100-pcie-switches")
    assert ids(select_gpus(box, "2")[0]) == [0, 1]
    chosen, reasons = select_gpus(busy(box, 0), "2")
    assert ids(chosen) == [2, 3]  # not 1,2 (two switches, PXB)
    assert reasons[-1].startswith("GPUs 2,3: no NVLink, one PCIe switch (PIX), NUMA node 0")
    four, reasons = select_gpus(busy(box, 0), "4")
    assert ids(four) == [4, 5, 6, 7] and "PCIe switches under one host bridge (PXB), NUMA node 1" in reasons[-1]


def test_nvswitch_box_prefers_one_socket_and_one_pcie_switch(machine):
    assert ids(select_gpus(machine("8x-h100-sxm"), "4")[0]) == [0, 1, 2, 3]
    assert ids(select_gpus(busy(machine("8x-h100-sxm"), 1), "4")[0]) == [4, 5, 6, 7]  # whole socket 1 over 0,2,3,4
    assert ids(select_gpus(busy(machine("8x-a100-sxm-80gb"), 0), "2")[0]) == [2, 3]  # NV12 + PXB switch pair


def test_unknown_numa_ids_fall_back_to_cpu_affinity_for_grouping(machine):
    h100 = machine("8x-h100-sxm")
    no_numa = replace(busy(h100, 1), gpus=tuple(replace(g, numa_node=None) for g in busy(h100, 1).gpus))
    chosen, reasons = select_gpus(no_numa, "4")
    assert ids(chosen) == [4, 5, 6, 7] and "CPU affinity 56-111" in reasons[-1]


# -- reasons on every decision line -------------------------------------------------------------

@pytest.mark.parametrize("name, gpus", [("2x-rtx4090", "1"), ("8x-h100-sxm", "8"), ("1x-h200", "1"),
                                        ("4x-a100-pcie-nvlink-pairs", "3"), ("mixed-a100-rtx3090", "1")])
def test_every_setting_has_a_reason(machine, name, gpus):
    plan = make_plan(machine(name), PlanOptions(gpus=gpus))
    empty = [s.key for s in plan.settings if not str(s.reason).strip()]
    assert empty == []


# -- counts vs indices ---------------------------------------------------------------------------

def test_gpus_is_a_count_and_indices_need_gpu_ids(machine):
    box = machine("2x-rtx4090")
    with pytest.raises(PlanError, match=r"--gpus 0: --gpus is a count .* to use GPU 0, pass --gpu-ids 0"):
        select_gpus(box, "0")
    with pytest.raises(PlanError, match=r"--gpus '0,1' looks like GPU indices: pass --gpu-ids 0,1"):
        select_gpus(box, "0,1")
    with pytest.raises(PlanError, match=r"--gpus 'id:1' .* pass --gpu-ids 1"):
        select_gpus(box, "id:1")
    assert ids(select_gpus(box, gpu_ids="1")[0]) == [1]
    assert ids(select_gpus(box, gpu_ids="1,0")[0]) == [1, 0]
    assert make_plan(box, PlanOptions(gpu_ids="1")).accelerate["gpu_ids"] == "1"
    with pytest.raises(PlanError, match="not both"):
        select_gpus(box, "2", gpu_ids="0,1")
    with pytest.raises(PlanError, match=r"--gpu-ids '0,0': GPU 0 named twice"):
        select_gpus(box, gpu_ids="0,0")
    with pytest.raises(PlanError, match=r"--gpu-ids 'a': give NVML indices"):
        select_gpus(box, gpu_ids="a")
    with pytest.raises(PlanError, match=r"--gpu-ids 0,5: no GPU \[5\] here"):
        select_gpus(box, gpu_ids="0,5")


def test_count_that_cannot_be_met_names_the_left_out_gpus_and_why(machine):
    box = machine("mixed-a100-rtx3090")
    no_display = replace(box, gpus=(box.gpus[0], replace(box.gpus[1], display_active=False)))
    with pytest.raises(PlanError) as info:
        select_gpus(no_display, "2")
    message = str(info.value)
    assert message.startswith("--gpus 2: only 1 usable GPU(s) here (0); left out: GPU 1 (NVIDIA GeForce RTX 3090: "
                              "another model than the NVIDIA A100 80GB PCIe")
    assert "--gpu-ids 0,1" in message
    with pytest.raises(PlanError, match=r"left out: GPU 1 \(drives a display"):
        select_gpus(box, "2")
    with pytest.raises(PlanError, match=r"left out: GPU 1 \(30.0 GiB held by other processes"):
        select_gpus(machine("2x-a100-one-busy"), "2")


# -- MIG -----------------------------------------------------------------------------------------

def test_mig_pending_gpu_is_skipped_with_the_reset_fix():
    box = odd_machine("2x-a100-mig-pending")
    plan = make_plan(box)
    assert plan.accelerate["gpu_ids"] == "0"
    reason = dict((s.key, s.reason) for s in plan.settings)["gpu_ids"]
    assert "skip GPU 1: MIG mode change pending (off now, on after the next GPU reset)" in reason
    named, reasons = select_gpus(box, gpu_ids="1")
    assert ids(named) == [1] and any("turns MIG on at the next reset" in r for r in reasons)


def test_mig_instance_is_offered_for_one_process_without_nccl(machine):
    plan = make_plan(machine("1x-a100-mig"))
    instance = machine("1x-a100-mig").gpus[0].mig_instances[0]
    assert plan.accelerate["gpu_ids"] == instance.uuid and plan.accelerate["num_processes"] == 1
    assert plan.accelerate["distributed_type"] == "NO"
    assert plan.mig_instance == instance
    reason = dict((s.key, s.reason) for s in plan.settings)["gpu_ids"]
    assert "one process on MIG instance" in reason and "3g.40gb, 39.2 GiB" in reason
    assert "CUDA_DEVICE_ORDER" not in plan.env_dict  # a MIG UUID needs no index order
    second = machine("1x-a100-mig").gpus[0].mig_instances[1]
    assert make_plan(machine("1x-a100-mig"), PlanOptions(gpu_ids=second.uuid)).accelerate["gpu_ids"] == second.uuid


def test_planner_plans_against_the_instance_memory_not_the_gpu(machine):
    box = machine("1x-a100-mig")
    with pytest.raises(PlanError, match=r"llama-3b .* does not fit in 39.2 GiB per MIG instance .* use a larger MIG instance"):
        make_plan(box, PlanOptions(model=LLAMA_3B, seq_len=2048))
    whole = replace(box, gpus=(replace(box.gpus[0], mig_enabled=False, mig_pending_enabled=False, mig_instances=None),))
    assert make_plan(whole, PlanOptions(model=LLAMA_3B, seq_len=2048)).memory.gpu_memory_bytes > 79 * GIB


def test_multi_process_over_mig_is_refused_with_the_reason(machine):
    box = machine("1x-a100-mig")
    with pytest.raises(PlanError, match=r"--gpus 2: .*MIG.* NCCL cannot join MIG instances"):
        make_plan(box, PlanOptions(gpus="2"))
    uuids = ",".join(m.uuid for m in box.gpus[0].mig_instances)
    with pytest.raises(PlanError, match="NCCL cannot join MIG instances"):
        make_plan(box, PlanOptions(gpu_ids=uuids))
    with pytest.raises(PlanError, match="multi-node over MIG"):
        make_plan(box, PlanOptions(num_machines=2, main_process_ip="n0"))
    no_instance = replace(box, gpus=(replace(box.gpus[0], mig_instances=()),))
    with pytest.raises(PlanError, match=r"no MIG instance on GPU 0: .*nvidia-smi mig -cgi"):
        make_plan(no_instance)


def test_select_gpus_refuses_to_hand_out_a_mig_instance_as_a_whole_gpu(machine):
    with pytest.raises(PlanError, match=r"MIG instance .*--gpu-memory-gib 39.2"):
        select_gpus(machine("1x-a100-mig"))


# -- CPU binding ----------------------------------------------------------------------------------

def test_cpu_binding_comes_from_cpu_affinity_when_nvml_gives_no_numa_node(machine):
    h100 = machine("8x-h100-sxm")
    no_numa = replace(h100, gpus=tuple(replace(g, numa_node=None) for g in h100.gpus),
                      host=replace(h100.host, numa_nodes=None))
    plan = make_plan(no_numa)
    assert plan.accelerate["enable_cpu_affinity"] is True
    reason = dict((s.key, s.reason) for s in plan.settings)["enable_cpu_affinity"]
    assert "CPU affinity 0-55 / 56-111" in reason and "no NUMA node id" in reason


def test_cpu_binding_for_gpus_that_are_not_nvml_0_to_n_is_a_taskset(machine):
    plan = make_plan(busy(machine("8x-v100-dgx1"), 0), PlanOptions(gpus="4"))
    assert "enable_cpu_affinity" not in plan.accelerate  # accelerate would pin process i to NVML GPU i
    settings = {s.key: s for s in plan.settings}
    assert settings["cpu_binding"].value == "taskset -c 20-39,60-79"
    assert "process i to NVML GPU i" in settings["cpu_binding"].reason
    assert plan.cpu_binding.command_prefix == "taskset -c 20-39,60-79"


def test_one_socket_of_a_two_socket_box_is_still_pinned(machine):
    plan = make_plan(machine("4x-a100-pcie-nvlink-pairs"), PlanOptions(gpus="2"))
    assert plan.accelerate["gpu_ids"] == "0,1" and plan.accelerate["enable_cpu_affinity"] is True
    assert "enable_cpu_affinity" not in make_plan(machine("4x-rtx3090-nvlink-pairs")).accelerate  # one NUMA node


def _islands_box(count, island):
    """``count`` GPUs in NVLink islands of ``island`` (NV6 inside, none across), one NUMA node per half."""
    from itertools import combinations

    from hf_gpu_train.hardware.profile import GpuInfo, GpuPair, HardwareProfile, HostInfo

    gpus = tuple(GpuInfo(index=i, name="GPU", uuid=f"GPU-{i}", pci_bus_id=f"0000:{i + 1:02x}:00.0", memory_total_bytes=GIB,
                         numa_node=2 * i // count) for i in range(count))
    pairs = tuple(GpuPair(a.index, b.index, "NODE" if a.numa_node == b.numa_node else "SYS",
                          6 if a.index // island == b.index // island else 0, "OK", "OK") for a, b in combinations(gpus, 2))
    return HardwareProfile(host=HostInfo("islands"), gpus=gpus, pairs=pairs)


def test_search_is_exhaustive_up_to_the_bound_and_greedy_beyond():
    from hf_gpu_train.plan.gpus import best_subset

    box = _islands_box(16, 4)
    chosen, why = best_subset(box, list(box.gpus[1:]), 4)  # GPU 0 taken: the island 4-7, not 1,2,3 plus one
    assert ids(chosen) == [4, 5, 6, 7] and why.endswith("best-connected of 1365 subsets of the 15 usable GPUs")
    big = _islands_box(18, 9)
    chosen, why = best_subset(big, list(big.gpus[1:]), 9)  # C(17, 9) = 24,310 > 20,000
    assert ids(chosen) == list(range(9, 18)) and why.endswith("grown greedily (24310 subsets are too many to try)")
    assert why.startswith("GPUs 9,10,11,12,13,14,15,16,17: fully NVLinked (NV6 on every pair)")


def test_bridged_pairs_do_not_pull_a_subset_across_the_cpu_interconnect(machine):
    """A PCIe-switch box with NVLink bridges on 0-1 and 4-5: four GPUs behind one top switch (PXB, one NUMA node) beat
    the two bridged pairs on two sockets (SYS), whose links would count for more in a plain NVLink total."""
    import dataclasses

    from hf_gpu_train.plan.gpus import select_devices

    box = machine("8x-a100-pcie-switches")
    bridged = {(0, 1), (4, 5)}
    pairs = tuple(dataclasses.replace(p, nvlinks=4) if (p.a, p.b) in bridged else p for p in box.pairs)
    chosen = select_devices(dataclasses.replace(box, pairs=pairs), "4").gpus
    assert [g.index for g in chosen] == [0, 1, 2, 3]
