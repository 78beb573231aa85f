from pathlib import Path

from hf_gpu_train.hardware.host import (
    cpu_model,
    detect_host,
    infiniband_devices,
    numa_nodes,
    nvidia_pci_devices,
    physical_cores,
    ram_total_bytes,
)

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7742 64-Core Processor
physical id\t: 0
core id\t: 0

processor\t: 1
model name\t: AMD EPYC 7742 64-Core Processor
physical id\t: 0
core id\t: 0

processor\t: 2
model name\t: AMD EPYC 7742 64-Core Processor
physical id\t: 1
core id\t: 0
"""


def make_tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "cpuinfo").write_text(CPUINFO)
    (proc / "meminfo").write_text("MemTotal:       263921220 kB\nMemFree: 1 kB\n")
    for n in range(2):
        (sys / f"devices/system/node/node{n}").mkdir(parents=True)
    (sys / "devices/system/node/possible").write_text("0-1")
    for dev, vendor, cls in [("0000:07:00.0", "0x10de", "0x030200"), ("0000:08:00.0", "0x10de", "0x040300"),
                             ("0000:01:00.0", "0x8086", "0x030000"), ("0000:41:00.0", "0x10de", "0x030000")]:
        d = sys / "bus/pci/devices" / dev
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
    (sys / "class/infiniband/mlx5_0").mkdir(parents=True)
    return proc, sys


def test_host_facts_from_proc_and_sys(tmp_path):
    proc, sys = make_tree(tmp_path)
    assert cpu_model(proc) == "AMD EPYC 7742 64-Core Processor"
    assert physical_cores(proc) == 2  # two distinct (physical id, core id) pairs; core 0 has two threads
    assert ram_total_bytes(proc) == 263921220 * 1024
    assert numa_nodes(sys) == 2
    # NVIDIA 3D controller and VGA count; NVIDIA audio function (0x0403) and the Intel GPU do not
    assert nvidia_pci_devices(sys) == 2
    assert infiniband_devices(sys) == ("mlx5_0",)


def test_missing_proc_and_sys_give_unknown_not_crash(tmp_path):
    host = detect_host(proc=tmp_path / "none", sys=tmp_path / "none", shm=tmp_path / "none")
    assert host.cpu_model is None and host.numa_nodes is None and host.nvidia_pci_devices is None
    assert host.shm_total_bytes is None and host.ram_total_bytes is None
    assert host.logical_cores >= 1


def test_this_machine():
    host = detect_host()
    assert host.hostname and host.logical_cores >= 1 and host.ram_total_bytes > 2**30
