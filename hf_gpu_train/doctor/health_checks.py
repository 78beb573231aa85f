"""The doctor's checks of each GPU's own health: ECC errors, memory repairs (retired pages, remapped rows), XIDs, PCIe
replays, NVLink errors. Each says what it read, the verdict and the fix: reset the GPU, reseat it, or drain the node
and replace it. A counter the GPU or driver does not have (no ECC on GeForce, no row remapping before Ampere, no page
retirement from Ampere on, no NVLink on PCIe cards) is named as not supported, never failed. They read only the
profile's ``GpuHealth`` (``hardware/health.py`` reads it from NVML), so they work on a snapshot as on the box.
Clocks held back by heat or a power brake are ``checks.check_idle_throttling``'s.
"""

from __future__ import annotations

from collections.abc import Callable

from ..hardware.health import (
    CRITICAL,
    RETIRED_PAGES_LIMIT,
    XIDS,
    drain_fix,
    nvlink_fix,
    reseat_fix,
    reset_fix,
    restart_fix,
    xid_meaning,
)
from ..hardware.profile import GpuHealth, GpuInfo, HardwareProfile
from .checks import FAIL, PASS, SKIP, WARN, Check

HEALTH_CHECK_NAMES = ("ECC", "memory repairs", "XID errors", "PCIe replays", "NVLink errors")

_ORDER = {PASS: 0, WARN: 1, FAIL: 2}


def _gathered(name: str, profile: HardwareProfile, judge: Callable[[GpuInfo, GpuHealth], tuple[str, str, str | None] | None],
              ok: str, unsupported: str) -> Check:
    """One check over every GPU: ``judge`` gives (status, finding, fix) for a GPU, or None when the GPU does not
    have what is checked. The worst status wins; every finding and fix is listed, the unsupported GPUs named."""
    findings: list[tuple[str, str, str | None]] = []
    without: list[str] = []
    for gpu in profile.gpus:
        verdict = judge(gpu, gpu.health) if gpu.health is not None else None
        if verdict is None:
            without.append(f"GPU{gpu.index}")
        else:
            findings.append(verdict)
    if not findings:
        recorded = any(g.health is not None for g in profile.gpus)
        return Check(name, SKIP, f"{unsupported} on {', '.join(without)}" if recorded else
                     "not recorded (a snapshot from before health fields: `hf-gpu-train detect --save` again)")
    status = max((s for s, _, _ in findings), key=_ORDER.__getitem__)
    bad = [(text, fix) for s, text, fix in findings if s != PASS]
    details = [text for text, _ in bad] or [ok]
    if without:
        details.append(f"{unsupported} on {', '.join(without)}")
    fixes = list(dict.fromkeys(fix if fix.endswith(".") else fix + "." for _, fix in bad if fix))
    return Check(name, status, "; ".join(details), " ".join(fixes) or None)


def check_ecc(profile: HardwareProfile) -> Check:
    """Uncorrectable (double-bit) ECC errors since the last reset: FAIL, reset. Over the board's life only: WARN."""
    def judge(gpu: GpuInfo, h: GpuHealth):
        if h.ecc_uncorrected_volatile is None and h.ecc_uncorrected_aggregate is None:
            return None
        counts = (f"{h.ecc_uncorrected_volatile if h.ecc_uncorrected_volatile is not None else '?'} uncorrectable since the "
                  f"last reset, {h.ecc_uncorrected_aggregate if h.ecc_uncorrected_aggregate is not None else '?'} over the "
                  f"board's life, {h.ecc_corrected_volatile if h.ecc_corrected_volatile is not None else '?'} corrected")
        if h.ecc_uncorrected_volatile:
            return FAIL, f"GPU{gpu.index}: {counts}: memory returned wrong data since the driver loaded", reset_fix(gpu.index)
        if h.ecc_uncorrected_aggregate:
            return WARN, (f"GPU{gpu.index}: {counts}: earlier double-bit errors; check that their repair was applied "
                          "(see memory repairs)"), reset_fix(gpu.index)
        return PASS, f"GPU{gpu.index}: {counts}", None

    return _gathered("ECC", profile, judge, "no uncorrectable ECC error on any GPU",
                     "ECC not supported (GeForce boards have no ECC memory, or ECC is off)")


