"""GPU health through NVML (issue 39, item 2): readings, what changed between polls, XID event sets, and the NVML
calls a GPU or driver does not support, all through the fake backend built from snapshots (and the real backend's
translation of pynvml with pynvml's own classes)."""

from dataclasses import replace

import pynvml
import pytest

from hf_gpu_train.hardware.backend import NvmlFailure
from hf_gpu_train.hardware.detect import detect
from hf_gpu_train.hardware.fake import FakeNvmlBackend
from hf_gpu_train.hardware.health import XIDS, HealthWatch, XidListener, read_health, restart_fix, xid_meaning
from hf_gpu_train.hardware.nvml import PynvmlBackend
from hf_gpu_train.hardware.profile import GpuHealth, NvLinkErrorCounts
from tests.hardware.odd_machines import odd_machine


def started(profile, **options):
    backend = FakeNvmlBackend(profile, **options)
    backend.init()
    return backend


def watch_all(backend):
    return HealthWatch(backend, {i: backend.handle(i) for i in range(backend.device_count())})


def test_a_reading_of_a_sick_gpu_has_every_counter_of_the_snapshot():
    sick = odd_machine("2x-a100-sick-gpu")
    reading = read_health(started(sick), 1)
    assert reading == replace(sick.gpus[1].health, xids=None)  # XIDs are events: the listener reads them
    assert (reading.ecc_uncorrected_aggregate, reading.row_remap_pending, reading.pcie_replays) == (2, True, 1543)
    assert reading.retired_pages_pending is None  # an A100 remaps rows, it retires no pages


def test_a_geforce_card_has_no_ecc_no_memory_repairs_and_no_nvlink(machine):
    reading = read_health(started(machine("2x-rtx4090")), 0)
    assert reading == GpuHealth(pcie_replays=0)


@pytest.mark.parametrize("kind", ["not_supported", "function_not_found"])
def test_queries_the_driver_lacks_leave_the_field_unknown(machine, kind):
    backend = started(machine("8x-h100-sxm"), failures={"remapped_rows": kind, "pcie_replay_count": kind, "active_nvlinks": kind})
    reading = read_health(backend, 0)
    assert (reading.row_remap_pending, reading.remapped_rows_corrected, reading.pcie_replays, reading.nvlink_errors) == (
        None, None, None, None)
    assert reading.ecc_uncorrected_volatile == 0


def test_detect_records_health_and_xids_and_none_where_event_sets_are_unsupported():
    sick = odd_machine("2x-a100-sick-gpu")
    assert [g.health.xids for g in detect(FakeNvmlBackend(sick), host=sick.host).gpus] == [(), (79, 48, 63)]
    no_events = detect(FakeNvmlBackend(sick, failures={"xid_event_set": "not_supported"}), host=sick.host)
    assert [g.health.xids for g in no_events.gpus] == [None, None]
    assert no_events.gpus[1].health.pcie_replays == 1543


def test_old_snapshots_without_health_detect_as_unknown(machine):
    box = machine("1x-t4")
    old = replace(box, gpus=tuple(replace(g, health=None) for g in box.gpus))
    assert detect(FakeNvmlBackend(old), host=old.host).gpus[0].health is None


def test_nothing_changed_no_event(machine):
    backend = started(machine("8x-h100-sxm"))
    watch = watch_all(backend)
    assert watch.poll() == [] and watch.poll() == []


def test_history_at_the_baseline_is_not_news():
    watch = watch_all(started(odd_machine("2x-a100-sick-gpu")))
    assert watch.poll() == []  # XIDs 79/48/63, the pending remap and 1543 replays were there before


