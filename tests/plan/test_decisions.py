"""Expected plans per reference machine: precision, gpu_ids, NCCL variables, strategy."""

from dataclasses import replace

import pytest

from hf_gpu_train.plan.decisions import PlanError, decide_precision, nccl_environment, p2p_level_cutoff, select_gpus
from hf_gpu_train.plan.planner import PlanOptions, make_plan


@pytest.mark.parametrize("name, dist, precision, gpu_ids, env", [
    ("cpu-only", "MULTI_GPU", "no", None, {"ACCELERATE_USE_CPU": "1"}),
    ("1x-t4", "NO", "fp16", "0", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    ("1x-h200", "NO", "bf16", "0", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    ("8x-h100-sxm", "MULTI_GPU", "bf16", "0,1,2,3,4,5,6,7", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    ("8x-a100-sxm-80gb", "MULTI_GPU", "bf16", "0,1,2,3,4,5,6,7", {}),
    ("4x-a100-pcie-nvlink-pairs", "MULTI_GPU", "bf16", "0,1,2,3", {}),
    ("2x-rtx4090", "MULTI_GPU", "bf16", "0,1", {"NCCL_P2P_DISABLE": "1"}),
    ("4x-rtx3090-nvlink-pairs", "MULTI_GPU", "bf16", "0,1,2,3", {"NCCL_P2P_LEVEL": "NVL"}),
    ("mixed-a100-rtx3090", "NO", "bf16", "0", {}),
    ("2x-a100-one-busy", "NO", "bf16", "0", {}),
    ("8x-v100-dgx1", "MULTI_GPU", "fp16", "0,1,2,3,4,5,6,7", {"NCCL_P2P_LEVEL": "NVL"}),
    ("8x-a100-pcie-switches", "MULTI_GPU", "bf16", "0,1,2,3,4,5,6,7", {"NCCL_P2P_LEVEL": "PXB"}),
    ("1x-a100-mig", "NO", "bf16", "MIG-a100-sxm-80-00-gi1-0000-000000000000", {}),
])
def test_default_plan_per_machine(machine, name, dist, precision, gpu_ids, env):
    plan = make_plan(machine(name))
    assert plan.accelerate["distributed_type"] == dist
    assert plan.accelerate["mixed_precision"] == precision
    assert plan.accelerate.get("gpu_ids") == gpu_ids
    for key, value in env.items():
        assert plan.env_dict[key] == value
    if name not in ("2x-rtx4090",):
        assert "NCCL_P2P_DISABLE" not in plan.env_dict  # NVLinked and datacenter pairs keep P2P
    assert all(s.reason for s in plan.settings)


def test_precision_errors_name_the_gpu_and_the_alternative(machine):
    with pytest.raises(PlanError, match=r"GPU 0 \(Tesla T4, compute capability 7.5\) has no bf16 support: use --precision fp16"):
        make_plan(machine("1x-t4"), PlanOptions(precision="bf16"))
    with pytest.raises(PlanError, match="needs 8.9 or newer"):
        decide_precision(machine("8x-a100-sxm-80gb").gpus, "fp8", fp8_backend_installed=True)
    with pytest.raises(PlanError, match="no fp8 backend"):
        decide_precision(machine("1x-h200").gpus, "fp8", fp8_backend_installed=False)
    assert decide_precision(machine("1x-h200").gpus, "fp8", fp8_backend_installed=True)[0] == "fp8"
    with pytest.raises(PlanError, match="use --precision fp32"):
        decide_precision((), "fp16")
    assert decide_precision(machine("8x-h100-sxm").gpus, "fp32")[0] == "no"


def test_skips_mig_display_and_busy_gpus_unless_asked(machine):
    two = machine("2x-a100-one-busy")
    mig_on_1 = replace(two, gpus=(two.gpus[0], replace(two.gpus[1], mig_enabled=True, mig_pending_enabled=True, mig_instances=())))
    gpus, reasons = select_gpus(mig_on_1, include_busy=True)
    assert [g.index for g in gpus] == [0] and any(r.startswith("skip GPU 1: MIG mode on") for r in reasons)
    gpus, reasons = select_gpus(machine("2x-a100-one-busy"))
    assert [g.index for g in gpus] == [0] and any("30.0 GiB held by other processes" in r for r in reasons)
    assert [g.index for g in select_gpus(machine("2x-a100-one-busy"), include_busy=True)[0]] == [0, 1]
    assert [g.index for g in select_gpus(machine("2x-a100-one-busy"), busy_threshold_bytes=40 * 2**30)[0]] == [0, 1]
    gpus, reasons = select_gpus(machine("mixed-a100-rtx3090"))
    assert [g.index for g in gpus] == [0] and any("drives a display" in r for r in reasons)
    gpus, reasons = select_gpus(machine("mixed-a100-rtx3090"), gpu_ids="0,1")
    assert len(gpus) == 2 and any("mixed GPU models" in r for r in reasons)


def test_mixed_models_pick_the_largest_homogeneous_group(machine):
    box = machine("mixed-a100-rtx3090")
    no_display = replace(box, gpus=(box.gpus[0], replace(box.gpus[1], display_active=False)))
    gpus, reasons = select_gpus(no_display)
    assert [g.name for g in gpus] == ["NVIDIA A100 80GB PCIe"]
    assert any("slowest GPU would pace" in r for r in reasons)


def test_fewer_gpus_prefer_nvlinked_pairs_then_a_numa_node(machine):
    assert [g.index for g in select_gpus(machine("4x-rtx3090-nvlink-pairs"), "2")[0]] == [0, 1]
    pairs = machine("4x-a100-pcie-nvlink-pairs")
    busy_0 = replace(pairs, gpus=(replace(pairs.gpus[0], memory_used_bytes=20 * 2**30), *pairs.gpus[1:]))
    assert [g.index for g in select_gpus(busy_0, "2")[0]] == [2, 3]  # the other NV12 pair, not 1,2
    h100 = machine("8x-h100-sxm")
    pcie_only = replace(h100, pairs=tuple(replace(p, nvlinks=0) for p in h100.pairs))
    chosen, reasons = select_gpus(pcie_only, "4")
    assert {g.numa_node for g in chosen} == {0} and any("NUMA node 0" in r for r in reasons)
    with pytest.raises(PlanError, match="only 2 usable"):
        select_gpus(machine("2x-rtx4090"), "3")
    with pytest.raises(PlanError, match=r"no GPU \[5\]"):
        select_gpus(machine("2x-rtx4090"), gpu_ids="0,5")
    with pytest.raises(PlanError, match="give all or a count"):
        select_gpus(machine("2x-rtx4090"), "two")


def test_selecting_only_nvlinked_3090s_needs_no_p2p_setting(machine):
    plan = make_plan(machine("4x-rtx3090-nvlink-pairs"), PlanOptions(gpus="2"))
    assert plan.accelerate["gpu_ids"] == "0,1"
    assert "NCCL_P2P_DISABLE" not in plan.env_dict and "NCCL_P2P_LEVEL" not in plan.env_dict


def test_multi_node_settings(machine):
    plan = make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, machine_rank=1, main_process_ip="node0"))
    acc = plan.accelerate
    assert (acc["num_processes"], acc["num_machines"], acc["machine_rank"], acc["main_process_ip"]) == (16, 2, 1, "node0")
    assert "NCCL_IB_DISABLE" not in plan.env_dict  # this box has InfiniBand
    no_ib = make_plan(machine("4x-a100-pcie-nvlink-pairs"), PlanOptions(num_machines=2, main_process_ip="node0"))
    assert no_ib.env_dict["NCCL_IB_DISABLE"] == "1"
    with pytest.raises(PlanError, match="needs --main-process-ip"):
        make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2))
    with pytest.raises(PlanError, match="--machine-rank 2"):
        make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, machine_rank=2, main_process_ip="x"))
    with pytest.raises(PlanError, match="1024..65535"):
        make_plan(machine("8x-h100-sxm"), PlanOptions(main_process_port=80))


