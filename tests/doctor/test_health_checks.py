"""The doctor's GPU health checks (issue 39, item 2) on the reference snapshots and a sick GPU: each verdict with its
fix, unsupported counters named and never failed."""

from dataclasses import replace

import pytest

from hf_gpu_train.doctor import FAIL, PASS, SKIP, WARN, run_checks
from hf_gpu_train.doctor.health_checks import (
    check_ecc,
    check_memory_repairs,
    check_nvlink_errors,
    check_pcie_replays,
    check_xids,
    health_checks,
)
from hf_gpu_train.hardware.profile import NvLinkErrorCounts
from tests.conftest import REFERENCE_MACHINES
from tests.hardware.odd_machines import TEST_MACHINES_DIR, odd_machine


def with_gpu_health(box, index, **changes):
    gpus = tuple(replace(g, health=replace(g.health, **changes)) if g.index == index else g for g in box.gpus)
    return replace(box, gpus=gpus)


@pytest.mark.parametrize("name", [n for n in REFERENCE_MACHINES if n != "cpu-only"])
def test_every_reference_machine_is_healthy_and_shows_the_checks(name, machine):
    checks = {c.name: c for c in run_checks(machine(name), None, None, live=False)}
    for check in ("ECC", "memory repairs", "XID errors", "PCIe replays", "NVLink errors"):
        assert checks[check].status in (PASS, SKIP), checks[check]


def test_the_sick_gpu_gets_each_verdict_with_its_fix():
    sick = odd_machine("2x-a100-sick-gpu")
    checks = {c.name: c for c in health_checks(sick)}
    assert {n: c.status for n, c in checks.items()} == {"ECC": WARN, "memory repairs": WARN, "XID errors": FAIL,
                                                       "PCIe replays": WARN, "NVLink errors": WARN}
    assert checks["ECC"].detail.startswith("GPU1: 0 uncorrectable since the last reset, 2 over the board's life, 3 corrected")
    assert "row remap is pending" in checks["memory repairs"].detail and "sudo nvidia-smi -r -i 1" in checks["memory repairs"].fix
    assert checks["XID errors"].detail == (
        "GPU1: XID 79 (GPU has fallen off the bus: unreachable over PCIe); XID 48 (double-bit ECC error: uncorrectable "
        "memory error, the process using that memory was killed); XID 63 (ECC page retirement or row remapping "
        "recorded: the repair applies at the next GPU reset)")
    assert checks["XID errors"].fix.startswith("drain the node (no new jobs on it) and replace GPU 1")
    assert checks["PCIe replays"].detail.startswith("GPU1: 1543 PCIe replays since boot") and "reseat GPU 1" in checks["PCIe replays"].fix
    assert checks["NVLink errors"].detail == "GPU1: NVLink errors on link 3 (12 replay, 0 recovery, 57 CRC flit, 0 CRC data)"


def test_uncorrectable_ecc_since_the_reset_fails_with_reset():
    box = with_gpu_health(odd_machine("2x-a100-sick-gpu"), 0, ecc_uncorrected_volatile=1, ecc_uncorrected_aggregate=1)
    check = check_ecc(box)
    assert check.status == FAIL and check.detail.startswith("GPU0: 1 uncorrectable since the last reset")
    assert check.fix.startswith("reset GPU 0 with no process on it: `sudo nvidia-smi -r -i 0`")


def test_remap_failure_and_retired_pages_past_the_limit_fail_with_drain(machine):
    failed = check_memory_repairs(with_gpu_health(machine("1x-h200"), 0, row_remap_failed=True))
    assert failed.status == FAIL and "no spare row left" in failed.detail and "replace GPU 0" in failed.fix
    worn = check_memory_repairs(with_gpu_health(machine("1x-t4"), 0, retired_pages_single_bit=50, retired_pages_double_bit=12))
    assert worn.status == FAIL and worn.detail == "GPU0: 62 pages retired (limit 60, at most 64 can retire)"
    pending = check_memory_repairs(with_gpu_health(machine("1x-t4"), 0, retired_pages_double_bit=1, retired_pages_pending=True))
    assert pending.status == WARN and "retired pages pending (1 retired in all)" in pending.detail


def test_nvlink_recoveries_fail_and_crc_errors_warn(machine):
    box = machine("4x-a100-pcie-nvlink-pairs")
    links = box.gpus[2].health.nvlink_errors
    recovering = with_gpu_health(box, 2, nvlink_errors=(NvLinkErrorCounts(0, recovery=3),) + links[1:])
    assert check_nvlink_errors(recovering).status == FAIL
    assert check_nvlink_errors(with_gpu_health(box, 2, nvlink_errors=(NvLinkErrorCounts(0, crc_data=1),) + links[1:])).status == WARN


def test_unsupported_counters_are_named_never_failed(machine):
    geforce = {c.name: c for c in health_checks(machine("2x-rtx4090"))}
    assert geforce["ECC"].status == SKIP and geforce["ECC"].detail.startswith("ECC not supported") \
        and geforce["ECC"].detail.endswith("on GPU0, GPU1")
    assert geforce["NVLink errors"].detail == "no NVLink on GPU0, GPU1"
    mixed = check_ecc(machine("mixed-a100-rtx3090"))  # an A100 with ECC beside a GeForce without
    assert mixed.status == PASS and mixed.detail.endswith("ECC not supported (GeForce boards have no ECC memory, or ECC is off) on GPU1")
    no_events = check_xids(replace(machine("1x-h200"), gpus=tuple(replace(g, health=replace(g.health, xids=None))
                                                                  for g in machine("1x-h200").gpus)))
    assert no_events.status == SKIP and no_events.detail == "XID events not supported by this driver on GPU0"


def test_snapshots_from_before_health_fields_skip_the_checks(machine):
    box = machine("1x-t4")
    old = replace(box, gpus=tuple(replace(g, health=None) for g in box.gpus))
    assert {c.status for c in health_checks(old)} == {SKIP}
    assert check_pcie_replays(old).detail.startswith("not recorded")


def test_doctor_on_the_sick_snapshot_prints_the_health_checks(capsys):
    from hf_gpu_train.cli import main

    code = main(["doctor", "--machine", str(TEST_MACHINES_DIR / "2x-a100-sick-gpu.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert "[FAIL] XID errors: GPU1: XID 79" in out and "[WARN] PCIe replays: GPU1: 1543" in out