def test_what_changed_between_polls_is_said_once_with_its_fix():
    backend = started(odd_machine("2x-a100-sick-gpu"))
    watch = watch_all(backend)
    backend.set_health(0, ecc_uncorrected_volatile=1, ecc_uncorrected_aggregate=1, row_remap_pending=True)
    backend.set_health(1, pcie_replays=1550)
    backend.inject_xid(0, 79)
    events = watch.poll()
    assert [(e.gpu, e.kind, e.severity) for e in events] == [
        (0, "xid", "critical"), (0, "ecc_uncorrected", "critical"), (0, "row_remap_pending", "warning"),
        (1, "pcie_replays", "warning")]
    assert events[0].message == "GPU 0: XID 79, GPU has fallen off the bus: unreachable over PCIe"
    assert events[0].fix.startswith("drain the node (no new jobs on it) and replace GPU 0")
    assert events[1].message.startswith("GPU 0: 1 new uncorrectable (double-bit) ECC error(s)")
    assert "sudo nvidia-smi -r -i 0" in events[1].fix and "sudo nvidia-smi -r -i 0" in events[2].fix
    assert events[3].message.startswith("GPU 1: 7 PCIe replay(s) (packets sent again, 1550 since boot)")
    assert "reseat GPU 1" in events[3].fix
    backend.set_health(1, pcie_replays=1600)  # rising again: the same finding, not said again
    backend.inject_xid(0, 79)
    assert watch.poll() == []
    backend.inject_xid(0, 48)  # another XID is news
    assert [e.message for e in watch.poll()] == [
        "GPU 0: XID 48, double-bit ECC error: uncorrectable memory error, the process using that memory was killed"]
    assert [e.kind for e in watch.seen] == ["xid", "ecc_uncorrected", "row_remap_pending", "pcie_replays", "xid"]


def test_nvlink_errors_remap_failure_and_retired_pages_past_the_limit(machine):
    backend = started(machine("8x-v100-dgx1"))
    watch = watch_all(backend)
    links = backend.health[2].nvlink_errors
    backend.set_health(2, nvlink_errors=(replace(links[0], crc_flit=5, replay=2),) + links[1:])
    backend.set_health(5, retired_pages_double_bit=3, retired_pages_single_bit=58, retired_pages_pending=True)
    events = {(e.gpu, e.kind): e for e in watch.poll()}
    assert set(events) == {(2, "nvlink_errors"), (5, "retired_pages_limit")}
    assert events[2, "nvlink_errors"].message == "GPU 2: NVLink errors rose: link 0 +2 replay, +5 CRC flit"
    assert events[5, "retired_pages_limit"].severity == "critical" and "replace GPU 5" in events[5, "retired_pages_limit"].fix
    sick = started(odd_machine("2x-a100-sick-gpu"))
    sick_watch = watch_all(sick)
    sick.set_health(1, row_remap_failed=True)
    assert [(e.kind, e.severity) for e in sick_watch.poll()] == [("row_remap_failed", "critical")]


def test_hardware_slowdown_newly_set_is_said_once(machine):
    box = machine("1x-h200")
    backend = started(box, series={"clock_event_reasons": [0x1, 0x1, 0x8 | 0x1, 0x8]})
    watch = watch_all(backend)
    assert watch.poll() == []
    (event,) = watch.poll()
    assert (event.kind, event.severity) == ("throttle_HwSlowdown", "warning")
    assert "power brake" in event.message and "fans" in event.fix
    assert watch.poll() == []


def test_xid_event_sets_unsupported_still_watch_the_counters():
    for failures in ({"xid_event_set": "not_supported"}, {"register_xid_events": "function_not_found"}):
        backend = started(odd_machine("2x-a100-sick-gpu"), failures=failures)
        watch = watch_all(backend)
        backend.inject_xid(1, 79)
        backend.set_health(1, pcie_replays=1544)
        assert [e.kind for e in watch.poll()] == ["pcie_replays"]


def test_a_gpu_without_event_support_is_left_out_of_the_listener(machine):
    box = machine("2x-a100-one-busy")
    box = replace(box, gpus=(box.gpus[0], replace(box.gpus[1], health=replace(box.gpus[1].health, xids=None))))
    backend = started(box)
    listener = XidListener(backend, {0: 0, 1: 1})
    assert listener.registered == {0}
    backend.inject_xid(0, 13)
    backend.inject_xid(1, 13)
    assert listener.drain() == [(0, 13)] and listener.drain() == []
    listener.close()
    assert listener.drain() == []


def test_queries_a_gpu_refused_at_the_baseline_are_not_asked_again(machine):
    backend = started(machine("2x-rtx4090"))
    watch = watch_all(backend)
    asked = dict(backend.calls)
    watch.poll()
    watch.poll()
    assert backend.calls["ecc_error_count"] == asked["ecc_error_count"]  # no ECC on GeForce: asked once, at the baseline
    assert backend.calls["pcie_replay_count"] == asked["pcie_replay_count"] + 4


