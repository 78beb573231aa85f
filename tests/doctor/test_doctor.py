from dataclasses import replace

import pytest

from hf_gpu_train.doctor import FAIL, PASS, SKIP, WARN, exit_code, run_checks
from hf_gpu_train.doctor.checks import (
    check_cuda_compat,
    check_cudnn_nccl,
    check_disk,
    check_gpu_models,
    check_idle_throttling,
    check_mig,
    check_nvlink_p2p,
    check_other_processes,
    check_shm,
    check_torch,
    torch_install_command,
)
from hf_gpu_train.doctor.live_checks import ProbeResult, p2p_copy_checks, small_win_checks
from hf_gpu_train.hardware.profile import SoftwareInfo

GOOD_SW = SoftwareInfo(python_version="3.11.7", torch_version="2.5.1+cu124", torch_cuda_build="12.4", cudnn_version=90100,
                       nccl_version="2.21.5", cuda_available=True, cuda_device_count=2)


class FakeProbe:
    """CUDA order differs from NVML order on purpose: the doctor must map by bus id."""

    def __init__(self, bus_ids, broken_small_win=(), broken_copy=()):
        self.bus_ids, self.broken_small_win, self.broken_copy = bus_ids, set(broken_small_win), set(broken_copy)
        self.small_win_calls, self.copy_calls = [], []

    def cuda_bus_ids(self):
        return self.bus_ids

    def small_win(self, cuda_index, precision):
        self.small_win_calls.append((cuda_index, precision))
        if cuda_index in self.broken_small_win:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return ProbeResult(True, f"{precision} ok")

    def p2p_copy(self, src, dst):
        self.copy_calls.append((src, dst))
        return ProbeResult((src, dst) not in self.broken_copy, "copied" if (src, dst) not in self.broken_copy else "data changed")


def by_name(checks):
    return {c.name: c for c in checks}


def test_cpu_only_machine_warns_and_exits_zero(machine):
    checks = run_checks(machine("cpu-only"), None, None, live=False)
    driver = by_name(checks)["driver"]
    assert driver.status == WARN and "training will run on the CPU" in driver.detail
    assert exit_code(checks) == 0


def test_gpu_on_the_bus_with_broken_nvml_fails_and_stops(machine):
    broken = replace(machine("cpu-only"), host=replace(machine("cpu-only").host, nvidia_pci_devices=2),
                     nvml_error="NVIDIA driver not loaded: the kernel module is missing (Driver Not Loaded)")
    checks = run_checks(broken, GOOD_SW, FakeProbe([]), live=True)
    driver = by_name(checks)["driver"]
    assert driver.status == FAIL and "2 NVIDIA GPU(s) on the PCI bus" in driver.detail
    assert "Fix the driver before installing frameworks" in driver.fix
    assert by_name(checks)["small win"].status == SKIP
    assert exit_code(checks) == 1


def test_busy_gpu_lists_the_process(machine):
    check = check_other_processes(machine("2x-a100-one-busy"))
    assert check.status == WARN and "pid 4242 python train_other.py" in check.detail and "GPU1" in check.detail
    assert check_other_processes(machine("8x-h100-sxm")).status == PASS


def test_mig_and_idle_throttling(machine):
    mig = check_mig(machine("1x-a100-mig"))
    assert mig.status == WARN and "-mig 0" in mig.fix
    t4 = machine("1x-t4")
    hot = replace(t4, gpus=(replace(t4.gpus[0], clock_event_reasons=("GpuIdle", "HwThermalSlowdown"), temperature_c=91),))
    check = check_idle_throttling(hot)
    assert check.status == WARN and "HwThermalSlowdown" in check.detail and "91 C" in check.detail
    assert check_idle_throttling(t4).status == PASS


def test_cpu_only_torch_on_a_gpu_box_gets_the_exact_install_fix(machine):
    cpu_torch = replace(GOOD_SW, torch_version="2.5.1+cpu", torch_cuda_build=None, cuda_available=False)
    check = check_torch(machine("8x-h100-sxm"), cpu_torch)  # driver supports CUDA 12.4
    assert check.status == FAIL and "CPU-only build" in check.detail
    assert check.fix == "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu124"
    assert check_torch(machine("cpu-only"), cpu_torch).status == PASS
    assert check_torch(machine("1x-t4"), replace(GOOD_SW, torch_version=None)).status == FAIL


