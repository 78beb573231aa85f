"""The frozen description of a machine that every decision in hf_gpu_train is made from.

Units live in the field names (``memory_total_bytes``, ``power_limit_w``) and ``None`` means
"unknown on this machine" (NVML said NotSupported, or the snapshot predates the field), never zero.
Nothing here touches NVML or torch: detection (``detect.py``) fills these, snapshots
(``snapshot.py``) persist them, decisions read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Compute capability thresholds. bf16 tensor cores arrived with Ampere (8.0); fp8 with Ada/Hopper
# (8.9 / 9.0). We decide from the capability, not from ``torch.cuda.is_bf16_supported()``, which
# defaults to ``including_emulation=True`` and answers True on a T4 (REFERENCE.md, accelerate section).
BF16_MIN_CAPABILITY = (8, 0)
FP8_MIN_CAPABILITY = (8, 9)

# NVML clocks-event ("throttle") reason bits, nvml.h nvmlClocksEventReasons.
CLOCK_EVENT_REASON_BITS = {
    0x1: "GpuIdle",
    0x2: "ApplicationsClocksSetting",
    0x4: "SwPowerCap",
    0x8: "HwSlowdown",
    0x10: "SyncBoost",
    0x20: "SwThermalSlowdown",
    0x40: "HwThermalSlowdown",
    0x80: "HwPowerBrakeSlowdown",
    0x100: "DisplayClockSetting",
}

# NVML topology common-ancestor levels mapped to the ``nvidia-smi topo -m`` legend.
TOPOLOGY_LEVELS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_ORDER = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")

# NVML P2P status codes (nvmlGpuP2PStatus_t).
P2P_STATUS_NAMES = {
    0: "OK",
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by regkey",
    5: "not supported",
    6: "unknown",
}


def cpulist(cpus: list[int] | tuple[int, ...]) -> str:
    """CPU ids in Linux cpulist notation: [0, 1, 2, 5] -> "0-2,5"."""
    ranges: list[str] = []
    ids = sorted(set(cpus))
    start = prev = None
    for cpu in ids + [None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(ranges)


def parse_cpulist(text: str | None) -> tuple[int, ...]:
    """"0-2,5" -> (0, 1, 2, 5)."""
    cpus: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def clock_event_reason_names(mask: int | None) -> tuple[str, ...]:
    """Names of the reason bits set in an NVML clocks-event mask, lowest bit first."""
    if not mask:
        return ()
    return tuple(name for bit, name in sorted(CLOCK_EVENT_REASON_BITS.items()) if mask & bit)


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on a GPU (ours or somebody else's)."""

    pid: int
    name: str | None
    used_memory_bytes: int | None


@dataclass(frozen=True)
class MigInstance:
    """One MIG device of a GPU in MIG mode: what CUDA sees instead of the whole GPU.

    A training process runs on one instance (``CUDA_VISIBLE_DEVICES=<uuid>``) and can use only the
    instance's memory, a fraction of the GPU's; NCCL cannot join instances into one group.
    ``index`` is the MIG device index within its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``).
    """

    index: int
    uuid: str  # "MIG-..." (drivers >= R470), what CUDA_VISIBLE_DEVICES takes
    name: str  # e.g. "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    memory_total_bytes: int
    memory_used_bytes: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def profile(self) -> str:
        """The MIG profile from the device name ("3g.40gb"), or the whole name when it has none."""
        _, sep, rest = self.name.rpartition("MIG ")
        return rest.strip() if sep else self.name

    @property
    def memory_free_bytes(self) -> int:
        return self.memory_total_bytes - (self.memory_used_bytes or 0)


@dataclass(frozen=True)
class NvLinkErrorCounts:
    """One active NVLink's data-link error counters (``nvmlDeviceGetNvLinkErrorCounter``), counted since the driver
    loaded or the counters were reset. Replays and recoveries are the link repairing itself; CRC errors are damaged
    flits or data the link had to send again."""

    link: int
    replay: int = 0
    recovery: int = 0
    crc_flit: int = 0
    crc_data: int = 0

    @property
    def total(self) -> int:
        return self.replay + self.recovery + self.crc_flit + self.crc_data


