"""The real pynvml backend: error translation with pynvml's own exception classes."""

import pynvml
import pytest

from hf_gpu_train.hardware.backend import NvmlFailure
from hf_gpu_train.hardware.nvml import PynvmlBackend


@pytest.fixture
def backend(monkeypatch):
    b = PynvmlBackend()
    b._pynvml = pynvml
    return b


@pytest.mark.parametrize("code, kind", [(3, "not_supported"), (12, "library_not_found"), (9, "driver_not_loaded"),
                                        (13, "function_not_found"), (4, "no_permission"), (999, "other")])
def test_pynvml_errors_become_nvml_failures(backend, monkeypatch, code, kind):
    def failing(handle):
        raise pynvml.NVMLError(code)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", failing)
    with pytest.raises(NvmlFailure) as info:
        backend.name(object())
    assert info.value.kind == kind


def test_values_are_decoded_and_normalised(backend, monkeypatch):
    class Pci:
        busId = b"00000000:3A:00.0"

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda h: Pci())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda h: b"NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCpuAffinity", lambda h, n: [0b1111 | (1 << 63), 0b1])
    assert backend.pci_bus_id(None) == "0000:3a:00.0"
    assert backend.name(None) == "NVIDIA H100 80GB HBM3"
    assert backend.cpu_affinity(None).startswith("0-3,63")


def test_throttle_reasons_fall_back_to_the_old_query(backend, monkeypatch):
    def missing(h):
        raise pynvml.NVMLError(13)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", missing)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", lambda h: 0x44)
    assert backend.clock_event_reasons(None) == 0x44


def test_nvlink_remotes_stop_at_unsupported_and_see_switches(backend, monkeypatch):
    class Pci:
        busId = b"00000000:C1:00.0"

    def state(h, link):
        if link >= 3:
            raise pynvml.NVMLError(3)
        return pynvml.NVML_FEATURE_ENABLED

    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", state)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkRemotePciInfo", lambda h, link: Pci())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType",
                        lambda h, link: pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if link == 2 else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)
    assert backend.nvlink_remotes(None) == [("0000:c1:00.0", False), ("0000:c1:00.0", False), ("0000:c1:00.0", True)]


def test_init_without_a_driver_is_a_library_not_found_failure_or_works():
    backend = PynvmlBackend()
    try:
        backend.init()
    except NvmlFailure as failure:
        assert failure.kind in ("library_not_found", "driver_not_loaded")
    else:  # a GPU machine: NVML works
        assert backend.device_count() >= 0
        backend.shutdown()


def test_mig_mode_reports_the_pending_mode(backend, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda h: [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE])
    assert backend.mig_mode(None) == (False, True)


def test_mig_devices_skip_empty_slots_and_read_each_instance(backend, monkeypatch):
    class Memory:
        total, used = 40192 * 2**20, 19 * 2**20

    def by_index(h, slot):
        if slot not in (0, 2):
            raise pynvml.NVMLError(6)  # NOT_FOUND: no MIG device in this slot
        return f"mig{slot}"

    def gi_id(mig):
        if mig == "mig2":
            raise pynvml.NVMLError(3)
        return 1

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMaxMigDeviceCount", lambda h: 7)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigDeviceHandleByIndex", by_index)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda mig: f"MIG-{mig}".encode())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda mig: b"NVIDIA A100-SXM4-80GB MIG 3g.40gb")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda mig: Memory())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstanceId", gi_id)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeInstanceId", lambda mig: 0)
    instances = backend.mig_devices(None)
    assert [(m.index, m.uuid, m.profile, m.memory_total_bytes, m.gpu_instance_id, m.compute_instance_id) for m in instances] == [
        (0, "MIG-mig0", "3g.40gb", 40192 * 2**20, 1, 0), (2, "MIG-mig2", "3g.40gb", 40192 * 2**20, None, 0)]

    def broken(h, slot):
        raise pynvml.NVMLError(999)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigDeviceHandleByIndex", broken)
    with pytest.raises(NvmlFailure):
        backend.mig_devices(None)


def test_numa_node_is_the_cpu_node_from_memory_affinity_not_the_gpu_numa_id(backend, monkeypatch):
    # nvmlDeviceGetNumaNodeId is the GPU's own NUMA id (Grace Hopper), "N/A" on x86: never asked.
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", lambda h: pytest.fail("asked the GPU NUMA id"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryAffinity", lambda h, words, scope: [0b10, 0, 0, 0])
    assert backend.numa_node(None) == 1
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryAffinity", lambda h, words, scope: [0b11, 0, 0, 0])
    with pytest.raises(NvmlFailure) as info:
        backend.numa_node(None)
    assert info.value.kind == "not_supported"

    def old_driver(h, words, scope):
        raise pynvml.NVMLError(13)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryAffinity", old_driver)
    with pytest.raises(NvmlFailure) as info:
        backend.numa_node(None)
    assert info.value.kind == "function_not_found"
