"""GPU health through NVML: what a GPU says about its own soundness, and what changed while a run used it.

A node that fails again and again is usually a GPU that said so first: XID errors, ECC counts, pages retired and
rows remapped for bad memory, PCIe packets replayed, NVLink errors, clocks held back by heat or a power brake. NVML
reads all of them in microseconds; this module turns them into
- ``read_health(backend, handle)``: one ``GpuHealth`` reading (a field is None where the GPU or driver does not tell:
  no ECC on GeForce, no row remapping before Ampere, no page retirement from Ampere on, no NVLink on PCIe cards);
- ``XidListener``: the NVML event set that receives XID critical errors, created once and read without waiting;
- ``HealthWatch``: a baseline, then on each ``poll()`` only what changed since, as ``HealthEvent``s with a one-line
  message, a severity and the fix (restart, reset, reseat, drain and replace). It never raises: an NVML failure
  skips the field. Cheap enough for a sampler thread every few seconds: queries the GPU refused at the baseline are
  not asked again, active NVLinks are found once.
- the meaning and fix of the common XIDs (``XIDS``), shared by the doctor (``doctor/health_checks.py``) and the
  dead-rank and hang summaries.

Sources: NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors), "Dynamic Page Retirement" (at most 64 pages
retire on a GPU; NVIDIA's guidance is to replace a board past 60) and the A100/H100 GPU memory error management
guide (row remapping applies at the next GPU reset; a bank out of spare rows is a remap failure).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .backend import GPU_IS_LOST, UNKNOWN_VALUE_KINDS, NvmlBackend, NvmlFailure
from .clock_events import THROTTLE_REASONS
from .profile import GpuHealth, NvLinkErrorCounts, clock_event_reason_names

log = logging.getLogger(__name__)

WARNING, CRITICAL = "warning", "critical"

# Past this many retired pages NVIDIA's guidance is to replace the board (at most 64 pages can retire at all).
RETIRED_PAGES_LIMIT = 60


def restart_fix(gpu: int) -> str:
    return (f"restart the run (it resumes from its last checkpoint); if it recurs on GPU {gpu}, check the application "
            "(CUDA_LAUNCH_BLOCKING=1, compute-sanitizer) and then the GPU (`hf-gpu-train doctor`)")


def reset_fix(gpu: int) -> str:
    return (f"reset GPU {gpu} with no process on it: `sudo nvidia-smi -r -i {gpu}` (or reboot the node); if it "
            "happens again after the reset, drain the node and replace the GPU")


def drain_fix(gpu: int) -> str:
    return (f"drain the node (no new jobs on it) and replace GPU {gpu}: the GPU can no longer repair itself "
            "(collect `nvidia-bug-report.sh` for the RMA)")


def reseat_fix(gpu: int) -> str:
    return (f"reseat GPU {gpu} and check its riser, PCIe cable and slot (`nvidia-smi -q -d PCIE` shows the replay "
            "counter); if it keeps rising, replace the riser, then the GPU")


def nvlink_fix(gpu: int) -> str:
    return (f"reset GPU {gpu} (`sudo nvidia-smi -r -i {gpu}`; on NVSwitch systems also restart nvidia-fabricmanager); "
            "if the counters keep rising, drain the node and have the NVLink bridge or baseboard checked "
            "(`nvidia-smi nvlink -e` shows the counters)")


def cooling_fix(gpu: int) -> str:
    return (f"check the fans, airflow and power cables of GPU {gpu} (`nvidia-smi -q -d PERFORMANCE,TEMPERATURE`); a "
            "hardware slowdown at normal temperature is the power supply or the board")


_FIXES = {"restart": restart_fix, "reset": reset_fix, "drain": drain_fix}


@dataclass(frozen=True)
class XidMeaning:
    meaning: str
    severity: str
    action: str  # restart, reset or drain: the key of the fix in _FIXES


# The common XIDs (NVIDIA's XID catalog: description and immediate action).
XIDS = {
    13: XidMeaning("graphics engine exception: usually the application (an out-of-range access in a kernel)", WARNING, "restart"),
    31: XidMeaning("GPU memory page fault: an illegal memory access by the application (or a driver bug)", WARNING, "restart"),
    43: XidMeaning("GPU stopped processing: a channel aborted after an application error; the GPU is usually fine",
                   WARNING, "restart"),
    45: XidMeaning("preemptive cleanup: a channel torn down because its process was killed or after an earlier error",
                   WARNING, "restart"),
    48: XidMeaning("double-bit ECC error: uncorrectable memory error, the process using that memory was killed",
                   CRITICAL, "reset"),
    61: XidMeaning("internal micro-controller breakpoint/warning", CRITICAL, "reset"),
    62: XidMeaning("internal micro-controller halt", CRITICAL, "reset"),
    63: XidMeaning("ECC page retirement or row remapping recorded: the repair applies at the next GPU reset", WARNING, "reset"),
    64: XidMeaning("ECC page retirement or row remapping failed: the GPU cannot repair its memory", CRITICAL, "drain"),
    74: XidMeaning("NVLink error: a link fault (hardware, NVSwitch or fabric manager)", CRITICAL, "reset"),
    79: XidMeaning("GPU has fallen off the bus: unreachable over PCIe", CRITICAL, "drain"),
    92: XidMeaning("high single-bit ECC error rate: the memory is degrading", WARNING, "reset"),
    94: XidMeaning("contained ECC error: an uncorrectable error confined to the process that hit it", CRITICAL, "restart"),
    95: XidMeaning("uncontained ECC error: an uncorrectable error that may have reached other processes", CRITICAL, "reset"),
    119: XidMeaning("GSP RPC timeout: the GPU System Processor stopped answering the driver", CRITICAL, "reset"),
    120: XidMeaning("GSP error: the GPU System Processor firmware reported an error", CRITICAL, "reset"),
}


def xid_meaning(xid: int) -> XidMeaning:
    return XIDS.get(xid, XidMeaning("see NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors)", WARNING, "reset"))


@dataclass(frozen=True)
class HealthEvent:
    """One thing that went wrong with a GPU: ``kind`` names it (``xid``, ``ecc_uncorrected``, ``row_remap_pending``,
    ...), ``message`` says it in one line, ``fix`` what to do; ``severity`` is ``warning`` or ``critical``."""

    gpu: int
    kind: str
    severity: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def xid_event(gpu: int, xid: int) -> HealthEvent:
    known = xid_meaning(xid)
    return HealthEvent(gpu, "xid", known.severity, f"GPU {gpu}: XID {xid}, {known.meaning}", _FIXES[known.action](gpu))


# -- reading -----------------------------------------------------------------------------------------------------
_REMAP_FIELDS = ("remapped_rows_corrected", "remapped_rows_uncorrected", "row_remap_pending", "row_remap_failed")

# One NVML question each, answering one or more GpuHealth fields. A GPU that refuses one (NotSupported) keeps None.
QUERIES: dict[str, Callable[[NvmlBackend, Any], dict[str, Any]]] = {
    "ecc_corrected_volatile": lambda b, h: {"ecc_corrected_volatile": b.ecc_error_count(h, False, False)},
    "ecc_uncorrected_volatile": lambda b, h: {"ecc_uncorrected_volatile": b.ecc_error_count(h, True, False)},
    "ecc_corrected_aggregate": lambda b, h: {"ecc_corrected_aggregate": b.ecc_error_count(h, False, True)},
    "ecc_uncorrected_aggregate": lambda b, h: {"ecc_uncorrected_aggregate": b.ecc_error_count(h, True, True)},
    "retired_pages_single_bit": lambda b, h: {"retired_pages_single_bit": b.retired_page_count(h, False)},
    "retired_pages_double_bit": lambda b, h: {"retired_pages_double_bit": b.retired_page_count(h, True)},
    "retired_pages_pending": lambda b, h: {"retired_pages_pending": b.retired_pages_pending(h)},
    "remapped_rows": lambda b, h: dict(zip(_REMAP_FIELDS, b.remapped_rows(h))),
    "pcie_replays": lambda b, h: {"pcie_replays": b.pcie_replay_count(h)},
}


def _ask(query: Callable[[], Any], lost: list[bool] | None = None) -> Any:
    """One NVML question; None when refused or failed (a lost GPU is noted in ``lost``, other failures logged)."""
    try:
        return query()
    except NvmlFailure as failure:
        if failure.kind == GPU_IS_LOST and lost is not None:
            lost.append(True)
        elif failure.kind not in UNKNOWN_VALUE_KINDS:
            log.debug("NVML health query failed: %s", failure)
        return None


def read_active_nvlinks(backend: NvmlBackend, handle: Any) -> list[int] | None:
    """The NVLinks that are up, None on a GPU without NVLink."""
    return _ask(lambda: backend.active_nvlinks(handle))


def read_health(backend: NvmlBackend, handle: Any, queries: list[str] | None = None,
                nvlinks: list[int] | None | bool = True, lost: list[bool] | None = None) -> GpuHealth:
    """One reading of a GPU's health (``xids`` is None: XIDs are events, read by ``XidListener``).

    ``queries``: the names in ``QUERIES`` to ask (all when None); ``nvlinks``: the active links (True: find them now,
    None: the GPU has no NVLink). A field the GPU or driver refuses stays None; nothing here raises.
    """
    values: dict[str, Any] = {}
    for name in QUERIES if queries is None else queries:
        answer = _ask(lambda q=QUERIES[name]: q(backend, handle), lost)
        if answer is not None:
            values.update(answer)
    links = read_active_nvlinks(backend, handle) if nvlinks is True else nvlinks
    if links is not None:
        counts = []
        for link in links:
            got = _ask(lambda link=link: backend.nvlink_error_counts(handle, link), lost)
            if got is not None:
                counts.append(NvLinkErrorCounts(link, *got))
        values["nvlink_errors"] = tuple(counts)
    return GpuHealth(**values)


class XidListener:
    """The NVML event set that receives XID critical errors from the GPUs in ``handles`` ({NVML index: handle}).

    Created once (registering is the expensive part), read without waiting: ``drain()`` returns what the driver
    queued since the last call. ``registered``: the GPUs whose XIDs it receives (a GPU or driver without event
    support is left out, and an NVML without event sets leaves it empty).
    """

    def __init__(self, backend: NvmlBackend, handles: dict[int, Any]):
        self.backend = backend
        self.registered: set[int] = set()
        self._set = _ask(backend.xid_event_set)
        if self._set is None:
            return
        for index, handle in handles.items():
            with contextlib.suppress(NvmlFailure):
                backend.register_xid_events(handle, self._set)
                self.registered.add(index)

    def drain(self, limit: int = 256) -> list[tuple[int, int]]:
        """(NVML index, XID) of every event pending now, oldest first (at most ``limit``: a GPU flooding XID 13
        must not hold the sampler)."""
        events: list[tuple[int, int]] = []
        while self._set is not None and len(events) < limit:
            event = _ask(lambda: self.backend.next_xid_event(self._set))
            if event is None:
                break
            events.append(event)
        return events

    def close(self) -> None:
        if self._set is not None:
            _ask(lambda: self.backend.free_event_set(self._set))
            self._set = None


# -- what changed ------------------------------------------------------------------------------------------------
def _rose(before: int | None, after: int | None) -> int:
    return after - before if before is not None and after is not None and after > before else 0


def changes(gpu: int, before: GpuHealth, after: GpuHealth) -> list[HealthEvent]:
    """What got worse between two readings of GPU ``gpu``: each as an event with its fix."""
    events = []
    dbe = _rose(before.ecc_uncorrected_volatile, after.ecc_uncorrected_volatile) or _rose(
        before.ecc_uncorrected_aggregate, after.ecc_uncorrected_aggregate)
    if dbe:
        events.append(HealthEvent(gpu, "ecc_uncorrected", CRITICAL, f"GPU {gpu}: {dbe} new uncorrectable (double-bit) ECC "
                                  "error(s): the memory returned wrong data, the process using it fails", reset_fix(gpu)))
    sbe = _rose(before.ecc_corrected_volatile, after.ecc_corrected_volatile) or _rose(
        before.ecc_corrected_aggregate, after.ecc_corrected_aggregate)
    if sbe:
        events.append(HealthEvent(gpu, "ecc_corrected", WARNING, f"GPU {gpu}: {sbe} new corrected (single-bit) ECC "
                                  "error(s): corrected, but a rising count means degrading memory", reset_fix(gpu)))
    retired = (_rose(before.retired_pages_single_bit, after.retired_pages_single_bit)
               + _rose(before.retired_pages_double_bit, after.retired_pages_double_bit))
    total = (after.retired_pages_single_bit or 0) + (after.retired_pages_double_bit or 0)
    if retired and total >= RETIRED_PAGES_LIMIT:
        events.append(HealthEvent(gpu, "retired_pages_limit", CRITICAL, f"GPU {gpu}: {total} pages retired (limit "
                                  f"{RETIRED_PAGES_LIMIT}): the GPU is running out of memory it can take out of use",
                                  drain_fix(gpu)))
    elif retired or (after.retired_pages_pending and before.retired_pages_pending is False):
        events.append(HealthEvent(gpu, "retired_pages_pending", WARNING, f"GPU {gpu}: memory page(s) retired for ECC errors "
                                  f"({total} in all); still in use until the GPU is reset", reset_fix(gpu)))
    if after.row_remap_failed and before.row_remap_failed is False:
        events.append(HealthEvent(gpu, "row_remap_failed", CRITICAL, f"GPU {gpu}: row remapping failed: a memory bank "
                                  "has no spare row left", drain_fix(gpu)))
    elif after.row_remap_pending and before.row_remap_pending is False:
        events.append(HealthEvent(gpu, "row_remap_pending", WARNING, f"GPU {gpu}: a failing memory row is marked for "
                                  "remapping; the spare row takes over at the next GPU reset", reset_fix(gpu)))
    replays = _rose(before.pcie_replays, after.pcie_replays)
    if replays:
        events.append(HealthEvent(gpu, "pcie_replays", WARNING, f"GPU {gpu}: {replays} PCIe replay(s) (packets sent "
                                  f"again, {after.pcie_replays} since boot): a marginal PCIe link", reseat_fix(gpu)))
    links = _nvlink_rises(before.nvlink_errors, after.nvlink_errors)
    if links:
        events.append(HealthEvent(gpu, "nvlink_errors", WARNING, f"GPU {gpu}: NVLink errors rose: {links}", nvlink_fix(gpu)))
    return events


def _nvlink_rises(before: tuple[NvLinkErrorCounts, ...] | None, after: tuple[NvLinkErrorCounts, ...] | None) -> str:
    if before is None or after is None:
        return ""
    old = {c.link: c for c in before}
    parts = []
    for now in after:
        was = old.get(now.link)
        if was is None:
            continue
        rose = [f"+{_rose(getattr(was, name), getattr(now, name))} {label}"
                for name, label in (("replay", "replay"), ("recovery", "recovery"), ("crc_flit", "CRC flit"),
                                    ("crc_data", "CRC data")) if _rose(getattr(was, name), getattr(now, name))]
        if rose:
            parts.append(f"link {now.link} " + ", ".join(rose))
    return "; ".join(parts)


def _keep_known(before: GpuHealth, after: GpuHealth) -> GpuHealth:
    """``after``, with the fields it failed to read this time taken from ``before`` (a field that failed once must
    not come back later as "new")."""
    return replace(after, **{f.name: getattr(before, f.name) for f in fields(after) if getattr(after, f.name) is None})


class HealthWatch:
    """What changed in the health of the GPUs ``handles`` ({NVML index: handle}) since the last ``poll()``.

    The constructor takes the baseline (XIDs already queued and counts already there are history, not news). Each
    kind of event is said once per GPU (an XID once per number): a counter that keeps rising is one finding, and
    a sampler thread calling every few seconds must not repeat it. ``seen`` keeps every event said so far, for the
    summaries written when a run ends. The backend must be initialised; nothing here raises.
    """

    def __init__(self, backend: NvmlBackend, handles: dict[int, Any]):
        self.backend, self.handles = backend, dict(handles)
        self.seen: list[HealthEvent] = []
        self._said: set[tuple[int, str]] = set()
        self._xids = XidListener(backend, self.handles)
        self._xids.drain()
        self._queries: dict[int, list[str]] = {}
        self._links: dict[int, list[int] | None] = {}
        self._last: dict[int, GpuHealth] = {}
        self._throttle: dict[int, set[str]] = {}
        for index, handle in self.handles.items():
            self._queries[index] = [name for name in QUERIES if self._supported(QUERIES[name], handle)]
            self._links[index] = read_active_nvlinks(backend, handle)
            self._last[index] = read_health(backend, handle, self._queries[index], self._links[index])
            self._throttle[index] = set(self._throttle_reasons(handle))

    def _supported(self, query: Callable[[NvmlBackend, Any], Any], handle: Any) -> bool:
        """Whether the GPU answers ``query`` at all (one it refuses is not asked again every poll)."""
        try:
            query(self.backend, handle)
            return True
        except NvmlFailure as failure:
            return failure.kind not in UNKNOWN_VALUE_KINDS

    def _throttle_reasons(self, handle: Any) -> tuple[str, ...]:
        mask = _ask(lambda: self.backend.clock_event_reasons(handle))
        return tuple(r for r in clock_event_reason_names(mask) if r in THROTTLE_REASONS)

    def poll(self) -> list[HealthEvent]:
        """The events since the last call (or since the baseline), each said once."""
        found = [xid_event(index, xid) for index, xid in self._xids.drain()]
        for index, handle in self.handles.items():
            lost: list[bool] = []
            now = read_health(self.backend, handle, self._queries[index], self._links[index], lost=lost)
            if lost:
                found.append(HealthEvent(index, "gpu_lost", CRITICAL, f"GPU {index}: NVML says the GPU is lost (fallen "
                                         "off the bus, XID 79)", drain_fix(index)))
                continue
            found += changes(index, self._last[index], now)
            self._last[index] = _keep_known(self._last[index], now)
            throttled = set(self._throttle_reasons(handle))
            for reason in sorted(throttled - self._throttle[index]):
                found.append(HealthEvent(index, f"throttle_{reason}", WARNING, f"GPU {index}: clocks held back by "
                                         f"{reason} ({_THROTTLE_MEANING[reason]})", cooling_fix(index)))
            self._throttle[index] |= throttled
        events = []
        for event in found:
            key = (event.gpu, event.message if event.kind == "xid" else event.kind)
            if key not in self._said:
                self._said.add(key)
                events.append(event)
        self.seen += events
        return events

    def poll_json(self) -> list[dict[str, Any]]:
        """``poll()`` as JSON-able dicts {"gpu", "kind", "severity", "message", "fix"}: for the telemetry sampler."""
        return [event.to_dict() for event in self.poll()]

    def close(self) -> None:
        self._xids.close()


_THROTTLE_MEANING = {
    "HwSlowdown": "hardware slowdown: the board's power brake or overheating signal",
    "SwThermalSlowdown": "the driver lowers clocks to stay under the temperature limit",
    "HwThermalSlowdown": "hardware thermal slowdown: the GPU is too hot",
    "HwPowerBrakeSlowdown": "external power brake: the power supply or chassis asked the GPU to slow down",
}