@dataclass(frozen=True)
class GpuHealth:
    """What NVML says about a GPU's own soundness: memory errors and their repairs, the bus, the links, XIDs.

    Every field is ``None`` when this GPU or driver does not tell (NVML NotSupported / FunctionNotFound): GeForce
    boards have no ECC, GPUs before Ampere no row remapping, Ampere and later no page retirement (they remap rows),
    PCIe boards no NVLink. ``hardware/health.py`` reads it and judges it; the doctor and the fault summaries say it.

    ECC counts are NVML's totals: *volatile* since the driver loaded (the last reboot or GPU reset), *aggregate*
    over the board's life (kept in its InfoROM); *corrected* are single-bit errors, *uncorrected* double-bit ones.
    """

    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    # Page retirement (Kepler..Volta, Turing): pages taken out of use for repeated single-bit or a double-bit error;
    # ``retired_pages_pending``: retired but still in use until the GPU is reset.
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    # Row remapping (Ampere and later): spare DRAM rows replacing failing ones; a remap applies at the next GPU
    # reset (``row_remap_pending``); ``row_remap_failed``: a bank ran out of spare rows.
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    pcie_replays: int | None = None  # PCIe packets the link had to send again (``nvmlDeviceGetPcieReplayCounter``)
    nvlink_errors: tuple[NvLinkErrorCounts, ...] | None = None  # one entry per active NVLink
    # XID critical errors NVML delivered through an event set while the GPU was watched (a snapshot: while
    # detecting; the driver's log keeps older ones: `dmesg | grep -i xid`). None: event sets not supported here.
    xids: tuple[int, ...] | None = None

    @property
    def known(self) -> bool:
        """Whether NVML told anything at all (a snapshot before health fields, or a GPU that supports none: no)."""
        return any(getattr(self, f) is not None for f in self.__dataclass_fields__)


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML sees it. ``index`` is the NVML index, which is NOT the CUDA index
    unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: match devices by ``pci_bus_id`` or ``uuid``."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_bytes: int
    memory_used_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    power_limit_w: float | None = None
    mig_enabled: bool | None = None  # MIG mode now
    # MIG mode after the next GPU reset (``nvmlDeviceGetMigMode``'s pending value): differs from
    # ``mig_enabled`` after `nvidia-smi -mig` until the GPU is reset or the machine rebooted.
    mig_pending_enabled: bool | None = None
    # The MIG devices of a GPU in MIG mode; () when MIG is on but no instance exists (CUDA then sees
    # no device here); None when not in MIG mode or not recorded (snapshots before version 2).
    mig_instances: tuple[MigInstance, ...] | None = None
    display_active: bool | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None  # Linux cpulist notation, e.g. "0-55,112-167"
    processes: tuple[GpuProcess, ...] = ()
    nvswitch_links: int = 0
    clock_event_reasons: tuple[str, ...] = ()
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    temperature_c: int | None = None
    utilization_pct: int | None = None
    pcie_link_gen: int | None = None
    pcie_link_width: int | None = None
    # ECC, retired pages, remapped rows, PCIe replays, NVLink errors, XIDs; None: not recorded (snapshots before
    # version 3) or nothing supported.
    health: GpuHealth | None = None

    @property
    def bf16_supported(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= BF16_MIN_CAPABILITY

    @property
    def fp8_supported(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= FP8_MIN_CAPABILITY

    @property
    def fp16_supported(self) -> bool:
        """fp16 tensor cores arrived with Volta (7.0); older cards run fp16 but slowly."""
        return self.compute_capability is not None and self.compute_capability >= (7, 0)

    @property
    def mig_change_pending(self) -> bool:
        """MIG mode was changed but the GPU not reset yet: the mode flips at the next reset or reboot."""
        return (self.mig_enabled is not None and self.mig_pending_enabled is not None
                and self.mig_enabled != self.mig_pending_enabled)

    @property
    def cpus(self) -> tuple[int, ...]:
        """CPU ids close to this GPU (NVML's CPU affinity), () when unknown."""
        return parse_cpulist(self.cpu_affinity)

    @property
    def memory_free_bytes(self) -> int:
        return self.memory_total_bytes - (self.memory_used_bytes or 0)

    @property
    def memory_total_gib(self) -> float:
        return self.memory_total_bytes / 2**30

    @property
    def other_processes_memory_bytes(self) -> int:
        return sum(p.used_memory_bytes or 0 for p in self.processes)

    @property
    def capability_str(self) -> str:
        return "?" if self.compute_capability is None else f"{self.compute_capability[0]}.{self.compute_capability[1]}"


@dataclass(frozen=True)
class GpuPair:
    """How two GPUs reach each other. ``a < b`` are NVML indices.

    ``topology`` is the PCIe common ancestor in ``nvidia-smi topo -m`` notation (PIX, PXB, PHB,
    NODE, SYS); ``nvlinks`` is the number of active NVLinks between them (through an NVSwitch
    counts: every GPU on the switch fabric reaches every other). P2P statuses are NVML's words.
    """

    a: int
    b: int
    topology: str | None
    nvlinks: int = 0
    p2p_read: str | None = None
    p2p_write: str | None = None

    @property
    def p2p_ok(self) -> bool:
        return self.p2p_read == "OK" and self.p2p_write == "OK"

    @property
    def p2p_problem(self) -> str | None:
        """NVML's reason when P2P does not work on this pair (read or write), None when it does."""
        if self.p2p_ok:
            return None
        return (self.p2p_read if self.p2p_read != "OK" else self.p2p_write) or "unknown"

    @property
    def path(self) -> str | None:
        """The fastest path between the two GPUs in NCCL's words: NVL over NVLink, else the PCIe level."""
        return "NVL" if self.nvlinks else self.topology

    @property
    def label(self) -> str:
        """The ``nvidia-smi topo -m`` cell for this pair: NV# wins over the PCIe path."""
        if self.nvlinks:
            return f"NV{self.nvlinks}"
        return self.topology or "?"


@dataclass(frozen=True)
class HostInfo:
    hostname: str
    cpu_model: str | None = None
    physical_cores: int | None = None
    logical_cores: int | None = None
    numa_nodes: int | None = None
    ram_total_bytes: int | None = None
    shm_total_bytes: int | None = None
    nvidia_pci_devices: int | None = None
    infiniband_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class SoftwareInfo:
    """Facts that need torch. Collected only on request (``detect --software``) and by the doctor."""

    python_version: str
    torch_version: str | None = None
    torch_cuda_build: str | None = None
    cudnn_version: int | None = None
    nccl_version: str | None = None
    cuda_available: bool | None = None
    cuda_device_count: int | None = None
    transformers_version: str | None = None
    accelerate_version: str | None = None


@dataclass(frozen=True)
class HardwareProfile:
    """Everything we know about one machine. ``nvml_error`` says why GPUs are missing or partial."""

    host: HostInfo
    gpus: tuple[GpuInfo, ...] = ()
    pairs: tuple[GpuPair, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_error: str | None = None
    software: SoftwareInfo | None = None
    name: str | None = None
    description: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def gpu(self, index: int) -> GpuInfo:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"no GPU with NVML index {index} (have {[g.index for g in self.gpus]})")

    def pair(self, a: int, b: int) -> GpuPair | None:
        lo, hi = sorted((a, b))
        for pair in self.pairs:
            if pair.a == lo and pair.b == hi:
                return pair
        return None

    @property
    def display_name(self) -> str:
        return self.name or self.host.hostname
