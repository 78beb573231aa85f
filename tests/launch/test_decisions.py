"""Expected plans per reference machine: precision, gpu_ids, NCCL variables, strategy."""

from dataclasses import replace

import pytest

from hf_gpu_train.launch.decisions import PlanError, decide_precision, nvlink_islands, select_gpus
from hf_gpu_train.launch.plan import PlanOptions, make_plan


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
    with pytest.raises(PlanError, match="MIG mode on"):
        select_gpus(machine("1x-a100-mig"))
    gpus, reasons = select_gpus(machine("2x-a100-one-busy"))
    assert [g.index for g in gpus] == [0] and any("30.0 GiB held by other processes" in r for r in reasons)
    assert [g.index for g in select_gpus(machine("2x-a100-one-busy"), include_busy=True)[0]] == [0, 1]
    assert [g.index for g in select_gpus(machine("2x-a100-one-busy"), busy_threshold_bytes=40 * 2**30)[0]] == [0, 1]
    gpus, reasons = select_gpus(machine("mixed-a100-rtx3090"))
    assert [g.index for g in gpus] == [0] and any("drives a display" in r for r in reasons)
    gpus, reasons = select_gpus(machine("mixed-a100-rtx3090"), "0,1")
    assert len(gpus) == 2 and any("mixed GPU models" in r for r in reasons)


def test_mixed_models_pick_the_largest_homogeneous_group(machine):
    box = machine("mixed-a100-rtx3090")
    no_display = replace(box, gpus=(box.gpus[0], replace(box.gpus[1], display_active=False)))
    gpus, reasons = select_gpus(no_display)
    assert [g.name for g in gpus] == ["NVIDIA A100 80GB PCIe"]
    assert any("slowest GPU would pace" in r for r in reasons)


def test_fewer_gpus_prefer_an_nvlink_island_then_a_numa_node(machine):
    assert [g.index for g in select_gpus(machine("4x-rtx3090-nvlink-pairs"), "2")[0]] == [0, 1]
    assert [[g.index for g in isl] for isl in nvlink_islands(machine("4x-a100-pcie-nvlink-pairs"), list(machine("4x-a100-pcie-nvlink-pairs").gpus))] == [[0, 1], [2, 3]]
    h100 = machine("8x-h100-sxm")
    pcie_only = replace(h100, pairs=tuple(replace(p, nvlinks=0) for p in h100.pairs))
    chosen, reasons = select_gpus(pcie_only, "4")
    assert {g.numa_node for g in chosen} == {0} and any("NUMA node 0" in r for r in reasons)
    with pytest.raises(PlanError, match="only 2 usable"):
        select_gpus(machine("2x-rtx4090"), "3")
    with pytest.raises(PlanError, match=r"no GPU \[5\]"):
        select_gpus(machine("2x-rtx4090"), "0,5")
    with pytest.raises(PlanError, match="give all, a count"):
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


def test_cpu_plan_refuses_gpu_strategies(machine):
    with pytest.raises(PlanError, match="needs GPUs"):
        make_plan(machine("cpu-only"), PlanOptions(strategy="fsdp"))
    assert make_plan(machine("cpu-only"), PlanOptions(cpu_processes=1)).accelerate["distributed_type"] == "NO"


def test_multi_node_needs_homogeneous_nodes(machine):
    ok = make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="n0", other_nodes=(machine("8x-h100-sxm"),)))
    assert ok.accelerate["num_processes"] == 16
    with pytest.raises(PlanError, match=r"nodes must be homogeneous: 8x-a100-sxm-80gb has 8x NVIDIA A100-SXM4-80GB"):
        make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="n0", other_nodes=(machine("8x-a100-sxm-80gb"),)))
