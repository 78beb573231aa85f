"""A rank that died or hung on a GPU that reported a health event is named with it (issue 39, item 2): the rank's own
watch in the hang summary, the launcher's node watch in the dead-rank line. NVML through the fake backend."""

import json
from pathlib import Path

from hf_gpu_train.faults.gpu_health import RankGpu, named_events, node_watch
from hf_gpu_train.faults.watchdog import Limits, Watchdog, summary
from hf_gpu_train.hardware.fake import FakeNvmlBackend
from hf_gpu_train.launch.rank_report import PROGRESS_DIR_ENV, failure_line, read_rank_gpus
from tests.faults.test_watchdog import wait_for_the_trip
from tests.hardware.odd_machines import odd_machine

XID_79 = {"gpu": 1, "kind": "xid", "severity": "critical", "message": "GPU 1: XID 79, GPU has fallen off the bus: "
          "unreachable over PCIe", "fix": "drain the node and replace GPU 1"}


def test_the_rank_watches_its_own_gpu_found_by_bus_id(machine, tmp_path):
    box = machine("8x-h100-sxm")
    backend = FakeNvmlBackend(box)
    gpu = RankGpu.watch(box.gpus[5].pci_bus_id, backend)
    assert (gpu.index, gpu.bus_id) == (5, box.gpus[5].pci_bus_id)
    assert gpu.events() == []
    backend.inject_xid(5, 79)
    backend.inject_xid(4, 48)  # another rank's GPU: not this rank's news
    assert [e["message"] for e in gpu.events()] == ["GPU 5: XID 79, GPU has fallen off the bus: unreachable over PCIe"]
    gpu.record(3, environ={PROGRESS_DIR_ENV: str(tmp_path)})
    assert read_rank_gpus(tmp_path) == {3: 5}
    assert RankGpu.watch(None, FakeNvmlBackend(box)) is None  # a CPU rank
    assert RankGpu.watch("0000:ee:00.0", FakeNvmlBackend(box)) is None
    assert RankGpu.watch(box.gpus[0].pci_bus_id, FakeNvmlBackend(box, init_failure="driver_not_loaded")) is None


def test_the_hang_summary_names_the_rank_on_the_gpu_with_a_new_xid():
    at = {"step": 7, "phase": "backward", "stalled_s": 30.0, "collectives": 40, "in_collective": None}
    states = {0: {**at, "in_collective": "all_reduce", "gpu": 0, "gpu_health": []}, 1: {**at, "collectives": 39, "gpu": 1,
                                                                                         "gpu_health": [XID_79]}}
    lines = summary(states, 0, 120.0, "the floor for a step", Path("out/hang-x"))
    assert lines[2].endswith("<- not where the others are") and lines[2].startswith("  rank 1:")
    assert lines[3:5] == ["  GPU health changed during the run:",
                          "    rank 1 (GPU 1): GPU 1: XID 79, GPU has fallen off the bus: unreachable over PCIe; fix: drain "
                          "the node and replace GPU 1"]
    quiet = summary({0: {**at, "gpu": 0, "gpu_health": []}}, 0, 120.0, "x", Path("out/hang-x"))
    assert not any("GPU health" in line for line in quiet)


def test_the_dead_rank_line_names_the_rank_and_its_gpus_xid(machine, tmp_path):
    box = machine("2x-a100-one-busy")
    backend = FakeNvmlBackend(box)
    watch = node_watch(backend)
    backend.inject_xid(1, 79)
    backend.set_health(0, pcie_replays=9)
    events = named_events(watch.poll(), {0: 0, 1: 1, 2: 1})
    assert events[0] == ("rank 1, 2 (GPU 1): GPU 1: XID 79, GPU has fallen off the bus: unreachable over PCIe; fix: drain "
                         "the node (no new jobs on it) and replace GPU 1: the GPU can no longer repair itself (collect "
                         "`nvidia-bug-report.sh` for the RMA)")
    assert events[1].startswith("rank 0 (GPU 0): GPU 0: 9 PCIe replay(s)")
    assert named_events([XID_79], {})[0].startswith("GPU 1 (no rank recorded on it): GPU 1: XID 79")
    line = failure_line((1, -6), {0: {"step": 12}, 1: {"step": 12}}, None, events[:1])
    assert line.startswith("rank 1 died (SIGABRT, exit -6); last step finished: rank 0 12, rank 1 12. GPU health changed "
                           "during the run: rank 1, 2 (GPU 1): GPU 1: XID 79")
    assert line.endswith("Do what each fix says, then run the same command again (it resumes from the last complete checkpoint, "
                         "if one was saved)")
    assert failure_line((1, -6), {}, None, []) == ("rank 1 died (SIGABRT, exit -6); last step finished: not recorded. Run the "
                                                    "same command again to resume from the last complete checkpoint, if one "
                                                    "was saved")
    assert node_watch(FakeNvmlBackend(machine("cpu-only"))) is None  # no NVML: nothing watched, nothing said


def test_a_rank_that_hangs_on_a_gpu_with_a_new_xid_says_so_in_its_summary(tmp_path):
    box = odd_machine("2x-a100-sick-gpu")
    backend = FakeNvmlBackend(box)
    exits = []
    watchdog = Watchdog(tmp_path, Limits(floor_s=0.3, long_floor_s=0.3), poll_s=0.05, exit=exits.append)
    watchdog.gpu = RankGpu.watch(box.gpus[1].pci_bus_id, backend)  # the snapshot's XIDs 79/48/63 are history
    backend.inject_xid(1, 74)
    watchdog.start()
    wait_for_the_trip(exits)
    (folder,) = tmp_path.glob("hang-*")
    state = json.loads((folder / "summary.json").read_text())["ranks"]["0"]
    assert state["gpu"] == 1 and [e["message"] for e in state["gpu_health"]] == [
        "GPU 1: XID 74, NVLink error: a link fault (hardware, NVSwitch or fabric manager)"]
    assert "    rank 0 (GPU 1): GPU 1: XID 74, NVLink error" in (folder / "summary.txt").read_text()