def test_torch_cuda_newer_than_driver(machine):
    t4 = machine("1x-t4")  # driver CUDA 12.2
    assert check_cuda_compat(t4, replace(GOOD_SW, torch_cuda_build="13.0")).status == FAIL
    minor = check_cuda_compat(t4, replace(GOOD_SW, torch_cuda_build="12.4"))
    assert minor.status == WARN and "minor-version compatibility" in minor.detail
    assert check_cuda_compat(t4, replace(GOOD_SW, torch_cuda_build="12.1")).status == PASS
    assert torch_install_command("12.2").endswith("cu121")
    assert torch_install_command("13.1").endswith("cu130")


def test_missing_cudnn_fails(machine):
    check = check_cudnn_nccl(machine("1x-t4"), replace(GOOD_SW, cudnn_version=None))
    assert check.status == FAIL and "cuDNN missing" in check.detail


def test_small_win_maps_nvml_to_cuda_by_bus_id_and_uses_best_precision(machine):
    box = machine("mixed-a100-rtx3090")
    # CUDA's FASTEST_FIRST order can differ from NVML's PCI order: here the 3090 is cuda:0
    probe = FakeProbe([box.gpus[1].pci_bus_id, box.gpus[0].pci_bus_id])
    checks = small_win_checks(box, probe)
    assert [c.status for c in checks] == [PASS, PASS]
    assert checks[0].detail.startswith("cuda:1") and checks[1].detail.startswith("cuda:0")
    assert sorted(probe.small_win_calls) == [(0, "bf16"), (0, "fp32"), (1, "bf16"), (1, "fp32")]
    t4 = machine("1x-t4")
    fp16_probe = FakeProbe([t4.gpus[0].pci_bus_id])
    small_win_checks(t4, fp16_probe)
    assert fp16_probe.small_win_calls == [(0, "fp32"), (0, "fp16")]


def test_small_win_failure_and_hidden_gpu(machine):
    box = machine("2x-a100-one-busy")
    checks = small_win_checks(box, FakeProbe([box.gpus[0].pci_bus_id], broken_small_win={0}))
    assert checks[0].status == FAIL and "illegal memory access" in checks[0].detail
    assert checks[1].status == SKIP and "not visible to CUDA" in checks[1].detail


def test_p2p_copy_corruption_fails_with_the_nccl_fix(machine):
    box = machine("2x-rtx4090")
    checks = p2p_copy_checks(box, FakeProbe([g.pci_bus_id for g in box.gpus], broken_copy={(0, 1)}))
    assert checks[0].status == FAIL and "NCCL_P2P_DISABLE=1" in checks[0].fix


def test_full_live_run_on_a_healthy_box_passes(machine, tmp_path):
    box = machine("4x-a100-pcie-nvlink-pairs")
    checks = run_checks(box, GOOD_SW, FakeProbe([g.pci_bus_id for g in box.gpus]), live=True, output_dir=tmp_path)
    names = [c.name for c in checks]
    assert names[0] == "driver" and names[-2:] == ["/dev/shm", "disk"]
    assert sum(n.startswith("small win") for n in names) == 4 and sum(n.startswith("P2P copy") for n in names) == 6
    assert exit_code(checks) == 0, [c for c in checks if c.status == FAIL]


def test_snapshot_run_skips_live_checks(machine):
    checks = by_name(run_checks(machine("1x-h200"), None, None, live=False))
    assert checks["small win"].status == SKIP and checks["disk"].status == SKIP
    assert checks["torch stack"].status == SKIP


def test_shm_and_disk(machine, tmp_path):
    small = replace(machine("1x-t4"), host=replace(machine("1x-t4").host, shm_total_bytes=64 * 2**20))
    assert check_shm(small).status == WARN and "--shm-size" in check_shm(small).fix
    assert check_disk(tmp_path / "not" / "yet").status == PASS
    assert check_disk(tmp_path, min_free_bytes=2**60).status == WARN