def test_debug_nccl_only_when_asked(machine):
    assert not any(k.startswith("NCCL_DEBUG") for k in make_plan(machine("8x-h100-sxm")).env_dict)
    assert make_plan(machine("8x-h100-sxm"), PlanOptions(debug_nccl=True)).env_dict["NCCL_DEBUG"] == "INFO"


def test_cpu_plan_refuses_sharding_one_process(machine):
    with pytest.raises(PlanError, match="pass --num-processes 2 or more"):  # ZeRO over gloo is allowed: test_cpu_deepspeed_plan
        make_plan(machine("cpu-only"), PlanOptions(strategy="deepspeed-zero2", cpu_processes=1))
    assert make_plan(machine("cpu-only"), PlanOptions(cpu_processes=1)).accelerate["distributed_type"] == "NO"


def test_multi_node_needs_homogeneous_nodes(machine):
    ok = make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="n0", other_nodes=(machine("8x-h100-sxm"),)))
    assert ok.accelerate["num_processes"] == 16
    with pytest.raises(PlanError, match=r"nodes must be homogeneous: 8x-a100-sxm-80gb has 8x NVIDIA A100-SXM4-80GB"):
        make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="n0", other_nodes=(machine("8x-a100-sxm-80gb"),)))


def test_p2p_level_keeps_p2p_up_to_where_it_stops(machine):
    box = machine("8x-a100-pcie-switches")
    env = {k: (v, why) for k, v, why in nccl_environment(box, box.gpus)}
    assert env["NCCL_P2P_LEVEL"][0] == "PXB" and "NCCL_P2P_DISABLE" not in env  # P2P kept within each socket
    assert env["NCCL_P2P_LEVEL"][1].startswith("P2P not supported on 0-4, 0-5, 0-6, 0-7, 1-4, 1-5 and 10 more "
                                               "(IOH topology not supported), all farther than PXB; the pairs up to PXB")
    assert p2p_level_cutoff(list(machine("2x-rtx4090").pairs)) is None  # nothing works: disable
    mixed = [replace(box.pair(0, 1), p2p_read="chipset not supported"), box.pair(0, 2)]
    assert p2p_level_cutoff(mixed) is None  # a broken PIX pair below a working PXB pair: no level separates them


def test_nvlink_without_p2p_disables_p2p_and_points_to_the_doctor():
    from tests.hardware.odd_machines import odd_machine

    vm = odd_machine("4x-h100-vm-nvlink-no-p2p")
    plan = make_plan(vm)
    assert plan.env_dict["NCCL_P2P_DISABLE"] == "1"
    reason = dict((k, why) for k, _, why in plan.env)["NCCL_P2P_DISABLE"]
    assert "NVLinks are active on 0-1, 0-2, 0-3, 1-2, 1-3, 2-3 but unused without P2P" in reason and "doctor" in reason
