import subprocess
import sys
from dataclasses import replace

import pytest

from hf_gpu_train.hardware.backend import NvmlFailure, normalize_bus_id, safe_query
from hf_gpu_train.hardware.detect import cuda_version_string, detect
from hf_gpu_train.hardware.fake import FakeNvmlBackend
from hf_gpu_train.hardware.snapshot import load_machine
from tests.conftest import REFERENCE_MACHINES
from tests.hardware.odd_machines import odd_machine, odd_machine_names

NVML_ONLY_FIELDS = dict(name=None, description=None, notes=(), software=None)


@pytest.mark.parametrize("name", [n for n in REFERENCE_MACHINES if n != "cpu-only"] + odd_machine_names())
def test_snapshot_through_fake_backend_detects_the_same_profile(name):
    original = odd_machine(name) if name in odd_machine_names() else load_machine(name)
    detected = detect(FakeNvmlBackend(original), host=original.host)
    assert detected.notes == ()
    assert detected == replace(original, **NVML_ONLY_FIELDS)


def test_mig_pending_mode_is_recorded_not_dropped():
    box = odd_machine("2x-a100-mig-pending")
    gpus = detect(FakeNvmlBackend(box), host=box.host).gpus
    assert (gpus[1].mig_enabled, gpus[1].mig_pending_enabled, gpus[1].mig_change_pending) == (False, True, True)
    assert (gpus[0].mig_enabled, gpus[0].mig_pending_enabled, gpus[0].mig_change_pending) == (False, False, False)
    assert gpus[1].mig_instances is None  # not in MIG mode now: no MIG devices to list


def test_mig_instances_are_recorded_with_their_memory_and_uuid(machine):
    box = machine("1x-a100-mig")
    gpu = detect(FakeNvmlBackend(box), host=box.host).gpus[0]
    assert gpu.mig_enabled and gpu.memory_total_bytes == 81920 * 2**20
    assert [(m.profile, m.memory_total_bytes, m.uuid[:4], m.gpu_instance_id) for m in gpu.mig_instances] == [
        ("3g.40gb", 40192 * 2**20, "MIG-", 1), ("3g.40gb", 40192 * 2**20, "MIG-", 2)]
    unlisted = detect(FakeNvmlBackend(box, failures={"mig_devices": "not_supported"}), host=box.host).gpus[0]
    assert unlisted.mig_enabled and unlisted.mig_instances is None  # unknown, not "no instance"


@pytest.mark.parametrize(
    "kind, cause",
    [
        ("library_not_found", "NVIDIA driver is not installed"),
        ("driver_not_loaded", "driver not loaded"),
        ("function_not_found", "too old"),
        ("no_permission", "permission"),
        ("lib_rm_version_mismatch", "without a reboot"),
    ],
)
def test_nvml_init_failures_give_a_cpu_profile_with_the_reason(machine, kind, cause):
    box = machine("2x-a100-one-busy")
    profile = detect(FakeNvmlBackend(box, init_failure=kind), host=box.host)
    assert profile.gpus == ()
    assert cause in profile.nvml_error
    assert profile.host == box.host


@pytest.mark.parametrize("field, method", [("power_limit_w", "power_limit_mw"), ("mig_enabled", "mig_mode"), ("mig_pending_enabled", "mig_mode"),
                                           ("numa_node", "numa_node"), ("display_active", "display_active"),
                                           ("compute_capability", "compute_capability")])
@pytest.mark.parametrize("kind", ["not_supported", "function_not_found"])
def test_unsupported_queries_become_none_without_notes(machine, field, method, kind):
    box = machine("1x-t4")
    profile = detect(FakeNvmlBackend(box, failures={method: kind}), host=box.host)
    assert getattr(profile.gpus[0], field) is None
    assert profile.gpus[0].name == "Tesla T4"
    assert profile.notes == ()


def test_unexpected_query_failure_is_recorded_not_raised(machine):
    box = machine("1x-t4")
    profile = detect(FakeNvmlBackend(box, failures={"temperature_c": "gpu_is_lost"}), host=box.host)
    assert profile.gpus[0].temperature_c is None
    assert any("temperature_c" in note and "gpu_is_lost" in note for note in profile.notes)


def test_nvlink_counts_through_nvswitch_and_bridges(machine):
    h100 = detect(FakeNvmlBackend(machine("8x-h100-sxm")), host=machine("8x-h100-sxm").host)
    assert {p.nvlinks for p in h100.pairs} == {18}
    assert len(h100.pairs) == 28
    bridged = detect(FakeNvmlBackend(machine("4x-rtx3090-nvlink-pairs")), host=machine("4x-rtx3090-nvlink-pairs").host)
    assert {(p.a, p.b): p.nvlinks for p in bridged.pairs} == {(0, 1): 4, (0, 2): 0, (0, 3): 0, (1, 2): 0, (1, 3): 0, (2, 3): 4}
    assert [p.p2p_ok for p in bridged.pairs] == [True, False, False, False, False, True]


def test_device_count_failure_is_a_partial_profile(machine):
    box = machine("1x-t4")
    profile = detect(FakeNvmlBackend(box, failures={"device_count": "gpu_is_lost"}), host=box.host)
    assert profile.gpus == ()
    assert "could not count GPUs" in profile.nvml_error
    assert profile.driver_version == "535.183.01"


def test_nvml_is_shut_down_after_detection(machine):
    backend = FakeNvmlBackend(machine("1x-t4"))
    detect(backend, host=machine("1x-t4").host)
    assert backend.calls["init"] == 1 and backend.calls["shutdown"] == 1 and not backend.initialised


def test_safe_query_maps_failures():
    def unsupported():
        raise NvmlFailure("not_supported")

    def broken():
        raise NvmlFailure("other", "boom")

    errors = []
    assert safe_query(unsupported, errors=errors) is None and errors == []
    assert safe_query(broken, errors=errors) is None and errors == ["broken: boom"]
    assert safe_query(lambda: 7) == 7


def test_bus_ids_and_cuda_versions_have_one_spelling():
    assert normalize_bus_id("00000000:07:00.0") == "0000:07:00.0"
    assert normalize_bus_id(b"00000000:AB:00.0") == "0000:ab:00.0"
    assert normalize_bus_id("07:00.0") == "0000:07:00.0"
    assert cuda_version_string(12020) == "12.2"
    assert cuda_version_string(13000) == "13.0"
    assert cuda_version_string(None) is None


def test_real_detection_on_this_machine_never_imports_torch():
    code = ("import sys; from hf_gpu_train.hardware.detect import detect; p = detect(); "
            "print(len(p.gpus)); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