@pytest.mark.gpu
def test_real_probe_small_win_on_every_gpu():
    from hf_gpu_train.doctor.live_checks import RealTorchProbe
    from hf_gpu_train.hardware.detect import detect

    profile = detect()
    checks = small_win_checks(profile, RealTorchProbe())
    assert checks and all(c.status == PASS for c in checks), checks


# -- MIG, NVLink without P2P, mixed models -----------------------------------------------------------

def test_mig_pending_is_reported_with_the_reset_fix():
    from tests.hardware.odd_machines import odd_machine

    checks = by_name(run_checks(odd_machine("2x-a100-mig-pending"), None, None, live=False))
    mig = checks["MIG"]
    assert mig.status == WARN
    assert mig.detail == ("GPU1: MIG mode change pending (off now, on after the next GPU reset): `nvidia-smi -mig` was run "
                          "but the GPU not reset, so the GPU works whole now and becomes MIG instances at the next reset "
                          "or reboot")
    assert mig.fix == ("Apply it: stop every process on the GPU, then `sudo nvidia-smi -i 1 -r` (or reboot; some VMs need "
                       "the host to reset it); or undo it: `sudo nvidia-smi -i 1 -mig 0`. Then run `hf-gpu-train detect "
                       "--save` again.")


def test_mig_instances_are_listed_with_their_memory(machine):
    check = check_mig(machine("1x-a100-mig"))
    assert check.status == WARN
    assert check.detail.startswith("GPU0: MIG mode on with 2 instance(s): 3g.40gb 39.2 GiB (MIG-a100-sxm-80-00-gi1-")
    assert "one process per instance (CUDA_VISIBLE_DEVICES=<MIG UUID>), NCCL cannot join instances" in check.detail
    assert "-mig 0" in check.fix and "hf-gpu-train config" in check.fix
    box = machine("1x-a100-mig")
    empty = replace(box, gpus=(replace(box.gpus[0], mig_instances=()),))
    none_created = check_mig(empty)
    assert none_created.status == WARN and "no MIG instance exists: CUDA sees no device on this GPU" in none_created.detail
    assert "nvidia-smi mig -cgi" in none_created.fix


def test_nvlink_without_p2p_warns_with_causes_and_fix(machine):
    from tests.hardware.odd_machines import odd_machine

    check = check_nvlink_p2p(odd_machine("4x-h100-vm-nvlink-no-p2p"))
    assert check.status == WARN
    assert check.detail.startswith("NVLinks active but P2P reported unsupported on 0-1, 0-2, 0-3, 1-2, 1-3, 2-3 (not supported)")
    assert "NCCL then moves data through host memory" in check.detail
    for cause in ("fabric manager", "virtual machine", "driver"):
        assert cause in check.detail
    assert "systemctl status nvidia-fabricmanager" in check.fix and "nvidia-smi topo -p2p r" in check.fix
    assert check_nvlink_p2p(machine("8x-h100-sxm")).status == PASS
    assert check_nvlink_p2p(machine("4x-rtx3090-nvlink-pairs")).status == PASS  # PCIe pairs without P2P are not NVLink's
    assert check_nvlink_p2p(machine("2x-rtx4090")).detail == "no NVLink between these GPUs"


def test_mixed_gpu_models_are_named(machine):
    check = check_gpu_models(machine("mixed-a100-rtx3090"))
    assert check.status == WARN
    assert check.detail == ("mixed GPU models: NVIDIA A100 80GB PCIe (GPU 0), NVIDIA GeForce RTX 3090 (GPU 1); one DDP job "
                            "runs at the pace and memory of its slowest GPU")
    assert "--gpu-ids" in check.fix
    assert check_gpu_models(machine("8x-h100-sxm")).detail == "8x NVIDIA H100 80GB HBM3"


def test_snapshot_doctor_runs_the_new_checks_in_order(machine):
    names = [c.name for c in run_checks(machine("8x-v100-dgx1"), None, None, live=False)]
    assert names[:6] == ["driver", "gpus", "GPU models", "other processes", "MIG", "NVLink P2P"]
