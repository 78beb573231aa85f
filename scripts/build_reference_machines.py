"""Write the reference machines shipped in ``hf_gpu_train/hardware/machines/``.

Run: ``python scripts/build_reference_machines.py``. ``tests/hardware/test_reference_machines.py``
fails when the committed JSON drifts from this file, so edit here, not the JSON. The same run writes the
test-only machines (odd boxes that should not ship) into ``tests/hardware/machines/``.

Sources for the values (memory as NVML reports it in MiB, compute capability, board power, max SM
clock, links): NVIDIA datasheets (T4, A100, H100, H200, RTX 3090, RTX 4090) and the
``nvidia-smi topo -m`` of DGX A100 / DGX H100 user guides (NV12 / NV18 on every pair through
NVSwitch), A100 PCIe NVLink-bridge guide (NV12 per bridged pair), GeForce RTX 3090 NVLink bridge
(NV4 per bridged pair). GeForce boards report P2P "chipset not supported" over PCIe
(nccl-tests #117, NVIDIA/nccl #1127).

DGX-1 (8x V100, hybrid cube mesh): the NV1/NV2 matrix and CPU affinities of NVIDIA's published
``nvidia-smi topo -m`` of a DGX-1 (each GPU has 6 NVLinks; GPUs 0-3 and 4-7 form fully linked quads on
one socket each, joined by 0-4, 1-5, 2-6, 3-7); the PCIe switches (GPUs 0-1, 2-3, 4-5, 6-7 behind one
PLX switch each, PIX) from the NIC columns of that output and the topology dump in NVIDIA/nccl #671
(GPU0 06:00.0 and GPU1 07:00.0 under PLX 03:00.0). MIG: profile names and memory as `nvidia-smi`
shows them on an A100-SXM4-80GB (two 3g.40gb instances, GPU instance ids 1 and 2, 40192 MiB each;
NVIDIA MIG user guide, "Supported MIG Profiles").

GPU health (NVML, what a healthy board reads): ECC counts zero on datacenter boards; GeForce boards have no ECC
(NotSupported: None); Tesla boards before Ampere (T4, V100) retire pages and have no row remapper, Ampere and later
(A100, H100, H200) remap rows and have no page retirement (NVIDIA's A100/H100 memory error management guide); one
NVLink error counter set per active link, none on boards without NVLink (T4, RTX 4090) and an empty list on boards
that have NVLink but no link up (an A100 PCIe without a bridge). XIDs: none while detecting.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.hardware import snapshot  # noqa: E402
from hf_gpu_train.hardware.profile import (  # noqa: E402
    GpuHealth,
    GpuInfo,
    GpuPair,
    GpuProcess,
    HardwareProfile,
    HostInfo,
    MigInstance,
    NvLinkErrorCounts,
    cpulist,
)

TEST_MACHINES_DIR = Path(__file__).resolve().parents[1] / "tests" / "hardware" / "machines"

MIB = 2**20
GIB = 2**30

# name, memory MiB, capability, board power W, max SM clock MHz, idle SM clock MHz, PCIe gen
GPU_MODELS = {
    "t4": ("Tesla T4", 15360, (7, 5), 70.0, 1590, 300, 3),
    "v100-sxm2-32": ("Tesla V100-SXM2-32GB", 32768, (7, 0), 300.0, 1530, 135, 3),
    "h200": ("NVIDIA H200", 143771, (9, 0), 700.0, 1980, 345, 5),
    "h100-sxm": ("NVIDIA H100 80GB HBM3", 81559, (9, 0), 700.0, 1980, 345, 5),
    "a100-sxm-80": ("NVIDIA A100-SXM4-80GB", 81920, (8, 0), 400.0, 1410, 210, 4),
    "a100-sxm-40": ("NVIDIA A100-SXM4-40GB", 40960, (8, 0), 400.0, 1410, 210, 4),
    "a100-pcie-80": ("NVIDIA A100 80GB PCIe", 81920, (8, 0), 300.0, 1410, 210, 4),
    "rtx4090": ("NVIDIA GeForce RTX 4090", 24564, (8, 9), 450.0, 3105, 210, 4),
    "rtx3090": ("NVIDIA GeForce RTX 3090", 24576, (8, 6), 350.0, 2100, 210, 4),
}


def gpu(index: int, model: str, bus: int, numa: int | None = 0, cpus: range = range(0), **extra) -> GpuInfo:
    name, mib, cc, watts, max_mhz, idle_mhz, gen = GPU_MODELS[model]
    mig = extra.pop("mig_enabled", False)
    return GpuInfo(
        index=index,
        name=name,
        uuid=f"GPU-{model}-{index:02d}-0000-0000-{bus:012x}",
        pci_bus_id=f"0000:{bus:02x}:00.0",
        memory_total_bytes=mib * MIB,
        memory_used_bytes=extra.pop("memory_used_bytes", 4 * MIB if model in ("h100-sxm", "h200") else 1 * MIB),
        compute_capability=cc,
        power_limit_w=watts,
        mig_enabled=mig,
        mig_pending_enabled=extra.pop("mig_pending_enabled", mig),
        display_active=extra.pop("display_active", False),
        numa_node=numa,
        cpu_affinity=cpulist(cpus) or None,
        clock_event_reasons=extra.pop("clock_event_reasons", ("GpuIdle",)),
        sm_clock_mhz=extra.pop("sm_clock_mhz", idle_mhz),
        sm_clock_max_mhz=max_mhz,
        temperature_c=extra.pop("temperature_c", 32),
        utilization_pct=extra.pop("utilization_pct", 0),
        pcie_link_gen=gen,
        pcie_link_width=16,
        **extra,
    )


def all_pairs(gpus, topology, nvlinks=lambda a, b: 0, p2p=lambda a, b: "OK") -> tuple[GpuPair, ...]:
    """Pairs for every GPU combination; each argument is a function of the two GpuInfo."""
    return tuple(
        GpuPair(a=a.index, b=b.index, topology=topology(a, b), nvlinks=nvlinks(a, b), p2p_read=p2p(a, b), p2p_write=p2p(a, b))
        for a, b in combinations(gpus, 2)
    )


def numa_topology(a: GpuInfo, b: GpuInfo) -> str:
    return "NODE" if a.numa_node == b.numa_node else "SYS"


def host(name: str, cpu: str, physical: int, logical: int, numa: int, ram_gib: int, shm_gib: float, gpus: int, ib=()) -> HostInfo:
    return HostInfo(
        hostname=name,
        cpu_model=cpu,
        physical_cores=physical,
        logical_cores=logical,
        numa_nodes=numa,
        ram_total_bytes=ram_gib * GIB,
        shm_total_bytes=int(shm_gib * GIB),
        nvidia_pci_devices=gpus,
        infiniband_devices=tuple(ib),
    )


# What a healthy board of each family reads (see the module docstring): ECC, page retirement, row remapping, NVLink.
ECC_ZERO = dict(ecc_corrected_volatile=0, ecc_uncorrected_volatile=0, ecc_corrected_aggregate=0, ecc_uncorrected_aggregate=0)
PAGE_RETIREMENT_ZERO = dict(retired_pages_single_bit=0, retired_pages_double_bit=0, retired_pages_pending=False)
ROW_REMAP_ZERO = dict(remapped_rows_corrected=0, remapped_rows_uncorrected=0, row_remap_pending=False, row_remap_failed=False)
HEALTH_BY_NAME = {  # GPU name -> (health fields, has NVLink)
    "Tesla T4": ({**ECC_ZERO, **PAGE_RETIREMENT_ZERO}, False),
    "Tesla V100-SXM2-32GB": ({**ECC_ZERO, **PAGE_RETIREMENT_ZERO}, True),
    "NVIDIA GeForce RTX 4090": ({}, False),
    "NVIDIA GeForce RTX 3090": ({}, True),
}


def healthy(gpu_info: GpuInfo, pairs) -> GpuHealth:
    """A healthy reading of ``gpu_info``: zero counts where its family has the counter, its active NVLinks."""
    counters, has_nvlink = HEALTH_BY_NAME.get(gpu_info.name, ({**ECC_ZERO, **ROW_REMAP_ZERO}, True))
    links = gpu_info.nvswitch_links or sum(p.nvlinks for p in pairs if gpu_info.index in (p.a, p.b))
    nvlinks = tuple(NvLinkErrorCounts(link) for link in range(links)) if has_nvlink else None
    return GpuHealth(**counters, pcie_replays=0, nvlink_errors=nvlinks, xids=())


def profile(name, description, host_info, gpus=(), pairs=(), driver="550.127.05", cuda="12.4", **extra) -> HardwareProfile:
    gpus = tuple(g if g.health is not None else replace(g, health=healthy(g, pairs)) for g in gpus)
    return HardwareProfile(
        host=host_info, gpus=gpus, pairs=tuple(pairs), driver_version=driver, cuda_driver_version=cuda,
        name=name, description=description, **extra,
    )


def machines() -> list[HardwareProfile]:
    out = []
    out.append(profile(
        "cpu-only", "A workstation or CI runner without an NVIDIA GPU",
        host("cpu-only", "AMD EPYC 7B13", 2, 2, 1, 24, 12, 0),
        driver=None, cuda=None,
        nvml_error="NVML library (libnvidia-ml.so.1) not found: the NVIDIA driver is not installed",
    ))

    t4 = [gpu(0, "t4", 0x04, cpus=range(8))]
    out.append(profile("1x-t4", "Cloud VM with one Tesla T4 (Turing, no bf16)",
                       host("1x-t4", "Intel(R) Xeon(R) CPU @ 2.20GHz", 4, 8, 1, 30, 15, 1), t4,
                       driver="535.183.01", cuda="12.2"))

    h200 = [gpu(0, "h200", 0x19, cpus=range(0, 32))]
    out.append(profile("1x-h200", "One H200 SXM (141 GB HBM3e) in a cloud VM",
                       host("1x-h200", "Intel(R) Xeon(R) Platinum 8480+", 16, 32, 1, 256, 128, 1), h200,
                       driver="570.124.06", cuda="12.8"))

    dgx_h100_cpus = [range(0, 56), range(56, 112)]
    h100 = [gpu(i, "h100-sxm", bus, numa=i // 4, cpus=dgx_h100_cpus[i // 4], nvswitch_links=18)
            for i, bus in enumerate([0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB])]
    out.append(profile("8x-h100-sxm", "DGX/HGX H100: 8x H100 SXM, NVSwitch (NV18 every pair), 8x ConnectX-7",
                       host("8x-h100-sxm", "Intel(R) Xeon(R) Platinum 8480C", 112, 224, 2, 2048, 1024, 8,
                            ib=[f"mlx5_{i}" for i in range(8)]),
                       h100, all_pairs(h100, numa_topology, nvlinks=lambda a, b: 18),
                       driver="550.127.05", cuda="12.4"))

    a100 = [gpu(i, "a100-sxm-80", bus, numa=i // 4, cpus=[range(0, 64), range(64, 128)][i // 4], nvswitch_links=12)
            for i, bus in enumerate([0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD])]

    def dgx_a100_topology(a, b):
        if a.index // 2 == b.index // 2:
            return "PXB"  # two GPUs behind one PCIe switch
        return numa_topology(a, b)

    out.append(profile("8x-a100-sxm-80gb", "DGX A100: 8x A100 SXM4 80GB, NVSwitch (NV12 every pair), 8x ConnectX-6",
                       host("8x-a100-sxm-80gb", "AMD EPYC 7742 64-Core Processor", 128, 256, 2, 2048, 1024, 8,
                            ib=[f"mlx5_{i}" for i in range(8)]),
                       a100, all_pairs(a100, dgx_a100_topology, nvlinks=lambda a, b: 12),
                       driver="535.183.01", cuda="12.2"))

    a100p = [gpu(i, "a100-pcie-80", bus, numa=i // 2, cpus=[range(0, 32), range(32, 64)][i // 2])
             for i, bus in enumerate([0x17, 0x31, 0xB1, 0xCA])]
    out.append(profile("4x-a100-pcie-nvlink-pairs", "4x A100 80GB PCIe, NVLink bridges joining GPUs 0-1 and 2-3 (NV12)",
                       host("4x-a100-pcie-nvlink-pairs", "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", 64, 128, 2, 1024, 512, 4),
                       a100p, all_pairs(a100p, numa_topology, nvlinks=lambda a, b: 12 if a.index // 2 == b.index // 2 else 0),
                       driver="550.127.05", cuda="12.4"))

    r4090 = [gpu(i, "rtx4090", bus, cpus=range(0, 48)) for i, bus in enumerate([0x01, 0x41])]
    out.append(profile("2x-rtx4090", "Workstation with 2x GeForce RTX 4090 on PCIe (P2P not supported)",
                       host("2x-rtx4090", "AMD Ryzen Threadripper PRO 5965WX 24-Cores", 24, 48, 1, 256, 128, 2),
                       r4090, all_pairs(r4090, lambda a, b: "PHB", p2p=lambda a, b: "chipset not supported"),
                       driver="550.107.02", cuda="12.4"))

    r3090 = [gpu(i, "rtx3090", bus, cpus=range(0, 64)) for i, bus in enumerate([0x01, 0x21, 0x41, 0x61])]

    def bridged(a, b):
        return a.index // 2 == b.index // 2

    out.append(profile("4x-rtx3090-nvlink-pairs", "4x GeForce RTX 3090, NVLink bridges joining GPUs 0-1 and 2-3 (NV4)",
                       host("4x-rtx3090-nvlink-pairs", "AMD Ryzen Threadripper 3970X 32-Core Processor", 32, 64, 1, 256, 128, 4),
                       r3090, all_pairs(r3090, lambda a, b: "PHB", nvlinks=lambda a, b: 4 if bridged(a, b) else 0,
                                        p2p=lambda a, b: "OK" if bridged(a, b) else "chipset not supported"),
                       driver="550.107.02", cuda="12.4"))

    mixed = [gpu(0, "a100-pcie-80", 0x01, cpus=range(0, 32)),
             gpu(1, "rtx3090", 0x41, cpus=range(0, 32), display_active=True, memory_used_bytes=412 * MIB,
                 processes=(GpuProcess(pid=1873, name="/usr/lib/xorg/Xorg", used_memory_bytes=None),))]
    out.append(profile("mixed-a100-rtx3090", "1x A100 80GB PCIe + 1x GeForce RTX 3090 driving the display",
                       host("mixed-a100-rtx3090", "AMD Ryzen 9 7950X 16-Core Processor", 16, 32, 1, 128, 64, 2),
                       mixed, all_pairs(mixed, lambda a, b: "PHB", p2p=lambda a, b: "GPU not supported"),
                       driver="550.107.02", cuda="12.4"))

    mig = [gpu(0, "a100-sxm-80", 0x07, cpus=range(0, 64), mig_enabled=True, memory_used_bytes=38 * MIB,
               mig_instances=mig_3g40gb_pair("a100-sxm-80-00"))]
    out.append(profile("1x-a100-mig", "1x A100 SXM4 80GB in MIG mode, split into two 3g.40gb instances "
                       "(CUDA sees the instances, not the GPU)",
                       host("1x-a100-mig", "AMD EPYC 7J13 64-Core Processor", 32, 64, 1, 256, 128, 1),
                       mig, driver="535.183.01", cuda="12.2"))

    busy = [gpu(0, "a100-sxm-40", 0x07, cpus=range(0, 32), nvswitch_links=12),
            gpu(1, "a100-sxm-40", 0x0F, cpus=range(0, 32), nvswitch_links=12, memory_used_bytes=30 * GIB,
                utilization_pct=87, clock_event_reasons=(), sm_clock_mhz=1410, temperature_c=64,
                processes=(GpuProcess(pid=4242, name="python train_other.py", used_memory_bytes=30 * GIB - 500 * MIB),))]
    out.append(profile("2x-a100-one-busy", "2x A100 SXM4 40GB (NV12); another user's job holds 30 GiB on GPU 1",
                       host("2x-a100-one-busy", "AMD EPYC 7J13 64-Core Processor", 32, 64, 1, 256, 128, 2),
                       busy, all_pairs(busy, lambda a, b: "PXB", nvlinks=lambda a, b: 12),
                       driver="535.183.01", cuda="12.2"))
    out.append(dgx1())
    out.append(pcie_switch_box())
    return out


def mig_3g40gb_pair(tag: str) -> tuple[MigInstance, ...]:
    """Two 3g.40gb instances of an A100-SXM4-80GB, as `nvidia-smi` lists them (40192 MiB, 19 MiB used)."""
    return tuple(MigInstance(index=i, uuid=f"MIG-{tag}-gi{gi}-0000-000000000000", name="NVIDIA A100-SXM4-80GB MIG 3g.40gb",
                             memory_total_bytes=40192 * MIB, memory_used_bytes=19 * MIB, gpu_instance_id=gi,
                             compute_instance_id=0)
                 for i, gi in enumerate((1, 2)))


# The DGX-1 hybrid cube mesh (nvidia-smi topo -m): NVLinks per pair; every other pair has none.
DGX1_NVLINKS = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
                (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}


def dgx1() -> HardwareProfile:
    cpus = [[*range(0, 20), *range(40, 60)], [*range(20, 40), *range(60, 80)]]
    v100 = [gpu(i, "v100-sxm2-32", bus, numa=i // 4, cpus=cpus[i // 4])
            for i, bus in enumerate([0x06, 0x07, 0x0A, 0x0B, 0x85, 0x86, 0x89, 0x8A])]

    def pcie(a, b):
        if a.numa_node != b.numa_node:
            return "SYS"
        return "PIX" if a.index // 2 == b.index // 2 else "PHB"  # one PLX switch per GPU pair

    def links(a, b):
        return DGX1_NVLINKS.get((a.index, b.index), 0)

    def p2p(a, b):  # PCIe P2P does not cross the sockets' QPI link; NVLinked pairs talk over NVLink
        return "OK" if links(a, b) or a.numa_node == b.numa_node else "IOH topology not supported"

    return profile("8x-v100-dgx1", "DGX-1: 8x V100 SXM2 32GB, NVLink hybrid cube mesh (NV1/NV2, 6 links per GPU), "
                   "two quads on two sockets, one PLX switch per GPU pair",
                   host("8x-v100-dgx1", "Intel(R) Xeon(R) CPU E5-2698 v4 @ 2.20GHz", 40, 80, 2, 512, 256, 8,
                        ib=[f"mlx5_{i}" for i in range(4)]),
                   v100, all_pairs(v100, pcie, nvlinks=links, p2p=p2p), driver="535.183.01", cuda="12.2")


def pcie_switch_box() -> HardwareProfile:
    """Dual-socket 8-GPU server with cascaded PCIe switches: per socket one top switch, two leaf switches
    with two GPUs each. PIX within a leaf switch, PXB between leaves under one top switch, SYS across
    the sockets (where PCIe P2P stops)."""
    cpus = [range(0, 28), range(28, 56)]
    a100 = [gpu(i, "a100-pcie-80", bus, numa=i // 4, cpus=[*cpus[i // 4], *(c + 56 for c in cpus[i // 4])])
            for i, bus in enumerate([0x1B, 0x1C, 0x1F, 0x20, 0x9B, 0x9C, 0x9F, 0xA0])]

    def pcie(a, b):
        if a.numa_node != b.numa_node:
            return "SYS"
        return "PIX" if a.index // 2 == b.index // 2 else "PXB"

    def p2p(a, b):
        return "OK" if a.numa_node == b.numa_node else "IOH topology not supported"

    return profile("8x-a100-pcie-switches", "8x A100 80GB PCIe, no NVLink: two GPUs per PCIe switch (PIX), two switches "
                   "under one top switch per socket (PXB), P2P stops at the socket boundary (SYS)",
                   host("8x-a100-pcie-switches", "Intel(R) Xeon(R) Gold 6348 CPU @ 2.60GHz", 56, 112, 2, 1024, 512, 8),
                   a100, all_pairs(a100, pcie, p2p=p2p), driver="550.127.05", cuda="12.4")


def test_machines() -> list[HardwareProfile]:
    """Odd boxes for decision tests: real situations, but not machines anyone should plan for."""
    out = []
    pending = [gpu(0, "a100-sxm-40", 0x07, cpus=range(0, 64), nvswitch_links=12),
               gpu(1, "a100-sxm-40", 0x0F, cpus=range(0, 64), nvswitch_links=12, mig_pending_enabled=True)]
    out.append(profile("2x-a100-mig-pending", "2x A100 SXM4 40GB (NV12); `nvidia-smi -i 1 -mig 1` was run on GPU 1 "
                       "but the GPU not reset: MIG is off now and turns on at the next reset",
                       host("2x-a100-mig-pending", "AMD EPYC 7J13 64-Core Processor", 32, 64, 1, 256, 128, 2),
                       pending, all_pairs(pending, lambda a, b: "PXB", nvlinks=lambda a, b: 12),
                       driver="535.183.01", cuda="12.2"))
    vm = [gpu(i, "h100-sxm", bus, numa=None, cpus=range(0, 96), nvswitch_links=18)
          for i, bus in enumerate([0x05, 0x06, 0x07, 0x08])]
    out.append(profile("4x-h100-vm-nvlink-no-p2p", "VM with 4x H100 SXM passed through: NVLinks active (NV18) but NVML "
                       "reports P2P not supported (no fabric manager / P2P blocked by the hypervisor); flat virtual PCIe",
                       host("4x-h100-vm-nvlink-no-p2p", "Intel(R) Xeon(R) Platinum 8480+", 48, 96, 1, 900, 450, 4),
                       vm, all_pairs(vm, lambda a, b: "PHB", nvlinks=lambda a, b: 18, p2p=lambda a, b: "not supported"),
                       driver="550.127.05", cuda="12.4"))
    out.append(sick_a100_pair())
    return out


def sick_a100_pair() -> HardwareProfile:
    """GPU 1 of two A100s after a memory failure: a double-bit error (XID 48) earlier in the board's life, a row
    marked for remapping (XID 63) that waits for a reset, a fall off the bus (XID 79), PCIe replays and CRC errors on
    one NVLink. GPU 0 is healthy. What the doctor must FAIL and WARN on, with the reset and reseat fixes."""
    pair = [gpu(i, "a100-sxm-40", bus, cpus=range(0, 64), nvswitch_links=12) for i, bus in enumerate([0x07, 0x0F])]
    pairs = all_pairs(pair, lambda a, b: "PXB", nvlinks=lambda a, b: 12)
    well = healthy(pair[1], pairs)
    links = tuple(NvLinkErrorCounts(c.link, replay=12, crc_flit=57) if c.link == 3 else c for c in well.nvlink_errors)
    sick = replace(well, ecc_corrected_volatile=3, ecc_corrected_aggregate=41, ecc_uncorrected_aggregate=2,
                   remapped_rows_uncorrected=1, row_remap_pending=True, pcie_replays=1543, nvlink_errors=links,
                   xids=(79, 48, 63))
    pair[1] = replace(pair[1], health=sick)
    return profile("2x-a100-sick-gpu", "2x A100 SXM4 40GB (NV12); GPU 1 had a double-bit ECC error: a row remap pending "
                   "a reset, XIDs 79/48/63, PCIe replays and NVLink CRC errors",
                   host("2x-a100-sick-gpu", "AMD EPYC 7J13 64-Core Processor", 32, 64, 1, 256, 128, 2),
                   pair, pairs, driver="535.183.01", cuda="12.2")


def main() -> None:
    targets = [(m, snapshot.MACHINES_DIR) for m in machines()] + [(m, TEST_MACHINES_DIR) for m in test_machines()]
    for machine, directory in targets:
        path = snapshot.save(machine, directory / f"{machine.name}.json")
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    main()