def check_memory_repairs(profile: HardwareProfile) -> Check:
    """Retired pages (before Ampere) and remapped rows (Ampere on): pending -> WARN reset; failed or past the limit
    -> FAIL drain and replace."""
    def judge(gpu: GpuInfo, h: GpuHealth):
        remaps = h.row_remap_pending is not None or h.row_remap_failed is not None
        retires = h.retired_pages_pending is not None or h.retired_pages_single_bit is not None
        if not remaps and not retires:
            return None
        found = []
        retired = (h.retired_pages_single_bit or 0) + (h.retired_pages_double_bit or 0)
        if h.row_remap_failed:
            found.append((FAIL, f"GPU{gpu.index}: row remapping failed: a memory bank has no spare row left",
                          drain_fix(gpu.index)))
        if retires and retired >= RETIRED_PAGES_LIMIT:
            found.append((FAIL, f"GPU{gpu.index}: {retired} pages retired (limit {RETIRED_PAGES_LIMIT}, at most 64 "
                          "can retire)", drain_fix(gpu.index)))
        if h.row_remap_pending:
            found.append((WARN, f"GPU{gpu.index}: a row remap is pending ({h.remapped_rows_uncorrected or 0} row(s) "
                          "remapped for uncorrectable, "
                          f"{h.remapped_rows_corrected or 0} for correctable errors): the failing row stays in use until "
                          "the GPU is reset", f"Reset the GPU to apply the remap: {reset_fix(gpu.index)}."))
        if h.retired_pages_pending:
            found.append((WARN, f"GPU{gpu.index}: retired pages pending ({retired} retired in all): still in use until "
                          "the GPU is reset", f"Reset the GPU to apply the retirement: {reset_fix(gpu.index)}."))
        if not found:
            what = (f"{h.remapped_rows_corrected or 0}+{h.remapped_rows_uncorrected or 0} rows remapped, none pending"
                    if remaps else f"{retired} pages retired, none pending")
            return PASS, f"GPU{gpu.index}: {what}", None
        status = FAIL if any(s == FAIL for s, _, _ in found) else WARN
        return status, "; ".join(t for _, t, _ in found), " ".join(f for _, _, f in found)

    return _gathered("memory repairs", profile, judge, "no row remap or page retirement pending or failed",
                     "neither row remapping nor page retirement supported (GeForce, or ECC off)")


def check_xids(profile: HardwareProfile) -> Check:
    """XID critical errors NVML delivered while detecting (a snapshot keeps them): each with its meaning and fix."""
    def judge(gpu: GpuInfo, h: GpuHealth):
        if h.xids is None:
            return None
        if not h.xids:
            return PASS, f"GPU{gpu.index}: none", None
        meanings = [(xid, xid_meaning(xid)) for xid in dict.fromkeys(h.xids)]
        text = f"GPU{gpu.index}: " + "; ".join(f"XID {xid} ({m.meaning})" for xid, m in meanings)
        worst = CRITICAL if any(m.severity == CRITICAL for _, m in meanings) else None
        fix = _xid_fix(gpu.index, [m.action for _, m in meanings])
        return (FAIL if worst else WARN), text, fix

    check = _gathered("XID errors", profile, judge, "no XID reported while detecting",
                      "XID events not supported by this driver")
    if check.status == PASS:  # the event set only sees XIDs from the moment it exists
        check = Check(check.name, PASS, check.detail + " (older ones are in `sudo dmesg | grep -i xid`)")
    return check


def _xid_fix(gpu: int, actions: list[str]) -> str:
    """The strongest action the XIDs call for: drain over reset over restart."""
    for action, fix in (("drain", drain_fix), ("reset", reset_fix), ("restart", restart_fix)):
        if action in actions:
            return fix(gpu) + "."
    return restart_fix(gpu) + "."


def check_pcie_replays(profile: HardwareProfile) -> Check:
    """PCIe replays: packets the link had to send again. Any count is a marginal link: WARN, reseat."""
    def judge(gpu: GpuInfo, h: GpuHealth):
        if h.pcie_replays is None:
            return None
        if h.pcie_replays:
            return WARN, (f"GPU{gpu.index}: {h.pcie_replays} PCIe replays since boot (a marginal link: a riser, cable or "
                          "slot; it slows every host-device copy and can end in the GPU falling off the bus)"), \
                reseat_fix(gpu.index) + "."
        return PASS, f"GPU{gpu.index}: 0", None

    return _gathered("PCIe replays", profile, judge, "no PCIe replay on any GPU", "PCIe replay counter not supported")


def check_nvlink_errors(profile: HardwareProfile) -> Check:
    """NVLink data-link errors: CRC errors and replays -> WARN; recoveries (the link went down and retrained: NCCL
    stalls on it) -> FAIL. Both with the reset fix."""
    def judge(gpu: GpuInfo, h: GpuHealth):
        if h.nvlink_errors is None:
            return None
        bad = [c for c in h.nvlink_errors if c.total]
        if not bad:
            return PASS, f"GPU{gpu.index}: {len(h.nvlink_errors)} link(s), no error", None
        listed = ", ".join(f"link {c.link} ({c.replay} replay, {c.recovery} recovery, {c.crc_flit} CRC flit, "
                           f"{c.crc_data} CRC data)" for c in bad)
        status = FAIL if any(c.recovery for c in bad) else WARN
        return status, f"GPU{gpu.index}: NVLink errors on {listed}", nvlink_fix(gpu.index) + "."

    return _gathered("NVLink errors", profile, judge, "no NVLink error on any GPU", "no NVLink")


def health_checks(profile: HardwareProfile) -> list[Check]:
    return [check_ecc(profile), check_memory_repairs(profile), check_xids(profile), check_pcie_replays(profile),
            check_nvlink_errors(profile)]


__all__ = ["health_checks", "HEALTH_CHECK_NAMES", "XIDS"]