def test_a_lost_gpu_is_an_event_not_an_exception(machine):
    backend = started(machine("1x-h200"))
    watch = watch_all(backend)
    backend.failures.update(pcie_replay_count="gpu_is_lost", ecc_error_count="other")
    assert [(e.kind, e.severity) for e in watch.poll()] == [("gpu_lost", "critical")]
    assert watch.poll() == []


def test_poll_json_gives_the_telemetry_dicts():
    backend = started(odd_machine("2x-a100-sick-gpu"))
    watch = watch_all(backend)
    backend.inject_xid(1, 94)
    assert watch.poll_json() == [{
        "gpu": 1, "kind": "xid", "severity": "critical",
        "message": "GPU 1: XID 94, contained ECC error: an uncorrectable error confined to the process that hit it",
        "fix": restart_fix(1)}]
    assert watch.poll_json() == []


def test_the_common_xids_have_a_meaning_and_an_action():
    assert set(XIDS) == {13, 31, 43, 45, 48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}
    assert {XIDS[x].action for x in (48, 95, 119)} == {"reset"} and {XIDS[x].action for x in (64, 79)} == {"drain"}
    assert "XID catalog" in xid_meaning(154).meaning


# -- the real backend: pynvml's answers and errors translated ---------------------------------------------------
@pytest.fixture
def real(monkeypatch):
    b = PynvmlBackend()
    b._pynvml = pynvml
    return b


def test_real_backend_reads_the_health_counters(real, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEccErrors", lambda h, kind, counter: 10 * kind + counter)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetRetiredPages", lambda h, cause: [0x1000] * (cause + 1))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetRetiredPagesPendingStatus", lambda h: 1)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetRemappedRows", lambda h: (2, 1, 1, 0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPcieReplayCounter", lambda h: 17)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkErrorCounter", lambda h, link, counter: link * 100 + counter)
    assert [real.ecc_error_count(None, u, a) for u in (False, True) for a in (False, True)] == [0, 1, 10, 11]
    assert (real.retired_page_count(None, False), real.retired_page_count(None, True)) == (1, 2)
    assert real.retired_pages_pending(None) is True
    assert real.remapped_rows(None) == (2, 1, True, False)
    assert real.pcie_replay_count(None) == 17
    assert real.nvlink_error_counts(None, 3) == (300, 301, 302, 303)
    assert read_health(real, None, queries=["pcie_replays"], nvlinks=[3]) == GpuHealth(
        pcie_replays=17, nvlink_errors=(NvLinkErrorCounts(3, 300, 301, 302, 303),))


def test_real_backend_without_ecc_or_nvlink_says_not_supported(real, monkeypatch):
    def refuse(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEccErrors", refuse)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", refuse)
    with pytest.raises(NvmlFailure) as info:
        real.ecc_error_count(None, True, False)
    assert info.value.kind == "not_supported"
    with pytest.raises(NvmlFailure) as info:
        real.active_nvlinks(None)
    assert info.value.kind == "not_supported"
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", lambda h, link: 1 if link < 2 else refuse())
    assert real.active_nvlinks(None) == [0, 1]


def test_real_backend_reads_xid_events_without_waiting(real, monkeypatch):
    class Data:
        eventType = pynvml.nvmlEventTypeXidCriticalError
        eventData = 79
        device = "handle-3"

    waits = []
    queue = [Data()]

    def wait(event_set, timeout_ms):
        waits.append(timeout_ms)
        if not queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return queue.pop()

    monkeypatch.setattr(pynvml, "nvmlEventSetWait_v2", wait)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetIndex", lambda h: 3 if h == "handle-3" else -1)
    assert real.next_xid_event("set") == (3, 79)
    assert real.next_xid_event("set") is None
    assert waits == [0, 0]  # never blocks the sampler

    # XID 79: the GPU fell off the bus and no longer tells its index; the index it had when registered is used
    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", lambda handle, kind, event_set: None)
    real.register_xid_events("handle-3", "set")

    def lost(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetIndex", lost)
    queue.append(Data())
    assert real.next_xid_event("set") == (3, 79)
