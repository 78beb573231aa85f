"""An NVML backend that answers from a ``HardwareProfile`` (usually a snapshot).

It lets every decision, check and callback run on a machine without a GPU, and it exercises the
real detection code: snapshot -> FakeNvmlBackend -> detect() -> the same snapshot. Failures are
injected by name, the way a driver would produce them::

    FakeNvmlBackend(profile, init_failure="driver_not_loaded")
    FakeNvmlBackend(profile, failures={"power_limit_mw": "not_supported"})

``series`` replays changing values (utilization, power, clocks, ...) for telemetry tests:
``series={"utilization_pct": [(10, 5), (95, 40)]}`` answers each call with the next item and
keeps the last one; ``{"temperature_c": {0: [60, 85], 1: [60]}}`` gives each GPU its own.

GPU health comes from each GPU's ``health`` in the snapshot (a field that is None there, or no health at all,
answers NotSupported, as a GPU without ECC, row remapping or NVLink would). A test changes it between two
readings with ``set_health(index, pcie_replays=12)``, and makes the driver report an XID with
``inject_xid(index, 79)``. The XIDs a snapshot recorded are queued on every event set when it registers the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .backend import NOT_SUPPORTED, NvmlFailure
from .profile import CLOCK_EVENT_REASON_BITS, P2P_STATUS_NAMES, TOPOLOGY_LEVELS, GpuHealth, HardwareProfile, MigInstance

_LEVEL_BY_NAME = {name: level for level, name in TOPOLOGY_LEVELS.items()}
_P2P_BY_NAME = {name: code for code, name in P2P_STATUS_NAMES.items()}
_REASON_BIT = {name: bit for bit, name in CLOCK_EVENT_REASON_BITS.items()}
_SWITCH_BUS_ID = "0000:ff:00.0"  # where a fake NVSwitch sits; any id no GPU uses


class FakeNvmlBackend:
    def __init__(
        self,
        profile: HardwareProfile,
        init_failure: str | None = None,
        failures: dict[str, str] | None = None,
        series: dict[str, Any] | None = None,
    ):
        self.profile = profile
        self.init_failure = init_failure
        self.failures = dict(failures or {})
        self.series = dict(series or {})
        self.calls: dict[str, int] = {}
        self._served: dict[tuple[str, int], int] = {}
        self.initialised = False
        self.health: dict[int, GpuHealth | None] = {h: gpu.health for h, gpu in enumerate(profile.gpus)}
        self.event_sets: list[FakeEventSet] = []
        if profile.nvml_error and init_failure is None:
            self.init_failure = "library_not_found"

    # -- plumbing -------------------------------------------------------------------------
    def _check(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method != "init" and not self.initialised:
            raise NvmlFailure("uninitialized", "NVML not initialised")
        kind = self.failures.get(method)
        if kind:
            raise NvmlFailure(kind, f"{method}: {kind} (injected)")

    def _value(self, method: str, handle: int, default: Any) -> Any:
        """The next value of an injected series for this GPU, else the snapshot's value."""
        values = self.series.get(method)
        if isinstance(values, dict):
            values = values.get(handle)
        if not values:
            if default is None:
                raise NvmlFailure(NOT_SUPPORTED, f"{method}: unknown in snapshot")
            return default
        key = (method, handle)
        served = self._served.get(key, 0)
        self._served[key] = served + 1
        return values[min(served, len(values) - 1)]

    def _gpu(self, handle: int):
        return self.profile.gpus[handle]

    # -- NvmlBackend ---------------------------------------------------------------------
    def init(self) -> None:
        self._check("init")
        if self.init_failure:
            raise NvmlFailure(self.init_failure, f"nvmlInit: {self.init_failure} (injected)")
        self.initialised = True

    def shutdown(self) -> None:
        self._check("shutdown")
        self.initialised = False

    def driver_version(self) -> str:
        self._check("driver_version")
        if self.profile.driver_version is None:
            raise NvmlFailure(NOT_SUPPORTED)
        return self.profile.driver_version

    def cuda_driver_version(self) -> int:
        self._check("cuda_driver_version")
        if self.profile.cuda_driver_version is None:
            raise NvmlFailure(NOT_SUPPORTED)
        major, minor = self.profile.cuda_driver_version.split(".")
        return int(major) * 1000 + int(minor) * 10

    def device_count(self) -> int:
        self._check("device_count")
        return len(self.profile.gpus)

    def handle(self, index: int) -> int:
        self._check("handle")
        if not 0 <= index < len(self.profile.gpus):
            raise NvmlFailure("invalid_argument", f"no GPU {index}")
        return index

    def name(self, h: int) -> str:
        self._check("name")
        return self._gpu(h).name

    def uuid(self, h: int) -> str:
        self._check("uuid")
        return self._gpu(h).uuid

    def pci_bus_id(self, h: int) -> str:
        self._check("pci_bus_id")
        return self._gpu(h).pci_bus_id

    def memory_info(self, h: int) -> tuple[int, int]:
        self._check("memory_info")
        gpu = self._gpu(h)
        used = self._value("memory_info_used", h, gpu.memory_used_bytes or 0)
        return gpu.memory_total_bytes, used

    def compute_capability(self, h: int) -> tuple[int, int]:
        self._check("compute_capability")
        return self._value("compute_capability", h, self._gpu(h).compute_capability)

    def power_limit_mw(self, h: int) -> int:
        self._check("power_limit_mw")
        watts = self._gpu(h).power_limit_w
        return self._value("power_limit_mw", h, None if watts is None else round(watts * 1000))

    def power_usage_mw(self, h: int) -> int:
        self._check("power_usage_mw")
        return self._value("power_usage_mw", h, None)

    def mig_mode(self, h: int) -> tuple[bool, bool]:
        """(now, after the next reset); a snapshot without the pending mode answers "no change"."""
        self._check("mig_mode")
        gpu = self._gpu(h)
        pending = gpu.mig_enabled if gpu.mig_pending_enabled is None else gpu.mig_pending_enabled
        return self._value("mig_mode", h, None if gpu.mig_enabled is None else (gpu.mig_enabled, pending))

    def mig_devices(self, h: int) -> list[MigInstance]:
        self._check("mig_devices")
        instances = self._gpu(h).mig_instances
        if instances is None:
            raise NvmlFailure(NOT_SUPPORTED, "mig_devices: not recorded in snapshot")
        return list(instances)

    def display_active(self, h: int) -> bool:
        self._check("display_active")
        return self._value("display_active", h, self._gpu(h).display_active)

    def numa_node(self, h: int) -> int:
        self._check("numa_node")
        return self._value("numa_node", h, self._gpu(h).numa_node)

    def cpu_affinity(self, h: int) -> str:
        self._check("cpu_affinity")
        return self._value("cpu_affinity", h, self._gpu(h).cpu_affinity)

    def compute_processes(self, h: int) -> list[tuple[int, int | None]]:
        self._check("compute_processes")
        return [(p.pid, p.used_memory_bytes) for p in self._gpu(h).processes]

    def process_name(self, pid: int) -> str:
        self._check("process_name")
        for gpu in self.profile.gpus:
            for proc in gpu.processes:
                if proc.pid == pid and proc.name is not None:
                    return proc.name
        raise NvmlFailure(NOT_SUPPORTED, f"no name for pid {pid}")

    def nvlink_remotes(self, h: int) -> list[tuple[str, bool]]:
        """Synthesised from the snapshot: direct links to peers, then the switch links."""
        self._check("nvlink_remotes")
        gpu = self._gpu(h)
        remotes: list[tuple[str, bool]] = []
        for pair in self.profile.pairs:
            if gpu.index not in (pair.a, pair.b):
                continue
            peer = self.profile.gpu(pair.b if pair.a == gpu.index else pair.a)
            switched = min(gpu.nvswitch_links, peer.nvswitch_links) if gpu.nvswitch_links and peer.nvswitch_links else 0
            remotes += [(peer.pci_bus_id, False)] * (pair.nvlinks - switched)
        remotes += [(_SWITCH_BUS_ID, True)] * gpu.nvswitch_links
        return remotes

    def _pair(self, h1: int, h2: int):
        pair = self.profile.pair(self._gpu(h1).index, self._gpu(h2).index)
        if pair is None:
            raise NvmlFailure(NOT_SUPPORTED, "pair not in snapshot")
        return pair

    def topology_common_ancestor(self, h1: int, h2: int) -> int:
        self._check("topology_common_ancestor")
        topology = self._pair(h1, h2).topology
        if topology is None:
            raise NvmlFailure(NOT_SUPPORTED)
        return _LEVEL_BY_NAME[topology]

    def p2p_status(self, h1: int, h2: int, capability: str) -> int:
        self._check("p2p_status")
        pair = self._pair(h1, h2)
        status = pair.p2p_read if capability == "read" else pair.p2p_write
        if status is None:
            raise NvmlFailure(NOT_SUPPORTED)
        return _P2P_BY_NAME.get(status, 6)

    def clock_event_reasons(self, h: int) -> int:
        self._check("clock_event_reasons")
        mask = sum(_REASON_BIT[name] for name in self._gpu(h).clock_event_reasons)
        return self._value("clock_event_reasons", h, mask)

    def sm_clock_mhz(self, h: int) -> int:
        self._check("sm_clock_mhz")
        return self._value("sm_clock_mhz", h, self._gpu(h).sm_clock_mhz)

    def sm_clock_max_mhz(self, h: int) -> int:
        self._check("sm_clock_max_mhz")
        return self._value("sm_clock_max_mhz", h, self._gpu(h).sm_clock_max_mhz)

    def temperature_c(self, h: int) -> int:
        self._check("temperature_c")
        return self._value("temperature_c", h, self._gpu(h).temperature_c)

    def utilization_pct(self, h: int) -> tuple[int, int]:
        self._check("utilization_pct")
        gpu_pct = self._gpu(h).utilization_pct
        return self._value("utilization_pct", h, None if gpu_pct is None else (gpu_pct, 0))

    def pcie_link(self, h: int) -> tuple[int, int]:
        self._check("pcie_link")
        gpu = self._gpu(h)
        default = None if gpu.pcie_link_gen is None else (gpu.pcie_link_gen, gpu.pcie_link_width)
        return self._value("pcie_link", h, default)

    # -- GPU health --------------------------------------------------------------------------
    def set_health(self, h: int, **changes: Any) -> None:
        """The GPU's health fields from now on (a counter that rose, a remap now pending)."""
        self.health[h] = replace(self.health[h] or GpuHealth(), **changes)

    def inject_xid(self, h: int, xid: int) -> None:
        """The driver reports XID ``xid`` on GPU ``h``: every event set that registered it receives it."""
        for event_set in self.event_sets:
            if h in event_set.handles and not event_set.freed:
                event_set.pending.append((self._gpu(h).index, xid))

    def _health(self, method: str, h: int, field: str) -> Any:
        self._check(method)
        value = getattr(self.health[h], field) if self.health[h] is not None else None
        if value is None:
            raise NvmlFailure(NOT_SUPPORTED, f"{method}: not supported on {self._gpu(h).name} (snapshot)")
        return value

    def ecc_error_count(self, h: int, uncorrected: bool, aggregate: bool) -> int:
        field = f"ecc_{'uncorrected' if uncorrected else 'corrected'}_{'aggregate' if aggregate else 'volatile'}"
        return self._health("ecc_error_count", h, field)

    def retired_page_count(self, h: int, double_bit: bool) -> int:
        return self._health("retired_page_count", h, "retired_pages_double_bit" if double_bit else "retired_pages_single_bit")

    def retired_pages_pending(self, h: int) -> bool:
        return self._health("retired_pages_pending", h, "retired_pages_pending")

    def remapped_rows(self, h: int) -> tuple[int, int, bool, bool]:
        return (self._health("remapped_rows", h, "remapped_rows_corrected"), self._health("remapped_rows", h, "remapped_rows_uncorrected"),
                self._health("remapped_rows", h, "row_remap_pending"), self._health("remapped_rows", h, "row_remap_failed"))

    def pcie_replay_count(self, h: int) -> int:
        return self._health("pcie_replay_count", h, "pcie_replays")

    def active_nvlinks(self, h: int) -> list[int]:
        return [c.link for c in self._health("active_nvlinks", h, "nvlink_errors")]

    def nvlink_error_counts(self, h: int, link: int) -> tuple[int, int, int, int]:
        for c in self._health("nvlink_error_counts", h, "nvlink_errors"):
            if c.link == link:
                return c.replay, c.recovery, c.crc_flit, c.crc_data
        raise NvmlFailure("invalid_argument", f"link {link} is not active")

    def xid_event_set(self) -> FakeEventSet:
        self._check("xid_event_set")
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def register_xid_events(self, h: int, event_set: FakeEventSet) -> None:
        xids = self._health("register_xid_events", h, "xids")
        event_set.handles.add(h)
        event_set.pending += [(self._gpu(h).index, xid) for xid in xids]

    def next_xid_event(self, event_set: FakeEventSet) -> tuple[int, int] | None:
        self._check("next_xid_event")
        if event_set.freed:
            raise NvmlFailure("invalid_argument", "event set freed")
        return event_set.pending.pop(0) if event_set.pending else None

    def free_event_set(self, event_set: FakeEventSet) -> None:
        self._check("free_event_set")
        event_set.freed = True


class FakeEventSet:
    """An NVML event set: the GPUs registered on it and the XIDs queued for it, oldest first."""

    def __init__(self) -> None:
        self.handles: set[int] = set()
        self.pending: list[tuple[int, int]] = []
        self.freed = False
